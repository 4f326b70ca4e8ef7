"""An independent float64 oracle for dense attention: forward and every gradient, attention sinks included.

Written apart from the library (it shares no helper with `reference_attention` or `masks`): plain numpy, one
(batch row, q head) at a time, the textbook softmax and its backward.

* Logits: q . k * scale, then c * tanh(logits / c) with a soft cap c.
* Visibility (jax.nn's meaning): causal keeps kv position <= q position; a window (left, right) keeps
  q - left <= kv <= q + right; a chunk C keeps q // C == kv // C; then equal nonzero bidirectional ids see each
  other whatever those three say; segment ids keep equal ids on top of all that.  Positions ([T] or per row
  [B, T]) default to 0..T-1 and 0..S-1.
* Sinks: head h's logit s_h joins every row's denominator, sum_j exp(l_j) + exp(s_h), and carries no value, so
  p_sink = exp(s_h) / that sum and d loss / d s_h = -sum over rows of p_sink * rowsum(dO * O).
* A row with no visible key outputs 0 and gets 0 gradient (its mass, with a sink, is all in the sink).
* v's head dim may differ from q's and k's (MLA): the output has v's.
"""

from __future__ import annotations

import numpy as np


def _f64(x):
  return None if x is None else np.asarray(x).astype(np.float64)


def _visible(T, S, q_pos, kv_pos, is_causal, window, q_ids, kv_ids, chunk=None, q_bid=None, kv_bid=None):
  qp, kp = np.asarray(q_pos, np.int64)[:, None], np.asarray(kv_pos, np.int64)[None, :]
  vis = np.ones((T, S), bool)
  if is_causal:
    vis &= kp <= qp
  if window is not None:
    left, right = (window, window) if isinstance(window, int) else window
    vis &= (kp >= qp - left) & (kp <= qp + right)
  if chunk is not None:
    vis &= np.floor_divide(qp, chunk) == np.floor_divide(kp, chunk)
  if q_bid is not None:
    vis |= (q_bid[:, None] != 0) & (q_bid[:, None] == kv_bid[None, :])
  if q_ids is not None:
    vis &= q_ids[:, None] == kv_ids[None, :]
  return vis


def _pair(x):
  if x is None:
    return None, None
  if isinstance(x, tuple):
    return tuple(np.asarray(a) for a in x)
  return np.asarray(x), np.asarray(x)


def _row(x, b):
  """Row b of [B, L] per-row data, or the shared [L] array itself."""
  return x if x.ndim == 1 else x[b]


def dense_oracle(
  q,
  k,
  v,
  *,
  do=None,
  is_causal=False,
  local_window_size=None,
  segment_ids=None,
  q_positions=None,
  kv_positions=None,
  logits_soft_cap=None,
  scale=None,
  sinks=None,
  chunk_size=None,
  bidirectional_ids=None,
):
  """float64 (out, grads): grads (dq, dk, dv) or (dq, dk, dv, dsinks) with sinks, None without `do`."""
  q, k, v, do, sinks = (_f64(x) for x in (q, k, v, do, sinks))
  B, T, N, H = q.shape
  _, S, K, Hv = v.shape
  G = N // K
  scale = H**-0.5 if scale is None else scale
  q_pos = np.arange(T) if q_positions is None else np.asarray(q_positions)
  if kv_positions is None:
    kv_pos = q_pos if q_positions is not None and T == S else np.arange(S)
  else:
    kv_pos = np.asarray(kv_positions)
  q_ids, kv_ids = _pair(segment_ids)
  q_bid, kv_bid = _pair(bidirectional_ids)
  out = np.zeros((B, T, N, Hv))
  dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
  dsinks = np.zeros(N)
  for b in range(B):
    vis = _visible(
      T, S, _row(q_pos, b), _row(kv_pos, b), is_causal, local_window_size,
      None if q_ids is None else q_ids[b], None if kv_ids is None else kv_ids[b], chunk_size,
      None if q_bid is None else q_bid[b], None if kv_bid is None else kv_bid[b],
    )  # fmt: skip
    for h in range(N):
      g = h // G
      qq, kk, vv = q[b, :, h], k[b, :, g], v[b, :, g]
      x = qq @ kk.T * scale  # [T, S]
      if logits_soft_cap is not None:
        tanh = np.tanh(x / logits_soft_cap)
        logits = logits_soft_cap * tanh
      else:
        logits = x
      shift = np.where(vis, logits, -np.inf).max(axis=1)
      if sinks is not None:
        shift = np.maximum(shift, sinks[h])
      shift = np.where(np.isfinite(shift), shift, 0.0)
      e = np.where(vis, np.exp(logits - shift[:, None]), 0.0)
      z = e.sum(axis=1)
      e_sink = np.exp(sinks[h] - shift) if sinks is not None else np.zeros(T)
      z = z + e_sink
      z_safe = np.where(z > 0, z, 1.0)
      p, p_sink = e / z_safe[:, None], e_sink / z_safe
      o = p @ vv
      out[b, :, h] = o
      if do is None:
        continue
      d_o = do[b, :, h]
      dp = d_o @ vv.T
      D = (d_o * o).sum(axis=1)
      ds = p * (dp - D[:, None])
      if logits_soft_cap is not None:
        ds = ds * (1.0 - tanh**2)
      dq[b, :, h] = scale * ds @ kk
      dk[b, :, g] += scale * ds.T @ qq
      dv[b, :, g] += p.T @ d_o
      dsinks[h] -= (p_sink * D).sum()
  if do is None:
    return out, None
  return out, (dq, dk, dv) if sinks is None else (dq, dk, dv, dsinks)

"""An independent float64 oracle for paged attention: forward and gradients.

Written apart from the library: it shares no helper with `paged_attention` or
`paged_reference_attention` (no `dequantize`, no metadata code).  It walks the
ragged batch token by token in plain numpy:

* pages are widened to float64 by numpy itself (ml_dtypes handles float8), and
  scaled here, one branch per scale shape: `()`, `[P, K]`, `[P, page_size, K]`;
* sequence i owns rows cu_q_lens[i] .. cu_q_lens[i + 1] - 1 of q, and its q
  tokens are the last q_len of its kv_len tokens, so row j has position
  kv_len - q_len + j and sees keys t <= position (and t >= position - left with
  local_window_size=(left, right), jax.nn's meaning; an int w is (w, w); the
  right side never admits a key past the token itself, so only `left` matters;
  and with chunk_size C only keys with t // C == position // C);
* with bidirectional_ids (one id per row of q), a row with a nonzero id also sees
  every key of its sequence that is one of the call's new tokens (t >= kv_len -
  q_len, so the row of the key is cu_q_lens[i] + t - (kv_len - q_len)) with the
  same id, after it or outside its window and chunk included;
* a key whose page id is out of range is invisible, as in the op's default mode.

Gradients are the textbook softmax backward per row, with the soft cap's
derivative, accumulated into the page slot each key was read from and taken
with respect to the stored value (d stored = d dequantized * scale).

v's head dim Hv may differ from q and k's H (MLA): the output and dO are
[T, N, Hv].  Attention sinks (`sinks`: one logit s_h per q head) are one more
entry of every row's softmax, with value 0: p_j = exp(s_j) / (sum_k exp(s_k) +
exp(s_h)), p_sink = exp(s_h) / (the same sum).  A row with no visible key has
output 0 and puts all its mass in the sink (p_sink = 1), so it contributes no
gradient anywhere, dsinks included.  With D = dO . out of a row, the backward of
that softmax is ds_j = p_j (dp_j - D) for the keys (the sink's dp is 0) and
d loss / d s_h = -p_sink * D, summed over the rows of head h.
"""

from __future__ import annotations

import numpy as np


def _widen(x) -> np.ndarray:
  return np.asarray(x).astype(np.float64)


def scale_factors(scale, num_pages: int, page_size: int, num_kv_heads: int) -> np.ndarray:
  """[P, page_size, K] float64: the factor every stored value of (page, slot, kv head) is multiplied by."""
  full = np.ones((num_pages, page_size, num_kv_heads))
  if scale is None:
    return full
  s = _widen(scale)
  if s.shape == ():
    return full * s
  if s.shape == (num_pages, num_kv_heads):  # per page and kv head
    return full * s[:, None, :]
  if s.shape == (num_pages, page_size, num_kv_heads):  # per token and kv head
    return full * s
  raise ValueError(f"oracle: unexpected scale shape {s.shape}")


def _window_left(local_window_size):
  """How many tokens before its own a row sees: local_window_size's left side (None: all of them)."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, int):  # jax.nn: w means (w, w)
    return local_window_size
  left, _right = local_window_size  # causal: keys past the token itself are masked whatever `right` says
  return left


def _visible_keys(table_row, kv_len, pos, num_pages, page_size, left, chunk=None, same_span=lambda t: False):
  """(token t, page id, slot) of the keys row at `pos` may read (`left`: the window's left side, or None;
  `chunk`: the attention chunk, or None; `same_span(t)`: key t shares the row's nonzero bidirectional id)."""
  keys = []
  for t in range(kv_len):
    page = int(table_row[t // page_size])
    if not 0 <= page < num_pages:
      continue
    causal = t <= pos
    causal = causal and (left is None or t >= pos - left)
    causal = causal and (chunk is None or t // chunk == pos // chunk)
    if causal or same_span(t):
      keys.append((t, page, t % page_size))
  return keys


def paged_oracle(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  *,
  k_scale=None,
  v_scale=None,
  do=None,
  local_window_size=None,
  logits_soft_cap=None,
  scale=None,
  sinks=None,
  chunk_size=None,
  bidirectional_ids=None,
):
  """float64 (out [T, N, Hv], (dq, dk_pages, dv_pages)), with dsinks [N] appended to the gradients when `sinks`
  is given; gradients only when `do` is given (else None)."""
  qf = _widen(q)
  T, N, H = qf.shape
  P, ps, K, _ = k_pages.shape
  Hv = v_pages.shape[3]
  sink = None if sinks is None else _widen(sinks)
  ksf = scale_factors(k_scale, P, ps, K)
  vsf = scale_factors(v_scale, P, ps, K)
  kp = _widen(k_pages) * ksf[..., None]
  vp = _widen(v_pages) * vsf[..., None]
  table, cu, kv_lens = np.asarray(page_indices), np.asarray(cu_q_lens), np.asarray(kv_lens)
  n = int(np.asarray(num_seqs)[0])
  groups = N // K
  scale = H**-0.5 if scale is None else scale
  dof = None if do is None else _widen(do)
  left = _window_left(local_window_size)
  out = np.zeros((T, N, Hv))
  dq, dkd, dvd = np.zeros((T, N, H)), np.zeros((P, ps, K, H)), np.zeros((P, ps, K, Hv))
  dsinks = np.zeros(N)
  bid = None if bidirectional_ids is None else np.asarray(bidirectional_ids)
  for i in range(n):
    q_len, kv_len = int(cu[i + 1] - cu[i]), int(kv_lens[i])
    for j in range(q_len):
      row, pos = int(cu[i]) + j, kv_len - q_len + j
      first_new = kv_len - q_len

      def same_span(t, row=row, i=i, first_new=first_new):
        if bid is None or bid[row] == 0 or t < first_new:
          return False
        return bid[int(cu[i]) + t - first_new] == bid[row]

      keys = _visible_keys(table[i], kv_len, pos, P, ps, left, chunk_size, same_span)
      if not keys:
        continue  # a row with no visible key: output 0, gradient 0
      pages = np.array([p for _, p, _ in keys])
      slots = np.array([s for _, _, s in keys])
      for h in range(N):
        g = h // groups
        kk, vv = kp[pages, slots, g], vp[pages, slots, g]  # [L, H], [L, Hv]
        x = kk @ qf[row, h] * scale
        if logits_soft_cap is not None:
          tanh = np.tanh(x / logits_soft_cap)
          s = logits_soft_cap * tanh
        else:
          s = x
        m = s.max() if sink is None else max(s.max(), sink[h])
        p = np.exp(s - m)
        total = p.sum() if sink is None else p.sum() + np.exp(sink[h] - m)
        p /= total
        out[row, h] = p @ vv
        if dof is None:
          continue
        d_o = dof[row, h]
        dp = vv @ d_o
        big_d = d_o @ out[row, h]  # = sum_j p_j dp_j: the sink's value, hence its dp, is 0
        ds = p * (dp - big_d)
        if sink is not None:
          dsinks[h] -= np.exp(sink[h] - m) / total * big_d
        if logits_soft_cap is not None:
          ds = ds * (1.0 - tanh**2)
        dq[row, h] = scale * ds @ kk
        np.add.at(dkd, (pages, slots, g), scale * ds[:, None] * qf[row, h][None, :])
        np.add.at(dvd, (pages, slots, g), p[:, None] * d_o[None, :])
  if dof is None:
    return out, None
  # Gradients with respect to the stored values: d stored = d dequantized * scale.
  grads = (dq, dkd * ksf[..., None], dvd * vsf[..., None])
  return out, grads if sink is None else (*grads, dsinks)

"""Reference attention: the oracle every backend and test compares against.

Plain f32 einsum + softmax at highest precision, the whole [T, S] score matrix
at once, no custom_vjp: gradients come from autodiff.  Mask semantics come from
`masks.visible`, the same function the block kernels use on partial tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src import dropout as dropout_lib
from flax_ringattn._src import masks, validation


def reference_attention(
  q,
  k,
  v,
  *,
  is_causal: bool = False,
  segment_ids=None,
  local_window_size=None,
  logits_soft_cap: float | None = None,
  scale: float | None = None,
  q_positions=None,
  kv_positions=None,
  chunk_size: int | None = None,
  bidirectional_ids=None,
  dropout_rate: float = 0.0,
  dropout_rng=None,
  broadcast_dropout: bool = True,
  sinks=None,
  mask=None,
):
  """Dense attention with the features of `ring_attention`, on one device.

  Args:
    q: [B, T, N, H]; k: [B, S, K, H]; v: [B, S, K, Hv] with N % K == 0 (Hv may
      differ from H, as in MLA).
    is_causal, segment_ids, local_window_size, logits_soft_cap, scale: as in
      `ring_attention` (jax.nn.dot_product_attention semantics).
    q_positions, kv_positions: optional [B, T] / [B, S] (or [T] / [S]) token
      positions the mask is evaluated on (default: 0..T-1 and 0..S-1); q
      alone serves self attention.  Pass `zigzag_positions(...)` to check a
      load-balanced ring directly.
    chunk_size, bidirectional_ids, mask: as in `ring_attention` (`mask`: a `Mask`).
    dropout_rate, dropout_rng, broadcast_dropout: attention dropout with the
      same keep mask as `ring_attention` (a hash of the key and the global
      batch, head, q and kv positions), applied to the normalised
      probabilities; autodiff then uses that same mask in the backward.
    sinks: optional [N] float attention-sink logits, one per q head: each joins
      its head's softmax denominator (exp(sinks[h]) beside the row's scores)
      and carries no value.

  Returns:
    [B, T, N, Hv] in q.dtype.  Rows with no visible key are 0 (and get 0
    gradient), never NaN; with sinks their mass is all in the sink.  Empty
    inputs (B, T, N or S = 0) give zeros of that shape, as in `ring_attention`.
  """
  B, T, S, N, K, H = validation.check_qkv(q, k, v)
  scale = validation.check_scale(scale, H)
  cap = validation.check_soft_cap(logits_soft_cap)
  spec, q_tok, kv_tok = masks.build(
    B,
    T,
    S,
    mask=mask,
    is_causal=is_causal,
    local_window_size=local_window_size,
    chunk_size=chunk_size,
    segment_ids=segment_ids,
    bidirectional_ids=bidirectional_ids,
    q_positions=q_positions,
    kv_positions=kv_positions,
  )
  q_tok = masks.with_positions(q_tok, jnp.arange(T, dtype=jnp.int32))
  kv_tok = masks.with_positions(kv_tok, jnp.arange(S, dtype=jnp.int32))
  sinks = validation.check_sinks(sinks, N)
  rate = dropout_lib.check_rate(dropout_rate)
  validation.check_bool("broadcast_dropout", broadcast_dropout)
  drop = dropout_lib.seed_operand(dropout_rng) if rate else None
  if validation.is_empty(q, k):
    return jnp.zeros((B, T, N, v.shape[3]), q.dtype)

  G = N // K
  qf = q.astype(jnp.float32).reshape(B, T, K, G, H)
  kf = k.astype(jnp.float32)
  vf = v.astype(jnp.float32)
  hi = jax.lax.Precision.HIGHEST
  s = jnp.einsum("btkgh,bskh->bkgts", qf, kf, precision=hi) * scale
  if cap is not None:
    s = cap * jnp.tanh(s / cap)
  vis = masks.visible(spec, q_tok, kv_tok)[:, None, None]  # [B|1, 1, 1, T, S]
  s = jnp.where(vis, s, -jnp.inf)
  m = jax.lax.stop_gradient(jnp.max(s, axis=-1, keepdims=True))
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, K, G, 1, 1)
    m = jnp.maximum(m, jax.lax.stop_gradient(sink))
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  p = jnp.exp(s - m)
  l = jnp.sum(p, axis=-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sink - m)  # the sink's share of the denominator; it carries no value
  p = p / jnp.where(l == 0.0, 1.0, l)
  if rate:
    keep = dropout_lib.keep_grouped(drop, q_tok.pos, kv_tok.pos, rate=rate, broadcast=broadcast_dropout, B=B, K=K, G=G)
    p = jnp.where(keep, p / (1.0 - rate), 0.0)
  o = jnp.einsum("bkgts,bskh->btkgh", p, vf, precision=hi)
  return o.reshape(B, T, N, v.shape[3]).astype(q.dtype)

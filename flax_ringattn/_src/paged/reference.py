"""Jittable paged reference: gather every sequence's pages, dense masked attention.

The oracle for the paged op (tests and benchmarks only).  Memory is
O(T * pages_per_seq * page_size), fine at test sizes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src import ragged, validation
from flax_ringattn._src.paged import common


def paged_reference_attention(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  *,
  local_window_size=None,
  logits_soft_cap=None,
  scale=None,
  k_scale=None,
  v_scale=None,
  sliding_window=None,
  sinks=None,
  chunk_size=None,
  bidirectional_ids=None,
):
  """Same arguments and result as `paged_attention`; rows past the batch are 0."""
  k_scale, v_scale = common.normalize_scales(k_scale, v_scale)
  T, N, H, P, ps, K, S, pps = common.check_paged_inputs(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale
  )
  scale = validation.check_scale(scale, H)
  cap = validation.check_soft_cap(logits_soft_cap)
  window = common.paged_window(local_window_size, sliding_window)
  chunk_size = validation.check_chunk_size(chunk_size)
  span_ids = common.check_bidirectional_ids(bidirectional_ids, T)
  k_pages, v_pages = common.kv_apart(k_pages, v_pages)
  k_pages, v_pages = common.unmerge_pages(k_pages, K), common.unmerge_pages(v_pages, K)
  G, L, Hv = N // K, pps * ps, v_pages.shape[3]
  sinks = validation.check_sinks(sinks, N)

  seq, start, valid = ragged.token_owner(cu_q_lens, num_seqs, T)
  lens = ragged.seq_q_lens(cu_q_lens, num_seqs)
  pos = kv_lens[seq] - lens[seq] + (jnp.arange(T) - start)  # [T]

  page_ok = (page_indices >= 0) & (page_indices < P)  # [S, pps]
  ids = jnp.clip(page_indices, 0, P - 1)
  kv_pos = jnp.arange(L)
  kv_ok = jnp.repeat(page_ok, ps, axis=1) & (kv_pos[None] < kv_lens[:, None])  # [S, L]
  # Slots past num_seqs are dead: padding rows map to one, and its garbage pages must not reach them (0 * NaN).
  kv_ok = kv_ok & (jnp.arange(S) < num_seqs[0])[:, None]

  def gather(pages, sc):
    x = ragged.dequantize(pages[ids], sc, ids).reshape(S, L, K, pages.shape[3])
    return jnp.where(kv_ok[..., None, None], x, 0.0)  # pages not owned never leak (NaN-safe)

  k_seq, v_seq = gather(k_pages, k_scale), gather(v_pages, v_scale)
  hi = jax.lax.Precision.HIGHEST
  qf = q.astype(jnp.float32).reshape(T, K, G, H)
  s = jnp.einsum("tkgh,tlkh->tkgl", qf, k_seq[seq], precision=hi) * scale
  if cap is not None:
    s = cap * jnp.tanh(s / cap)
  mask = kv_ok[seq] & (kv_pos[None] <= pos[:, None]) & valid[:, None]
  if window is not None:
    mask = mask & (kv_pos[None] >= pos[:, None] - window[0])
  if chunk_size is not None:
    mask = mask & (pos[:, None] // chunk_size == kv_pos[None] // chunk_size)
  if span_ids is not None and T:
    # A key that is one of its sequence's new tokens carries that row's id; a cached one (earlier calls) 0.
    cu = ragged.effective_cu(cu_q_lens, num_seqs)
    new_lo = kv_lens - lens  # [S] position of each sequence's first new token
    row = jnp.clip(cu[:-1, None] + kv_pos[None] - new_lo[:, None], 0, max(T - 1, 0))
    kv_ids = jnp.where((kv_pos[None] >= new_lo[:, None]) & (kv_pos[None] < kv_lens[:, None]), span_ids[row], 0)
    span = (span_ids[:, None] != 0) & (span_ids[:, None] == kv_ids[seq])
    mask = mask | (span & kv_ok[seq] & valid[:, None])
  s = jnp.where(mask[:, None, None], s, -jnp.inf)
  m = jax.lax.stop_gradient(s.max(-1, keepdims=True))
  if sinks is not None:
    sink = sinks.astype(jnp.float32).reshape(1, K, G, 1)
    m = jnp.maximum(m, jax.lax.stop_gradient(sink))
  m = jnp.where(jnp.isneginf(m), 0.0, m)
  p = jnp.exp(s - m)
  l = p.sum(-1, keepdims=True)
  if sinks is not None:
    l = l + jnp.exp(sink - m)  # the sink joins the denominator and carries no value
  p = p / jnp.where(l == 0.0, 1.0, l)
  o = jnp.einsum("tkgl,tlkh->tkgh", p, v_seq[seq], precision=hi)
  # Rows past the batch have no visible key; with sinks their mass is in the sink, their output 0 either way.
  return o.reshape(T, N, Hv).astype(q.dtype)

"""XLA paged attention over a ragged batch: forward and backward.

Loop nest (both passes): a `fori_loop` over the chunks of the schedule
(`_src/ragged.py`: at most `block_q` rows of one sequence), and inside it a
`while_loop` over the blocks of `pages_per_block` pages that the chunk can see
(its causal and sliding-window range only, jumping over blocks with no page
of the sequence there).  Each step gathers one block of
pages of every kv head (page-major layout: one contiguous copy per page), so
the q heads of a GQA group share the K/V reads and nothing is repeated.

Bidirectional spans (`bidirectional_ids` [T], one id per row of q): a key that is one of its sequence's new
tokens in this call carries that row's id, any other key (cached by an earlier call) id 0.  A chunk with a nonzero
id also walks the blocks of its sequence's new tokens after its own rows (and before its window or chunk): equal
ids see each other there whatever causal, window and chunk say (`masks.pair_visible`).

Isolation: a step reads only the pages listed in the sequence's row of
page_indices; slots past kv_lens or with an out-of-range page id are zeroed
before use and masked, so NaN/garbage in pages not owned by the sequence can
never reach its output (or, in the backward, receive gradient).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from flax_ringattn._src import masks, ragged, vma

F32 = jnp.float32


def _chunk_rows(ch, c, lens, kv_lens, block_q):
  """Per-row positions and validity of chunk c."""
  seq, row0, n = ch.seq[c], ch.row0[c], ch.num_rows[c]
  r = jnp.arange(block_q)
  first = kv_lens[seq] - lens[seq] + row0
  return seq, first + r, r < n, first, first + jnp.maximum(n, 1) - 1


def _kv_block_range(first_pos, last_pos, spec, block_tokens, max_blocks, span=None):
  """[lo, hi): the kv blocks a chunk of rows at positions first_pos .. last_pos can see; `span`: (whether a row
  of the chunk has a nonzero bidirectional id, the sequence's new tokens' positions [new_lo, new_hi)), which it
  may then see too, after its own rows or before its window or chunk."""
  hi = jnp.clip(last_pos // block_tokens + 1, 0, max_blocks)
  lo = masks.first_visible_position(spec.mask, first_pos) // block_tokens
  if span is not None:
    has, new_lo, new_hi = span
    lo = jnp.where(has, jnp.minimum(lo, jnp.maximum(new_lo, 0) // block_tokens), lo)
    hi = jnp.where(has, jnp.maximum(hi, jnp.clip((new_hi - 1) // block_tokens + 1, 0, max_blocks)), hi)
  return jnp.minimum(lo, hi), hi


class _Spans:
  """The bidirectional ids of one call as the chunks read them: the q rows' own, and a key's (its new token's
  row's id when it is one of the call's new tokens of its sequence, else 0)."""

  def __init__(self, ids, cu_q_lens, num_seqs, lens, kv_lens, pad: int):
    self.ids = jnp.pad(jnp.asarray(ids, jnp.int32), (0, pad))  # as q: a chunk's rows never run off the end
    self.cu, self.lens, self.kv_lens, self.T = ragged.effective_cu(cu_q_lens, num_seqs), lens, kv_lens, ids.shape[0]

  def rows(self, start, bq: int):
    return jax.lax.dynamic_slice_in_dim(self.ids, start, bq)

  def new_range(self, seq):
    """[new_lo, new_hi): the positions of sequence seq's new tokens."""
    return self.kv_lens[seq] - self.lens[seq], self.kv_lens[seq]

  def keys(self, seq, kv_pos):
    new_lo, new_hi = self.new_range(seq)
    row = jnp.clip(self.cu[seq] + kv_pos - new_lo, 0, self.T - 1)
    return jnp.where((kv_pos >= new_lo) & (kv_pos < new_hi), self.ids[row], 0)

  def block_range(self, seq, q_ids, row_ok, first, last, spec, block_tokens, max_blocks):
    span = (jnp.any((q_ids != 0) & row_ok), *self.new_range(seq))
    return _kv_block_range(first, last, spec, block_tokens, max_blocks, span)


def _next_blocks(row_ids, pb: int, num_pages: int):
  """[max_blocks + 1]: the first kv block >= b that holds a page of the sequence (max_blocks: none).  The kv loops
  jump over blocks with no page there, e.g. the other devices' pages of a cache spread over a sequence axis
  (`owned_page_ids` makes them -1): their compute would be masked anyway."""
  has = jnp.any(((row_ids >= 0) & (row_ids < num_pages)).reshape(-1, pb), axis=1)
  blocks = jnp.where(has, jnp.arange(has.shape[0]), has.shape[0])
  return jnp.append(jax.lax.cummin(blocks, reverse=True), has.shape[0])


def _load_block(k_pages, v_pages, k_scale, v_scale, row_ids, kb, spec, page_size, kv_len_s, num_pages):
  """Gathers K and V block kb of one sequence.

  Returns (k, v) [L, K, H] float32 zeroed where invalid, valid [L], kv_pos [L],
  page ids [pb] and their in-range mask [pb].
  """
  pb = spec.block_sizes.block_kv // page_size
  ids = jax.lax.dynamic_slice_in_dim(row_ids, kb * pb, pb)
  ok = (ids >= 0) & (ids < num_pages)
  safe = jnp.clip(ids, 0, num_pages - 1)
  L = pb * page_size
  kv_pos = kb * L + jnp.arange(L)
  valid = jnp.repeat(ok, page_size) & (kv_pos < kv_len_s)

  def gather(pages, scale):
    x = ragged.dequantize(pages[safe], scale, safe)  # [pb, page_size, K, H]
    return jnp.where(valid[:, None, None], x.reshape(L, *x.shape[2:]), 0.0)

  return gather(k_pages, k_scale), gather(v_pages, v_scale), valid, kv_pos, ids, ok


def _scores(q_c, k_blk, spec, pos, row_ok, kv_pos, kv_ok, q_ids=None, kv_ids=None):
  """[K, G, bq, L] scaled, capped, masked scores (and tanh for the cap's gradient); q_ids [bq] / kv_ids [L]: the
  bidirectional ids of the rows and keys, or None."""
  s = jnp.einsum("qkgh,lkh->kgql", q_c, k_blk, preferred_element_type=F32) * spec.scale
  t = None
  if spec.logits_soft_cap is not None:
    t = jnp.tanh(s / spec.logits_soft_cap)
    s = spec.logits_soft_cap * t
  ids = (None, None) if q_ids is None else (q_ids[:, None], kv_ids[None])
  mask = kv_ok[None] & row_ok[:, None] & masks.pair_visible(spec.mask, pos[:, None], kv_pos[None], None, None, *ids)
  return jnp.where(mask, s, -jnp.inf), t


def _spans(ids, cu_q_lens, num_seqs, lens, kv_lens, pad: int):
  return None if ids is None else _Spans(ids, cu_q_lens, num_seqs, lens, kv_lens, pad)


def _chunk_range(spans, ch, c, bq, seq, row_ok, first, last, spec, block_tokens, max_blocks):
  """(the chunk's rows' bidirectional ids or None, its kv block range [lo, hi))."""
  if spans is None:
    return None, _kv_block_range(first, last, spec, block_tokens, max_blocks)
  q_ids = spans.rows(ch.q_start[c], bq)
  return q_ids, spans.block_range(seq, q_ids, row_ok, first, last, spec, block_tokens, max_blocks)


def _key_ids(spans, seq, kv_pos):
  return None if spans is None else spans.keys(seq, kv_pos)


def _passes(spec, lens):
  """(rows per chunk, sequences) of each pass over the batch.

  Sequences with one new token (decode) get a pass of one-row chunks, so a
  decode never pays for `block_q` rows; the rest (prefill, chunked prefill,
  speculative verification) go in chunks of `block_q` rows.  Both passes have
  static shapes: the batch mix still never recompiles.
  """
  S = lens.shape[0]
  if spec.block_sizes.block_q == 1:
    return [(1, None, None)]
  return [(spec.block_sizes.block_q, lens > 1, None), (1, lens == 1, S)]


def _padded_page_table(page_indices, pb):
  """Pads pages_per_seq to a multiple of pages_per_block with -1 (invalid) pages."""
  pps = page_indices.shape[1]
  extra = -pps % pb
  if extra:
    page_indices = jnp.pad(page_indices, ((0, 0), (0, extra)), constant_values=-1)
  return page_indices


def paged_fwd(
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, bidirectional_ids=None, *, spec
):
  """Returns (out [T, N, Hv] in q.dtype, lse [T, N] float32; -inf for rows not in the batch)."""
  T, N, H = q.shape
  P, ps, K, _ = k_pages.shape
  Hv = v_pages.shape[3]
  G, pad, pb = N // K, spec.block_sizes.block_q, spec.block_sizes.block_kv // ps
  table = _padded_page_table(page_indices, pb)
  block_tokens = pb * ps
  max_blocks = table.shape[1] // pb
  lens = ragged.seq_q_lens(cu_q_lens, num_seqs)
  # block_q rows of padding so a chunk's window never runs off the end of q.
  q_pad = jnp.pad(q, ((0, pad), (0, 0), (0, 0))).reshape(T + pad, K, G, H)
  spans = _spans(bidirectional_ids, cu_q_lens, num_seqs, lens, kv_lens, pad)

  def chunk(c, carry, ch, bq):
    out, lse = carry
    seq, pos, row_ok, first, last = _chunk_rows(ch, c, lens, kv_lens, bq)
    q_c = jax.lax.dynamic_slice_in_dim(q_pad, ch.q_start[c], bq)
    q_ids, (lo, hi) = _chunk_range(spans, ch, c, bq, seq, row_ok, first, last, spec, block_tokens, max_blocks)
    nxt = _next_blocks(table[seq], pb, P)

    def kv_step(state):
      kb, m, l, acc = state
      k_blk, v_blk, kv_ok, kv_pos, _, _ = _load_block(
        k_pages, v_pages, k_scale, v_scale, table[seq], kb, spec, ps, kv_lens[seq], P
      )
      s, _ = _scores(q_c, k_blk, spec, pos, row_ok, kv_pos, kv_ok, q_ids, _key_ids(spans, seq, kv_pos))
      m_new = jnp.maximum(m, s.max(-1))
      m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe[..., None])
      acc = alpha[..., None] * acc + jnp.einsum("kgql,lkh->kgqh", p, v_blk, preferred_element_type=F32)
      return nxt[kb + 1], m_new, alpha * l + p.sum(-1), acc

    init = (lo, jnp.full((K, G, bq), -jnp.inf, F32), jnp.zeros((K, G, bq), F32), jnp.zeros((K, G, bq, Hv), F32))
    init = (nxt[lo], *(vma.like(x, q, k_pages, v_pages) for x in init[1:]))
    _, m, l, acc = jax.lax.while_loop(lambda st: st[0] < hi, kv_step, init)
    empty = l == 0.0
    o = (acc / jnp.where(empty, 1.0, l)[..., None]).transpose(2, 0, 1, 3).reshape(bq, N, Hv)
    row_lse = jnp.where(empty, -jnp.inf, m + jnp.log(jnp.where(empty, 1.0, l))).transpose(2, 0, 1).reshape(bq, N)
    start = ch.q_start[c]
    o = jnp.where(row_ok[:, None, None], o, jax.lax.dynamic_slice_in_dim(out, start, bq))
    row_lse = jnp.where(row_ok[:, None], row_lse, jax.lax.dynamic_slice_in_dim(lse, start, bq))
    return jax.lax.dynamic_update_slice_in_dim(out, o, start, 0), jax.lax.dynamic_update_slice_in_dim(
      lse, row_lse, start, 0
    )

  # Pages sharded over a sequence axis (context parallelism) make every partial vary over it.
  carry = (jnp.zeros((T + pad, N, Hv), F32), jnp.full((T + pad, N), -jnp.inf, F32))
  carry = tuple(vma.like(x, q, k_pages, v_pages) for x in carry)
  for bq, select, max_chunks in _passes(spec, lens):
    ch = ragged.chunk_schedule(cu_q_lens, num_seqs, T, bq, select, max_chunks)
    carry = jax.lax.fori_loop(0, ch.count, functools.partial(chunk, ch=ch, bq=bq), carry)
  out, lse = carry
  return out[:T].astype(q.dtype), lse[:T]


def paged_bwd(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  k_scale,
  v_scale,
  lse,
  do,
  delta,
  *,
  spec,
  bidirectional_ids=None,
):
  """(dq [T, N, H], dk_pages [P, page_size, K, H], dv_pages [P, page_size, K, Hv]) in float32, given the final lse [T, N] and
  delta = rowsum(dO * O) [T, N] (the flash contract of `_src/flash.py`).

  Gradients reach only the page slots a sequence reads (scatter-added, so
  shared prefix pages collect the gradient of every sequence that reads them);
  for scaled (quantized) pages they are with respect to the stored values.
  """
  T, N, H = q.shape
  P, ps, K, _ = k_pages.shape
  G, pad_rows, pb = N // K, spec.block_sizes.block_q, spec.block_sizes.block_kv // ps
  table = _padded_page_table(page_indices, pb)
  block_tokens = pb * ps
  max_blocks = table.shape[1] // pb
  lens = ragged.seq_q_lens(cu_q_lens, num_seqs)
  pad = lambda x: jnp.pad(x, ((0, pad_rows),) + ((0, 0),) * (x.ndim - 1))
  q_pad = pad(q).reshape(T + pad_rows, K, G, H)
  do_pad = pad(do).reshape(T + pad_rows, K, G, v_pages.shape[3])
  lse_pad = pad(lse).reshape(T + pad_rows, K, G)
  delta_pad = pad(delta).reshape(T + pad_rows, K, G)
  spans = _spans(bidirectional_ids, cu_q_lens, num_seqs, lens, kv_lens, pad_rows)

  def page_grad_scale(scale, ids):
    # d(stored) = d(dequantized) * scale
    if scale is None:
      return 1.0
    s = scale.astype(F32)
    if s.ndim == 0:
      return s
    s = s[jnp.clip(ids, 0, P - 1)]
    return s[:, None, :, None] if s.ndim == 2 else s[..., None]

  def chunk(c, carry, ch, bq):
    dq, dk_pages, dv_pages = carry
    seq, pos, row_ok, first, last = _chunk_rows(ch, c, lens, kv_lens, bq)
    start = ch.q_start[c]
    q_c = jax.lax.dynamic_slice_in_dim(q_pad, start, bq)
    do_c = jax.lax.dynamic_slice_in_dim(do_pad, start, bq).astype(F32)
    lse_c = jax.lax.dynamic_slice_in_dim(lse_pad, start, bq).transpose(1, 2, 0)  # [K, G, bq]
    delta_c = jax.lax.dynamic_slice_in_dim(delta_pad, start, bq).transpose(1, 2, 0)
    lse_c = jnp.where(jnp.isneginf(lse_c), 0.0, lse_c)
    q_ids, (lo, hi) = _chunk_range(spans, ch, c, bq, seq, row_ok, first, last, spec, block_tokens, max_blocks)
    nxt = _next_blocks(table[seq], pb, P)

    def kv_step(state):
      kb, dq_c, dk_pages, dv_pages = state
      k_blk, v_blk, kv_ok, kv_pos, ids, page_ok = _load_block(
        k_pages, v_pages, k_scale, v_scale, table[seq], kb, spec, ps, kv_lens[seq], P
      )
      s, t = _scores(q_c, k_blk, spec, pos, row_ok, kv_pos, kv_ok, q_ids, _key_ids(spans, seq, kv_pos))
      p = jnp.exp(s - lse_c[..., None])  # [K, G, bq, L]
      dv_blk = jnp.einsum("kgql,qkgh->lkh", p, do_c)
      dp = jnp.einsum("qkgh,lkh->kgql", do_c, v_blk)
      ds = p * (dp - delta_c[..., None])
      if t is not None:
        ds = ds * (1.0 - t * t)
      ds = ds * spec.scale
      dq_c = dq_c + jnp.einsum("kgql,lkh->qkgh", ds, k_blk)
      dk_blk = jnp.einsum("kgql,qkgh->lkh", ds, q_c.astype(F32))
      # Scatter-add into the pages read; invalid page ids go nowhere (mode="drop").
      target = jnp.where(page_ok, ids, P)
      keep = kv_ok[:, None, None]
      dk_pages = dk_pages.at[target].add(
        jnp.where(keep, dk_blk, 0.0).reshape(pb, ps, K, H) * page_grad_scale(k_scale, ids), mode="drop"
      )
      dv_pages = dv_pages.at[target].add(
        jnp.where(keep, dv_blk, 0.0).reshape(pb, ps, *dv_blk.shape[1:]) * page_grad_scale(v_scale, ids), mode="drop"
      )
      return nxt[kb + 1], dq_c, dk_pages, dv_pages

    init = (nxt[lo], vma.like(jnp.zeros((bq, K, G, H), F32), q, k_pages, v_pages, do), dk_pages, dv_pages)
    _, dq_c, dk_pages, dv_pages = jax.lax.while_loop(lambda st: st[0] < hi, kv_step, init)
    dq_c = jnp.where(row_ok[:, None, None, None], dq_c, 0.0)
    window = jax.lax.dynamic_slice_in_dim(dq, start, bq)
    dq = jax.lax.dynamic_update_slice_in_dim(dq, window + dq_c, start, 0)
    return dq, dk_pages, dv_pages

  carry = (jnp.zeros((T + pad_rows, K, G, H), F32), jnp.zeros(k_pages.shape, F32), jnp.zeros(v_pages.shape, F32))
  carry = tuple(vma.like(x, q, k_pages, v_pages, do) for x in carry)
  for bq, select, max_chunks in _passes(spec, lens):
    ch = ragged.chunk_schedule(cu_q_lens, num_seqs, T, bq, select, max_chunks)
    carry = jax.lax.fori_loop(0, ch.count, functools.partial(chunk, ch=ch, bq=bq), carry)
  dq, dk, dv = carry
  return dq[:T].reshape(T, N, H), dk, dv

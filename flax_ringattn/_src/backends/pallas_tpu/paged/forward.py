"""Forward paged kernel, and its variant that first writes the new tokens' K/V into their pages."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu import tiling
from flax_ringattn._src.backends.pallas_tpu.paged import plans as pp
from flax_ringattn._src.backends.pallas_tpu.paged import walk as w


def _fwd_kernel(cu_ref, kv_lens_ref, table_ref, sched_ref, q_ref, k_hbm, v_hbm, *rest, d: pp.PagedDims, spec):
  scales_hbm, rest = w.split_refs(d, rest)
  (q_ids, kv_ids_hbm), rest = w.split_spans(d, rest)
  new_refs = ()
  if d.write:
    new_k, new_v, *rest = rest
    new_scales, rest = w.split_refs(d, rest)
    new_refs = (new_k, new_v, new_scales)
  o_ref, lse_ref, *rest = rest
  if d.write:
    # The page buffers are aliased to these outputs: read and write them there.
    k_hbm, v_hbm, *rest = rest
    scales_hbm, rest = w.split_refs(d, rest)
  k_buf, v_buf, scale_bufs, kv_ids_buf, keys_sc, rest = w.split_scratch(d, rest)
  q_sc, m_sc, l_sc, acc_sc, sem, tokens_sc = rest
  r = w.Refs(
    cu_ref, kv_lens_ref, table_ref, sched_ref, k_hbm, v_hbm, scales_hbm, k_buf, v_buf, scale_bufs, sem, tokens_sc
  )
  r = dataclasses.replace(r, q_ids=q_ids, kv_ids_hbm=kv_ids_hbm, kv_ids_buf=kv_ids_buf, keys_sc=keys_sc)
  G, q_lo = d.G, pl.program_id(0) * d.bq
  for k in range(d.K):  # fold each head group once per q block, not once per kv block
    # f32 before the fold: a bf16 [bq, G, H] -> [bq * G, H] reshape needs G even (two rows a 32-bit word).
    q_sc[k] = w.fold(q_ref[:, k * G : (k + 1) * G, :].astype(c.F32), G)  # [bq * G, H]
  m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, c.F32)
  l_sc[...] = jnp.zeros(l_sc.shape, c.F32)
  acc_sc[...] = jnp.zeros(acc_sc.shape, c.F32)

  def update(s, b, slot, g, keys, row0, rows, nk):
    """Online softmax of the first nk keys of kv block b over the folded rows [row0, row0 + rows)."""
    q_ids, kv_ids = w.span_ids(d, r, s, b, slot, g)
    ids = (q_ids, None if kv_ids is None else kv_ids[:, :nk])
    vis = w.mask(d, spec, q_lo, g.start, g.end, g.first_pos, b, keys[:, :nk], ids, row0=row0, rows=rows, keys=nk)
    at = pl.ds(row0, rows)
    whole = nk == d.block_tokens
    for k in range(d.K):
      kk, _ = w.load_head(d, k_buf, scale_bufs[0], slot, k, keys=None if whole else nk)
      vv, _ = w.load_head(d, v_buf, scale_bufs[1], slot, k, keys=None if whole else nk)
      s_ = w.dot(q_sc[k, at, :], kk, ((1,), (1,)), d.q_dtype) * spec.scale
      if spec.logits_soft_cap is not None:
        s_ = spec.logits_soft_cap * jnp.tanh(s_ / spec.logits_soft_cap)
      s_ = jnp.where(vis, s_, -jnp.inf)
      m_prev, l_prev = m_sc[k, at, :][:, :1], l_sc[k, at, :][:, :1]
      m_new = jnp.maximum(m_prev, s_.max(axis=-1, keepdims=True))
      m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows that see nothing yet: exp(-inf) = 0, not NaN
      alpha = jnp.exp(m_prev - m_safe)
      p = jnp.exp(s_ - m_safe)
      l_sc[k, at, :] = jnp.broadcast_to(alpha * l_prev + p.sum(axis=-1, keepdims=True), (rows, c.LANES))
      m_sc[k, at, :] = jnp.broadcast_to(m_new, (rows, c.LANES))
      acc_sc[k, at, :] = alpha * acc_sc[k, at, :] + w.dot(p, vv, ((1,), (0,)), d.q_dtype)  # [rows, Hv]

  def on_keys(s, b, slot, g, keys, nk):
    if d.window_rows is None:
      update(s, b, slot, g, keys, 0, d.bq * G, nk)
      return
    # A sequence with few rows here (a decode token: G rows) is computed on its window alone.
    narrow, row0 = w.row_window(d, g, q_lo)
    pl.when(narrow)(lambda: update(s, b, slot, g, keys, row0, d.window_rows, nk))
    pl.when(~narrow)(lambda: update(s, b, slot, g, keys, 0, d.bq * G, nk))

  levels = w.key_levels(d)

  def visit(s, b, slot, g, keys, limit):
    if len(levels) == 1:
      on_keys(s, b, slot, g, keys, levels[0])
      return
    for nk in levels:  # a sequence's last block on as few keys as hold its own (`walk.key_levels`)
      pl.when(limit == nk)(functools.partial(on_keys, s, b, slot, g, keys, nk))

  if d.write:
    _write_block(d, spec, r, new_refs, q_lo)
  w.walk(d, spec, r, q_lo, visit, levels)
  for k in range(d.K):
    l, m = l_sc[k][:, :1], m_sc[k][:, :1]
    # No visible key (padding rows, empty sequences): o = 0, lse = -inf (with sinks, flash.py then gives the row
    # lse' = s_h, a finite lse whose backward must still read no key: see backward.py).
    empty = l == 0.0
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[:, k * G : (k + 1) * G, :] = (acc_sc[k] / l_safe).reshape(d.bq, G, d.Hv).astype(o_ref.dtype)
    lse_ref[:, k * G : (k + 1) * G] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe)).reshape(d.bq, G)


def _write_block(d: pp.PagedDims, spec, r: w.Refs, new_refs, q_lo):
  """Fused cache write: the block's rows go into their page slots before the walk reads any page.

  The grid runs in order, so the rows of a sequence in earlier q blocks are already stored when a later block
  reads them; copy-on-write has already given the sequence its own copy of a shared page it writes into.
  """
  q_hi = q_lo + d.bq
  n = jnp.clip(r.sched[0], 0, d.S)

  def seq_step(s):
    g = w.seq_in_block(d, spec, r, s, q_lo)
    _write_rows(d, r, new_refs, q_lo, s, g.start, g.lo_row, g.hi_row, g.first_pos)
    return s + 1

  live = lambda s: (s < n) & (r.cu[jnp.minimum(s, d.S)] < q_hi)  # noqa: E731
  jax.lax.while_loop(live, seq_step, w.first_seq(d, r, q_lo, n))


def _write_rows(d: pp.PagedDims, r: w.Refs, new_refs, q_lo, s, seq_start, lo_row, hi_row, first_pos):
  new_k, new_v, new_scales = new_refs
  pairs = [(new_k, r.k_hbm, True), (new_v, r.v_hbm, True)]  # (new rows, pages or scales, pages?)
  pairs += [(a, b, False) for a, b in zip(new_scales, r.scales_hbm, strict=True) if a is not None]

  def row(t, carry):
    pos = first_pos + (t - seq_start)
    entry = jax.lax.div(jnp.maximum(pos, 0), d.ps)
    pid = r.table[s * d.ppt + jnp.minimum(entry, d.ppt - 1)]
    ok = (pos >= 0) & (entry < d.ppt) & (pid >= 0) & (pid < d.P)
    slot = jax.lax.rem(jnp.maximum(pos, 0), d.ps)
    safe = jnp.clip(pid, 0, d.P - 1)

    @pl.when(ok)
    def _():
      for src, dst, pages in pairs:
        copy = pltpu.make_async_copy(src.at[t - q_lo], _page_row(d, dst, safe, slot, pages), r.sem.at[d.slots])
        copy.start()
        copy.wait()

    return carry

  jax.lax.fori_loop(lo_row, hi_row, row, 0)


def _page_row(d: pp.PagedDims, dst, pid, slot, pages: bool):
  """Slot `slot` of page pid in a page buffer (`pages`) or a scale array: K rows of a flat page buffer, else one
  index."""
  if d.flat and pages:
    return dst.at[pid, pl.ds(slot * d.K, d.K)]
  return dst.at[pid, slot]


def paged_fwd(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  k_scale,
  v_scale,
  bidirectional_ids=None,
  *,
  spec,
  interpret,
):
  """Returns (out [T, N, Hv] in q.dtype, lse [T, N] float32; -inf for rows not in the batch)."""
  f, G = pp.lane_groups(q, k_pages, v_pages, k_scale, v_scale)
  if f > 1:
    args = (k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, bidirectional_ids)
    out, lse = paged_fwd(pp.spread_heads(q, f, G), *args, spec=spec, interpret=interpret)
    return pp.gather_heads(out, f, G), lse
  T = q.shape[0]
  d = pp.spec_dims(q, k_pages, v_pages, page_indices, k_scale, v_scale, spec, interpret, slots=tiling.PAGED_FWD_SLOTS)
  q, bidirectional_ids = (pp.pad_rows(x, d.T) for x in (q, bidirectional_ids))
  k_pages, v_pages = pp.kernel_pages(d, k_pages, v_pages)
  prefetch, scales = pp.operands(d, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
  prefetch = w.scheduled(d, spec, prefetch)
  scales += pp.span_operands(d, bidirectional_ids, kv_lens, cu_q_lens, num_seqs)
  kernel = functools.partial(_fwd_kernel, d=d, spec=spec)
  run = pp.launch(kernel, d, pp.fwd_plan(d), semantics=("parallel",), aliases={}, interpret=interpret, name="paged_fwd")
  out, lse = run(*prefetch, q, k_pages, v_pages, *scales)
  return out[:T], lse[:T]


def paged_fwd_write(
  q,
  k_new,
  v_new,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  k_scale,
  v_scale,
  k_new_scale,
  v_new_scale,
  *,
  spec,
  interpret,
):
  """Forward with the fused cache write; not differentiable (serving).

  k_new, v_new: [T, K, H] / [T, K, Hv] the new tokens' K/V as stored (page dtype; quantized by the caller), with
  their per-token scales [T, K] when the cache keeps scales ([P, page_size, K]).  kv_lens and page_indices are
  the cache's after the append (pages reserved, copy-on-write done).  Returns (out [T, N, Hv], lse [T, N],
  k_pages, v_pages, k_scale, v_scale); the page buffers are aliased to the results (donate them to update in
  place).
  """
  if spec.mask.has_bidirectional:
    raise NotImplementedError(
      "the fused cache write writes q block by q block: a bidirectional span reaching a later block would read "
      "keys not written yet; append the K/V, then call paged_attention"
    )
  for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
    if sc is not None and sc.ndim != 3:
      raise NotImplementedError(
        f"the fused cache write stores per-token scales [P, page_size, K], got {name}.ndim={sc.ndim}"
      )
  if k_pages.ndim == 3 or v_pages is None:
    raise NotImplementedError(
      "the fused cache write stores one token row at a time, which Mosaic refuses in merged pages "
      "[P, page_size, K * H] and kv pages [P, 2, page_size, K * H] (offsets along tiled dimensions); append the "
      "K/V, then call paged_attention"
    )
  T = q.shape[0]
  d = pp.spec_dims(
    q, k_pages, v_pages, page_indices, k_scale, v_scale, spec, interpret, write=True, slots=tiling.PAGED_FWD_SLOTS
  )
  k_pages, v_pages = pp.to_kernel_pages(d, k_pages), pp.to_kernel_pages(d, v_pages)
  q, k_new, v_new, k_new_scale, v_new_scale = (
    pp.pad_rows(x, d.T) for x in (q, k_new, v_new, k_new_scale, v_new_scale)
  )  # padding rows belong to no sequence: never written
  prefetch, _ = pp.operands(d, kv_lens, page_indices, cu_q_lens, num_seqs, None, None)
  prefetch = w.scheduled(d, spec, prefetch)
  scales = tuple(x for x in (k_scale, v_scale) if x is not None)
  new_scales = tuple(x.astype(c.F32) for x in (k_new_scale, v_new_scale) if x is not None)
  operands = (
    *prefetch,
    q,
    k_pages,
    v_pages,
    *scales,
    k_new.astype(k_pages.dtype),
    v_new.astype(v_pages.dtype),
    *new_scales,
  )
  # Inputs 5, 6 (pages) and 7.. (scales) after the 4 prefetched arrays and q become outputs 2, 3, 4...
  aliases = {5 + i: 2 + i for i in range(2 + len(scales))}
  kernel = functools.partial(_fwd_kernel, d=d, spec=spec)
  run = pp.launch(
    kernel,
    d,
    pp.fwd_plan(d),
    semantics=("arbitrary",),
    aliases=aliases,
    interpret=interpret,
    name="paged_fwd_write",
  )
  out, lse, k_pages, v_pages, *new = run(*operands)
  k_scale, v_scale = (new.pop(0) if x is not None else None for x in (k_scale, v_scale))
  return out[:T], lse[:T], pp.from_kernel_pages(d, k_pages), pp.from_kernel_pages(d, v_pages), k_scale, v_scale


# -- backward -----------------------------------------------------------------------------

"""Backward paged kernel: dq per q block in VMEM, dK/dV added into f32 page buffers in HBM."""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu import tiling
from flax_ringattn._src.backends.pallas_tpu.paged import plans as pp
from flax_ringattn._src.backends.pallas_tpu.paged import walk as w


def _bwd_kernel(
  cu_ref, kv_lens_ref, table_ref, sched_ref, q_ref, do_ref, stats_ref, k_hbm, v_hbm, *rest, d: pp.PagedDims, spec
):
  scales_hbm, rest = w.split_refs(d, rest)
  (q_ids, kv_ids_hbm), rest = w.split_spans(d, rest)
  _dk_in, _dv_in, dq_ref, dk_hbm, dv_hbm, *rest = rest
  del _dk_in, _dv_in  # the same buffers as dk_hbm / dv_hbm (aliased)
  k_buf, v_buf, scale_bufs, kv_ids_buf, keys_sc, rest = w.split_scratch(d, rest)
  dq_sc, dk_blk, dv_blk, *page_bufs, sem, tokens_sc = rest
  dk_page, dv_page = page_bufs[0], page_bufs[-1]  # one buffer for both unless v's head dim differs (MLA)
  r = w.Refs(
    cu_ref, kv_lens_ref, table_ref, sched_ref, k_hbm, v_hbm, scales_hbm, k_buf, v_buf, scale_bufs, sem, tokens_sc
  )
  r = dataclasses.replace(r, q_ids=q_ids, kv_ids_hbm=kv_ids_hbm, kv_ids_buf=kv_ids_buf, keys_sc=keys_sc)
  G, q_lo = d.G, pl.program_id(0) * d.bq
  dq_sc[...] = jnp.zeros(dq_sc.shape, c.F32)

  def visit(s, b, slot, g, keys, limit):  # noqa: ARG001 (the whole block: `walk`'s default levels)
    ids = w.span_ids(d, r, s, b, slot, g)
    vis = w.mask(d, spec, q_lo, g.start, g.end, g.first_pos, b, keys, ids)
    for k in range(d.K):
      # Slots without a key are zeroed (`block_keys`) and p is exactly 0 there: their dK, dV rows are 0.
      kk, k_sc = w.load_head(d, k_buf, scale_bufs[0], slot, k)
      vv, v_sc = w.load_head(d, v_buf, scale_bufs[1], slot, k)
      heads = slice(k * G, (k + 1) * G)
      q = w.fold(q_ref[:, heads, :].astype(c.F32), G)  # f32 first: the fold of bf16 rows needs G even
      do = w.fold(do_ref[:, heads, :].astype(c.F32), G)
      # lse is the final one (flash.py): with sinks it is finite even on rows that see no key (s_h), without them
      # -inf there.  Either way only `vis` decides which p are read, so those rows get exact-zero gradients.
      stats = stats_ref[k]  # [rows, 2]: (lse, delta), folded as q (`plans.fold_row_stats`)
      lse, delta = stats[:, :1], stats[:, 1:]
      lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
      s_ = w.dot(q, kk, ((1,), (1,)), d.q_dtype) * spec.scale
      t = None
      if spec.logits_soft_cap is not None:
        t = jnp.tanh(s_ / spec.logits_soft_cap)
        s_ = spec.logits_soft_cap * t
      p = jnp.where(vis, jnp.exp(jnp.where(vis, s_, 0.0) - lse), 0.0)  # [rows, L]
      dv = w.dot(p, do, ((0,), (0,)), d.q_dtype)  # [L, Hv]
      dp = w.dot(do, vv, ((1,), (1,)), d.q_dtype)
      ds = p * (dp - delta)
      if t is not None:
        ds = ds * (1.0 - t * t)
      ds = ds * spec.scale
      dq = w.dot(ds, kk, ((1,), (0,)), d.q_dtype)  # [rows, H]
      dq_sc[:, heads, :] = dq_sc[:, heads, :] + dq.reshape(d.bq, G, d.H)
      dk = w.dot(ds, q, ((0,), (0,)), d.q_dtype).reshape(d.ppb, d.ps, d.H)
      dv = dv.reshape(d.ppb, d.ps, d.Hv)
      # Gradients with respect to the stored values: d(stored) = d(dequantised) * scale.
      if k_sc is not None:
        dk = dk * k_sc
      if v_sc is not None:
        dv = dv * v_sc
      dk_blk[:, :, k, :] = dk
      dv_blk[:, :, k, :] = dv

    # Read-add-write of every page read, one at a time (a page may repeat in a table row).
    def add_page(j, pid):
      for acc_hbm, blk, page_sc in ((dk_hbm, dk_blk, dk_page), (dv_hbm, dv_blk, dv_page)):
        rd = pltpu.make_async_copy(acc_hbm.at[pid], page_sc, sem.at[d.slots])
        rd.start()
        rd.wait()
        page_sc[...] = page_sc[...] + blk[j]
        wr = pltpu.make_async_copy(page_sc, acc_hbm.at[pid], sem.at[d.slots])
        wr.start()
        wr.wait()

    for j, page in enumerate(w.block_pages(d, r, s, b, g.kv_len)):
      pl.when(page.ok)(functools.partial(add_page, j, page.pid))

  w.walk(d, spec, r, q_lo, visit)
  dq_ref[...] = dq_sc[...]


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
  interpret,
  bidirectional_ids=None,
):
  """(dq [T, N, H], dk_pages [P, page_size, K, H], dv_pages [P, page_size, K, Hv]) in float32, as the XLA
  backend's `paged_bwd` (merged pages: dk_pages [P, page_size, K * H], dv_pages [P, page_size, K * Hv])."""
  f, G = pp.lane_groups(q, k_pages, v_pages, k_scale, v_scale)
  if f > 1:
    args = (k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, lse)
    dq, dk, dv = paged_bwd(
      pp.spread_heads(q, f, G),
      *args,
      pp.spread_heads(do, f, G),
      delta,
      spec=spec,
      interpret=interpret,
      bidirectional_ids=bidirectional_ids,
    )
    return pp.gather_heads(dq, f, G), dk, dv
  T = q.shape[0]
  d = pp.spec_dims(q, k_pages, v_pages, page_indices, k_scale, v_scale, spec, interpret, slots=tiling.PAGED_BWD_SLOTS)
  k_pages, v_pages = pp.kernel_pages(d, k_pages, v_pages)
  q, do, lse, delta, bidirectional_ids = (pp.pad_rows(x, d.T) for x in (q, do, lse, delta, bidirectional_ids))
  prefetch, scales = pp.operands(d, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
  prefetch = w.scheduled(d, spec, prefetch)
  dk0, dv0 = (jnp.zeros((d.P, d.ps, d.K, h), c.F32) for h in (d.H, d.Hv))
  spans = pp.span_operands(d, bidirectional_ids, kv_lens, cu_q_lens, num_seqs)
  stats = pp.fold_row_stats(d, lse, delta)
  operands = (*prefetch, q, do.astype(q.dtype), stats, k_pages, v_pages, *scales, *spans, dk0, dv0)
  n = len(operands)
  kernel = functools.partial(_bwd_kernel, d=d, spec=spec)
  # dK/dV pages are read-modified-written across grid steps: the steps run in order on one core.
  run = pp.launch(
    kernel,
    d,
    pp.bwd_plan(d),
    semantics=("arbitrary",),
    aliases={n - 2: 1, n - 1: 2},
    interpret=interpret,
    name="paged_bwd",
  )
  dq, dk, dv = run(*operands)
  if d.merged:  # the cotangents take the pages' layout: [P, ps, K, h] -> [P, ps, K * h]
    dk, dv = (x.reshape(d.P, d.ps, -1) for x in (dk, dv))
  if d.together:  # kv pages: one cotangent [P, 2, ps, K * H]
    return dq[:T], jnp.stack([dk, dv], axis=1), None
  return dq[:T], dk, dv

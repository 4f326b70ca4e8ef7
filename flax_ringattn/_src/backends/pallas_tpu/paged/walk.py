"""The walk both paged kernels share: page copies into the two-slot kv buffer, the masks of a block, and the
sequence-by-sequence visit of the kv blocks a q block can see (steps 1 to 3 of the package docstring)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src import masks
from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu.paged import plans as pp


@dataclasses.dataclass(frozen=True)
class Refs:
  """Scalar metadata, HBM pages and the VMEM kv buffers of one launch."""

  cu: object  # [S + 1] effective cu_q_lens (SMEM)
  kv_lens: object  # [S]
  table: object  # [S * ppt] page ids, -1 padded
  num_seqs: object  # [1]
  k_hbm: object
  v_hbm: object
  scales_hbm: tuple  # k_scale / v_scale [P, rows, K] (None when absent)
  k_buf: object  # [2, ppb, ps, K, H]
  v_buf: object  # [2, ppb, ps, K, Hv]
  scale_bufs: tuple  # [2, ppb, rows, K] (None when absent)
  sem: object  # DMA semaphores; [0] and [1]: the kv slots


def _page_copies(d: pp.PagedDims, r: Refs, s, b, slot, kv_len):
  """[(copy this page?, descriptors)] for the ppb pages of kv block b of sequence s."""
  out = []
  for j in range(d.ppb):
    entry = b * d.ppb + j
    pid = r.table[s * d.ppt + entry]
    ok = (pid >= 0) & (pid < d.P) & (entry * d.ps < kv_len)
    safe = jnp.clip(pid, 0, d.P - 1)
    descs = [
      pltpu.make_async_copy(r.k_hbm.at[safe], r.k_buf.at[slot, j], r.sem.at[slot]),
      pltpu.make_async_copy(r.v_hbm.at[safe], r.v_buf.at[slot, j], r.sem.at[slot]),
    ]
    for src, dst in zip(r.scales_hbm, r.scale_bufs, strict=True):
      if src is not None:
        descs.append(pltpu.make_async_copy(src.at[safe], dst.at[slot, j], r.sem.at[slot]))
    out.append((ok, safe, descs))
  return out


def _start(copies):
  for ok, _, descs in copies:
    pl.when(ok)(functools.partial(_each, descs, "start"))


def _wait(copies):
  for ok, _, descs in copies:
    pl.when(ok)(functools.partial(_each, descs, "wait"))


def _each(descs, method):
  for desc in descs:
    getattr(desc, method)()


def kv_valid(d: pp.PagedDims, copies, b, kv_len):
  """[ppb, ps, 1] bool: the slot was copied and is below kv_len."""
  page = jax.lax.broadcasted_iota(jnp.int32, (d.ppb, d.ps, 1), 0)
  slot = jax.lax.broadcasted_iota(jnp.int32, (d.ppb, d.ps, 1), 1)
  ok = jnp.zeros((d.ppb, d.ps, 1), jnp.bool_)
  for j, (page_ok, _, _) in enumerate(copies):
    ok = ok | ((page == j) & page_ok)
  return ok & (b * d.block_tokens + page * d.ps + slot < kv_len)


def kv_valid_row(d: pp.PagedDims, copies, b, kv_len):
  """[1, ppb * ps] bool: `kv_valid` laid out along the lanes (the score tile's kv axis)."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, d.block_tokens), 1)
  ok = jnp.zeros((1, d.block_tokens), jnp.bool_)
  for j, (page_ok, _, _) in enumerate(copies):
    ok = ok | ((jax.lax.div(lane, d.ps) == j) & page_ok)
  return ok & (b * d.block_tokens + lane < kv_len)


def load_head(d: pp.PagedDims, buf, scale_buf, slot, k, valid):
  """[ppb * ps, H or Hv] float32 values of kv head k (dequantised, zero where not valid), and the scale
  [ppb, rows, 1]."""
  x = buf[slot, :, :, k, :].astype(c.F32)  # [ppb, ps, H or Hv]
  sc = None
  if scale_buf is not None:
    sc = scale_buf[slot, :, :, k][..., None]  # [ppb, rows, 1]
    x = x * sc
  x = jnp.where(valid, x, 0.0)
  return x.reshape(d.block_tokens, x.shape[-1]), sc


def fold(x, G):
  """[bq, G, ...] -> [bq * G, ...]: row r is token r // G, head r % G."""
  return x.reshape(x.shape[0] * G, *x.shape[2:])


def mask(d: pp.PagedDims, spec, q_lo, seq_start, seq_end, first_pos, b, valid_row):
  """[bq * G, block_tokens] visibility of kv block b for the rows of one sequence in this q block."""
  rows = d.bq * d.G
  t = q_lo + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), d.G)  # global row of q
  pos = first_pos + (t - seq_start)
  kv_pos = b * d.block_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, d.block_tokens), 1)
  return (t >= seq_start) & (t < seq_end) & valid_row & masks.pair_visible(spec.mask, pos, kv_pos)


def dot(a, b, contract, dtype):
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  return jax.lax.dot_general(
    a.astype(dtype), b.astype(dtype), (contract, ((), ())), preferred_element_type=c.F32, precision=precision
  )


@dataclasses.dataclass(frozen=True)
class _Seq:
  """Where sequence s meets the q block: its rows, positions and the kv blocks [lo, hi) they can see."""

  start: jax.Array  # first row of the sequence in q
  end: jax.Array
  kv_len: jax.Array
  first_pos: jax.Array  # position of the sequence's first new token
  lo_row: jax.Array  # its rows in this q block: [lo_row, hi_row)
  hi_row: jax.Array
  lo: jax.Array
  hi: jax.Array


def seq_in_block(d: pp.PagedDims, spec, r: Refs, s, q_lo) -> _Seq:
  seq_start, seq_end = r.cu[s], r.cu[s + 1]
  kv_len = r.kv_lens[s]
  lo_row, hi_row = jnp.maximum(seq_start, q_lo), jnp.minimum(seq_end, q_lo + d.bq)
  first_pos = kv_len - (seq_end - seq_start)
  lo_pos, hi_pos = first_pos + (lo_row - seq_start), first_pos + (hi_row - 1 - seq_start)
  # lax.div/rem (truncating) on non-negative values: Mosaic lowers floor division through sign(), which
  # needs the TPU generation at lowering time.
  hi = jnp.where(hi_pos < 0, 0, jnp.minimum(jax.lax.div(hi_pos, d.block_tokens) + 1, d.max_blocks))
  hi = jnp.where(hi_row > lo_row, hi, 0)
  lo = jax.lax.div(masks.first_visible_position(spec.mask, lo_pos), d.block_tokens)
  return _Seq(seq_start, seq_end, kv_len, first_pos, lo_row, hi_row, jnp.minimum(lo, hi), hi)


def first_seq(d: pp.PagedDims, r: Refs, q_lo, n):
  """The first sequence whose rows reach the q block (a scalar scan of cu_q_lens)."""
  return jax.lax.while_loop(lambda s: (s < n) & (r.cu[jnp.minimum(s + 1, d.S)] <= q_lo), lambda s: s + 1, 0)


def walk(d: pp.PagedDims, spec, r: Refs, q_lo, visit):
  """Calls visit(s, b, slot, copies, seq) for every (sequence, kv block) that the rows [q_lo, q_lo + bq) can
  see, with block b's pages in VMEM slot `slot`.

  One copy is always in flight ahead of the compute: the next block of the sequence, or, during its last
  block, the first block of the next sequence (a decode batch is mostly one-block sequences).
  """
  q_hi = q_lo + d.bq
  n = jnp.clip(r.num_seqs[0], 0, d.S)
  live = lambda s: (s < n) & (r.cu[jnp.minimum(s, d.S)] < q_hi)  # noqa: E731

  def seq_step(carry):
    s, slot, started = carry
    g = seq_in_block(d, spec, r, s, q_lo)
    has_work = g.lo < g.hi

    @pl.when(has_work & ~started)
    def _():
      _start(_page_copies(d, r, s, g.lo, slot, g.kv_len))

    s2 = jnp.minimum(s + 1, d.S - 1)
    g2 = seq_in_block(d, spec, r, s2, q_lo)
    next_ok = live(s + 1) & (g2.lo < g2.hi)

    def kv_step(b, cur):
      nxt = 1 - cur

      @pl.when(b + 1 < g.hi)
      def _():
        _start(_page_copies(d, r, s, b + 1, nxt, g.kv_len))

      @pl.when((b + 1 == g.hi) & next_ok)
      def _():
        _start(_page_copies(d, r, s2, g2.lo, nxt, g2.kv_len))

      copies = _page_copies(d, r, s, b, cur, g.kv_len)
      _wait(copies)
      visit(s, b, cur, copies, g)
      return nxt

    slot = jax.lax.fori_loop(g.lo, g.hi, kv_step, slot)
    return s + 1, slot, has_work & next_ok

  init = (first_seq(d, r, q_lo, n), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.bool_))
  jax.lax.while_loop(lambda c: live(c[0]), seq_step, init)


def split_refs(d: pp.PagedDims, refs):
  """Peels the optional scale refs off a kernel's ref list."""
  refs = list(refs)
  scales = []
  for rows in d.scale_rows:
    scales.append(refs.pop(0) if rows else None)
  return tuple(scales), refs


def split_scratch(d: pp.PagedDims, refs):
  refs = list(refs)
  k_buf, v_buf = refs.pop(0), refs.pop(0)
  scale_bufs = tuple(refs.pop(0) if rows else None for rows in d.scale_rows)
  return k_buf, v_buf, scale_bufs, refs


# -- forward ------------------------------------------------------------------------------

"""Static sizes (`PagedDims`), what the kernels support, their call plans, operands and launch."""

from __future__ import annotations

import dataclasses
import operator

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src import ragged, vma
from flax_ringattn._src.backends.pallas_tpu import common as c

SUPPORTED_Q_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class PagedDims:
  """Static sizes of one paged launch."""

  T: int  # rows of q
  N: int
  K: int
  H: int  # q's and k's head dim
  P: int  # pages
  ps: int  # page size
  S: int  # max_num_seqs
  ppt: int  # page-table entries per sequence, padded to a multiple of ppb
  bq: int  # rows per grid step
  ppb: int  # pages per kv block
  q_dtype: object
  page_dtype: object
  scale_rows: tuple  # (rows of k_scale, rows of v_scale) per page: 0 (no scale), 1 (per page) or ps (per token)
  write: bool = False  # fused cache write: the new tokens' K/V (and per-token scales) go into their pages first
  v_head_dim: int | None = None  # v's (and the output's) head dim when it differs from H (MLA); None: H
  spans: bool = False  # bidirectional ids: the q block's ids in, the kv blocks' ids copied with the pages
  compiled: bool = False  # compiled for a TPU (not interpret mode): flat pages are read through 32-bit words
  # Merged pages: [P, ps, K * H] (a token's kv heads side by side along the lanes), copied into [slots, ppb * ps, K * H]
  # buffers, where head k is the lane slice [k * H, (k + 1) * H): dense for any K, no strided load.
  merged: bool = False
  # kv pages: one [P, 2, ps, K * H] array, a page's K and V (each merged) copied together, with one DMA, into one
  # [slots, 2, ppb * ps, K * H] buffer (slot, then K or V: `walk.Half`).  Implies `merged`, and Hv == H.
  together: bool = False
  slots: int = 2  # kv blocks in VMEM: slots - 1 in flight while one is computed (`walk.walk`)

  @property
  def flat(self) -> bool:
    """Pages travel as [P, ps * K, H] into flat [slots, ppb * ps * K, H] kv buffers (`tiling.flat_kv_pages`)."""
    return not self.merged and c.flat_kv_pages(self.page_dtype, self.K, (self.H, self.Hv))

  @property
  def rows_per_token(self) -> int:
    """Rows of a kv buffer (`kv_buffer_shape`) per token: K when flat, else 1 ([ppb * ps, K, h])."""
    return self.K if self.flat else 1

  @property
  def span_rows(self) -> int:
    """Rows of the kv id table (`span_operands`): sequence s's kv block b is row cu[s] // bt + 2 s + b - (its first
    new token's block); a sequence of q_len new tokens touches at most (q_len - 1) // bt + 2 blocks, which the
    gap to the next sequence's first row, >= q_len // bt + 2, always holds."""
    return self.T // self.block_tokens + 2 * self.S + 2

  @property
  def Hv(self) -> int:
    return self.H if self.v_head_dim is None else self.v_head_dim

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def window_rows(self) -> int | None:
    """Folded rows (`walk.fold`) of the forward's narrow path, or None (`window_rows`)."""
    return window_rows(self.G, self.bq, spans=self.spans)

  @property
  def block_tokens(self) -> int:
    return self.ppb * self.ps

  @property
  def max_blocks(self) -> int:
    return self.ppt // self.ppb


def window_rows(G: int, bq: int, *, spans: bool = False) -> int | None:
  """Folded rows of the forward's narrow path for G q heads per kv head and q blocks of bq rows, or None.

  A sequence whose rows in a q block fit in this many folded rows starting at a multiple of 8 (an f32 sublane
  tile) is computed on those rows alone, not on the block's bq * G, so a decode token costs about G rows, not
  bq * G.  The least multiple of 8 that holds any one token's G rows from the tile they start in (8 for G in 1,
  2, 4, 8; 16 for G = 3, 5, 6, 7, 12, ...); None when that is the whole block, or with span ids (their q ids
  are folded whole)."""
  w = max((t * G) % 8 + G for t in range(8))
  w = -(-w // 8) * 8
  return None if w >= bq * G or spans else w


def fits_window(lo, hi, window: int, rows: int, div=operator.floordiv):
  """(whether folded rows [lo, hi) of a q block of `rows` folded rows fit in `window` rows from a multiple of 8,
  that first row).  The kernel passes traced values and `jax.lax.div` (Mosaic lowers floor division through
  sign()); the roofline model Python ints."""
  row0 = div(lo, 8) * 8
  return (hi <= row0 + window) & (row0 + window <= rows), row0


def page_size(k_pages, v_pages) -> int:
  """Tokens per page: kv pages [P, 2, ps, K * H] when v_pages is None, else [P, ps, ...]."""
  return k_pages.shape[2] if v_pages is None else k_pages.shape[1]


def check_supported(q, k_pages, v_pages, *, block_q, pages_per_block) -> tuple[int, int]:
  """(bq, ppb) for this call, or NotImplementedError for valid input the kernel does not handle (v_pages None:
  k_pages are kv pages [P, 2, ps, K * H])."""
  T = q.shape[0]
  together = v_pages is None
  ps = page_size(k_pages, v_pages)
  if jnp.dtype(q.dtype) not in SUPPORTED_Q_DTYPES:
    raise NotImplementedError(f"pallas_tpu paged attention supports float32 and bfloat16 q, got q.dtype={q.dtype}")
  sub = c.sublanes(q.dtype)
  if ps % sub:
    raise NotImplementedError(
      f"pallas_tpu paged attention needs page_size to be a multiple of {sub} for {jnp.dtype(q.dtype).name} q "
      f"(a page is a whole number of sublane tiles), got page_size={ps}; use implementation='xla'"
    )
  if (k_pages.ndim == 3 or together) and ps % c.sublanes(k_pages.dtype):
    raise NotImplementedError(
      f"pallas_tpu paged attention with merged pages [P, page_size, K * H] of {jnp.dtype(k_pages.dtype).name} "
      f"needs page_size to be a multiple of {c.sublanes(k_pages.dtype)} (a page is a whole number of that dtype's "
      f"sublane tiles), got page_size={ps}; use [P, page_size, K, H] pages or implementation='xla'"
    )
  return q_block(T, block_q, sub), max(1, pages_per_block)


def q_block(T: int, block_q: int, sub: int) -> int:
  """Rows per grid step for T rows: the whole axis when it fits in block_q, else the multiple of `sub` up to
  block_q with the fewest grid steps, then the least padding (`padded_rows`: the kernels pad q to a multiple of
  it, so every token count works)."""
  if T <= max(block_q, sub):
    return T
  options = range(sub, max(block_q, sub) + 1, sub)
  return min(options, key=lambda b: (padded_rows(T, b) // b, padded_rows(T, b), -b))


def padded_rows(T: int, bq: int) -> int:
  return -(-T // bq) * bq


def pad_rows(x, rows: int):
  """x with its leading (row) axis zero-padded to `rows` (None stays None)."""
  if x is None or x.shape[0] == rows:
    return x
  return jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1))


def dims_of(q, k_pages, v_pages, page_indices, k_scale, v_scale, *, bq, ppb, write=False, spans=False) -> PagedDims:
  """v_pages None: k_pages are kv pages [P, 2, ps, K * H] (`PagedDims.together`)."""
  T, N, H = q.shape
  together = v_pages is None
  if together:
    P, _, ps, KH = k_pages.shape
    merged, K, Hv = True, KH // H, H
  else:
    P, ps = k_pages.shape[:2]
    merged = k_pages.ndim == 3
    K = k_pages.shape[2] // H if merged else k_pages.shape[2]
    Hv = v_pages.shape[2] // K if merged else v_pages.shape[3]
  S, pps = page_indices.shape
  rows = tuple(0 if x is None else (1 if x.ndim < 3 else ps) for x in (k_scale, v_scale))
  return PagedDims(
    T=T,
    N=N,
    K=K,
    H=H,
    P=P,
    ps=ps,
    S=S,
    ppt=-(-pps // ppb) * ppb,
    bq=bq,
    ppb=ppb,
    q_dtype=jnp.dtype(q.dtype),
    page_dtype=jnp.dtype(k_pages.dtype),
    scale_rows=rows,
    write=write,
    v_head_dim=None if Hv == H else Hv,
    spans=spans,
    merged=merged,
    together=together,
  )


# -- heads narrower than the lanes --------------------------------------------------------


def lane_groups(q, k_pages, v_pages, k_scale, v_scale) -> tuple[int, int]:
  """(f, G): merged pages whose head dim H divides 128 into f > 1 heads per 128-lane group (head dim 64: two kv
  heads side by side, as a page [page_size, K * 64] holds them) are attended as K / f heads of 128 lanes, each with
  f * G q heads, so every load, matmul and store is lane-dense.  q (and do) go in spread (`spread_heads`: head n's
  H values in its kv head's lanes of the group, zeros in the others), so a row's scores see its own kv head only;
  each output row keeps its own head's lanes (`gather_heads`).  f = 1 (no regrouping) for 4-D pages, quantized
  pages (their scales are per kv head), K and V head dims that differ, or K not a multiple of f.  G = N / K."""
  H, N = q.shape[-1], q.shape[1]
  if v_pages is not None and (k_pages.ndim != 3 or k_pages.shape != v_pages.shape):
    return 1, 0
  if k_scale is not None or v_scale is not None:
    return 1, 0
  K = k_pages.shape[-1] // H
  if H >= c.LANES or c.LANES % H or K % (c.LANES // H):
    return 1, N // K
  return c.LANES // H, N // K


def _group_lane(N: int, f: int, G: int):
  """[N] int32: which of its group's f lane slots q head n's kv head (n // G) takes."""
  return (jnp.arange(N, dtype=jnp.int32) // G) % f


def spread_heads(x, f: int, G: int):
  """x [T, N, H] -> [T, N, f * H]: head n's values in lane slot (n // G) % f, zeros in the others."""
  T, N, H = x.shape
  on = _group_lane(N, f, G)[:, None] == jnp.arange(f, dtype=jnp.int32)[None, :]  # [N, f]
  return jnp.where(on[None, :, :, None], x[:, :, None, :], jnp.zeros((), x.dtype)).reshape(T, N, f * H)


def gather_heads(y, f: int, G: int):
  """The inverse of `spread_heads` on the kernels' results: [T, N, f * H] -> [T, N, H], head n's lane slot.  A
  select and a sum over the f slots (elementwise: a TPU gather of T * N rows ran a 1056-row step 14x slower than
  the kernel itself)."""
  T, N, W = y.shape
  on = _group_lane(N, f, G)[:, None] == jnp.arange(f, dtype=jnp.int32)[None, :]  # [N, f]
  y = y.reshape(T, N, f, W // f)
  return jnp.where(on[None, :, :, None], y, jnp.zeros((), y.dtype)).sum(axis=2, dtype=y.dtype)


# -- call plans (the planner's VMEM model is checked against these) --------------------


def _row_block(d: PagedDims, minor):
  return pl.BlockSpec((d.bq, *minor), lambda i, *_: (i,) + (0,) * len(minor))


def _any():
  return pl.BlockSpec(memory_space=pl.ANY)


def kv_buffer_shape(d: PagedDims, h: int) -> tuple:
  """The VMEM buffer of `PagedDims.slots` kv blocks' K (h = H) or V (h = Hv) pages."""
  return c.paged_kv_buffer_shape(d.ppb, d.ps, d.K, h, d.page_dtype, (d.H, d.Hv), merged=d.merged, slots=d.slots)


def page_shape(d: PagedDims, h: int) -> tuple:
  """The page buffers as the kernels take them: kv pages as given [P, 2, ps, K * h], merged as given
  [P, ps, K * h], [P, ps * K, h] when flat (a free reshape), else as given [P, ps, K, h]."""
  if d.together:
    return (d.P, 2, d.ps, d.K * h)
  if d.merged:
    return (d.P, d.ps, d.K * h)
  return (d.P, d.ps * d.K, h) if d.flat else (d.P, d.ps, d.K, h)


def to_kernel_pages(d: PagedDims, x):
  """x [P, ps, K, h] or merged [P, ps, K * h] (`PagedDims.merged`) as the kernels take it (`page_shape`)."""
  return x if x is None else x.reshape(page_shape(d, x.shape[-1] // (d.K if d.merged else 1)))


def kernel_pages(d: PagedDims, k_pages, v_pages) -> tuple:
  """(k_pages, v_pages) as the kernels take them (`to_kernel_pages`); kv pages go in as both (one HBM array, two
  operands: the kernels' signatures stay those of K and V apart)."""
  if d.together:
    return k_pages, k_pages
  return to_kernel_pages(d, k_pages), to_kernel_pages(d, v_pages)


def from_kernel_pages(d: PagedDims, x):
  """The inverse of `to_kernel_pages`: the pages in the caller's layout."""
  return x if d.merged else x.reshape(d.P, d.ps, d.K, x.shape[-1])


def _kv_scratch(d: PagedDims):
  if d.together:  # [slot, K or V, rows, lanes]: a page's K and V land with one copy (`walk.Half` reads each)
    slots, rows, lanes = kv_buffer_shape(d, d.H)
    bufs = [((slots, 2, rows, lanes), d.page_dtype)]
  else:
    bufs = [(kv_buffer_shape(d, d.H), d.page_dtype), (kv_buffer_shape(d, d.Hv), d.page_dtype)]
  bufs += [((d.slots, d.ppb, r, d.K), c.F32) for r in d.scale_rows if r]
  if d.spans:
    bufs.append(((d.slots, 1, d.block_tokens), jnp.int32))  # the kv block's bidirectional ids, along the lanes
  bufs.append(((1, d.block_tokens), jnp.int32))  # which key slots of the block hold a key (`walk.block_keys`)
  return bufs


def _span_specs(d: PagedDims):
  """The q block's ids [bq, 1] (pipelined) and the kv id table [span_rows, 1, bt] (HBM); none without spans."""
  if not d.spans:
    return [], []
  return [_row_block(d, (1,)), _any()], [jnp.dtype(jnp.int32)] * 2


def fwd_plan(d: PagedDims) -> c.CallPlan:
  num_scales = sum(1 for r in d.scale_rows if r)
  rows = d.bq * d.G
  span_specs, span_dtypes = _span_specs(d)
  in_specs = [_row_block(d, (d.N, d.H)), _any(), _any(), *(_any() for _ in range(num_scales)), *span_specs]
  in_dtypes = [d.q_dtype, d.page_dtype, d.page_dtype, *((c.F32,) * num_scales), *span_dtypes]
  out_specs = [_row_block(d, (d.N, d.Hv)), _row_block(d, (d.N,))]
  out_shapes = [jax.ShapeDtypeStruct((d.T, d.N, d.Hv), d.q_dtype), jax.ShapeDtypeStruct((d.T, d.N), c.F32)]
  if d.write:  # new K/V rows (and their per-token scales) in; the updated pages out (aliased, in HBM)
    in_specs += [_row_block(d, (d.K, d.H)), _row_block(d, (d.K, d.Hv))] + [_row_block(d, (d.K,))] * num_scales
    in_dtypes += [d.page_dtype] * 2 + [c.F32] * num_scales
    out_specs += [_any()] * (2 + num_scales)
    out_shapes += [jax.ShapeDtypeStruct(page_shape(d, h), d.page_dtype) for h in (d.H, d.Hv)]
    out_shapes += [jax.ShapeDtypeStruct((d.P, d.ps, d.K), c.F32)] * num_scales
  return c.CallPlan(
    grid=(d.T // d.bq,),
    in_specs=tuple(in_specs),
    in_dtypes=tuple(in_dtypes),
    out_specs=tuple(out_specs),
    out_shapes=tuple(out_shapes),
    scratch=(
      *_kv_scratch(d),
      # q, kv head major, each head group folded (`walk.fold`) once per q block; f32, so the narrow path
      # (`PagedDims.window_rows`) slices it at any multiple of 8 rows (a bf16 tile is 16)
      ((d.K, rows, d.H), c.F32),
      ((d.K, rows, c.LANES), c.F32),  # m
      ((d.K, rows, c.LANES), c.F32),  # l
      ((d.K, rows, d.Hv), c.F32),  # acc, folded as q
    ),
  )


def fold_row_stats(d: PagedDims, lse, delta):
  """[T, N] lse and delta -> [K, T * G, 2], row r of head group k: token r // G, q head k * G + r % G (`walk.fold`),
  so the backward reads each group's (lse, delta) columns without a lane-to-sublane reshape (Mosaic has none)."""
  x = jnp.stack([lse, delta], axis=-1).reshape(d.T, d.K, d.G, 2)
  return x.transpose(1, 0, 2, 3).reshape(d.K, d.T * d.G, 2)


def page_grad_buffers(d: PagedDims) -> tuple:
  """Head dims of the one-page VMEM buffers the backward's read-add-write goes through: one for dK and dV, or
  one each when v's head dim differs (MLA)."""
  return (d.H,) if d.Hv == d.H else (d.H, d.Hv)


def bwd_plan(d: PagedDims) -> c.CallPlan:
  num_scales = sum(1 for r in d.scale_rows if r)
  span_specs, span_dtypes = _span_specs(d)
  return c.CallPlan(
    grid=(d.T // d.bq,),
    in_specs=(
      _row_block(d, (d.N, d.H)),  # q
      _row_block(d, (d.N, d.Hv)),  # do
      pl.BlockSpec((d.K, d.bq * d.G, 2), lambda i, *_: (0, i, 0)),  # (lse, delta) (`fold_row_stats`)
      _any(),
      _any(),
      *(_any() for _ in range(num_scales)),
      *span_specs,
      _any(),  # dk pages (aliased to the dk output)
      _any(),  # dv pages
    ),
    in_dtypes=(
      d.q_dtype,
      d.q_dtype,
      c.F32,
      d.page_dtype,
      d.page_dtype,
      *((c.F32,) * num_scales),
      *span_dtypes,
      c.F32,
      c.F32,
    ),
    out_specs=(_row_block(d, (d.N, d.H)), _any(), _any()),
    out_shapes=(
      jax.ShapeDtypeStruct((d.T, d.N, d.H), c.F32),
      jax.ShapeDtypeStruct((d.P, d.ps, d.K, d.H), c.F32),
      jax.ShapeDtypeStruct((d.P, d.ps, d.K, d.Hv), c.F32),
    ),
    scratch=(
      *_kv_scratch(d),
      ((d.bq, d.N, d.H), c.F32),  # dq accumulator
      ((d.ppb, d.ps, d.K, d.H), c.F32),  # dK of one kv block
      ((d.ppb, d.ps, d.K, d.Hv), c.F32),  # dV of one kv block
      # One page of the dK / dV accumulators (read-add-write).
      *(((d.ps, d.K, h), c.F32) for h in page_grad_buffers(d)),
    ),
  )


def launch(kernel, d: PagedDims, plan: c.CallPlan, *, semantics, aliases, interpret, name):
  scratch = [pltpu.VMEM(shape, dtype) for shape, dtype in plan.scratch]
  scratch.append(pltpu.SemaphoreType.DMA((d.slots + 1,)))  # one per kv slot, one for the kernel's own copies
  scratch.append(pltpu.SMEM((2 * d.slots,), jnp.int32))  # tokens and rows copied into each kv slot (`walk.Refs`)

  def run(*args):
    args = vma.unify(*args)
    mat = vma.manual_axis_type(args[4])
    out_shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=mat) for o in plan.out_shapes]
    return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=4,
        grid=plan.grid,
        in_specs=list(plan.in_specs),
        out_specs=list(plan.out_specs),
        scratch_shapes=scratch,
      ),
      out_shape=out_shapes,
      input_output_aliases=aliases,
      compiler_params=c.compiler_params(semantics, interpret, bounds_checks=False),  # page ids clamped
      interpret=interpret,
      name=name,
    )(*args)

  return run


def operands(d: PagedDims, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale):
  cu = ragged.effective_cu(cu_q_lens, num_seqs)  # past num_seqs / decreasing entries flattened, as in XLA
  table = page_indices
  if d.ppt > table.shape[1]:
    table = jnp.pad(table, ((0, 0), (0, d.ppt - table.shape[1])), constant_values=-1)
  prefetch = (cu, kv_lens, table.reshape(-1), num_seqs)
  scales = []
  for x in (k_scale, v_scale):
    if x is None:
      continue
    x = x.astype(c.F32)
    if x.ndim == 0:
      x = jnp.broadcast_to(x, (d.P, 1, d.K))
    elif x.ndim == 2:
      x = x[:, None, :]
    scales.append(x)
  return prefetch, tuple(scales)


def spec_dims(q, k_pages, v_pages, page_indices, k_scale, v_scale, spec, interpret, *, slots: int, write=False):
  block_q, block_kv = spec.block_sizes.block_q, spec.block_sizes.block_kv
  ps = page_size(k_pages, v_pages)
  bq, ppb = check_supported(q, k_pages, v_pages, block_q=block_q, pages_per_block=block_kv // ps)
  scale_dims = [None if x is None else jnp.asarray(x) for x in (k_scale, v_scale)]
  spans = spec.mask.has_bidirectional
  d = dims_of(q, k_pages, v_pages, page_indices, *scale_dims, bq=bq, ppb=ppb, write=write, spans=spans)
  return dataclasses.replace(d, T=padded_rows(d.T, bq), compiled=interpret is None, slots=slots)


def span_operands(d: PagedDims, ids, kv_lens, cu_q_lens, num_seqs):
  """The bidirectional ids as the kernels read them: the rows' own [T, 1], and the kv id table
  [span_rows, 1, bt] whose row for (sequence s, kv block b) holds the ids of the block's keys (see `span_rows`):
  a key that is one of the call's new tokens of s carries its row's id, any other key 0.  () without ids."""
  if ids is None:
    return ()
  bt = d.block_tokens
  seq, start, valid = ragged.token_owner(cu_q_lens, num_seqs, d.T)
  lens = ragged.seq_q_lens(cu_q_lens, num_seqs)
  first = kv_lens[seq] - lens[seq]  # the row's sequence's first new position
  pos = first + (jnp.arange(d.T) - start)
  row = start // bt + 2 * seq + pos // bt - jnp.maximum(first, 0) // bt  # start: cu[seq] (effective)
  row = jnp.where(valid & (pos >= 0), row, d.span_rows)  # dropped
  table = jnp.zeros((d.span_rows, bt), jnp.int32).at[row, jnp.maximum(pos, 0) % bt].set(ids, mode="drop")
  return ids[:, None], table[:, None, :]

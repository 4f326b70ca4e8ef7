"""Pallas TPU ragged paged attention: one launch for a mixed prefill + decode batch, forward and backward.

Grid: one step per block of `bq` consecutive rows of q (q stays [T, N, H] as
projected; its BlockSpec is (bq, N, H), so nothing is transposed outside the
kernel).  A block may hold rows of several sequences; the step derives
everything else from the scalar-prefetched metadata (SMEM), with no
precomputed schedule:

  1. the first sequence whose rows reach the block (a scalar scan of cu_q_lens);
  2. for each sequence s overlapping the block: its rows in the block, their
     positions (the new tokens are the last q_len of kv_lens[s]), and the kv
     blocks they can see (causal upper end, sliding-window lower end);
  3. for each kv block of `ppb` pages: async copies of the pages (all kv
     heads of a page are contiguous, so one copy per page and per K/V) into a
     two-slot VMEM buffer; the next block (of the same sequence, or the first
     block of the next sequence) is in flight while block b is used;
  4. for each kv head: the G = N / K q heads of its group, folded to one
     (bq * G, H) operand (row r is token r // G, head r % G), meet the block
     in one matmul, so decode under 8:1 GQA fills 8 rows of the MXU per token.

Isolation: a page slot is copied only if the page id is in [0, P) and the
slot is below kv_lens[s]; anything else is never read.  Copied slots past
kv_lens and slots not copied (stale VMEM) are zeroed before the matmuls and
masked, so NaN in foreign pages or tails cannot reach an output.

Backward (one kernel, sequential grid): the same walk recomputes p from the
forward's lse and accumulates dq for the block in VMEM, while dK/dV of each
kv block are added into f32 page buffers in HBM (aliased to the outputs) by
read-add-write copies, one page at a time, so pages shared by several
sequences (prefix sharing) collect the gradient of every reader.

JAX 0.10.2's TPU interpreter cannot index through reshaped refs, so refs are
only indexed (`ref.at[...]`, `ref[...]`) and loaded values are reshaped.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src import paged_metadata as metadata
from flax_ringattn._src import vma
from flax_ringattn._src.backends.pallas_tpu import common as c

SUPPORTED_Q_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


@dataclasses.dataclass(frozen=True)
class PagedDims:
  """Static sizes of one paged launch."""

  T: int  # rows of q
  N: int
  K: int
  H: int
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

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def block_tokens(self) -> int:
    return self.ppb * self.ps

  @property
  def max_blocks(self) -> int:
    return self.ppt // self.ppb


def check_supported(q, k_pages, *, block_q, pages_per_block) -> tuple[int, int]:
  """(bq, ppb) for this call, or NotImplementedError for valid input the kernel does not handle."""
  T = q.shape[0]
  ps = k_pages.shape[1]
  if jnp.dtype(q.dtype) not in SUPPORTED_Q_DTYPES:
    raise NotImplementedError(f"pallas_tpu paged attention supports float32 and bfloat16 q, got q.dtype={q.dtype}")
  sub = c.sublanes(q.dtype)
  if ps % sub:
    raise NotImplementedError(
      f"pallas_tpu paged attention needs page_size to be a multiple of {sub} for {jnp.dtype(q.dtype).name} q "
      f"(a page is a whole number of sublane tiles), got page_size={ps}; use implementation='xla'"
    )
  try:
    bq = c.tpu_tile(T, max(block_q, 1), sub, what="block_q")
  except ValueError as e:
    raise NotImplementedError(f"pallas_tpu paged attention: {e}") from None
  if bq != T and bq % sub:
    raise NotImplementedError(f"pallas_tpu paged attention: block_q={bq} must be a multiple of {sub}")
  return bq, max(1, pages_per_block)


def dims_of(q, k_pages, page_indices, k_scale, v_scale, *, bq, ppb, write=False) -> PagedDims:
  T, N, H = q.shape
  P, ps, K, _ = k_pages.shape
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
  )


# -- call plans (the planner's VMEM model is checked against these) --------------------


def _row_block(d: PagedDims, minor):
  return pl.BlockSpec((d.bq, *minor), lambda i, *_: (i,) + (0,) * len(minor))


def _any():
  return pl.BlockSpec(memory_space=pl.ANY)


def _kv_scratch(d: PagedDims):
  bufs = [((2, d.ppb, d.ps, d.K, d.H), d.page_dtype)] * 2
  bufs += [((2, d.ppb, r, d.K), c.F32) for r in d.scale_rows if r]
  return bufs


def fwd_plan(d: PagedDims) -> c.CallPlan:
  num_scales = sum(1 for r in d.scale_rows if r)
  rows = d.bq * d.G
  in_specs = [_row_block(d, (d.N, d.H)), _any(), _any(), *(_any() for _ in range(num_scales))]
  in_dtypes = [d.q_dtype, d.page_dtype, d.page_dtype, *((c.F32,) * num_scales)]
  out_specs = [_row_block(d, (d.N, d.H)), _row_block(d, (d.N,))]
  out_shapes = [jax.ShapeDtypeStruct((d.T, d.N, d.H), d.q_dtype), jax.ShapeDtypeStruct((d.T, d.N), c.F32)]
  if d.write:  # new K/V rows (and their per-token scales) in; the updated pages out (aliased, in HBM)
    in_specs += [_row_block(d, (d.K, d.H))] * 2 + [_row_block(d, (d.K,))] * num_scales
    in_dtypes += [d.page_dtype] * 2 + [c.F32] * num_scales
    out_specs += [_any()] * (2 + num_scales)
    pages = jax.ShapeDtypeStruct((d.P, d.ps, d.K, d.H), d.page_dtype)
    out_shapes += [pages, pages] + [jax.ShapeDtypeStruct((d.P, d.ps, d.K), c.F32)] * num_scales
  return c.CallPlan(
    grid=(d.T // d.bq,),
    in_specs=tuple(in_specs),
    in_dtypes=tuple(in_dtypes),
    out_specs=tuple(out_specs),
    out_shapes=tuple(out_shapes),
    scratch=(
      *_kv_scratch(d),
      ((d.K, rows, c.LANES), c.F32),  # m
      ((d.K, rows, c.LANES), c.F32),  # l
      ((d.bq, d.N, d.H), c.F32),  # acc, laid out as the output block
    ),
  )


def bwd_plan(d: PagedDims) -> c.CallPlan:
  num_scales = sum(1 for r in d.scale_rows if r)
  page_grads = jax.ShapeDtypeStruct((d.P, d.ps, d.K, d.H), c.F32)
  return c.CallPlan(
    grid=(d.T // d.bq,),
    in_specs=(
      _row_block(d, (d.N, d.H)),  # q
      _row_block(d, (d.N, d.H)),  # do
      _row_block(d, (d.N,)),  # lse
      _row_block(d, (d.N,)),  # delta
      _any(),
      _any(),
      *(_any() for _ in range(num_scales)),
      _any(),  # dk pages (aliased to the dk output)
      _any(),  # dv pages
    ),
    in_dtypes=(d.q_dtype, d.q_dtype, c.F32, c.F32, d.page_dtype, d.page_dtype, *((c.F32,) * (num_scales + 2))),
    out_specs=(_row_block(d, (d.N, d.H)), _any(), _any()),
    out_shapes=(jax.ShapeDtypeStruct((d.T, d.N, d.H), c.F32), page_grads, page_grads),
    scratch=(
      *_kv_scratch(d),
      ((d.bq, d.N, d.H), c.F32),  # dq accumulator
      ((d.ppb, d.ps, d.K, d.H), c.F32),  # dK of one kv block
      ((d.ppb, d.ps, d.K, d.H), c.F32),  # dV of one kv block
      ((d.ps, d.K, d.H), c.F32),  # one page of the dK / dV accumulators (read-add-write)
    ),
  )


def _launch(kernel, plan: c.CallPlan, *, num_semaphores, semantics, aliases, interpret, name):
  scratch = [pltpu.VMEM(shape, dtype) for shape, dtype in plan.scratch]
  scratch.append(pltpu.SemaphoreType.DMA((num_semaphores,)))

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
      compiler_params=c.compiler_params(semantics, interpret),
      interpret=interpret,
      name=name,
    )(*args)

  return run


# -- the walk shared by both kernels ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Refs:
  """Scalar metadata, HBM pages and the VMEM kv buffers of one launch."""

  cu: object  # [S + 1] effective cu_q_lens (SMEM)
  kv_lens: object  # [S]
  table: object  # [S * ppt] page ids, -1 padded
  num_seqs: object  # [1]
  k_hbm: object
  v_hbm: object
  scales_hbm: tuple  # k_scale / v_scale [P, rows, K] (None when absent)
  k_buf: object  # [2, ppb, ps, K, H]
  v_buf: object
  scale_bufs: tuple  # [2, ppb, rows, K] (None when absent)
  sem: object  # DMA semaphores; [0] and [1]: the kv slots


def _page_copies(d: PagedDims, r: _Refs, s, b, slot, kv_len):
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


def _kv_valid(d: PagedDims, copies, b, kv_len):
  """[ppb, ps, 1] bool: the slot was copied and is below kv_len."""
  page = jax.lax.broadcasted_iota(jnp.int32, (d.ppb, d.ps, 1), 0)
  slot = jax.lax.broadcasted_iota(jnp.int32, (d.ppb, d.ps, 1), 1)
  ok = jnp.zeros((d.ppb, d.ps, 1), jnp.bool_)
  for j, (page_ok, _, _) in enumerate(copies):
    ok = ok | ((page == j) & page_ok)
  return ok & (b * d.block_tokens + page * d.ps + slot < kv_len)


def _kv_valid_row(d: PagedDims, copies, b, kv_len):
  """[1, ppb * ps] bool: `_kv_valid` laid out along the lanes (the score tile's kv axis)."""
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, d.block_tokens), 1)
  ok = jnp.zeros((1, d.block_tokens), jnp.bool_)
  for j, (page_ok, _, _) in enumerate(copies):
    ok = ok | ((jax.lax.div(lane, d.ps) == j) & page_ok)
  return ok & (b * d.block_tokens + lane < kv_len)


def _load_head(d: PagedDims, buf, scale_buf, slot, k, valid):
  """[ppb * ps, H] float32 values of kv head k (dequantised, zero where not valid), and the scale [ppb, rows, 1]."""
  x = buf[slot, :, :, k, :].astype(c.F32)  # [ppb, ps, H]
  sc = None
  if scale_buf is not None:
    sc = scale_buf[slot, :, :, k][..., None]  # [ppb, rows, 1]
    x = x * sc
  x = jnp.where(valid, x, 0.0)
  return x.reshape(d.block_tokens, d.H), sc


def _fold(x, G):
  """[bq, G, ...] -> [bq * G, ...]: row r is token r // G, head r % G."""
  return x.reshape(x.shape[0] * G, *x.shape[2:])


def _mask(d: PagedDims, spec, q_lo, seq_start, seq_end, first_pos, b, valid_row):
  """[bq * G, block_tokens] visibility of kv block b for the rows of one sequence in this q block."""
  rows = d.bq * d.G
  t = q_lo + jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), d.G)  # global row of q
  pos = first_pos + (t - seq_start)
  kv_pos = b * d.block_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, d.block_tokens), 1)
  vis = (t >= seq_start) & (t < seq_end) & (kv_pos <= pos) & valid_row
  if spec.sliding_window is not None:
    vis = vis & (kv_pos > pos - spec.sliding_window)
  return vis


def _dot(a, b, contract, dtype):
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


def _seq_in_block(d: PagedDims, spec, r: _Refs, s, q_lo) -> _Seq:
  seq_start, seq_end = r.cu[s], r.cu[s + 1]
  kv_len = r.kv_lens[s]
  lo_row, hi_row = jnp.maximum(seq_start, q_lo), jnp.minimum(seq_end, q_lo + d.bq)
  first_pos = kv_len - (seq_end - seq_start)
  lo_pos, hi_pos = first_pos + (lo_row - seq_start), first_pos + (hi_row - 1 - seq_start)
  # lax.div/rem (truncating) on non-negative values: Mosaic lowers floor division through sign(), which
  # needs the TPU generation at lowering time.
  hi = jnp.where(hi_pos < 0, 0, jnp.minimum(jax.lax.div(hi_pos, d.block_tokens) + 1, d.max_blocks))
  hi = jnp.where(hi_row > lo_row, hi, 0)
  lo = jnp.zeros((), jnp.int32)
  if spec.sliding_window is not None:
    lo = jax.lax.div(jnp.maximum(lo_pos - spec.sliding_window + 1, 0), d.block_tokens)
  return _Seq(seq_start, seq_end, kv_len, first_pos, lo_row, hi_row, jnp.minimum(lo, hi), hi)


def _first_seq(d: PagedDims, r: _Refs, q_lo, n):
  """The first sequence whose rows reach the q block (a scalar scan of cu_q_lens)."""
  return jax.lax.while_loop(lambda s: (s < n) & (r.cu[jnp.minimum(s + 1, d.S)] <= q_lo), lambda s: s + 1, 0)


def _walk(d: PagedDims, spec, r: _Refs, q_lo, visit):
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
    g = _seq_in_block(d, spec, r, s, q_lo)
    has_work = g.lo < g.hi

    @pl.when(has_work & ~started)
    def _():
      _start(_page_copies(d, r, s, g.lo, slot, g.kv_len))

    s2 = jnp.minimum(s + 1, d.S - 1)
    g2 = _seq_in_block(d, spec, r, s2, q_lo)
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

  init = (_first_seq(d, r, q_lo, n), jnp.zeros((), jnp.int32), jnp.zeros((), jnp.bool_))
  jax.lax.while_loop(lambda c: live(c[0]), seq_step, init)


def _split_refs(d: PagedDims, refs):
  """Peels the optional scale refs off a kernel's ref list."""
  refs = list(refs)
  scales = []
  for rows in d.scale_rows:
    scales.append(refs.pop(0) if rows else None)
  return tuple(scales), refs


def _split_scratch(d: PagedDims, refs):
  refs = list(refs)
  k_buf, v_buf = refs.pop(0), refs.pop(0)
  scale_bufs = tuple(refs.pop(0) if rows else None for rows in d.scale_rows)
  return k_buf, v_buf, scale_bufs, refs


# -- forward ------------------------------------------------------------------------------


def _fwd_kernel(cu_ref, kv_lens_ref, table_ref, n_ref, q_ref, k_hbm, v_hbm, *rest, d: PagedDims, spec):
  scales_hbm, rest = _split_refs(d, rest)
  new_refs = ()
  if d.write:
    new_k, new_v, *rest = rest
    new_scales, rest = _split_refs(d, rest)
    new_refs = (new_k, new_v, new_scales)
  o_ref, lse_ref, *rest = rest
  if d.write:
    # The page buffers are aliased to these outputs: read and write them there.
    k_hbm, v_hbm, *rest = rest
    scales_hbm, rest = _split_refs(d, rest)
  k_buf, v_buf, scale_bufs, rest = _split_scratch(d, rest)
  m_sc, l_sc, acc_sc, sem = rest
  r = _Refs(cu_ref, kv_lens_ref, table_ref, n_ref, k_hbm, v_hbm, scales_hbm, k_buf, v_buf, scale_bufs, sem)
  G, q_lo = d.G, pl.program_id(0) * d.bq
  m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, c.F32)
  l_sc[...] = jnp.zeros(l_sc.shape, c.F32)
  acc_sc[...] = jnp.zeros(acc_sc.shape, c.F32)

  def visit(s, b, slot, copies, g):
    del s
    valid = _kv_valid(d, copies, b, g.kv_len)
    vis = _mask(d, spec, q_lo, g.start, g.end, g.first_pos, b, _kv_valid_row(d, copies, b, g.kv_len))
    for k in range(d.K):
      kk, _ = _load_head(d, k_buf, scale_bufs[0], slot, k, valid)
      vv, _ = _load_head(d, v_buf, scale_bufs[1], slot, k, valid)
      q = _fold(q_ref[:, k * G : (k + 1) * G, :], G)  # [bq * G, H]
      s_ = _dot(q, kk, ((1,), (1,)), d.q_dtype) * spec.scale
      if spec.logits_soft_cap is not None:
        s_ = spec.logits_soft_cap * jnp.tanh(s_ / spec.logits_soft_cap)
      s_ = jnp.where(vis, s_, -jnp.inf)
      m_prev, l_prev = m_sc[k][:, :1], l_sc[k][:, :1]
      m_new = jnp.maximum(m_prev, s_.max(axis=-1, keepdims=True))
      m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)  # rows that see nothing yet: exp(-inf) = 0, not NaN
      alpha = jnp.exp(m_prev - m_safe)
      p = jnp.exp(s_ - m_safe)
      l_sc[k] = jnp.broadcast_to(alpha * l_prev + p.sum(axis=-1, keepdims=True), (d.bq * G, c.LANES))
      m_sc[k] = jnp.broadcast_to(m_new, (d.bq * G, c.LANES))
      pv = _dot(p, vv, ((1,), (0,)), d.q_dtype)  # [bq * G, H]
      acc = acc_sc[:, k * G : (k + 1) * G, :]
      acc_sc[:, k * G : (k + 1) * G, :] = alpha.reshape(d.bq, G, 1) * acc + pv.reshape(d.bq, G, d.H)

  if d.write:
    _write_block(d, spec, r, new_refs, q_lo)
  _walk(d, spec, r, q_lo, visit)
  for k in range(d.K):
    l = l_sc[k][:, :1].reshape(d.bq, G, 1)
    m = m_sc[k][:, :1].reshape(d.bq, G, 1)
    empty = l == 0.0  # no visible key (padding rows, empty sequences): o = 0, lse = -inf
    l_safe = jnp.where(empty, 1.0, l)
    o_ref[:, k * G : (k + 1) * G, :] = (acc_sc[:, k * G : (k + 1) * G, :] / l_safe).astype(o_ref.dtype)
    lse_ref[:, k * G : (k + 1) * G] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe)).reshape(d.bq, G)


def _write_block(d: PagedDims, spec, r: _Refs, new_refs, q_lo):
  """Fused cache write: the block's rows go into their page slots before the walk reads any page.

  The grid runs in order, so the rows of a sequence in earlier q blocks are already stored when a later block
  reads them; copy-on-write has already given the sequence its own copy of a shared page it writes into.
  """
  q_hi = q_lo + d.bq
  n = jnp.clip(r.num_seqs[0], 0, d.S)

  def seq_step(s):
    g = _seq_in_block(d, spec, r, s, q_lo)
    _write_rows(d, r, new_refs, q_lo, s, g.start, g.lo_row, g.hi_row, g.first_pos)
    return s + 1

  live = lambda s: (s < n) & (r.cu[jnp.minimum(s, d.S)] < q_hi)  # noqa: E731
  jax.lax.while_loop(live, seq_step, _first_seq(d, r, q_lo, n))


def _write_rows(d: PagedDims, r: _Refs, new_refs, q_lo, s, seq_start, lo_row, hi_row, first_pos):
  new_k, new_v, new_scales = new_refs
  pairs = [(new_k, r.k_hbm), (new_v, r.v_hbm)]
  pairs += [(a, b) for a, b in zip(new_scales, r.scales_hbm, strict=True) if a is not None]

  def row(t, carry):
    pos = first_pos + (t - seq_start)
    entry = jax.lax.div(jnp.maximum(pos, 0), d.ps)
    pid = r.table[s * d.ppt + jnp.minimum(entry, d.ppt - 1)]
    ok = (pos >= 0) & (entry < d.ppt) & (pid >= 0) & (pid < d.P)
    slot = jax.lax.rem(jnp.maximum(pos, 0), d.ps)
    safe = jnp.clip(pid, 0, d.P - 1)

    @pl.when(ok)
    def _():
      for src, dst in pairs:
        copy = pltpu.make_async_copy(src.at[t - q_lo], dst.at[safe, slot], r.sem.at[2])
        copy.start()
        copy.wait()

    return carry

  jax.lax.fori_loop(lo_row, hi_row, row, 0)


def _operands(d: PagedDims, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale):
  cu = metadata.effective_cu(cu_q_lens, num_seqs)  # past num_seqs / decreasing entries flattened, as in XLA
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


def _spec_dims(q, k_pages, page_indices, k_scale, v_scale, spec, write=False):
  bq, ppb = check_supported(q, k_pages, block_q=spec.block_q, pages_per_block=spec.pages_per_block)
  scale_dims = [None if x is None else jnp.asarray(x) for x in (k_scale, v_scale)]
  return dims_of(q, k_pages, page_indices, *scale_dims, bq=bq, ppb=ppb, write=write)


def paged_fwd(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, *, spec, interpret):
  """Returns (out [T, N, H] in q.dtype, lse [T, N] float32; -inf for rows not in the batch)."""
  d = _spec_dims(q, k_pages, page_indices, k_scale, v_scale, spec)
  prefetch, scales = _operands(d, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
  kernel = functools.partial(_fwd_kernel, d=d, spec=spec)
  run = _launch(
    kernel, fwd_plan(d), num_semaphores=2, semantics=("parallel",), aliases={}, interpret=interpret, name="paged_fwd"
  )
  out, lse = run(*prefetch, q, k_pages, v_pages, *scales)
  return out, lse


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

  k_new, v_new: [T, K, H] the new tokens' K/V as stored (page dtype; quantized by the caller), with their
  per-token scales [T, K] when the cache keeps scales ([P, page_size, K]).  kv_lens and page_indices are the
  cache's after the append (pages reserved, copy-on-write done).  Returns (out [T, N, H], k_pages, v_pages,
  k_scale, v_scale); the page buffers are aliased to the results (donate them to update in place).
  """
  for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
    if sc is not None and sc.ndim != 3:
      raise NotImplementedError(
        f"the fused cache write stores per-token scales [P, page_size, K], got {name}.ndim={sc.ndim}"
      )
  d = _spec_dims(q, k_pages, page_indices, k_scale, v_scale, spec, write=True)
  prefetch, _ = _operands(d, kv_lens, page_indices, cu_q_lens, num_seqs, None, None)
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
  run = _launch(
    kernel,
    fwd_plan(d),
    num_semaphores=3,
    semantics=("arbitrary",),
    aliases=aliases,
    interpret=interpret,
    name="paged_fwd_write",
  )
  out, _, k_pages, v_pages, *new = run(*operands)
  k_scale, v_scale = (new.pop(0) if x is not None else None for x in (k_scale, v_scale))
  return out, k_pages, v_pages, k_scale, v_scale


# -- backward -----------------------------------------------------------------------------


def _bwd_kernel(
  cu_ref, kv_lens_ref, table_ref, n_ref, q_ref, do_ref, lse_ref, delta_ref, k_hbm, v_hbm, *rest, d: PagedDims, spec
):
  scales_hbm, rest = _split_refs(d, rest)
  _dk_in, _dv_in, dq_ref, dk_hbm, dv_hbm, *rest = rest
  del _dk_in, _dv_in  # the same buffers as dk_hbm / dv_hbm (aliased)
  k_buf, v_buf, scale_bufs, rest = _split_scratch(d, rest)
  dq_sc, dk_blk, dv_blk, page_sc, sem = rest
  r = _Refs(cu_ref, kv_lens_ref, table_ref, n_ref, k_hbm, v_hbm, scales_hbm, k_buf, v_buf, scale_bufs, sem)
  G, q_lo, rows = d.G, pl.program_id(0) * d.bq, d.bq * d.G
  dq_sc[...] = jnp.zeros(dq_sc.shape, c.F32)

  def visit(s, b, slot, copies, g):
    del s
    valid = _kv_valid(d, copies, b, g.kv_len)
    vis = _mask(d, spec, q_lo, g.start, g.end, g.first_pos, b, _kv_valid_row(d, copies, b, g.kv_len))
    for k in range(d.K):
      kk, k_sc = _load_head(d, k_buf, scale_bufs[0], slot, k, valid)
      vv, v_sc = _load_head(d, v_buf, scale_bufs[1], slot, k, valid)
      heads = slice(k * G, (k + 1) * G)
      q = _fold(q_ref[:, heads, :], G)
      do = _fold(do_ref[:, heads, :], G)
      lse = lse_ref[:, heads].reshape(rows, 1)
      lse = jnp.where(jnp.isneginf(lse), 0.0, lse)
      delta = delta_ref[:, heads].reshape(rows, 1)
      s_ = _dot(q, kk, ((1,), (1,)), d.q_dtype) * spec.scale
      t = None
      if spec.logits_soft_cap is not None:
        t = jnp.tanh(s_ / spec.logits_soft_cap)
        s_ = spec.logits_soft_cap * t
      p = jnp.where(vis, jnp.exp(jnp.where(vis, s_, 0.0) - lse), 0.0)  # [rows, L]
      dv = _dot(p, do, ((0,), (0,)), d.q_dtype)  # [L, H]
      dp = _dot(do, vv, ((1,), (1,)), d.q_dtype)
      ds = p * (dp - delta)
      if t is not None:
        ds = ds * (1.0 - t * t)
      ds = ds * spec.scale
      dq = _dot(ds, kk, ((1,), (0,)), d.q_dtype)  # [rows, H]
      dq_sc[:, heads, :] = dq_sc[:, heads, :] + dq.reshape(d.bq, G, d.H)
      dk = _dot(ds, q, ((0,), (0,)), d.q_dtype).reshape(d.ppb, d.ps, d.H)
      dv = dv.reshape(d.ppb, d.ps, d.H)
      # Gradients with respect to the stored values: d(stored) = d(dequantised) * scale.
      if k_sc is not None:
        dk = dk * k_sc
      if v_sc is not None:
        dv = dv * v_sc
      dk_blk[:, :, k, :] = jnp.where(valid, dk, 0.0)
      dv_blk[:, :, k, :] = jnp.where(valid, dv, 0.0)

    # Read-add-write of every page read, one at a time (a page may repeat in a table row).
    def add_page(j, pid):
      for acc_hbm, blk in ((dk_hbm, dk_blk), (dv_hbm, dv_blk)):
        rd = pltpu.make_async_copy(acc_hbm.at[pid], page_sc, sem.at[2])
        rd.start()
        rd.wait()
        page_sc[...] = page_sc[...] + blk[j]
        wr = pltpu.make_async_copy(page_sc, acc_hbm.at[pid], sem.at[2])
        wr.start()
        wr.wait()

    for j, (ok, pid, _) in enumerate(copies):
      pl.when(ok)(functools.partial(add_page, j, pid))

  _walk(d, spec, r, q_lo, visit)
  dq_ref[...] = dq_sc[...]


def paged_bwd(
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, out, lse, do, *, spec, interpret
):
  """(dq [T, N, H], dk_pages, dv_pages [P, page_size, K, H]) in float32, as the XLA backend's `paged_bwd`."""
  d = _spec_dims(q, k_pages, page_indices, k_scale, v_scale, spec)
  prefetch, scales = _operands(d, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale)
  delta = jnp.sum(do.astype(c.F32) * out.astype(c.F32), axis=-1)  # [T, N]
  zeros = jnp.zeros((d.P, d.ps, d.K, d.H), c.F32)
  operands = (*prefetch, q, do.astype(q.dtype), lse, delta, k_pages, v_pages, *scales, zeros, zeros)
  n = len(operands)
  kernel = functools.partial(_bwd_kernel, d=d, spec=spec)
  # dK/dV pages are read-modified-written across grid steps: the steps run in order on one core.
  run = _launch(
    kernel,
    bwd_plan(d),
    num_semaphores=3,
    semantics=("arbitrary",),
    aliases={n - 2: 1, n - 1: 2},
    interpret=interpret,
    name="paged_bwd",
  )
  dq, dk, dv = run(*operands)
  return dq, dk, dv

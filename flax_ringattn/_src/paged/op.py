"""`paged_attention`: ragged mixed prefill + decode attention over a paged KV cache.

Public front end: validation, one options object (`AttentionSpec`), the implementation from the paged registry
(`implementations.py`), opt-in dynamic checks (`checks.py`); differentiated by the one `flash` custom_vjp.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, PartitionSpec

from flax_ringattn._src import flash, masks, sharding, validation, vma
from flax_ringattn._src.block_sizes import BlockSizes
from flax_ringattn._src.options import AttentionSpec
from flax_ringattn._src.paged import allocator, common
from flax_ringattn._src.paged import context_parallel as cp
from flax_ringattn._src.paged.checks import check_metadata
from flax_ringattn._src.paged.implementations import PAGED


def paged_attention(
  q,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  cu_q_lens,
  num_seqs,
  *,
  local_window_size=None,
  logits_soft_cap: float | None = None,
  scale: float | None = None,
  k_scale=None,
  v_scale=None,
  implementation: str | None = None,
  block_sizes: BlockSizes | None = None,
  checked: bool = False,
  interpret=None,
  sliding_window: int | None = None,
  sinks=None,
  chunk_size: int | None = None,
  bidirectional_ids=None,
  mesh=None,
  seq_axis=None,
  axis_name=None,
  head_axis=None,
):
  """Attention of a ragged batch of new tokens over their sequences' paged KV cache.

  Args:
    q: [T, N, H] new tokens of all sequences back to back (T =
      max_num_batched_tokens; rows past cu_q_lens[num_seqs] are padding and
      return 0).  Heads stay in the second-minor dimension, as projected.
    k_pages, v_pages: [P, page_size, K, H] / [P, page_size, K, Hv] page-major
      caches (N % K == 0; v's head dim Hv may differ, as in MLA); float, or
      int8 / float8 with `k_scale` / `v_scale`.  Or merged, [P, page_size, K * H]
      / [P, page_size, K * Hv] (a token's kv heads side by side; K = the last
      dim / q's H): the Pallas TPU kernel reads those densely for any K and
      head dim (`PagedKVCache.create(merged=True)`); cotangents keep the layout.
      Or kv pages: k_pages [P, 2, page_size, K * H] (a page's merged K, then
      its merged V; v's head dim is H) with v_pages=None, the layout the
      Pallas TPU kernel copies with one DMA per page instead of two (pages of
      few kv heads are small, and a decode's time goes to issuing their
      copies); `PagedKVCache.create(merged="kv")`.
    kv_lens: [S] tokens of each sequence in the cache, new tokens included.
    page_indices: [S, pages_per_seq] page ids of each sequence, in order.
    cu_q_lens: [S + 1] sequence i owns rows cu_q_lens[i] .. cu_q_lens[i+1]-1.
    num_seqs: [1] sequences in use (dynamic: no recompilation).
    local_window_size: int w or (left, right), as in `jax.nn.dot_product_attention`:
      a token at position i sees the cached tokens in [i - left, i] (paged
      attention is causal, so `right` changes nothing).  Gemma's
      "sliding window of W tokens" is local_window_size=(W - 1, 0).
    logits_soft_cap: c > 0: logits become c * tanh(logits / c).
    scale: logit scale, default H ** -0.5.
    k_scale, v_scale: Python floats, or float arrays of shape () or [P, K] (per
      page and kv head) or [P, page_size, K] (per token); dequantised value =
      stored * scale.  A float is converted to an array inside but is a constant
      of the enclosing jit (a new value retraces); pass an array to change the
      value without recompiling.
    implementation: "pallas_tpu" (the ragged paged Pallas TPU kernel,
      `_src/backends/pallas_tpu/paged/`), "xla" (portable), or None: the
      TPU kernel on a TPU when it supports the call, else XLA
      (`available_implementations(op="paged")`).
    block_sizes: `BlockSizes(block_q=rows per chunk, block_kv=kv tokens per
      step, a multiple of page_size)`.  None: (16, 128) on XLA; on pallas_tpu
      `plan_paged_block_sizes`, which fits both kernels in the chip's VMEM.
    checked: under `jit`, add `checkify` checks of the metadata's values
      (num_seqs in range, cu_q_lens starting at 0 and non-decreasing, at most T
      new tokens, q_len <= kv_len, kv_lens within pages_per_seq * page_size,
      page ids in [0, P) for the pages a sequence uses); run the call under
      `jax.experimental.checkify.checkify`.  Called on concrete arrays, the
      same checks always run and raise `ValueError` (naming the operand, the
      slot or position, and the value), whatever `checked` says.  Unchecked
      under `jit`, bad metadata can still never make a sequence read outside
      its own pages: such slots are masked.
    interpret: run the pallas_tpu kernel in Pallas TPU interpret mode (on CPU):
      True or a `jax.experimental.pallas.tpu.InterpretParams`, with
      implementation="pallas_tpu" (without an implementation it still picks
      pallas_tpu, with a DeprecationWarning).
    sliding_window: deprecated (warns once): each token sees at most this many
      tokens, itself included; the same as local_window_size=(sliding_window - 1, 0).
    chunk_size: C: a row sees only the keys in its own chunk of C positions,
      q_pos // C == kv_pos // C (Llama 4's chunked attention), with causal
      and the window as usual.
    bidirectional_ids: [T] int, one id per row of q (Gemma 3's image tokens,
      a prefix-LM prefix): this call's new tokens of one sequence with the
      same nonzero id see each other in both directions, later rows of the
      call included, whatever causal, window and chunk say; 0: no span.  The
      keys cached by earlier calls carry id 0, so a span must lie whole in
      one call (its rows' K/V are written in it): a query cannot see a token
      that is not in the cache yet.  Rows of different sequences never meet.
    sinks: optional [N] float attention-sink logits, one per q head
      (differentiable), as in `ring_attention`: exp(sinks[h]) joins the
      softmax denominator of every row of head h and carries no value.

    mesh, seq_axis: context parallelism: the cache's pages are spread over
      mesh axis `seq_axis` (default: the mesh's only axis), sharded on the page
      dimension (device d of n owns the global page ids [d * P / n,
      (d + 1) * P / n), as `PagedKVCache.create(..., mesh=, seq_axis=)` lays
      them out); page_indices keep global ids.  Each device attends over its
      own pages and the partials are merged exactly (one psum of
      [T, N, Hv + 1] and one pmax of [T, N]); q, the metadata and the output
      are replicated over the axis.  P must be a multiple of n.
    axis_name: the same inside your own `jax.shard_map` over that (bound) axis:
      k_pages / v_pages (and per-page scales) are then this device's shards,
      everything else replicated.
    head_axis: with `mesh`, a second mesh axis the kv heads are split over
      (with their q heads, sinks and per-head scales); with or without
      `seq_axis`.

  Returns:
    [T, N, Hv] in q.dtype.  Differentiable in q, k_pages, v_pages and sinks
    (page gradients are scatter-added into the pages each sequence reads).
  """
  call = plan_call(
    q,
    k_pages,
    v_pages,
    kv_lens,
    page_indices,
    cu_q_lens,
    num_seqs,
    k_scale=k_scale,
    v_scale=v_scale,
    local_window_size=local_window_size,
    sliding_window=sliding_window,
    chunk_size=chunk_size,
    bidirectional_ids=bidirectional_ids,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    implementation=implementation,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  validation.check_bool("checked", checked)
  sinks = _as_array(validation.check_sinks(sinks, q.shape[1]))
  q, k_pages, v_pages = (_as_array(x) for x in (q, k_pages, v_pages))  # numpy in: the kernels index with tracers
  K = common.page_dims(q, k_pages, v_pages)[2]
  seq_axis, shards = context_parallel_axis(mesh, seq_axis, axis_name, k_pages.shape[0], head_axis, K)
  # Inside the caller's shard_map the pages are this device's shard: the ids in the table are global.
  num_pages = k_pages.shape[0] * (shards if axis_name is not None else 1)
  check_metadata(*call.metadata, q.shape[0], num_pages, common.page_size_of(k_pages, v_pages), checked=checked)
  if is_empty(q):
    return empty_out(q, k_pages, v_pages)
  args = (q, k_pages, v_pages, *call.metadata, call.k_scale, call.v_scale, call.bidirectional_ids)
  if axis_name is not None:
    return flash.flash(PagedKernel(spec=call.spec, backend=call.backend, axis_name=axis_name), sinks, *args)
  if seq_axis is not None or head_axis is not None:
    kernel = PagedKernel(spec=call.spec, backend=call.backend, axis_name=seq_axis)
    return _on_mesh(kernel, mesh, seq_axis, head_axis, sinks, args)
  kernel = PagedKernel(spec=call.spec, backend=call.backend)
  mesh = _explicit_mesh((*args, sinks))
  if mesh is None:
    return flash.flash(kernel, sinks, *args)
  # Arrays typed on an Explicit mesh (e.g. replicated parameters' outputs): the
  # op works per device, so run it as a replicated shard_map over that mesh.
  return _on_mesh(kernel, mesh, None, None, sinks, args)


def is_empty(q) -> bool:
  """q [T, N, H] holds no row or no head: the output [T, N, Hv] is empty (T = 0 also for a layer step of 0 tokens)."""
  return 0 in q.shape[:2]


def empty_out(q, k_pages, v_pages):
  """The empty output, as `jax.nn.dot_product_attention` returns one: no kernel runs, and the gradients are zeros
  of the inputs' shapes."""
  return jnp.zeros((*q.shape[:2], common.page_dims(q, k_pages, v_pages)[4]), q.dtype)


def context_parallel_axis(mesh, seq_axis, axis_name, pages: int, head_axis=None, kv_heads: int = 1):
  """(seq_axis, n): the mesh axis (or axes) the pages are spread over and its size; (None, 1) without context
  parallelism.  With `axis_name` (inside the caller's shard_map) seq_axis stays None and n is the bound size.
  Also checks `head_axis` (kv heads split over it, with `mesh`)."""
  if head_axis is not None and mesh is None:
    raise ValueError(f"head_axis={head_axis!r} needs mesh=... (inside your own shard_map the heads are yours)")
  if axis_name is not None:
    if mesh is not None or seq_axis is not None:
      raise ValueError(
        f"pass axis_name={axis_name!r} inside your own shard_map, or mesh=... with seq_axis=..., not both"
      )
    axes = axis_name if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not all(sharding.axis_is_bound(a) for a in axes):
      raise ValueError(
        f"axis_name={axis_name!r} is not bound: call paged_attention inside jax.shard_map over a mesh with that "
        "axis (k_pages / v_pages sharded on their page dimension), or pass mesh=... and seq_axis=..."
      )
    return None, jax.lax.axis_size(axis_name)
  if seq_axis is not None and mesh is None:
    raise ValueError(f"seq_axis={seq_axis!r} needs mesh=... (inside your own shard_map pass axis_name=...)")
  if mesh is None:
    return None, 1
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if head_axis is None or seq_axis is not None:
    seq_axis = sharding.sequence_axis(mesh, seq_axis, arg="seq_axis")
  if isinstance(seq_axis, list):
    seq_axis = tuple(seq_axis)
  sharding.check_mesh_axes(mesh, where="paged_attention", seq_axis=seq_axis, head_axis=head_axis)
  if head_axis is not None:
    seq_axes = () if seq_axis is None else seq_axis if isinstance(seq_axis, tuple) else (seq_axis,)
    if head_axis in seq_axes:
      raise ValueError(f"seq_axis={seq_axis!r} and head_axis={head_axis!r} must be different mesh axes")
    tp = sharding.axes_size(mesh, head_axis)
    if kv_heads % tp:
      raise ValueError(
        f"kv heads K={kv_heads} must be a multiple of the {head_axis!r} mesh axis size {tp}: heads are split so "
        "every device keeps whole GQA groups"
      )
  if seq_axis is None:
    return None, 1
  n = sharding.axes_size(mesh, seq_axis)
  if pages % n:
    raise ValueError(
      f"k_pages has P={pages} pages, which must be a multiple of the {seq_axis!r} axis size {n}: each device owns "
      "P / n of them (PagedKVCache.create(..., mesh=, seq_axis=) allocates so)"
    )
  return seq_axis, n


def scale_spec(x, seq_axis, head_axis):
  """The partition of a k/v scale: () replicated; [P, K] and [P, page_size, K] split with their pages."""
  if x is None:
    return None
  return PartitionSpec() if x.ndim == 0 else PartitionSpec(seq_axis, *(None,) * (x.ndim - 2), head_axis)


def shard_mapped(fn, mesh, args, in_specs, out_specs):
  """fn(*args) as a shard_map over `mesh`, the arrays first laid out as `in_specs` (None: an absent operand);
  returns (its result, the laid-out arguments)."""
  placed = [x if s is None else sharding.constrain(x, mesh, s) for x, s in zip(args, in_specs, strict=True)]
  return jax.shard_map(fn, mesh=mesh, in_specs=tuple(in_specs), out_specs=out_specs)(*placed), placed


def _on_mesh(kernel, mesh, seq_axis, head_axis, sinks, args):
  """`kernel` as a shard_map over `mesh`: the pages and per-page scales split on their page dimension over
  `seq_axis` (context parallelism) and on their kv heads over `head_axis`, q, the output and the sinks on their
  heads; the metadata replicated (neither axis: everything replicated)."""
  k_scale, v_scale, ids = args[-3:]
  h, rep = head_axis, PartitionSpec()
  # Merged pages [P, page_size, K * H] split on their last dim: a device's kv heads' lanes are consecutive.
  pages = PartitionSpec(seq_axis, None, h, *(None,) * (args[1].ndim - 3))
  if common.kv_together(args[2]):  # kv pages [P, 2, page_size, K * H]
    pages = PartitionSpec(seq_axis, None, None, h)
  specs = (
    None if sinks is None else PartitionSpec(h),
    PartitionSpec(None, h, None),  # q [T, N, H]: a kv head's q heads are consecutive (K-major)
    pages,
    None if args[2] is None else pages,
    rep,
    rep,
    rep,
    rep,
    scale_spec(k_scale, seq_axis, h),
    scale_spec(v_scale, seq_axis, h),
    None if ids is None else rep,
  )
  fn = lambda sinks, *a: flash.flash(kernel, sinks, *a)  # noqa: E731
  return shard_mapped(fn, mesh, (sinks, *args), specs, PartitionSpec(None, h, None))[0]


@dataclasses.dataclass(frozen=True)
class PagedCall:
  """One paged attention call, validated once (`plan_call`): its options (`spec`), backend, scales, int32
  metadata and bidirectional ids.  It attends (`paged_attention`), and, where its backend has one, attends and
  writes the new tokens' K/V into their pages in the same kernel (`fuses_cache_write`, `attend_and_write`)."""

  spec: AttentionSpec
  backend: object
  k_scale: object
  v_scale: object
  metadata: tuple  # (kv_lens, page_indices, cu_q_lens, num_seqs) as int32 arrays
  bidirectional_ids: object = None  # [T] int32, or None
  merged: bool = False  # pages [P, page_size, K * H], or kv pages [P, 2, page_size, K * H]

  @property
  def fuses_cache_write(self) -> bool:
    """Whether `attend_and_write` runs: a backend with a fused write, per-token ([P, page_size, K]) scales or none,
    no bidirectional ids (the kernel writes q block by q block, so a span reaching past its block would read
    keys not written yet), and 4-D pages (on a TPU, Mosaic refuses the one-row writes into merged pages: "Offsets
    along tiled dimensions must be aligned to tiles", seen on a v5e; merged caches append, then attend)."""
    per_token = all(x is None or x.ndim == 3 for x in (self.k_scale, self.v_scale))
    spans = self.spec.mask.has_bidirectional
    return getattr(self.backend, "fused_cache_write", False) and per_token and not spans and not self.merged

  def with_cache(self, k_scale, v_scale, kv_lens, page_indices) -> PagedCall:
    """The same call over a cache whose pages were reserved since (`PagedKVCache.reserve_append`): the new
    lengths, page table and scales, nothing validated again (their shapes are the ones checked)."""
    cu, n = self.metadata[2:]
    metadata = tuple(jnp.asarray(x, jnp.int32) for x in (kv_lens, page_indices)) + (cu, n)
    return dataclasses.replace(self, k_scale=_as_array(k_scale), v_scale=_as_array(v_scale), metadata=metadata)

  def attend_and_write(
    self, q, k_new, v_new, k_pages, v_pages, *, k_new_scale=None, v_new_scale=None, sinks=None, checked=False,
    mesh=None, seq_axis=None,
  ):  # fmt: skip
    """Attention with the fused cache write: (out [T, N, Hv], k_pages, v_pages, k_scale, v_scale).

    k_new, v_new: [T, K, H] / [T, K, Hv] the new tokens' K/V as the pages store them, with per-token scales
    [T, K] for a scaled cache; the call's pages, scales and metadata are the cache's after
    `PagedKVCache.reserve_append` (pages reserved, copy-on-write done, kv_lens grown: `with_cache`).  The pages
    come back with the new tokens written in the same launch (buffers aliased: donate them to update in place).
    Serving only: not differentiable.  `sinks`, `checked`, `mesh` and `seq_axis` as for `paged_attention` (the
    sinks rescale the finished rows, as `flash` does; with the pages spread over `seq_axis`, each device writes
    the new rows of the pages it owns and attends over them, and the partials merge exactly).  Raises
    `NotImplementedError` where `fuses_cache_write` is False.
    """
    if not self.fuses_cache_write:
      raise NotImplementedError(
        f"this paged call has no fused cache write (backend {type(self.backend).__name__}, bidirectional ids "
        f"{self.bidirectional_ids is not None}, scales {getattr(self.k_scale, 'shape', None)}, merged pages "
        f"{self.merged}): append the new "
        "tokens (PagedKVCache.append), then attend (paged_attention)"
      )
    q, k_new, v_new, k_pages, v_pages = (_as_array(x) for x in (q, k_new, v_new, k_pages, v_pages))
    seq_axis, _ = context_parallel_axis(mesh, seq_axis, None, k_pages.shape[0])
    check_metadata(*self.metadata, q.shape[0], k_pages.shape[0], common.page_size_of(k_pages, v_pages), checked=checked)
    sinks = _as_array(validation.check_sinks(sinks, q.shape[1]))
    if is_empty(q):  # no new token: the pages stay as they are
      return empty_out(q, k_pages, v_pages), k_pages, v_pages, self.k_scale, self.v_scale
    kernel = PagedKernel(spec=self.spec, backend=self.backend, axis_name=seq_axis)
    new = (k_new, v_new, k_pages, v_pages, *self.metadata, self.k_scale, self.v_scale, k_new_scale, v_new_scale)
    spec, backend = self.spec, self.backend

    def write_and_attend(sinks, q, k_new, v_new, k_pages, v_pages, kv_lens, table, *rest):
      if seq_axis is not None:  # write and read only this device's pages, then merge
        table = cp.owned_page_ids(table, seq_axis, k_pages.shape[0])
      out, lse, *cache = backend.fwd_write(q, k_new, v_new, k_pages, v_pages, kv_lens, table, *rest, spec=spec)
      if seq_axis is not None:
        out, lse = cp.merge_partials(out, lse, seq_axis)
      out, _ = flash.apply_sinks(kernel, out, lse, sinks)
      return (out.astype(q.dtype), *cache)

    if seq_axis is None:
      return write_and_attend(sinks, q, *new)
    rep, paged = PartitionSpec(), PartitionSpec(seq_axis)
    scales = tuple(scale_spec(x, seq_axis, None) for x in (self.k_scale, self.v_scale))  # per token: with the pages
    new_scales = tuple(None if x is None else rep for x in (k_new_scale, v_new_scale))
    specs = (None if sinks is None else rep, rep, rep, rep, paged, paged, rep, rep, rep, rep, *scales, *new_scales)
    (out, *cache), placed = shard_mapped(write_and_attend, mesh, (sinks, q, *new), specs, (rep, paged, paged, *scales))
    # The updated pages typed exactly as they came in (an Explicit mesh's spec spelling is part of a jit's key).
    before = (*placed[4:6], *placed[10:12])  # k_pages, v_pages, k_scale, v_scale
    return (out, *(x if x is None else allocator.placed_like(x, y) for x, y in zip(cache, before, strict=True)))


def plan_call(
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
  local_window_size=None,
  sliding_window=None,
  chunk_size=None,
  bidirectional_ids=None,
  logits_soft_cap=None,
  scale=None,
  implementation=None,
  block_sizes=None,
  interpret=None,
) -> PagedCall:
  """The `PagedCall` of these operands and options (those of `paged_attention`), validated statically, with its
  implementation chosen."""
  k_scale, v_scale = common.normalize_scales(k_scale, v_scale)
  T, N, H, P, ps, K, S, pps = common.check_paged_inputs(
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale
  )
  window = common.paged_window(local_window_size, sliding_window)
  cap = validation.check_soft_cap(logits_soft_cap)
  ids = common.check_bidirectional_ids(bidirectional_ids, T)
  common.check_block_sizes(block_sizes)
  if block_sizes is not None and block_sizes.block_kv % ps and ps % block_sizes.block_kv:
    raise ValueError(f"block_sizes.block_kv={block_sizes.block_kv} must be a multiple of page_size={ps}")
  # An empty q (no row, or no head) runs no kernel (`is_empty`); the implementation is still chosen, and the
  # options checked, as for one row.
  probe = jax.ShapeDtypeStruct((max(T, 1), N or K, H), q.dtype) if is_empty(q) else q
  shape = dict(
    q=probe, k_pages=k_pages, v_pages=v_pages, k_scale=k_scale, v_scale=v_scale, pages_per_seq=pps, logits_soft_cap=cap
  )
  shape |= {"bidirectional": True} if ids is not None else {}
  backend = PAGED.select(implementation, interpret=interpret, block_sizes=block_sizes, **shape).backend
  blocks = backend.blocks(block_sizes=block_sizes, **shape)
  pages_per_block = max(1, min(blocks.block_kv // ps, pps))
  spec = AttentionSpec(
    mask=masks.MaskSpec(
      is_causal=True,
      window=window,
      chunk_size=validation.check_chunk_size(chunk_size),
      has_bidirectional=ids is not None,
    ),
    scale=validation.check_scale(scale, H),
    logits_soft_cap=cap,
    block_sizes=BlockSizes(block_q=min(blocks.block_q, max(T, 1)), block_kv=pages_per_block * ps),
  )
  metadata = tuple(jnp.asarray(x, jnp.int32) for x in (kv_lens, page_indices, cu_q_lens, num_seqs))
  return PagedCall(
    spec, backend, _as_array(k_scale), _as_array(v_scale), metadata, ids, merged=k_pages.ndim == 3 or v_pages is None
  )


def _as_array(x):
  """A checked operand (numpy, or None) as a jax array: the kernels index it with traced ids."""
  return x if x is None or isinstance(x, jax.Array) else jnp.asarray(x)


@dataclasses.dataclass(frozen=True)
class PagedKernel:
  """Paged attention as a `flash.FlashKernel`: operands (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
  num_seqs, k_scale, v_scale, bidirectional_ids); o [T, N, Hv], lse [T, N].  With `axis_name` (bound: inside `jax.shard_map`) the
  pages are this device's shard of a cache spread over that axis, and the partials are merged across it
  (`context_parallel.py`)."""

  spec: AttentionSpec
  backend: object
  axis_name: object = None

  @staticmethod
  def rows_to_lse(rows):
    return rows  # [T, N] both

  lse_to_rows = rows_to_lse

  def forward(self, *operands):
    if self.axis_name is None:
      return self.backend.fwd(*operands, spec=self.spec)
    o, lse = self.backend.fwd(*self._local(operands), spec=self.spec)
    return cp.merge_partials(o, lse, self.axis_name)

  def _local(self, operands):
    # Compacted decode rows sit at local positions: only exact when every earlier token is visible anyway.
    compact = self.spec.mask.window is None and self.spec.mask.chunk_size is None
    return cp.local_operands(operands, self.axis_name, compact=compact)

  def backward(self, operands, lse, do, delta):
    q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, _ = operands
    local = operands if self.axis_name is None else self._local(operands)
    *local, ids = local
    dq, dk, dv = self.backend.bwd(*local, lse, do, delta, spec=self.spec, bidirectional_ids=ids)
    # Each device's dq covers its own pages' keys: the whole dq is their sum (q is replicated over the axis).
    dq = vma.sum_to(dq, q)
    return (
      dq.astype(q.dtype),
      _page_cotangent(dk, k_pages),
      _page_cotangent(dv, v_pages),
      None,
      None,
      None,
      None,
      _zero_cotangent(k_scale),
      _zero_cotangent(v_scale),
      None,
    )


def _zero_cotangent(x):
  if x is None:
    return None
  if jnp.issubdtype(x.dtype, jnp.floating):
    return jnp.zeros_like(x)
  return jnp.zeros(x.shape, jax.dtypes.float0)


def _page_cotangent(g, pages):
  if pages is None:  # kv pages: k_pages' cotangent holds both
    return None
  if jnp.issubdtype(pages.dtype, jnp.floating):
    return g.astype(pages.dtype)
  return jnp.zeros(pages.shape, jax.dtypes.float0)  # int8 pages: not differentiable


def _explicit_mesh(args):
  mesh = None
  for x in args:
    if x is None:
      continue
    sharding = getattr(jax.typeof(x), "sharding", None)
    m = getattr(sharding, "mesh", None)
    if m is None or not m.axis_names or not any(t == AxisType.Explicit for t in m.axis_types):
      continue
    if any(e is not None for e in sharding.spec):
      raise ValueError(
        f"paged_attention got an input sharded as {sharding.spec} over Explicit mesh axes: pass mesh=... with "
        "seq_axis=... (pages spread over a sequence axis, as PagedKVCache.create(mesh=, seq_axis=) lays them out) "
        "and / or head_axis=... (kv heads split), or call it inside your own jax.shard_map"
      )
    mesh = m
  return mesh

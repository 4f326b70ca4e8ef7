"""TPU tile rules and call plans: the lowest layer of the Pallas TPU backend.

Every buffer a kernel allocates is described once, by `CallPlan`: the grid, the
BlockSpecs of its operands and results, and its scratch shapes.  The kernels
build their `pl.pallas_call` from a plan (`common.call`), and the VMEM
footprint models of `planners/` are tested against the footprint of the same
plans, so a model cannot drift from the code.  Both the kernels and the
planners import this module; it imports neither.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

LANES = 128  # minor (lane) dimension of a TPU vreg
# SMEM is 1 MiB per core from v4 on (JAX's tpu_info); the two scalar-prefetched
# tile tables of one kernel may use half of it.
SMEM_BYTES = 1024 * 1024
SMEM_TABLE_BYTES = SMEM_BYTES // 2
# kv blocks in the paged kernels' VMEM (`paged.walk.walk`): slots - 1 in flight while one is computed.  On a v5e
# (2026-12-08; 64 decodes of 2064 tokens, 14 / 2 / 64, kv pages of 64, blocks of 1024) 2, 3 and 4 forward slots
# ran 0.274, 0.269 and 0.275 ms: a second block in flight buys nothing there, and costs a block of VMEM.
PAGED_FWD_SLOTS = 2
PAGED_BWD_SLOTS = 2
F32 = jnp.float32


def strided_lanes(head_dims: tuple[int, ...]) -> bool:
  """Whether buffers `head_dims` wide can be read or written a head at a time with sublane-strided loads and
  stores: Mosaic strides only buffers exactly 128 lanes wide ("The last dim size is not 128 in original base
  memref" on a v5e, for 192).  The one rule behind `flat_kv_pages` and `token_major_forward`."""
  return all(h == LANES for h in head_dims)


def flat_kv_pages(page_dtype, num_kv_heads: int, head_dims: tuple[int, ...]) -> bool:
  """Whether the paged kernels keep a kv block as one flat [tokens * K, H] VMEM buffer (row t * K + k: token t,
  kv head k) and read a head with one sublane-strided load (`paged/walk.py`; bf16 through 32-bit words, which
  hold heads 2i and 2i + 1 of a token): 32-bit and bf16 pages with K a multiple of 8 and K's and V's head dims
  (`head_dims`) all 128.  Then a page [page_size, K, H] is whole (8, 128) tiles in HBM as XLA lays it out, and
  viewing the cache as [P, page_size * K, H] is free; with fewer heads XLA tiles a page (K, 128) and that view
  would copy the cache (seen on a v5e).  The head dims must be `strided_lanes`.  Other pages stay
  [P, page_size, K, H] and a head is read as a slice."""
  dtype = jnp.dtype(page_dtype)
  return (dtype.itemsize == 4 or dtype == jnp.bfloat16) and num_kv_heads % 8 == 0 and strided_lanes(head_dims)


def paged_kv_buffer_shape(
  pages_per_block: int,
  page_size: int,
  num_kv_heads: int,
  head_dim: int,
  page_dtype,
  head_dims: tuple[int, ...],
  merged: bool = False,
  slots: int = 2,
):
  """The paged kernels' VMEM buffer of `slots` kv blocks' K (head_dim H) or V (Hv) pages: [slots, ppb * ps, K * h]
  for merged pages ([P, page_size, K * h], a token per row with its heads side by side along the lanes), flat
  [slots, ppb * ps * K, h] when `flat_kv_pages` (of both head dims, `head_dims`), else [slots, ppb * ps, K, h] (a
  token per row)."""
  ppb, ps, K = pages_per_block, page_size, num_kv_heads
  if merged:
    return (slots, ppb * ps, K * head_dim)
  flat = flat_kv_pages(page_dtype, K, head_dims)
  return (slots, ppb * ps * K, head_dim) if flat else (slots, ppb * ps, K, head_dim)


def token_major_forward(num_heads: int, bq: int, head_dims: tuple[int, ...]) -> bool:
  """Whether the block forward reads q and writes o in the caller's token-major layout (`block/forward.py`):
  q [B, T, N, H] viewed as [B, T * N, H] and o as [B, T * N, Hv] (row t * N + n: token t, head n), lse written
  lane-dense as [N, bq] blocks of [B, N, T].  It needs N a multiple of 8, so that the view is free under XLA's
  (8, 128) tiles of a [.., N, H] array, q tiles a multiple of 128 (lse's lane blocks), and q's and o's head dims
  (`head_dims`) `strided_lanes`: a head is a sublane-strided load or store.  Other shapes are transposed to
  heads-major around the kernel."""
  return num_heads % 8 == 0 and bq % LANES == 0 and strided_lanes(head_dims)


# A PARTIAL block-forward tile of bq = R * bk rows is computed in R sub-tiles of bk rows, each classified on its
# own (`masks.tile_kinds` at (bk, bk)): the half of a 1024 x 512 causal diagonal tile above the diagonal is
# skipped and the half below it is unmasked.  Each sub-tile compiles its own masked and unmasked bodies, so R stays
# small: 16 sub-tiles of a 2048 x 2048 tile made the causal forward 1.84x slower on a v5e (code size).
MAX_SUB_TILES = 2


def forward_sub_tiles(bq: int, bk: int, dtype) -> int:
  """How many row sub-tiles a PARTIAL block-forward tile (bq, bk) is computed in: bq / bk where that is 2 to
  MAX_SUB_TILES (and bk rows are whole sublane tiles of `dtype`), else 1 (the whole tile)."""
  r, rem = divmod(bq, bk)
  return r if not rem and 2 <= r <= MAX_SUB_TILES and bk % sublanes(dtype) == 0 else 1


def sublanes(dtype) -> int:
  """Second-minor alignment of a tile of `dtype`: 8 rows of 32 bits, packed for narrower types."""
  return 8 * max(1, 4 // jnp.dtype(dtype).itemsize)


@dataclasses.dataclass(frozen=True)
class CallPlan:
  """Everything about one pallas_call's buffers; `pl.pallas_call` is built from it."""

  grid: tuple[int, ...]
  in_specs: tuple  # BlockSpecs of the array operands (after the scalar prefetch)
  in_dtypes: tuple
  out_specs: tuple
  out_shapes: tuple  # jax.ShapeDtypeStruct
  scratch: tuple  # (shape, dtype) of VMEM scratch buffers
  # Grid dimension semantics; None: every axis "parallel" but the innermost, "arbitrary".
  semantics: tuple | None = None


def padded_bytes(shape, dtype) -> int:
  """VMEM bytes of one buffer: the two minor dims are padded to (sublanes, 128) tiles."""
  shape = tuple(1 if d is None else d for d in shape)
  if len(shape) == 1:
    shape = (1, *shape)
  *lead, rows, cols = shape
  rows = -(-rows // sublanes(dtype)) * sublanes(dtype)
  cols = -(-cols // LANES) * LANES
  return math.prod(lead) * rows * cols * jnp.dtype(dtype).itemsize


def plan_vmem_bytes(plan: CallPlan) -> int:
  """VMEM a plan allocates: inputs and outputs double-buffered by the pipeline, plus scratch."""
  total = 0
  # Operands left in HBM (memory_space=pl.ANY: no block shape) take no VMEM; the kernel copies them itself.
  for spec, dtype in zip(plan.in_specs, plan.in_dtypes, strict=True):
    if spec.block_shape is not None:
      total += 2 * padded_bytes(spec.block_shape, dtype)
  for spec, out in zip(plan.out_specs, plan.out_shapes, strict=True):
    if spec.block_shape is not None:
      total += 2 * padded_bytes(spec.block_shape, out.dtype)
  for shape, dtype in plan.scratch:
    total += padded_bytes(shape, dtype)
  return total


def tpu_tile(length: int, requested: int, align: int, *, what: str) -> int:
  """The tile for a `length`-token axis: the whole axis if it fits, else the largest aligned divisor."""
  if length <= requested:
    return length  # a block equal to the full dimension is always legal
  t = (requested // align) * align
  while t >= align:
    if length % t == 0:
      return t
    t -= align
  raise ValueError(
    f"pallas_tpu: no {what} tile <= {requested} divides the shard length {length} in multiples of {align} "
    f"(TPU tiles must be multiples of {align} or the whole axis); choose a shard length that is a multiple "
    f"of {align} or BlockSizes with {what} >= {length}"
  )

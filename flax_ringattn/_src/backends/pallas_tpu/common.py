"""What the Pallas TPU kernels share: tiles of one block, mask and dropout operands, the launch.

Every kernel builds its `pl.pallas_call` here (`call`) from a `tiling.CallPlan`,
the description its planner's footprint model is tested against.

Layout inside the kernels: heads-major, q `[B, N, T, H]`, k `[B, K, S, H]`,
v `[B, K, S, Hv]` (Hv: v's and the output's head dim, MLA's; H when equal),
so a tile's two minor dimensions are (tokens, head_dim).  Per-row statistics
(lse, delta) are `[B, N, T, 1]` and per-tile scratch statistics are kept
lane-replicated `[G, bq, 128]`, as TPU flash kernels do, so no kernel needs a
lane <-> sublane relayout.  A kernel instance handles the G = N / K q heads of
one kv head, so the kv tile is read once per group and the group's heads share
one matmul.  The exceptions read the caller's token-major layout and gather a
head with sublane-strided loads (`strided_rows`): the block forward's q, o and
lse where `tiling.token_major_forward` allows, and the paged kernels (q as
projected, [T, N, H]; flat kv pages).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src import dropout as dropout_lib
from flax_ringattn._src import masks, vma
from flax_ringattn._src.backends.pallas_tpu import planners as planner
from flax_ringattn._src.backends.pallas_tpu.tiling import (  # noqa: F401  (the kernels read these as c.*)
  F32,
  LANES,
  SMEM_BYTES,
  SMEM_TABLE_BYTES,
  CallPlan,
  flat_kv_pages,
  forward_sub_tiles,
  padded_bytes,
  paged_kv_buffer_shape,
  plan_vmem_bytes,
  sublanes,
  token_major_forward,
  tpu_tile,
)
from flax_ringattn._src.options import ProblemShape


def block_tiles(spec, q, k, *, backward: bool, v=None) -> tuple[int, int]:
  """(bq, bk) for one block: q tiles sublane-aligned, kv tiles lane-aligned (the score tile's minor dim).

  Without `spec.block_sizes` the planner picks the largest tiles that fit VMEM (with v's head dim; v None:
  like k).
  """

  _, T, N, H = q.shape
  _, S, K, _ = k.shape
  if spec.block_sizes is not None:
    blocks = spec.block_sizes
  else:
    v_shape = None if v is None else v.shape
    blocks = planner.plan_block_sizes_for(ProblemShape.of(q.shape, k.shape, q.dtype, spec, v_shape=v_shape))
  req_q, req_kv = blocks.bwd if backward else (blocks.block_q, blocks.block_kv)
  suffix = "_bwd" if backward else ""
  bq = tpu_tile(T, req_q, sublanes(q.dtype), what=f"block_q{suffix}")
  bk = tpu_tile(S, req_kv, LANES, what=f"block_kv{suffix}")
  if N > K and bq % sublanes(q.dtype):
    # The G heads of a group are stacked into one (G * bq, H) matmul operand;
    # Mosaic can only merge those dims when bq fills whole sublane tiles.
    raise ValueError(
      f"pallas_tpu: with {N // K} q heads per kv head the q tile must be a multiple of {sublanes(q.dtype)} rows "
      f"for {jnp.dtype(q.dtype).name}, got the whole shard q_len={T}; use a shard length that is a multiple of "
      f"{sublanes(q.dtype)} or implementation='xla'"
    )
  return bq, bk


def fused_backward(spec, q, k, v, bq: int, bk: int) -> bool:
  """Whether the block backward computes dq in the dk/dv kernel (`BlockSizes.fused_bwd`): a test's
  `KernelDebug.fused_backward` first, then the call's (or the planner's) `fused_bwd`, and where that is None the
  planner's rule at these tiles (`planners.fused_backward_auto`: the dq partials fit their HBM allowance, the
  fused kernel fits VMEM, and the stacked score tile is not past the size where it spills)."""
  if spec.debug is not None and spec.debug.fused_backward is not None:
    return spec.debug.fused_backward
  shape = ProblemShape.of(q.shape, k.shape, q.dtype, spec, v_shape=v.shape)
  blocks = spec.block_sizes if spec.block_sizes is not None else planner.plan_block_sizes_for(shape)
  if blocks.fused_bwd is not None:
    return blocks.fused_bwd
  return planner.fused_backward_auto(shape, batch=q.shape[0], bq=bq, bk=bk)


def forward_token_major(spec, q, k, v, bq: int, bk: int) -> bool:
  """Whether the block forward of these operands runs token-major at tiles (bq, bk): where the layout allows it
  and it fits VMEM (`planners.forward_token_major`), unless a test forces the heads-major forward
  (`KernelDebug.forward_layout`)."""
  if spec.debug is not None and spec.debug.forward_layout == "heads_major":
    return False
  shape = ProblemShape.of(q.shape, k.shape, q.dtype, spec, v_shape=v.shape)
  return planner.forward_token_major_for(shape, bq, bk)


def block_setup(spec, q, k, v, q_tok, kv_tok, *, backward: bool):
  """What every kernel of one block needs: plan dimensions, the tile-class table and the mask operands."""
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  bq, bk = block_tiles(spec, q, k, backward=backward, v=v)
  table = planner.block_table_bytes(T // bq, S // bk)  # tile-class and fetch-index tables, in SMEM
  if table > SMEM_TABLE_BYTES:
    suffix = "_bwd" if backward else ""
    raise ValueError(
      f"pallas_tpu: {T // bq} x {S // bk} tiles (q_len={T}, kv_len={S}, block_q{suffix}={bq}, block_kv{suffix}={bk}) "
      f"need {table} bytes of tile tables in SMEM, more than {SMEM_TABLE_BYTES}; use larger tiles "
      "(BlockSizes or block_sizes=None to let plan_block_sizes choose)"
    )
  dims = dict(
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    Hv=v.shape[3],
    dtype=q.dtype,
    bq=bq,
    bk=bk,
    mask=spec.mask,
    has_dropout=bool(spec.dropout_rate),
  )
  kinds = masks.tile_kinds(spec.mask, q_tok, kv_tok, bq, bk)  # [T/bq, S/bk]
  return dims, kinds, mask_operands(q_tok, kv_tok)


def by_tile_kind(kind, update):
  """Runs update(masked=False) on a FULL tile, update(masked=True) on a PARTIAL one, nothing on an EMPTY one."""
  pl.when(kind == masks.FULL)(lambda: update(False))
  pl.when(kind == masks.PARTIAL)(lambda: update(True))


def with_sub_tiles(mask, q_tok, kv_tok, kinds, bq: int, bk: int, sub_tiles: int):
  """The tile-class table with each tile's `sub_tiles` row sub-tiles classified too (`tiling.forward_sub_tiles`):
  bits 0-1 hold the tile's class, bits 2 + 2r and 3 + 2r sub-tile r's (`masks.tile_kinds` at (bq / sub_tiles,
  bk)).  `tile_class` and `sub_tile_class` read them back; one table, so the kernel's scalar prefetch is
  unchanged."""
  if sub_tiles == 1:
    return kinds
  sub = masks.tile_kinds(mask, q_tok, kv_tok, bq // sub_tiles, bk).reshape(kinds.shape[0], sub_tiles, -1)
  assert 2 + 2 * sub_tiles <= 31, sub_tiles  # every class fits the int32 entry
  return kinds + sum(sub[:, r].astype(kinds.dtype) << (2 + 2 * r) for r in range(sub_tiles))


def tile_class(kind):
  """The tile's own class in a `with_sub_tiles` table entry."""
  return kind & 3


def sub_tile_class(kind, r: int):
  """Sub-tile r's class in a `with_sub_tiles` table entry."""
  return (kind >> (2 + 2 * r)) & 3


def fetch_index(kinds):
  """For each grid step (row i, step j) the kv tile to fetch: j itself, or, on an EMPTY tile,
  the tile fetched just before it in the row (the next non-empty one at the row's start).

  The pipeline only issues a DMA when a block index changes, so skipped tiles
  cost neither matmuls nor HBM traffic.
  """
  n = kinds.shape[-1]
  j = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), kinds.shape)
  live = kinds != 0
  before = jax.lax.cummax(jnp.where(live, j, -1), axis=kinds.ndim - 1)
  after = jax.lax.cummin(jnp.where(live, j, n), axis=kinds.ndim - 1, reverse=True)
  return jnp.where(before >= 0, before, jnp.where(after < n, after, 0)).astype(jnp.int32)


def _word_rows(ref, start: int, count: int, stride: int, *, compiled: bool, name: str):
  """How `strided_rows` / `store_strided_rows` reach their rows: None where they stride the ref directly (32-bit
  rows, or the interpreter, which strides any dtype but cannot bitcast a ref); else the bf16 ref's 32-bit word view
  and the word rows holding the rows (`stride` even)."""
  if ref.dtype.itemsize == 4 or not compiled:
    return None
  if ref.dtype != jnp.bfloat16 or stride % 2:
    raise NotImplementedError(f"{name}: compiled, 32-bit or bf16 with an even stride, got {ref.dtype} {stride}")
  return ref.bitcast(jnp.uint32), pl.ds(start // 2, count, stride=stride // 2)


def strided_rows(ref, start: int, count: int, stride: int, *, compiled: bool):
  """Rows start, start + stride, ... (`count` of them) of a 2-D VMEM ref as float32: one sublane-strided load
  (a head of a token-major buffer whose row t * stride + n is token t, head n).  Compiled, bf16 is read as
  32-bit words (a word holds rows 2i and 2i + 1, 2i in its low half; Mosaic strides 32-bit rows, so `stride`
  must be even), and a bf16 half moved to the top of a word is that value as float32.  The interpreter strides
  any dtype but cannot bitcast a ref, so it loads directly."""
  view = _word_rows(ref, start, count, stride, compiled=compiled, name="strided_rows")
  if view is None:
    return ref[pl.ds(start, count, stride=stride), :].astype(F32)
  words, rows = view
  loaded = words[rows, :]
  top = loaded << 16 if start % 2 == 0 else loaded & jnp.uint32(0xFFFF0000)
  return pltpu.bitcast(top, F32)


def store_strided_rows(ref, start: int, stride: int, value, *, compiled: bool):
  """`strided_rows`' store: rows start, start + stride, ... of a 2-D VMEM ref = value (float32 [count, lanes])
  in the ref's dtype.  Compiled, a bf16 ref is written through 32-bit words (`stride` even): each word keeps its
  other half (a row of another head, stored at another grid step or already there) and gets this value rounded
  to bf16 (the convert's round-to-nearest-even, as `astype` outside the kernel) in its half.  The interpreter
  stores directly."""
  count = value.shape[0]
  view = _word_rows(ref, start, count, stride, compiled=compiled, name="store_strided_rows")
  if view is None:
    ref[pl.ds(start, count, stride=stride), :] = value.astype(ref.dtype)
    return
  words, rows = view
  top = pltpu.bitcast(value.astype(jnp.bfloat16).astype(F32), jnp.uint32)  # bf16 bits on top, zeros below
  kept = words[rows, :] & jnp.uint32(0xFFFF0000 if start % 2 == 0 else 0x0000FFFF)
  words[rows, :] = kept | (top >> 16 if start % 2 == 0 else top)


def heads_major(x):
  """[B, L, heads, H] <-> [B, heads, L, H]."""
  return x.transpose(0, 2, 1, 3)


def mask_operands(q_tok, kv_tok):
  """The `masks.Tokens` of both sides as kernel operands, field by field (positions, segment ids, bidirectional
  ids; q's then kv's of each): q's as columns ([T, 1], or [B, T, 1] per row) and kv's as rows ([1, S] or
  [B, 1, S]), so a kernel compares a (bq, 1) block with a (1, bk) block without relayout (`mask_tokens`)."""
  ops = []
  for q_field, kv_field in zip(dataclasses.astuple(q_tok), dataclasses.astuple(kv_tok), strict=True):
    if q_field is not None:
      ops += [q_field.astype(jnp.int32)[..., :, None], kv_field.astype(jnp.int32)[..., None, :]]
  return ops


def mask_tokens(mask, mask_refs):
  """(q, kv) `masks.Tokens` of one tile's values, from the refs of `mask_operands` ((bq, 1) and (1, bk) each)."""
  values = iter(r[...] for r in mask_refs)
  pairs = {name: (next(values), next(values)) for name in mask_fields(mask)}
  return masks.Tokens(**{k: q for k, (q, _) in pairs.items()}), masks.Tokens(**{k: kv for k, (_, kv) in pairs.items()})


def mask_fields(mask) -> tuple[str, ...]:
  """The `masks.Tokens` fields a block kernel takes, in `Tokens` order: positions always (the layout's, shared by
  every row, or given per row), then the mask's other per-row data (`MaskSpec.data_fields`)."""
  return ("pos",) + tuple(name for name in mask.data_fields if name != "pos")


def scores(q_ref, k_ref, mask_refs, *, spec, masked: bool, log2: bool = False):
  """Scaled, soft-capped and (if `masked`) masked f32 scores of one tile pair (`log2`: times log2(e) too,
  folded into the scale where there is no soft cap).

  q_ref holds (G, bq, H) (the G heads of one kv head), k_ref (bk, H).  Returns
  s [G, bq, bk] and t = tanh(raw / cap) [G, bq, bk] for the soft-cap gradient
  (None without a cap).  Masked entries are -inf.
  """
  G, bq, H = q_ref.shape
  q = q_ref[...].reshape(G * bq, H)  # reshape the value, never the ref (interpret mode)
  s = jax.lax.dot_general(q, k_ref[...], (((1,), (1,)), ((), ())), preferred_element_type=F32, precision=spec.precision)
  cap = spec.logits_soft_cap
  s = (s * (spec.scale * LOG2_E if log2 and cap is None else spec.scale)).reshape(G, bq, -1)
  t = None
  if cap is not None:
    t = jnp.tanh(s / cap)
    s = (cap * LOG2_E if log2 else cap) * t
  if masked:
    vis = masks.tokens_visible(spec.mask, *mask_tokens(spec.mask, mask_refs))  # [bq, bk]
    s = jnp.where(vis[None], s, -jnp.inf)
  return s, t


def tile_lanes(x, width: int):
  """A lane-replicated (..., 128) statistic across `width` lanes: tiled (whole vregs copied) when `width` is a
  multiple of 128, else its first lane broadcast."""
  if width % LANES == 0:
    return jnp.tile(x, (1,) * (x.ndim - 1) + (width // LANES,))
  return x[..., :1]


LOG2_E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2_E)


# The int32[4] dropout operand (`_src/dropout.py`) of a kernel, whole in SMEM: read as scalars.
DROPOUT_SPEC = pl.BlockSpec(memory_space=pltpu.SMEM)


def dropout_specs(has_dropout: bool):
  """([BlockSpec], (dtype,)) of the dropout operand: one SMEM operand with dropout, none without."""
  return ([DROPOUT_SPEC], (jnp.int32,)) if has_dropout else ([], ())


def dropout_operands(spec, dropout):
  """The kernel operands that carry `dropout` (the int32[4] of the block contract): [dropout] or []."""
  if not dropout_lib.require_operand(spec.dropout_rate, dropout):
    return []
  return [dropout.astype(jnp.int32)]


def split_dropout_ref(spec, refs):
  """(dropout ref or None, the remaining refs): the dropout operand comes first in `refs` when present."""
  return (refs[0], refs[1:]) if spec.dropout_rate else (None, refs)


def dropout_scale(spec, drop_ref, b, kv_head, num_q_heads_per_kv: int, qp, kp):
  """keep / (1 - rate) of one tile pair's probabilities, [G, bq, bk] ([1, bq, bk] broadcast), or None.

  The mask is `dropout.keep` of the global batch row (offset + b), q head
  (offset + kv_head * G + g), and the global positions qp [bq, 1] / kp [1, bk]:
  the same function the reference and the XLA backend evaluate, so the kernel's
  mask does not depend on its tiles, the ring size or the hop order.
  """
  if not spec.dropout_rate:
    return None
  rate = spec.dropout_rate
  if spec.dropout_broadcast:
    keep = dropout_lib.keep(drop_ref[0], drop_ref[1], 0, 0, qp, kp, rate=rate)[None]
  else:
    G = num_q_heads_per_kv
    g = jax.lax.broadcasted_iota(jnp.int32, (G, 1, 1), 0)
    head = drop_ref[3] + kv_head * G + g
    keep = dropout_lib.keep(drop_ref[0], drop_ref[1], drop_ref[2] + b, head, qp, kp, rate=rate)
  return dropout_lib.keep_scale(keep, rate)


def tile_dropout(spec, drop_ref, b, kv_head, q_ref, mask_refs):
  """`dropout_scale` of a block kernel's tile, from the position blocks it already holds (None without dropout)."""
  if drop_ref is None:
    return None
  q, kv = mask_tokens(spec.mask, mask_refs)
  return dropout_scale(spec, drop_ref, b, kv_head, q_ref.shape[0], q.pos, kv.pos)


def mask_specs(mask, bq: int, bk: int, q_block, kv_block):
  """BlockSpecs of `mask_operands`; q_block / kv_block map grid indices to (b, q tile) / (b, kv tile)."""
  per_row = [
    pl.BlockSpec((None, bq, 1), lambda *g: (q_block(*g)[0], q_block(*g)[1], 0)),
    pl.BlockSpec((None, 1, bk), lambda *g: (kv_block(*g)[0], 0, kv_block(*g)[1])),
  ]
  shared = [
    pl.BlockSpec((bq, 1), lambda *g: (q_block(*g)[1], 0)),
    pl.BlockSpec((1, bk), lambda *g: (0, kv_block(*g)[1])),
  ]
  return [*(per_row if mask.has_positions else shared), *(per_row * (len(mask_fields(mask)) - 1))]


def mask_dtypes(mask) -> tuple:
  """The dtypes of `mask_operands` (all int32)."""
  return (jnp.int32,) * (2 * len(mask_fields(mask)))


def compiler_params(semantics, interpret, *, bounds_checks: bool = True):
  """`bounds_checks=False`: Mosaic adds no check of each DMA's source and destination ranges (two a copy, 8-10
  dependent scalar bundles each on a v5e).  Only for kernels that clamp every DMA they start into range
  themselves: the paged kernels, which start a copy per page (the interpret-mode tests check each range)."""
  if interpret is not None:
    return pltpu.CompilerParams(dimension_semantics=semantics)

  limit = planner.vmem_limit_bytes(planner.current_generation())
  return pltpu.CompilerParams(
    dimension_semantics=semantics, vmem_limit_bytes=limit, disable_bounds_checks=not bounds_checks
  )


def call(kernel, plan: CallPlan, num_prefetch: int, *, interpret, name: str):
  """`pl.pallas_call` built from a plan (the only place the kernels are launched).

  Inside `jax.shard_map(check_vma=True)` the operands are made to vary over the
  same manual axes and the results are declared to vary over them too.
  """
  semantics = plan.semantics or ("parallel",) * (len(plan.grid) - 1) + ("arbitrary",)

  def run(*args):
    args = vma.unify(*args)
    mat = vma.manual_axis_type(args[0])
    out_shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=mat) for o in plan.out_shapes]
    return _pallas_call(kernel, plan, num_prefetch, semantics, out_shapes, interpret, name)(*args)

  return run


def _pallas_call(kernel, plan, num_prefetch, semantics, out_shapes, interpret, name):
  return pl.pallas_call(
    kernel,
    grid_spec=pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=num_prefetch,
      grid=plan.grid,
      in_specs=list(plan.in_specs),
      out_specs=list(plan.out_specs),
      scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in plan.scratch],
    ),
    out_shape=out_shapes,
    compiler_params=compiler_params(semantics, interpret),
    interpret=interpret,
    name=name,
  )

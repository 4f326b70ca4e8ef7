"""Planner of the in-kernel ring (`ring/`): where the communication slots live (VMEM or HBM) and the tiles of each
direction, from the ring's own footprint model (`ring_footprint`) and its SMEM tile tables."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flax_ringattn._src.backends.pallas_tpu import tiling as c
from flax_ringattn._src.backends.pallas_tpu.planners.block import (
  MAX_TILE,
  Footprint,
  _tile,
  _traffic,
  _v_dim,
  candidates,
  fwd_score_temporaries,
  q_candidates,
)
from flax_ringattn._src.backends.pallas_tpu.planners.chip import MiB, budget_bytes, current_generation
from flax_ringattn._src.options import ProblemShape


def ring_footprint(
  kernel: str,
  *,
  T,
  S,
  bq,
  bk,
  num_heads,
  num_kv_heads,
  head_dim,
  dtype,
  has_segments=False,
  soft_cap=False,
  dropout=False,
  v_head_dim=None,
  extra_fields=(),
) -> Footprint:
  """VMEM of an in-kernel ring kernel: 'ring_fwd' / 'ring_bwd' (VMEM slots, `ring/vmem_forward.py`,
  `ring/vmem_backward.py`) or 'ring_fwd_hbm' / 'ring_bwd_hbm' (HBM slots, `ring/hbm_forward.py`, `ring/hbm_backward.py`).

  With VMEM slots a grid step holds the whole q shard of one kv head's group
  (T rows) and two communication slots of the kv shard (S rows) for each
  travelling array: K, V and the kv row of each token field (positions given
  per row, segment ids, bidirectional ids; each with its q column); the
  backward adds two f32 slots each for the dK / dV accumulators and one f32
  local sum each.
  With HBM slots only tiles are in VMEM, whatever T and S: the outer tile of
  a pass and its state once, the streamed inner tiles twice (double buffers).
  Temporaries are those of one (bq, bk) tile pair, as in `footprint`.
  q, K, dq and dK buffers are `head_dim` wide; V, dV, dO, o and the softmax
  accumulator `v_head_dim` (None: `head_dim`).
  """
  G, H, f32, i32 = num_heads // num_kv_heads, head_dim, jnp.float32, jnp.int32
  Hv = H if v_head_dim is None else v_head_dim
  score = G * bq * bk * 4
  F = bool(has_segments) + len(extra_fields)  # token fields (`RingDims.fields`)
  if kernel in ("ring_fwd", "ring_bwd"):
    q_blk = _tile(T, H, dtype, G)
    stat = _tile(T, 1, f32, G)
    slots = _tile(S, H, dtype, 2) + _tile(S, Hv, dtype, 2)  # K and V, two slots each
    seg_in = F * _tile(T, 1, i32)  # the q columns of the token fields
    slots += F * _tile(1, S, i32, 2)  # their kv rows, two slots each
  if kernel == "ring_fwd":
    inputs = q_blk + seg_in
    outputs = _tile(T, Hv, f32, G) + stat
    scratch = slots + 2 * _tile(T, c.LANES, f32, G) + _tile(T, Hv, f32, G)  # m, l, acc
    temporaries = fwd_score_temporaries(bk) * score
  elif kernel == "ring_bwd":
    inputs = q_blk + _tile(T, Hv, dtype, G) + 2 * stat + seg_in  # q, do, lse, delta
    outputs = _tile(T, H, f32, G) + _tile(S, H, f32) + _tile(S, Hv, f32)  # dq, dk, dv
    scratch = slots + _tile(S, H, f32, 2) + _tile(S, Hv, f32, 2) + _tile(S, H, f32) + _tile(S, Hv, f32)
    temporaries = 5 * score
  elif kernel in ("ring_fwd_hbm", "ring_bwd_hbm"):
    inputs = outputs = 0  # everything pipelined by hand: scratch only
    kv_tiles = _tile(bk, H, dtype, 2) + _tile(bk, Hv, dtype, 2)  # [2] x (k, v)
    kv_tiles += F * _tile(1, bk, i32, 2)  # [2] x the kv token rows
    if kernel == "ring_fwd_hbm":
      q_tile = _tile(bq, H, dtype, G) + F * _tile(bq, 1, i32)
      state = 2 * _tile(bq, c.LANES, f32, G) + _tile(bq, Hv, f32, G) + _tile(bq, 1, f32, G)  # m, l, acc, lse
      scratch = q_tile + kv_tiles + state
      temporaries = fwd_score_temporaries(bk) * score
    else:
      q_side = _tile(bq, H, dtype, G) + _tile(bq, Hv, dtype, G) + 2 * _tile(bq, 1, f32, G)  # q, do, lse, delta
      q_side += F * _tile(bq, 1, i32)
      kv_grads = _tile(bk, H, f32) + _tile(bk, Hv, f32)  # dk, dv of a kv tile
      # the fold's partners of the dk, dv tiles, unless it adds in their halves (`ring.hbm_backward.fold_in_halves`)
      fold = kv_grads if bk % 16 else 0
      scratch = 2 * q_side + kv_tiles + _tile(bq, H, f32, G) + kv_grads + fold  # [2] x q side; dq; dk, dv; fold
      temporaries = 5 * score
  else:
    raise ValueError(f"kernel must be 'ring_fwd', 'ring_bwd', 'ring_fwd_hbm' or 'ring_bwd_hbm', got {kernel!r}")
  if soft_cap:
    temporaries += 2 * score
  if dropout:
    temporaries += 2 * score  # as in `footprint`
  return Footprint(buffers=2 * (inputs + outputs) + scratch, temporaries=temporaries)


RING_KINDS_PER_WORD = 16  # the ring's tile table packs 2-bit tile classes, 16 to an int32 word (a power of two:
# `ring.protocol.tile_kind` unpacks with shifts and masks)


def ring_table_bytes(n: int, q_tiles: int, kv_tiles: int) -> int:
  """SMEM bytes of the ring's tile table: n hops x q_tiles rows of ceil(kv_tiles / 16) int32 words, 1-D."""
  return n * q_tiles * -(-kv_tiles // RING_KINDS_PER_WORD) * 4


@dataclasses.dataclass(frozen=True)
class RingPlan:
  """Where the in-kernel ring keeps its slots ("vmem" or "hbm") and its tiles, for one direction."""

  slots: str
  bq: int
  bk: int


def plan_ring(
  *,
  T,
  S,
  n,
  num_heads,
  num_kv_heads,
  head_dim,
  dtype,
  backward: bool,
  has_segments=False,
  soft_cap=False,
  dropout=False,
  tiles=None,
  generation=None,
  v_head_dim=None,
  extra_fields=(),
) -> RingPlan:
  """Slots and tiles of the in-kernel ring's forward (or backward) kernel on (T, S) shards of a ring of n.

  VMEM slots when some legal tiles fit `generation`'s budget with the whole
  shards resident (no HBM traffic inside a hop), at the largest such tiles;
  else HBM slots (only tiles in VMEM, any shard length), at the tiles with the
  least HBM traffic (`hbm_bytes` of the block kernels the passes mirror), then
  the largest.  Either way the ring's tile table (`ring_table_bytes`) must
  fit its SMEM share.  `tiles=(bq, bk)` (the caller's BlockSizes) is kept and
  only the slots are chosen.  `v_head_dim`: v's (and the output's) head dim
  when it differs from head_dim (MLA); None: head_dim.  `extra_fields`: the
  mask's per-row data besides segment ids (`ProblemShape.extra_fields`: "pos"
  for positions given per row, "bid" for bidirectional ids), each travelling
  as a token field.
  """
  shape = _shape(T, S, num_heads, num_kv_heads, head_dim, v_head_dim, dtype, has_segments, soft_cap, dropout)
  shape = dataclasses.replace(shape, extra_fields=tuple(extra_fields))
  return plan_ring_for(shape, n=n, backward=backward, tiles=tiles, generation=generation)


def _shape(T, S, num_heads, num_kv_heads, head_dim, v_head_dim, dtype, has_segments, soft_cap, dropout):
  """The `ProblemShape` of the keyword forms (`plan_ring`, `ring_fits`)."""
  return ProblemShape(
    q_len=T,
    kv_len=S,
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    v_head_dim=None if v_head_dim == head_dim else v_head_dim,
    dtype=dtype,
    has_segments=has_segments,
    soft_cap=soft_cap,
    dropout=dropout,
  )


def plan_ring_for(shape: ProblemShape, *, n, backward: bool, tiles=None, generation=None) -> RingPlan:
  """`plan_ring` of one `ProblemShape` of (T, S) shards (what the kernels call; v's head dim is
  `shape.head_dim_v`)."""
  T, S, dtype = shape.q_len, shape.kv_len, shape.dtype
  num_heads, num_kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
  generation = current_generation() if generation is None else generation
  budget = budget_bytes(generation)
  if tiles is not None:
    pairs = [tuple(tiles)]
  else:
    qs = q_candidates(T, dtype, grouped=num_heads > num_kv_heads)
    pairs = [(bq, bk) for bq in qs for bk in candidates(S, c.LANES)]
    if not pairs:
      raise ValueError(
        f"plan_ring: no legal TPU tile for q_len={T} (multiples of {c.sublanes(dtype)} up to {MAX_TILE}, or the "
        f"whole axis up to {MAX_TILE}) or kv_len={S} (multiples of {c.LANES}, same rule)"
      )
    pairs = [(bq, bk) for bq, bk in pairs if ring_table_bytes(n, T // bq, S // bk) <= c.SMEM_TABLE_BYTES]
  dims = dict(T=T, S=S, dtype=dtype, **shape.heads, **shape.features)
  name = "ring_bwd" if backward else "ring_fwd"
  resident = [(bq, bk) for bq, bk in pairs if ring_footprint(name, bq=bq, bk=bk, **dims).total <= budget]
  if resident:
    bq, bk = max(resident, key=lambda t: (t[0] * t[1], t[0]))
    return RingPlan("vmem", bq, bk)
  streamed = [(bq, bk) for bq, bk in pairs if ring_footprint(name + "_hbm", bq=bq, bk=bk, **dims).total <= budget]
  if tiles is not None and not streamed:
    streamed = pairs  # the caller's tiles: run them as asked (Mosaic reports what does not fit)
  if not streamed:
    raise ValueError(
      f"plan_ring: no legal tiles of the q_len={T}, kv_len={S} shards fit the {generation} VMEM budget of "
      f"{budget / MiB:.1f} MiB with HBM slots ({num_heads // num_kv_heads} q heads per kv head, "
      f"head_dim={head_dim}{_v_dim(shape)}), with a tile table for a ring of {n} within {c.SMEM_TABLE_BYTES} "
      "bytes of SMEM"
    )
  passes = ("dq", "dkv") if backward else ("fwd",)

  def key(t):
    bq, bk = t
    traffic = _traffic(passes, bq, bk, q_len=T, kv_len=S, dtype=dtype, **shape.heads)
    if backward:
      # `hbm_bytes` counts lse and delta at 4 bytes a row; the dK/dV pass copies their [G, bq, 1] f32 tiles,
      # which TPU HBM tiling pads to 128 lanes, once per kv tile.
      traffic += (S // bk) * 2 * T * num_heads * (c.LANES - 1) * 4
    return (traffic, -bq * bk, -bq)

  bq, bk = min(streamed, key=key)
  return RingPlan("hbm", bq, bk)


def ring_fits(
  *,
  T,
  S,
  n=1,
  num_heads,
  num_kv_heads,
  head_dim,
  dtype,
  has_segments=False,
  soft_cap=False,
  dropout=False,
  generation=None,
  v_head_dim=None,
) -> bool:
  """Whether `plan_ring` finds slots and tiles for both directions on (T, S) shards of a ring of n."""
  shape = _shape(T, S, num_heads, num_kv_heads, head_dim, v_head_dim, dtype, has_segments, soft_cap, dropout)
  return ring_fits_for(shape, n=n, generation=generation)


def ring_fits_for(shape: ProblemShape, *, n=1, generation=None) -> bool:
  """`ring_fits` of one `ProblemShape` of (T, S) shards (v's head dim: `shape.head_dim_v`)."""
  try:
    for backward in (False, True):
      plan_ring_for(shape, n=n, backward=backward, generation=generation)
  except ValueError:
    return False
  return True

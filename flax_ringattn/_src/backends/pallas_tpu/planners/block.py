"""VMEM-aware tile planner for the Pallas TPU block kernels.

The footprint model lives here and only here: `footprint()` counts every
buffer the forward, dq and dk/dv kernels allocate (pipelined input and output
tiles twice, for double buffering; VMEM scratch once) plus the f32
score-sized temporaries the kernel body keeps live.  `tests/test_planner.py`
checks the buffer part against `common.plan_vmem_bytes` of the kernels' own
`CallPlan`s, so a kernel change that adds a buffer fails a test until the model
learns it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flax_ringattn._src import validation
from flax_ringattn._src.backends.pallas_tpu import tiling as c
from flax_ringattn._src.backends.pallas_tpu.planners import tuned
from flax_ringattn._src.backends.pallas_tpu.planners.chip import MiB, budget_bytes, current_generation
from flax_ringattn._src.block_sizes import BlockSizes
from flax_ringattn._src.options import ProblemShape

# Larger tiles stop paying: a 1024-row q tile already feeds the MXU for many
# cycles per DMA, while causal and window skipping get coarser with tile size.
MAX_TILE = 2048

# The forward's tiles stop at 1024 q rows x 512 kv columns (`_capped`).  Measured on a v5e (2026-12-06, 8k tokens,
# 8 heads of 128, bf16, lane-replicated statistics, docs/performance.md): a full mask ran 2.34-2.38 ms at every tile
# from 1024 x 512 to 2048 x 2048, so larger tiles buy nothing; a causal one ran 1.56-1.58 ms at 1024 x 512 and
# 1024 x 1024 and 1.65-1.72 ms at the larger tiles (a diagonal tile computes its masked-out part too), and 512-row
# tiles paid more per grid step (1.68 ms).  1024 x 512 then wins with row sub-tiles (`tiling.forward_sub_tiles`,
# which need bq = 2 bk: 1.537 ms).  Only this v5e shape was measured; other generations take the same cap.
# K/V re-streaming at 1024-row tiles stays far below the tiles' compute time.
FWD_MAX_Q, FWD_MAX_KV = 1024, 512

# With grouped heads (G = N / K > 1: the group's q heads stacked into G * bq score rows) the forward's kv tiles go to
# 1024 and its stacked rows stop at 4096.  Every kv step rescales the statistics and the accumulator of each row
# (lane-replicated, whole vregs), a per-row cost that wider kv tiles spread over more scores.  Measured on a v5e
# (2026-12-07, 8k tokens causal, bf16, head dim 64): 14 q heads over 2 kv heads (G = 7) ran 3.23 ms at 1024 x 512,
# 2.44 at 512 x 512, 2.26 at 512 x 1024 and 2.27 at 256 x 1024 (splash at its best 2.16); 32 over 8 (G = 4) ran
# 5.61 ms at 1024 x 512, 5.30 at 512 x 1024 and 5.17 at 1024 x 1024 (splash 4.96).
FWD_GROUPED_MAX_KV, FWD_MAX_ROWS = 1024, 4096

# The backward's score tile (the G q heads of a group stacked: G * bq rows x bk columns) stops at 2M entries.  Measured
# on a v5e (2026-12-07, 8k tokens causal, 32 q heads over 8 kv heads of 64, bf16, forward + backward): backward tiles
# of 512 x 512, 512 x 1024 and 256 x 1024 (1-2M entries with G = 4) ran 19.1-19.8 ms, 1024 x 1024 (4M) 29.0 ms and
# 1024 x 2048 (8M) 32.3 ms: past VMEM's sweet spot the probabilities, dP and dS temporaries spill.  8 heads of 128
# (G = 1) were tuned at 1024 x 2048, 2M entries.  Least HBM traffic alone picked 1024 x 2048 for G = 4.
BWD_MAX_SCORES = 2048 * 1024

# The fused backward (`BlockSizes.fused_bwd`: dq computed in the dk/dv kernel, one partial per kv tile) keeps more
# temporaries live per tile (dq's f32 product besides p, dP and dS), and its tiles stop at 1M stacked scores.
# Measured on the same v5e and shapes (forward + backward, forward tiles as above): G = 4 ran 15.62 ms at 256 x 1024
# (1M), 15.92 at 512 x 1024 (2M) and 16.88 at 512 x 512 fused, against 19.13-19.40 unfused at any of them; G = 7
# ran 6.91 ms at 128 x 1024 (0.9M), 7.20 at 512 x 512 (1.8M) and 12.13 at 512 x 1024 (3.7M), against 8.25-8.53
# unfused; splash at its best (blocks 1024, its fused backward) 15.53 and 6.61.  Its kv tiles stop at 1024: least
# traffic alone picks 2048-wide ones, and G = 4 ran 16.24 ms fused at 256 x 2048, G = 7 7.88 ms at 256 x 1024.
BWD_FUSED_MAX_SCORES, BWD_FUSED_MAX_KV = 1024 * 1024, 1024

# The fused backward's dq partials, (S / bk) x [B, N, T, H] in q's dtype, live until summed; past this many bytes
# the kernel runs over kv chunks (`fused_dq_chunks`), each chunk's partials summed into dq before the next.
FUSED_DQ_MAX_BYTES = 1 << 30


def fused_dq_bytes(*, B, T, S, N, H, bk, dtype) -> int:
  """HBM bytes of the fused backward's dq partials: one [B, N, T, H] in `dtype` per kv tile of `bk`."""
  return (S // bk) * B * N * T * H * jnp.dtype(dtype).itemsize


def fused_dq_chunks(*, B, T, S, N, H, bk, dtype) -> int | None:
  """The fewest equal kv chunks (each whole kv tiles) whose dq partials fit `FUSED_DQ_MAX_BYTES` apiece: the fused
  backward runs its kernel once per chunk (`block.backward`).  None: one kv tile's partial alone passes it."""
  tiles = S // bk
  for chunks in range(1, tiles + 1):
    if (
      tiles % chunks == 0
      and fused_dq_bytes(B=B, T=T, S=S // chunks, N=N, H=H, bk=bk, dtype=dtype) <= FUSED_DQ_MAX_BYTES
    ):
      return chunks
  return None


@dataclasses.dataclass(frozen=True)
class Footprint:
  """VMEM bytes of one kernel: `buffers` (BlockSpec tiles and scratch) + `temporaries`."""

  buffers: int
  temporaries: int

  @property
  def total(self) -> int:
    return self.buffers + self.temporaries


def _tile(rows: int, cols: int, dtype, lead: int = 1) -> int:
  """Bytes of a [lead, rows, cols] VMEM buffer padded to (sublane, lane) tiles."""
  return c.padded_bytes((lead, rows, cols), dtype)


def footprint(
  kernel: str,
  *,
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
  token_major=None,
):
  """Footprint of kernel 'fwd', 'dq' or 'dkv' at tiles (bq, bk).

  q, k, dq and dk tiles are `head_dim` wide; v, o, dO, dv and the output accumulator `v_head_dim` (None:
  `head_dim`), v's head dim (MLA's).  `token_major` ('fwd'): the forward's layout (`forward_token_major`);
  None: wherever `tiling.token_major_forward` allows it.
  """
  G, H, f32, i32 = num_heads // num_kv_heads, head_dim, jnp.float32, jnp.int32
  Hv = H if v_head_dim is None else v_head_dim
  q_tile = _tile(bq, H, dtype, G)  # q: the G heads of a group
  do_tile = _tile(bq, Hv, dtype, G)  # do
  k_tile = _tile(bk, H, dtype)
  v_tile = _tile(bk, Hv, dtype)
  row_stat = _tile(bq, 1, f32, G)  # lse / delta, [G, bq, 1]
  # One (bq, 1) column and one (1, bk) row per mask field: positions (the layout's, or given per row: the same
  # blocks), segment ids, and the other per-row data (`ProblemShape.extra_fields`).
  pairs = 1 + bool(has_segments) + len([f for f in extra_fields if f != "pos"])
  mask = (_tile(bq, 1, i32) + _tile(1, bk, i32)) * pairs
  score = G * bq * bk * 4  # one f32 [G * bq, bk] tile
  if kernel == "fwd":
    scratch = 2 * _tile(bq, c.LANES, f32, G) + _tile(bq, Hv, f32, G)  # m, l, acc
    if token_major is None:
      token_major = c.token_major_forward(num_heads, bq, (H, Hv))
    if token_major:  # q and o tiles of all N heads, lse [N, bq], the group's q
      inputs = _tile(bq * num_heads, H, dtype) + k_tile + v_tile + mask
      outputs = _tile(bq * num_heads, Hv, f32) + _tile(num_heads, bq, f32)
      scratch += q_tile
    else:
      inputs = q_tile + k_tile + v_tile + mask
      outputs = _tile(bq, Hv, f32, G) + row_stat
    temporaries = fwd_score_temporaries(bk) * score
  elif kernel == "dq":
    inputs = q_tile + do_tile + 2 * row_stat + k_tile + v_tile + mask
    outputs = _tile(bq, H, f32, G)
    scratch = _tile(G * bq, H, f32)
    temporaries = 5 * score  # s (masked), p, dp, ds, ds * scale cast for the matmul
  elif kernel in ("dkv", "dkv_fused"):
    inputs = k_tile + v_tile + q_tile + do_tile + 2 * row_stat + mask
    outputs = _tile(bk, H, f32) + _tile(bk, Hv, f32)  # dk, dv
    scratch = _tile(bk, H, f32) + _tile(bk, Hv, f32)
    temporaries = 5 * score  # as dq, plus p cast for dV sharing the same live range
    if kernel == "dkv_fused":  # + the tile's dq partial (q's dtype) and its f32 product
      outputs += q_tile
      temporaries += _tile(G * bq, H, f32)
  else:
    raise ValueError(f"kernel must be 'fwd', 'dq', 'dkv' or 'dkv_fused', got {kernel!r}")
  if soft_cap:
    temporaries += 2 * score  # raw / cap and tanh(raw / cap), kept for the gradient
  if dropout:
    temporaries += 2 * score  # the int32 hash of the keep mask and the f32 keep / (1 - rate) scale
  return Footprint(buffers=2 * (inputs + outputs) + scratch, temporaries=temporaries)


def fwd_score_temporaries(bk: int) -> int:
  """Score-sized f32 temporaries of the online-softmax step (`block.forward.online_softmax_step`, shared by the
  in-kernel ring): s, its masked copy, p (and p cast to the input dtype), and m tiled across the tile's lanes
  where bk is whole vregs (`common.tile_lanes`; else m is a broadcast column)."""
  return 4 if bk % c.LANES == 0 else 3


def forward_token_major(*, bq, bk, budget, num_heads, head_dim, v_head_dim=None, **dims) -> bool:
  """Whether the block forward runs token-major at tiles (bq, bk): where `tiling.token_major_forward` allows it
  and its footprint fits `budget`.  Its q and o tiles hold all N heads (the heads-major forward's hold G), so
  with many heads and tall q tiles the heads-major forward runs instead of refusing the tiles.  The planner and
  the kernel both decide by this."""
  Hv = head_dim if v_head_dim is None else v_head_dim
  if not c.token_major_forward(num_heads, bq, (head_dim, Hv)):
    return False
  need = footprint(
    "fwd", bq=bq, bk=bk, num_heads=num_heads, head_dim=head_dim, v_head_dim=v_head_dim, token_major=True, **dims
  )
  return need.total <= budget


def forward_token_major_for(shape: ProblemShape, bq: int, bk: int, *, generation: str | None = None) -> bool:
  """`forward_token_major` of one `ProblemShape` at tiles (bq, bk), against `generation`'s budget (None: the
  attached TPU's, or the smallest-VMEM generation off TPU): what the block forward runs."""
  budget = budget_bytes(current_generation() if generation is None else generation)
  return forward_token_major(bq=bq, bk=bk, budget=budget, dtype=shape.dtype, **shape.heads, **shape.features)


def _fwd_footprint(bq, bk, budget, **dims) -> Footprint:
  """The forward's footprint in the layout it runs at tiles (bq, bk) (`forward_token_major`)."""
  token_major = forward_token_major(bq=bq, bk=bk, budget=budget, **dims)
  return footprint("fwd", bq=bq, bk=bk, token_major=token_major, **dims)


def candidates(length: int, align: int) -> list[int]:
  """Legal tiles for an axis of `length` tokens, ascending: aligned divisors, and the whole axis."""
  out = {length} if length <= MAX_TILE else set()
  out |= {t for t in range(align, min(length, MAX_TILE) + 1, align) if length % t == 0}
  return sorted(out)


def q_candidates(q_len: int, dtype, *, grouped: bool) -> list[int]:
  """Legal q tiles; grouped heads (N > K) need sublane-aligned ones (see common.block_tiles)."""
  sub = c.sublanes(dtype)
  return [t for t in candidates(q_len, sub) if not grouped or t % sub == 0]


def hbm_bytes(kernel: str, *, bq, bk, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype, v_head_dim=None) -> int:
  """HBM bytes one block's kernel moves when every tile is live.

  The forward and dq kernels stream all of K/V once per q tile, the dk/dv kernel
  streams q, dO, lse and delta once per kv tile; the other operands move once.
  This is what the planner minimises: within the VMEM budget, taller q tiles
  (forward, dq) and wider kv tiles (dk/dv) cut the re-streaming.  v, o, dO and
  dv are `v_head_dim` wide (None: `head_dim`).
  """
  b = jnp.dtype(dtype).itemsize
  Hv = head_dim if v_head_dim is None else v_head_dim
  q_in, do_in = (q_len * num_heads * w * b for w in (head_dim, Hv))  # q, do
  kv_in = kv_len * num_kv_heads * (head_dim + Hv) * b  # k and v
  stats = q_len * num_heads * 4  # lse or delta
  if kernel == "fwd":
    return q_in + (q_len // bq) * kv_in + q_len * num_heads * Hv * 4 + stats  # + o (f32) and lse
  if kernel == "dq":
    return q_in + do_in + 2 * stats + (q_len // bq) * kv_in + q_len * num_heads * head_dim * 4  # + dq (f32)
  if kernel in ("dkv", "dkv_fused"):
    dkv = kv_in + (kv_len // bk) * (q_in + do_in + 2 * stats) + kv_len * num_kv_heads * (head_dim + Hv) * 4
    if kernel == "dkv":
      return dkv
    # + the dq partials, written and read back by their sum, and dq (f32)
    return dkv + 2 * (kv_len // bk) * q_in + q_len * num_heads * head_dim * 4
  raise ValueError(f"kernel must be 'fwd', 'dq', 'dkv' or 'dkv_fused', got {kernel!r}")


def _traffic(kernels, bq, bk, **shape) -> int:
  """`hbm_bytes` summed over `kernels` ('fwd', 'dq', 'dkv') at tiles (bq, bk)."""
  return sum(hbm_bytes(k, bq=bq, bk=bk, **shape) for k in kernels)


def block_table_bytes(q_tiles: int, kv_tiles: int) -> int:
  """SMEM bytes of a block kernel's two scalar-prefetched tables (tile classes, fetch index), int32 each."""
  return 2 * q_tiles * kv_tiles * 4


def _capped(tiles: list[int], cap: int) -> list[int]:
  """The forward's tiles up to `cap`, where one of at least half of it exists; else all of them (an awkward length,
  8 x 131 = 1048 say, would otherwise fall back to 8-row tiles instead of the whole axis)."""
  below = [t for t in tiles if t <= cap]
  return below if below and below[-1] >= cap // 2 else tiles


def _best(kernels, q_len, kv_len, dtype, budget, **dims):
  """The fitting (bq, bk) with the least HBM traffic, then the largest area; the forward's at most
  FWD_MAX_Q x FWD_MAX_KV (`_capped`) unless no such tile fits.  Fitting: the VMEM footprint within `budget` and
  the tile-class and fetch-index tables within SMEM (`common.block_setup` refuses larger ones), which a long
  shard's capped tiles can exceed.

  HBM bytes never grow with either tile, so a tile one step larger than the
  choice in either dimension does not fit (else it would have been chosen).
  """
  grouped = dims["num_heads"] > dims["num_kv_heads"]
  group = dims["num_heads"] // dims["num_kv_heads"]
  qs, ks = q_candidates(q_len, dtype, grouped=grouped), candidates(kv_len, c.LANES)
  if kernels == ("fwd",):
    q_cap, kv_cap = (min(FWD_MAX_Q, FWD_MAX_ROWS // group), FWD_GROUPED_MAX_KV) if grouped else (FWD_MAX_Q, FWD_MAX_KV)
    capped = _least_traffic(kernels, _capped(qs, q_cap), _capped(ks, kv_cap), q_len, kv_len, dtype, budget, dims)
  else:
    most = BWD_MAX_SCORES
    if kernels == ("dkv_fused",):
      most, ks = BWD_FUSED_MAX_SCORES, _capped(ks, BWD_FUSED_MAX_KV)
    capped = _least_traffic(kernels, qs, ks, q_len, kv_len, dtype, budget, dims, max_scores=most // group)
  if capped is not None:
    return capped
  return _least_traffic(kernels, qs, ks, q_len, kv_len, dtype, budget, dims)


def _least_traffic(kernels, qs, ks, q_len, kv_len, dtype, budget, dims, max_scores=None):
  """`_best` over the tiles qs x ks (with `max_scores`, those with bq * bk at most that); None if none fits."""
  best, best_key = None, None
  heads = {k: dims[k] for k in ("num_heads", "num_kv_heads", "head_dim", "v_head_dim") if k in dims}
  for bq in qs:
    for bk in ks:
      if block_table_bytes(q_len // bq, kv_len // bk) > c.SMEM_TABLE_BYTES:
        continue
      if max_scores is not None and bq * bk > max_scores:
        continue
      need = max(
        (
          _fwd_footprint(bq, bk, budget, dtype=dtype, **dims)
          if k == "fwd"
          else footprint(k, bq=bq, bk=bk, dtype=dtype, **dims)
        ).total
        for k in kernels
      )
      if need > budget:
        continue
      traffic = _traffic(kernels, bq, bk, q_len=q_len, kv_len=kv_len, dtype=dtype, **heads)
      key = (traffic, -bq * bk, -bq)
      if best_key is None or key < best_key:
        best, best_key = (bq, bk), key
  return best


def plan_block_sizes(
  q_len: int,
  kv_len: int,
  num_heads: int,
  num_kv_heads: int,
  head_dim: int,
  dtype,
  *,
  generation: str | None = None,
  has_segments: bool = False,
  logits_soft_cap: float | None = None,
  dropout: bool = False,
  soft_cap: bool | None = None,
  v_head_dim: int | None = None,
) -> BlockSizes:
  """The tiles of least HBM traffic, then the largest, whose VMEM footprint fits `generation`'s budget.

  Args:
    q_len, kv_len: the lengths one block sees: the per-device shard lengths
      of the ring (T / ring size and S / ring size).
    num_heads, num_kv_heads, head_dim: N, K and H (q and k's head dim) of
      the local shard.
    dtype: the input dtype (float32 or bfloat16).
    generation: 'v4', 'v5e', 'v5p', 'v6e' or 'v7x'; None: the attached TPU's,
      or the smallest-VMEM generation off TPU.
    has_segments, logits_soft_cap, dropout: the call's segment ids (whether
      it has them), soft cap (as `ring_attention` takes it) and whether it
      uses attention dropout (each adds buffers or temporaries).
    soft_cap: deprecated (warns once): a bool standing for whether there is a
      `logits_soft_cap`.
    v_head_dim: v's (and the output's) head dim when it differs from
      head_dim (MLA: DeepSeek's qk 192, v 128); None: head_dim.

  Returns:
    `BlockSizes` with forward and backward tiles: of the legal tiles (at most
    MAX_TILE; the forward's at most FWD_MAX_Q x FWD_MAX_KV where tiles of at
    least half of that exist) whose footprint fits VMEM and whose tile tables
    fit SMEM, those with the least HBM traffic (`hbm_bytes`), then the
    largest.
  """
  if soft_cap is not None:
    validation.warn_once(
      ("plan_block_sizes", "soft_cap"),
      "plan_block_sizes(soft_cap=...) is deprecated: pass the call's logits_soft_cap (a float or None), as "
      "ring_attention takes it",
    )
  has_cap = bool(soft_cap) if soft_cap is not None else logits_soft_cap is not None
  shape = ProblemShape(
    q_len=q_len,
    kv_len=kv_len,
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    dtype=dtype,
    has_segments=has_segments,
    soft_cap=has_cap,
    dropout=dropout,
    v_head_dim=None if v_head_dim == head_dim else v_head_dim,
  )
  return plan_block_sizes_for(shape, generation=generation)


def plan_block_sizes_for(shape: ProblemShape, *, generation: str | None = None) -> BlockSizes:
  """`plan_block_sizes` of one `ProblemShape` (what the kernels call; v's head dim is `shape.head_dim_v`)."""
  q_len, kv_len, dtype = shape.q_len, shape.kv_len, shape.dtype
  num_heads, num_kv_heads, head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
  generation = current_generation() if generation is None else generation
  budget = budget_bytes(generation)
  for name, value in (
    ("q_len", q_len),
    ("kv_len", kv_len),
    ("num_heads", num_heads),
    ("num_kv_heads", num_kv_heads),
    ("head_dim", head_dim),
    ("v_head_dim", shape.head_dim_v),
  ):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"plan_block_sizes: {name} must be a positive int, got {name}={value!r}")
  if num_heads % num_kv_heads:
    raise ValueError(f"plan_block_sizes: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
  dims = shape.heads | shape.features
  measured = _tuned(shape, generation, budget, dims)
  if measured is not None:
    return measured
  fwd = _best(("fwd",), q_len, kv_len, dtype, budget, **dims)
  bwd, fused_bwd = _best_backward(shape, budget, dims)
  if fwd is None or bwd is None:
    qs = q_candidates(q_len, dtype, grouped=num_heads > num_kv_heads)
    ks = candidates(kv_len, c.LANES)
    if not qs or not ks:
      whole = " (with grouped heads it must be aligned too)" if num_heads > num_kv_heads else ""
      raise ValueError(
        f"plan_block_sizes: no legal TPU tile for q_len={q_len} (multiples of {c.sublanes(dtype)} up to {MAX_TILE}, "
        f"or the whole axis up to {MAX_TILE}{whole}) or kv_len={kv_len} (multiples of {c.LANES}, same rule)"
      )
    smallest = footprint("dq", bq=qs[0], bk=ks[0], dtype=dtype, **dims).total
    # A tile pair must fit both: the VMEM budget, and SMEM for its tile tables (q_len / bq x kv_len / bk entries).
    # Long axes need large tiles for the tables, and large tiles may not fit VMEM.
    tables = block_table_bytes(q_len // qs[0], kv_len // ks[0])
    raise ValueError(
      f"plan_block_sizes: no legal tiles for q_len={q_len}, kv_len={kv_len} fit both the {generation} VMEM budget "
      f"of {budget / MiB:.1f} MiB and SMEM's {c.SMEM_TABLE_BYTES // 1024} KiB of tile tables (the smallest tiles, "
      f"{qs[0]} x {ks[0]}, need {smallest / MiB:.1f} MiB of VMEM and {tables // 1024} KiB of tables, with "
      f"{num_heads // num_kv_heads} q heads per kv head and head_dim={head_dim}{_v_dim(shape)}); shard the sequence "
      "over a ring axis (each device plans its shard)"
    )
  return BlockSizes(block_q=fwd[0], block_kv=fwd[1], block_q_bwd=bwd[0], block_kv_bwd=bwd[1], fused_bwd=fused_bwd)


def _best_backward(shape: ProblemShape, budget: int, dims: dict):
  """(backward tiles, `fused_bwd`): the fused backward's tiles (`BWD_FUSED_MAX_SCORES`, `BWD_FUSED_MAX_KV`) with
  fused_bwd None, where one kv tile's dq partial fits `FUSED_DQ_MAX_BYTES` for one batch row and the two-kernel
  backward fits VMEM at the same tiles (the kernels decide a call's batch by `fused_backward_auto`); else the two
  kernels' tiles with fused_bwd False.  None tiles: nothing fits."""
  q_len, kv_len, dtype = shape.q_len, shape.kv_len, shape.dtype
  fused = _best(("dkv_fused",), q_len, kv_len, dtype, budget, **dims)
  if fused is not None:
    bq, bk = fused
    fits = fused_dq_chunks(B=1, T=q_len, S=kv_len, N=shape.num_heads, H=shape.head_dim, bk=bk, dtype=dtype)
    split = _least_traffic(("dq", "dkv"), [bq], [bk], q_len, kv_len, dtype, budget, dims)
    if fits is not None and split is not None:
      return fused, None
  return _best(("dq", "dkv"), q_len, kv_len, dtype, budget, **dims), False


def fused_backward_auto(shape: ProblemShape, *, batch: int, bq: int, bk: int, generation: str | None = None) -> bool:
  """`BlockSizes.fused_bwd=None`'s choice for `shape` (one block's lengths, heads, features) with `batch` rows at
  tiles (bq, bk): fused where one kv tile's dq partial fits `FUSED_DQ_MAX_BYTES`, its VMEM footprint fits `generation`'s
  budget (None: the attached TPU's) and the stacked score tile (N / K q heads) is at most `BWD_MAX_SCORES` (past it
  the fused kernel's temporaries spill: G = 7 at 512 x 1024 ran 12.1 ms fused, 8.3 ms as two kernels)."""
  if (shape.num_heads // shape.num_kv_heads) * bq * bk > BWD_MAX_SCORES:
    return False
  dims = dict(T=shape.q_len, S=shape.kv_len, N=shape.num_heads, H=shape.head_dim, dtype=shape.dtype)
  if fused_dq_chunks(B=batch, bk=bk, **dims) is None:
    return False
  budget = budget_bytes(current_generation() if generation is None else generation)
  need = footprint("dkv_fused", bq=bq, bk=bk, dtype=shape.dtype, **shape.heads, **shape.features)
  return need.total <= budget


def _tuned(shape: ProblemShape, generation: str, budget: int, dims: dict) -> BlockSizes | None:
  """The tiles a tuned table (`tuned.py`) gives `shape` on `generation`, where the model's own rules accept them
  (legal tiles, VMEM footprint and SMEM tables within budget); else None (the model plans)."""
  entry = tuned.lookup(generation, tuned.block_key(shape))
  if entry is None:
    return None
  q_len, kv_len, dtype = shape.q_len, shape.kv_len, shape.dtype
  qs = q_candidates(q_len, dtype, grouped=shape.num_heads > shape.num_kv_heads)
  ks = candidates(kv_len, c.LANES)
  fwd = (entry["block_q"], entry["block_kv"])
  bwd = (entry.get("block_q_bwd") or fwd[0], entry.get("block_kv_bwd") or fwd[1])
  fused_bwd = entry.get("fused_bwd")
  bwd_kernels = ("dkv_fused",) if fused_bwd else ("dq", "dkv")
  for kernels, (bq, bk) in ((("fwd",), fwd), (bwd_kernels, bwd)):
    if bq not in qs or bk not in ks or _least_traffic(kernels, [bq], [bk], q_len, kv_len, dtype, budget, dims) is None:
      return None
  return BlockSizes(block_q=fwd[0], block_kv=fwd[1], block_q_bwd=bwd[0], block_kv_bwd=bwd[1], fused_bwd=fused_bwd)


def _v_dim(shape: ProblemShape) -> str:
  """The `, v_head_dim=...` of an error message when v's head dim differs from q/k's; else nothing."""
  return "" if shape.v_head_dim is None else f", v_head_dim={shape.v_head_dim}"

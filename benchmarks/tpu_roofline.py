"""Roofline model of the Pallas TPU ring-attention kernels per TPU generation (model-derived, runs on CPU).

What it computes
----------------
For every TPU generation (v4, v5e, v5p, v6e, v7x), sequence length T and mask,
the forward and backward Pallas kernels of one device's whole ring (the sum
over its n hops; a hop is one block kernel call: the device's q shard against
one kv shard), with the tiles `flax_ringattn.plan_block_sizes` picks for the
per-device shard length T / n:

* tile tables: `masks.tile_kinds` on the real global positions of every hop
  (`layout.shard_positions` of the q shard and of kv shard (r - t) mod n at hop
  t), for all n devices x n hops.  A hop whose whole block is EMPTY is not
  launched (the ring's `lax.cond`); its tiles still count as skipped.
* FLOPs: every non-EMPTY tile costs its matmuls in full, 2 * G * bq * bk * H
  each per kv head (forward 2: s, pv; dq kernel 3: s, dp, dq; dk/dv kernel 4:
  s, dp, dv, dk).  "useful%" is the share of those FLOPs that land on visible
  (q, k) pairs (counted exactly from the positions), so partial-tile waste shows.
* HBM bytes: the block DMAs the Pallas pipeline issues.  It copies an input
  block when the block index differs from the previous grid step's (the first
  step always copies), and writes an output block back when its index changes.
  The grid is walked in order with `common.fetch_index` tables exactly as the
  BlockSpec index maps use them; a self-check replays small grids through the
  kernels' own `index_map` lambdas (`forward.fwd_plan`, `backward.dq_plan`,
  `backward.dkv_plan`) and must agree.  Block sizes come from those plans.  By
  default a block is counted as the HBM tiles it spans ((8, 128) tiles for
  32-bit data, (16, 128) for bf16: a [.., bq, 1] lse/delta/position block moves
  bq x 128 words); `--logical-bytes` counts the bare element bytes instead.
  "dead GB": DMAs no computing step needs: input blocks replaced before any non-EMPTY step reads them, and
  write-backs of output rows without a non-EMPTY tile (zeros / -inf that the ring's merge adds nothing from).
* intensity FLOP/B, the roofline time sum over launches of
  max(FLOPs / peak, bytes / HBM bandwidth) and the bound ("mxu" or "hbm", from
  the summed terms), for the busiest device ("t_dev") and for the
  hop-synchronous ring ("t_ring" = sum over hops of the slowest device's hop).
* skip%: EMPTY tiles over all devices and hops, and the per-device min-max; and
  "imbal" = the busiest device's FLOPs over the mean device's.
* ICI: K/V bytes each device sends per hop (backward: plus the f32 dK/dV
  accumulators) against the compute time of a hop, and the one-way bandwidth
  that would hide the send, compared with a one-link estimate derived from the
  per-chip bidirectional ICI bandwidth Google documents (see ICI_BIDIR_GBPS).
* in-kernel ring (`implementation="pallas_tpu_ring"`): per generation, the shard
  length below which a full-mask hop's compute at the MXU peak is shorter than
  its send over one ICI link (`kernel_ring_min_shard`), forward and backward.
* in-kernel ring with HBM slots (`ring_forward_hbm.py`, `ring_backward_hbm.py`): per
  generation and long shard lengths (KERNEL_RING_HBM_SHARDS), one full-mask hop of
  one device (`ring_hbm_hop`, printed by `print_kernel_ring_hbm`): FLOPs and their
  time at the MXU peak, the HBM bytes the kernel copies per tile (q, state, streamed
  K/V; backward: dQ pass, dK/dV pass, fold) plus the ring's send read and receive
  written, their time, the bound, the ICI send time and whether the hop hides it;
  the slots and tiles `planner.plan_ring` picks, and the size of the ring's SMEM
  tile table.

Hardware numbers are JAX's own table (`pltpu.get_tpu_info_for_chip`, per
TensorCore, times the TensorCores of one JAX device: v4 and v5p chips are one
megacore device of 2 cores, a v7x device is one of its chip's 2 cores).  The
compute bound uses the bf16 peak.  Everything printed before the timing section
is derived from this model, not measured: it ignores VPU work (exp, masking),
the ~0.35 us per-grid-step overhead, XLA ops around the kernels (casts, the
online-softmax merge, delta), megacore splitting, and DMA efficiency.

A last model section walks one decode step and one mixed prefill + decode step through the ragged paged kernel
(`_src/backends/pallas_tpu/paged.py`, blocks from `planner.plan_paged_block_sizes`): K/V bytes copied against
each live byte once, grouped vs ungrouped decode MXU rows, ragged vs padded FLOPs, and the projected decode time
against the HBM bound (`print_paged`).

When a TPU is attached (`jax.default_backend() == "tpu"`) the script also times
`ring_attention(..., implementation="pallas_tpu")` (a ring of one, at each
per-device shard length) forward and forward+backward against
`jax.nn.dot_product_attention` in the same run, and prints achieved time next
to the model's roofline for exactly that call.

Run it::

  python benchmarks/tpu_roofline.py --quick          # a few seconds
  python benchmarks/tpu_roofline.py                  # default table, < 1 min on CPU
  python benchmarks/tpu_roofline.py --generations v5e,v6e --seq-lens 131072,1048576 --masks causal,causal-lb
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import math
import statistics
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import tpu as pltpu

import flax_ringattn as fr
from flax_ringattn._src import layout, masks
from flax_ringattn._src.backends.pallas_tpu import backward, common, forward, planner

GENERATIONS = ("v4", "v5e", "v5p", "v6e", "v7x")
# generation -> (pltpu.ChipVersion member, TensorCores per JAX device)
CHIPS = {"v4": ("TPU_V4", 2), "v5e": ("TPU_V5E", 1), "v5p": ("TPU_V5P", 2), "v6e": ("TPU_V6E", 1), "v7x": ("TPU_7X", 1)}
# Bidirectional ICI bandwidth per chip, GB/s, from Google's Cloud TPU system-architecture pages
# (docs.cloud.google.com/tpu/docs/v5e, /v5p, and the generation table of /tpu7x, which also lists v6e).
# v4's page gives no per-chip figure, so v4 has none here.
ICI_BIDIR_GBPS = {"v5e": 400, "v5p": 1200, "v6e": 800, "v7x": 1200}
# ICI ports per chip: v5e's page lists 4; v6e (2D torus) and v5p (3D torus) are assumed to have one port per torus
# neighbour.  v7x: not documented in those pages, and a v7x device is one TensorCore of a 2-core chip; no estimate.
ICI_PORTS = {"v5e": 4, "v6e": 4, "v5p": 6}
MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}  # per tile pair, read off forward._kernel / backward._dq_kernel / _dkv_kernel
PASSES = {"fwd": ("fwd",), "bwd": ("dq", "dkv")}
DEFAULT_SEQ_LENS = (32768, 131072, 524288)
QUICK_SEQ_LENS = (16384,)
ALL_MASKS = ("full", "causal", "causal-lb", "window")
GB, MB, MIB, GIB = 1e9, 1e6, 2**20, 2**30


# ------------------------------------------------------------------------------------------
# Hardware.


@dataclasses.dataclass(frozen=True)
class Hardware:
  gen: str
  cores: int  # TensorCores per JAX device
  peak: float  # bf16 FLOP/s per device
  hbm_bw: float  # bytes/s per device
  vmem: int  # bytes per TensorCore
  ici_bidir: float | None  # bytes/s per chip, both directions, all links (documented)
  ici_link: float | None  # bytes/s, one link, one direction (estimate)

  @property
  def ridge(self) -> float:
    return self.peak / self.hbm_bw


def hardware(gen: str) -> Hardware:
  chip, cores = CHIPS[gen]
  info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, chip), cores)
  bidir = ICI_BIDIR_GBPS.get(gen)
  ports = ICI_PORTS.get(gen)
  link = bidir * GB / (2 * ports) if bidir and ports else None
  return Hardware(
    gen,
    cores,
    float(info.bf16_ops_per_second * cores),
    float(info.mem_bw_bytes_per_second * cores),
    info.vmem_capacity_bytes,
    bidir * GB if bidir else None,
    link,
  )


# ------------------------------------------------------------------------------------------
# Problem and tiles.


@dataclasses.dataclass(frozen=True)
class Problem:
  B: int
  N: int
  K: int
  H: int
  dtype: str
  n: int  # ring size
  window: int

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize


def mask_setup(name: str, window: int) -> tuple[masks.MaskSpec, bool]:
  """(MaskSpec, load_balance) of a mask name."""
  if name == "full":
    return masks.MaskSpec(), False
  if name == "causal":
    return masks.MaskSpec(is_causal=True), False
  if name == "causal-lb":
    return masks.MaskSpec(is_causal=True), True
  if name == "window":
    return masks.MaskSpec(is_causal=True, window=(window, 0)), False
  raise ValueError(f"unknown mask {name!r}; known: {ALL_MASKS}")


def tiles(gen: str, L: int, p: Problem) -> dict[str, tuple[int, int]]:
  """(bq, bk) per pass as the kernels resolve them (`common.block_tiles`) from the planner's BlockSizes."""
  try:
    bs = fr.plan_block_sizes(L, L, p.N, p.K, p.H, jnp.dtype(p.dtype), generation=gen)
  except ValueError as e:
    raise ValueError(f"plan_block_sizes({L}, {L}, ..., generation={gen!r}) failed: {e}") from e
  sub = common.sublanes(jnp.dtype(p.dtype))
  fwd = (
    common.tpu_tile(L, bs.block_q, sub, what="block_q"),
    common.tpu_tile(L, bs.block_kv, common.LANES, what="block_kv"),
  )
  bq, bk = bs.bwd
  bwd = (common.tpu_tile(L, bq, sub, what="block_q_bwd"), common.tpu_tile(L, bk, common.LANES, what="block_kv_bwd"))
  return {"fwd": fwd, "bwd": bwd}


# ------------------------------------------------------------------------------------------
# Tile tables over the ring.
#
# The tables are computed by the library's own `layout.shard_positions` and `masks.tile_kinds`, run on numpy
# arrays (their module's `jnp` swapped for numpy while they run): XLA would compile every distinct shape, which
# costs far more than the arithmetic here.  `fetch_index_np` mirrors `common.fetch_index` (jax.lax.cummax has no
# numpy twin).  The self-check compares all of it with the jitted JAX originals on a small ring.


@contextlib.contextmanager
def _numpy_as_jnp():
  saved = masks.jnp, layout.jnp
  masks.jnp = layout.jnp = np
  try:
    yield
  finally:
    masks.jnp, layout.jnp = saved


def fetch_index_np(kinds: np.ndarray) -> np.ndarray:
  """numpy twin of `common.fetch_index` (checked against it by the self-check)."""
  n = kinds.shape[-1]
  j = np.broadcast_to(np.arange(n, dtype=np.int32), kinds.shape)
  live = kinds != 0
  before = np.maximum.accumulate(np.where(live, j, -1), axis=-1)
  after = np.flip(np.minimum.accumulate(np.flip(np.where(live, j, n), axis=-1), axis=-1), axis=-1)
  return np.where(before >= 0, before, np.where(after < n, after, 0)).astype(np.int32)


@functools.cache
def ring_positions(n: int, L: int, lb: bool) -> tuple[np.ndarray, np.ndarray]:
  """q positions [n, L] of every device and kv positions [n, n, L] of (device r, hop t): shard (r - t) mod n."""
  with _numpy_as_jnp():
    pos = np.stack([np.asarray(layout.shard_positions(r, n, L, lb)) for r in range(n)]).astype(np.int32)
  src = (np.arange(n)[:, None] - np.arange(n)[None, :]) % n
  return pos, pos[src]


@dataclasses.dataclass(frozen=True)
class Tables:
  """Per (device, hop): kinds [n, n, L/bq, L/bk], fetch (same shape), fetch_t (dk/dv: transposed), launched [n, n]."""

  kinds: np.ndarray
  fetch: np.ndarray
  fetch_t: np.ndarray
  launched: np.ndarray

  def at(self, r: int, t: int) -> Tables:
    return Tables(
      self.kinds[r, t][None, None],
      self.fetch[r, t][None, None],
      self.fetch_t[r, t][None, None],
      self.launched[r, t][None, None],
    )


@functools.cache
def ring_tables(mask: str, window: int, n: int, L: int, bq: int, bk: int) -> Tables:
  """masks.tile_kinds of every (device, hop) on the real positions, the fetch-index tables, and which hops launch."""
  spec, lb = mask_setup(mask, window)
  q_pos, kv_pos = ring_positions(n, L, lb)
  try:
    with _numpy_as_jnp():
      kinds = _pairwise(lambda qp, kp: masks.tile_kinds(spec, qp, kp, None, None, bq, bk), q_pos, kv_pos)
      # The ring skips a hop whose whole block is EMPTY (ring_loop._hop_kind: classify with one tile per shard).
      hop = _pairwise(lambda qp, kp: masks.tile_kinds(spec, qp, kp, None, None, L, L)[0, 0], q_pos, kv_pos)
  except (AttributeError, TypeError):  # the library code needs something numpy lacks: run it under XLA instead
    kinds = np.asarray(_ring_kinds_jit(spec=spec, q_pos=q_pos, kv_pos=kv_pos, bq=bq, bk=bk))
    hop = np.asarray(_ring_kinds_jit(spec=spec, q_pos=q_pos, kv_pos=kv_pos, bq=L, bk=L))[..., 0, 0]
  kinds = kinds.astype(np.int8)
  return Tables(kinds, fetch_index_np(kinds), fetch_index_np(np.swapaxes(kinds, -1, -2)), hop != masks.EMPTY)


def _pairwise(f, q_pos: np.ndarray, kv_pos: np.ndarray) -> np.ndarray:
  """f(q positions of device r, kv positions of its hop t) stacked to [n, n, ...]."""
  n = q_pos.shape[0]
  return np.stack([np.stack([np.asarray(f(q_pos[r], kv_pos[r, t])) for t in range(n)]) for r in range(n)])


def _ring_kinds(spec: masks.MaskSpec, q_pos, kv_pos, bq: int, bk: int):
  one = lambda qp, kp: masks.tile_kinds(spec, qp, kp, None, None, bq, bk)
  return jax.vmap(jax.vmap(one, in_axes=(None, 0)))(q_pos, kv_pos)


_ring_kinds_jit = jax.jit(_ring_kinds, static_argnames=("spec", "bq", "bk"))


@functools.partial(jax.jit, static_argnames=("n", "L", "bq", "bk", "window"))
def _jax_tables(*, n: int, L: int, bq: int, bk: int, window: int):
  """The same tables by the JAX originals (for the self-check): positions, and per mask kinds, fetch, fetch_t, hop."""
  src = (jnp.arange(n)[:, None] - jnp.arange(n)[None, :]) % n
  pos = {lb: jax.vmap(lambda r, lb=lb: layout.shard_positions(r, n, L, lb))(jnp.arange(n)) for lb in (False, True)}
  out = {"positions": {lb: (q, q[src]) for lb, q in pos.items()}}
  for name in ALL_MASKS:
    spec, lb = mask_setup(name, window)
    q_pos, kv_pos = out["positions"][lb]
    kinds = _ring_kinds(spec, q_pos, kv_pos, bq, bk)
    hop = _ring_kinds(spec, q_pos, kv_pos, L, L)[..., 0, 0]
    vis = jax.vmap(jax.vmap(lambda qp, kp, spec=spec: masks.visible(spec, qp, kp).sum(), in_axes=(None, 0)))
    out[name] = (
      kinds,
      common.fetch_index(kinds),
      common.fetch_index(jnp.swapaxes(kinds, -1, -2)),
      hop,
      vis(q_pos, kv_pos),
    )
  return out


@functools.cache
def visible_pairs(mask: str, window: int, n: int, L: int) -> np.ndarray:
  """[n, n] number of visible (q, k) pairs per (device, hop), from the positions (kv sorted in a shard)."""
  spec, lb = mask_setup(mask, window)
  q_pos, kv_pos = ring_positions(n, L, lb)
  out = np.zeros((n, n), np.int64)
  big = np.iinfo(np.int64).max // 4
  for r in range(n):
    q = q_pos[r].astype(np.int64)
    lo, hi = np.full(L, -big), np.full(L, big)
    if spec.is_causal:
      hi = q
    if spec.window is not None:
      left, right = spec.window
      lo, hi = q - left, np.minimum(hi, q + right)
    for t in range(n):
      kp = kv_pos[r, t]
      assert np.all(kp[1:] >= kp[:-1]), "positions must increase within a shard"
      cnt = np.searchsorted(kp, hi, side="right") - np.searchsorted(kp, lo, side="left")
      out[r, t] = np.clip(cnt, 0, None).sum()
  return out


# ------------------------------------------------------------------------------------------
# DMA model.


def block_bytes(shape, dtype, tiled: bool) -> int:
  """HBM bytes one DMA of a block moves: the (sublane, 128) HBM tiles it spans, or its bare elements."""
  dims = [1 if d is None else int(d) for d in shape]
  dtype = jnp.dtype(dtype)
  if tiled:
    dims[-1] = -(-dims[-1] // common.LANES) * common.LANES
    if len(dims) >= 2:
      sub = common.sublanes(dtype)
      dims[-2] = -(-dims[-2] // sub) * sub
  return math.prod(dims) * dtype.itemsize


# How each operand's BlockSpec index map moves over the (row, step) grid of one (b, kv head):
# "row" = the row index (grid axis 2), "fetch" = the fetch-index table at (row, step); and whether
# the index also contains b and h (then a new (b, h) always refetches).  Order = the plan's in_specs.
# The self-check replays the real index maps and fails if this drifts from the kernels.
IN_MAPS = {
  "fwd": (("row", True), ("fetch", True), ("fetch", True), ("row", False), ("fetch", False)),
  "dq": (("row", True),) * 4 + (("fetch", True),) * 2 + (("row", False), ("fetch", False)),
  "dkv": (("row", True),) * 2 + (("fetch", True),) * 4 + (("fetch", False), ("row", False)),
}
PLANS = {"fwd": forward.fwd_plan, "dq": backward.dq_plan, "dkv": backward.dkv_plan}


def _dmas(seq: np.ndarray, live: np.ndarray, bh: int, has_bh: bool) -> tuple[np.ndarray, np.ndarray]:
  """(issued, dead) DMA counts of one operand per launch.

  seq [..., M]: block index along the M steps of one (b, kv head), in grid order; live [..., M]: the step
  computes.  A DMA is dead when no live step runs while its block is resident.
  """
  batch = seq.shape[:-1]
  seq = seq.reshape(-1, seq.shape[-1])
  live = live.reshape(seq.shape)
  change = np.ones(seq.shape, bool)
  change[:, 1:] = seq[:, 1:] != seq[:, :-1]
  within = change.sum(axis=1)
  seg = np.cumsum(change.ravel()) - 1
  used = np.bincount(seg, weights=live.ravel(), minlength=int(seg[-1]) + 1) > 0
  seg_row = np.repeat(np.arange(seq.shape[0]), within)
  dead = np.bincount(seg_row, weights=~used, minlength=seq.shape[0]).astype(np.int64)
  if has_bh:
    issued = bh * within
  else:  # the same index sequence repeats for every (b, h); the wrap-around step refetches only on a change
    wrap = seq[:, 0] != seq[:, -1]
    issued = within + (bh - 1) * (within - 1 + wrap)
  return issued.reshape(batch), (bh * dead).reshape(batch)


@dataclasses.dataclass
class KernelCost:
  """Per-launch totals, arrays [n devices, n hops] (zero where the hop is not launched)."""

  flops: np.ndarray
  useful: np.ndarray
  bytes: np.ndarray
  dead: np.ndarray


def kernel_cost(
  kernel: str, tab: Tables, pairs: np.ndarray, p: Problem, L: int, bq: int, bk: int, tiled: bool
) -> KernelCost:
  """FLOPs and HBM bytes of `kernel` ('fwd', 'dq', 'dkv') for every (device, hop) of the ring."""
  dims = dict(B=p.B, T=L, S=L, N=p.N, K=p.K, H=p.H, dtype=jnp.dtype(p.dtype), bq=bq, bk=bk, has_segments=False)
  plan = PLANS[kernel](**dims)
  if kernel == "dkv":  # dk/dv walks the transposed table (block_bwd: kinds.T and fetch_index(kinds.T))
    table, fetch = np.swapaxes(tab.kinds, -1, -2), tab.fetch_t
  else:
    table, fetch = tab.kinds, tab.fetch
  launched = tab.launched
  rows = table.shape[-2]
  live = table != masks.EMPTY
  row_idx = np.broadcast_to(np.arange(rows, dtype=np.int32)[:, None], table.shape)
  seqs = {"row": row_idx.reshape(*table.shape[:2], -1), "fetch": fetch.reshape(*table.shape[:2], -1)}
  live_flat = live.reshape(*table.shape[:2], -1)
  bh = p.B * p.K
  total = np.zeros(launched.shape, np.float64)
  dead = np.zeros(launched.shape, np.float64)
  counted = {}
  for spec, dtype, (which, has_bh) in zip(plan.in_specs, plan.in_dtypes, IN_MAPS[kernel], strict=True):
    key = (which, has_bh)
    if key not in counted:
      counted[key] = _dmas(seqs[which], live_flat, bh, has_bh)
    issued, wasted = counted[key]
    nbytes = block_bytes(spec.block_shape, dtype, tiled)
    total += issued * nbytes
    dead += wasted * nbytes
  empty_rows = (~live.any(axis=-1)).sum(axis=-1)  # [n, n]: rows without a non-EMPTY tile write zeros / -inf
  for spec, out in zip(plan.out_specs, plan.out_shapes, strict=True):
    nbytes = block_bytes(spec.block_shape, out.dtype, tiled)
    total += bh * rows * nbytes  # one write-back per row and (b, h)
    dead += bh * empty_rows * nbytes
  tile_flops = MATMULS[kernel] * 2 * p.G * bq * bk * p.H * bh
  flops = live.sum(axis=(-2, -1)) * float(tile_flops)
  useful = pairs * float(MATMULS[kernel] * 2 * p.H * p.B * p.N)
  return KernelCost(*(np.where(launched, a, 0.0) for a in (flops, useful, total, dead)))


# ------------------------------------------------------------------------------------------
# One row of the table: a (generation, T, mask, pass).


@dataclasses.dataclass
class PassResult:
  gen: str
  T: int
  shard: int
  mask: str
  pas: str
  tiles: tuple[int, int]
  skip: float  # EMPTY tiles / all tiles, all devices and hops
  skip_dev: tuple[float, float]  # per-device min, max
  flops: float  # busiest device, summed over its hops and the pass's kernels
  useful: float
  bytes: float
  dead: float
  t_mxu: float  # busiest device: sum of flops / peak
  t_hbm: float
  t_dev: float  # busiest device: sum over launches of max(flops / peak, bytes / bw)
  t_ring: float  # sum over hops of the slowest device's hop time
  imbal: float
  hop_times: np.ndarray  # [n hops]: slowest device's time per hop
  error: str = ""

  @property
  def bound(self) -> str:
    return "mxu" if self.t_mxu >= self.t_hbm else "hbm"


def evaluate(gen: str, T: int, mask: str, pas: str, p: Problem, hw: Hardware, tiled: bool) -> PassResult:
  L = T // p.n
  bq, bk = tiles(gen, L, p)[pas]
  tab = ring_tables(mask, p.window, p.n, L, bq, bk)
  pairs = visible_pairs(mask, p.window, p.n, L)
  costs = [kernel_cost(k, tab, pairs, p, L, bq, bk, tiled) for k in PASSES[pas]]
  t_launch = sum(np.maximum(c.flops / hw.peak, c.bytes / hw.hbm_bw) for c in costs)  # [n, n]
  t_dev = t_launch.sum(axis=1)
  r = int(np.argmax(t_dev))
  flops = sum(c.flops for c in costs)
  empty = tab.kinds == masks.EMPTY
  skip_dev = empty.mean(axis=(1, 2, 3))
  hop_times = t_launch.max(axis=0)
  return PassResult(
    gen,
    T,
    L,
    mask,
    pas,
    (bq, bk),
    float(empty.mean()),
    (float(skip_dev.min()), float(skip_dev.max())),
    float(flops[r].sum()),
    float(sum(c.useful for c in costs)[r].sum()),
    float(sum(c.bytes for c in costs)[r].sum()),
    float(sum(c.dead for c in costs)[r].sum()),
    float(flops[r].sum() / hw.peak),
    float(sum(c.bytes for c in costs)[r].sum() / hw.hbm_bw),
    float(t_dev[r]),
    float(hop_times.sum()),
    float(flops.sum(axis=1).max() / max(flops.sum(axis=1).mean(), 1.0)),
    hop_times,
  )


# ------------------------------------------------------------------------------------------
# Self-check: the vectorised model against the kernels' own index maps on small grids.


def _replay(kernel: str, tab: Tables, p: Problem, L: int, bq: int, bk: int, tiled: bool) -> tuple[float, float]:
  """(HBM bytes, FLOPs) of one launch (`tab` of one hop) by walking the grid through the plan's index_map lambdas."""
  dims = dict(B=p.B, T=L, S=L, N=p.N, K=p.K, H=p.H, dtype=jnp.dtype(p.dtype), bq=bq, bk=bk, has_segments=False)
  plan = PLANS[kernel](**dims)
  kinds = tab.kinds[0, 0]
  table, fetch = (kinds.T, tab.fetch_t[0, 0]) if kernel == "dkv" else (kinds, tab.fetch[0, 0])
  prev_in = [None] * len(plan.in_specs)
  prev_out = [None] * len(plan.out_specs)
  total = flops = 0.0
  for g in np.ndindex(*plan.grid):
    for a, spec in enumerate(plan.in_specs):
      idx = tuple(int(x) for x in spec.index_map(*g, table, fetch))
      if idx != prev_in[a]:
        total += block_bytes(spec.block_shape, plan.in_dtypes[a], tiled)
        prev_in[a] = idx
    for a, spec in enumerate(plan.out_specs):
      idx = tuple(int(x) for x in spec.index_map(*g, table, fetch))
      if idx != prev_out[a]:  # the previous block is written back when the index moves on (and at the end)
        total += block_bytes(spec.block_shape, plan.out_shapes[a].dtype, tiled)
        prev_out[a] = idx
    if table[g[2], g[3]] != masks.EMPTY:
      flops += MATMULS[kernel] * 2 * p.G * bq * bk * p.H
  return total, flops


def self_check(tiled: bool) -> None:
  """Raises unless the model agrees with the library on a small ring (B=2, K=2, so (b, h) boundaries are crossed):
  the numpy-run tables equal the jitted JAX originals, the visible-pair counts equal a brute-force masks.visible,
  and the vectorised DMA/FLOP counts equal a replay of the grid through the kernels' own index_map lambdas."""
  p = Problem(B=2, N=4, K=2, H=128, dtype="bfloat16", n=4, window=100)
  L, bq, bk = 512, 64, 128
  ref = jax.tree.map(np.asarray, _jax_tables(n=p.n, L=L, bq=bq, bk=bk, window=p.window))
  for lb in (False, True):
    for got, want in zip(ring_positions(p.n, L, lb), ref["positions"][lb], strict=True):
      assert np.array_equal(got, want), ("positions", lb)
  for mask in ALL_MASKS:
    tab = ring_tables(mask, p.window, p.n, L, bq, bk)
    pairs = visible_pairs(mask, p.window, p.n, L)
    kinds, fetch, fetch_t, hop, vis = ref[mask]
    assert np.array_equal(tab.kinds, kinds) and np.array_equal(tab.launched, hop != masks.EMPTY), (mask, "kinds")
    assert np.array_equal(tab.fetch, fetch) and np.array_equal(tab.fetch_t, fetch_t), (mask, "fetch_index")
    assert np.array_equal(pairs, vis), (mask, "visible pairs")
    for kernel in MATMULS:
      cost = kernel_cost(kernel, tab, pairs, p, L, bq, bk, tiled)
      for r, t in [(0, 0), (1, 2), (p.n - 1, 1), (2, p.n - 1)]:
        if not tab.launched[r, t]:
          assert cost.bytes[r, t] == 0
          continue
        want_bytes, want_flops = _replay(kernel, tab.at(r, t), p, L, bq, bk, tiled)
        assert cost.bytes[r, t] == want_bytes, (mask, kernel, r, t, cost.bytes[r, t], want_bytes)
        assert cost.flops[r, t] == want_flops, (mask, kernel, r, t)


# ------------------------------------------------------------------------------------------
# Printing.


def _fmt_time(s: float) -> str:
  return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.1f}"


def print_hardware(gens: Sequence[str]) -> None:
  print("Hardware (JAX pltpu.get_tpu_info_for_chip, per JAX device; ICI per chip from Cloud TPU docs):")
  print(
    f"  {'gen':4} {'cores':>5} {'bf16 TF/s':>9} {'HBM GB/s':>8} {'ridge F/B':>9} {'VMEM MiB':>8} "
    f"{'ICI bidir GB/s/chip':>19} {'1 link 1-way GB/s (est)':>23}"
  )
  for g in gens:
    hw = hardware(g)
    bidir = f"{hw.ici_bidir / GB:.0f}" if hw.ici_bidir else "n/a"
    link = f"{hw.ici_link / GB:.0f}" if hw.ici_link else "n/a"
    print(
      f"  {g:4} {hw.cores:>5} {hw.peak / 1e12:>9.0f} {hw.hbm_bw / GB:>8.0f} {hw.ridge:>9.0f} "
      f"{hw.vmem / MIB:>8.0f} {bidir:>19} {link:>23}"
    )


def print_tiles(gens: Sequence[str], seq_lens: Sequence[int], p: Problem) -> None:
  print(f"\nTiles from plan_block_sizes(T/n, T/n, N={p.N}, K={p.K}, H={p.H}, {p.dtype}), as bq x bk (fwd | bwd):")
  shards = [T // p.n for T in seq_lens]
  print("  " + f"{'gen':4}" + "".join(f" {'T/n=' + str(L):>22}" for L in shards))
  for g in gens:
    cells = []
    for L in shards:
      try:
        t = tiles(g, L, p)
        cells.append(f"{t['fwd'][0]}x{t['fwd'][1]} | {t['bwd'][0]}x{t['bwd'][1]}")
      except ValueError:
        cells.append("error (see rows)")
    print("  " + f"{g:4}" + "".join(f" {c:>22}" for c in cells))


HEADER = (
  f"  {'gen':4} {'T':>8} {'T/n':>7} {'mask':10} {'pass':4} {'tiles':>9} {'skip%':>6} {'dev skip%':>11} "
  f"{'TFLOP':>9} {'useful%':>7} {'GB':>8} {'dead GB':>7} {'FLOP/B':>7} {'bound':>5} {'t_dev ms':>9} "
  f"{'t_ring ms':>9} {'imbal':>5}"
)


def print_row(r: PassResult) -> None:
  if r.error:
    print(f"  {r.gen:4} {r.T:>8} {'':>7} {r.mask:10} {r.pas:4} error: {r.error}")
    return
  tiles_s = f"{r.tiles[0]}x{r.tiles[1]}"
  dev = f"{100 * r.skip_dev[0]:.0f}-{100 * r.skip_dev[1]:.0f}"
  useful = 100 * r.useful / r.flops if r.flops else 0.0
  ai = r.flops / r.bytes if r.bytes else 0.0
  print(
    f"  {r.gen:4} {r.T:>8} {r.shard:>7} {r.mask:10} {r.pas:4} {tiles_s:>9} {100 * r.skip:>6.1f} "
    f"{dev:>11} {r.flops / 1e12:>9.2f} {useful:>7.1f} {r.bytes / GB:>8.2f} {r.dead / GB:>7.2f} {ai:>7.0f} "
    f"{r.bound:>5} {_fmt_time(r.t_dev):>9} {_fmt_time(r.t_ring):>9} {r.imbal:>5.2f}"
  )


def print_ici(
  results: dict, gens: Sequence[str], seq_lens: Sequence[int], mask_names: Sequence[str], p: Problem
) -> None:
  print("\nICI per hop (model-derived): bytes each device sends per hop vs. the slowest device's compute in the")
  print("sending hops (roofline); 'needs' = one-way bandwidth that would hide the send behind the hop's compute.")
  print("Forward sends K and V; backward sends K and V plus the f32 dK/dV accumulators.  'link' assumes the ring's")
  print("neighbour is one ICI link away and the send uses one direction of that one link.")
  print(
    f"  {'gen':4} {'T/n':>7} {'mask':10} {'pass':4} {'MB/hop':>8} {'min hop ms':>10} {'needs GB/s':>10} "
    f"{'link GB/s':>9} {'ICI ms':>8} {'hidden':>6}"
  )
  for g in gens:
    hw = hardware(g)
    for T in seq_lens:
      L = T // p.n
      for mask in mask_names:
        for pas in PASSES:
          r = results.get((g, T, mask, pas))
          if r is None or r.error:
            continue
          per_elem = p.itemsize if pas == "fwd" else p.itemsize + 4
          sent = 2 * p.B * L * p.K * p.H * per_elem
          sending = r.hop_times[: p.n - 1] if pas == "fwd" else r.hop_times  # bwd: accumulators move every hop
          t_min = float(sending.min()) if len(sending) else float("nan")
          needs = sent / t_min if t_min > 0 else float("inf")
          if hw.ici_link:
            t_ici = sent / hw.ici_link
            link, ici = f"{hw.ici_link / GB:.0f}", _fmt_time(t_ici)
            hidden = "yes" if t_ici <= t_min else "no"
          else:
            link = ici = hidden = "n/a"
          print(
            f"  {g:4} {L:>7} {mask:10} {pas:4} {sent / MB:>8.1f} {_fmt_time(t_min):>10} {needs / GB:>10.1f} "
            f"{link:>9} {ici:>8} {hidden:>6}"
          )


def kernel_ring_min_shard(hw: Hardware, p: Problem, pas: str) -> float | None:
  """Shard length L below which one hop of `implementation="pallas_tpu_ring"` cannot hide its send (full mask,
  MXU-bound compute, one ICI link one way).

  A hop computes 2 * B * L^2 * N * H FLOPs per matmul (forward 2 matmuls: s, pv; the fused backward 5: s, dp,
  dq, dk, dv) and sends 2 * B * L * K * H elements (K and V; backward: plus the f32 dK/dV accumulators), so
  compute / transfer grows linearly in L and they break even at
  L = bytes_per_token * peak / (flops_per_token_squared * link).
  """
  if not hw.ici_link:
    return None
  matmuls = 2 if pas == "fwd" else 5
  flops_per_l2 = 2 * matmuls * p.B * p.N * p.H
  per_elem = p.itemsize if pas == "fwd" else p.itemsize + 4
  bytes_per_l = 2 * p.B * p.K * p.H * per_elem
  return bytes_per_l * hw.peak / (flops_per_l2 * hw.ici_link)


def print_kernel_ring(gens: Sequence[str], p: Problem) -> None:
  print("\nIn-kernel ring (pallas_tpu_ring), per hop (model-derived): below this shard length T/n a hop's compute")
  print("(full mask, at the bf16 MXU peak) is shorter than its send over one ICI link, so the ring waits on ICI.")
  print("A causal or windowed hop computes less and needs a longer shard.  Link bandwidths as in the ICI table.")
  print(f"  {'gen':4} {'link GB/s':>9} {'fwd min T/n':>11} {'bwd min T/n':>11}")
  for g in gens:
    hw = hardware(g)
    f, b = kernel_ring_min_shard(hw, p, "fwd"), kernel_ring_min_shard(hw, p, "bwd")
    if f is None:
      print(f"  {g:4} {'n/a':>9} {'n/a':>11} {'n/a':>11}")
      continue
    print(f"  {g:4} {hw.ici_link / GB:>9.0f} {f:>11.0f} {b:>11.0f}")


# ------------------------------------------------------------------------------------------
# The in-kernel ring with HBM slots (`ring_forward_hbm.py`, `ring_backward_hbm.py`): per-hop model, full mask.

KERNEL_RING_HBM_SHARDS = (1024, 8192, 32768, 131072)  # per-device shard lengths T / n of `print_kernel_ring_hbm`


@dataclasses.dataclass(frozen=True)
class RingHop:
  """One hop of an HBM-slot ring kernel on one device (all B x K grid steps), full mask: every tile computes."""

  pas: str  # "fwd" or "bwd"
  hop: int
  tiles: tuple[int, int]  # (bq, bk) the kernel runs with
  slots: str  # what `planner.plan_ring` picks at this shape: "hbm" = this kernel runs, "vmem" = the other one
  smem_table: int  # bytes of the ring's tile table (`planner.ring_table_bytes`: n x T/bq x S/bk classes of 2 bits;
  # `ring_protocol.ring_dims` refuses more than common.SMEM_TABLE_BYTES)
  flops: float
  tile_bytes: float  # HBM bytes of the kernel's own copies: outer tiles, state, streamed tiles, fold
  ring_bytes: float  # HBM bytes of the ring's sends: the outgoing copy read here plus the incoming one written here
  sent: float  # bytes this device sends to its neighbour over ICI this hop
  t_mxu: float  # flops / bf16 peak
  t_hbm: float  # bytes / HBM bandwidth
  t_ici: float | None  # sent / one ICI link one way; None where the link is unknown

  @property
  def bytes(self) -> float:
    return self.tile_bytes + self.ring_bytes

  @property
  def bound(self) -> str:
    return "mxu" if self.t_mxu >= self.t_hbm else "hbm"

  @property
  def t_hop(self) -> float:
    return max(self.t_mxu, self.t_hbm)

  @property
  def hidden(self) -> bool | None:
    """Whether the hop's compute (roofline) is at least as long as its send; None without a link figure."""
    return None if self.t_ici is None else self.t_ici <= self.t_hop


def middle_hop(n: int) -> int:
  """The hop `print_kernel_ring_hbm` shows: hop 1 of a ring of 3 or more (state read and written, K/V sent;
  backward also dq read, the fold, and the dK/dV accumulators sent), else hop 0."""
  return 1 if n > 2 else 0


def ring_hbm_hop(
  gen: str,
  L: int,
  p: Problem,
  pas: str,
  *,
  hop: int | None = None,
  tile: tuple[int, int] | None = None,
  tiled: bool = True,
) -> RingHop:
  """HBM bytes, FLOPs and ICI send of hop `hop` (default `middle_hop(p.n)`) of the HBM-slot ring kernel `pas`
  ("fwd": `ring_forward_hbm._kernel`, hops 0 .. n-1; "bwd": `ring_backward_hbm._kernel`, hops 0 .. n, hop n
  only sending the accumulators home) on one device with shard length L = T = S, full mask (no tile, row or
  column skipped, every member sends: live = n).  `tile` (bq, bk) defaults to the ring planner's
  (`planner.plan_ring`, as the kernels plan them without BlockSizes).

  Per (batch row, kv head), with nq = L / bq q tiles and nk = L / bk kv tiles, and bb(shape, dtype) the bytes
  of one copy (`block_bytes`: (sublane, 128) HBM tiles, so an f32 [G, bq, 1] lse / delta tile moves G x bq x 128
  words; bare elements with tiled=False):

  forward, per q tile: q [G, bq, H] in; the state, stored finished in the outputs as o [G, bq, H] f32 and lse
    [G, bq, 1] f32, read (not on hop 0, which initialises it) and written back (every hop, the last one's write
    being the result); all nk K and V tiles [bk, H] streamed.  2 matmuls per tile pair.
  backward, dQ pass per q tile: q, dO [G, bq, H] and lse, delta [G, bq, 1] f32 in, dq [G, bq, H] f32 read (not
    on hop 0) and written, all nk K / V tiles streamed; 3 matmuls per tile pair.  dK/dV pass per kv tile: K, V
    [bk, H] in, all nq q / dO / lse / delta tiles streamed, dK, dV [bk, H] f32 written; 4 matmuls.  Fold (hops
    1 .. n-1) per kv tile: for dK and dV, read the arrived accumulator and the local sum, write the sum.  After
    the last hop, the accumulators [S, H] f32 are copied out (counted in that hop).
  sends: K and V [S, H] on hops t < n - 1; backward also the f32 dK / dV accumulators on hops t >= 1.  Each
    sent byte is read from this device's HBM and (from the upstream neighbour) written into it: 2 x sent.
  """
  if pas not in PASSES:
    raise ValueError(f"pas must be one of {tuple(PASSES)}, got {pas!r}")
  n = p.n
  t = middle_hop(n) if hop is None else hop
  last = n - 1 if pas == "fwd" else (n if n > 1 else 0)
  if not 0 <= t <= last:
    raise ValueError(f"hop {t} is not a hop of the {pas} ring of {n} (0 .. {last})")
  hw = hardware(gen)
  dtype = jnp.dtype(p.dtype)
  plan = planner.plan_ring(
    T=L,
    S=L,
    n=n,
    num_heads=p.N,
    num_kv_heads=p.K,
    head_dim=p.H,
    dtype=dtype,
    backward=pas == "bwd",
    tiles=tile,
    generation=gen,
  )
  bq, bk, slots = plan.bq, plan.bk, plan.slots
  if L % bq or L % bk:
    raise ValueError(f"tiles {bq}x{bk} do not divide the shard length {L}")
  G, H, nq, nk, f32 = p.G, p.H, L // bq, L // bk, "float32"
  bb = functools.partial(block_bytes, tiled=tiled)
  q_t, f32_q, stat = bb((G, bq, H), dtype), bb((G, bq, H), f32), bb((G, bq, 1), f32)
  kv_t, f32_kv = bb((bk, H), dtype), bb((bk, H), f32)
  shard, acc = bb((L, H), dtype), bb((L, H), f32)  # one K (or V) shard; one dK (or dV) accumulator
  computes = t < n  # backward hop n only sends
  if pas == "fwd":
    matmuls = MATMULS["fwd"]
    state = f32_q + stat  # o, lse
    per_row = q_t + nk * 2 * kv_t + (state if t > 0 else 0) + state
    tile_bytes = nq * per_row
    sent = 2 * shard if t < n - 1 else 0
  else:
    matmuls = MATMULS["dq"] + MATMULS["dkv"]
    q_side = 2 * q_t + 2 * stat  # q, dO, lse, delta
    dq_pass = nq * (q_side + (f32_q if t > 0 else 0) + f32_q + nk * 2 * kv_t)
    dkv_pass = nk * (2 * kv_t + nq * q_side + 2 * f32_kv)
    fold = nk * 2 * 3 * f32_kv if 1 <= t < n else 0
    copy_out = 2 * 2 * acc if t == last else 0  # dK, dV: read the home slot, write the output
    tile_bytes = (dq_pass + dkv_pass if computes else 0) + fold + copy_out
    sent = (2 * shard if t < n - 1 else 0) + (2 * acc if t >= 1 else 0)
  bh = p.B * p.K
  flops = float(bh * matmuls * 2 * G * L * L * H) if computes else 0.0
  tile_bytes, sent = float(bh * tile_bytes), float(bh * sent)
  ring_bytes = 2 * sent
  return RingHop(
    pas=pas,
    hop=t,
    tiles=(bq, bk),
    slots=slots,
    smem_table=planner.ring_table_bytes(n, nq, nk),
    flops=flops,
    tile_bytes=tile_bytes,
    ring_bytes=ring_bytes,
    sent=sent,
    t_mxu=flops / hw.peak,
    t_hbm=(tile_bytes + ring_bytes) / hw.hbm_bw,
    t_ici=sent / hw.ici_link if hw.ici_link else None,
  )


def print_kernel_ring_hbm(
  gens: Sequence[str], p: Problem, tiled: bool, shards: Sequence[int] = KERNEL_RING_HBM_SHARDS
) -> None:
  t = middle_hop(p.n)
  kib = common.SMEM_TABLE_BYTES // 1024
  print("\nIn-kernel ring with HBM slots (pallas_tpu_ring, ring_forward_hbm / ring_backward_hbm), per hop")
  print(f"(model-derived, not measured; `ring_hbm_hop`): hop {t} of a ring of n={p.n}, full mask, one device.  K/V")
  print("slots, softmax state, dq and the dK/dV accumulators live in HBM; tiles stream through VMEM.")
  print("  GFLOP, mxu ms: the hop's matmuls at the bf16 MXU peak.  HBM GB, hbm ms: the kernel's tile copies (fwd:")
  print("  q, o / lse state in and out, all K/V tiles per q tile; bwd: dQ pass, dK/dV pass, fold) plus the ring's")
  print("  traffic (the outgoing send read here, the incoming one written here).  hop ms = max of the two; bound =")
  print("  the larger.")
  print("  sent MB, ICI ms: the hop's send (fwd: K/V; bwd: K/V + f32 dK/dV) over one ICI link one way, as in the ICI")
  print("  table; hidden = the hop computes at least that long.  tiles, slots: planner.plan_ring(T/n, T/n, n, ...)")
  print("  per direction ('vmem': the VMEM-slot kernel runs there, no HBM traffic inside a hop, and the row shows what")
  print(
    "  HBM slots would cost at its tiles).  SMEM KiB: the ring's tile table (n x T/bq x S/bk, 2 bits a tile), within"
  )
  print(f"  {kib} KiB by the planner.  Ignores VPU work, grid-step overhead, and that the outer tile's copies are")
  print("  synchronous (not overlapped with compute).")
  print(
    f"  {'gen':4} {'T/n':>7} {'pass':4} {'tiles':>9} {'slots':>5} {'SMEM KiB':>9} {'GFLOP':>9} {'mxu ms':>8} "
    f"{'HBM GB':>8} {'hbm ms':>8} {'FLOP/B':>7} {'bound':>5} {'hop ms':>8} {'sent MB':>8} {'ICI ms':>8} {'hidden':>6}"
  )
  for g in gens:
    for L in shards:
      for pas in PASSES:
        try:
          r = ring_hbm_hop(g, L, p, pas, hop=t, tiled=tiled)
        except ValueError as e:
          print(f"  {g:4} {L:>7} {pas:4} error: {e}")
          continue
        smem = f"{r.smem_table / 1024:.1f}{'!' if r.smem_table > common.SMEM_TABLE_BYTES else ''}"
        ici = "n/a" if r.t_ici is None else _fmt_time(r.t_ici)
        hidden = "n/a" if r.hidden is None else ("yes" if r.hidden else "no")
        tiles_s = f"{r.tiles[0]}x{r.tiles[1]}"
        print(
          f"  {g:4} {L:>7} {pas:4} {tiles_s:>9} {r.slots:>5} {smem:>9} "
          f"{r.flops / 1e9:>9.1f} {_fmt_time(r.t_mxu):>8} {r.bytes / GB:>8.3f} {_fmt_time(r.t_hbm):>8} "
          f"{r.flops / r.bytes:>7.0f} {r.bound:>5} {_fmt_time(r.t_hop):>8} {r.sent / MB:>8.1f} {ici:>8} {hidden:>6}"
        )


# ------------------------------------------------------------------------------------------
# Timing on an attached TPU.


def _median_time(fn, args, repeats: int) -> float:
  jax.block_until_ready(fn(*args))  # compile + warm-up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def time_on_tpu(args, p: Problem, seq_lens: Sequence[int], mask_names: Sequence[str], tiled: bool) -> None:
  if jax.default_backend() != "tpu":
    print(
      f"\nNo TPU attached (default backend: {jax.default_backend()}); kernels not timed, all numbers above are "
      "model-derived."
    )
    return
  gen = planner.current_generation()
  info = pltpu.get_tpu_info()
  if gen not in CHIPS:
    print(f"\nTPU {info.chip_version} is not one of {GENERATIONS}; kernels not timed.")
    return
  peak = float(info.bf16_ops_per_second * info.num_cores)
  bw = float(info.mem_bw_bytes_per_second * info.num_cores)
  one = dataclasses.replace(p, n=1)
  print(
    f"\nMeasured on this TPU ({jax.devices()[0].device_kind}, planner generation {gen!r}, {info.num_cores} core(s)): "
    f"ring_attention(implementation='pallas_tpu') as a ring of one at each per-device shard length, vs "
    f"jax.nn.dot_product_attention; median of {args.repeats}.  'roof' = this model for exactly that call."
  )
  print(
    f"  {'L':>7} {'mask':10} {'pass':7} {'pallas ms':>9} {'roof ms':>8} {'%roof':>6} {'TF/s useful':>11} "
    f"{'xla ms':>8} {'xla/pallas':>10}"
  )
  dtype = jnp.dtype(p.dtype)
  for T in seq_lens:
    L = T // p.n
    kq, kk, kv, kg = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(kq, (p.B, L, p.N, p.H), dtype)
    k = jax.random.normal(kk, (p.B, L, p.K, p.H), dtype)
    v = jax.random.normal(kv, (p.B, L, p.K, p.H), dtype)
    ct = jax.random.normal(kg, (p.B, L, p.N, p.H), dtype)
    for mask in mask_names:
      if mask == "causal-lb":
        continue  # a ring of one has no layout to balance
      spec, _ = mask_setup(mask, p.window)
      kw = dict(is_causal=spec.is_causal, local_window_size=spec.window)

      def ring(q, k, v, kw=kw):
        return fr.ring_attention(q, k, v, implementation="pallas_tpu", **kw)

      def xla(q, k, v, kw=kw):
        return jax.nn.dot_product_attention(q, k, v, **kw)

      def grad_of(f, ct=ct):
        return jax.jit(jax.grad(lambda x, y, z: jnp.sum(f(x, y, z).astype(jnp.float32) * ct), argnums=(0, 1, 2)))

      roof = {}
      try:
        for pas in PASSES:
          bq, bk = tiles(gen, L, one)[pas]
          tab = ring_tables(mask, p.window, 1, L, bq, bk)
          pairs = visible_pairs(mask, p.window, 1, L)
          costs = [kernel_cost(kn, tab, pairs, one, L, bq, bk, tiled) for kn in PASSES[pas]]
          roof[pas] = (
            sum(float(np.maximum(c.flops / peak, c.bytes / bw).sum()) for c in costs),
            sum(float(c.useful.sum()) for c in costs),
          )
      except ValueError as e:
        print(f"  {L:>7} {mask:10} model error: {e}")
        continue
      xla_ok = p.B * p.N * L * L * 4 <= args.xla_max_gib * GIB  # XLA materialises the f32 scores
      for pas, make in (("fwd", jax.jit), ("fwd+bwd", grad_of)):
        t_roof = roof["fwd"][0] + (roof["bwd"][0] if pas == "fwd+bwd" else 0.0)
        useful = roof["fwd"][1] + (roof["bwd"][1] if pas == "fwd+bwd" else 0.0)
        try:
          t_pal = _median_time(make(ring), (q, k, v), args.repeats)
          pal = f"{t_pal * 1e3:>9.2f} {t_roof * 1e3:>8.2f} {100 * t_roof / t_pal:>6.1f} {useful / t_pal / 1e12:>11.1f}"
        except Exception as e:  # noqa: BLE001 -- report and go on
          t_pal = None
          pal = f"error: {type(e).__name__}: {str(e)[:60]}"
        if xla_ok:
          try:
            t_xla = _median_time(make(xla), (q, k, v), args.repeats)
            ratio = f"{t_xla / t_pal:>10.2f}" if t_pal else ""
            xla_s = f"{t_xla * 1e3:>8.2f} {ratio}"
          except Exception as e:  # noqa: BLE001
            xla_s = f"error: {type(e).__name__}"
        else:
          xla_s = f"skip (scores {p.B * p.N * L * L * 4 / GIB:.1f} GiB > --xla-max-gib)"
        print(f"  {L:>7} {mask:10} {pas:7} {pal} {xla_s}")


# ------------------------------------------------------------------------------------------


# ------------------------------------------------------------------------------------------
# The ragged paged attention kernel (`_src/backends/pallas_tpu/paged.py`), one decode step and one mixed step.
#
# Model of the kernel's walk: a grid step per q block of bq rows; for each sequence with rows in the block, the
# kv blocks its rows can see (ppb pages each) are copied page by page, only pages below kv_len (so a sequence's
# pages are read once per q block holding its rows), and every kv head's matmuls run on the whole folded
# (bq * G, ppb * page) tile, whatever share of the rows belongs to the sequence.


def paged_workload(num_decodes: int, prefill: int, num_prefills: int, max_history: int) -> list[tuple[int, int]]:
  """(q_len, kv_len) per sequence: decodes with histories evenly spread over 64 .. max_history, then prefills."""
  hist = np.linspace(64, max_history, num_decodes).astype(int) if num_decodes else []
  return [(1, int(h)) for h in hist] + [(prefill, prefill)] * num_prefills


def paged_step_cost(seqs, bq: int, ppb: int, ps: int, p: Problem, tiled: bool) -> dict:
  """FLOPs and HBM bytes of one forward launch of the paged kernel over `seqs`, walked as the kernel does."""
  T = -(-sum(q for q, _ in seqs) // bq) * bq
  page_bytes = block_bytes((ps, p.K, p.H), p.dtype, tiled)
  flops = kv_bytes = 0
  row = 0
  for q_len, kv_len in seqs:
    first = kv_len - q_len
    for blk in range(row // bq, -(-(row + q_len) // bq) if q_len else row // bq):
      hi = min(row + q_len, (blk + 1) * bq)  # last row of the sequence in this q block, + 1
      last_pos = first + (hi - 1 - row)
      blocks = last_pos // (ppb * ps) + 1
      pages = min(blocks * ppb, -(-kv_len // ps))
      kv_bytes += 2 * pages * page_bytes  # K and V
      flops += 2 * 2 * p.K * (bq * p.G) * (blocks * ppb * ps) * p.H  # s and pv per kv head
    row += q_len
  q_bytes = block_bytes((T, p.N, p.H), p.dtype, tiled)
  io = 2 * q_bytes + block_bytes((T, p.N), "float32", tiled)  # q in; o and lse out
  useful_kv = sum(2 * kv * p.K * p.H * p.itemsize for _, kv in seqs)  # each live K/V byte once
  useful_flops = sum(
    2 * 2 * p.N * p.H * sum(first + j + 1 for j in range(q)) for q, first in ((q, kv - q) for q, kv in seqs)
  )
  return dict(
    T=T, flops=flops, kv_bytes=kv_bytes, bytes=kv_bytes + io, min_kv=useful_kv, useful=useful_flops, steps=T // bq
  )


def padded_flops(seqs, p: Problem) -> int:
  """A padded batch: every sequence's q padded to the longest q_len and its kv to the longest kv_len."""
  qm, km = max(q for q, _ in seqs), max(kv for _, kv in seqs)
  return 2 * 2 * len(seqs) * p.N * qm * km * p.H


MXU_ROWS = {"v4": 128, "v5e": 128, "v5p": 128, "v6e": 256, "v7x": 256}  # systolic array height per generation
STEP_OVERHEAD_S = 0.35e-6  # per grid step (see the module docstring)


def print_paged(gens: Sequence[str], p: Problem, args, tiled: bool) -> None:
  ps = args.page_size
  decode = paged_workload(args.paged_decodes, 0, 0, args.paged_history)
  mixed = paged_workload(args.paged_decodes, args.paged_prefill, 2, args.paged_history)
  print(
    f"\nPaged kernel (model): page {ps}, {args.paged_decodes} decodes with histories 64..{args.paged_history}"
    f" (decode step), the same + 2 prefills of {args.paged_prefill} (mixed step); N={p.N} K={p.K} H={p.H} {p.dtype}."
  )
  print("  KV x min: K/V bytes the kernel copies / each live K/V byte once (tiled pages pad K to the sublanes).")
  print("  MXU rows: useful rows of the decode QK^T matmul per MXU pass, grouped (G q heads of a kv head in one")
  print("  matmul) vs ungrouped (one q head); the q block computes bq * G rows per sequence, G of them useful.")
  print("  ragged/padded: FLOPs of the mixed step, kernel walk vs a batch padded to the longest q and kv.")
  print("  t_proj: decode step, max(FLOPs / peak, bytes / HBM) + grid-step overhead; HBM bound: live K/V + q/o once")
  print("  at HBM speed; mixed us: t_proj of the mixed step.  q blk: plan = plan_paged_block_sizes, min = one sublane")
  print("  tile.  rows/useful: rows the decode matmul computes per useful row (= bq).")
  print(
    f"  {'gen':4} {'q blk':>4} {'bq':>4} {'pages/blk':>9} {'KV MB':>8} {'KV x min':>8} {'MXU grouped':>11} {'ungrouped':>9} "
    f"{'rows/useful':>11} {'ragged/padded':>13} {'t_proj us':>9} {'HBM bound us':>12} {'bound/proj':>10} "
    f"{'mixed us':>10}"
  )
  for g in gens:
    hw = hardware(g)
    try:
      bs = planner.plan_paged_block_sizes(
        max(-(-len(decode) // 16) * 16, 16),
        ps,
        -(-args.paged_history // ps),
        p.N,
        p.K,
        p.H,
        jnp.dtype(p.dtype),
        generation=g,
      )
    except ValueError as e:
      print(f"  {g:4} error: {e}")
      continue
    # The planner's q block (tall: a prefill re-reads its pages once per q block) and the shortest legal one
    # (a decode computes bq * G rows for G useful ones): the kernel's decode/prefill trade-off.
    for label, bq in (("plan", bs.block_q), ("min", common.sublanes(jnp.dtype(p.dtype)))):
      ppb = bs.block_kv // ps
      dc = paged_step_cost(decode, bq, ppb, ps, p, tiled)
      mx = paged_step_cost(mixed, bq, ppb, ps, p, tiled)
      t_proj = max(dc["flops"] / hw.peak, dc["bytes"] / hw.hbm_bw) + dc["steps"] * STEP_OVERHEAD_S
      t_mixed = max(mx["flops"] / hw.peak, mx["bytes"] / hw.hbm_bw) + mx["steps"] * STEP_OVERHEAD_S
      io_min = 2 * len(decode) * p.N * p.H * p.itemsize
      t_bound = (dc["min_kv"] + io_min) / hw.hbm_bw
      rows = MXU_ROWS[g]
      print(
        f"  {g:4} {label:>4} {bq:>4} {ppb:>9} {dc['kv_bytes'] / MB:>8.1f} {dc['kv_bytes'] / dc['min_kv']:>8.2f} "
        f"{100 * min(p.G, rows) / rows:>10.1f}% {100 / rows:>8.1f}% {bq:>11} "
        f"{mx['flops'] / padded_flops(mixed, p):>13.3f} {t_proj * 1e6:>9.1f} {t_bound * 1e6:>12.1f} "
        f"{t_bound / t_proj:>10.2f} {t_mixed * 1e6:>10.1f}"
      )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--generations", default=",".join(GENERATIONS), help="comma-separated, of " + ",".join(GENERATIONS)
  )
  parser.add_argument("--seq-lens", default=None, help=f"global T, comma-separated (default {DEFAULT_SEQ_LENS})")
  parser.add_argument("--ring-size", type=int, default=8, help="devices n in the ring; the shard length is T / n")
  parser.add_argument("--masks", default=",".join(ALL_MASKS), help="comma-separated, of " + ",".join(ALL_MASKS))
  parser.add_argument("--window", type=int, default=4096, help="left window of the 'window' mask (causal, right 0)")
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--num-heads", type=int, default=32)
  parser.add_argument("--num-kv-heads", type=int, default=8)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
  parser.add_argument(
    "--logical-bytes",
    action="store_true",
    help="count bare element bytes per block instead of the (sublane, 128) HBM tiles it spans",
  )
  parser.add_argument("--repeats", type=int, default=10, help="timed runs per call on a TPU (median)")
  parser.add_argument(
    "--xla-max-gib",
    type=float,
    default=4.0,
    help="on a TPU, time jax.nn.dot_product_attention only if its f32 scores fit in this",
  )
  parser.add_argument("--quick", action="store_true", help="tiny run (T=16k), a few seconds")
  parser.add_argument("--page-size", type=int, default=16, help="paged kernel: tokens per page")
  parser.add_argument("--paged-decodes", type=int, default=64, help="paged kernel: decode sequences per step")
  parser.add_argument("--paged-history", type=int, default=4096, help="paged kernel: longest decode history")
  parser.add_argument("--paged-prefill", type=int, default=512, help="paged kernel: new tokens per prefill")
  args = parser.parse_args(argv)
  args.generations = [g.strip() for g in args.generations.split(",") if g.strip()]
  args.masks = [m.strip() for m in args.masks.split(",") if m.strip()]
  for g in args.generations:
    if g not in CHIPS:
      parser.error(f"unknown generation {g!r}; known: {GENERATIONS}")
  for m in args.masks:
    if m not in ALL_MASKS:
      parser.error(f"unknown mask {m!r}; known: {ALL_MASKS}")
  if args.seq_lens is None:
    args.seq_lens = list(QUICK_SEQ_LENS if args.quick else DEFAULT_SEQ_LENS)
  else:
    args.seq_lens = [int(s) for s in args.seq_lens.split(",") if s.strip()]
  for T in args.seq_lens:
    if T % (2 * args.ring_size):
      parser.error(f"T={T} must be a multiple of 2 * ring size ({2 * args.ring_size}) for the zigzag layout")
  if args.num_heads % args.num_kv_heads:
    parser.error("--num-heads must be a multiple of --num-kv-heads")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  t0 = time.perf_counter()
  tiled = not args.logical_bytes
  p = Problem(
    B=args.batch,
    N=args.num_heads,
    K=args.num_kv_heads,
    H=args.head_dim,
    dtype=args.dtype,
    n=args.ring_size,
    window=args.window,
  )
  self_check(tiled)
  print("TPU roofline model of the Pallas ring-attention kernels -- MODEL-DERIVED numbers, not measurements.")
  print(
    f"B={p.B} N={p.N} K={p.K} (G={p.G}) H={p.H} {p.dtype}, ring of n={p.n}, HBM bytes counted as "
    f"{'(sublane, 128) tiles' if tiled else 'bare elements'}; self-check vs the kernels' index maps: ok"
  )
  print_hardware(args.generations)
  print_tiles(args.generations, args.seq_lens, p)
  print("\nPer pass, one device's whole ring (sum over its n hops).  TFLOP .. t_dev: the busiest device.")
  print("  masks: full = none, causal, causal-lb = causal on the zigzag layout (load_balance=True), window = causal")
  print(f"  with a {p.window}-token left window.  skip% = EMPTY tiles over all devices and hops (dev: per-device")
  print("  min-max); useful% = FLOPs on visible pairs / FLOPs of the non-EMPTY tiles; dead GB = DMAs no computing")
  print("  step needs (input blocks no non-EMPTY step reads, outputs of rows without a non-EMPTY tile); t_ring = sum")
  print("  over hops of the slowest device's hop; imbal = busiest device's FLOPs / the mean device's.")
  print("  bwd = dq kernel + dk/dv kernel (the forward's lse is an input).")
  print(HEADER)
  results = {}
  for g in args.generations:
    hw = hardware(g)
    for T in args.seq_lens:
      for mask in args.masks:
        for pas in PASSES:
          try:
            r = evaluate(g, T, mask, pas, p, hw, tiled)
          except ValueError as e:
            r = PassResult(
              g, T, T // p.n, mask, pas, (0, 0), 0, (0, 0), 0, 0, 0, 0, 0, 0, 0, 0, 0, np.zeros(0), error=str(e)
            )
          results[(g, T, mask, pas)] = r
          print_row(r)
    print()
  ici_masks = [m for m in ("full", "causal-lb") if m in args.masks] or args.masks[:1]
  print_ici(results, args.generations, args.seq_lens, ici_masks, p)
  print_paged(args.generations, p, args, tiled)
  print_kernel_ring(args.generations, p)
  print_kernel_ring_hbm(args.generations, p, tiled)
  time_on_tpu(args, p, args.seq_lens, args.masks, tiled)
  print(f"\n(model run took {time.perf_counter() - t0:.1f} s)")
  return 0


if __name__ == "__main__":
  sys.exit(main())

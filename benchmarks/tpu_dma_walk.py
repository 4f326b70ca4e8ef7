"""The DMA walk of the Pallas TPU block kernels over a ring, for `tpu_roofline.py` (model-derived, runs on CPU).

For one TPU generation, global length T, mask and pass, the forward or backward
block kernels of one device's whole ring (the sum over its n hops; a hop is one
block kernel call: the device's q shard against one kv shard), at the tiles
`plan_block_sizes` picks for the shard T / n (`evaluate`):

* tile tables: `masks.tile_kinds` on the real positions of every (device, hop)
  (`layout.shard_positions` of the q shard and of kv shard (r - t) mod n).  A
  hop whose whole block is EMPTY is not launched (the ring's `lax.cond`).
* FLOPs: every non-EMPTY tile runs its matmuls in full (`cost.KERNEL_MATMULS`);
  the useful ones land on visible (q, k) pairs, counted exactly.
* HBM bytes: the block DMAs the Pallas pipeline issues (an input block is
  copied when its index differs from the previous grid step's, an output block
  written back when its index moves on), walked with `common.fetch_index`
  tables as the BlockSpec index maps use them.  A block counts as the
  (sublane, 128) HBM tiles it spans, or (tiled=False) its bare elements.
* `self_check` replays small grids through the kernels' own `index_map`
  lambdas and compares the tables with the jitted JAX originals: the walk must
  agree with the kernels, so a kernel change that moves a DMA fails it.

The backward modelled is the two-kernel one (dq, then dk/dv: `BlockSizes(fused_bwd=False)`), at the planner's
backward tiles (the fused backward's where that is the plan).  The default fused backward (one kernel, the dq
partials written by the dk/dv kernel, one per kv tile) is not modelled yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import flax_ringattn as fr
from flax_ringattn._src import layout, masks
from flax_ringattn._src.backends.pallas_tpu import common
from flax_ringattn._src.backends.pallas_tpu.block import backward, forward
from flax_ringattn.benchmarking import cost, hardware

GENERATIONS = hardware.TPU_GENERATIONS
PASSES = {"fwd": ("fwd",), "bwd": ("dq", "dkv")}
ALL_MASKS = ("full", "causal", "causal-lb", "window")
GB, MB, MIB, GIB = 1e9, 1e6, 2**20, 2**30


def rates(gen: str) -> tuple[float, float]:
  """(bf16 FLOP/s, HBM bytes/s) of one JAX device of `gen`, from the hardware table."""
  chip = hardware.tpu(gen)
  return chip.peak_flops("bfloat16"), chip.memory_bandwidth


# ------------------------------------------------------------------------------------------
# Problem and tiles.


@dataclasses.dataclass(frozen=True)
class Problem:
  """What the roofline models: one call's B, N, K, H (Hv: v's head dim, MLA) and dtype on a ring of n (the global
  T varies per row), and the left window of the "window" mask."""

  B: int
  N: int
  K: int
  H: int
  dtype: str
  n: int  # ring size
  window: int
  Hv: int | None = None  # None: H

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize


def mask_setup(name: str, window: int) -> tuple[masks.MaskSpec, bool]:
  """(MaskSpec, load_balance) of a mask name."""
  specs = {
    "full": (masks.MaskSpec(), False),
    "causal": (masks.MaskSpec(is_causal=True), False),
    "causal-lb": (masks.MaskSpec(is_causal=True), True),
    "window": (masks.MaskSpec(is_causal=True, window=(window, 0)), False),
  }
  if name not in specs:
    raise ValueError(f"unknown mask {name!r}; known: {ALL_MASKS}")
  return specs[name]


def tiles(gen: str, L: int, p: Problem) -> dict[str, tuple[int, int]]:
  """(bq, bk) per pass as the kernels resolve them (`common.block_tiles`) from the planner's BlockSizes."""
  try:
    bs = fr.plan_block_sizes(L, L, p.N, p.K, p.H, jnp.dtype(p.dtype), generation=gen, v_head_dim=p.Hv)
  except ValueError as e:
    raise ValueError(f"plan_block_sizes({L}, {L}, ..., generation={gen!r}) failed: {e}") from e
  sub, lanes = common.sublanes(jnp.dtype(p.dtype)), common.LANES
  (fq, fk), (bq, bk) = (bs.block_q, bs.block_kv), bs.bwd
  fwd = (common.tpu_tile(L, fq, sub, what="block_q"), common.tpu_tile(L, fk, lanes, what="block_kv"))
  bwd = (common.tpu_tile(L, bq, sub, what="block_q_bwd"), common.tpu_tile(L, bk, lanes, what="block_kv_bwd"))
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
      kinds = _pairwise(
        lambda qp, kp: masks.tile_kinds(spec, masks.Tokens(qp), masks.Tokens(kp), bq, bk), q_pos, kv_pos
      )
      # The ring skips a hop whose whole block is EMPTY (ring_loop._hop_kind: classify with one tile per shard).
      hop = _pairwise(
        lambda qp, kp: masks.tile_kinds(spec, masks.Tokens(qp), masks.Tokens(kp), L, L)[0, 0], q_pos, kv_pos
      )
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
  one = lambda qp, kp: masks.tile_kinds(spec, masks.Tokens(qp), masks.Tokens(kp), bq, bk)
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
    vis = jax.vmap(
      jax.vmap(
        lambda qp, kp, spec=spec: masks.visible(spec, masks.Tokens(qp), masks.Tokens(kp)).sum(), in_axes=(None, 0)
      )
    )
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
# The heads-major forward: the token-major one (`tiling.token_major_forward`, grid (b, row, kv head, step), q, o
# and lse resident across kv heads) is not modelled here.
PLANS = {
  "fwd": functools.partial(forward.fwd_plan, token_major=False),
  "dq": backward.dq_plan,
  "dkv": backward.dkv_plan,
}


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
  dims = dict(B=p.B, T=L, S=L, N=p.N, K=p.K, H=p.H, Hv=p.Hv, dtype=jnp.dtype(p.dtype), bq=bq, bk=bk)
  dims["mask"] = masks.MaskSpec()  # positions only, no per-row ids (as before: no segment ids)
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
  flops = live.sum(axis=(-2, -1)) * cost.pair_flops(bq * bk, B=p.B, N=p.N, H=p.H, matmuls=kernel, Hv=p.Hv)
  useful = cost.pair_flops(pairs, B=p.B, N=p.N, H=p.H, matmuls=kernel, Hv=p.Hv)
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


def evaluate(gen: str, T: int, mask: str, pas: str, p: Problem, tiled: bool) -> PassResult:
  L = T // p.n
  bq, bk = tiles(gen, L, p)[pas]
  tab = ring_tables(mask, p.window, p.n, L, bq, bk)
  pairs = visible_pairs(mask, p.window, p.n, L)
  costs = [kernel_cost(k, tab, pairs, p, L, bq, bk, tiled) for k in PASSES[pas]]
  peak, bw = rates(gen)
  t_launch = sum(np.maximum(c.flops / peak, c.bytes / bw) for c in costs)  # [n, n]
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
    float(flops[r].sum() / peak),
    float(sum(c.bytes for c in costs)[r].sum() / bw),
    float(t_dev[r]),
    float(hop_times.sum()),
    float(flops.sum(axis=1).max() / max(flops.sum(axis=1).mean(), 1.0)),
    hop_times,
  )


# ------------------------------------------------------------------------------------------
# Self-check: the vectorised model against the kernels' own index maps on small grids.


def _replay(kernel: str, tab: Tables, p: Problem, L: int, bq: int, bk: int, tiled: bool) -> tuple[float, float]:
  """(HBM bytes, FLOPs) of one launch (`tab` of one hop) by walking the grid through the plan's index_map lambdas."""
  dims = dict(B=p.B, T=L, S=L, N=p.N, K=p.K, H=p.H, Hv=p.Hv, dtype=jnp.dtype(p.dtype), bq=bq, bk=bk)
  dims["mask"] = masks.MaskSpec()  # positions only, no per-row ids (as before: no segment ids)
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
      flops += cost.pair_flops(bq * bk, N=p.G, H=p.H, matmuls=kernel, Hv=p.Hv)
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
    # The MLA problem (qk 192, v 128) checks that v-side blocks are walked at their own width.
    for pp in (p, dataclasses.replace(p, H=192, Hv=128)):
      for kernel in cost.KERNEL_MATMULS:
        kc = kernel_cost(kernel, tab, pairs, pp, L, bq, bk, tiled)
        for r, t in [(0, 0), (1, 2), (p.n - 1, 1), (2, p.n - 1)]:
          if not tab.launched[r, t]:
            assert kc.bytes[r, t] == 0
            continue
          want_bytes, want_flops = _replay(kernel, tab.at(r, t), pp, L, bq, bk, tiled)
          assert kc.bytes[r, t] == want_bytes, (mask, kernel, r, t, pp.Hv, kc.bytes[r, t], want_bytes)
          assert kc.flops[r, t] == want_flops, (mask, kernel, r, t, pp.Hv)

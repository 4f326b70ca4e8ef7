"""`suggest_strategy`: a small cost model that ranks the sequence-parallel strategies.

The model (per device, one attention call, forward + backward, zigzag
load balance assumed so causal work is even), built from the package's cost
model (`_src/perf/cost.py`) and hardware table (`_src/perf/hardware.py`):

* compute: F = `cost.attention_flops` (14 * B * N * T * S * H flops, forward 4,
  backward 10), halved when causal; every strategy does F / n of it on each of
  its n devices, at `hardware.flops` flop/s.
* ring over n devices (bandwidth b of that axis, latency a per step): n hops per
  pass, each overlapping its compute (F / n^2) with one K/V shard transfer
  (`cost.ring_hop_bytes`: 2 * B * S/n * K * H * bytes; the backward also moves
  the f32 dK/dV accumulators), then merging its partial result into f32
  accumulators (`cost.ring_merge_bytes`: o / lse forward, dK / dV backward:
  memory-bound, at `hardware.memory_bandwidth`): time = sum over passes of
  (n - 1) * (max(compute_hop, bytes_hop / b + a) + merge_hop) + compute_hop
  (`cost.ring_pass_time`).
* ulysses over n: all-to-alls are not overlapped: forward q, k, v in and o out,
  backward do in and dq, dk, dv out, each (n - 1) / n of the local shard
  (kv heads repeated to K' = lcm(K, n)); time = compute + bytes / b + 4 (n - 1) a.
  Needs N % n == 0.
* all_gather over n: forward gathers K/V ((n - 1) / n * 2 * B * S * K * H *
  bytes), backward gathers them again and reduce-scatters f32 dK/dV; time =
  compute + bytes / b + 3 (n - 1) a.
* ulysses_ring over (R, U): the Ulysses all-to-alls over U (inner bandwidth),
  then a ring of R over the outer axis on N / U heads.

Memory per device: the local q/k/v/o/dO shards plus what the strategy adds:
the ring two K/V shards in flight and f32 dK/dV accumulators (linear in
T / n); Ulysses the head-sharded copies of q/k/v/o (T * heads / n); all_gather
the gathered K/V and their f32 gradients (linear in S, not S / n).

Bandwidths: an axis whose devices sit in different processes uses
`hardware.outer_bandwidth`, one within a process `inner_bandwidth`; that is
what puts the ring (or the outer axis of "ulysses_ring") across processes.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flax_ringattn._src.options import ProblemShape
from flax_ringattn._src.perf import cost
from flax_ringattn._src.perf import hardware as hardware_table
from flax_ringattn._src.ring.strategies import ulysses_kv_repeat


@dataclasses.dataclass(frozen=True, kw_only=True)
class Hardware:
  """Per-device peak rates of one accelerator generation (or of the CPU devices measured here).

  `suggest_strategy(..., hardware=)` takes one, or a name of `HARDWARE` ("tpu_v5e", "tpu_v5p", "a100", "h100",
  "cpu"); `Hardware.from_chip` reads a chip of the hardware table.  Fields: `flops` (flop/s), `inner_bandwidth`
  / `outer_bandwidth` (bytes/s to peers in / outside the device's process), `latency` (s per collective step),
  `memory` (bytes), `memory_bandwidth` (bytes/s); `name`, `source` (where the figures come from).
  """

  name: str
  flops: float  # dense matmul flop/s per device in the working dtype
  inner_bandwidth: float  # bytes/s one device sends to peers in its own process / host / slice
  outer_bandwidth: float  # bytes/s one device sends to peers in other processes / hosts
  latency: float  # seconds per collective step
  memory: float  # bytes of device memory
  memory_bandwidth: float  # bytes/s of device memory (the ring's per-hop merge of o / dK / dV is bound by it)
  source: str = ""

  @classmethod
  def from_chip(cls, chip: hardware_table.Chip) -> Hardware:
    """The advisor's view of a chip of the hardware table (its working peak, its links, its memory)."""
    return cls(
      name=chip.name,
      flops=chip.peak_flops(),
      inner_bandwidth=chip.link_bandwidth,
      outer_bandwidth=chip.network_bandwidth,
      latency=chip.latency,
      memory=chip.memory_bytes,
      memory_bandwidth=chip.memory_bandwidth,
      source=chip.source,
    )


def _advisable(chip: hardware_table.Chip) -> bool:
  needs = (chip.peak_flops(), chip.link_bandwidth, chip.network_bandwidth, chip.latency, chip.memory_bytes)
  return all(x is not None for x in (*needs, chip.memory_bandwidth))


# The chips of the hardware table with every figure the model needs (tpu_v5e, tpu_v5p, a100, h100, cpu).
HARDWARE = {c.name: Hardware.from_chip(c) for c in hardware_table.CHIPS.values() if _advisable(c)}


@dataclasses.dataclass(frozen=True)
class StrategyEstimate:
  """The model's prediction for one candidate (time and memory per device).

  `strategy` ("ring", "ulysses", "all_gather", "ulysses_ring"), `axis_name` and `factoring` ((axis, size), ...)
  name the candidate; `time_s` (inf when not feasible), `memory_bytes`, `feasible` (fits the device's memory) and
  `note` are the model's answer.  Found in `StrategyAdvice.candidates`.
  """

  strategy: str
  axis_name: object
  factoring: tuple  # ((axis, size), ...) in axis_name order
  time_s: float  # inf when not feasible
  memory_bytes: float
  feasible: bool
  note: str = ""


@dataclasses.dataclass(frozen=True)
class StrategyAdvice:
  """`suggest_strategy`'s answer: the best feasible candidate, and every candidate for comparison.

  `strategy`, `axis_name`, `factoring`: the fastest feasible candidate (pass them to the layer or op);
  `candidates`: every `StrategyEstimate`, fastest first; `hardware`: the `Hardware` the model assumed.
  """

  strategy: str
  axis_name: object
  factoring: tuple
  candidates: tuple  # StrategyEstimate, fastest first
  hardware: Hardware


def _crosses_processes(mesh, axis) -> bool:
  names = list(mesh.axis_names)
  devs = np.asarray(mesh.devices)
  moved = np.moveaxis(devs, names.index(axis), 0).reshape(devs.shape[names.index(axis)], -1)
  procs = np.vectorize(lambda d: getattr(d, "process_index", 0))(moved)
  return bool((procs != procs[:1]).any())


def _ring_time(n, compute, fwd_hop_bytes, bwd_hop_bytes, bw, lat, merge_s):
  """Both passes of a ring of n; `compute` (seconds of the whole call) splits 4 : 10 between them."""
  t = 0.0
  for direction, hop in (("fwd", fwd_hop_bytes), ("bwd", bwd_hop_bytes)):
    c = compute * cost.MATMULS[direction] / cost.MATMULS["fwd+bwd"] / n
    t += cost.ring_pass_time(n, c, hop, bandwidth=bw, latency=lat, merge_s=merge_s)
  return t


def estimate(strategy, sizes, bws, shape: ProblemShape, *, B, causal, hw, latency):
  """Time and memory per device for `strategy` over axes of `sizes` (outer first) with bandwidths `bws`, for B
  sequences of the call's (global) `shape`."""
  T, N, K, H, itemsize = shape.q_len, shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.itemsize
  Hv = shape.head_dim_v
  W = H + Hv  # q and o (and k and v) side by side: 2 H without MLA
  n = int(np.prod(sizes))
  flops = cost.attention_flops(B=B, T=T, S=T, N=N, H=H, is_causal=causal, direction="fwd+bwd", Hv=Hv)
  compute = flops / n / hw.flops
  local = B * T / n * (N + K) * W * itemsize * 2  # q, k, v, o + do, dq/dk/dv of the caller
  kv_shard = B * T / n * K * W

  def hops(S, K):
    return [cost.ring_hop_bytes(B=B, S=S, K=K, H=H, itemsize=itemsize, direction=d, Hv=Hv) for d in ("fwd", "bwd")]

  if strategy == "ring":
    merge = cost.ring_merge_bytes(B=B, T=T / n, S=T / n, N=N, K=K, H=H, Hv=Hv) / hw.memory_bandwidth
    t = _ring_time(n, compute, *hops(T / n, K), bws[0], latency, merge)
    return t, local + 2 * kv_shard * itemsize + kv_shard * 4 * 2, ""
  if strategy == "all_gather":
    gathered = B * T * K * W
    vol = (n - 1) / n * gathered * (2 * itemsize + 4)
    return compute + vol / bws[0] + 3 * (n - 1) * latency, local + gathered * (itemsize + 4), ""
  u = sizes[-1]
  if N % u:
    return math.inf, math.inf, f"N={N} q heads do not split over {u} devices"
  Kp = K * ulysses_kv_repeat(K, u)
  a2a = (u - 1) / u * B * T / n * (N + Kp) * W * (itemsize * 2 + 4)
  heads_copy = B * T * u / n * (N + Kp) / u * W * (itemsize + 4)
  if strategy == "ulysses":
    return compute + a2a / bws[-1] + 4 * (u - 1) * latency, local + heads_copy, ""
  R = sizes[0]
  kv_r = B * T / R * Kp / u * W
  merge_r = cost.ring_merge_bytes(B=B, T=T / R, S=T / R, N=N / u, K=Kp / u, H=H, Hv=Hv) / hw.memory_bandwidth
  t = _ring_time(R, compute, *hops(T / R, Kp / u), bws[0], latency, merge_r)
  return t + a2a / bws[-1] + 4 * (u - 1) * latency, local + heads_copy + kv_r * (3 * itemsize + 8), ""


def suggest_strategy(
  mesh,
  seq_len: int,
  num_heads: int,
  num_kv_heads: int,
  head_dim: int,
  dtype,
  *,
  axis_name=None,
  hardware=None,
  batch_size: int = 1,
  is_causal: bool = False,
  v_head_dim: int | None = None,
) -> StrategyAdvice:
  """Ranks "ring", "ulysses", "all_gather" and "ulysses_ring" on `mesh` with the documented cost model.

  Args:
    mesh: the `jax.sharding.Mesh` the sequence is sharded over.
    seq_len, num_heads, num_kv_heads, head_dim, dtype: T (= S), N, K, H and the
      activation dtype of one attention call (batch `batch_size`).
    axis_name: the sequence axis, or a (ring_axis, ulysses_axis) pair; None
      considers every axis of the mesh alone and every pair (the axis that
      crosses processes as the ring axis).
    hardware: a name from `HARDWARE` ("tpu_v5e", "tpu_v5p", "a100", "h100",
      "cpu": the chips of the package's hardware table with every figure the
      model needs) or a `Hardware`; None: "cpu" on CPU, else the TPU/GPU
      default ("tpu_v5p", "h100").
    batch_size: B.
    is_causal: whether the call is causal (halves the compute), False by
      default like `ring_attention`'s.
    v_head_dim: v's head dim when it differs from `head_dim` (MLA: 128
      against qk 192); None: the same.

  Returns:
    `StrategyAdvice` with the fastest feasible candidate (its memory must fit the
    device) and every candidate's predicted time and memory per device.
  """
  import jax

  if hardware is None:
    platform = jax.devices()[0].platform
    hardware = {"tpu": "tpu_v5p", "gpu": "h100"}.get(platform, "cpu")
  if isinstance(hardware, str):
    if hardware not in HARDWARE:
      raise ValueError(f"unknown {hardware=}; choose one of {tuple(HARDWARE)} or pass a flax_ringattn.Hardware")
    hardware = HARDWARE[hardware]
  if not isinstance(hardware, Hardware):
    raise TypeError(f"hardware must be a name or a flax_ringattn.Hardware, got {hardware!r}")
  dims = (("seq_len", seq_len), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim))
  for name, value in (*dims, *((("v_head_dim", v_head_dim),) if v_head_dim is not None else ())):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"{name} must be a positive int, got {name}={value!r}")
  if num_heads % num_kv_heads:
    raise ValueError(f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
  names = tuple(mesh.axis_names)
  sizes = dict(zip(names, mesh.axis_sizes, strict=True))
  if axis_name is None:
    singles = list(names)
    pairs = [(a, b) for a in names for b in names if a != b and sizes[a] > 1 and sizes[b] > 1]
    pairs = [p for p in pairs if _crosses_processes(mesh, p[0]) or not _crosses_processes(mesh, p[1])]
  elif isinstance(axis_name, (tuple, list)):
    singles, pairs = [], [tuple(axis_name)]
  else:
    singles, pairs = [axis_name], []
  for ax in [*singles, *(a for p in pairs for a in p)]:
    if ax not in names:
      raise ValueError(f"axis_name={axis_name!r}: {ax!r} is not an axis of the mesh (mesh axes: {names})")

  def bw(ax):
    return hardware.outer_bandwidth if _crosses_processes(mesh, ax) else hardware.inner_bandwidth

  shape = ProblemShape(
    q_len=seq_len,
    kv_len=seq_len,
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    dtype=dtype,
    v_head_dim=None if v_head_dim in (None, head_dim) else v_head_dim,
  )
  dims = dict(B=batch_size, causal=is_causal, hw=hardware, latency=hardware.latency)
  out = []
  plans = [(s, a, (a,)) for a in singles for s in ("ring", "ulysses", "all_gather")]
  plans += [("ulysses_ring", p, p) for p in pairs]
  for strategy, axis, axes in plans:
    ax_sizes = tuple(sizes[a] for a in axes)
    n = int(np.prod(ax_sizes))
    t, m, note = estimate(strategy, ax_sizes, tuple(bw(a) for a in axes), shape, **dims)
    if seq_len % (2 * n):
      t, m, note = math.inf, math.inf, f"seq_len={seq_len} is not a multiple of 2 * {n} (zigzag shards)"
    feasible = math.isfinite(t) and m <= hardware.memory
    if math.isfinite(t) and not feasible:
      note = f"needs {m / 2**30:.1f} GiB per device > {hardware.memory / 2**30:.0f} GiB"
    factoring = tuple((a, sizes[a]) for a in axes)
    out.append(StrategyEstimate(strategy, axis, factoring, t, m, feasible, note))
  out.sort(key=lambda e: (not e.feasible, e.time_s))
  if not out or not out[0].feasible:
    raise ValueError(f"no strategy fits: {[(e.strategy, e.note) for e in out]}")
  best = out[0]
  return StrategyAdvice(best.strategy, best.axis_name, best.factoring, tuple(out), hardware)

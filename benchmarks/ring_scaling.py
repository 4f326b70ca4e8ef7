"""Sequence-length scaling of ring attention vs. two alternatives, on simulated CPU devices.

What it measures
----------------
For every sequence length T (default 2k..32k) and for causal and non-causal
attention, the forward+backward pass ``jax.grad(sum(attn(q, k, v) * g))`` with
respect to q, k and v, with the ``ring_scaling`` problem set of
``flax_ringattn.benchmarking.PROBLEM_SETS`` (B=1, 4 heads, head_dim 64,
float32), on 8 simulated host devices
(``--xla_force_host_platform_device_count=8``), q/k/v sharded along the
sequence axis of a 1-D mesh ``("sp",)``.  Implementations, timed side by side
in the same run (``benchmarking.time_interleaved``: every round runs each
once, the order rotating):

* ``ring``      -- ``flax_ringattn.ring_attention(..., mesh=mesh, axis_name="sp")``
* ``ring+lb``   -- the same with ``load_balance=True`` (causal only; inputs are
                   treated as already zigzag-ordered, which does not matter for
                   timing)
* ``allgather`` -- ``jax.nn.dot_product_attention`` under ``jax.jit`` on the
                   sharded inputs; XLA all-gathers K/V and materialises the
                   ``[T/8, T]`` scores on every device
* ``haoliu``    -- ``ringattention_jax`` from haoliu's ``ringattention==0.1.2``
                   (the pure-JAX blockwise ring used on CPU), inside
                   ``jax.shard_map``, query/key chunks of 256.  Optional: install
                   it outside the project, e.g.
                   ``pip install --no-deps --target /tmp/haoliu_pkg ringattention==0.1.2``
                   and pass ``--haoliu-path /tmp/haoliu_pkg``.  Its ``__init__``
                   calls ``jax.lib.xla_bridge``, gone from current JAX; the
                   script restores that alias before importing it.

Before anything is timed, every configuration's output and q/k/v gradients at
T=1024 are checked against ``reference_attention``; a wrong result exits 1.
Columns: per-device temp memory (``compiled.memory_analysis()``), median wall
time, achieved GFLOP/s (``Problem.flops``: fwd 4*B*N*T*S*H, bwd 10, causal
counted once) and the fraction of this machine's f32 matmul rate (measured
first, one device, 2048^3), and the bytes each device sends, read from the
compiled HLO (``benchmarking.collective_volume``).  A second table checks the
project's performance targets (a miss exits 3, except with ``--quick``).
Configurations whose estimated host memory (8 x per-device footprint) exceeds
``--mem-limit-gib`` are reported as ``OOM-skip``; a failing row is reported
and does not stop the table.  ``--json`` prints the report as JSON.

Run it::

  python benchmarks/ring_scaling.py --quick            # smoke run, T=512,1024
  python benchmarks/ring_scaling.py                    # full table (slow on CPU)
  python benchmarks/ring_scaling.py --seq-lens 2048,8192 --impls allgather,haoliu \
      --haoliu-path /tmp/haoliu_pkg

The simulated devices share the host's cores, so absolute times say little
about accelerators; the ratios between implementations, memory and
communication volume are the point.
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import os

NUM_DEVICES = 8


def _force_host_devices(num_devices: int) -> None:
  """Ask XLA for `num_devices` host devices; must run before jax is imported."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    flag = f"--xla_force_host_platform_device_count={num_devices}"
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


_force_host_devices(NUM_DEVICES)

import argparse
import dataclasses
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

try:
  import flax_ringattn
except ImportError:  # running from a checkout that is not installed
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  import flax_ringattn
from flax_ringattn import benchmarking as bench
from flax_ringattn.benchmarking import PROBLEM_SETS, Report, cost, measure_matmul_flops

AXIS = "sp"
PROBLEM = PROBLEM_SETS["ring_scaling"][0]  # B, heads, head_dim, dtype; T and causal vary per row
BATCH, HEADS, HEAD_DIM, DTYPE = PROBLEM.B, PROBLEM.N, PROBLEM.H, jnp.dtype(PROBLEM.dtype)
DEFAULT_SEQ_LENS = tuple(dict.fromkeys(p.T for p in PROBLEM_SETS["ring_scaling"]))
QUICK_SEQ_LENS = tuple(dict.fromkeys(p.T for p in PROBLEM_SETS["ring_scaling_quick"]))
ALL_IMPLS = ("ring", "ring+lb", "allgather", "haoliu")
MATMUL_N = 2048
MIB = 2**20
GIB = 2**30
# Exit status (`benchmarking.Report.finish`): 0 = outputs correct and every measured target met (with --quick:
# outputs correct); 1 = an output differs from the reference (nothing is timed); 3 = a target was missed.
EXIT_WRONG_RESULT, EXIT_TARGET_MISSED = bench.EXIT_WRONG_RESULT, bench.EXIT_TARGET_MISSED
HAOLIU_INSTALL = "pip install --no-deps --target /tmp/haoliu_pkg ringattention==0.1.2"

Attention = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


@dataclasses.dataclass
class Row:
  """One (implementation, T, causal) configuration and what was measured."""

  impl: str
  seq_len: int
  causal: bool
  compiled: Any = None
  stats: bench.CompiledStats | None = None
  times: list[float] = dataclasses.field(default_factory=list)
  status: str = ""  # Non-empty: "OOM-skip", "error: ..."; the row is not timed.


def attention_flops(seq_len: int, causal: bool) -> float:
  """Useful fwd+bwd FLOPs of global attention (`cost.attention_flops`, the same for every implementation)."""
  return PROBLEM.replace(T=seq_len, is_causal=causal).flops("fwd+bwd")


def ideal_ring_bytes(seq_len: int, num_devices: int = NUM_DEVICES) -> tuple[float, float]:
  """Bytes each device sends in an ideal ring (`cost.ring_sent_bytes`): (forward only, forward + backward)."""
  dims = dict(B=BATCH, S=seq_len // num_devices, K=HEADS, H=HEAD_DIM, itemsize=PROBLEM.itemsize)
  return cost.ring_sent_bytes(num_devices, **dims, direction="fwd"), cost.ring_sent_bytes(num_devices, **dims)


# ------------------------------------------------------------------------------------------
# Implementations: each returns attention on global [B, T, N, H] arrays sharded along T.


def make_ring(mesh, causal: bool, load_balance: bool, block_sizes: tuple[int, int] | None) -> Attention:
  kwargs: dict[str, Any] = {
    "mesh": mesh,
    "axis_name": AXIS,
    "is_causal": causal,
    "load_balance": load_balance,
  }
  if block_sizes is not None:
    kwargs["block_sizes"] = flax_ringattn.BlockSizes(block_q=block_sizes[0], block_kv=block_sizes[1])
  return functools.partial(flax_ringattn.ring_attention, **kwargs)


def make_allgather(causal: bool) -> Attention:
  return functools.partial(jax.nn.dot_product_attention, is_causal=causal)


def load_haoliu(path: str | None):
  """Returns haoliu's `ringattention_jax`, or None (with a message) if unavailable."""
  if path:
    sys.path.insert(0, path)
  if not hasattr(jax.lib, "xla_bridge"):
    # ringattention/__init__.py calls jax.lib.xla_bridge.get_backend(), removed from JAX.
    jax.lib.xla_bridge = jax._src.xla_bridge
  try:
    import ringattention
  except ImportError as e:
    print(f"haoliu: not installed ({e}); {HAOLIU_INSTALL} and pass --haoliu-path /tmp/haoliu_pkg", file=sys.stderr)
    return None
  return ringattention.ringattention_jax


def make_haoliu(ring_fn, mesh, causal: bool, seq_len: int, chunk: int) -> Attention:
  chunk = min(chunk, seq_len // mesh.size)
  blockwise_kwargs = {
    "causal_block_size": 1 if causal else None,  # None disables its causal mask entirely.
    "query_chunk_size": chunk,
    "key_chunk_size": chunk,
    "deterministic": True,
    "dropout_rng": None,
    "attn_pdrop": 0.0,
    "dtype": DTYPE,
    "policy": jax.checkpoint_policies.nothing_saveable,
    "precision": None,
    "prevent_cse": True,
  }

  def local(q, k, v):  # (q, k, v, attn_bias, segment_ids, cache_idx, axis_name, f32 logits, kw)
    return ring_fn(q, k, v, None, None, None, AXIS, True, blockwise_kwargs)

  spec = P(None, AXIS, None, None)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)


# ------------------------------------------------------------------------------------------
# Measurement.


CHECK_SEQ_LEN = 1024  # the correctness check's length: the dense reference stays small
CHECK_TOL = 2e-4  # f32 output and gradients, |a - b| <= tol * (1 + |b|)


def make_attention(impl: str, mesh, causal: bool, seq_len: int, args, haoliu_fn) -> Attention | None:
  """The attention of one configuration (None: haoliu not installed); the check and the timing use the same."""
  if impl in ("ring", "ring+lb"):
    return make_ring(mesh, causal, impl == "ring+lb", args.block)
  if impl == "allgather":
    return make_allgather(causal)
  return None if haoliu_fn is None else make_haoliu(haoliu_fn, mesh, causal, seq_len, args.haoliu_chunk)


def check_against_reference(args, mesh, haoliu_fn) -> list[bench.Check]:
  """Every timed configuration's output and q/k/v gradients against `reference_attention` at CHECK_SEQ_LEN.

  The configurations are built by the same factory as the timed rows (only T differs), so a wrong flag or
  layout shows here.
  """
  sharding = NamedSharding(mesh, P(None, AXIS, None, None))
  q, k, v, g = (np.asarray(x) for x in inputs(CHECK_SEQ_LEN, sharding, args.seed + 1))
  checks = []
  for causal in args.causal_modes:
    reference = functools.partial(flax_ringattn.reference_attention, is_causal=causal)
    expected = [np.asarray(reference(q, k, v))]
    expected += [np.asarray(x) for x in fwd_bwd(reference, sharding)(q, k, v, g)]
    for impl in args.impls:
      if impl == "ring+lb" and not causal:
        continue
      attention = make_attention(impl, mesh, causal, CHECK_SEQ_LEN, args, haoliu_fn)
      if attention is None:
        continue
      # ring+lb reads its inputs in zigzag order: permute them in, and the gradients back.
      zz = impl == "ring+lb"
      order = (lambda x: flax_ringattn.zigzag_order(x, NUM_DEVICES, axis=1)) if zz else (lambda x: x)
      inverse = (lambda x: flax_ringattn.zigzag_inverse(x, NUM_DEVICES, axis=1)) if zz else (lambda x: x)
      args_in = (order(q), order(k), order(v))
      got = [jax.jit(attention)(*args_in), *fwd_bwd(attention, sharding)(*args_in, order(g))]
      got = [np.asarray(inverse(x)) for x in got]
      name = f"{impl} causal={causal} T={CHECK_SEQ_LEN}"
      checks.append(bench.compare(name, got, expected, tol=CHECK_TOL, metric="rel_elementwise"))
  return checks


def fwd_bwd(attention: Attention, sharding: NamedSharding):
  """jit(grad of sum(attention(q, k, v) * g) w.r.t. q, k, v), gradients kept sharded."""
  return bench.fwd_bwd(attention, out_shardings=sharding, with_output=False)


def inputs(seq_len: int, sharding: NamedSharding, seed: int) -> tuple[jax.Array, ...]:
  return PROBLEM.replace(T=seq_len).inputs(seed, sharding=sharding)


def compile_row(row: Row, attention: Attention, xs: Sequence[jax.Array], sharding, mem_limit: float) -> None:
  """Compiles the row's fwd+bwd, records memory and traffic, marks it OOM-skip if too big."""
  compiled = fwd_bwd(attention, sharding).lower(*xs).compile()
  row.stats = bench.compiled_stats(compiled, NUM_DEVICES)
  if row.stats.footprint_bytes is not None and NUM_DEVICES * row.stats.footprint_bytes > mem_limit:
    row.status = "OOM-skip"
  else:
    row.compiled = compiled


def _error(e: Exception) -> str:
  return f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"


def time_rows(rows: Sequence[Row], xs: Sequence[jax.Array], repeats: int) -> None:
  """Times the compiled rows interleaved (`benchmarking.time_interleaved`); a row that fails is marked."""
  live = {id(r): r for r in rows if r.compiled is not None}

  def failed(key, e):
    live[key].status, live[key].compiled = _error(e), None

  calls = {key: functools.partial(r.compiled, *xs) for key, r in live.items()}
  for key, times in bench.time_interleaved(calls, repeats, on_error=failed).items():
    live[key].times = times


def measure_seq_len(seq_len: int, args, mesh, haoliu_fn) -> list[Row]:
  """Compiles and times every requested (implementation, causal) pair at one T, interleaved."""
  sharding = NamedSharding(mesh, P(None, AXIS, None, None))
  xs = inputs(seq_len, sharding, args.seed)
  rows = []
  for causal in args.causal_modes:
    for impl in args.impls:
      if impl == "ring+lb" and not causal:
        continue
      row = Row(impl, seq_len, causal)
      rows.append(row)
      try:
        attention = make_attention(impl, mesh, causal, seq_len, args, haoliu_fn)
        if attention is None:
          row.status = "not installed"
          continue
        compile_row(row, attention, xs, sharding, args.mem_limit_gib * GIB)
      except Exception as e:
        row.status = _error(e)
  time_rows(rows, xs, args.repeats)
  for row in rows:
    row.compiled = None  # Release executables before the next T.
  return rows


# ------------------------------------------------------------------------------------------
# Reporting.

HEADER = ("impl", "T", "causal", "temp MiB/dev", "median ms", "GFLOP/s", "% matmul", "MiB sent/dev", "sent/ideal ring")


def table_row(row: Row, peak: float) -> list:
  temp = row.stats.temp_bytes if row.stats else None
  cells = [row.impl, row.seq_len, row.causal, None if temp is None else temp / MIB]
  t = bench.median(row.times)
  if t is None:
    cells += [row.status or "-", None, None]
  else:
    gflops = attention_flops(row.seq_len, row.causal) / t / 1e9
    cells += [1e3 * t, gflops, 100 * gflops / peak]
  if row.stats is None:
    return cells + [None, None]
  sent = row.stats.sent
  marks = ("~" if sent.estimated else "") + ("?" if sent.unknown_trips else "")
  return cells + [f"{sent.total / MIB:.2f}{marks}", sent.total / ideal_ring_bytes(row.seq_len)[1]]


def report_results(report: Report, rows: Sequence[Row], peak: float, seq_lens: Sequence[int]) -> None:
  notes = [
    "FLOP model (all implementations, `cost.attention_flops`): fwd = 4*B*N*T*S*H, bwd = 10*B*N*T*S*H (2.5x fwd), "
    "S = T; causal counts half.  '% matmul' is relative to the one-device f32 matmul rate above.",
    "MiB sent/dev: bytes one device sends per fwd+bwd call, from the compiled HLO (collective-permute: operand; "
    "all-gather: output - input; '~' = includes ring estimates, all-reduce 2(n-1)/n*size, reduce-scatter/"
    "all-to-all (n-1)/n*size; '?' = a while loop without known_trip_count counted once).",
    f"Ideal ring per device (N={NUM_DEVICES}, f32, `cost.ring_sent_bytes`): fwd sends K,V N-1 times = (N-1)/N of "
    "global K+V; fwd+bwd adds K,V N-1 times and the f32 dK,dV accumulators N times (haoliu's ring sends K,V N "
    "times in fwd and K,V,dK,dV N times in bwd: 48/44 = 1.09x ideal):",
  ]
  for t in seq_lens:
    fwd, total = ideal_ring_bytes(t)
    notes.append(f"  T={t}: fwd {fwd / MIB:.2f} MiB, fwd+bwd {total / MIB:.2f} MiB")
  formats = {"temp MiB/dev": ".1f", "median ms": ".1f", "GFLOP/s": ".1f", "% matmul": ".1f", "sent/ideal ring": ".2f"}
  report.table("fwd+bwd per configuration", HEADER, [table_row(r, peak) for r in rows], formats=formats, notes=notes)


def _find(rows: Sequence[Row], impl: str, seq_len: int, causal: bool) -> Row | None:
  return next((r for r in rows if (r.impl, r.seq_len, r.causal) == (impl, seq_len, causal)), None)


def _ratio(a: float | None, b: float | None) -> float | None:
  return a / b if a is not None and b else None


def report_targets(report: Report, rows: Sequence[Row], seq_lens: Sequence[int]) -> None:
  """Project targets, at T=8k (time, traffic) and 16k (memory), else at the largest T measured ("n/a" values,
  e.g. without haoliu, are not misses)."""
  t_time = 8192 if 8192 in seq_lens else max(seq_lens)
  t_mem = 16384 if 16384 in seq_lens else max(seq_lens)

  def time_of(impl: str, causal: bool) -> float | None:
    row = _find(rows, impl, t_time, causal)
    return bench.median(row.times) if row else None

  def temp_mib(impl: str, seq_len: int) -> float | None:
    row = _find(rows, impl, seq_len, False)
    return row.stats.temp_bytes / MIB if row and row.stats and row.stats.temp_bytes is not None else None

  def at_most(x, limit):
    return None if x is None else x <= limit

  for impl in ("ring", "ring+lb"):
    r = _ratio(time_of(impl, True), time_of("haoliu", True))
    report.target(f"{impl} / haoliu time, T={t_time} causal", r, "<= 0.80", at_most(r, 0.8))
  for impl in ("ring", "ring+lb"):
    r = _ratio(time_of(impl, True), time_of("ring", False))
    report.target(f"{impl} causal / ring non-causal time, T={t_time}", r, "<= 0.55", at_most(r, 0.55))
  mem = [temp_mib("ring", t_mem), temp_mib("haoliu", t_mem)]
  mem_s = " vs ".join("n/a" if m is None else f"{m:.1f}" for m in mem)
  report.target(f"temp MiB/dev T={t_mem} non-causal, ring vs haoliu", mem_s, "-", None)
  pair = (8192, 16384) if {8192, 16384} <= set(seq_lens) else sorted(set(seq_lens))[-2:]
  if len(pair) == 2:
    small, large = pair
    growth = _ratio(temp_mib("ring", large), temp_mib("ring", small))
    report.target(f"ring temp growth T={small}->{large} non-causal", growth, f"~{large / small:g} (linear in T)", None)
  ring_row = _find(rows, "ring", t_time, False)
  sent = ring_row.stats.sent.total if ring_row and ring_row.stats else None
  ratio = _ratio(sent, ideal_ring_bytes(t_time)[1])
  report.target(f"ring bytes sent / ideal ring, T={t_time} non-causal", ratio, "~1.0", None)


# ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument(
    "--seq-lens",
    default=",".join(map(str, DEFAULT_SEQ_LENS)),
    help="comma-separated global sequence lengths (multiples of 8)",
  )
  parser.add_argument(
    "--quick",
    action="store_true",
    help=f"smoke run: T={','.join(map(str, QUICK_SEQ_LENS))}, 1 repeat",
  )
  parser.add_argument("--repeats", type=int, default=3, help="timed calls per row (median)")
  parser.add_argument("--impls", default=",".join(ALL_IMPLS), help=f"comma-separated subset of {','.join(ALL_IMPLS)}")
  parser.add_argument("--causal", choices=("both", "causal", "non-causal"), default="both")
  parser.add_argument(
    "--block",
    default=None,
    metavar="Q[,KV]",
    help="pass flax_ringattn.BlockSizes(block_q=Q, block_kv=KV) to ring rows",
  )
  parser.add_argument(
    "--haoliu-path",
    default=None,
    help="directory holding the `ringattention` package (e.g. a pip --target)",
  )
  parser.add_argument("--haoliu-chunk", type=int, default=256, help="haoliu query/key chunk size (clamped to T/8)")
  parser.add_argument(
    "--mem-limit-gib",
    type=float,
    default=16.0,
    help="skip rows whose estimated host memory (8 devices) exceeds this",
  )
  parser.add_argument("--seed", type=int, default=0)
  bench.add_report_args(parser)
  args = parser.parse_args(argv)
  if args.quick:
    args.seq_lens, args.repeats = ",".join(map(str, QUICK_SEQ_LENS)), 1
  args.seq_lens = [int(t) for t in args.seq_lens.split(",")]
  if bad := [t for t in args.seq_lens if t <= 0 or t % NUM_DEVICES]:
    parser.error(f"--seq-lens {bad} must be positive multiples of {NUM_DEVICES}")
  args.impls = [i.strip() for i in args.impls.split(",")]
  if unknown := set(args.impls) - set(ALL_IMPLS):
    parser.error(f"unknown --impls {sorted(unknown)}; choose from {ALL_IMPLS}")
  args.causal_modes = {"both": (False, True), "causal": (True,), "non-causal": (False,)}[args.causal]
  if args.block:
    q, _, kv = args.block.partition(",")
    args.block = (int(q), int(kv or q))
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if jax.device_count() < NUM_DEVICES:
    sys.exit(f"need {NUM_DEVICES} devices, have {jax.device_count()} (XLA_FLAGS={os.environ.get('XLA_FLAGS')!r})")
  mesh = jax.make_mesh(
    (NUM_DEVICES,),
    (AXIS,),
    axis_types=(jax.sharding.AxisType.Auto,),
    devices=jax.devices()[:NUM_DEVICES],
  )
  haoliu_fn = load_haoliu(args.haoliu_path) if "haoliu" in args.impls else None
  peak = measure_matmul_flops(MATMUL_N, repeats=max(args.repeats, 10)) / 1e9
  report = Report(
    "ring_scaling: ring attention vs all-gather vs haoliu, fwd+bwd",
    json=args.json,
    meta={
      "machine": f"{bench.machine()}; {NUM_DEVICES} simulated devices",
      "problem": f"B={BATCH}, heads={HEADS}, head_dim={HEAD_DIM}, {DTYPE}, fwd+bwd, repeats={args.repeats}",
      f"one-device f32 matmul {MATMUL_N}^3 (median), GFLOP/s": round(peak, 1),
    },
  )
  report.require(check_against_reference(args, mesh, haoliu_fn))
  rows = []
  for seq_len in args.seq_lens:
    report.progress(f"T={seq_len} ...")
    rows += measure_seq_len(seq_len, args, mesh, haoliu_fn)
  report_results(report, rows, peak, args.seq_lens)
  report_targets(report, rows, args.seq_lens)
  return report.finish(enforce_targets=not args.quick)


if __name__ == "__main__":
  sys.exit(main())

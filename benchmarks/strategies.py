"""Every `strategy=` of `ring_attention` side by side on 8 simulated CPU devices, against `suggest_strategy`.

What it measures
----------------
For each sequence length T, the forward+backward pass (``benchmarking.fwd_bwd``,
gradients only) of causal attention with the ``strategies`` problem set of
``flax_ringattn.benchmarking.PROBLEM_SETS`` (B=1, N=K=8 heads, head_dim 64,
float32; ``--heads``/``--kv-heads``/``--head-dim`` change it), zigzag layout,
XLA block backend, for

* ``ring``, ``ulysses``, ``all_gather`` over a 1-D mesh ("sp",) of 8 devices,
* ``ulysses_ring`` over a (2, 4) mesh ("ring", "uly").

Before anything is timed, every strategy's output and gradients are checked:
against `reference_attention` at T = ``--check-len`` (default 1024), and at
every T against the ring's own result (the ring is checked against the
reference by the test suite).  A wrong result exits 1.

Columns: per-device temp memory (``compiled.memory_analysis()``), median wall
time (strategies interleaved, ``benchmarking.time_interleaved``), bytes sent
per device (from the compiled HLO), the cost model's predicted time
(`flax_ringattn.suggest_strategy`'s model, hardware "cpu" from the package's
hardware table or the rates measured with ``--calibrate``), and both as
ratios to the ring, so the model's ratios can be compared with the measured
ones.  A last table names the measured best and the model's advice per T.

Run it::

  python benchmarks/strategies.py --seq-lens 1024,2048 --repeats 2   # smoke run
  python benchmarks/strategies.py --calibrate                         # 4k..32k (slow on CPU)
  python benchmarks/strategies.py --seq-lens 4096,8192,16384 --compile-only-lens 32768 --calibrate
                                     # 32k compiled only: its memory and bytes sent, no time

The simulated devices share the host's cores, so absolute times say little
about accelerators, and a loaded machine adds noise; ratios are the point.
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import os

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import argparse
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ringattn as fr
from flax_ringattn import benchmarking as bench
from flax_ringattn._src.advisor import HARDWARE, estimate

STRATEGIES = ("ring", "ulysses", "all_gather", "ulysses_ring")
PROBLEM = bench.PROBLEM_SETS["strategies"][0]
DEFAULT_SEQ_LENS = ",".join(str(p.T) for p in bench.PROBLEM_SETS["strategies"])
LAYOUT = {
  "ring": ((8,), ("sp",), "sp"),
  "ulysses": ((8,), ("sp",), "sp"),
  "all_gather": ((8,), ("sp",), "sp"),
  "ulysses_ring": ((2, 4), ("ring", "uly"), ("ring", "uly")),
}
MIB, GIB = 2**20, 2**30
CHECK_TOL = 1e-4  # f32: max |a - b| / max |b|


def mesh_for(strategy):
  shape, names, axis = LAYOUT[strategy]
  return jax.make_mesh(shape, names, devices=jax.devices()[:8]), axis


def attention(strategy, mesh, axis):
  def f(q, k, v):
    return fr.ring_attention(
      q, k, v, mesh=mesh, axis_name=axis, strategy=strategy, is_causal=True, load_balance=True, implementation="xla"
    )

  return f


def inputs(p: bench.Problem, mesh, axis, seed=0):
  rng = np.random.default_rng(seed)
  spec = NamedSharding(mesh, P(None, axis, None, None))
  shapes = ((1, p.T, p.N, p.H), (1, p.T, p.K, p.H), (1, p.T, p.K, p.H), (1, p.T, p.N, p.H))
  return [jax.device_put(rng.standard_normal(s, np.float32), spec) for s in shapes], spec


def results(strategy, p: bench.Problem):
  mesh, axis = mesh_for(strategy)
  (q, k, v, g), _ = inputs(p, mesh, axis)
  out, vjp = jax.vjp(jax.jit(attention(strategy, mesh, axis)), q, k, v)
  return [np.asarray(x) for x in (out, *vjp(g))]


def check(p: bench.Problem, *, against_reference: bool) -> list[bench.Check]:
  """Every strategy's fwd + grads vs the reference (or vs the ring)."""
  got = {s: results(s, p) for s in STRATEGIES}
  if against_reference:
    rng = np.random.default_rng(0)  # the draws of `inputs`, in its order
    shapes = ((1, p.T, p.N, p.H), (1, p.T, p.K, p.H), (1, p.T, p.K, p.H), (1, p.T, p.N, p.H))
    q, k, v, g = (rng.standard_normal(s, np.float32) for s in shapes)
    # ulysses_ring runs on 8 devices too, so the zigzag layout of 8 shards applies to every strategy.
    pos = fr.zigzag_positions(p.T, 8)
    ref = functools.partial(fr.reference_attention, is_causal=True, q_positions=pos, kv_positions=pos)
    out, vjp = jax.vjp(ref, q, k, v)
    want, against = [np.asarray(x) for x in (out, *vjp(g))], "reference"
  else:
    want, against = got["ring"], "ring"
  return [
    bench.compare(f"{s} T={p.T} vs {against}", vals, want, tol=CHECK_TOL, metric="rel_max") for s, vals in got.items()
  ]


def calibrate() -> fr.Hardware:
  """This machine's CPU devices: one device's f32 matmul rate and an all-gather's rate between devices."""
  flops = bench.measure_matmul_flops(repeats=5)
  mesh = jax.make_mesh((8,), ("sp",), devices=jax.devices()[:8])
  x = jax.device_put(jnp.ones((8 * 2**21,), jnp.float32), NamedSharding(mesh, P("sp")))
  gather = jax.jit(lambda x: x * 1.0, out_shardings=NamedSharding(mesh, P()))
  t = bench.median(bench.time_interleaved({"all-gather": lambda: gather(x)}, 5)["all-gather"])
  bw = 7 / 8 * x.nbytes / t  # each device receives the other 7 shards
  base = HARDWARE["cpu"]
  return fr.Hardware(
    name="cpu (calibrated)",
    flops=flops,
    inner_bandwidth=bw,
    outer_bandwidth=base.outer_bandwidth,
    latency=base.latency,
    memory=base.memory,
    memory_bandwidth=base.memory_bandwidth,  # the all-gather rate is not a memory rate
    source=f"measured now: {flops / 1e9:.1f} GFLOP/s f32 matmul, all-gather {bw / 1e9:.2f} GB/s",
  )


def predict(strategy, p: bench.Problem, hw):
  shape, _, _ = LAYOUT[strategy]
  bws = tuple(hw.inner_bandwidth for _ in shape)
  t, m, _ = estimate(strategy, shape, bws, p.shape, B=p.B, causal=True, hw=hw, latency=hw.latency)
  return t, m


def measure(seq_lens, compile_only, p: bench.Problem, args, report: bench.Report) -> dict:
  """(strategy, T) -> (compiled stats or None, times, status): compiled, then timed interleaved per T."""
  out = {}
  for T in seq_lens + compile_only:
    report.progress(f"T={T} ...")
    compiled, xs = {}, {}
    for s in STRATEGIES:
      mesh, axis = mesh_for(s)
      (q, k, v, g), spec = inputs(p.replace(T=T), mesh, axis)
      stats, status = None, ""
      try:
        exe = bench.fwd_bwd(attention(s, mesh, axis), out_shardings=spec, with_output=False).lower(q, k, v, g).compile()
        stats = bench.compiled_stats(exe, 8)
        if stats.footprint_bytes is not None and 8 * stats.footprint_bytes > args.mem_limit_gib * GIB:
          status = "OOM-skip"
        elif T not in compile_only:
          compiled[s], xs[s] = exe, (q, k, v, g)
        else:
          status = "not run"
      except Exception as e:  # one failing row must not kill the table
        status = f"error: {type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}"
      out[s, T] = [stats, [], status]

    def failed(s, e, T=T):
      out[s, T][2] = f"error: {type(e).__name__}"

    calls = {s: functools.partial(exe, *xs[s]) for s, exe in compiled.items()}
    for s, times in bench.time_interleaved(calls, args.repeats, on_error=failed).items():
      out[s, T][1] = times
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--seq-lens", default=DEFAULT_SEQ_LENS)
  ap.add_argument("--heads", type=int, default=PROBLEM.N)
  ap.add_argument("--kv-heads", type=int, default=PROBLEM.K)
  ap.add_argument("--head-dim", type=int, default=PROBLEM.H)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--check-len", type=int, default=1024)
  ap.add_argument("--calibrate", action="store_true", help="measure this machine's rates for the model")
  ap.add_argument("--mem-limit-gib", type=float, default=24.0)
  ap.add_argument(
    "--compile-only-lens",
    default="",
    help="lengths that are only compiled: temp memory and bytes sent from the compiled program, not timed or run",
  )
  bench.add_report_args(ap)
  args = ap.parse_args(argv)
  p = PROBLEM.replace(N=args.heads, K=args.kv_heads, H=args.head_dim)
  seq_lens = [int(s) for s in args.seq_lens.split(",")]
  compile_only = [int(s) for s in args.compile_only_lens.split(",") if s]
  report = bench.Report(
    "strategies: every strategy= of ring_attention vs suggest_strategy's model",
    json=args.json,
    meta={"problem": f"{p.replace(T=seq_lens[0]).describe()}, zigzag, xla blocks, fwd+bwd, 8 CPU devices"},
  )
  checks = check(p.replace(T=args.check_len), against_reference=True)
  for T in seq_lens:
    checks += check(p.replace(T=T), against_reference=False)
  report.require(checks)

  hw = calibrate() if args.calibrate else HARDWARE["cpu"]
  report.note(f"\nmodel hardware: {hw.name}: {hw.source}")
  measured = measure(seq_lens, compile_only, p, args, report)
  table, summary = [], []
  for T in seq_lens + compile_only:
    ring_t = bench.median(measured["ring", T][1])
    ring_p = predict("ring", p.replace(T=T), hw)[0]
    times, predicted = {}, {}
    for s in STRATEGIES:
      stats, ts, status = measured[s, T]
      t = bench.median(ts)
      pt, pm = predict(s, p.replace(T=T), hw)
      times[s], predicted[s] = t, pt
      temp = stats.temp_bytes / MIB if stats and stats.temp_bytes is not None else None
      sent = stats.sent.total / MIB if stats else None
      ratio = t / ring_t if t and ring_t else None
      table.append([s, T, temp, pm / MIB, 1e3 * t if t else (status or "-"), sent, 1e3 * pt, ratio, pt / ring_p])
    ok = {s: t for s, t in times.items() if t}
    best = min(ok, key=ok.get) if ok else "-"
    advice = min(predicted, key=predicted.get)
    summary.append([T, best, advice, (best == advice) if ok else None])
  header = ["strategy", "T", "temp MiB", "model MiB", "time ms", "sent MiB", "model ms", "time / ring", "model / ring"]
  formats = {"temp MiB": ".1f", "model MiB": ".1f", "time ms": ".0f", "sent MiB": ".1f", "model ms": ".0f"}
  report.table("measured vs the cost model", header, table, formats=formats | dict.fromkeys(header[-2:], ".2f"))
  report.table("best per T", ["T", "measured best", "model's advice", "agree"], summary)
  return report.finish()


if __name__ == "__main__":
  sys.exit(main())

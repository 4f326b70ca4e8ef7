"""Every `strategy=` of `ring_attention` side by side on 8 simulated CPU devices, against `suggest_strategy`.

What it measures
----------------
For each sequence length T, the forward+backward pass (``ring_scaling.fwd_bwd``)
of causal attention with B=1, N=K=8 heads (``--heads``/``--kv-heads``),
head_dim 64, float32, zigzag layout, XLA block backend, for

* ``ring``, ``ulysses``, ``all_gather`` over a 1-D mesh ("sp",) of 8 devices,
* ``ulysses_ring`` over a (2, 4) mesh ("ring", "uly").

Before anything is timed, every strategy's output and gradients are checked:
against `reference_attention` at T = ``--check-len`` (default 1024), and at
every T against the ring's own result (the ring is checked against the
reference by the test suite).  A wrong result exits non-zero.

Columns: per-device temp memory (``compiled.memory_analysis()``), median wall
time, bytes sent per device (from the compiled HLO), the cost model's
predicted time (`flax_ringattn.suggest_strategy`, hardware "cpu" or the rates
measured with ``--calibrate``), and both as ratios to the ring, so the model's
ratios can be compared with the measured ones.  A last table names the
measured best and the model's advice per T.  Timing, memory and table code
are shared with ``ring_scaling.py``.

Run it::

  python benchmarks/strategies.py --seq-lens 1024,2048 --repeats 2   # smoke run
  python benchmarks/strategies.py --calibrate                         # 4k..32k (slow on CPU)
  python benchmarks/strategies.py --seq-lens 4096,8192,16384 --compile-only-lens 32768 --calibrate
                                     # 32k compiled only: its memory and bytes sent, no time

The simulated devices share the host's cores, so absolute times say little
about accelerators, and a loaded machine adds noise; ratios are the point.
"""

# ruff: noqa: E402 -- ring_scaling sets XLA_FLAGS before jax is imported.
from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import jax
import jax.numpy as jnp
import numpy as np
import ring_scaling as rs
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ringattn as fr
from flax_ringattn._src.advisor import HARDWARE, estimate

STRATEGIES = ("ring", "ulysses", "all_gather", "ulysses_ring")
LAYOUT = {
  "ring": ((8,), ("sp",), "sp"),
  "ulysses": ((8,), ("sp",), "sp"),
  "all_gather": ((8,), ("sp",), "sp"),
  "ulysses_ring": ((2, 4), ("ring", "uly"), ("ring", "uly")),
}


def mesh_for(strategy):
  shape, names, axis = LAYOUT[strategy]
  return jax.make_mesh(shape, names, devices=jax.devices()[:8]), axis


def attention(strategy, mesh, axis):
  def f(q, k, v):
    return fr.ring_attention(
      q, k, v, mesh=mesh, axis_name=axis, strategy=strategy, is_causal=True, load_balance=True, implementation="xla"
    )

  return f


def inputs(T, N, K, H, mesh, axis, seed=0):
  rng = np.random.default_rng(seed)
  spec = NamedSharding(mesh, P(None, axis, None, None))
  shapes = ((1, T, N, H), (1, T, K, H), (1, T, K, H), (1, T, N, H))
  return [jax.device_put(rng.standard_normal(s, np.float32), spec) for s in shapes], spec


def results(strategy, T, N, K, H):
  mesh, axis = mesh_for(strategy)
  (q, k, v, g), spec = inputs(T, N, K, H, mesh, axis)
  out, vjp = jax.vjp(jax.jit(attention(strategy, mesh, axis)), q, k, v)
  return [np.asarray(x) for x in (out, *vjp(g))]


def check(T, N, K, H, *, against_reference: bool) -> list[str]:
  """Every strategy's fwd + grads vs the reference (or vs the ring); returns the failures."""
  got = {s: results(s, T, N, K, H) for s in STRATEGIES}
  if against_reference:
    rng = np.random.default_rng(0)  # the draws of `inputs`, in its order
    q, k, v, g = (rng.standard_normal(s, np.float32) for s in ((1, T, N, H), (1, T, K, H), (1, T, K, H), (1, T, N, H)))
    pos = fr.zigzag_positions(T, 8)
    ref = lambda q, k, v: fr.reference_attention(q, k, v, is_causal=True, q_positions=pos, kv_positions=pos)  # noqa: E731
    out, vjp = jax.vjp(ref, q, k, v)
    want = [np.asarray(x) for x in (out, *vjp(g))]
    # ulysses_ring runs on 8 devices too, so the zigzag layout of 8 shards applies to every strategy.
  else:
    want = got["ring"]
  bad = []
  for s, vals in got.items():
    for name, a, b in zip(("out", "dq", "dk", "dv"), vals, want, strict=True):
      err = float(np.max(np.abs(a - b)))
      if not np.isfinite(err) or err > 1e-4 * max(1.0, float(np.max(np.abs(b)))):
        bad.append(f"{s} T={T} {name}: max |error| {err:.3g}")
  return bad


def calibrate() -> fr.Hardware:
  """This machine's CPU devices: one device's f32 matmul rate and an all-gather's rate between devices."""
  flops = rs.matmul_gflops(5) * 1e9
  mesh = jax.make_mesh((8,), ("sp",), devices=jax.devices()[:8])
  x = jax.device_put(jnp.ones((8 * 2**21,), jnp.float32), NamedSharding(mesh, P("sp")))
  gather = jax.jit(lambda x: x * 1.0, out_shardings=NamedSharding(mesh, P()))
  jax.block_until_ready(gather(x))
  times = []
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(gather(x))
    times.append(time.perf_counter() - t0)
  sent = 7 / 8 * x.nbytes  # each device receives the other 7 shards
  bw = sent / float(np.median(times))
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


def predict(strategy, T, N, K, H, hw):
  shape, _, _ = LAYOUT[strategy]
  bws = tuple(hw.inner_bandwidth for _ in shape)
  t, m, _ = estimate(strategy, shape, bws, B=1, T=T, N=N, K=K, H=H, itemsize=4, causal=True, hw=hw, latency=hw.latency)
  return t, m


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--seq-lens", default="4096,8192,16384,32768")
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int, default=8)
  p.add_argument("--head-dim", type=int, default=64)
  p.add_argument("--repeats", type=int, default=3)
  p.add_argument("--check-len", type=int, default=1024)
  p.add_argument("--calibrate", action="store_true", help="measure this machine's rates for the model")
  p.add_argument("--mem-limit-gib", type=float, default=24.0)
  p.add_argument(
    "--compile-only-lens",
    default="",
    help="lengths that are only compiled: temp memory and bytes sent from the compiled program, not timed or run",
  )
  args = p.parse_args(argv)
  N, K, H = args.heads, args.kv_heads, args.head_dim
  seq_lens = [int(s) for s in args.seq_lens.split(",")]
  compile_only = [int(s) for s in args.compile_only_lens.split(",") if s]

  bad = check(args.check_len, N, K, H, against_reference=True)
  for T in seq_lens:
    bad += check(T, N, K, H, against_reference=False)
  if bad:
    print("WRONG RESULTS, nothing timed:\n  " + "\n  ".join(bad))
    return 1
  print(f"checked: every strategy matches the reference at T={args.check_len} and the ring at T={seq_lens}")

  hw = calibrate() if args.calibrate else HARDWARE["cpu"]
  print(f"model hardware: {hw.name}: {hw.source}")
  rows = {}
  for T in seq_lens + compile_only:
    for s in STRATEGIES:
      mesh, axis = mesh_for(s)
      (q, k, v, g), spec = inputs(T, N, K, H, mesh, axis)
      row = rs.Row(impl=s, seq_len=T, causal=True)
      try:
        rs.compile_row(row, attention(s, mesh, axis), (q, k, v, g), spec, args.mem_limit_gib * rs.GIB)
      except Exception as e:  # one failing row must not kill the table
        row.status = rs._error(e)
      rows[s, T] = (row, (q, k, v, g))
    if T in compile_only:
      for s in STRATEGIES:
        rows[s, T][0].status = rows[s, T][0].status or "not run"
        rows[s, T][0].compiled = None  # frees the executable: nothing runs at this length
      continue
    for _ in range(args.repeats):  # interleaved: repeats outside, strategies inside
      for s in STRATEGIES:
        row, xs = rows[s, T]
        if row.compiled is not None:
          t = rs.run_row(row, xs)
          if t is not None:
            row.times.append(t)

  table, summary = [], []
  for T in seq_lens + compile_only:
    ring_t = rs.median_time(rows["ring", T][0])
    ring_p = predict("ring", T, N, K, H, hw)[0]
    measured = {}
    predicted = {}
    for s in STRATEGIES:
      row = rows[s, T][0]
      t = rs.median_time(row)
      pt, pm = predict(s, T, N, K, H, hw)
      measured[s], predicted[s] = t, pt
      table.append(
        [
          s,
          str(T),
          f"{row.temp_bytes / rs.MIB:.1f}" if row.temp_bytes is not None else "-",
          f"{pm / rs.MIB:.1f}",
          f"{1e3 * t:.0f}" if t else (row.status or "-"),
          f"{row.sent.total / rs.MIB:.1f}" if row.sent else "-",
          f"{1e3 * pt:.0f}",
          rs._fmt(t / ring_t if t and ring_t else None),
          rs._fmt(pt / ring_p),
        ]
      )
    ok = {s: t for s, t in measured.items() if t}
    best = min(ok, key=ok.get) if ok else "-"
    advice = min(predicted, key=predicted.get)
    summary.append([str(T), best, advice, ("yes" if best == advice else "no") if ok else "-"])
  print()
  header = [
    "strategy",
    "T",
    "temp MiB",
    "model MiB",
    "time ms",
    "sent MiB",
    "model ms",
    "time / ring",
    "model / ring",
  ]
  print(rs.markdown_table(header, table))
  print()
  print(rs.markdown_table(["T", "measured best", "model's advice", "agree"], summary))
  return 0


if __name__ == "__main__":
  sys.exit(main())

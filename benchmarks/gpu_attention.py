"""Forward+backward attention on an NVIDIA GPU: pallas_gpu vs the xla backend vs cuDNN.

What it measures
----------------
``jax.grad`` of ``sum(attn(q, k, v) * g)`` with respect to q, k and v (and the
output), with the ``gpu_attention`` problem set of
``flax_ringattn.benchmarking.PROBLEM_SETS``: bf16, head_dim 128, GQA 4:1 (32 q
heads, 8 kv heads), batch 1, at 4k, 8k, 16k and 32k tokens, causal and not.
Implementations, timed side by side (``benchmarking.time_interleaved``: every
round runs each once, the order rotating):

* ``pallas_gpu``   -- ``ring_attention(..., implementation="pallas_gpu")``
* ``xla``          -- ``ring_attention(..., implementation="xla")``
* ``cudnn``        -- ``jax.nn.dot_product_attention(..., implementation="cudnn")``
                      (one device only: it has no ring)

on one device (no mesh) and as a ring over every local device (``mesh=``; a
ring of one on a single-GPU machine).  Before anything is timed, every output
and gradient is compared with cuDNN's (with ``reference_attention`` when cuDNN
is absent); a wrong result exits 1.  Columns: median ms, TFLOP/s
(``Problem.flops``: fwd+bwd = 3.5 x the forward's 4*B*N*T*S*H, causal counted
once), the fraction of the devices' dense bf16 peak (the package's hardware
table, by device kind), and the speed relative to cuDNN and to the xla backend
as paired medians.  The targets of the project (bf16, causal, fwd+bwd, 8k, one
device: pallas_gpu >= 0.6x cuDNN's speed and >= 3x the xla backend's) are
checked at the end; a miss exits 3.

Run it::

  python benchmarks/gpu_attention.py --out benchmarks/results/gpu_attention.md
  python benchmarks/gpu_attention.py --smoke      # CPU: tiny shapes, kernels in interpret mode, 2 devices

``--smoke`` is how CI-less machines know the script works; its numbers mean
nothing.
"""

# ruff: noqa: E402 -- XLA_FLAGS (simulated host devices for --smoke) must be set before jax is imported.
from __future__ import annotations

import argparse
import datetime
import functools
import os
import sys
from collections.abc import Sequence

# --smoke rings over 2 simulated host devices (no effect on GPUs); must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ringattn as fr
from flax_ringattn import benchmarking as bench

TARGET_T = 8192
TARGET_VS_CUDNN = 0.6  # pallas_gpu speed / cuDNN speed, at least
TARGET_VS_XLA = 3.0  # pallas_gpu speed / xla speed, at least
MAX_REL_ERR = 2e-2  # bf16: max |a - b| / max |b|, per output and gradient


def peak_flops(kind: str) -> float | None:
  """Dense bf16 peak of a GPU by its `device_kind`, from the package's hardware table (None if unknown)."""
  chip = bench.hardware.gpu_for_device_kind(kind)
  return chip.peak_flops("bfloat16") if chip else None


def attention_fns(causal: bool, mesh, *, interpret: bool, smoke: bool) -> dict:
  """name -> attn(q, k, v); the ring variants take global arrays (sharded by the caller)."""
  blocks = fr.BlockSizes(block_q=16, block_kv=16) if smoke else None
  ring = dict(is_causal=causal, block_sizes=blocks)
  fns = {
    "pallas_gpu": lambda q, k, v: fr.ring_attention(q, k, v, implementation="pallas_gpu", interpret=interpret, **ring),
    "xla": lambda q, k, v: fr.ring_attention(q, k, v, implementation="xla", **ring),
  }
  if mesh is not None:
    return {
      f"{name} ring{mesh.size}": (
        lambda q, k, v, impl=impl: fr.ring_attention(
          q, k, v, mesh=mesh, implementation=impl, interpret=interpret if impl == "pallas_gpu" else None, **ring
        )
      )
      for name, impl in (("pallas_gpu", "pallas_gpu"), ("xla", "xla"))
    }
  if jax.default_backend() == "gpu":
    fns["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  return fns


def reference_fn(causal: bool):
  if jax.default_backend() == "gpu":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  return lambda q, k, v: fr.reference_attention(q, k, v, is_causal=causal)


def measure(p: bench.Problem, mesh, args, report: bench.Report) -> list[dict]:
  """Checks every implementation of problem `p` against the reference (exits 1 on a mismatch), then times them."""
  q, k, v, g = p.inputs(0)
  want = jax.device_get(bench.fwd_bwd(reference_fn(p.is_causal))(q, k, v, g))
  if mesh is not None:
    spec = NamedSharding(mesh, P(None, "sp", None, None))
    q, k, v, g = (jax.device_put(x, spec) for x in (q, k, v, g))
  fns = attention_fns(p.is_causal, mesh, interpret=args.smoke, smoke=args.smoke)
  fns = {name: bench.fwd_bwd(f) for name, f in fns.items()}
  where = f"T={p.T} causal={p.is_causal}" + ("" if mesh is None else f" ring of {mesh.size}")
  checks = [
    bench.compare(f"{name} {where}", jax.device_get(f(q, k, v, g)), want, tol=MAX_REL_ERR, metric="rel_max")
    for name, f in fns.items()
  ]
  report.require(checks)
  times = bench.time_interleaved({name: functools.partial(f, q, k, v, g) for name, f in fns.items()}, args.repeats)
  n_dev = 1 if mesh is None else mesh.size
  peak = peak_flops(jax.devices()[0].device_kind)
  rows = []
  for (name, ts), check in zip(times.items(), checks, strict=True):
    s = bench.median(ts)
    tflops = p.flops("fwd+bwd") / s / 1e12
    suffix = name.removeprefix(name.split()[0])  # " ring2" for the ring rows: compare ring with ring
    refs = {ref: ref + suffix for ref in ("cudnn", "xla")}
    vs = {ref: bench.paired_ratio(times[r], ts).ratio if r in times else None for ref, r in refs.items()}
    frac = None if peak is None else tflops * 1e12 / (peak * n_dev)
    rows.append(dict(impl=name, T=p.T, causal=p.is_causal, devices=n_dev, ms=s * 1e3, tflops=tflops, frac=frac,
                     vs_cudnn=vs["cudnn"], vs_xla=vs["xla"], err=check.error))  # fmt: skip
  return rows


def check_targets(rows: Sequence[dict], report: bench.Report) -> None:
  """The project's targets at TARGET_T, causal, one device (speeds as paired ratios of interleaved rounds)."""
  at = {r["impl"]: r for r in rows if r["T"] == TARGET_T and r["causal"] and r["devices"] == 1}
  pallas = at.get("pallas_gpu")
  if pallas is None:
    return
  for ref, goal in (("cudnn", TARGET_VS_CUDNN), ("xla", TARGET_VS_XLA)):
    r = pallas[f"vs_{ref}"] if ref in at else None
    report.target(f"pallas_gpu speed / {ref}'s, {TARGET_T} causal, one device", r, f">= {goal:g}x", r and r >= goal)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  seq_lens = dict.fromkeys(p.T for p in bench.PROBLEM_SETS["gpu_attention"])
  ap.add_argument("--seq-lens", default=",".join(map(str, seq_lens)))
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--no-ring", action="store_true", help="skip the ring-over-local-devices rows")
  ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, pallas_gpu in interpret mode")
  ap.add_argument("--out", default=None, help="also write the markdown report to this file")
  bench.add_report_args(ap)
  return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if args.smoke:
    problems, args.repeats = bench.PROBLEM_SETS["gpu_attention_smoke"], min(args.repeats, 2)
  else:
    if jax.default_backend() != "gpu":
      raise SystemExit(f"needs a GPU (default backend {jax.default_backend()!r}); use --smoke on CPU")
    base = bench.PROBLEM_SETS["gpu_attention"][0]
    problems = [base.replace(T=int(T), is_causal=c) for T in args.seq_lens.split(",") for c in (True, False)]
  devices = jax.devices()[:2] if args.smoke else jax.local_devices()
  mesh = None if args.no_ring else jax.make_mesh((len(devices),), ("sp",), devices=devices)
  p0 = problems[0]
  report = bench.Report(
    f"gpu_attention: {datetime.date.today()}"
    + (" (SMOKE: interpret mode, numbers mean nothing)" if args.smoke else ""),
    json=args.json,
    meta={
      "machine": bench.machine(),
      "problem": f"B={p0.B} N={p0.N} K={p0.K} H={p0.H} {p0.dtype}, fwd+bwd, median of {args.repeats}",
    },
  )
  rows = []
  for p in problems:
    rows += measure(p, None, args, report)
    if mesh is not None:
      rows += measure(p, mesh, args, report)
  header = ["T", "causal", "impl", "devices", "ms", "TFLOP/s", "of bf16 peak", "vs cudnn", "vs xla", "max rel err"]
  keys = ["T", "causal", "impl", "devices", "ms", "tflops", "frac", "vs_cudnn", "vs_xla", "err"]
  formats = {"ms": ".2f", "TFLOP/s": ".1f", "of bf16 peak": ".0%", "vs cudnn": ".2f", "vs xla": ".2f"}
  report.table("fwd+bwd", header, [[r[k] for k in keys] for r in rows], formats=formats | {"max rel err": ".1e"})
  report.note("\n'vs cudnn', 'vs xla': that implementation's time / this one's, median of paired rounds.")
  check_targets(rows, report)
  code = report.finish()
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write(report.markdown())
  return code


if __name__ == "__main__":
  sys.exit(main())

"""Forward+backward attention on an NVIDIA GPU: pallas_gpu vs the xla backend vs cuDNN.

What it measures
----------------
``jax.grad`` of ``sum(attn(q, k, v) * g)`` with respect to q, k and v, bf16,
head_dim 128, GQA 4:1 (32 q heads, 8 kv heads), batch 1, at 4k, 8k, 16k and
32k tokens, causal and not.  Implementations, timed side by side in the same
run (each repeat runs every implementation once, the order rotating):

* ``pallas_gpu``   -- ``ring_attention(..., implementation="pallas_gpu")``
* ``xla``          -- ``ring_attention(..., implementation="xla")``
* ``cudnn``        -- ``jax.nn.dot_product_attention(..., implementation="cudnn")``
                      (one device only: it has no ring)

on one device (no mesh) and as a ring over every local device (``mesh=``; a
ring of one on a single-GPU machine).  Before anything is timed, every output
and gradient is compared with cuDNN's (with ``reference_attention`` when cuDNN
is absent); a wrong result exits non-zero.  Columns: median ms, TFLOP/s
(fwd+bwd = 3.5 x the forward's 4*B*N*T*S*H, halved for causal: causal FLOPs
counted once) and the fraction of the devices' dense bf16 peak
(`pallas_gpu.planner.BF16_PEAK_TFLOPS`, by device kind).  The targets of the
project (bf16, causal, fwd+bwd, 8k, one device: pallas_gpu >= 0.6x cuDNN's
speed and >= 3x the xla backend's) are checked at the end; a miss exits
non-zero.

Run it::

  python benchmarks/gpu_attention.py --out benchmarks/results/gpu_attention.md
  python benchmarks/gpu_attention.py --smoke      # CPU: tiny shapes, kernels in interpret mode, 2 devices

``--smoke`` is how CI-less machines know the script works; its numbers mean
nothing.
"""

# ruff: noqa: E402 -- XLA_FLAGS (simulated host devices for --smoke) must be set before jax is imported.
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import statistics
import sys
from collections.abc import Sequence

# --smoke rings over 2 simulated host devices (no effect on GPUs); must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from paged_throughput import time_interleaved  # shared interleaved timer
from ring_scaling import markdown_table  # shared table printer

import flax_ringattn as fr
from flax_ringattn._src.backends.pallas_gpu import planner

TARGET_T = 8192
TARGET_VS_CUDNN = 0.6  # pallas_gpu speed / cuDNN speed, at least
TARGET_VS_XLA = 3.0  # pallas_gpu speed / xla speed, at least
MAX_REL_ERR = 2e-2  # bf16: max |a - b| / max |b|, per output and gradient


@dataclasses.dataclass(frozen=True)
class Problem:
  B: int
  N: int
  K: int
  H: int
  dtype: object


def flops(p: Problem, T: int, causal: bool) -> float:
  fwd = 4 * p.B * p.N * T * T * p.H
  total = 3.5 * fwd  # backward: 5 matmuls to the forward's 2
  return total / 2 if causal else total


def peak_tflops(kind: str) -> float | None:
  for name, tflops in planner.BF16_PEAK_TFLOPS.items():
    if name.lower() in kind.lower():
      return tflops
  return None


def make_inputs(p: Problem, T: int, seed: int = 0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (p.B, T, p.N, p.H), jnp.float32).astype(p.dtype)
  k = jax.random.normal(ks[1], (p.B, T, p.K, p.H), jnp.float32).astype(p.dtype)
  v = jax.random.normal(ks[2], (p.B, T, p.K, p.H), jnp.float32).astype(p.dtype)
  g = jax.random.normal(ks[3], (p.B, T, p.N, p.H), jnp.float32).astype(p.dtype)
  return q, k, v, g


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


def fwd_bwd(attn):
  def loss(q, k, v, g):
    return jnp.sum(attn(q, k, v).astype(jnp.float32) * g.astype(jnp.float32))

  @jax.jit
  def run(q, k, v, g):
    out = attn(q, k, v)
    grads = jax.grad(loss, argnums=(0, 1, 2))(q, k, v, g)
    return out, grads

  return run


def rel_err(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  if not np.isfinite(a).all():
    return float("inf")
  return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-6))


def reference_fn(causal: bool):
  if jax.default_backend() == "gpu":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")
  return lambda q, k, v: fr.reference_attention(q, k, v, is_causal=causal)


def measure(p: Problem, T: int, causal: bool, mesh, args) -> list[dict]:
  q, k, v, g = make_inputs(p, T)
  # Correctness first: every implementation against the reference (on one device), before any timing.
  ref_out, ref_grads = jax.device_get(fwd_bwd(reference_fn(causal))(q, k, v, g))
  if mesh is not None:
    spec = NamedSharding(mesh, P(None, "sp", None, None))
    q, k, v, g = (jax.device_put(x, spec) for x in (q, k, v, g))
  fns = {name: fwd_bwd(f) for name, f in attention_fns(causal, mesh, interpret=args.smoke, smoke=args.smoke).items()}
  errors = {}
  for name, f in fns.items():
    out, grads = jax.device_get(f(q, k, v, g))
    errors[name] = max(rel_err(x, y) for x, y in zip((out, *grads), (ref_out, *ref_grads), strict=True))
    if errors[name] > MAX_REL_ERR:
      raise SystemExit(f"WRONG RESULT: {name} at T={T} causal={causal}: max relative error {errors[name]:.3g}")
  times = time_interleaved({name: (lambda f=f: f(q, k, v, g)) for name, f in fns.items()}, args.repeats)
  n_dev = 1 if mesh is None else mesh.size
  peak = peak_tflops(jax.devices()[0].device_kind)
  rows = []
  for name, ts in times.items():
    s = statistics.median(ts)
    tflops = flops(p, T, causal) / s / 1e12
    rows.append(
      dict(
        impl=name,
        T=T,
        causal=causal,
        devices=n_dev,
        ms=s * 1e3,
        tflops=tflops,
        frac=None if peak is None else tflops / (peak * n_dev),
        err=errors[name],
      )
    )
  return rows


def check_targets(rows: Sequence[dict]) -> list[str]:
  """The project's targets at TARGET_T, causal, one device; a list of misses (empty: all met)."""
  at = {r["impl"]: r["ms"] for r in rows if r["T"] == TARGET_T and r["causal"] and r["devices"] == 1}
  if "pallas_gpu" not in at:
    return []
  misses = []
  if "cudnn" in at and at["cudnn"] / at["pallas_gpu"] < TARGET_VS_CUDNN:
    misses.append(f"pallas_gpu is {at['cudnn'] / at['pallas_gpu']:.2f}x cuDNN's speed (target >= {TARGET_VS_CUDNN})")
  if "xla" in at and at["xla"] / at["pallas_gpu"] < TARGET_VS_XLA:
    misses.append(f"pallas_gpu is {at['xla'] / at['pallas_gpu']:.2f}x the xla backend (target >= {TARGET_VS_XLA})")
  return misses


def table(rows: Sequence[dict]) -> str:
  header = ["T", "causal", "impl", "devices", "ms", "TFLOP/s", "of bf16 peak", "max rel err"]
  body = [
    [
      str(r["T"]),
      "yes" if r["causal"] else "no",
      r["impl"],
      str(r["devices"]),
      f"{r['ms']:.2f}",
      f"{r['tflops']:.1f}",
      "n/a" if r["frac"] is None else f"{r['frac']:.0%}",
      f"{r['err']:.1e}",
    ]
    for r in rows
  ]
  return markdown_table(header, body)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
  ap.add_argument("--seq-lens", default="4096,8192,16384,32768")
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--no-ring", action="store_true", help="skip the ring-over-local-devices rows")
  ap.add_argument("--smoke", action="store_true", help="CPU: tiny shapes, pallas_gpu in interpret mode")
  ap.add_argument("--out", default=None, help="also write the markdown table to this file")
  return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  if args.smoke:
    p, seq_lens, args.repeats = Problem(B=1, N=4, K=1, H=16, dtype=jnp.bfloat16), [64], min(args.repeats, 2)
  else:
    if jax.default_backend() != "gpu":
      raise SystemExit(f"needs a GPU (default backend {jax.default_backend()!r}); use --smoke on CPU")
    p, seq_lens = Problem(B=1, N=32, K=8, H=128, dtype=jnp.bfloat16), [int(s) for s in args.seq_lens.split(",")]
  devices = jax.devices()[:2] if args.smoke else jax.local_devices()
  mesh = None if args.no_ring else jax.make_mesh((len(devices),), ("sp",), devices=devices)
  rows = []
  for T in seq_lens:
    for causal in (True, False):
      rows += measure(p, T, causal, None, args)
      if mesh is not None:
        rows += measure(p, T, causal, mesh, args)
  kind = jax.devices()[0].device_kind
  head = (
    f"gpu_attention: {datetime.date.today()} on {len(jax.local_devices())} x {kind}, jax {jax.__version__}, "
    f"B={p.B} N={p.N} K={p.K} H={p.H} {jnp.dtype(p.dtype).name}, fwd+bwd, median of {args.repeats}"
    + (" (SMOKE: interpret mode, numbers mean nothing)" if args.smoke else "")
  )
  text = head + "\n\n" + table(rows) + "\n"
  misses = check_targets(rows)
  text += "\ntargets (8k causal, one device): " + ("; ".join(misses) if misses else "met (or not measured)") + "\n"
  print(text)
  if args.out:
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      f.write(text)
  return 1 if misses else 0


if __name__ == "__main__":
  sys.exit(main())

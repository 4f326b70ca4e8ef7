"""Compile the real-size decoders' train step for a TPU on any host, and print what XLA says it needs.

With `libtpu` installed (`pip install "libtpu==0.0.42.*"`, the version jax 0.10.2's `jax[tpu]` pins), JAX compiles
for a TPU topology it describes without one attached (`jax.experimental.topologies`): the Pallas TPU kernels go
through Mosaic, XLA through its TPU passes and its memory check.  So this host, without a chip, can tell

* the memory a train step needs (`compiled.memory_analysis()`: temporaries, arguments, outputs), or XLA's
  "RESOURCE_EXHAUSTED ... HLO temporaries" verdict when it does not fit the chip's HBM;
* the longest sequence each way compiles within the chip's memory (`--tables longest`: doubling T until XLA
  refuses), which is what `real_models.py --tables longest` finds by running it;
* how long the compile takes here (its Mosaic kernels included) and the size of the code.

These are XLA's compile-time figures for the chip, not a run on it: the program that compiles here within HBM is
the one the chip's first step compiles (the same jax and libtpu), but nothing here is timed on a chip.

  python benchmarks/tpu_compile.py --model qwen --seq-lens 32768 --ways library,splash --remat --remat-policy mask
  python benchmarks/tpu_compile.py --model qwen --tables longest --ways library,splash --remat --remat-policy mask

The models, the three ways and the remat policies are `real_models.py`'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
import sys
import time
from collections.abc import Sequence

import jax
import optax
from flax import nnx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import real_models as rm  # noqa: E402  (its models, ways, forward and remat policies)

from flax_ringattn import benchmarking as bench  # noqa: E402

TOPOLOGIES = {"v5e": "v5e:1x1"}


def tpu_device(chip: str):
  """A device of a one-chip `chip` topology (no TPU attached: libtpu's compile-only description), the Pallas TPU
  backend told that it targets a TPU (its own check reads the attached backend), and the planners that it is a
  `chip` (off a TPU they plan for `chip.DEFAULT_GENERATION`, v4: smaller VMEM, other tiles)."""
  from jax.experimental import topologies

  import flax_ringattn._src.backends.pallas_tpu as pallas_tpu
  from flax_ringattn._src.backends.pallas_tpu.planners import chip as planner_chip
  from flax_ringattn._src.ring import dense

  planner_chip.DEFAULT_GENERATION = chip
  dense.FUSED_RECOVERY = True  # a traced mask's recovery as a TPU runs it (`dense.fused_recovery`), from this CPU

  topo = topologies.get_topology_desc(
    platform="tpu", topology_name=TOPOLOGIES[chip], chip_config_name="default", chips_per_host_bounds=(1, 1, 1),
    num_slices=1,
  )  # fmt: skip
  pallas_tpu.on_tpu = lambda: True
  return topo.devices[0]


def compile_step(way: str, c, T: int, args, device) -> dict:
  """XLA's figures for one AdamW train step of `way` at T tokens, compiled for `device`'s chip."""
  tokens, positions = rm.train_inputs(c, args.batch, T)
  model = rm.build(way, c, T, tokens, positions, interpret=False)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
  graph, state = nnx.split((model, optimizer))

  def step(state, tokens, positions):
    model, optimizer = nnx.merge(graph, state)

    def loss_fn(model):
      return rm.loss(model, tokens, positions, args.remat, args.remat_policy, args.loss_chunk)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss, nnx.state((model, optimizer))

  sharding = jax.sharding.SingleDeviceSharding(device)
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), (state, tokens, positions))
  t0 = time.perf_counter()
  lowered = jax.jit(step, donate_argnums=0).trace(*shapes).lower()
  t1 = time.perf_counter()
  try:
    memory = lowered.compile().memory_analysis()
  except Exception as e:  # noqa: BLE001 (XLA's out-of-memory verdict is a result)
    return dict(fits=False, error=_first_line(e), compile_s=time.perf_counter() - t1, lower_s=t1 - t0)
  gib = lambda n: n / 2**30  # noqa: E731
  return dict(
    fits=True,
    temp=gib(memory.temp_size_in_bytes),
    args=gib(memory.argument_size_in_bytes),
    code=memory.generated_code_size_in_bytes / 2**20,
    compile_s=time.perf_counter() - t1,
    lower_s=t1 - t0,
  )


def _first_line(e: Exception) -> str:
  text = str(e).strip()
  found = re.search(r"HLO temporaries \(([^)]*)\) exceeds available HBM \(([^)]*)\)", text)
  if found:
    return f"out of memory: {found.group(1)} of temporaries, {found.group(2)} of HBM"
  return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:160]


def memory_table(report, c, args, device) -> None:
  rows = []
  for T in args.seq_lens:
    for way in args.ways:
      r = compile_step(way, c, T, args, device)
      rows.append([T, way, r.get("temp"), r.get("args"), r.get("code"), r["compile_s"], r.get("error", "")])
      report.progress(f"compile T={T} {way}: {rows[-1][2:]}")
  report.table(
    f"{c.name} train step compiled for a {args.chip} on this host (no chip), batch {args.batch}, AdamW, bf16"
    + (f", remat per block (policy: {args.remat_policy})" if args.remat else ""),
    ["T", "attention", "temporaries GiB", "arguments GiB", "code MiB", "compile s", "XLA's verdict"],
    rows,
    formats={"temporaries GiB": ".2f", "arguments GiB": ".2f", "code MiB": ".1f", "compile s": ".1f"},
    notes=[
      "compiled.memory_analysis() of the donated train step (`jax.experimental.topologies`, libtpu, no chip attached);",
      "the verdict is XLA's own when the step does not fit the chip's HBM.  compile s: on this host, Mosaic included.",
    ],
  )


def longest_table(report, c, args, device) -> None:
  rows = []
  for way in args.ways:
    T, best, failed = args.longest_from, None, ""
    fits = {}

    def try_length(T, way=way, fits=fits):
      r = compile_step(way, c, T, args, device)
      report.progress(f"longest {way}: T={T} {'fits' if r['fits'] else r['error']}")
      fits[T] = r
      return r["fits"]

    while T <= args.longest_cap and try_length(T):
      best, T = T, T * 2
    first_out = T if T <= args.longest_cap else None
    # Between the last length that fit and the first that did not, halve the gap down to --longest-step tokens.
    lo, hi = best, first_out
    while lo is not None and hi is not None and hi - lo > args.longest_step:
      mid = (lo + hi) // 2 // args.longest_step * args.longest_step
      if mid in (lo, hi):
        break
      lo, hi = (mid, hi) if try_length(mid) else (lo, mid)
    best = lo
    failed = f"T={hi}: {fits[hi]['error']}" if hi is not None else f"none up to {args.longest_cap}"
    rows.append([way, best, failed])
  report.table(
    f"Longest sequence whose train step fits a {args.chip}, {c.name}, batch {args.batch}"
    + (f", remat per block (policy: {args.remat_policy})" if args.remat else ""),
    ["attention", "longest T", "first that does not fit"],
    rows,
    notes=[
      f"T doubling from {args.longest_from} up to {args.longest_cap}, then halving the gap to {args.longest_step} "
      "tokens; XLA's compile-time verdict for the chip, not a run.",
    ],
  )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--model", default="qwen", choices=sorted(rm.MODELS))
  p.add_argument("--chip", default="v5e", choices=sorted(TOPOLOGIES))
  p.add_argument("--tables", default="memory", help="of memory,longest")
  p.add_argument("--ways", default="library,splash", help="of library,splash,xla")
  p.add_argument("--seq-lens", default="8192,32768", help="memory: tokens per sequence")
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--layers", type=int, help="the model cut to its first N blocks")
  p.add_argument("--remat", action="store_true", help="recompute each block in the backward")
  p.add_argument("--remat-policy", default="none", choices=sorted(rm.REMAT_POLICIES))
  p.add_argument("--loss-chunk", type=int, default=0, help="real_models.py's --loss-chunk")
  p.add_argument("--longest-from", type=int, default=8192)
  p.add_argument("--longest-cap", type=int, default=131072)
  p.add_argument("--longest-step", type=int, default=4096, help="longest: the resolution of the search, in tokens")
  bench.add_report_args(p)
  args = p.parse_args(argv)
  args.tables = args.tables.split(",")
  args.ways = args.ways.split(",")
  args.seq_lens = [int(x) for x in args.seq_lens.split(",")]
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  try:
    device = tpu_device(args.chip)
  except Exception as e:  # noqa: BLE001
    print(f"tpu_compile: no TPU compiler here ({_first_line(e)}); pip install 'libtpu==0.0.42.*'", file=sys.stderr)
    return 2
  c = rm.MODELS[args.model]
  if args.layers:
    c = dataclasses.replace(c, layers=args.layers)
  report = bench.Report(f"tpu_compile: {c.name} compiled for a {args.chip}", json=args.json)
  if "memory" in args.tables:
    memory_table(report, c, args, device)
  if "longest" in args.tables:
    longest_table(report, c, args, device)
  return report.finish(enforce_targets=False)


if __name__ == "__main__":
  sys.exit(main())

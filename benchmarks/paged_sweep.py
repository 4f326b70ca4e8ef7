"""The paged kernel alone over head layouts, batches and its own knobs: a quick sweep for kernel work.

`tpu_kernels.py --tables paged` is the comparison with JAX's `ragged_paged_attention` at its best (its block
sizes swept, ours checked against 4-D pages as well); a row there compiles several programs.  This script compiles
one program per row: `paged_attention(..., implementation="pallas_tpu")` in one `jax.jit`, on kv pages `[P, 2,
page, K * H]` (`ServingEngine`'s layout), a batch of decodes, bf16.  Each row is first checked against
`implementation="xla"` on the same pages (exit 1 on a mismatch), then timed two ways:

- wall ms: a call's time, the median of `--repeats` interleaved rounds (`benchmarking.time_interleaved`, with
  `--peer` beside JAX's kernel) of 10 calls back to back, the wrapper's XLA ops and the host's dispatch inside;
- device ms: on a TPU, the device time of the call's program and of the kernel alone, summed from a
  `jax.profiler` trace of 10 calls (`benchmarking.device_time`).  Where wall ms is well above device ms the
  call is bound by its dispatch, and a kernel change shows only in device ms.

`--peer` also times JAX's kernel (TPU only; head dims that are whole lanes) on its combined cache `[P, page, 2K,
H]`, built outside the timed call, at its own tuned blocks, to place a row; `tpu_kernels.py` gives the ratio
against it at its best.  % HBM: the K and V bytes of every sequence's kv_len over the chip's bandwidth, against
the kernel's device time (wall time off a TPU).

Run it (repository root)::

  PYTHONPATH=. python benchmarks/paged_sweep.py --rows 14/2/64/64/2064 32/8/64/64/2064 8/1/128/16/4096 --peer
  PYTHONPATH=. python benchmarks/paged_sweep.py --rows 14/2/64/64/2064/16/1024 --fwd-slots 2 3 --contiguous
  python benchmarks/paged_sweep.py --rows 8/2/64/16/40/3                  # on CPU: interpret mode, a smoke run

A row is N/K/H/page/kv_len[/seqs[/block_q/block_kv]] (seqs 64 by default; blocks: the planner's).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import sys
import tempfile
from collections.abc import Sequence

import jax
import jax.numpy as jnp

try:
  import flax_ringattn  # noqa: F401 -- installed, or this checkout (below)
except ImportError:  # pragma: no cover
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import flax_ringattn as fr
from flax_ringattn import benchmarking as bench
from flax_ringattn.benchmarking import median, time_interleaved

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import tpu_kernels as tk  # noqa: E402  (the decode batches and page tables of the kernel benchmark)

EXIT_WRONG_RESULT = 1
TOLERANCE = 2e-2  # bf16: max |pallas - xla| <= TOLERANCE * max(1, max |xla|)
CALLS = 10


@dataclasses.dataclass(frozen=True)
class Row:
  N: int
  K: int
  H: int
  page: int
  kv_len: int
  seqs: int = 64
  block_q: int | None = None
  block_kv: int | None = None

  @property
  def name(self) -> str:
    blocks = f", {self.block_q} x {self.block_kv}" if self.block_q else ""
    return f"{self.N}/{self.K}/{self.H}, page {self.page}, {self.seqs} x {self.kv_len}{blocks}"


def parse_row(text: str) -> Row:
  parts = [int(x) for x in text.split("/")]
  if len(parts) not in (5, 6, 8):
    raise argparse.ArgumentTypeError(f"a row is N/K/H/page/kv_len[/seqs[/block_q/block_kv]], got {text!r}")
  row = Row(*parts)
  if row.N % row.K:
    raise argparse.ArgumentTypeError(f"{text!r}: N={row.N} is not a multiple of K={row.K}")
  return row


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--rows", nargs="+", type=parse_row, required=True, metavar="N/K/H/PAGE/KV[/SEQS[/BQ/BKV]]")
  p.add_argument("--contiguous", action="store_true", help="each sequence's pages one run (a fresh engine's)")
  p.add_argument("--fwd-slots", nargs="+", type=int, default=[None], metavar="N",
                 help="the forward's kv slots (tiling.PAGED_FWD_SLOTS), a row per value")  # fmt: skip
  p.add_argument("--peer", action="store_true", help="also time JAX's ragged_paged_attention (TPU only)")
  p.add_argument("--repeats", type=int, default=20)
  p.add_argument("--seed", type=int, default=0)
  return p.parse_args(argv)


def device_ms(fn, args) -> tuple[float, float] | None:
  """(program ms, paged kernel ms) a call, from a profile of CALLS calls; None off a TPU."""
  if jax.default_backend() != "tpu":
    return None
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    for _ in range(CALLS):
      out = fn(*args)
    jax.block_until_ready(out)
    jax.profiler.stop_trace()
    t = bench.device_time(trace_dir)
  kernel = sum(us for name, us in t.ops.items() if name.startswith("paged"))
  return t.program_us / CALLS / 1e3, kernel / CALLS / 1e3


def sweep_row(row: Row, slots: int | None, args, interpret) -> dict:
  from flax_ringattn._src.backends.pallas_tpu import tiling

  default_slots = tiling.PAGED_FWD_SLOTS
  if slots is not None:
    tiling.PAGED_FWD_SLOTS = slots  # read when the kernel is traced: this row's jit traces inside
    jax.clear_caches()  # jax.jit keeps the trace of an equal partial: another slot count would reuse it
  try:
    step = tk.decode(row.seqs, row.kv_len)
    x = tk.paged_inputs(step, row.N, row.K, row.H, row.page, args.seed, contiguous=args.contiguous)
    merged = tuple(a.reshape(*a.shape[:2], row.K * row.H) for a in (x.k, x.v))
    kv_pages = jnp.stack(merged, axis=1)  # [P, 2, page, K * H]
    blocks = fr.BlockSizes(block_q=row.block_q, block_kv=row.block_kv) if row.block_q else None
    scale = row.H**-0.5
    ours = jax.jit(functools.partial(fr.paged_attention, scale=scale, implementation="pallas_tpu",
                                     block_sizes=blocks, interpret=interpret))  # fmt: skip
    xla = jax.jit(functools.partial(fr.paged_attention, scale=scale, implementation="xla"))
    got = ours(x.q, kv_pages, None, *x.meta).astype(jnp.float32)
    want = xla(x.q, *merged, *x.meta).astype(jnp.float32)
    err = float(jnp.max(jnp.abs(got - want)))
    if not err <= TOLERANCE * max(1.0, float(jnp.max(jnp.abs(want)))):
      print(f"WRONG RESULT: {row.name}: max |pallas - xla| = {err:.3e}", flush=True)
      raise SystemExit(EXIT_WRONG_RESULT)
    call = (x.q, kv_pages, None, *x.meta)
    calls = {"ours": functools.partial(ours, *call)}
    if args.peer and jax.default_backend() == "tpu" and row.H % 128 == 0:
      from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

      rpa = jax.jit(functools.partial(ragged_paged_attention, sm_scale=scale, vmem_limit_bytes=64 << 20))
      calls["jax"] = functools.partial(rpa, x.q, tk.combined_cache(x.k, x.v), *x.meta)
    # Interleaved rounds of CALLS calls back to back, one wait a round (`benchmarking.time_interleaved`).
    times = time_interleaved(calls, args.repeats, warmup=1, calls_per_round=CALLS)
    wall = {name: median(t) * 1e3 for name, t in times.items()}
    out = dict(row=row.name, slots=tiling.PAGED_FWD_SLOTS, err=err, wall=wall["ours"], jax=wall.get("jax"))
    dev = device_ms(ours, call)
    out["program"], out["kernel"] = dev if dev else (None, None)
    kv_bytes = sum(step.kv_lens) * row.K * row.H * 2 * 2
    out["hbm"] = kv_bytes / ((out["kernel"] or out["wall"]) * 1e-3) / tk.V5E.memory_bandwidth * 100
    return out
  finally:
    tiling.PAGED_FWD_SLOTS = default_slots


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  interpret = True if jax.default_backend() != "tpu" else None
  print(f"# paged_sweep: {bench.machine()}", flush=True)
  if interpret:
    print("Pallas TPU interpret mode off a TPU: the rows are checked, their times mean nothing.", flush=True)
  results = []
  for row in args.rows:
    for slots in args.fwd_slots:
      r = sweep_row(row, slots, args, interpret)
      results.append(r)
      kernel = "" if r["kernel"] is None else f", kernel {r['kernel']:.3f} ms of device time"
      print(f"{r['row']}, {r['slots']} slots: wall {r['wall']:.3f} ms{kernel}", flush=True)
  header = ["row", "slots", "max err", "wall ms", "device ms", "kernel ms", "% HBM", "jax wall ms", "jax / ours"]
  table = [
    [r["row"], r["slots"], r["err"], r["wall"], r["program"], r["kernel"], r["hbm"], r["jax"],
     r["jax"] / r["wall"] if r["jax"] else None]
    for r in results
  ]  # fmt: skip
  formats = {"max err": ".1e", "wall ms": ".3f", "device ms": ".3f", "kernel ms": ".3f", "% HBM": ".1f",
             "jax wall ms": ".3f", "jax / ours": ".2f"}  # fmt: skip
  print(bench.markdown_table(header, table, formats))
  print("\nwall: median of rounds of 10 calls back to back; device, kernel: from a jax.profiler trace of 10 calls; "
        "% HBM: K and V bytes over the kernel's device time (wall off a TPU); jax / ours: wall against wall.")  # fmt: skip
  return 0


if __name__ == "__main__":
  sys.exit(main())

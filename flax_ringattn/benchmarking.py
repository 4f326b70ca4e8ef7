"""What the scripts in `benchmarks/` share, for your own benchmarks too (imported on demand).

* timing: `time_interleaved(calls, repeats, *, warmup, on_error,
  calls_per_round)` runs the candidates in interleaved rounds (A B, B A, ...),
  each call `block_until_ready`'d (or `calls_per_round` calls, then one wait); `paired_ratio(slow, fast)` gives the median of the
  per-round ratios (`Paired.ratio`) and the rounds the faster one lost;
  `measure_matmul_flops` the rate of one device; `machine()` a line on the
  host, JAX and its devices; `count_compiles(fn, calls)` the traces of a jitted
  step over changing arguments, and its median time.
* checks before timing: `compare(name, got, want, *, tol, metric)` makes a
  `Check`; `Report.require(checks)` exits with `EXIT_WRONG_RESULT` (1) before
  anything is timed when one fails.
* reports: `Report(title, *, json)`: tables, notes and targets as Markdown, or
  one JSON document (`add_report_args(parser)` adds `--json`);
  `Report.finish()` returns the exit status (0 ok, 1 wrong result, 3 a target
  missed).
* start-up: `use_compilation_cache(directory)` turns JAX's persistent
  compilation cache on (a second start reads compiled programs back) and
  counts its hits and misses; `add_compilation_cache_args(parser)` /
  `compilation_cache_from_args(args)` give a script `--compilation-cache DIR`
  and `--no-compilation-cache`.  It changes JAX's global configuration, so
  only scripts call it; the library never does.
* problem shapes: `Problem` (B, T, S, N, K, H, dtype, mask; `flops()`,
  `bytes()`, `inputs()`), `fwd_bwd(attention)`, and `PROBLEM_SETS`, the named
  shapes of each benchmark, which tests can run too.
* models: `hardware` (the chip table: `chip("tpu_v5e")`, `CHIPS`), `cost`
  (FLOPs, bytes, a ring hop's compute against its transfer), and
  `collective_volume` / `compiled_stats` (bytes sent and memory of a compiled
  program); `device_time(trace_dir)` the device time per program and per op
  of a `jax.profiler` trace (`create_perfetto_trace=True`), without
  TensorBoard.
"""

from flax_ringattn._src.perf import cost, hardware
from flax_ringattn._src.perf.harness import (
  EXIT_OK,
  EXIT_TARGET_MISSED,
  EXIT_USAGE,
  EXIT_WRONG_RESULT,
  Check,
  CompilationCache,
  Paired,
  Report,
  add_compilation_cache_args,
  add_report_args,
  compare,
  compilation_cache_from_args,
  count_compiles,
  error,
  machine,
  markdown_table,
  measure_matmul_flops,
  median,
  paired_ratio,
  time_interleaved,
  use_compilation_cache,
)
from flax_ringattn._src.perf.hlo import CommVolume, CompiledStats, collective_volume, compiled_stats
from flax_ringattn._src.perf.problems import PROBLEM_SETS, Problem, fwd_bwd
from flax_ringattn._src.perf.trace import DeviceTime, device_time

__all__ = [
  "EXIT_OK",
  "EXIT_TARGET_MISSED",
  "EXIT_USAGE",
  "EXIT_WRONG_RESULT",
  "PROBLEM_SETS",
  "Check",
  "CommVolume",
  "CompilationCache",
  "CompiledStats",
  "DeviceTime",
  "Paired",
  "Problem",
  "Report",
  "add_compilation_cache_args",
  "add_report_args",
  "collective_volume",
  "compare",
  "compilation_cache_from_args",
  "compiled_stats",
  "cost",
  "count_compiles",
  "device_time",
  "error",
  "fwd_bwd",
  "hardware",
  "machine",
  "markdown_table",
  "measure_matmul_flops",
  "median",
  "paired_ratio",
  "time_interleaved",
  "use_compilation_cache",
]

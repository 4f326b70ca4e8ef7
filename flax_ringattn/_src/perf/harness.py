"""The benchmark harness every script in `benchmarks/` runs on.

A script (1) checks every candidate's results against a reference and exits
with `EXIT_WRONG_RESULT` before timing anything if one is off, (2) times the
candidates interleaved, (3) reports paired ratios, and (4) prints a Markdown
report, or with `--json` one JSON document, and exits with a status that says
what happened:

* `time_interleaved`: every round runs each candidate once (A B C, then B C A,
  ...) after untimed warm-up rounds, each call `jax.block_until_ready`'d, so a
  change of machine load hits every candidate alike and round r of A can be
  paired with round r of B (`calls_per_round`: several calls per turn, one
  wait, for device time without the host round trip).
* `paired_ratio`: the median of the per-round ratios, and the rounds the
  faster one lost; steadier than a ratio of medians on a shared machine.
* `compare` / `Report.require`: the check before timing.
* `Report`: sections (tables, notes, checks, targets) printed as Markdown as
  they come, or gathered into one JSON document at the end; `Report.finish`
  returns the exit status: `EXIT_OK` (0), `EXIT_WRONG_RESULT` (1),
  `EXIT_TARGET_MISSED` (3; 2 is argparse's usage error).
"""

from __future__ import annotations

import dataclasses
import json as _json
import math
import pathlib
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

EXIT_OK = 0
EXIT_WRONG_RESULT = 1
EXIT_USAGE = 2
EXIT_TARGET_MISSED = 3


# ------------------------------------------------------------------------------------------
# Timing.


def time_interleaved(
  calls: Mapping[str, Callable[[], object]],
  repeats: int,
  *,
  warmup: int = 1,
  on_error: Callable[[str, Exception], None] | None = None,
  calls_per_round: int = 1,
) -> dict[str, list[float]]:
  """Seconds per call of each candidate, `repeats` interleaved rounds after `warmup` untimed ones.

  Round r runs the candidates in the order rotated by r.  A candidate that raises is passed to `on_error`
  and dropped from the rounds after (its list keeps the times it has); without `on_error` the error propagates.

  `calls_per_round` > 1: a candidate's turn dispatches that many calls back to back and waits for the last one
  only, and its time is the total over the count.  One device runs its calls in order, so this is about the
  device's time per call, with one host round trip (dispatch, then the wait for the result) spread over the
  turn instead of one in each call: on a remote or busy host that round trip can be a large part of a short
  kernel's time.  Where dispatching a call takes longer than running it, it measures the dispatch.  The calls
  must not depend on each other's results (each is the same jitted call).
  """
  if calls_per_round < 1:
    raise ValueError(f"time_interleaved: calls_per_round must be >= 1, got {calls_per_round}")
  import jax

  names = list(calls)
  times: dict[str, list[float]] = {name: [] for name in names}
  live = list(names)
  for r in range(warmup + repeats):
    order = live[r % len(live) :] + live[: r % len(live)] if live else []
    for name in order:
      try:
        t0 = time.perf_counter()
        out = None
        for _ in range(calls_per_round):
          out = calls[name]()  # the earlier results are dropped: only the last one is waited for
        jax.block_until_ready(out)
        dt = (time.perf_counter() - t0) / calls_per_round
      except Exception as e:
        if on_error is None:
          raise
        on_error(name, e)
        live.remove(name)
        continue
      if r >= warmup:
        times[name].append(dt)
  return times


def count_compiles(fn: Callable, calls: Sequence[tuple]) -> tuple[int, float | None]:
  """(traces of `jax.jit(fn)` over the argument tuples `calls`, run in order, and the median seconds of every
  call after the first, which compiles): the compile count of a step whose shapes never change (1 is right)."""
  import jax

  traces = 0

  def counted(*args):
    nonlocal traces
    traces += 1  # runs once per trace, not per call
    return fn(*args)

  jitted, args = jax.jit(counted), iter(calls)
  times = time_interleaved({"step": lambda: jitted(*next(args))}, len(calls) - 1)["step"]
  return traces, median(times)


def median(xs: Sequence[float]) -> float | None:
  return statistics.median(xs) if len(xs) else None


@dataclasses.dataclass(frozen=True)
class Paired:
  """`slow` over `fast`, round by round: `ratio` is the median of the per-round ratios (> 1: `fast` is faster)."""

  ratios: tuple[float, ...]

  @property
  def ratio(self) -> float:
    return statistics.median(self.ratios) if self.ratios else math.nan

  @property
  def losses(self) -> int:
    """Rounds in which `fast` was the slower one."""
    return sum(r < 1.0 for r in self.ratios)


def paired_ratio(slow: Sequence[float], fast: Sequence[float]) -> Paired:
  """Per-round ratios slow[r] / fast[r] of two candidates timed in the same rounds of `time_interleaved`."""
  if len(slow) != len(fast):
    raise ValueError(f"paired_ratio needs the same rounds, got {len(slow)=} and {len(fast)=}")
  return Paired(tuple(s / f for s, f in zip(slow, fast, strict=True)))


def measure_matmul_flops(n: int = 2048, *, repeats: int = 10, dtype="float32", device=None) -> float:
  """Median flop/s of a jitted n^3 matmul on one device (the rate the CPU benchmarks compare against)."""
  import jax
  import jax.numpy as jnp

  device = device or jax.devices()[0]
  a, b = (jax.device_put(jax.random.normal(jax.random.key(i), (n, n), dtype), device) for i in (1, 2))
  matmul = jax.jit(jnp.matmul)
  t = time_interleaved({"matmul": lambda: matmul(a, b)}, repeats)["matmul"]
  return 2 * n**3 / statistics.median(t)


def machine() -> str:
  """One line on what ran the benchmark: JAX, its backend and devices, the host's cores and load."""
  import os

  import jax

  try:
    usable = len(os.sched_getaffinity(0))
  except AttributeError:
    usable = os.cpu_count()
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  return (
    f"jax {jax.__version__} ({jax.default_backend()}, {jax.device_count()} x {jax.devices()[0].device_kind}), "
    f"flax_ringattn {getattr(sys.modules.get('flax_ringattn'), '__version__', '?')}, {os.cpu_count()} cores "
    f"({usable} usable), load average {load}"
  )


# ------------------------------------------------------------------------------------------
# Checks before timing.

METRICS = {
  "abs": "max |a - b|",
  "rel_max": "max |a - b| / max |b|",
  "rel_elementwise": "max |a - b| / (1 + |b|)",
}


@dataclasses.dataclass(frozen=True)
class Check:
  """One candidate's result against the reference: `error` in `metric` must be finite and at most `tol`."""

  name: str
  error: float
  tol: float
  metric: str = "abs"

  @property
  def ok(self) -> bool:
    return math.isfinite(self.error) and self.error <= self.tol

  def line(self) -> str:
    return (
      f"{'ok' if self.ok else 'FAILED'}: {self.name}: {METRICS[self.metric]} = {self.error:.2e} (tol {self.tol:.0e})"
    )


def error(got, want, *, metric: str = "abs") -> float:
  """The largest error over the leaves of two matching pytrees of arrays, compared in f32 (inf if `got` is not
  finite)."""
  import jax

  if metric not in METRICS:
    raise ValueError(f"metric must be one of {tuple(METRICS)}, got {metric!r}")
  worst = 0.0
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    if a.shape != b.shape:
      raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    if not np.isfinite(a).all():
      return math.inf
    diff = np.abs(a - b)
    if metric == "abs":
      e = diff.max(initial=0.0)
    elif metric == "rel_max":
      e = diff.max(initial=0.0) / max(float(np.abs(b).max(initial=0.0)), 1e-6)
    else:
      e = (diff / (1 + np.abs(b))).max(initial=0.0)
    worst = max(worst, float(e))
  return worst


def compare(name: str, got, want, *, tol: float, metric: str = "abs") -> Check:
  return Check(name, error(got, want, metric=metric), tol, metric)


# ------------------------------------------------------------------------------------------
# The report.


DEFAULT_COMPILATION_CACHE = "~/.cache/flax_ringattn/jax-compilation-cache"


class CompilationCache:
  """JAX's persistent compilation cache turned on for this process (`use_compilation_cache`), with counts of its
  hits and misses since then: a second start of the same program reads its compiled executables back instead of
  compiling them again.  JAX keys an entry on the program, its shapes, the flags and the backend, so a changed
  shape or flag compiles anew."""

  def __init__(self, directory):
    import jax

    self.directory = str(pathlib.Path(directory).expanduser())
    jax.config.update("jax_compilation_cache_dir", self.directory)
    # Cache every executable: the defaults skip programs that compile in under a second, most of a small run.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    self.requests = self.hits = self.written = 0
    self.compile_seconds = 0.0
    jax.monitoring.register_event_listener(self._event)
    jax.monitoring.register_event_duration_secs_listener(self._duration)

  def _event(self, name: str, **_) -> None:
    # JAX records a "miss" only where it writes the entry: a program it compiles but may not cache (one with a host
    # callback, say) shows only as a request that did not hit.
    if name == "/jax/compilation_cache/compile_requests_use_cache":
      self.requests += 1
    elif name == "/jax/compilation_cache/cache_hits":
      self.hits += 1
    elif name == "/jax/compilation_cache/cache_misses":
      self.written += 1

  def _duration(self, name: str, seconds: float, **_) -> None:
    # XLA's compile step of every jitted program, a read back from the cache included: what a second start saves.
    if name == "/jax/core/compile/backend_compile_duration":
      self.compile_seconds += seconds

  @property
  def misses(self) -> int:
    """Programs compiled in this process (not read back), whether or not JAX then wrote them to the cache."""
    return self.requests - self.hits

  def summary(self) -> str:
    unwritten = self.misses - self.written
    note = f" ({unwritten} not written: a host callback in the program, or not process 0)" if unwritten > 0 else ""
    return (
      f"compilation cache {self.directory}: {self.hits} hits, {self.misses} compiled{note}; "
      f"{self.compile_seconds:.1f} s in XLA compiles and cache reads"
    )


def use_compilation_cache(directory=DEFAULT_COMPILATION_CACHE) -> CompilationCache:
  """Turns JAX's persistent compilation cache on in `directory`, for the rest of the process.  This changes JAX's
  global configuration: scripts call it at their start (the library itself never does).  The same as
  `jax.config.update("jax_compilation_cache_dir", directory)` plus caching every executable, however fast it
  compiled."""
  return CompilationCache(directory)


def add_compilation_cache_args(parser) -> None:
  """--compilation-cache DIR and --no-compilation-cache, for `compilation_cache_from_args`."""
  parser.add_argument(
    "--compilation-cache",
    default=DEFAULT_COMPILATION_CACHE,
    metavar="DIR",
    help="JAX's persistent compilation cache: a second start reads compiled programs back (default: %(default)s)",
  )
  parser.add_argument("--no-compilation-cache", action="store_true", help="compile everything anew, cache nothing")


def compilation_cache_from_args(args) -> CompilationCache | None:
  return None if args.no_compilation_cache else use_compilation_cache(args.compilation_cache)


def add_report_args(parser) -> None:
  """The flags every benchmark shares: --json."""
  parser.add_argument(
    "--json", action="store_true", help="print the report as one JSON document on stdout (progress on stderr)"
  )


def _cell(value, fmt: str | None) -> str:
  if value is None:
    return "-"
  if isinstance(value, bool):
    return "yes" if value else "no"
  if isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    if isinstance(value, (float, np.floating)) and not math.isfinite(value):
      return "n/a"
    if fmt:
      return format(value, fmt)
    if isinstance(value, (int, np.integer)):
      return str(value)
    size = abs(value)
    return format(
      value, ".0f" if size >= 1e4 else ".1f" if size >= 10 else ".3f" if size >= 0.01 or not size else ".3g"
    )
  return str(value)


def _json_value(value):
  if isinstance(value, (np.integer,)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    return float(value) if math.isfinite(value) else None
  if isinstance(value, (list, tuple)):
    return [_json_value(v) for v in value]
  if isinstance(value, dict):
    return {str(k): _json_value(v) for k, v in value.items()}
  return value


def markdown_table(header: Sequence[str], rows: Sequence[Sequence], formats: Mapping[str, str] | None = None) -> str:
  """A Markdown table, columns padded to their widest cell; `formats` maps a column to a format spec."""
  formats = formats or {}
  cells = [[_cell(v, formats.get(h)) for h, v in zip(header, row, strict=True)] for row in rows]
  widths = [max(len(c) for c in col) for col in zip(header, *cells, strict=True)]

  def line(row):
    return "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"

  return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, cells)])


class Report:
  """A benchmark's output: Markdown as it goes, or (json=True) one JSON document printed by `finish`.

  Sections keep their order.  Progress messages (`progress`) always go to stderr, so stdout stays one Markdown
  report or one JSON document.
  """

  def __init__(self, title: str, *, json: bool = False, meta: Mapping | None = None, stream=None):
    self.title, self.json, self.meta = title, json, dict(meta or {})
    self.stream = stream or sys.stdout
    self.sections: list[dict] = []
    self.checks: list[Check] = []
    self.targets: list[dict] = []
    self._targets_done = False
    self._markdown: list[str] = []
    self._emit(f"# {title}\n" + "".join(f"\n- {k}: {v}" for k, v in self.meta.items()))

  def _emit(self, text: str) -> None:
    self._markdown.append(text)
    if not self.json:
      print(text, file=self.stream, flush=True)

  def markdown(self) -> str:
    """Everything the Markdown report holds so far (also kept with json=True, e.g. for a results file)."""
    return "\n".join(self._markdown) + "\n"

  def progress(self, text: str) -> None:
    print(text, file=sys.stderr, flush=True)

  def note(self, text: str) -> None:
    self.sections.append({"note": text})
    self._emit(text)

  def table(self, title: str, header: Sequence[str], rows: Sequence[Sequence], *, formats=None, notes=()) -> None:
    """A table: rows of raw values (numbers stay numbers in JSON; `formats` applies to the Markdown only)."""
    header = list(header)
    self.sections.append(
      {
        "table": title,
        "columns": header,
        "rows": [dict(zip(header, map(_json_value, r), strict=True)) for r in rows],
        "notes": list(notes),
      }
    )
    self._emit((f"\n## {title}\n\n" if title else "\n") + markdown_table(header, rows, formats))
    if notes:
      self._emit("\n" + "\n".join(notes))

  def require(self, checks: Sequence[Check]) -> None:
    """The check before timing: report every check; if one failed, print the report and exit with
    `EXIT_WRONG_RESULT` (nothing is timed)."""
    self.checks.extend(checks)
    self._emit("\n" + "\n".join(c.line() for c in checks))
    if not all(c.ok for c in checks):
      self._emit("\nWRONG RESULT: nothing timed.")
      sys.exit(self.finish())

  def target(self, name: str, value, target: str, met: bool | None) -> None:
    """A project target: `met` None when not measured (not a miss)."""
    self.targets.append({"target": name, "value": _json_value(value), "goal": target, "met": met})

  @property
  def missed(self) -> list[str]:
    return [t["target"] for t in self.targets if t["met"] is False]

  def finish(self, *, enforce_targets: bool = True) -> int:
    """Print the targets (Markdown) or the whole JSON document; return the exit status."""
    if any(not c.ok for c in self.checks):
      code = EXIT_WRONG_RESULT
    elif self.missed and enforce_targets:
      code = EXIT_TARGET_MISSED
    else:
      code = EXIT_OK
    if self.targets and not self._targets_done:
      self._targets_done = True
      status = {None: "-", True: "met", False: "**missed**"}
      rows = [[t["target"], _cell(t["value"], None), t["goal"], status[t["met"]]] for t in self.targets]
      self._emit("\n## targets\n\n" + markdown_table(("target", "value", "goal", "status"), rows))
    if self.json:
      doc = {
        "title": self.title,
        "meta": _json_value(self.meta),
        "checks": [dataclasses.asdict(c) | {"ok": c.ok} for c in self.checks],
        "sections": self.sections,
        "targets": self.targets,
        "exit_code": code,
      }
      print(_json.dumps(_json_value(doc), indent=1), file=self.stream, flush=True)
    elif code == EXIT_TARGET_MISSED:
      self._emit(f"\ntargets missed: {'; '.join(self.missed)}")
    return code

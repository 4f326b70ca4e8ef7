"""Device time per program and per op, read off a `jax.profiler` trace.

`jax.profiler.start_trace(directory, create_perfetto_trace=True)` ... `stop_trace()` leaves a Perfetto trace
(`perfetto_trace.json.gz`) beside its XPlane files.  On a TPU (or GPU) its device processes (`/device:TPU:0`, ...)
hold one thread of the programs that ran ("XLA Modules") and one of their ops ("XLA Ops"); `device_time` sums
their durations by name, so a benchmark can say where a step's device time went without TensorBoard.  A CPU
backend's trace has no device process: the result is then empty.
"""

from __future__ import annotations

import collections
import dataclasses
import gzip
import json
import pathlib


@dataclasses.dataclass(frozen=True)
class DeviceTime:
  """Microseconds summed by name over a trace: `programs` (jitted programs), `ops` (their ops), and how many
  times each op ran (`op_counts`).  Empty on a backend whose trace has no device process."""

  programs: dict
  ops: dict
  op_counts: dict

  def top(self, n: int) -> list[tuple[str, float, int]]:
    """The n ops of most device time: (name, microseconds, runs)."""
    ranked = sorted(self.ops.items(), key=lambda kv: -kv[1])[:n]
    return [(name, us, self.op_counts[name]) for name, us in ranked]

  @property
  def program_us(self) -> float:
    return sum(self.programs.values())


def device_time(trace_dir) -> DeviceTime:
  """Sums the device events of the newest Perfetto trace under `trace_dir` (see the module docstring)."""
  found = sorted(
    pathlib.Path(trace_dir).expanduser().glob("**/perfetto_trace.json.gz"), key=lambda p: p.stat().st_mtime
  )
  if not found:
    raise FileNotFoundError(
      f"no perfetto_trace.json.gz under {trace_dir}: trace with jax.profiler.start_trace(dir, "
      "create_perfetto_trace=True)"
    )
  with gzip.open(found[-1], "rt") as f:
    doc = json.load(f)
  events = doc["traceEvents"] if isinstance(doc, dict) else doc
  meta = [e for e in events if e.get("ph") == "M"]
  devices = {e["pid"] for e in meta if e.get("name") == "process_name" and e["args"]["name"].startswith("/device:")}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in meta if e.get("name") == "thread_name"}
  programs, ops, counts = collections.defaultdict(float), collections.defaultdict(float), collections.Counter()
  for e in events:
    if e.get("ph") != "X" or e.get("pid") not in devices:
      continue
    thread = threads.get((e["pid"], e.get("tid")), "")
    if thread == "XLA Modules":
      programs[e["name"]] += float(e.get("dur", 0))
    elif thread == "XLA Ops":
      ops[e["name"]] += float(e.get("dur", 0))
      counts[e["name"]] += 1
  return DeviceTime(dict(programs), dict(ops), dict(counts))

"""The scripts of benchmarks/ as modules, for the tests that run them (test_benchmarks.py, test_cp_benchmark.py).

Each script is loaded once per process and shared (tests patch its attributes with `monkeypatch`, which restores
them).  A helper module, not a test module: pytest collects nothing from it.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@functools.cache
def load(name: str):
  """benchmarks/<name>.py, imported as the module `_bench_<name>`."""
  spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


def never(*args, **kwargs):
  """Patched over a script's timing: a script must not time anything once its reference check failed."""
  raise AssertionError("timed although the reference check failed")

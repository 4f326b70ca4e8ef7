"""CPU harness for Pallas TPU kernels run in interpret mode (tests only).

`pl.pallas_call(..., interpret=pltpu.InterpretParams(...))` simulates VMEM, DMAs, semaphores and remote copies
on CPU devices.  Three helpers:

* `ensure_cpu_threads`: on a machine with few cores a multi-device interpret-mode kernel deadlocks.  XLA's CPU
  client sizes its thread pools from `sched_getaffinity`; each simulated device blocks one pool thread inside the
  interpreter's callbacks and the array copies inside those callbacks wait for a free one (8 devices need more
  than 8 threads; seen with operands >= 128 KiB on 2 cores).  This re-executes the process with a tiny
  LD_PRELOAD shim (`cpu_affinity_shim.c`) that makes `sched_getaffinity` report more CPUs, so the pools get
  more, mostly idle, threads.  `get_nprocs`/`sysconf` do not size the pools and are left alone.
* `interpret_params`: the default `pltpu.InterpretParams` for tests (race detection on).
* `no_races`: a context manager asserting that the race detector saw no data race.

This module imports only the standard library at import time so that `tests/conftest.py` can load it (by file
path) before JAX, and the package, are imported.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

FAKE_CPUS_ENV = "FLAX_RINGATTN_FAKE_CPUS"  # read by the shim: how many CPUs sched_getaffinity reports
SHIM_ENV = "FLAX_RINGATTN_CPU_SHIM"  # the .so path in the re-executed process (never re-exec twice); "0": off
REAL_CPUS_ENV = "FLAX_RINGATTN_REAL_CPUS"  # the CPU count the process saw before the shim
DEFAULT_MIN_CPUS = 32

_SHIM_SOURCE = Path(__file__).with_name("cpu_affinity_shim.c")


def visible_cpus() -> int:
  """CPUs this process may run on, as XLA sees them (the shim's fake count when it is loaded)."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


def real_cpus() -> int:
  """CPUs this process may really run on (before the shim), e.g. to size a pool of worker processes."""
  real = os.environ.get(REAL_CPUS_ENV, "")
  return int(real) if real.isdigit() and SHIM_ENV in os.environ else visible_cpus()


def ensure_cpu_threads(min_cpus: int = DEFAULT_MIN_CPUS) -> int:
  """Make XLA's CPU thread pools big enough for multi-device interpret-mode kernels.

  If the process sees fewer than `min_cpus` CPUs, builds the shim (cached) and re-executes the current process
  with it preloaded; otherwise returns at once.  Call it before JAX initialises its CPU backend (the re-exec
  restarts the process anyway, but everything done before it is wasted).  Without a C compiler, on a
  non-Linux system or in a pytest-xdist worker it warns and continues: multi-device kernels may then hang.
  `FLAX_RINGATTN_CPU_SHIM=0` in the environment turns it off.

  Returns the number of CPUs the process now sees.
  """
  have = visible_cpus()
  if have >= min_cpus:
    return have
  if os.environ.get(SHIM_ENV) == "0":  # opted out
    return have
  if SHIM_ENV in os.environ:
    _warn(f"the CPU affinity shim ({os.environ[SHIM_ENV]}) is marked as loaded but the process sees {have} CPUs")
    return have
  if not sys.platform.startswith("linux"):
    _warn(f"only {have} CPUs and the LD_PRELOAD shim is Linux-only")
    return have
  if "PYTEST_XDIST_WORKER" in os.environ:
    # A worker talks to the controller over inherited pipes: never replace it.  Workers normally inherit the
    # shim (or the "0" set below) from a controller that ran this first.
    _warn(f"pytest-xdist worker sees only {have} CPUs and was started without the CPU affinity shim")
    return have
  if not sys.executable or not getattr(sys, "orig_argv", None):
    _warn("cannot re-execute this interpreter (no sys.executable / sys.orig_argv)")
    return have
  try:
    shim = build_shim()
  except ShimBuildError as e:
    _warn(str(e))
    os.environ[SHIM_ENV] = "0"  # child processes (xdist workers) need not try again
    return have

  env = dict(os.environ)
  preload = env.get("LD_PRELOAD", "")
  env["LD_PRELOAD"] = f"{shim}:{preload}" if preload else str(shim)
  env[FAKE_CPUS_ENV] = str(min_cpus)
  env[SHIM_ENV] = str(shim)
  env[REAL_CPUS_ENV] = str(have)
  _stop_pytest_capture()
  sys.stdout.flush()
  sys.stderr.flush()
  os.execve(sys.executable, sys.orig_argv, env)
  raise AssertionError("unreachable")  # pragma: no cover


class ShimBuildError(RuntimeError):
  pass


def build_shim() -> Path:
  """Compiles `cpu_affinity_shim.c` once per source version; returns the path of the shared library.

  Cached under `$XDG_CACHE_HOME/flax_ringattn/` (default `~/.cache/flax_ringattn/`), keyed by a hash of the
  source; written to a temporary name and renamed, so concurrent builds never see a partial file.
  """
  source = _SHIM_SOURCE.read_bytes()
  key = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
  name = f"cpu_affinity_shim-{key}.so"
  errors = []
  for cache in _cache_dirs():
    target = cache / name
    if target.is_file():
      return target
    try:
      cache.mkdir(parents=True, exist_ok=True)
      fd, tmp = tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=cache)
      os.close(fd)
    except OSError as e:
      errors.append(f"{cache}: {e}")
      continue
    try:
      _compile(_SHIM_SOURCE, Path(tmp))
      os.replace(tmp, target)
      return target
    finally:
      if os.path.exists(tmp):
        os.unlink(tmp)
  raise ShimBuildError(
    f"no usable cache directory (writable, no space or colon in its path) for the CPU affinity shim: {errors}"
  )


def _cache_dirs() -> list[Path]:
  xdg = os.environ.get("XDG_CACHE_HOME")
  base = Path(xdg) if xdg else Path.home() / ".cache"
  dirs = [base / "flax_ringattn", Path(tempfile.gettempdir()) / f"flax_ringattn-{os.getuid()}"]
  return [d for d in dirs if not any(c in str(d) for c in " :")]  # LD_PRELOAD splits on spaces and colons


def _compilers() -> list[list[str]]:
  found = []
  if os.environ.get("CC"):
    cc = shlex.split(os.environ["CC"])
    if cc and shutil.which(cc[0]):
      found.append(cc)
  found += [[path] for name in ("cc", "gcc", "clang") if (path := shutil.which(name))]
  return found


def _compile(source: Path, out: Path) -> None:
  compilers = _compilers()
  if not compilers:
    raise ShimBuildError("no C compiler (cc, gcc or clang; or $CC) to build the CPU affinity shim")
  failures = []
  for cc in compilers:
    cmd = [*cc, "-shared", "-fPIC", "-O2", "-o", str(out), str(source), "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode == 0:
      return
    failures.append(f"$ {shlex.join(cmd)}\n{proc.stderr.strip()}")
  raise ShimBuildError("could not build the CPU affinity shim:\n" + "\n".join(failures))


def _warn(what: str) -> None:
  warnings.warn(
    f"flax_ringattn.ensure_cpu_threads: {what}.  Multi-device Pallas interpret-mode kernels may deadlock "
    "(XLA's CPU thread pool is sized from the visible CPU count); per-test timeouts will report it.",
    RuntimeWarning,
    stacklevel=3,
  )


def _stop_pytest_capture() -> None:
  """Give the real stdout/stderr back before exec when called while pytest captures (conftest import time).

  Otherwise the re-executed pytest would write into pytest's capture temp files.
  """
  capture = sys.modules.get("_pytest.capture")
  if capture is None:
    return
  for obj in gc.get_objects():
    if isinstance(obj, capture.CaptureManager):
      obj.stop_global_capturing()


def interpret_params(**overrides):
  """The default `pltpu.InterpretParams` for tests: race detection on; `overrides` replace any field."""
  from jax.experimental.pallas import tpu as pltpu

  return pltpu.InterpretParams(**{"detect_races": True, **overrides})


@contextlib.contextmanager
def no_races(*, expect_kernels: bool = True):
  """Resets interpret-mode state, runs the block, then asserts the race detector found no data race.

  Checks every interpret-mode kernel that ran inside the block (each `pallas_call` gets its own detector
  state; JAX keeps only the last one), after waiting for pending effects.  Kernels must run with
  `detect_races=True` (see `interpret_params`), else there is nothing to check.  With `expect_kernels`, it
  also fails when no interpret-mode kernel ran at all (e.g. a test that silently took a non-Pallas path).
  """
  import jax
  from jax.experimental.pallas import tpu as pltpu

  try:
    # Private JAX API (0.10.2): a module global `races: RaceDetectionState | None`, replaced by a new
    # `RaceDetectionState(...)` when a kernel initialises the simulated shared memory.
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc

    state_cls = ipc.RaceDetectionState
    ipc.races  # noqa: B018 - check that the attribute exists
    if not hasattr(state_cls, "races_found"):
      raise AttributeError("RaceDetectionState.races_found")
  except (ImportError, AttributeError) as e:
    raise RuntimeError(
      "no_races(): JAX moved the Pallas TPU interpret-mode race detector (expected "
      "jax._src.pallas.mosaic.interpret.interpret_pallas_call.races, a RaceDetectionState with .races_found, as in "
      f"JAX 0.10.2; this is JAX {jax.__version__}). Update flax_ringattn/_src/testing/interpret.py."
    ) from e

  states = []

  class _Recorded(state_cls):
    def __init__(self, *args, **kwargs):
      super().__init__(*args, **kwargs)
      states.append(self)

  pltpu.reset_tpu_interpret_mode_state()
  ipc.RaceDetectionState = _Recorded
  try:
    yield
    jax.effects_barrier()
  finally:
    ipc.RaceDetectionState = state_cls
  if ipc.races is not None and all(ipc.races is not s for s in states):
    states.append(ipc.races)
  racy = sum(bool(s.races_found) for s in states)
  if racy:
    raise AssertionError(
      f"Pallas TPU interpret mode detected a data race in {racy} of {len(states)} kernel run(s) "
      "(details printed above as 'RACE DETECTED')"
    )
  if expect_kernels and not states:
    raise AssertionError("no_races(): no Pallas interpret-mode kernel ran inside the block")
  global _clean_checks
  _clean_checks += bool(states)


_clean_checks = 0  # no_races() blocks that ran at least one kernel and found no race (read by tests/conftest.py)


def clean_race_checks() -> int:
  """How many `no_races()` blocks have passed in this process; a test that ran none read no race detector."""
  return _clean_checks

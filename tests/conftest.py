"""Test setup: 8 simulated CPU devices, shared mesh helpers, the interpret-mode harness."""

import contextlib
import importlib.metadata
import importlib.util
import os
import sys
import threading
import traceback
from pathlib import Path

# `make test-tpu` (tests/test_tpu_compiled.py, compiled on the chip) sets FLAX_RINGATTN_TPU_TIER=1: XLA keeps its
# default compile flags and the process is not re-executed under the CPU shim below.  Nothing here hides the TPU
# from JAX (no JAX_PLATFORMS).
TPU_TIER = os.environ.get("FLAX_RINGATTN_TPU_TIER", "0") != "0"

# Must happen before JAX initialises its backends.  (8 host devices cost nothing on a TPU host.)
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
  _flags += " --xla_force_host_platform_device_count=8"
# The suite is compile-bound on CPU: skip LLVM's expensive optimisation passes (about 40% off each XLA compile of a
# ring's forward and backward; interpret-mode kernels, which are execution-bound, run as fast).  Floating-point
# semantics are unchanged (no fast-math).  Subprocesses (examples, README, multi-process tests) inherit it.
# FLAX_RINGATTN_TEST_FULL_OPT=1 keeps XLA's default optimisation.
_full_opt = TPU_TIER or os.environ.get("FLAX_RINGATTN_TEST_FULL_OPT", "0") != "0"
if not _full_opt and "xla_backend_optimization_level" not in _flags:
  _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
  # And XLA:CPU's older loop emitters instead of its MLIR fusion emitters: about 30% off the compiles of 9 ring /
  # converted-model tests and 9 interpret-mode ones, 10% off the whole suite's CPU time (2026-12-03); no
  # fast-math.  XLA aborts on a flag it does not know, so only on the jaxlib line it was measured on.
  if importlib.metadata.version("jaxlib").startswith("0.10.") and "xla_cpu_use_fusion_emitters" not in _flags:
    _flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = _flags.strip()


def _load_harness():
  """flax_ringattn/_src/testing/interpret.py, loaded by path: importing the package would import JAX."""
  path = Path(__file__).resolve().parents[1] / "flax_ringattn" / "_src" / "testing" / "interpret.py"
  spec = importlib.util.spec_from_file_location("_flax_ringattn_interpret_harness", path)
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


# Multi-device Pallas interpret-mode kernels deadlock when XLA's CPU thread pool is small (few cores): re-exec
# this process with more (fake) CPUs before JAX starts.  xdist workers inherit the environment and do not re-exec.
_harness = _load_harness()
if not TPU_TIER:
  _harness.ensure_cpu_threads()

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402

# Per-test timeout (seconds) for tests marked `interpret`; an explicit @pytest.mark.timeout wins.
INTERPRET_TIMEOUT_S = float(os.environ.get("FLAX_RINGATTN_INTERPRET_TIMEOUT", "180"))


@contextlib.contextmanager
def jax_events():
  """The names of JAX's compile-pipeline events recorded inside the block, in order (traces:
  "/jax/core/compile/jaxpr_trace_duration", backend compiles: "/jax/core/compile/backend_compile_duration")."""
  events = []

  def listen(name, secs, **kwargs):
    del secs, kwargs
    events.append(name)

  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    yield events
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)


def make_mesh(shape, names, *, explicit: bool = True):
  """A mesh over the first prod(shape) CPU devices (Explicit axes by default, as jax.make_mesh)."""
  n = 1
  for s in shape:
    n *= s
  types = (AxisType.Explicit if explicit else AxisType.Auto,) * len(shape)
  return jax.make_mesh(tuple(shape), tuple(names), axis_types=types, devices=jax.devices()[:n])


@pytest.fixture(scope="module", autouse=True)
def _drop_compiled_programs():
  """Each module's compiled programs go when it ends: an xdist worker runs about 900 tests, and the executables
  its jit caches would otherwise hold (interpret-mode kernels are large) pile up for the whole run.  Two full
  runs on a 2-core machine lost a worker late in the run (SIGSEGV / SIGABRT inside an XLA compile of an
  interpret-mode backward) that the same tests alone did not; modules share few programs, so little is
  recompiled."""
  yield
  import gc

  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="session", autouse=True)
def _eight_devices():
  if jax.default_backend() == "cpu":  # on a GPU only the one-device tests are run (benchmarks/gpu_check.sh)
    assert jax.device_count() >= 8, f"tests need 8 CPU devices, got {jax.devices()}"


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: the TPU tier runs where xdist may not be installed
def pytest_xdist_auto_num_workers(config):
  """`-n auto`: one worker per real CPU, not per CPU the shim reports (PYTEST_XDIST_AUTO_NUM_WORKERS still wins)."""
  del config
  return None if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS") else _harness.real_cpus()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  """A passing `interpret` test must have read the race detector: at least one clean `no_races()` block.

  Tests that run no race-checked kernel on purpose carry `@pytest.mark.races_not_read(reason)`.
  """
  check = item.get_closest_marker("interpret") and not item.get_closest_marker("races_not_read")
  if check:
    from flax_ringattn._src.testing import interpret as harness

    before = harness.clean_race_checks()
  result = yield
  if check and harness.clean_race_checks() == before:
    raise AssertionError(
      f"{item.nodeid} is marked `interpret` but passed without a clean `no_races()` check: wrap the kernel "
      "calls in `with no_races():` (flax_ringattn._src.testing.interpret), or mark the test "
      "`@pytest.mark.races_not_read(reason)`"
    )
  return result


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    if item.get_closest_marker("interpret") and not item.get_closest_marker("timeout"):
      item.add_marker(pytest.mark.timeout(INTERPRET_TIMEOUT_S, method="thread"))
  # `slow` tests first (stable otherwise): with xdist, a minute-long test started last keeps one worker busy
  # after the other has finished.
  items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # pytest-timeout's hook (optional: as above)
def pytest_timeout_set_timer(item, settings):
  """For `interpret` tests: pytest-timeout's thread method, followed by the likely causes of the hang."""
  if item.get_closest_marker("interpret") is None or settings.method != "thread":
    return None
  timer = threading.Timer(settings.timeout, _interpret_timeout, (item, settings))
  timer.name = f"interpret timeout {item.nodeid}"
  timer.daemon = True

  def cancel():
    timer.cancel()
    timer.join()

  item.cancel_timeout = cancel
  timer.start()
  return True


def _interpret_timeout(item, settings):
  """Like pytest-timeout's thread method (captured output, every thread's stack, exit), plus the likely causes.

  Writes to stderr: an xdist worker's stdout goes nowhere, its stderr is the controller's.
  """
  import pytest_timeout

  if not settings.disable_debugger_detection and getattr(pytest_timeout, "is_debugging", lambda: False)():
    return
  out = sys.__stderr__ or sys.stderr  # fd 2, once the capture is suspended
  try:
    capman = item.config.pluginmanager.getplugin("capturemanager")
    captured = (None, None)
    if capman:
      capman.suspend_global_capture(item)
      captured = capman.read_global_capture()
    out.write("\n" + _rule("Timeout", "+"))
    for title, text in zip(("Captured stdout", "Captured stderr"), captured, strict=True):
      if text:
        out.write(_rule(title) + text + "\n")
    names = {t.ident: t.name for t in threading.enumerate()}
    for ident, frame in sys._current_frames().items():
      if ident != threading.get_ident():
        out.write(_rule(f"Stack of {names.get(ident, '<unknown>')} ({ident})"))
        out.write("".join(traceback.format_stack(frame)))
    shim = "loaded" if os.environ.get(_harness.SHIM_ENV, "0") != "0" else "NOT loaded"
    out.write(_rule("interpret-mode test timed out", "!"))
    out.write(
      f"{item.nodeid} ran past {settings.timeout:g}s: a Pallas TPU interpret-mode kernel is most likely deadlocked.\n"
      "Likely causes:\n"
      "  1. XLA's CPU thread pool is too small for the simulated devices: each device blocks a pool thread and the\n"
      "     array copies in the interpreter's callbacks wait for a free one. This process sees "
      f"{_harness.visible_cpus()} CPUs ({_harness.real_cpus()} real; CPU affinity shim {shim}).\n"
      "     tests/conftest.py calls ensure_cpu_threads(), which needs a C compiler: look for its warning.\n"
      "  2. A semaphore / DMA protocol bug in the kernel: a wait whose signal or DMA never comes, a mismatched\n"
      "     semaphore count or copy size, or a barrier that not every device reaches. See the stacks above.\n"
      "  3. Or it is only slow (interpret mode is, and more so on a loaded machine): the stacks show the simulated\n"
      "     devices' Python callbacks only, not XLA's native code between them. Raise the limit with\n"
      "     FLAX_RINGATTN_INTERPRET_TIMEOUT=<seconds> or @pytest.mark.timeout(<seconds>, method='thread') to tell.\n"
    )
    out.write(_rule("exiting", "!"))
  except Exception:
    traceback.print_exc()
  finally:
    out.flush()
    os._exit(1)


def _rule(title, char="~"):
  return f" {title} ".center(100, char) + "\n"

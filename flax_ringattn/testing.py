"""Test helpers for your own test suite (chex-based).

* `assert_matches_reference(fn, q, k, v, *, grads=True, **mask_options)`: an
  attention function's output and q/k/v gradients against
  `reference_attention`, with messages naming the tensor, the worst index and
  the error.
* `TOLERANCES`, `tolerance(dtype, kind)`, `assert_close(actual, expected, dtype, kind)`:
  the per-dtype tolerances this library tests itself with.
* `collective_counts(jitted_fn, *args)`: the collectives in the compiled
  program (`["collective-permute"]` > 0: the ring really runs sharded).
* Pallas TPU interpret mode on CPU: `interpret_params(**overrides)` (race
  detection on), `no_races()` (asserts the race detector ran and found
  nothing), `ensure_cpu_threads()` (call before JAX starts: multi-device
  interpret-mode kernels deadlock on machines with few cores otherwise).
* Kernel test hooks: `with kernel_debug(slots="hbm")` makes the in-kernel ring
  keep its slots in HBM, `drop_credits=True` injects a protocol bug for the
  race detector to find, and `recorder=Recorder()` records the ring's remote
  DMAs and protocol events at trace time.  They reach the kernels in the
  call's hashable options, never through module globals, for calls traced
  inside the block (a jitted function traced before it keeps its trace).
"""

from flax_ringattn._src.debug import KernelDebug, Recorder, kernel_debug
from flax_ringattn._src.testing.checks import (
  TOLERANCES,
  assert_close,
  assert_matches_reference,
  collective_counts,
  tolerance,
)
from flax_ringattn._src.testing.interpret import ensure_cpu_threads, interpret_params, no_races

__all__ = [
  "TOLERANCES",
  "KernelDebug",
  "Recorder",
  "assert_close",
  "assert_matches_reference",
  "collective_counts",
  "ensure_cpu_threads",
  "interpret_params",
  "kernel_debug",
  "no_races",
  "tolerance",
]

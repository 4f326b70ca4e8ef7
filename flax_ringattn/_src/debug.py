"""Test hooks of the kernels, as one hashable configuration instead of module globals or kernel arguments.

A `KernelDebug` travels in the static options (`AttentionSpec.debug`, part of
the kernels' static configuration and of the `flash` kernel's hash) down to the
kernels, which read it at trace time.  Tests set it for the calls traced inside
a `with kernel_debug(...)` block (`flax_ringattn.testing.kernel_debug`): the
public entry points read it once, when they build their options, so a function
the caller's `jax.jit` traced before the block keeps its cached trace (trace it
inside the block, or call the kernels with a spec that carries the debug
configuration).  Production calls carry `debug=None`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses

_SLOTS = ("vmem", "hbm")


class Recorder:
  """What the in-kernel ring's protocol does, appended at trace time (hops are unrolled in Python, so trace order
  is program order).  Hashed by identity: a recorder is one experiment.

  dmas: (kernel name, bytes, how many ring members start it) for every remote DMA started, once per grid step.
  events: (kernel name, event, detail): ("slots", "vmem" or "hbm") when a kernel is launched, then ("hop", t),
  ("compute", t), ("release", None), ("acquire", None), ("start", descriptor id), ("wait", descriptor id).
  """

  def __init__(self):
    self.dmas: list = []
    self.events: list = []

  __hash__ = object.__hash__
  __eq__ = object.__eq__


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelDebug:
  """slots: "vmem" or "hbm" overrides the in-kernel ring planner's choice of where the communication slots live,
  so that small test shapes run the HBM-slot kernels.  drop_credits: the forward ring skips its credit exchange (a
  protocol bug the race detector must catch).  recorder: a `Recorder` the ring protocol appends to.

  Block-kernel variants, for A/B runs on a chip (`benchmarks/tpu_kernels.py --ours-variants`) and their tests:
  forward_layout "heads_major" runs the heads-major forward where the token-major one would run; natural_exp computes
  the online softmax with exp, not in log2 units with exp2 (`block.forward.online_softmax_step`);
  whole_partial_tiles computes a PARTIAL tile whole, masked, instead of in row sub-tiles
  (`tiling.forward_sub_tiles`).  fused_backward True / False overrides the block backward's choice of one fused
  kernel or a dq kernel and a dk/dv kernel (`BlockSizes.fused_bwd`, `common.fused_backward`); None keeps it."""

  slots: str | None = None
  drop_credits: bool = False
  recorder: Recorder | None = None
  forward_layout: str | None = None
  natural_exp: bool = False
  whole_partial_tiles: bool = False
  fused_backward: bool | None = None

  def __post_init__(self):
    if self.slots is not None and self.slots not in _SLOTS:
      raise ValueError(f"slots must be one of {_SLOTS} or None, got {self.slots!r}")
    if self.forward_layout not in (None, "heads_major"):
      raise ValueError(f"forward_layout must be 'heads_major' or None, got {self.forward_layout!r}")


_CURRENT: contextvars.ContextVar[KernelDebug | None] = contextvars.ContextVar("flax_ringattn_debug", default=None)


def current() -> KernelDebug | None:
  """The debug configuration of the enclosing `kernel_debug` block, or None."""
  return _CURRENT.get()


@contextlib.contextmanager
def kernel_debug(**changes):
  """Calls traced inside the block carry the enclosing block's `KernelDebug` with `changes` (its fields) applied
  (tests only); yields it."""
  cfg = dataclasses.replace(current() or KernelDebug(), **changes)
  token = _CURRENT.set(cfg)
  try:
    yield cfg
  finally:
    _CURRENT.reset(token)

"""The ring op's registry: the block backends of the block contract, in order of preference.

`"pallas_tpu_ring"` is an alias: `"pallas_tpu"` running the ring strategy as one fused kernel per direction
(`PallasTpuBackend.fused_ring`) instead of one block call per hop.  With `implementation=None` the ring
strategy takes the fused ring where the backend offers one, compiles for the chip (not interpret mode) and its
planner fits the shards (`fused_ring_fits`); everything else runs the portable ring loop (`ring_loop.py`) or
another strategy (`strategies.py`) on the block kernels.
"""

from __future__ import annotations

from flax_ringattn._src.backends.pallas_gpu import PallasGpuBackend
from flax_ringattn._src.backends.pallas_tpu import PallasTpuBackend
from flax_ringattn._src.backends.registry import Registry
from flax_ringattn._src.backends.xla import XlaBackend

FUSED_RING = "pallas_tpu_ring"

RING = Registry(
  "ring_attention",
  (PallasTpuBackend(), PallasGpuBackend(), XlaBackend()),
  preference=("pallas_tpu", "pallas_gpu", "xla"),
  aliases={FUSED_RING: ("pallas_tpu", {"fused": True})},
  interpret_default="pallas_tpu",
  interpret_error=(
    "interpret=... applies to implementation='pallas_tpu' only (or 'pallas_tpu_ring'; or 'pallas_gpu' with "
    "interpret=True), got implementation={implementation!r}"
  ),
)


def select(implementation, *, dtype, spec, shapes, interpret=None):
  """The `Choice` of backend for one ring call (`Registry.select`)."""
  return RING.select(implementation, interpret=interpret, dtype=dtype, spec=spec, shapes=shapes)


def get_backend(implementation, *, dtype, spec, shapes, interpret=None):
  """The block backend `select` chooses."""
  return select(implementation, dtype=dtype, spec=spec, shapes=shapes, interpret=interpret).backend


def check_name(implementation):
  """What `select` checks of `implementation` before a call's shapes are known (the layers check it when they
  are built): a string among `RING.names()`, or None."""
  RING.check_name(implementation)

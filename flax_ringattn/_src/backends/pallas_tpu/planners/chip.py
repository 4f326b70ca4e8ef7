"""The chip side of the Pallas TPU planners: VMEM per generation, the share a plan may use, the scoped limit.

Per-generation VMEM capacities are per TensorCore, from the package's one
hardware table (`_src/perf/hardware.py`, whose TPU figures are JAX's own,
`jax/_src/pallas/mosaic/tpu_info.py`, JAX 0.10.2, which cites each number);
a test checks `VMEM_BYTES` against `pltpu.get_tpu_info_for_chip`.
"""

from __future__ import annotations

import jax
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src.perf import hardware

MiB = hardware.MiB

# generation -> VMEM bytes per TensorCore (the hardware table's TPUs, in its order).
VMEM_BYTES = {g: hardware.tpu(g).vmem_bytes for g in hardware.TPU_GENERATIONS}
# The fraction of VMEM a plan may use: Mosaic keeps internal scratch and
# spills matmul operands, and a plan that fills VMEM exactly fails to compile.
SAFETY_MARGIN = 0.75
# Off TPU (interpret mode, or planning ahead) plan for the smallest VMEM.
DEFAULT_GENERATION = "v4"


def current_generation() -> str:
  """The attached TPU's generation name ('v5e', ...), or DEFAULT_GENERATION off TPU.

  A chip missing from VMEM_BYTES (v2, v3, v4i, 7, 8i, ...) is named by JAX's
  chip version; `vmem_bytes` then asks JAX for its capacity.
  """
  if jax.default_backend() != "tpu":
    return DEFAULT_GENERATION
  version = str(pltpu.get_tpu_info().chip_version.value).lower()
  version = {"7x": "v7x", "tpu7x": "v7x"}.get(version, version)
  return version if version.startswith("v") or version in VMEM_BYTES else f"v{version}"


def vmem_bytes(generation: str) -> int:
  """VMEM per TensorCore: the table for known generations, else JAX's own number for the attached chip."""
  if generation in VMEM_BYTES:
    return VMEM_BYTES[generation]
  if jax.default_backend() == "tpu" and generation == current_generation():
    return int(pltpu.get_tpu_info().vmem_capacity_bytes)
  raise ValueError(f"unknown TPU {generation=}; known generations: {tuple(VMEM_BYTES)}")


def budget_bytes(generation: str) -> int:
  return int(vmem_bytes(generation) * SAFETY_MARGIN)


def vmem_limit_bytes(generation: str) -> int:
  """The scoped VMEM limit a kernel asks Mosaic for: nearly all of VMEM (the
  planner keeps footprints within SAFETY_MARGIN; Mosaic's default scoped limit
  is far lower on most chips)."""
  return int(vmem_bytes(generation) * 0.9)

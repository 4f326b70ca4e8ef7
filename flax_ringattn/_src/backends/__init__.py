"""Registry of block backends, tried in order of preference."""

from __future__ import annotations

import dataclasses
import logging

from flax_ringattn._src.backends import pallas_gpu
from flax_ringattn._src.backends.pallas_tpu import PallasTpuBackend, normalize_interpret
from flax_ringattn._src.backends.pallas_tpu.ring import PallasTpuRingBackend
from flax_ringattn._src.backends.xla import XlaBackend

_BACKENDS = {
  "pallas_tpu_ring": PallasTpuRingBackend(),
  "pallas_tpu": PallasTpuBackend(),
  "pallas_gpu": pallas_gpu.PallasGpuBackend(),
  "xla": XlaBackend(),
}
# Preference order for implementation=None: the in-kernel TPU ring (`ring/op.py` skips it where the shard does not
# fit VMEM), the TPU block kernels where they run, the GPU kernels where they run, else XLA.
_PREFERENCE = ("pallas_tpu_ring", "pallas_tpu", "pallas_gpu", "xla")
_INTERPRETABLE = ("pallas_tpu", "pallas_tpu_ring")  # with a TPU InterpretParams (pallas_gpu takes interpret=True)
_log = logging.getLogger("flax_ringattn")


def available() -> tuple[str, ...]:
  return tuple(_BACKENDS)


def get_backend(implementation: str | None, *, dtype, spec, shapes, interpret=None, preference=_PREFERENCE):
  """The backend named `implementation`, or the first one of `preference` that supports the call.

  `interpret` (True or a `pltpu.InterpretParams`) runs a Pallas backend in
  interpret mode; with implementation=None it selects the Pallas TPU backend.
  With implementation="pallas_gpu" it must be True or False (Pallas's generic
  interpreter).
  """
  if implementation == "pallas_gpu":
    backend = dataclasses.replace(_BACKENDS["pallas_gpu"], interpret=pallas_gpu.normalize_interpret(interpret))
    backend.check_supported(dtype=dtype, spec=spec, shapes=shapes)
    return backend
  interpret = normalize_interpret(interpret)
  if interpret is not None:
    if implementation is None:
      implementation = "pallas_tpu"
    if implementation not in _INTERPRETABLE:
      raise ValueError(
        f"interpret=... applies to implementation='pallas_tpu' only (or 'pallas_tpu_ring'; or 'pallas_gpu' with "
        f"interpret=True), got {implementation=}"
      )
  if implementation is None:
    errors = []
    for name in preference:
      backend = _BACKENDS[name]
      try:
        backend.check_supported(dtype=dtype, spec=spec, shapes=shapes)
      except NotImplementedError as e:
        errors.append(f"{name}: {e}")
        _log.info("implementation=None skips %s: %s", name, e)
        continue
      return backend
    raise NotImplementedError("no backend supports this call: " + "; ".join(errors))
  if not isinstance(implementation, str):
    raise TypeError(f"implementation must be a string or None, got {implementation!r}")
  if implementation not in _BACKENDS:
    raise ValueError(f"unknown {implementation=}; available implementations: {available()}")
  backend = _BACKENDS[implementation]
  if interpret is not None:
    backend = dataclasses.replace(backend, interpret=interpret)
  backend.check_supported(dtype=dtype, spec=spec, shapes=shapes)
  return backend

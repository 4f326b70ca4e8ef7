"""Registry of block backends, tried in order of preference."""

from __future__ import annotations

import dataclasses

from flax_ringattn._src.backends.pallas_tpu import PallasTpuBackend, normalize_interpret
from flax_ringattn._src.backends.pallas_tpu.ring import PallasTpuRingBackend
from flax_ringattn._src.backends.xla import XlaBackend

_BACKENDS = {"pallas_tpu": PallasTpuBackend(), "xla": XlaBackend()}
_BACKENDS["pallas_tpu_ring"] = PallasTpuRingBackend()
# Preference order for implementation=None: the TPU kernels where they run, else XLA.
_PREFERENCE = ("pallas_tpu", "xla")
# On a TPU the in-kernel ring comes first (see `ring/op.py`, which skips it where the shard does not fit VMEM).
_PREFERENCE = ("pallas_tpu_ring", *_PREFERENCE)
_INTERPRETABLE = ("pallas_tpu", "pallas_tpu_ring")


def available() -> tuple[str, ...]:
  return tuple(_BACKENDS)


def get_backend(implementation: str | None, *, dtype, spec, shapes, interpret=None):
  """The backend named `implementation`, or the best one that supports the call.

  `interpret` (True or a `pltpu.InterpretParams`) runs a Pallas backend in
  interpret mode; with implementation=None it selects the Pallas TPU backend.
  """
  interpret = normalize_interpret(interpret)
  if interpret is not None:
    if implementation is None:
      implementation = "pallas_tpu"
    if implementation not in _INTERPRETABLE:
      raise ValueError(
        f"interpret=... applies to implementation='pallas_tpu' only (or 'pallas_tpu_ring'), got {implementation=}"
      )
  if implementation is None:
    errors = []
    for name in _PREFERENCE:
      backend = _BACKENDS[name]
      try:
        backend.check_supported(dtype=dtype, spec=spec, shapes=shapes)
      except NotImplementedError as e:
        errors.append(f"{name}: {e}")
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

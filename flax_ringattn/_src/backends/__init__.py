"""Registry of block backends, tried in order of preference."""

from __future__ import annotations

from flax_ringattn._src.backends.xla import XlaBackend

_BACKENDS = {"xla": XlaBackend()}
# Preference order for implementation=None; later issues put Pallas first.
_PREFERENCE = ("xla",)


def available() -> tuple[str, ...]:
  return tuple(_BACKENDS)


def get_backend(implementation: str | None, *, dtype, spec, shapes):
  """The backend named `implementation`, or the best one that supports the call."""
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
  backend.check_supported(dtype=dtype, spec=spec, shapes=shapes)
  return backend

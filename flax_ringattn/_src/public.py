"""The public classes' signatures as `help()`, `inspect.signature` and IDEs show them.

flax's `nnx.Module` metaclass defines `__call__(*args, **kwargs)`, and `inspect.signature(cls)` reads a
metaclass `__call__` before the class's `__init__`: `RingMultiHeadAttention` would show `(*args, **kwargs)`.
"""

from __future__ import annotations

import inspect


class _InitSignature:
  """`cls.__signature__`: `cls.__init__`'s signature without `self`, read from the class it is looked up on (a
  subclass with its own `__init__` shows its own).  On an instance it is absent, so `inspect.signature(layer)` is
  still the signature of the layer's `__call__`."""

  def __get__(self, instance, owner=None):
    if instance is not None:
      raise AttributeError("__signature__")
    return _init_signature(owner)


def _init_signature(cls) -> inspect.Signature:
  sig = inspect.signature(cls.__init__)
  return sig.replace(parameters=tuple(sig.parameters.values())[1:])


def expose_init_signatures(objects) -> None:
  """Gives every class of `objects` whose `inspect.signature` is not its own `__init__`'s (without `self`) that
  signature.  Classes without a Python `__init__` (named tuples, exceptions) and functions are left alone."""
  for cls in objects:
    if not inspect.isclass(cls) or not inspect.isfunction(getattr(cls, "__init__", None)):
      continue
    try:
      shown = inspect.signature(cls)
    except (TypeError, ValueError):
      shown = None
    if shown != _init_signature(cls):
      cls.__signature__ = _InitSignature()

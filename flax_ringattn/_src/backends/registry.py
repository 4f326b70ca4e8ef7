"""One selection rule for every op: a `Registry` of implementations, tried in order of preference.

Each op (ring, paged) owns one registry (`ring/implementations.py`, `paged/implementations.py`) and the same
rules hold for both:

* `implementation="name"` runs that implementation or raises: `ValueError` for an unknown name (listing the
  known ones), `NotImplementedError` from its `check_supported` for valid input it cannot run.
* `implementation=None` tries the preference order; `NotImplementedError` from `check_supported` means "valid
  input, not supported here" and the next one is tried (logged at INFO on the "flax_ringattn" logger).
* `interpret=` applies to the Pallas implementations only, through `with_interpret`; the others reject it
  with the registry's `interpret_error`.
  It never picks an implementation silently: with `implementation=None` it selects the registry's
  `interpret_default` and warns once (deprecated), so a call says which kernels it interprets.
* An alias is another name for an implementation plus options the op reads (`Choice.options`), e.g. the
  ring's `"pallas_tpu_ring"` is `"pallas_tpu"` with the fused in-kernel ring.

An implementation is any hashable object with `name` and `check_supported(**call)` (what `call` holds is the
op's business); a Pallas one also has `with_interpret(interpret)`, and one with a `label` field reports errors
under the alias a call asked for.
"""

from __future__ import annotations

import dataclasses
import logging

from flax_ringattn._src.validation import warn_once

_log = logging.getLogger("flax_ringattn")


@dataclasses.dataclass(frozen=True)
class Choice:
  """The implementation a call runs, the name it was asked for, and the alias's options (empty without one)."""

  backend: object
  requested: str | None
  options: tuple = ()  # (key, value) pairs of the alias

  def option(self, key, default=None):
    return dict(self.options).get(key, default)


class Registry:
  def __init__(self, op: str, implementations, *, preference, aliases=None, interpret_default=None, interpret_error=""):
    self.op = op
    self._impls = {impl.name: impl for impl in implementations}
    self.preference = tuple(preference)
    self.aliases = dict(aliases or {})  # alias -> (implementation name, options dict)
    self.interpret_default = interpret_default
    self.interpret_error = interpret_error  # formatted with implementation=
    assert set(self.preference) <= set(self._impls), (self.preference, tuple(self._impls))

  def names(self) -> tuple[str, ...]:
    """Every name `implementation=` accepts: the aliases first (they are the most specific), then the preference
    order."""
    return (*self.aliases, *self.preference)

  def check_name(self, implementation):
    """`implementation` if it is None or a name `select` accepts; else the `TypeError` / `ValueError` that
    `select` raises (the layers check the name when they are built, before a call's shapes are known)."""
    if implementation is None:
      return None
    if not isinstance(implementation, str):
      raise TypeError(f"implementation must be a string or None, got {implementation!r}")
    name = self.aliases.get(implementation, (implementation, {}))[0]
    if name not in self._impls:
      raise ValueError(f"unknown {implementation=}; available implementations: {self.names()} (of {self.op})")
    return implementation

  def select(self, implementation, *, interpret=None, **call) -> Choice:
    """The `Choice` for `implementation` (a name, an alias or None) under the rules of the module docstring."""
    interpreting = interpret is not None and interpret is not False
    implied = implementation is None and interpreting and bool(self.interpret_default)
    if implied:
      implementation = self.interpret_default
    if implementation is None:
      errors = []
      for name in self.preference:
        backend = self._impls[name]
        try:
          backend.check_supported(**call)
        except NotImplementedError as e:
          errors.append(f"{name}: {e}")
          _log.info("implementation=None skips %s: %s", name, e)
          continue
        return Choice(backend, None)
      raise NotImplementedError(f"no {self.op} implementation supports this call: " + "; ".join(errors))
    self.check_name(implementation)
    name, options = self.aliases.get(implementation, (implementation, {}))
    backend = self._impls[name]
    if name != implementation and hasattr(backend, "label"):
      backend = dataclasses.replace(backend, label=implementation)
    if interpreting:
      if not hasattr(backend, "with_interpret"):
        raise ValueError(self.interpret_error.format(implementation=implementation))
      backend = backend.with_interpret(interpret)  # a bad value raises before the warning below
    if implied:
      warn_once(
        (self.op, "interpret"),
        f"{self.op}: interpret=... without implementation= picks implementation={implementation!r}; "
        f"pass implementation={implementation!r} (or the Pallas implementation you mean) explicitly",
      )
    backend.check_supported(**call)
    return Choice(backend, implementation, tuple(sorted(options.items())))

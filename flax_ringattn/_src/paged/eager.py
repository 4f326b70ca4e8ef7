"""Eager `PagedKVCache` calls compiled once per configuration.

Called on concrete arrays, a cache method would otherwise run op by op: a few hundred small XLA programs, each
compiled on first use (about 20 s for the first `append` of a process on a 2-core CPU, and again for every new
cache geometry).  `method` runs the whole method as one jitted program instead, with every contract check of
the method (`checks.enforce`, `admission.check`) turned into a checkify check.  When a check fails, the call is
run again op by op, as before: that raises the method's own error (`ValueError`, `TypeError`,
`CacheOverflowError`, with the same message), and the cache object the caller holds is unchanged either way.

Under a trace, or with arguments a jit cannot take as they are (a list, a bool or float where an int belongs),
the method runs as written.  A concrete cache spread over Explicit mesh axes runs inside its mesh
(`allocator.eager_mesh`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import numbers

import jax
import numpy as np
from jax.experimental import checkify

from flax_ringattn._src import validation
from flax_ringattn._src.paged import allocator, checks

# Traces of each method's eager program ("PagedKVCache.append": 2): a test reads it to see one compile per
# configuration.
TRACES: collections.Counter = collections.Counter()


def _jit_ready(leaf) -> bool:
  """A leaf a jit takes without changing what the method sees: a concrete array, or a Python int (not a bool)."""
  if isinstance(leaf, jax.core.Tracer):
    return False
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
    return True
  return isinstance(leaf, numbers.Integral) and not isinstance(leaf, (bool, np.bool_))


def method(fn):
  """Decorates a `PagedKVCache` method: an eager call runs as one compiled program (see the module docstring).

  Keyword-only parameters are static (part of the compiled configuration); the others are traced."""
  signature = inspect.signature(fn)
  static_names = {n for n, p in signature.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}
  name = fn.__qualname__

  def traced(cache, dynamic, static):
    TRACES[name] += 1
    with checks.all_checked():
      return fn(cache, **dynamic, **dict(static))

  program = jax.jit(checkify.checkify(traced, errors=checkify.user_checks), static_argnums=2)

  def compiled(cache, args, kwargs):
    """The call as one program, or None when it must run op by op (not eager, not jittable, or a check failed)."""
    try:
      bound = signature.bind(cache, *args, **kwargs)
    except TypeError:
      return None  # the plain call raises Python's own message
    arguments = dict(bound.arguments)
    del arguments[next(iter(signature.parameters))]  # self
    static = tuple(sorted((k, v) for k, v in arguments.items() if k in static_names))
    dynamic = {k: v for k, v in arguments.items() if k not in static_names}
    leaves = jax.tree.leaves((cache, dynamic))
    if not all(_jit_ready(x) for x in leaves) or not all(validation.is_hashable(v) for _, v in static):
      return None
    try:
      err, out = program(cache, dynamic, static)
    except Exception:  # noqa: BLE001 (a static refusal, or a value the trace cannot read: the plain call says it)
      return None
    return None if err.get() is not None else out

  @functools.wraps(fn)
  def call(self, *args, **kwargs):
    if isinstance(self.k_pages, jax.core.Tracer):
      return fn(self, *args, **kwargs)
    mesh = allocator.eager_mesh(self.k_pages)
    with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
      out = None if allocator.under_trace() else compiled(self, args, kwargs)
      return fn(self, *args, **kwargs) if out is None else out

  return call

"""shard_map's varying-manual-axes (vma) bookkeeping for freshly made arrays.

Inside `jax.shard_map(check_vma=True)` an array built from constants (zeros,
-inf) is "invariant" while values computed from the shards are "varying";
`lax.cond`/`switch`/`scan` require both sides to agree.  `like(x, ref)` marks
`x` as varying over the same manual axes as `ref`; outside shard_map it is a
no-op.
"""

from __future__ import annotations

import jax


def _varying_axes(x) -> frozenset:
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # JAX 0.10: aval.mat.varying
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(aval, "vma", ()))  # older JAX


def _varying_over(x, want: frozenset):
  missing = tuple(sorted(want - _varying_axes(x), key=str))
  return jax.lax.pcast(x, missing, to="varying") if missing else x


def like(x, *refs):
  """`x` marked varying over every manual axis any of `refs` varies over."""
  return _varying_over(x, frozenset().union(*(_varying_axes(r) for r in refs)))


def unify(*xs):
  """`xs` all marked varying over the union of their manual axes (e.g. the operands of one pallas_call)."""
  want = frozenset().union(*(_varying_axes(x) for x in xs))
  return [_varying_over(x, want) for x in xs]


def manual_axis_type(x):
  """The manual-axis type of `x` for a `jax.ShapeDtypeStruct` (None outside JAX 0.10's vma tracking)."""
  return getattr(jax.typeof(x), "mat", None)


def varying_axes(x) -> frozenset:
  """The manual axes `x` varies over (empty outside shard_map or without the vma check)."""
  return _varying_axes(x)


def sum_to(x, ref):
  """`x` summed (psum) over the manual axes it varies over and `ref` does not: the cotangent of a value that was
  replicated over those axes (e.g. per-head parameters used by every sequence shard)."""
  extra = tuple(sorted(_varying_axes(x) - _varying_axes(ref), key=str))
  return jax.lax.psum(x, extra) if extra else x

"""Small helpers for meshes with Explicit or Auto axes (JAX 0.10 defaults to Explicit)."""

from __future__ import annotations

import jax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P


def has_explicit_axes(mesh, spec: P) -> bool:
  names = {a for entry in spec if entry is not None for a in (entry if isinstance(entry, tuple) else (entry,))}
  types = dict(zip(mesh.axis_names, mesh.axis_types, strict=True))
  return any(types[a] == AxisType.Explicit for a in names)


def constrain(x, mesh, spec: P):
  """Puts `x` on `NamedSharding(mesh, spec)`: `jax.reshard` for Explicit axes
  (sharding is part of the type there), a sharding constraint otherwise."""
  if mesh is None:
    return x
  sharding = NamedSharding(mesh, spec)
  if has_explicit_axes(mesh, spec):
    return jax.reshard(x, sharding)
  return jax.lax.with_sharding_constraint(x, sharding)


def axis_is_bound(axis_name) -> bool:
  """True inside a shard_map (or other collective context) that binds `axis_name`."""
  try:
    jax.lax.axis_size(axis_name)
  except (NameError, ValueError, KeyError):
    return False
  return True


def sequence_axis(mesh, axis, *, arg: str):
  """`axis`, or the only axis of `mesh` when `axis` is None (`arg` names the keyword in the error)."""
  if axis is not None or mesh is None:
    return axis
  names = tuple(mesh.axis_names)
  if len(names) != 1:
    raise ValueError(f"mesh has axes {names}: pass {arg}=... to say which one the sequence is sharded over")
  return names[0]


def check_mesh_axes(mesh, *, where: str = "", **axes):
  """Raises ValueError when an axis given as `role=axis` (a tuple names several) is not one of `mesh`'s.

  `where` prefixes the message (the layer or function that was given the axis).  Without a mesh nothing is
  checked: the axes must then be bound by the caller's own `shard_map`.
  """
  if mesh is None:
    return
  names = tuple(mesh.axis_names)
  prefix = f"{where}: " if where else ""
  for role, axis in axes.items():
    for a in axis if isinstance(axis, (tuple, list)) else (axis,):
      if a is not None and a not in names:
        which = "" if a == axis else f" names {a!r}, which"
        raise ValueError(f"{prefix}{role}={axis!r}{which} is not an axis of the mesh (mesh axes: {names})")


def axes_size(mesh, axes) -> int:
  """The number of devices along `axes` (one mesh axis or a tuple of them) of `mesh`."""
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes, strict=True))
  n = 1
  for a in axes if isinstance(axes, (tuple, list)) else (axes,):
    n *= sizes[a]
  return n


def named(mesh, spec: P) -> NamedSharding:
  return NamedSharding(mesh, spec)

"""`place_on_mesh`: the arrays of a model, an optimizer or a pytree that are not on a mesh, replicated on it.

flax creates arrays on one device.  `convert(model, mesh=...)` replicates the model's own on the mesh, but an
`nnx.Optimizer` built afterwards still starts with its step counter (and optax's counts) on one device: the
first jitted step returns them on the mesh, so the second step sees other input shardings and compiles again.
Placing them on the mesh first makes the first step's outputs have its inputs' shardings: one compile.
`convert` uses the same helper (`replicate_off_mesh`) for the rest of the model.
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


def _on_devices(value, devices) -> bool:
  """Whether `value` is laid out on a mesh over exactly `devices` (then its placement is the caller's)."""
  return isinstance(value.sharding, NamedSharding) and value.sharding.device_set == devices


def _off_mesh(value, devices) -> bool:
  return isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) and not _on_devices(value, devices)


def replicate_off_mesh(node, mesh) -> list[str]:
  """Replicates on `mesh`, in place, every concrete array of the NNX object `node` that is not already laid out
  on the mesh's devices; returns the paths of those moved."""
  devices = set(mesh.devices.flat)
  replicated = NamedSharding(mesh, P())
  placed = []
  for path, var in nnx.iter_graph(node):
    if not isinstance(var, nnx.Variable):
      continue
    value = var.get_value()
    if _off_mesh(value, devices):
      var.set_value(jax.device_put(value, replicated))
      placed.append(".".join(str(p) for p in path) or "<root>")
  return placed


def _check_mesh(mesh):
  if isinstance(mesh, jax.sharding.AbstractMesh):
    raise TypeError(
      f"place_on_mesh(tree, mesh): mesh={mesh!r} is an AbstractMesh, which has no devices to place arrays on; "
      "pass the concrete jax.sharding.Mesh (e.g. jax.make_mesh(...))"
    )
  if not isinstance(mesh, jax.sharding.Mesh):
    raise TypeError(
      f"place_on_mesh(tree, mesh): mesh must be a jax.sharding.Mesh (e.g. jax.make_mesh(...)), got "
      f"{type(mesh).__name__}: {mesh!r}"
    )
  if mesh.devices.size == 0:
    raise ValueError(f"place_on_mesh(tree, mesh): mesh={mesh!r} has no devices")


def place_on_mesh(tree, mesh):
  """Replicates on `mesh` every array of `tree` that is not already on the mesh's devices.

  Call it on an `nnx.Optimizer` made after `convert(model, mesh=...)` (or on
  any model or state built on one device): the optimizer's step counter and
  optax's counts start on one device, and a jitted train step would otherwise
  compile twice (its first outputs come back on the mesh).  Arrays already
  laid out on the mesh (the converted model's parameters, sharded or not) stay
  as they are; values being traced are left alone.

  Args:
    tree: an NNX object (`nnx.Module`, `nnx.Optimizer`, ...), updated in place
      and returned, or a pytree of arrays, returned placed.
    mesh: the `jax.sharding.Mesh` the model runs on.

  Returns:
    `tree` itself (an NNX object), or the placed pytree.
  """
  _check_mesh(mesh)
  if nnx.graph.is_graph_node(tree):
    replicate_off_mesh(tree, mesh)
    return tree
  devices = set(mesh.devices.flat)
  replicated = NamedSharding(mesh, P())
  return jax.tree.map(lambda x: jax.device_put(x, replicated) if _off_mesh(x, devices) else x, tree)

"""Pieces shared by the NNX layers."""

from __future__ import annotations

import difflib
import inspect

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from flax_ringattn._src import sharding

_PROJECTIONS = ("query", "key", "value", "out", "query_ln", "key_ln")
_FLAX_OPTIONS = tuple(p for p in inspect.signature(nnx.MultiHeadAttention.__init__).parameters if p != "self")


def check_keywords(cls, kwargs):
  """Raises TypeError naming `cls` for a keyword neither `cls.__init__` nor `nnx.MultiHeadAttention` takes.

  The layers pass what they do not know on to `nnx.MultiHeadAttention.__init__`, which would otherwise report a
  typo against flax's class.
  """
  unknown = [k for k in kwargs if k not in _FLAX_OPTIONS]
  if not unknown:
    return
  own = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "kwargs")]
  close = difflib.get_close_matches(unknown[0], own + list(_FLAX_OPTIONS), n=1)
  hint = f" (did you mean {close[0]!r}?)" if close else ""
  raise TypeError(
    f"{cls.__name__}() got an unexpected keyword argument {unknown[0]!r}{hint}; it takes the arguments of "
    f"nnx.MultiHeadAttention plus {', '.join(p for p in own if p not in _FLAX_OPTIONS)}"
  )


def head_sharding_metadata(head_axis, mesh, *, kernel_metadata, bias_metadata, out_kernel_metadata, out_bias_metadata):
  """Parameter metadata of nnx.MultiHeadAttention with the heads on `head_axis`.

  q/k/v kernels are [F, heads, H] and their biases [heads, H]; the out kernel is
  [N, H, F].  With a mesh and no head axis the parameters are typed as
  replicated on it (so that Explicit mesh axes see them on the mesh).  Metadata
  the caller passed wins over these defaults.
  """
  metadata = dict(
    kernel_metadata=kernel_metadata,
    bias_metadata=bias_metadata,
    out_kernel_metadata=out_kernel_metadata,
    out_bias_metadata=out_bias_metadata,
  )
  if head_axis is None and mesh is None:
    return metadata
  extra = {"mesh": mesh} if mesh is not None else {}
  defaults = dict(
    kernel_metadata=(None, head_axis, None),
    bias_metadata=(head_axis, None),
    out_kernel_metadata=(head_axis, None, None),
    out_bias_metadata=(None,),
  )
  return {name: {"out_sharding": defaults[name], **extra, **metadata[name]} for name in metadata}


def head_param_spec(projection: str, param: str, head_axis):
  """Partition of a parameter of nnx.MultiHeadAttention with the heads on `head_axis` (None: not head-sharded)."""
  if head_axis is None:
    return None
  if projection in ("query", "key", "value"):
    return {"kernel": (None, head_axis, None), "bias": (head_axis, None)}.get(param)
  if projection == "out" and param == "kernel":
    return (head_axis, None, None)
  return None


def place_params(layer, mesh, head_axis=None):
  """Puts the layer's parameters on `mesh`: over `head_axis`, else their `out_sharding` metadata, else replicated.

  Called at the start of every `__call__`: weights loaded with `nnx.update` from
  a model on one device (or from a checkpoint; `nnx.update` also replaces the
  parameters' metadata) are then typed on the mesh before flax's projections
  contract them with mesh-sharded activations, which Explicit mesh axes
  require.  Under `nnx.jit` the new placement is written back to the model, so
  later calls find the parameters in place (a no-op constraint).
  """
  if mesh is None:
    return
  for name in _PROJECTIONS:
    module = getattr(layer, name, None)
    if not isinstance(module, nnx.Module):
      continue
    for path, var in nnx.iter_graph(module):
      if not isinstance(var, nnx.Param):
        continue
      value = var.get_value()
      spec = head_param_spec(name, path[-1], head_axis)
      if spec is None:
        spec = var.get_metadata().get("out_sharding") or (None,) * value.ndim
      target = sharding.named(mesh, P(*spec))
      if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
        if value.sharding.is_equivalent_to(target, value.ndim):
          continue
        var.set_value(jax.device_put(value, target))
      else:
        var.set_value(sharding.constrain(value, mesh, P(*spec)))

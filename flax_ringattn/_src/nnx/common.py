"""Pieces shared by the NNX layers."""

from __future__ import annotations

import difflib
import inspect
import numbers

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from flax_ringattn._src import sharding, validation

_PROJECTIONS = ("query", "key", "value", "out", "query_ln", "key_ln")
_FLAX_OPTIONS = tuple(p for p in inspect.signature(nnx.MultiHeadAttention.__init__).parameters if p != "self")
_FLAX_DEFAULTS = {name: p.default for name, p in inspect.signature(nnx.MultiHeadAttention.__init__).parameters.items()}


class RingOfOneWarning(UserWarning):
  """A ring layer whose sequence axis has one device: it runs, and shards nothing."""


RING_OF_ONE_KEY = "ring_of_one"  # validation.warn_once's key: the warning is once per process


def warn_if_ring_of_one(mesh, seq_axis, *, where: str) -> None:
  """Warns once per process when `seq_axis` spans one device: on `mesh`, or, without one, as bound by the
  caller's shard_map (read at trace time).  A ring of one computes the right answer on one device, which on CPU
  usually means XLA_FLAGS did not ask for simulated devices before JAX started."""
  if seq_axis is None:
    return
  axes = tuple(seq_axis) if isinstance(seq_axis, (tuple, list)) else (seq_axis,)
  if mesh is not None:
    size = sharding.axes_size(mesh, axes)
  elif all(sharding.axis_is_bound(a) for a in axes):
    size = 1
    for a in axes:
      size *= jax.lax.axis_size(a)
  else:
    return
  if size != 1:
    return
  validation.warn_once(
    RING_OF_ONE_KEY,
    f"{where}: the sequence axis seq_axis={seq_axis!r} has 1 device, so ring attention runs as a ring of one "
    f"(nothing is sharded; JAX sees {jax.device_count()} device(s) on {jax.default_backend()!r}). On CPU, "
    "simulate devices with XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before jax is imported) and "
    "build the mesh over them",
    RingOfOneWarning,
  )


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


def check_layer_arguments(
  cls_name: str, *, num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features
):
  """The sizes of an attention layer's constructor, checked before flax builds anything.

  Every one is a positive int (the optional ones may be None: flax then takes in_features, or num_heads for
  num_kv_heads); qkv_features (default in_features) splits into num_heads heads and num_heads into num_kv_heads
  groups (GQA).  TypeError for a non-int, ValueError for a bad value, each naming `cls_name`, the argument and
  its value (flax's own checks would divide by zero, or fail at the first call).
  """
  sizes = dict(
    num_heads=(num_heads, False),
    in_features=(in_features, False),
    qkv_features=(qkv_features, True),
    out_features=(out_features, True),
    num_kv_heads=(num_kv_heads, True),
    in_kv_features=(in_kv_features, True),
  )
  for name, (value, optional) in sizes.items():
    if value is None and optional:
      continue
    expected = "a positive int" + (" or None" if optional else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
      raise TypeError(f"{cls_name}: {name} must be {expected}, got {name}={value!r} ({type(value).__name__})")
    if value < 1:
      raise ValueError(f"{cls_name}: {name} must be {expected}, got {name}={value}")
  qkv = in_features if qkv_features is None else qkv_features
  if qkv % num_heads:
    which = f"qkv_features={qkv}" if qkv_features is not None else f"qkv_features (default in_features={qkv})"
    raise ValueError(
      f"{cls_name}: {which} must be a multiple of num_heads={num_heads}: each head gets qkv_features // num_heads "
      "features"
    )
  if num_kv_heads is not None and num_heads % num_kv_heads:
    raise ValueError(
      f"{cls_name}: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} (GQA: each kv head "
      "serves num_heads // num_kv_heads q heads)"
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
  """Partition of a parameter of nnx.MultiHeadAttention with the heads on `head_axis` (None: not head-sharded);
  the layers' own `sinks` ([N], one logit per q head) is `projection="sinks"`."""
  if head_axis is None:
    return None
  if projection == "sinks":
    return (head_axis,)
  if projection in ("query", "key", "value"):
    return {"kernel": (None, head_axis, None), "bias": (head_axis, None)}.get(param)
  if projection == "out" and param == "kernel":
    return (head_axis, None, None)
  return None


# The metadata keys flax has used for a parameter's partitioning (`nnx.with_partitioning` writes `out_sharding`
# in flax 0.12; older code and checkpoints carry `sharding` or `sharding_names`).
_SHARDING_KEYS = ("out_sharding", "sharding", "sharding_names")


def metadata_spec(var) -> tuple | None:
  """The partition of an `nnx.Variable` from its metadata, whichever form flax allows there: a `NamedSharding`
  (its spec), a `PartitionSpec` or a tuple of axis names; None when it has none."""
  meta = var.get_metadata()
  value = next((meta[key] for key in _SHARDING_KEYS if meta.get(key) is not None), None)
  if value is None:
    return None
  if isinstance(value, jax.sharding.NamedSharding):
    value = value.spec
  if isinstance(value, (P, tuple, list)):
    return tuple(value)
  raise TypeError(
    f"a parameter's partitioning metadata must be a NamedSharding, a PartitionSpec or a tuple of mesh axis names, "
    f"got {value!r} ({type(value).__name__})"
  )


def spec_axes(spec) -> set:
  """The mesh axis names a partition spec (tuple form) names."""
  names = set()
  for entry in spec:
    if isinstance(entry, str):
      names.add(entry)
    elif isinstance(entry, (tuple, list)):
      names.update(a for a in entry if isinstance(a, str))
  return names


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
  for name, param, var in _layer_params(layer):
    value = var.get_value()
    spec = head_param_spec(name, param, head_axis)
    if spec is None:
      spec = metadata_spec(var) or (None,) * value.ndim
    target = sharding.named(mesh, P(*spec))
    if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer):
      if value.sharding.is_equivalent_to(target, value.ndim):
        continue
      var.set_value(jax.device_put(value, target))
    else:
      var.set_value(sharding.constrain(value, mesh, P(*spec)))


def _layer_params(layer):
  """(projection, parameter name, nnx.Param) of the layer's projections, and its `sinks` when it has them."""
  for name in _PROJECTIONS:
    module = getattr(layer, name, None)
    if not isinstance(module, nnx.Module):
      continue
    for path, var in nnx.iter_graph(module):
      if isinstance(var, nnx.Param):
        yield name, path[-1], var
  sinks = getattr(layer, "sinks", None)
  if isinstance(sinks, nnx.Param):
    yield "sinks", "sinks", sinks


def check_v_head_dim(v_head_dim, head_dim: int) -> int:
  """The value head dim of a layer: `v_head_dim`, or the q/k `head_dim` when None."""
  if v_head_dim is None:
    return head_dim
  if not isinstance(v_head_dim, numbers.Integral) or isinstance(v_head_dim, bool) or v_head_dim < 1:
    raise ValueError(
      f"v_head_dim must be a positive int (the value projection's head dim, as in MLA) or None (the q/k head dim "
      f"{head_dim}), got {v_head_dim=!r}"
    )
  return int(v_head_dim)


def build_head_options(layer, *, use_sinks, v_head_dim, kwargs, metadata, mesh, head_axis):
  """The layers' options beyond nnx.MultiHeadAttention, applied to a layer `super().__init__` just built.

  `v_head_dim` (MLA): the value projection becomes [in_kv_features] -> [K, Hv] and the out projection
  [N, Hv] -> [out_features], built with the same initialisers, dtypes, precision, dot_general and metadata as
  flax builds them (`kwargs`: the caller's keywords; `metadata`: what the layer passed to flax); q and k keep
  `head_dim`.  `use_sinks`: a learnable `sinks` parameter [N] (one logit per q head, zeros, `param_dtype`),
  typed over `head_axis` like the kernels' head dimension.
  """
  validation.check_bool("use_sinks", use_sinks)
  layer.v_head_dim = check_v_head_dim(v_head_dim, layer.head_dim)
  rngs = kwargs["rngs"]
  if layer.v_head_dim != layer.head_dim:
    option = lambda name: kwargs.get(name, _FLAX_DEFAULTS[name])  # noqa: E731
    common = dict(
      dtype=layer.dtype,
      param_dtype=layer.param_dtype,
      use_bias=layer.use_bias,
      precision=layer.precision,
      rngs=rngs,
    )
    layer.value = nnx.LinearGeneral(
      layer.in_kv_features,
      out_features=(layer.num_kv_heads, layer.v_head_dim),
      kernel_init=option("kernel_init"),
      bias_init=option("bias_init"),
      promote_dtype=layer.qkv_promote_dtype,
      dot_general=layer.qkv_dot_general,
      dot_general_cls=layer.qkv_dot_general_cls,
      kernel_metadata=metadata["kernel_metadata"],
      bias_metadata=metadata["bias_metadata"],
      **common,
    )
    layer.out = nnx.LinearGeneral(
      in_features=(layer.num_heads, layer.v_head_dim),
      out_features=layer.out_features,
      axis=(-2, -1),
      kernel_init=option("out_kernel_init") or option("kernel_init"),
      bias_init=option("out_bias_init") or option("bias_init"),
      promote_dtype=layer.out_promote_dtype,
      dot_general=layer.out_dot_general,
      dot_general_cls=layer.out_dot_general_cls,
      kernel_metadata=metadata["out_kernel_metadata"] or metadata["kernel_metadata"],
      bias_metadata=metadata["out_bias_metadata"] or metadata["bias_metadata"],
      **common,
    )
  layer.sinks = nnx.data(None)
  if use_sinks:
    placement = {}
    if head_axis is not None or mesh is not None:
      placement = {"out_sharding": (head_axis,), **({"mesh": mesh} if mesh is not None else {})}
    layer.sinks = nnx.Param(jnp.zeros((layer.num_heads,), layer.param_dtype), **placement)

"""`convert`: swap every `nnx.MultiHeadAttention` of a model for the library's layers, in place.

The model's code is not touched: the new layer takes over the old one's
projection submodules (`query`, `key`, `value`, `out` and the optional q/k
norms) as they are, so weights, dtypes, initialisers, `dot_general`s and
parameter metadata (partitioning included) carry over exactly, and so does its
dropout stream (`rngs`).  Every constructor option of the old layer is passed
to the new one; `layer_options` add the library's own (`head_axis`,
`load_balance`, `implementation`, ...).

With a `mesh`, the rest of the model's arrays that are still on one device
(flax creates them there) are replicated on the mesh too: from the first
swapped layer on the activations are mesh-sharded, and with Explicit axes a
parameter gradient contracted over sequence-sharded activations (an MLP
kernel's, an embedding's) must know its mesh, or the first training step fails
with `ShardingTypeError: Contracting dimensions are sharded`.  Arrays already
on the mesh's devices are left as they are (`placement.replicate_off_mesh`, which
`place_on_mesh` shares: call it on an optimizer built after convert).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
from flax import nnx
from flax.nnx.nn.attention import dot_product_attention

from flax_ringattn._src import sharding
from flax_ringattn._src.nnx import handwritten
from flax_ringattn._src.nnx.common import (
  _PROJECTIONS,
  head_param_spec,
  metadata_spec,
  place_params,
  spec_axes,
  warn_if_ring_of_one,
)
from flax_ringattn._src.nnx.handwritten_paged import PagedSiteOptions
from flax_ringattn._src.nnx.paged_mha import PagedMultiHeadAttention
from flax_ringattn._src.nnx.placement import replicate_off_mesh
from flax_ringattn._src.nnx.ring_mha import RingMultiHeadAttention
from flax_ringattn._src.paged import step as paged_step
from flax_ringattn._src.ring.options import RingOptions

# Constructor options of nnx.MultiHeadAttention read back from a built layer.
_OPTIONS = (
  "qkv_features",
  "out_features",
  "num_kv_heads",
  "in_kv_features",
  "dtype",
  "param_dtype",
  "broadcast_dropout",
  "dropout_rate",
  "deterministic",
  "precision",
  "use_bias",
  "normalize_qk",
  "qkv_promote_dtype",
  "out_promote_dtype",
  "ln_promote_dtype",
)


@dataclasses.dataclass
class ConversionReport:
  """What `convert` did.

  `replaced` / `skipped` (path, reason): the `nnx.MultiHeadAttention` layers.  `watched`: the model's own
  modules that look for attention written by hand at their first call; `sites` (`SiteReport`s, filled at the
  first call, or at once with `convert(..., example=...)`): each hand-written attention found, converted
  (with what was recognised: heads and groups, q/k and v head dims, scale, soft cap, window, mask kind, sinks,
  softmax) or left alone (with the reason).  `converted` and `left_alone` list them by kind.  `to`: "ring" or
  "paged"; `placed`: the model's other arrays moved from one device to the mesh; `untraceable`: watched modules
  that only run eagerly; `own_code` (path, reason): watched modules that ran their own code for a reason that
  can hide attention (a cache argument, an NNX object argument they write to, a call that cannot be traced);
  `called`: whether a watched module has run (or `example=` did).  `print(report)` shows all of it.
  """

  to: str
  replaced: list[str] = dataclasses.field(default_factory=list)
  skipped: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  placed: list[str] = dataclasses.field(default_factory=list)  # other arrays moved from one device to the mesh
  watched: list[str] = dataclasses.field(default_factory=list)
  sites: list = dataclasses.field(default_factory=list)
  untraceable: list[str] = dataclasses.field(default_factory=list)  # watched modules that only run eagerly
  # (path, reason) of each watched module that ran its own code for a reason that can hide attention from the
  # matcher: a cache argument, an NNX object argument it writes to, a call that cannot be traced.
  own_code: list[tuple[str, str]] = dataclasses.field(default_factory=list)
  called: bool = False  # a watched module has been called (or `example=` ran)

  def add_site(self, site) -> None:
    if not any(s.path == site.path and s.converted == site.converted for s in self.sites):
      self.sites.append(site)

  def add_own_code(self, path: str, reason: str) -> None:
    if (path, reason) not in self.own_code:
      self.own_code.append((path, reason))

  @property
  def converted(self):
    return [s for s in self.sites if s.converted]

  @property
  def left_alone(self):
    return [s for s in self.sites if not s.converted]

  def __str__(self) -> str:
    converted = len(self.replaced) + len(self.converted)
    lines = [
      f"convert(to={self.to!r}): {converted} converted ({len(self.replaced)} nnx.MultiHeadAttention replaced, "
      f"{len(self.converted)} hand-written), {len(self.skipped) + len(self.left_alone)} left alone"
    ]
    lines += [f"  replaced {path}" for path in self.replaced]
    lines += [f"  kept     {path}: {why}" for path, why in self.skipped]
    if self.watched:
      lines.append(
        f"  hand-written attention: {len(self.converted)} converted, {len(self.left_alone)} left alone"
        + ("" if self.called else f" (found at the first call; {len(self.watched)} modules watched)")
      )
      lines += [f"  converted {s}" for s in self.converted]
      lines += [f"  left     {s}" for s in self.left_alone]
      lines += [f"  own code {path}: {reason}" for path, reason in self.own_code]
    if self.placed:
      lines.append(f"  {len(self.placed)} other arrays of the model replicated on the mesh (they were on one device)")
    return "\n".join(lines)


def _path_name(path) -> str:
  return ".".join(str(p) for p in path) or "<root>"


def _child(parent, key):
  if isinstance(parent, (nnx.List, nnx.Dict, list, dict)):
    return parent[key]
  return getattr(parent, key)


def _set_child(parent, key, value):
  if isinstance(parent, (nnx.List, nnx.Dict, list, dict)):
    parent[key] = value
  else:
    setattr(parent, key, value)


def _why_not(layer, to: str) -> str | None:
  if isinstance(layer, (RingMultiHeadAttention, PagedMultiHeadAttention)):
    return f"already a {type(layer).__name__}"
  if layer.attention_fn is not dot_product_attention:
    return (
      f"custom attention_fn={getattr(layer.attention_fn, '__name__', layer.attention_fn)!r}: convert replaces "
      "layers whose attention is flax's dot_product_attention (or pass flax_ringattn.make_ring_attention_fn yourself)"
    )
  if to == "ring" and layer.decode:
    return "decode=True: a sampling layer with flax's KV cache; convert(model, to='paged') gives sampling layers"
  if getattr(layer, "cached_key", None) is not None:
    return "its autoregressive cache is initialised (init_cache): convert before init_cache"
  return None


def _new_layer(old, to: str, mesh, seq_axis, layer_options):
  options = {name: getattr(old, name) for name in _OPTIONS}
  options["keep_rngs"] = old.rngs is not None
  common = dict(mesh=mesh, rngs=nnx.Rngs(0), **options)
  try:
    if to == "ring":
      return RingMultiHeadAttention(
        old.num_heads, old.in_features, seq_axis=seq_axis, decode=False, **common, **layer_options
      )
    # Sampling is deterministic: the paged layer has no dropout.  seq_axis spreads its cache's pages.
    common.update(dropout_rate=0.0, keep_rngs=False)
    return PagedMultiHeadAttention(old.num_heads, old.in_features, seq_axis=seq_axis, **common, **layer_options)
  except TypeError as e:
    layer = "RingMultiHeadAttention" if to == "ring" else "PagedMultiHeadAttention"
    raise TypeError(f"convert(..., **layer_options): {layer} does not take these options ({e})") from e


def _take_over(new, old, head_axis, mesh):
  """The new layer takes the old one's projections; their metadata learns the mesh placement."""
  for name in _PROJECTIONS:
    setattr(new, name, getattr(old, name))
  if old.rngs is not None:
    new.rngs = old.rngs
  if mesh is None:
    return
  for name in _PROJECTIONS:
    module = getattr(new, name)
    if not isinstance(module, nnx.Module):
      continue
    for path, var in nnx.iter_graph(module):
      if not isinstance(var, nnx.Param):
        continue
      spec = head_param_spec(name, path[-1], head_axis) or metadata_spec(var) or (None,) * var.get_value().ndim
      missing = spec_axes(spec) - set(mesh.axis_names)
      if missing:
        raise ValueError(
          f"convert: the partitioning metadata of {name}.{_path_name(path)} names mesh axes {sorted(missing)} that "
          f"mesh={dict(mesh.shape)} lacks (its spec {spec}); pass the mesh the model was partitioned for, or one "
          "with those axes (logical axis names, such as 'embed' or 'mlp', must be mapped to mesh axes by your "
          "sharding rules before convert)"
        )
      var.set_metadata(out_sharding=spec, mesh=mesh)
  place_params(new, mesh, head_axis)


class _Undo:
  """What `convert` changed, to put back when any step fails: every variable's value and metadata as they were
  before (taken once, up front), and the module swaps and class changes in reverse order."""

  def __init__(self, model):
    self.variables = [
      (var, var.get_raw_value(), dict(var.get_metadata()))
      for _, var in nnx.iter_graph(model)
      if isinstance(var, nnx.Variable)
    ]
    self.steps = []

  def restore(self):
    for step in reversed(self.steps):
      step()
    for var, value, metadata in self.variables:
      var.set_raw_value(value)
      var.set_metadata(metadata)


def convert(
  model,
  *,
  to: str = "ring",
  mesh=None,
  seq_axis=None,
  handwritten: bool = True,
  example=None,
  **layer_options,
) -> ConversionReport:
  """Replaces, in place, every `nnx.MultiHeadAttention` of `model` by the library's layer.

  Args:
    model: an `nnx.Module` (any graph: attributes, `nnx.List`, `nnx.Dict`).
    to: "ring" (`RingMultiHeadAttention`: training and prefill with the
      sequence sharded over `seq_axis`) or "paged" (`PagedMultiHeadAttention`:
      sampling from a paged KV cache; call `init_cache` on each layer).
    mesh: the `jax.sharding.Mesh` the layers run on (parameters are placed on
      it: replicated, or over `head_axis`; the model's other arrays still on
      one device are replicated on it).
    seq_axis: mesh axis of the sequence.  Ring: the activations' sequence
      axis (default: the mesh's only axis).  Paged: the axis the KV cache's
      pages spread over (context parallelism, see "Serving long contexts";
      default: none, the pages are not spread; combines with `head_axis`).
    handwritten: also convert attention written by hand in the
      model's own modules (einsum or matmul logits, scale, tanh cap,
      `where` mask or additive bias, softmax, einsum with v; MHA, grouped or
      repeated GQA; a v head dim other than q/k's, as in MLA; attention
      sinks written as a per-head logit column joined before the softmax
      and dropped after it, as in gpt-oss, whose gradient reaches the
      model's parameter): the innermost module holding such a block runs it
      as ring attention over `seq_axis`, with the mask recovered from the
      model's own (see "Hand-written attention" in the README).  With
      to="paged" each such site serves from its own paged KV cache instead
      (the k and v the model computes are written into it; each sequence is
      causal over its own cache, with the site's window, soft cap and sinks;
      the model's mask is not used): serve the model with `ServingEngine`.
    example: optional `fn(model)` calling the model once as training will
      (e.g. `lambda m: m(tokens, positions, mask)`); run abstractly (no
      compute, the model unchanged) so the report lists the hand-written
      sites at once instead of after the first real call (to="paged": any
      batch shape; nothing is attended).
    **layer_options: more keyword options of the new layer, e.g. `head_axis`,
      `batch_axis`, `load_balance`, `implementation`, `block_sizes`,
      `local_window_size`, `logits_soft_cap`, `check_mask`.  Hand-written
      sites use `strategy`, `implementation`, `block_sizes`, `batch_axis`,
      `head_axis`, `interpret`, `check_mask` and `local_window_size`: a
      window the model builds from data (e.g. from positions) must be
      declared, as w, (left, right), or a function of the attention module
      returning one or None (for models whose layers differ, e.g.
      `lambda m: m.sliding_window_size if m.attn_type == LOCAL else None`).

  Returns:
    A `ConversionReport`: the paths replaced and, for each attention layer
    left alone, why (a custom `attention_fn`, `decode=True` for the ring, ...).
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be a flax.nnx.Module, got {type(model).__name__}")
  if to not in ("ring", "paged"):
    raise ValueError(f"{to=} must be 'ring' or 'paged'")
  if example is not None and not callable(example):
    raise TypeError(
      f"convert: example must be a function of the model, called as example(model) (e.g. example=lambda m: "
      f"m(tokens, positions)), got a {type(example).__name__}; wrap the inputs in such a function"
    )
  if to == "paged" and seq_axis is not None and mesh is None:
    raise ValueError(f"convert(to='paged'): {seq_axis=} needs mesh=... (the mesh the cache's pages spread over)")
  # Checked before anything is replaced, so a wrong axis leaves the model as it was.
  sharding.check_mesh_axes(
    mesh,
    where="convert",
    seq_axis=seq_axis,
    head_axis=layer_options.get("head_axis"),
    batch_axis=layer_options.get("batch_axis"),
  )
  report = ConversionReport(to=to)
  undo, stage = _Undo(model), "reading the model"
  try:
    found = [(path, node) for path, node in nnx.iter_graph(model) if isinstance(node, nnx.MultiHeadAttention)]
    for path, old in found:
      why = _why_not(old, to)
      if why is None and not path:
        why = "the model itself is the attention layer: build the library's layer directly"
      if why is not None:
        report.skipped.append((_path_name(path), why))
        continue
      stage = f"replacing {_path_name(path)}"
      new = _new_layer(old, to, mesh, seq_axis, layer_options)
      _take_over(new, old, layer_options.get("head_axis"), mesh)
      parent = model
      for key in path[:-1]:
        parent = _child(parent, key)
      _set_child(parent, path[-1], new)
      undo.steps.append(lambda parent=parent, key=path[-1], old=old: _set_child(parent, key, old))
      report.replaced.append(_path_name(path))
    if handwritten:
      stage = "watching the model's own modules for hand-written attention"
      _watch_handwritten(model, to, mesh, seq_axis, layer_options, report, undo)
    if mesh is not None and (report.replaced or report.watched):
      stage = "placing the model's other arrays on the mesh"
      report.placed = replicate_off_mesh(model, mesh)
    if example is not None:
      stage = "running example=..."
      graphdef, state = nnx.split(model)
      # Paged sites attend only inside a serving step: the example runs as the engine's discovery does.
      scope = paged_step.serving_step(paged_step.Step("discover")) if to == "paged" else contextlib.nullcontext()
      with scope:
        jax.eval_shape(lambda st: example(nnx.merge(graphdef, st)), state)
      report.called = True
  except BaseException as e:
    undo.restore()
    e.add_note(
      f"convert(to={to!r}) failed while {stage}; the model is as it was before convert (its modules, their classes, "
      "every parameter's value and metadata)"
    )
    raise
  return report


_HANDWRITTEN_OPTIONS = (
  "strategy",
  "implementation",
  "block_sizes",
  "batch_axis",
  "head_axis",
  "interpret",
  "check_mask",
  "local_window_size",
)


# The options a hand-written site served from a paged cache takes (`to="paged"`).
_HANDWRITTEN_PAGED_OPTIONS = ("implementation", "block_sizes", "interpret", "checked", "local_window_size")


def _watch_handwritten(model, to, mesh, seq_axis, layer_options, report, undo):
  if to == "paged":
    options = PagedSiteOptions(
      mesh=mesh,
      seq_axis=seq_axis,
      **{k: layer_options[k] for k in _HANDWRITTEN_PAGED_OPTIONS if k in layer_options},
    )
  else:
    options = RingOptions(
      mesh=mesh,
      axis_name=sharding.sequence_axis(mesh, seq_axis, arg="seq_axis"),
      **{k: layer_options[k] for k in _HANDWRITTEN_OPTIONS if k in layer_options},
    )
    if mesh is not None:
      warn_if_ring_of_one(mesh, options.axis_name, where="convert(to='ring')")
  classes: dict = {}
  nodes = [(path, node) for path, node in nnx.iter_graph(model) if handwritten.is_user_module(node)]
  for path, node in nodes:
    undo.steps.append(functools.partial(handwritten.unwatch, node, type(node)))
    handwritten.watch(node, _path_name(path), options, report, classes)
    report.watched.append(_path_name(path))

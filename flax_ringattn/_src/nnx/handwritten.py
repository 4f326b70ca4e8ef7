"""`convert` for attention written by hand: every user module of a model is watched, and the innermost one
whose call contains an attention pattern runs that attention as ring attention.

Mechanism (the matcher: `_src/matcher/`, one entry point `matcher.find_sites`):

* `watch` gives each user-defined module of the model (not flax's own classes) a subclass whose `__call__`
  first traces the original call to a jaxpr, with the module functionalised (`nnx.split` / `nnx.merge`) and
  avals stripped of shardings, and looks for attention sites in it.
* While a module is traced, the watched modules it calls trace themselves too ("nested discovery").  When one
  of them holds a site, the outer module runs its own code unchanged and leaves the rewrite to it: the site
  belongs to the innermost module, so `nnx.remat`, `nnx.scan` and python loops around layers keep working,
  and the report names the attention module itself.
* The module holding sites evaluates its jaxpr equation by equation, computing each site with
  `masked_ring_attention` on the model's own q, k, v and mask and never the site's logits; its new state
  (caches, counters) is written back with `nnx.update`.
* A call that passes a non-None argument named like `*cache*` (sampling) runs the model's code unchanged,
  and so does a site whose queries and keys differ in length.  NNX objects passed as arguments travel in the
  split with the module; a call that writes to one runs the model's code.  A module left to its own code for
  such a reason traces it under `OPAQUE_SCOPE` inside its caller's discovery, so the caller does not convert
  that attention in its place, and the report lists it (`own_code`).
* Remat bodies (`nnx.remat`, `jax.checkpoint`) inside the call are looked through (`Program.flatten`) and run
  inside `jax.checkpoint` again with their policy; dead equations are pruned before matching.
* The converted call writes back only the variables it changed (`nnx.update` of a variable merged at another
  trace level, unchanged, would fail under `jax.jit` of `nnx.split` / `nnx.merge`).
* Attention sinks written as a logit column joined before the softmax and dropped after it (gpt-oss) are
  recognised around the matcher (`matcher/sinks.py`) and passed to the op as `sinks=`; a value head dim
  other than q/k's (MLA) is read from the second einsum.
* Plans are cached per module class on the call's structure, static arguments and avals: a jitted step
  traces once, an eager loop traces once per shape.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import threading

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from flax_ringattn._src import matcher
from flax_ringattn._src.nnx.handwritten_paged import PagedSiteFn, PagedSiteOptions
from flax_ringattn._src.ring.dense import bias_as_mask, context_mesh, masked_ring_attention
from flax_ringattn._src.ring.options import RingOptions


@dataclasses.dataclass
class SiteReport:
  """One attention written by hand: where, what was recognised, and whether it runs as ring attention."""

  path: str
  module: str
  converted: bool
  details: dict = dataclasses.field(default_factory=dict)
  reason: str = ""

  def __str__(self) -> str:
    if not self.converted:
      return f"{self.path} ({self.module}): {self.reason}"
    d = self.details
    parts = [
      f"heads {d['q_heads']}/{d['kv_heads']} (groups {d['groups']}{', kv repeated' if d['kv_repeated'] else ''})"
    ]
    if d.get("v_head_dim", d["head_dim"]) != d["head_dim"]:
      parts.append(f"head dims q/k {d['head_dim']}, v {d['v_head_dim']}")
    parts.append(f"scale {d['scale']:.6g}" + (f" (q pre-scaled by {d['scale_on_q']:.6g})" if d["scale_on_q"] else ""))
    if d["soft_cap"] is not None:
      parts.append(f"soft cap {d['soft_cap']:.6g}")
    if d.get("paged"):
      if d["window"] is not None:
        parts.append(f"window {d['window']} (its causal side in serving)")
      parts.append(f"the model's mask ({d['mask']}) not used: each sequence causal over its own paged cache")
    else:
      parts.append(f"mask {d['mask']}: {mask_structure(d)}")
    if d.get("sinks"):
      parts.append("sinks")
    parts.append(f"softmax {d['softmax']}")
    return f"{self.path} ({self.module}): " + ", ".join(parts)


def mask_structure(d) -> str:
  """The structure of a site's mask in words (`details` of a `SiteReport`): what the model's code fixes with
  constants (causal, a window), a window declared to convert, and what is recovered from its data at each call."""
  terms = ["causal"] if d.get("mask_causal") else []
  if d["window"] is not None:
    terms.append(f"window {d['window']}")
  if d.get("mask_from_data"):
    which = "segments, padding, spans" if d.get("mask_causal") else "causal or not, segments, padding, spans"
    rest = "the rest " if terms else ""
    terms.append(f"{rest}recovered from the model's mask at each call ({which})")
  if terms:
    return ", ".join(terms)
  if d["mask"] == "none":
    return "bidirectional (every query sees every key)"
  return "a constant mask, recovered at each call"


def declared_window(options: RingOptions, module):
  """The window `convert` was told a watched module uses: `options.local_window_size` is w, (left, right), None,
  or fn(module) -> one of those, for models whose layers differ (Gemma's local and global layers)."""
  w = options.local_window_size
  return w(module) if callable(w) else w


_LOCAL = threading.local()


def _discovering() -> bool:
  return getattr(_LOCAL, "depth", 0) > 0


class _Discovery:
  """Marks a trace of a module's original call; the watched modules it calls add the sites (and rejected
  sites) their own traces hold to its counters."""

  def __enter__(self):
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    self.outer = (getattr(_LOCAL, "sites", 0), getattr(_LOCAL, "rejects", 0))
    _LOCAL.sites, _LOCAL.rejects = 0, 0
    return self

  def __exit__(self, *exc):
    self.child_sites, self.child_rejects = _LOCAL.sites, _LOCAL.rejects
    _LOCAL.sites, _LOCAL.rejects = self.outer
    _LOCAL.depth -= 1
    return False


def _count_in_enclosing(plan):
  """Tells the module whose trace called this one how many sites this call holds."""
  if _discovering():
    _LOCAL.sites = getattr(_LOCAL, "sites", 0) + plan.total_sites
    _LOCAL.rejects = getattr(_LOCAL, "rejects", 0) + plan.total_rejects


@dataclasses.dataclass
class _Plan:
  program: matcher.Program | None
  sites: list
  out_tree: object = None
  dyn_index: tuple = ()
  sinks: dict = dataclasses.field(default_factory=dict)  # g2 -> matcher.SinkRef
  delegated: bool = False
  total_sites: int = 0  # sites in this call's jaxpr, its watched children's included
  total_rejects: int = 0
  own_code: bool = False  # the call writes to an NNX object argument: the model's code runs


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, jax.core.Tracer))


def _abstract(x):
  return jax.ShapeDtypeStruct(np.shape(x), x.dtype)


_signature = functools.lru_cache(maxsize=None)(inspect.signature)


def _uses_cache(call, module, args, kwargs) -> bool:
  try:
    bound = _signature(call).bind(module, *args, **kwargs)
  except TypeError:
    return False
  return any("cache" in name.lower() and value is not None for name, value in bound.arguments.items())


_NODE = "<nnx object argument>"  # where an NNX object sits among a call's arguments (it travels in the split)


def _plan(module, call, split, flat, node_index=()):
  """The traced and matched plan of this call (cached on the class); records the report.

  split: `nnx.split((module, *nodes))`, the module with the NNX objects passed as arguments (at `node_index`
  among the flattened arguments); flat: `jax.tree.flatten((args, kwargs))` with NNX objects as leaves (both also
  serve `_run`).
  """
  cls = type(module)
  graphdef, state = split
  leaves, treedef = flat
  dyn_index = tuple(i for i, x in enumerate(leaves) if _is_array(x))
  statics = tuple(None if i in dyn_index else _NODE if i in node_index else x for i, x in enumerate(leaves))
  state_avals = tuple((tuple(np.shape(x)), str(x.dtype)) for x in jax.tree.leaves(state))
  dyn_avals = tuple((tuple(np.shape(leaves[i])), str(leaves[i].dtype)) for i in dyn_index)
  key = (graphdef, treedef, statics, state_avals, dyn_avals)
  try:
    hash(key)
  except TypeError:
    key = None
  cache = cls._fr_plans
  if key is not None and key in cache:
    plan = cache[key]
    _count_in_enclosing(plan)
    return plan

  def original(state, dyn):
    full = list(leaves)
    m, *nodes = nnx.merge(graphdef, state)
    for i, node in zip(node_index, nodes, strict=True):
      full[i] = node
    for i, x in zip(dyn_index, dyn, strict=True):
      full[i] = x
    a, kw = jax.tree.unflatten(treedef, full)
    out = call(m, *a, **kw)
    return out, nnx.state((m, *nodes))

  path = getattr(module, "_fr_path", cls.__name__)
  with _Discovery() as found:
    try:
      closed, out_shape = jax.make_jaxpr(original, return_shape=True)(
        jax.tree.map(_abstract, state), [_abstract(leaves[i]) for i in dyn_index]
      )
    except Exception as e:  # noqa: BLE001 (a call that only runs eagerly, e.g. one reading values on the host)
      # Not traceable on abstract values: the module runs its own code, as before convert.
      cls._fr_report.untraceable.append(f"{path}: {type(e).__name__}: {e}")
      cls._fr_report.add_own_code(path, f"its call cannot be traced on abstract values ({type(e).__name__}: {e})")
      plan = _Plan(None, [])
      if key is not None:
        cache[key] = plan
      return plan
  written = _written_arguments(closed, state, out_shape, len(node_index))
  if written:
    # The call writes to an NNX object it was given (rngs it draws from, a cache it fills): run the model's own
    # code, which updates that object as before convert.
    cls._fr_report.add_own_code(
      path, f"writes to the NNX object passed as argument ({', '.join(written)}): runs its own code"
    )
    plan = _Plan(None, [], own_code=True)
    if key is not None:
      cache[key] = plan
    return plan
  program = matcher.Program.flatten(closed).dce()
  sites, rejected, sinks = matcher.find_sites(program)
  if not sites and not rejected and not found.child_sites and not found.child_rejects:
    hidden = _attention_in_loop_body(closed.jaxpr)
    if hidden:
      cls._fr_report.add_own_code(
        path,
        f"a contraction and an exp (attention?) inside a {hidden} body, which convert does not look into: runs its "
        "own code (a module called in the body, as with nnx.scan over layers, converts)",
      )
  # The children hold all of this call's sites: they convert them.  A site of this module's own code (attention
  # inline beside attention children) makes this module convert every site of its call itself.
  delegated = bool(sites) and len(sites) <= found.child_sites
  plan = _Plan(
    program,
    [] if delegated else sites,
    jax.tree.structure(out_shape),
    dyn_index,
    sinks=sinks,
    delegated=delegated,
    total_sites=len(sites),
    total_rejects=len(rejected),
  )
  _record(module, plan.sites, rejected if len(rejected) > found.child_rejects else [], sinks)
  _count_in_enclosing(plan)
  if key is not None:
    cache[key] = plan
  return plan


_LOOPS = {"scan": ("jaxpr",), "while": ("body_jaxpr", "cond_jaxpr"), "cond": ("branches",)}


def _attention_in_loop_body(jaxpr, depth: int = 4) -> str | None:
  """The first loop / cond primitive whose body holds a dot_general and an exp, else None."""
  for e in jaxpr.eqns:
    for key in _LOOPS.get(e.primitive.name, ()):
      bodies = e.params[key]
      for body in bodies if isinstance(bodies, (tuple, list)) else (bodies,):
        inner = getattr(body, "jaxpr", body)
        if _has_attention_ops(inner, depth):
          return f"lax.{e.primitive.name}"
  return None


def _has_attention_ops(jaxpr, depth: int) -> bool:
  names = set()

  def scan(jx, d):
    for e in jx.eqns:
      names.add(e.primitive.name)
      for value in e.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
          inner = getattr(sub, "jaxpr", sub)
          if d and hasattr(inner, "eqns"):
            scan(inner, d - 1)

  scan(jaxpr, depth)
  return "dot_general" in names and "exp" in names


def _leaf_ranges(state, offset: int = 0) -> dict:
  """path -> (first, end) of each variable's leaves among `jax.tree.leaves(state)` shifted by `offset` (a
  variable holding None has none, one holding a tuple several)."""
  ranges, n = {}, offset
  for path, var in nnx.to_flat_state(state):
    count = len(jax.tree.leaves(var))
    ranges[path] = (n, n + count)
    n += count
  return ranges


def _written_arguments(closed, state, out_shape, num_nodes: int) -> list[str]:
  """The NNX objects passed as arguments (keys 1..num_nodes of `state`) whose variables the traced call writes
  (an output leaf that is not its input leaf passed through, or a variable the call adds): where, or []."""
  if not num_nodes:
    return []
  jaxpr = closed.jaxpr
  before = _leaf_ranges(state)
  after = _leaf_ranges(out_shape[1], offset=len(jax.tree.leaves(out_shape[0])))
  written = []
  for path, (start, end) in after.items():
    if path[0] == 0:
      continue
    old = before.get(path)
    passed_through = (
      old is not None
      and old[1] - old[0] == end - start
      and all(jaxpr.outvars[o] is jaxpr.invars[i] for o, i in zip(range(start, end), range(*old), strict=True))
    )
    if not passed_through:
      written.append(f"argument {path[0] - 1}: {'.'.join(map(str, path[1:]))}")
  return written


def _unchanged(new, old) -> bool:
  """Whether a variable's value is the one it had, leaf by leaf (a tuple value is a new container every time)."""
  new_leaves, new_tree = jax.tree.flatten(new.get_raw_value())
  old_leaves, old_tree = jax.tree.flatten(old.get_raw_value())
  return new_tree == old_tree and all(a is b for a, b in zip(new_leaves, old_leaves, strict=True))


def _record(module, sites, rejected, sinks):
  report = type(module)._fr_report
  path = getattr(module, "_fr_path", type(module).__name__)
  name = type(module)._fr_original.__name__
  declared = declared_window(type(module)._fr_options, module) if sites else None
  for n, site in enumerate(sites):
    where = path if len(sites) == 1 else f"{path}[{n}]"
    details = site.describe()
    details["v_head_dim"] = site.sizes["Hv"]
    details["sinks"] = site.g2 in sinks
    if declared is not None:
      details["window"] = f"{declared} (declared)"
    details["paged"] = isinstance(type(module)._fr_options, PagedSiteOptions)
    report.add_site(SiteReport(where, name, True, details))
  for n, rej in enumerate(rejected):
    where = path if len(rejected) == 1 else f"{path}[{n}]"
    report.add_site(SiteReport(where, name, False, reason=rej.reason))


def _run(root, plan: _Plan, state, leaves):
  """Runs the plan's program on (module, *nodes) `root` and writes back the variables the call changed (only
  those: a variable merged at another trace level that the call only reads must not be written)."""
  module = root[0]
  opts: RingOptions = type(module)._fr_options
  inputs = [*jax.tree.leaves(state), *(leaves[i] for i in plan.dyn_index)]
  replace = {}
  declared = declared_window(opts, module)
  for n, site in enumerate(plan.sites):
    if isinstance(opts, PagedSiteOptions):
      replace[site.g2] = PagedSiteFn(site, module, n, opts, declared, plan.sinks.get(site.g2))
    else:
      replace[site.g2] = _SiteFn(site, opts, declared, plan.sinks.get(site.g2))
  skip = set().union(*(s.interior for s in plan.sites))
  outs = plan.program.run(inputs, replace=replace, skip=skip)
  out, new_state = jax.tree.unflatten(plan.out_tree, outs)
  before = dict(nnx.to_flat_state(state))
  changed = [
    (path, new) for path, new in nnx.to_flat_state(new_state) if path not in before or not _unchanged(new, before[path])
  ]
  if changed:
    nnx.update(root, nnx.from_flat_state(changed))
  for fn in replace.values():  # after the update, which would write back the caches the program read
    if isinstance(fn, PagedSiteFn):
      fn.store()
  return out


class _SiteFn:
  """The replacement of one site's second dot_general (its `inputs` keep those values alive)."""

  def __init__(self, site, opts, declared_window=None, sinks=None):
    self.site, self.opts, self.declared, self.sinks = site, opts, declared_window, sinks
    self.inputs = site.inputs + ([sinks.atom] if sinks is not None else [])

  def __call__(self, read):
    site, opts = self.site, self.opts
    q, k, v, masks = matcher.site_inputs(site, read)
    k, v = k.astype(q.dtype), v.astype(q.dtype)
    mask, exact = None, None
    for kind, negate, arr in masks:
      if kind == "mask":
        # The model's own bool mask is read as it is: every extra elementwise op would make XLA hold a
        # [B, T, S] copy for the several reductions of the recovery.
        vis = arr if arr.dtype == jnp.bool_ and not negate else (arr != 0) != negate
      else:
        vis, ok = bias_as_mask(arr)
        exact = ok if exact is None else exact & ok
      mask = vis if mask is None else mask & vis
    window = self.declared if self.declared is not None else site.window
    precision = site.precision[0] if isinstance(site.precision, tuple) else site.precision
    options = opts.replace(
      mesh=context_mesh(opts.mesh, opts.axis_name),
      scale=site.scale,
      logits_soft_cap=site.cap,
      local_window_size=window,
      precision=precision,
    )
    mask = None if mask is None else mask[:, None]
    sinks = None if self.sinks is None else matcher.read_sinks(site, self.sinks, read)
    out = masked_ring_attention(q, k, v, options, mask=mask, also_exact=exact, sinks=sinks)
    return matcher.site_output(site, out)


def _own_code(call, module, args, kwargs):
  """The model's own call, traced (inside a module's discovery) under the scope the matcher never converts, so
  the calling module does not convert in its place what this one was left to run as written."""
  if not _discovering():
    return call(module, *args, **kwargs)
  with jax.named_scope(matcher.OPAQUE_SCOPE):
    return call(module, *args, **kwargs)


def _watched_call(self, *args, **kwargs):
  cls = type(self)
  call = cls._fr_original.__call__
  report = cls._fr_report
  report.called = True
  if _uses_cache(call, self, args, kwargs):
    report.add_own_code(
      getattr(self, "_fr_path", cls.__name__),
      "called with a cache argument (a parameter named like *cache* not None: sampling): runs its own code; "
      "calls without a cache (training, prefill) convert",
    )
    return _own_code(call, self, args, kwargs)
  # NNX objects passed in (rngs, a module, a table of constants) travel in the split with the module; a call
  # that writes to one runs the model's own code (`_plan`).
  leaves, treedef = jax.tree.flatten((args, kwargs), is_leaf=nnx.graph.is_graph_node)
  node_index = tuple(i for i, x in enumerate(leaves) if nnx.graph.is_graph_node(x))
  root = (self, *(leaves[i] for i in node_index))
  split = nnx.split(root)
  plan = _plan(self, call, split, (leaves, treedef), node_index)
  if plan.own_code or plan.program is None:
    return _own_code(call, self, args, kwargs)
  if _discovering() or not plan.sites:
    return call(self, *args, **kwargs)
  return _run(root, plan, split[1], leaves)


def is_user_module(node) -> bool:
  """A module of the model's own code (not flax's or this library's), with its own `__call__`."""
  cls = type(node)
  mod = cls.__module__ or ""
  if mod.startswith(("flax.", "flax_ringattn.")) or getattr(cls, "_fr_original", None) is not None:
    return False
  own = (c for c in cls.__mro__ if c is not object and not (c.__module__ or "").startswith("flax."))
  return isinstance(node, nnx.Module) and any("__call__" in vars(c) for c in own)


def watch(node, path: str, options: RingOptions, report, classes: dict):
  """Gives `node` the watching subclass of its class (one per class and `convert` call)."""
  cls = type(node)
  sub = classes.get(cls)
  if sub is None:
    sub = type(
      cls.__name__,
      (cls,),
      {
        "__call__": _watched_call,
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "_fr_original": cls,
        "_fr_options": options,
        "_fr_report": report,
        "_fr_plans": {},
      },
    )
    classes[cls] = sub
  node.__class__ = sub
  node._fr_path = path


def unwatch(node, cls):
  """Undoes `watch`: `node` is of its own class `cls` again."""
  node.__class__ = cls
  vars(node).pop("_fr_path", None)

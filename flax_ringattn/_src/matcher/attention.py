"""Attention written by hand, found in a jaxpr and run as ring attention.

Decoders in the wild (Gemma, Llama, Qwen styles) write attention as
`einsum -> [scale] -> [tanh cap] -> mask (where / additive bias) -> softmax ->
einsum`.  `find_sites` walks the flattened jaxpr of a module's call and, from
every `dot_general`, follows the values derived from its output (the logits)
forward:

* layout ops (transpose, reshape, size-1 broadcasts, dtype casts) move the
  logits' axes around; each axis is tracked as a tuple of *atoms*, the axes of
  the first `dot_general` (batch pairs `b*`, q-side free `q*`, k-side free `k*`,
  contraction `H`), so a `[B, T, K, G, S]` -> `[B, T, N, S]` merge and its split
  back are followed exactly;
* `mul` / `div` by constants and `tanh` fold into (scale, soft cap);
* `select_n` against a constant <= -1e6 is a boolean mask, `add` of a
  non-constant is an additive bias; both are traced back through broadcasts and
  casts to the array the model built, whose axes map onto atoms;
* `reduce_max` / `sub` / `exp` / `reduce_sum` / `div` (or a `custom_jvp_call`
  whose body is that) is the softmax; its axis is the key axis S;
* the first `dot_general` that contracts S with another array is the
  probabilities times v.

The atoms then say which axes are B, T, S, the kv heads (a batch pair) and the
GQA group (a second q-side free axis), so q, k and v are brought to
`[B, T, N, H]` / `[B, S, K, H]` by reshapes and one transpose each, never
copied per head; `jnp.repeat` of k and v over heads is undone so only the kv
heads travel.  Anything else on the path (dropout on the probabilities, a
per-head mask, a scale applied after the mask, weights returned to the caller)
leaves the site alone with its reason.  `Program.run` then evaluates the
jaxpr, binding every equation as `jax.core.eval_jaxpr` does, except that each
site's second `dot_general` is computed by `dot_product_attention` on the
model's own q, k, v and mask, and the site's interior is never computed.

The matcher (`find_sites`, `_match`) is here; the flattened program and its constants are in
`program.py` (constants too big to build are read at points by `band.py`), the `Site` it builds
and the code that runs one in `site.py` (both re-exported here).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from flax_ringattn._src.masks import BIAS_MASKED
from flax_ringattn._src.matcher.band import const_sample, shape_of
from flax_ringattn._src.matcher.program import (
  INLINE,
  MAX_CONST_ELEMENTS,
  Const,
  Eqn,
  FVar,
  Program,
  const_value,
  is_literal,
  scalar_value,
)
from flax_ringattn._src.matcher.site import (
  Fail,
  MaskRef,
  Rejected,
  Site,
  finish,
  from_atoms,
  mask_ref,
  reshape_layout,
  site_inputs,
  site_output,
  to_atoms,
)

__all__ = [
  "MAX_CONST_ELEMENTS",
  "Const",
  "Eqn",
  "FVar",
  "MaskRef",
  "Program",
  "Rejected",
  "Site",
  "const_value",
  "find_sites",
  "from_atoms",
  "scalar_value",
  "site_inputs",
  "site_output",
  "to_atoms",
]

_LAYOUT = ("transpose", "reshape", "squeeze", "broadcast_in_dim", "convert_element_type", "copy", "copy_p")


# -- the matcher ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Form:
  """What a tracked value computes from the raw logits x: mask(cap * tanh(scale * x / cap)) (no tanh when cap is
  None), per branch: a statistic only combines with the very value it was computed from."""

  scale: float = 1.0
  cap: float | None = None
  masks: tuple = ()
  softmax_dtype: str | None = None


@dataclasses.dataclass
class _Track:
  """What flows from the first dot_general: its layout, how far along the attention it is, and its form."""

  layout: tuple
  stage: str  # logits -> shifted -> exp -> probs
  dtype: str
  form: _Form = _Form()


@dataclasses.dataclass
class _Stat:
  """A row statistic of one tracked value (softmax max or sum over S, or 1 / sum)."""

  kind: str  # "max", "sum", "recip"
  src: object = None  # the tracked atom it reduces


def find_sites(prog: Program):
  """([Site], [Rejected]) for every dot_general whose output flows into a softmax."""
  producers, consumers = prog.producers(), prog.consumers()
  sites, rejected, taken = [], [], set()
  outputs = {a for a in prog.outvars if not is_literal(a)}
  for i, e in enumerate(prog.eqns):
    if e.name != "dot_general" or i in taken or e.opaque:
      continue
    try:
      site = _match(prog, i, producers, consumers, outputs)
    except Fail as err:
      if _reaches_softmax(prog, i, consumers):
        rejected.append(Rejected(i, str(err)))
      continue
    except Exception as err:  # noqa: BLE001 (an unforeseen shape of program: never convert, report if attention-like)
      if _reaches_softmax(prog, i, consumers):
        rejected.append(Rejected(i, f"not understood ({type(err).__name__}: {err})"))
      continue
    if site is None:
      continue
    sites.append(site)
    taken |= site.interior
  return sites, rejected


def _reaches_softmax(prog, g1, consumers, limit=64):
  seen, frontier = set(), [prog.eqns[g1].outs[0]]
  while frontier and len(seen) < limit:
    v = frontier.pop()
    for j in consumers.get(v, ()):
      if j in seen:
        continue
      seen.add(j)
      e = prog.eqns[j]
      if e.name == "exp" or (e.name == "custom_jvp_call" and softmax_axis(e.params) is not None):
        return True
      if e.name == "dot_general":
        continue
      frontier.extend(e.outs)
  return False


def _match(prog: Program, g1: int, producers, consumers, outputs):
  e1 = prog.eqns[g1]
  (lc, rc), (lb, rb) = e1.params["dimension_numbers"]
  lhs, rhs = e1.ins
  lshape, rshape = tuple(lhs.aval.shape), tuple(rhs.aval.shape)
  if len(lc) != 1:
    return None  # attention contracts one head-dim axis
  sizes: dict = {"H": lshape[lc[0]]}
  lay_l, lay_r = [None] * len(lshape), [None] * len(rshape)
  lay_l[lc[0]], lay_r[rc[0]] = ("H",), ("H",)
  out_axes = []
  for n, (a, b) in enumerate(zip(lb, rb, strict=True)):
    name = f"b{n}"
    sizes[name] = lshape[a]
    lay_l[a], lay_r[b] = (name,), (name,)
    out_axes.append((name,))
  for shape, lay, tag in ((lshape, lay_l, "l"), (rshape, lay_r, "r")):
    n = 0
    for ax in range(len(shape)):
      if lay[ax] is None:
        name = f"{tag}{n}"
        n += 1
        sizes[name] = shape[ax]
        lay[ax] = (name,)
        out_axes.append((name,))
  tracks = {e1.outs[0]: _Track(tuple(out_axes), "logits", str(e1.outs[0].aval.dtype))}
  stats: dict = {}
  interior = {g1}
  state = {"S": None, "softmax": None}

  def s_axis(layout, axis):
    atoms = [a for a in layout[axis] if sizes[a] > 1]
    if len(atoms) != 1:
      raise Fail(f"the softmax runs over a merged or empty axis {layout[axis]}")
    if state["S"] is None:
      state["S"] = atoms[0]
    elif state["S"] != atoms[0]:
      raise Fail("two softmax axes")
    return atoms[0]

  first = min(consumers.get(e1.outs[0], [g1 + 1]))
  for j in range(first, len(prog.eqns)):
    e = prog.eqns[j]
    tracked = [a for a in e.ins if not is_literal(a) and a in tracks]
    stat_ins = [a for a in e.ins if not is_literal(a) and a in stats]
    if not tracked and not stat_ins:
      continue
    interior.add(j)
    name = e.name
    out = e.outs[0] if e.outs else None
    if tracked and name == "dot_general":
      return finish(prog, g1, j, e, tracks, sizes, lay_l, lay_r, e1, state, interior, producers, consumers, outputs)
    if not tracked:  # statistics: passed through broadcasts and casts, inverted for a reciprocal
      st = stats[stat_ins[0]]
      if name in ("broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type", "squeeze", "copy"):
        stats[out] = st
      elif name in ("max", "min") and all(is_literal(a) or a in stats for a in e.ins):
        stats[out] = st
      elif name == "div" and st.kind == "sum" and e.ins[1] in stats and scalar_value(prog, e.ins[0], producers) == 1.0:
        stats[out] = _Stat("recip", st.src)
      else:
        raise Fail(f"the softmax statistic goes into {name}")
      continue
    x = tracks[tracked[0]]
    if len(tracked) > 1 and name not in ("select_n",):
      raise Fail(f"{name} combines two attention values")
    others = [a for a in e.ins if is_literal(a) or a not in tracks]
    lay = x.layout
    if name in _LAYOUT:
      if name == "transpose":
        lay = tuple(lay[p] for p in e.params["permutation"])
      elif name == "reshape":
        if e.params.get("dimensions") is not None:
          raise Fail("a reshape with dimensions")
        lay = reshape_layout(lay, sizes, e.params["new_sizes"])
        if lay is None:
          raise Fail("a reshape that splits an axis of the logits")
      elif name == "squeeze":
        lay = tuple(ax for n, ax in enumerate(lay) if n not in e.params["dimensions"])
      elif name == "broadcast_in_dim":
        dims = e.params["broadcast_dimensions"]
        shape = e.params["shape"]
        new = [()] * len(shape)
        for src, dst in enumerate(dims):
          new[dst] = lay[src]
        if any(shape[d] != 1 for d in range(len(shape)) if d not in dims):
          raise Fail("the logits are broadcast")
        lay = tuple(new)
      dtype = str(out.aval.dtype)
      form = x.form
      if name == "convert_element_type" and x.stage in ("logits", "shifted"):
        form = dataclasses.replace(form, softmax_dtype=dtype)
      tracks[out] = _Track(lay, x.stage, dtype, form)
      continue
    if name in ("mul", "div") and x.stage == "logits":
      if name == "div" and e.ins[0] not in tracks:
        raise Fail("the logits divide a constant")
      c = scalar_value(prog, others[0], producers)
      if c is None:
        raise Fail(f"the logits are {'multiplied' if name == 'mul' else 'divided'} by a non-constant")
      if x.form.masks:
        raise Fail("the logits are scaled after the mask")
      c = c if name == "mul" else 1.0 / c
      if x.form.cap is not None:
        form = dataclasses.replace(x.form, cap=x.form.cap * c)
      else:
        form = dataclasses.replace(x.form, scale=x.form.scale * c)
      tracks[out] = _Track(lay, "logits", x.dtype, form)
      continue
    if name == "tanh" and x.stage == "logits":
      if x.form.cap is not None or x.form.masks:
        raise Fail("tanh after a cap or a mask")
      tracks[out] = _Track(lay, "logits", x.dtype, dataclasses.replace(x.form, cap=1.0))
      continue
    if name == "select_n" and x.stage == "logits":
      if len(e.ins) != 3:
        raise Fail("a select with more than two cases")
      pred, case0, case1 = e.ins
      if pred in tracks:
        raise Fail("the logits select on themselves")
      if (case0 in tracks) == (case1 in tracks):
        raise Fail("both cases of a select are attention values")
      other = case1 if case0 in tracks else case0
      c = scalar_value(prog, other, producers)
      if c is None or c > BIAS_MASKED:
        raise Fail(f"a select against {c if c is not None else 'a non-constant'} (not a mask value <= -1e6)")
      ref = mask_ref(prog, pred, lay, producers, "mask", negate=case0 in tracks, sizes=sizes)
      tracks[out] = _Track(lay, "logits", x.dtype, dataclasses.replace(x.form, masks=(*x.form.masks, ref)))
      continue
    if name == "add" and x.stage == "logits":
      other = others[0]
      c = scalar_value(prog, other, producers)
      val = None if c is not None else const_value(prog, other, producers)
      if val is None and c is None and math.prod(shape_of(other)) > MAX_CONST_ELEMENTS:
        val = const_sample(prog, other, producers)  # too big to build: its values at a sample of points
      if c == 0.0:
        tracks[out] = _Track(lay, "logits", x.dtype, x.form)
        continue
      if c is not None:
        raise Fail(f"a constant {c} added to the logits")
      if val is not None and not np.all((val == 0) | (val <= BIAS_MASKED)):
        raise Fail("an additive bias with values other than 0 and <= -1e6 (a position bias, e.g. ALiBi)")
      ref = mask_ref(prog, other, lay, producers, "bias", sizes=sizes)
      tracks[out] = _Track(lay, "logits", x.dtype, dataclasses.replace(x.form, masks=(*x.form.masks, ref)))
      continue
    if name in ("reduce_max", "argmax", "reduce_sum") and len(e.params["axes"]) != 1:
      raise Fail(f"{name} over several axes {e.params['axes']}")
    if name in ("reduce_max", "argmax") and x.stage == "logits":
      s_axis(lay, e.params["axes"][0])
      stats[out] = _Stat("max", tracked[0])
      continue
    if name == "sub" and x.stage == "logits" and e.ins[0] in tracks and e.ins[1] in stats:
      st = stats[e.ins[1]]
      if st.kind != "max" or st.src is not e.ins[0]:
        raise Fail("the logits minus something other than their own max")
      tracks[out] = _Track(lay, "shifted", x.dtype, x.form)
      continue
    if name == "exp" and x.stage in ("logits", "shifted"):
      state["softmax"] = "exp / sum"
      tracks[out] = _Track(lay, "exp", x.dtype, x.form)
      continue
    if name == "reduce_sum" and x.stage == "exp":
      s_axis(lay, e.params["axes"][0])
      stats[out] = _Stat("sum", tracked[0])
      continue
    if name == "div" and x.stage == "exp" and e.ins[0] in tracks and e.ins[1] in stats:
      st = stats[e.ins[1]]
      if st.kind != "sum" or st.src is not e.ins[0]:
        raise Fail("exp divided by something other than its own sum")
      tracks[out] = _Track(lay, "probs", x.dtype, x.form)
      continue
    if name == "mul" and x.stage == "exp" and any(a in stats and stats[a].kind == "recip" for a in e.ins):
      recip = next(stats[a] for a in e.ins if a in stats)
      if recip.src is not tracked[0]:
        raise Fail("exp times the reciprocal of another sum")
      tracks[out] = _Track(lay, "probs", x.dtype, x.form)
      continue
    if name == "custom_jvp_call" and x.stage == "logits":
      axis = softmax_axis(e.params)
      if axis is None:
        raise Fail("a custom_jvp function that is not a softmax")
      if any(a is not tracked[0] and not (is_literal(a) and np.size(a.val) <= 1) for a in e.ins):
        raise Fail("a softmax with a where= mask or another operand")
      s_axis(lay, axis)
      state["softmax"] = "jax.nn.softmax"
      tracks[out] = _Track(lay, "probs", str(out.aval.dtype), x.form)
      continue
    raise Fail(f"{name} on the attention {x.stage} (not scale, tanh cap, mask, bias or softmax)")
  if state["softmax"] is not None:
    raise Fail("the probabilities never meet v in a contraction")
  return None


def softmax_axis(params):
  """The axis of a custom_jvp_call whose body is a softmax (max, exp, sum over one axis, div), else None."""
  body = params.get("call_jaxpr")
  jaxpr = getattr(body, "jaxpr", body)
  if jaxpr is None:
    return None
  names, axes = [], set()

  def scan(jx):
    for e in jx.eqns:
      names.append(e.primitive.name)
      if e.primitive.name == "reduce_sum":
        axes.update(e.params["axes"])
      inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
      if inner is not None and e.primitive.name in INLINE:
        scan(getattr(inner, "jaxpr", inner))

  scan(jaxpr)
  if "exp" not in names or "div" not in names or len(axes) != 1:
    return None
  return next(iter(axes))

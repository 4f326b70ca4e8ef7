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
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from flax_ringattn._src.ring.dense import BIAS_MASKED

_INLINE = ("pjit", "jit", "closed_call", "core_call")
_LAYOUT = ("transpose", "reshape", "squeeze", "broadcast_in_dim", "convert_element_type", "copy", "copy_p")
_CONST_OPS = (
  "broadcast_in_dim",
  "convert_element_type",
  "reshape",
  "squeeze",
  "mul",
  "div",
  "neg",
  "add",
  "sub",
  "iota",
  "ge",
  "le",
  "gt",
  "lt",
  "eq",
  "ne",
  "and",
  "or",
  "not",
  "select_n",
  "transpose",
  "max",
  "min",
  "abs",
  "sqrt",
  "rsqrt",
  "pow",
  "integer_pow",
  "exp",
  "log",
  "tanh",
  "square",
  "stop_gradient",
)


class Const:
  """A constant of the jaxpr (a closed-over array or an inner jaxpr's const)."""

  def __init__(self, val):
    self.val = val


def _is_literal(a) -> bool:
  return isinstance(a, (Const, jex_core.Literal))


class FVar:
  """A value of the flattened program (each inlined call gets its own, even when JAX shares the jaxpr)."""

  __slots__ = ("aval",)

  def __init__(self, aval):
    self.aval = aval


@dataclasses.dataclass(eq=False)
class Eqn:
  """One equation of the flattened program: the original jaxpr equation, its inputs and outputs."""

  eqn: object  # jax.core.JaxprEqn
  ins: list  # atoms: FVar, Literal or Const
  outs: list  # FVar

  @property
  def name(self) -> str:
    return self.eqn.primitive.name

  @property
  def params(self):
    return self.eqn.params


@dataclasses.dataclass
class Program:
  """A closed jaxpr with its calls (`jit`, `closed_call`) inlined."""

  invars: list
  outvars: list
  eqns: list

  @classmethod
  def flatten(cls, closed) -> Program:
    eqns: list[Eqn] = []

    def walk(jaxpr, consts, ins):
      env: dict = {}

      def rd(a):
        return a if isinstance(a, jex_core.Literal) else env[a]

      for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = Const(c)
      for v, a in zip(jaxpr.invars, ins, strict=True):
        env[v] = a
      for e in jaxpr.eqns:
        args = [rd(a) for a in e.invars]
        if e.primitive.name in _INLINE:
          inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
          outs = walk(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), args)
        else:
          outs = [FVar(v.aval) for v in e.outvars]
          eqns.append(Eqn(e, args, outs))
        for v, o in zip(e.outvars, outs, strict=True):
          env[v] = o
      return [rd(a) for a in jaxpr.outvars]

    invars = [FVar(v.aval) for v in closed.jaxpr.invars]
    outvars = walk(closed.jaxpr, closed.consts, invars)
    return cls(invars, outvars, eqns)

  def run(self, args, replace=None, skip=()):
    """Evaluates the program on `args`; `replace` maps an equation index to fn(read) -> its output."""
    replace = replace or {}
    live = self._live(replace, skip)
    env: dict = {}

    def read(a):
      if isinstance(a, Const):
        return a.val
      if isinstance(a, jex_core.Literal):
        return a.val
      return env[a]

    for v, x in zip(self.invars, args, strict=True):
      env[v] = x
    for i, e in enumerate(self.eqns):
      if i not in live:
        continue
      if i in replace:
        env[e.outs[0]] = replace[i](read)
        continue
      params = e.eqn.primitive.get_bind_params(e.params)
      with e.eqn.ctx.manager:
        ans = e.eqn.primitive.bind(*[read(a) for a in e.ins], **params)
      if e.eqn.primitive.multiple_results:
        for v, x in zip(e.outs, ans, strict=True):
          env[v] = x
      else:
        env[e.outs[0]] = ans
    return [read(a) for a in self.outvars]

  def _live(self, replace, skip):
    """Indices of the equations the outputs need (and every equation with effects)."""
    needed = {a for a in self.outvars if not _is_literal(a)}
    for deps in replace.values():
      needed |= {a for a in getattr(deps, "inputs", ()) if not _is_literal(a)}
    live = set()
    for i in range(len(self.eqns) - 1, -1, -1):
      e = self.eqns[i]
      if i in skip and i not in replace:
        continue
      if i in replace or e.eqn.effects or any(v in needed for v in e.outs):
        live.add(i)
        if i not in replace:
          needed |= {a for a in e.ins if not _is_literal(a)}
    return live

  def producers(self):
    return {v: i for i, e in enumerate(self.eqns) for v in e.outs}

  def consumers(self):
    users: dict = {}
    for i, e in enumerate(self.eqns):
      for a in e.ins:
        if not _is_literal(a):
          users.setdefault(a, []).append(i)
    return users


# -- layouts --------------------------------------------------------------------------------------


def _reshape_layout(layout, sizes, new_sizes):
  """The atom tuple of each new axis, or None when an atom would have to split."""
  atoms = [a for ax in layout for a in ax if sizes[a] > 1]
  out, i = [], 0
  for n in new_sizes:
    if n == 1:
      out.append(())
      continue
    group, prod = [], 1
    while prod < n and i < len(atoms):
      group.append(atoms[i])
      prod *= sizes[atoms[i]]
      i += 1
    if prod != n:
      return None
    out.append(tuple(group))
  return tuple(out) if i == len(atoms) else None


def to_atoms(x, layout, sizes, target):
  """x (axes labelled by `layout`) as an array whose axes are the atoms of `target`, in that order."""
  seq = [a for ax in layout for a in ax if sizes[a] > 1]
  missing = [a for a in seq if a not in target]
  if missing:
    raise ValueError(f"internal: atoms {missing} of {layout} not in {target}")
  x = x.reshape([sizes[a] for a in seq])
  x = x.transpose([seq.index(a) for a in target if a in seq])
  return x.reshape([sizes[a] if a in seq else 1 for a in target])


def from_atoms(y, target, sizes, layout, shape):
  """The inverse of `to_atoms`: y [target atoms] laid out as `layout` with `shape`."""
  seq = [a for ax in layout for a in ax if sizes[a] > 1]
  present = [a for a in target if a in seq]
  y = y.reshape([sizes[a] for a in present])
  y = y.transpose([present.index(a) for a in seq])
  return y.reshape(shape)


# -- constants ------------------------------------------------------------------------------------


# Constants are evaluated on the host only up to this many elements (a [T, S] band at T = 4096): beyond it a
# constant counts as unknown, which can only make the matcher reject or verify at run time, never guess.
MAX_CONST_ELEMENTS = 1 << 24


def const_value(prog: Program, atom, producers, depth: int = 12):
  """The concrete value of `atom` when it is computed from literals and constants only, else None."""
  if isinstance(atom, (Const, jex_core.Literal)):
    val = atom.val
    return None if isinstance(val, jax.core.Tracer) else np.asarray(val)
  if depth == 0 or atom not in producers or math.prod(atom.aval.shape) > MAX_CONST_ELEMENTS:
    return None
  e = prog.eqns[producers[atom]]
  if e.name not in _CONST_OPS or len(e.outs) != 1:
    return None
  vals = [const_value(prog, a, producers, depth - 1) for a in e.ins]
  if any(v is None for v in vals):
    return None
  params = e.eqn.primitive.get_bind_params(e.params)
  with jax.ensure_compile_time_eval():
    return np.asarray(e.eqn.primitive.bind(*[jnp.asarray(v) for v in vals], **params))


def scalar_value(prog: Program, atom, producers):
  """The value of a constant that is one scalar broadcast (a scale, a mask fill), without building the
  broadcast; None when `atom` is not such a constant."""
  while not _is_literal(atom) and atom in producers:
    e = prog.eqns[producers[atom]]
    if e.name not in ("broadcast_in_dim", "convert_element_type", "reshape", "squeeze", "copy"):
      break
    atom = e.ins[0]
  if math.prod(getattr(getattr(atom, "aval", None), "shape", ()) or ()) > 1:
    return None
  return _uniform_scalar(const_value(prog, atom, producers))


def _uniform_scalar(val):
  if val is None:
    return None
  flat = np.asarray(val, np.float64).reshape(-1)
  if flat.size == 0 or not np.all(flat == flat[0]):
    return None
  return float(flat[0])


# -- sites ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class MaskRef:
  """A boolean mask or additive bias the model built, traced back to its source array."""

  atom: object  # the source array
  layout: tuple  # atom tuple of each source axis
  kind: str  # "mask" (visible where nonzero) or "bias"
  negate: bool = False  # visible where the source is zero
  window: tuple | None = None  # a constant band factor of the mask: (left, right)


@dataclasses.dataclass
class Site:
  """One recognised attention: where it is in the program and what it computes."""

  g1: int
  g2: int
  interior: set
  sizes: dict
  roles: dict  # role -> atom (B, T, S, K, G, H, Hv); K / G absent when 1
  q: tuple  # (atom, layout)
  k: tuple
  v: tuple
  out_layout: tuple
  out_shape: tuple
  out_dtype: object
  scale: float
  cap: float | None
  masks: list
  softmax: str
  softmax_dtype: str
  q_prescaled: float | None = None
  kv_repeated: bool = False
  precision: object = None  # the logits' dot_general precision, passed to the ring

  @property
  def inputs(self):
    return [self.q[0], self.k[0], self.v[0], *(m.atom for m in self.masks)]

  @property
  def window(self):
    wins = [m.window for m in self.masks if m.window is not None]
    return wins[0] if wins else None

  def describe(self) -> dict:
    size = lambda role: self.sizes[self.roles[role]] if role in self.roles else 1  # noqa: E731
    kinds = sorted({m.kind if m.kind == "bias" else "where" for m in self.masks}) or ["none"]
    return {
      "q_heads": size("K") * size("G"),
      "kv_heads": size("K"),
      "groups": size("G"),
      "head_dim": size("H"),
      "seq_len": size("T"),
      "scale": self.scale,
      "scale_on_q": self.q_prescaled,
      "soft_cap": self.cap,
      "window": self.window,
      "mask": "+".join(kinds),
      "softmax": f"{self.softmax} in {self.softmax_dtype}",
      "kv_repeated": self.kv_repeated,
    }


@dataclasses.dataclass
class Rejected:
  """An attention-like computation (a dot_general whose result reaches an exp / softmax) left alone."""

  g1: int
  reason: str


class _Fail(Exception):
  pass


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
  outputs = {a for a in prog.outvars if not _is_literal(a)}
  for i, e in enumerate(prog.eqns):
    if e.name != "dot_general" or i in taken:
      continue
    try:
      site = _match(prog, i, producers, consumers, outputs)
    except _Fail as err:
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
      if e.name == "exp" or (e.name == "custom_jvp_call" and _softmax_axis(e.params) is not None):
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
      raise _Fail(f"the softmax runs over a merged or empty axis {layout[axis]}")
    if state["S"] is None:
      state["S"] = atoms[0]
    elif state["S"] != atoms[0]:
      raise _Fail("two softmax axes")
    return atoms[0]

  first = min(consumers.get(e1.outs[0], [g1 + 1]))
  for j in range(first, len(prog.eqns)):
    e = prog.eqns[j]
    tracked = [a for a in e.ins if not _is_literal(a) and a in tracks]
    stat_ins = [a for a in e.ins if not _is_literal(a) and a in stats]
    if not tracked and not stat_ins:
      continue
    interior.add(j)
    name = e.name
    out = e.outs[0] if e.outs else None
    if tracked and name == "dot_general":
      return _finish(prog, g1, j, e, tracks, sizes, lay_l, lay_r, e1, state, interior, producers, consumers, outputs)
    if not tracked:  # statistics: passed through broadcasts and casts, inverted for a reciprocal
      st = stats[stat_ins[0]]
      if name in ("broadcast_in_dim", "reshape", "stop_gradient", "convert_element_type", "squeeze", "copy"):
        stats[out] = st
      elif name in ("max", "min") and all(_is_literal(a) or a in stats for a in e.ins):
        stats[out] = st
      elif name == "div" and st.kind == "sum" and e.ins[1] in stats and scalar_value(prog, e.ins[0], producers) == 1.0:
        stats[out] = _Stat("recip", st.src)
      else:
        raise _Fail(f"the softmax statistic goes into {name}")
      continue
    x = tracks[tracked[0]]
    if len(tracked) > 1 and name not in ("select_n",):
      raise _Fail(f"{name} combines two attention values")
    others = [a for a in e.ins if _is_literal(a) or a not in tracks]
    lay = x.layout
    if name in _LAYOUT:
      if name == "transpose":
        lay = tuple(lay[p] for p in e.params["permutation"])
      elif name == "reshape":
        if e.params.get("dimensions") is not None:
          raise _Fail("a reshape with dimensions")
        lay = _reshape_layout(lay, sizes, e.params["new_sizes"])
        if lay is None:
          raise _Fail("a reshape that splits an axis of the logits")
      elif name == "squeeze":
        lay = tuple(ax for n, ax in enumerate(lay) if n not in e.params["dimensions"])
      elif name == "broadcast_in_dim":
        dims = e.params["broadcast_dimensions"]
        shape = e.params["shape"]
        new = [()] * len(shape)
        for src, dst in enumerate(dims):
          new[dst] = lay[src]
        if any(shape[d] != 1 for d in range(len(shape)) if d not in dims):
          raise _Fail("the logits are broadcast")
        lay = tuple(new)
      dtype = str(out.aval.dtype)
      form = x.form
      if name == "convert_element_type" and x.stage in ("logits", "shifted"):
        form = dataclasses.replace(form, softmax_dtype=dtype)
      tracks[out] = _Track(lay, x.stage, dtype, form)
      continue
    if name in ("mul", "div") and x.stage == "logits":
      if name == "div" and e.ins[0] not in tracks:
        raise _Fail("the logits divide a constant")
      c = scalar_value(prog, others[0], producers)
      if c is None:
        raise _Fail(f"the logits are {'multiplied' if name == 'mul' else 'divided'} by a non-constant")
      if x.form.masks:
        raise _Fail("the logits are scaled after the mask")
      c = c if name == "mul" else 1.0 / c
      if x.form.cap is not None:
        form = dataclasses.replace(x.form, cap=x.form.cap * c)
      else:
        form = dataclasses.replace(x.form, scale=x.form.scale * c)
      tracks[out] = _Track(lay, "logits", x.dtype, form)
      continue
    if name == "tanh" and x.stage == "logits":
      if x.form.cap is not None or x.form.masks:
        raise _Fail("tanh after a cap or a mask")
      tracks[out] = _Track(lay, "logits", x.dtype, dataclasses.replace(x.form, cap=1.0))
      continue
    if name == "select_n" and x.stage == "logits":
      if len(e.ins) != 3:
        raise _Fail("a select with more than two cases")
      pred, case0, case1 = e.ins
      if pred in tracks:
        raise _Fail("the logits select on themselves")
      if (case0 in tracks) == (case1 in tracks):
        raise _Fail("both cases of a select are attention values")
      other = case1 if case0 in tracks else case0
      c = scalar_value(prog, other, producers)
      if c is None or c > BIAS_MASKED:
        raise _Fail(f"a select against {c if c is not None else 'a non-constant'} (not a mask value <= -1e6)")
      ref = _mask_ref(prog, pred, lay, producers, "mask", negate=case0 in tracks, sizes=sizes)
      tracks[out] = _Track(lay, "logits", x.dtype, dataclasses.replace(x.form, masks=(*x.form.masks, ref)))
      continue
    if name == "add" and x.stage == "logits":
      other = others[0]
      c = scalar_value(prog, other, producers)
      val = None if c is not None else const_value(prog, other, producers)
      if c == 0.0:
        tracks[out] = _Track(lay, "logits", x.dtype, x.form)
        continue
      if c is not None:
        raise _Fail(f"a constant {c} added to the logits")
      if val is not None and not np.all((val == 0) | (val <= BIAS_MASKED)):
        raise _Fail("an additive bias with values other than 0 and <= -1e6 (a position bias, e.g. ALiBi)")
      ref = _mask_ref(prog, other, lay, producers, "bias", sizes=sizes)
      tracks[out] = _Track(lay, "logits", x.dtype, dataclasses.replace(x.form, masks=(*x.form.masks, ref)))
      continue
    if name in ("reduce_max", "argmax", "reduce_sum") and len(e.params["axes"]) != 1:
      raise _Fail(f"{name} over several axes {e.params['axes']}")
    if name in ("reduce_max", "argmax") and x.stage == "logits":
      s_axis(lay, e.params["axes"][0])
      stats[out] = _Stat("max", tracked[0])
      continue
    if name == "sub" and x.stage == "logits" and e.ins[0] in tracks and e.ins[1] in stats:
      st = stats[e.ins[1]]
      if st.kind != "max" or st.src is not e.ins[0]:
        raise _Fail("the logits minus something other than their own max")
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
        raise _Fail("exp divided by something other than its own sum")
      tracks[out] = _Track(lay, "probs", x.dtype, x.form)
      continue
    if name == "mul" and x.stage == "exp" and any(a in stats and stats[a].kind == "recip" for a in e.ins):
      recip = next(stats[a] for a in e.ins if a in stats)
      if recip.src is not tracked[0]:
        raise _Fail("exp times the reciprocal of another sum")
      tracks[out] = _Track(lay, "probs", x.dtype, x.form)
      continue
    if name == "custom_jvp_call" and x.stage == "logits":
      axis = _softmax_axis(e.params)
      if axis is None:
        raise _Fail("a custom_jvp function that is not a softmax")
      if any(a is not tracked[0] and not (_is_literal(a) and np.size(a.val) <= 1) for a in e.ins):
        raise _Fail("a softmax with a where= mask or another operand")
      s_axis(lay, axis)
      state["softmax"] = "jax.nn.softmax"
      tracks[out] = _Track(lay, "probs", str(out.aval.dtype), x.form)
      continue
    raise _Fail(f"{name} on the attention {x.stage} (not scale, tanh cap, mask, bias or softmax)")
  if state["softmax"] is not None:
    raise _Fail("the probabilities never meet v in a contraction")
  return None


def _softmax_axis(params):
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
      if inner is not None and e.primitive.name in _INLINE:
        scan(getattr(inner, "jaxpr", inner))

  scan(jaxpr)
  if "exp" not in names or "div" not in names or len(axes) != 1:
    return None
  return next(iter(axes))


def _mask_ref(prog, atom, lay, producers, kind, *, negate=False, sizes):
  """Traces a mask / bias operand (in the logits' layout `lay`) back through broadcasts and casts."""
  # An operand of the logits' rank may broadcast its size-1 axes implicitly: those carry no atom.
  shape = tuple(atom.aval.shape)
  src_lay = tuple(() if n < len(shape) and shape[n] == 1 else ax for n, ax in enumerate(lay))
  nonzero = False
  while atom in producers:
    e = prog.eqns[producers[atom]]
    if e.name == "broadcast_in_dim":
      dims = e.params["broadcast_dimensions"]
      src_shape = tuple(e.ins[0].aval.shape)
      src_lay = tuple(src_lay[d] if src_shape[n] != 1 else () for n, d in enumerate(dims))
      atom = e.ins[0]
    elif e.name in ("convert_element_type", "copy") or (e.name == "ne" and _is_zero(prog, e.ins[1], producers)):
      nonzero = nonzero or e.name == "ne"
      atom = e.ins[0]
    elif e.name == "reshape" and e.params.get("dimensions") is None:
      src_shape = tuple(e.ins[0].aval.shape)
      keep = [ax for ax in src_lay if any(sizes[a] > 1 for a in ax)]
      if [s for s in src_shape if s != 1] != [math.prod(sizes[a] for a in ax) for ax in keep]:
        break
      it = iter(keep)
      src_lay = tuple(next(it) if s != 1 else () for s in src_shape)
      atom = e.ins[0]
    elif e.name == "not" and kind == "mask":
      negate = not negate
      atom = e.ins[0]
    else:
      break
  del nonzero  # a nonzero test and the source itself select the same entries
  window = _constant_band(prog, atom, src_lay, producers, sizes) if kind == "mask" else None
  return MaskRef(atom, tuple(tuple(a for a in ax if sizes[a] > 1) for ax in src_lay), kind, negate, window)


def _is_zero(prog, atom, producers):
  return scalar_value(prog, atom, producers) == 0.0


def _constant_band(prog, atom, src_lay, producers, sizes):
  """A sliding window the model built from constants (`triu` / `tril` bands ANDed or multiplied into the
  mask): the (left, right) of the constant factors' band, or None."""
  consts = []

  def collect(a, depth=8):
    val = const_value(prog, a, producers)
    if val is not None:
      consts.append(val)
      return
    if depth == 0 or _is_literal(a) or a not in producers:
      return
    e = prog.eqns[producers[a]]
    if e.name in ("and", "mul"):
      for b in e.ins:
        collect(b, depth - 1)
    elif e.name in ("convert_element_type", "broadcast_in_dim") or (
      e.name == "ne" and _is_zero(prog, e.ins[1], producers)
    ):
      collect(e.ins[0], depth - 1)

  collect(atom)
  band = None
  for val in consts:
    v = np.asarray(val) != 0
    while v.ndim > 2 and (v.shape[0] == 1 or bool(np.all(v == v[:1]))):
      v = v[0]  # leading (batch, head) axes of a band built like the mask: the same band in each
    if v.ndim != 2 or v.shape[0] != v.shape[1]:
      continue
    band = v if band is None else band & v
  if band is None:
    return None
  i, j = np.nonzero(band)
  if i.size == 0:
    return None
  left, right = int(np.max(i - j)), int(np.max(j - i))
  n = band.shape[0]
  rows, cols = np.indices(band.shape)
  if not np.array_equal(band, (cols >= rows - left) & (cols <= rows + right)):
    return None
  if left >= n - 1 and right >= n - 1:
    return None  # no band at all
  if right == 0 and left >= n - 1:
    return None  # the causal triangle: recovered from the whole mask
  return (left, right)


def _repeat_source(prog, atom, lay, head, producers):
  """(src, G, layout of src) when `atom` (axes labelled `lay`) repeats src G times along the axis labelled
  `head`, as `jnp.repeat` does (a broadcast then a merging reshape, possibly transposed after); else None."""
  if atom not in producers:
    return None
  e = prog.eqns[producers[atom]]
  if e.name == "transpose":
    perm = e.params["permutation"]
    src_lay = [None] * len(lay)
    for out_axis, in_axis in enumerate(perm):
      src_lay[in_axis] = lay[out_axis]
    return _repeat_source(prog, e.ins[0], tuple(src_lay), head, producers)
  if e.name != "reshape" or e.ins[0] not in producers:
    return None
  b = prog.eqns[producers[e.ins[0]]]
  if b.name != "broadcast_in_dim":
    return None
  axes = [n for n, ax in enumerate(lay) if ax == (head,)]
  if len(axes) != 1:
    return None
  h = axes[0]
  src = b.ins[0]
  src_shape, mid = tuple(src.aval.shape), tuple(b.params["shape"])
  dims = b.params["broadcast_dimensions"]
  out_shape = tuple(atom.aval.shape)
  if len(mid) != len(src_shape) + 1 or tuple(dims) != tuple(d + (d > h) for d in range(len(src_shape))):
    return None
  if mid[: h + 1] + mid[h + 2 :] != src_shape or out_shape[h] != mid[h] * mid[h + 1]:
    return None
  return src, mid[h + 1], lay


def _finish(prog, g1, g2, e2, tracks, sizes, lay_l, lay_r, e1, state, interior, producers, consumers, outputs):
  """The second dot_general: probabilities times v.  Assigns roles and builds the Site."""
  if state["S"] is None or state["softmax"] is None:
    raise _Fail("no softmax before the second contraction")
  p_atom = next(a for a in e2.ins if not _is_literal(a) and a in tracks)
  p = tracks[p_atom]
  if p.stage != "probs":
    raise _Fail(f"the {p.stage} (not the probabilities) meet a contraction")
  (c0, c1), (b0, b1) = e2.params["dimension_numbers"]
  p_is_lhs = e2.ins[0] is p_atom
  pc, vc = (c0, c1) if p_is_lhs else (c1, c0)
  pb, vb = (b0, b1) if p_is_lhs else (b1, b0)
  v_atom = e2.ins[1] if p_is_lhs else e2.ins[0]
  S = state["S"]
  if len(pc) != 1 or tuple(a for a in p.layout[pc[0]] if sizes[a] > 1) != (S,):
    raise _Fail("the probabilities are contracted over something other than the key axis")
  vshape = tuple(v_atom.aval.shape)
  v_lay = [None] * len(vshape)
  v_lay[vc[0]] = (S,)
  for a, b in zip(pb, vb, strict=True):
    v_lay[b] = p.layout[a]
  free = [n for n in range(len(vshape)) if v_lay[n] is None]
  if len(free) != 1:
    raise _Fail(f"v has {len(free)} free axes (expected one head dim)")
  sizes["Hv"] = vshape[free[0]]
  v_lay[free[0]] = ("Hv",)
  p_free = [p.layout[n] for n in range(len(p.layout)) if n not in pc and n not in pb]
  batch = [p.layout[n] for n in pb]
  out_layout = tuple(batch + (p_free + [("Hv",)] if p_is_lhs else [("Hv",)] + p_free))
  # The escape check: nothing computed inside the site is used outside it.
  for j in interior - {g2}:
    for v in prog.eqns[j].outs:
      if v in outputs or any(u not in interior and u != g2 for u in consumers.get(v, ())):
        raise _Fail("attention weights or logits are used outside the attention (returned or sown)")
  # Which dot_general operand is q: the one without the key axis.
  s_on_r = any(S in ax for ax in lay_r)
  q_atom, q_lay = (e1.ins[0], tuple(lay_l)) if s_on_r else (e1.ins[1], tuple(lay_r))
  k_atom, k_lay = (e1.ins[1], tuple(lay_r)) if s_on_r else (e1.ins[0], tuple(lay_l))
  q_free = [ax[0] for ax in q_lay if ax[0][0] in "lr" and sizes[ax[0]] > 1]
  k_free = [ax[0] for ax in k_lay if ax[0][0] in "lr" and sizes[ax[0]] > 1]
  if k_free != [S]:
    raise _Fail(f"k has free axes {k_free} besides the key axis")
  batch_atoms = [ax[0] for ax in q_lay if ax[0].startswith("b") and sizes[ax[0]] > 1]
  form = p.form
  mask_atoms = {a for m in form.masks for ax in m.layout for a in ax}
  B = next((a for a in batch_atoms if a in mask_atoms), None)
  heads = [a for a in batch_atoms if a != B]
  if B is None and len(heads) > 1:
    B, heads = heads[0], heads[1:]
  if len(heads) > 1:
    raise _Fail(f"more than one head axis {heads}")
  T = next((a for a in q_free if a in mask_atoms), None)
  if T is None:
    same = [a for a in q_free if sizes[a] == sizes[S]]
    T = same[0] if len(same) == 1 else (q_free[0] if q_free else None)
  if T is None:
    raise _Fail("no query axis")
  groups = [a for a in q_free if a != T]
  if len(groups) > 1:
    raise _Fail(f"more than one group axis {groups}")
  for m in form.masks:
    extra = [a for ax in m.layout for a in ax if a not in (B, T, S)]
    if extra:
      raise _Fail("a per-head mask")
  if sizes[T] != sizes[S]:
    raise _Fail(f"cross or cached attention: {sizes[T]} queries against {sizes[S]} keys")
  roles = {"T": T, "S": S, "H": "H", "Hv": "Hv"}
  if B is not None:
    roles["B"] = B
  if heads:
    roles["K"] = heads[0]
  if groups:
    roles["G"] = groups[0]
  # GQA by jnp.repeat of k and v: move only the kv heads.
  k_src, v_src, repeated = (k_atom, k_lay), (v_atom, tuple(v_lay)), False
  if heads:
    kr = _repeat_source(prog, k_atom, k_lay, heads[0], producers)
    vr = _repeat_source(prog, v_atom, tuple(v_lay), heads[0], producers)
    if kr and vr and kr[1] == vr[1] and kr[1] > 1:
      # Split the head atom into (kv head, group): q's head axis reads K-major, as jnp.repeat lays it out.
      g = kr[1]
      kv_name, grp = heads[0] + "k", heads[0] + "g"
      sizes[kv_name], sizes[grp] = sizes[heads[0]] // g, g
      split = lambda lay: tuple((kv_name, grp) if ax == (heads[0],) else ax for ax in lay)  # noqa: E731
      only_kv = lambda lay: tuple((kv_name,) if ax == (heads[0],) else ax for ax in lay)  # noqa: E731
      q_lay = split(q_lay)
      out_layout = tuple(
        tuple(a2 for a in ax for a2 in ((kv_name, grp) if a == heads[0] else (a,))) for ax in out_layout
      )
      k_src, v_src = (kr[0], only_kv(kr[2])), (vr[0], only_kv(vr[2]))
      roles["K"], roles["G"] = kv_name, grp
      if groups:
        raise _Fail("GQA both grouped in the einsum and repeated")
      repeated = True
  scale, cap = form.scale, None
  if form.cap is not None:
    cap = form.cap
    scale = form.scale * cap
  prescale = _q_prescale(prog, q_atom, producers)
  return Site(
    g1=g1,
    g2=g2,
    interior=interior,
    sizes=sizes,
    roles=roles,
    q=(q_atom, q_lay),
    k=k_src,
    v=v_src,
    out_layout=out_layout,
    out_shape=tuple(e2.outs[0].aval.shape),
    out_dtype=e2.outs[0].aval.dtype,
    scale=scale,
    cap=cap,
    masks=list(form.masks),
    softmax=state["softmax"],
    softmax_dtype=form.softmax_dtype or str(e1.outs[0].aval.dtype),
    precision=e1.params.get("precision"),
    q_prescaled=prescale,
    kv_repeated=repeated,
  )


def _q_prescale(prog, q_atom, producers):
  """The constant q was multiplied by just before the logits (Gemma's query_pre_attn_scalar), for the report."""
  seen = 0
  while q_atom in producers and seen < 4:
    e = prog.eqns[producers[q_atom]]
    if e.name == "mul":
      for a in e.ins:
        c = scalar_value(prog, a, producers)
        if c is not None:
          return c
      return None
    if e.name not in ("reshape", "transpose", "convert_element_type"):
      return None
    q_atom = e.ins[0]
    seen += 1
  return None


# -- running a site ---------------------------------------------------------------------------------


def site_inputs(site: Site, read):
  """(q [B, T, N, H], k, v [B, S, K, H], masks [(kind, [B | 1, T, S] array)]) from the program's values."""
  r, sz = site.roles, site.sizes
  K, G = r.get("K"), r.get("G")
  B = r.get("B")
  q_t = [a for a in (B, r["T"], K, G, "H") if a is not None]
  k_t = [a for a in (B, r["S"], K, "H") if a is not None]
  v_t = [a for a in (B, r["S"], K, "Hv") if a is not None]
  bsz = sz[B] if B is not None else 1
  heads = (sz[K] if K else 1) * (sz[G] if G else 1)
  q = to_atoms(read(site.q[0]), site.q[1], sz, q_t).reshape(bsz, sz[r["T"]], heads, sz["H"])
  k = to_atoms(read(site.k[0]), site.k[1], sz, k_t).reshape(bsz, sz[r["S"]], sz[K] if K else 1, sz["H"])
  v = to_atoms(read(site.v[0]), site.v[1], sz, v_t).reshape(bsz, sz[r["S"]], sz[K] if K else 1, sz["Hv"])
  masks = []
  for m in site.masks:
    x = read(m.atom)
    present = [a for ax in m.layout for a in ax]
    tgt = [a for a in (B, r["T"], r["S"]) if a is not None]
    arr = to_atoms(x, m.layout, sz, tgt)
    mb = sz[B] if B is not None and B in present else 1
    t = sz[r["T"]] if r["T"] in present else 1  # a key-only [B, 1, 1, S] mask has no query axis
    s_ = sz[r["S"]] if r["S"] in present else 1
    arr = jnp.broadcast_to(arr.reshape(mb, t, s_), (mb, sz[r["T"]], sz[r["S"]]))
    masks.append((m.kind, m.negate, arr))
  return q, k, v, masks


def site_output(site: Site, out):
  """out [B, T, N, Hv] laid out as the site's second dot_general's result."""
  r, sz = site.roles, site.sizes
  K, G = r.get("K"), r.get("G")
  target = [a for a in (r.get("B"), r["T"], K, G, "Hv") if a is not None]
  y = out.reshape([sz[a] for a in target])
  return from_atoms(y, target, sz, site.out_layout, site.out_shape).astype(site.out_dtype)

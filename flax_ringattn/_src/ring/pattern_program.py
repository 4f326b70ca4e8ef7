"""The flattened jaxpr the hand-written-attention matcher works on, and the constants read from it.

`Program.flatten` inlines a closed jaxpr's calls (`jit`, `closed_call`) into one list of `Eqn`s over `FVar`s and
`Const`s; `Program.run` evaluates it, with chosen equations replaced.  `const_value` / `scalar_value` read the
values computed from constants only (a scale, a mask fill, a constant band).  This module imports nothing else of
the matcher: `pattern_site.py` (the sites) and `pattern.py` (the matcher) build on it.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

_INLINE = ("pjit", "jit", "closed_call", "core_call")
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

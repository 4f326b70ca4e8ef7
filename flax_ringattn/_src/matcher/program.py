"""The flattened jaxpr the hand-written-attention matcher works on, and the constants read from it.

`Program.flatten` inlines a closed jaxpr's calls (`jit`, `closed_call`) and remat bodies (`jax.checkpoint`,
`nnx.remat`: a `Region` each) into one list of `Eqn`s over `FVar`s and `Const`s; `Program.run` evaluates it, with
chosen equations replaced and each remat body inside `jax.checkpoint` again.  `const_value` / `scalar_value` read the
values computed from constants only (a scale, a mask fill, a constant band).  This module imports nothing else of
the matcher: `site.py` (the sites) and `attention.py` (the matcher) build on it.
"""

from __future__ import annotations

import collections
import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

INLINE = ("pjit", "jit", "closed_call", "core_call")
CONST_OPS = (
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


def is_literal(a) -> bool:
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
  region: Region | None = None  # the innermost `jax.checkpoint` (remat) body it was inlined from
  opaque: bool = False  # traced under `OPAQUE_SCOPE`: code that must run as written, never matched

  @property
  def name(self) -> str:
    return self.eqn.primitive.name

  @property
  def params(self):
    return self.eqn.params


@dataclasses.dataclass(eq=False)
class Region:
  """An inlined `jax.checkpoint` / `nnx.remat` body: its equations are matched like any others, and `run`
  evaluates them inside `jax.checkpoint` again with the same policy, so the rematerialisation the model asked
  for (around a converted attention too) is kept."""

  params: dict  # policy, prevent_cse
  ins: list  # the atoms the body reads
  outs: list = dataclasses.field(default_factory=list)  # the atoms it returns
  items: list = dataclasses.field(default_factory=list)  # its Eqns and inner Regions, in order


_REMAT = ("remat2", "checkpoint", "remat")
# A `jax.named_scope` whose equations (and those of calls inlined from under it) the matcher never converts: a
# watched module that runs its own code (a sampling call with a cache, ...) traces it so, and the module calling
# it then does not convert that attention in its place.
OPAQUE_SCOPE = "flax_ringattn_runs_its_own_code"


@dataclasses.dataclass
class Program:
  """A closed jaxpr with its calls (`jit`, `closed_call`) and remat bodies inlined; `items` is the same
  equations as a tree, each remat body a `Region`."""

  invars: list
  outvars: list
  eqns: list
  items: list = None

  def __post_init__(self):
    if self.items is None:
      self.items = list(self.eqns)

  @classmethod
  def flatten(cls, closed) -> Program:
    eqns: list[Eqn] = []
    top: list = []

    def walk(jaxpr, consts, ins, items, region, opaque=False):
      env: dict = {}

      def rd(a):
        return a if isinstance(a, jex_core.Literal) else env[a]

      for v, c in zip(jaxpr.constvars, consts, strict=True):
        env[v] = Const(c)
      for v, a in zip(jaxpr.invars, ins, strict=True):
        env[v] = a
      for e in jaxpr.eqns:
        args = [rd(a) for a in e.invars]
        hidden = opaque or OPAQUE_SCOPE in str(e.source_info.name_stack)
        if e.primitive.name in INLINE:
          inner = e.params.get("jaxpr", e.params.get("call_jaxpr"))
          outs = walk(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), args, items, region, hidden)
        elif e.primitive.name in _REMAT:
          inner = e.params["jaxpr"]
          body = Region({k: e.params[k] for k in ("policy", "prevent_cse") if k in e.params}, args)
          items.append(body)
          outs = walk(getattr(inner, "jaxpr", inner), getattr(inner, "consts", ()), args, body.items, body, hidden)
          body.outs = list(outs)
        else:
          outs = [FVar(v.aval) for v in e.outvars]
          eqn = Eqn(e, args, outs, region, hidden)
          eqns.append(eqn)
          items.append(eqn)
        for v, o in zip(e.outvars, outs, strict=True):
          env[v] = o
      return [rd(a) for a in jaxpr.outvars]

    invars = [FVar(v.aval) for v in closed.jaxpr.invars]
    outvars = walk(closed.jaxpr, closed.consts, invars, top, None)
    return cls(invars, outvars, eqns, top)

  def dce(self) -> Program:
    """The program without its dead equations (those no output needs, and without effects): a value the model
    computes and then drops, such as attention weights an inner function returns and its caller ignores, is no
    use of that value."""
    live = {id(self.eqns[i]) for i in self._live({}, ())}

    def keep(items):
      out = []
      for it in items:
        if isinstance(it, Region):
          inner = keep(it.items)
          if inner:
            out.append(dataclasses.replace(it, items=inner))
        elif id(it) in live:
          out.append(it)
      return out

    return Program(self.invars, self.outvars, [e for e in self.eqns if id(e) in live], keep(self.items))

  def run(self, args, replace=None, skip=()):
    """Evaluates the program on `args`; `replace` maps an equation index to fn(read) -> its output.  Remat
    bodies run inside `jax.checkpoint` with their own policy."""
    replace = replace or {}
    live = self._live(replace, skip)
    index = {id(e): i for i, e in enumerate(self.eqns)}

    def read_in(env):
      def read(a):
        if isinstance(a, (Const, jex_core.Literal)):
          return a.val
        return env[a]

      return read

    def run_items(items, env):
      read = read_in(env)
      for it in items:
        if isinstance(it, Region):
          run_region(it, env)
          continue
        i = index[id(it)]
        if i not in live:
          continue
        if i in replace:
          env[it.outs[0]] = replace[i](read)
          continue
        params = it.eqn.primitive.get_bind_params(it.params)
        with it.eqn.ctx.manager:
          ans = it.eqn.primitive.bind(*[read(a) for a in it.ins], **params)
        if it.eqn.primitive.multiple_results:
          for v, x in zip(it.outs, ans, strict=True):
            env[v] = x
        else:
          env[it.outs[0]] = ans

    def run_region(region, env):
      made = {v for i in _region_eqns(region) if index[id(i)] in live for v in i.outs}
      outs = list(dict.fromkeys(a for a in region.outs if isinstance(a, FVar) and a in made))
      if not made:
        return
      # The inputs the body's live equations can read: an input whose producer was pruned (its only readers
      # were a converted site's interior, e.g. a mask broadcast before the body) has no value and is not passed.
      ins = [a for a in dict.fromkeys(region.ins) if isinstance(a, FVar) and a in env]

      def body(*xs):
        # Values outside the body that a replaced site reads (a repeat's source, a mask's) are closed over.
        local = collections.ChainMap(dict(zip(ins, xs, strict=True)), env)
        run_items(region.items, local)
        return [local[a] for a in outs]

      results = jax.checkpoint(body, **region.params)(*[env[a] for a in ins])
      for a, x in zip(outs, results, strict=True):
        env[a] = x

    env: dict = {}
    for v, x in zip(self.invars, args, strict=True):
      env[v] = x
    run_items(self.items, env)
    return [read_in(env)(a) for a in self.outvars]

  def _live(self, replace, skip):
    """Indices of the equations the outputs need (and every equation with effects)."""
    needed = {a for a in self.outvars if not is_literal(a)}
    for deps in replace.values():
      needed |= {a for a in getattr(deps, "inputs", ()) if not is_literal(a)}
    live = set()
    for i in range(len(self.eqns) - 1, -1, -1):
      e = self.eqns[i]
      if i in skip and i not in replace:
        continue
      if i in replace or e.eqn.effects or any(v in needed for v in e.outs):
        live.add(i)
        if i not in replace:
          needed |= {a for a in e.ins if not is_literal(a)}
    return live

  def producers(self):
    return {v: i for i, e in enumerate(self.eqns) for v in e.outs}

  def consumers(self):
    users: dict = {}
    for i, e in enumerate(self.eqns):
      for a in e.ins:
        if not is_literal(a):
          users.setdefault(a, []).append(i)
    return users


def _region_eqns(region: Region):
  """Every equation of a remat body, its inner bodies' included."""
  for it in region.items:
    if isinstance(it, Region):
      yield from _region_eqns(it)
    else:
      yield it


# -- constants ------------------------------------------------------------------------------------


# Constants are evaluated on the host only up to this many elements (a [T, S] band at T = 4096): beyond it
# `const_value` gives up, and a band or bias is read at points instead (band.py), never built whole.
MAX_CONST_ELEMENTS = 1 << 24


def const_value(prog: Program, atom, producers, depth: int = 12):
  """The concrete value of `atom` when it is computed from literals and constants only, else None."""
  if isinstance(atom, (Const, jex_core.Literal)):
    val = atom.val
    return None if isinstance(val, jax.core.Tracer) else np.asarray(val)
  if depth == 0 or atom not in producers or math.prod(atom.aval.shape) > MAX_CONST_ELEMENTS:
    return None
  e = prog.eqns[producers[atom]]
  if e.name not in CONST_OPS or len(e.outs) != 1:
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
  while not is_literal(atom) and atom in producers:
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

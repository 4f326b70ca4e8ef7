"""Attention sinks written by hand (gpt-oss style), found around the attention matcher (`attention.py`).

Models write a sink as one more logit column per head, joined before the softmax and dropped after it::

    logits = jnp.concatenate([logits, jnp.broadcast_to(sinks.reshape(K, G, 1, 1), (..., 1))], axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)[..., :-1]

which is attention with `sinks=`: exp(sinks[h]) joins the denominator of every row of head h and carries no
value.  `find_sites` recognises it in three steps, and never converts a pattern it cannot run exactly:

1. For each `concatenate` of two operands where one, the column, has size 1 on the joined axis d, it follows
   every value computed from the joined array in program order: only a softmax may run on it (casts, exp,
   max and sum over d, subtracting / dividing by those statistics, or `jax.nn.softmax` over d), and the
   softmax output must meet exactly one `slice` that drops the column (the last column when it was appended,
   the first when it was prepended) and keeps everything else.  Anything else (a scale or mask applied after
   the join, the column kept, the wrong column dropped, the probabilities returned) leaves it alone with the
   reason.
2. A view of the program reads the logits where the joined array was read and the slice's input where its
   output was read (the join and the slice see no attention value there), and `attention.find_sites` matches
   it as plain attention: scale, cap and mask are those of the logits before the join.
3. A site of the view is kept when it covers the whole softmax chain; the join and the slice join its
   interior, the escape check is redone on the real program, and the column is traced back (broadcasts,
   unit reshapes, float casts) to an array over the heads, laid out as the site's heads (K-major, as q) for
   the op's `sinks=`.  The real program then runs with the site replaced, so the sinks' gradient reaches the
   model's parameter through its own casts and reshapes.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from flax_ringattn._src.matcher import attention
from flax_ringattn._src.matcher.program import Program, is_literal
from flax_ringattn._src.matcher.site import reshape_layout, to_atoms

_CAST_OPS = ("convert_element_type", "copy")
_STAT_PASS = ("broadcast_in_dim", "reshape", "squeeze", "stop_gradient", "convert_element_type", "copy", "max", "min")


@dataclasses.dataclass
class SinkRef:
  """The sinks of one site: the array the model broadcast into its sink column, and how to read it per head."""

  atom: object  # the array (a value of the program: the parameter, or its cast / reshape)
  layout: tuple  # atom tuple of each of its axes (head atoms only)
  dtype: object  # the column's dtype (the model's own cast)


@dataclasses.dataclass
class _Chain:
  """One joined sink column: the join, the softmax run on the joined array, the slice that drops the column."""

  concat: int
  logits: object  # the joined logits operand
  column: object  # the sink column operand
  axis: int
  body: set  # equations between the join and the slice
  drop: int = -1  # the slice
  reason: str = ""


class _Reject(Exception):
  pass


def find_sites(prog: Program):
  """([attention.Site], [attention.Rejected], {g2: SinkRef}) of `prog`: `attention.find_sites`, plus attention
  whose softmax has a sink column joined and dropped around it (see the module)."""
  producers, consumers = prog.producers(), prog.consumers()
  outputs = {a for a in prog.outvars if not is_literal(a)}
  chains = [c for i, e in enumerate(prog.eqns) if (c := _chain(prog, i, e, outputs)) is not None]
  good = [c for c in chains if not c.reason]
  view = _view(prog, good) if good else prog
  sites, rejected = attention.find_sites(view)
  refs, kept, claimed = {}, [], set()
  for site in sites:
    touched = [c for c in good if c.body & site.interior]
    try:
      for c in touched:
        _claim(prog, site, c, producers, consumers, outputs)
      if len(touched) > 1:
        raise _Reject("two sink columns on one attention")
      if touched:
        refs[site.g2] = _sink_ref(prog, site, touched[0], producers)
        claimed.add(touched[0].concat)
    except _Reject as err:
      rejected.append(attention.Rejected(site.g1, f"attention sinks: {err}"))
      continue
    kept.append(site)
  # A rejected attention whose logits carry a sink column names what went wrong with the column, or that the
  # rest was not recognised once the column was set aside.
  for n, rej in enumerate(rejected):
    for c in chains:
      if c.concat in claimed or rej.reason.startswith("attention sinks:"):
        continue
      if (c.reason and "concatenate" not in rej.reason) or not _reaches(prog, rej.g1, c.concat, consumers):
        continue
      why = c.reason or f"the attention around it is not recognised ({rej.reason})"
      rejected[n] = attention.Rejected(rej.g1, f"attention sinks: {why}")
  return kept, rejected, refs


# -- the chain between the join and the slice -------------------------------------------------------------------


def _chain(prog, i, e, outputs):
  """The sink chain of equation i when it joins a one-column array to the logits, else None; `reason` set when
  the column is joined but not in the form `find_sites` runs exactly."""
  if e.name != "concatenate" or len(e.ins) != 2 or any(is_literal(a) for a in e.ins):
    return None
  d = e.params["dimension"]
  widths = [a.aval.shape[d] for a in e.ins]
  if sorted(widths)[0] != 1 or widths[0] == widths[1]:
    return None
  first = widths[0] == 1
  column, logits = (e.ins[0], e.ins[1]) if first else (e.ins[1], e.ins[0])
  chain = _Chain(i, logits, column, d, set())
  try:
    _follow(prog, chain, first, outputs)
  except _Reject as err:
    chain.reason = str(err)
  return chain


def _follow(prog, chain, first, outputs):
  """Follows every value computed from the joined array (see the module, step 1); fills body and drop."""
  d = chain.axis
  joined = prog.eqns[chain.concat].outs[0]
  # full: the values over the joined axis, mapped to whether a softmax (exp) has run on them; stats: their max
  # and sum over it, and what is made of those.
  full, stats = {joined: False}, set()
  for j in range(chain.concat + 1, len(prog.eqns)):
    e = prog.eqns[j]
    ins_full = [a for a in e.ins if not is_literal(a) and a in full]
    ins_stat = [a for a in e.ins if not is_literal(a) and a in stats]
    if not ins_full and not ins_stat:
      continue
    name, out = e.name, (e.outs[0] if e.outs else None)
    if any(a in outputs for a in ins_full + ins_stat):
      raise _Reject("the logits or probabilities with the sink column are returned")
    if ins_full and name == "slice":
      if chain.drop >= 0:
        raise _Reject("the probabilities with the sink column are sliced twice")
      if not full[ins_full[0]]:
        raise _Reject("the sink column is dropped before the softmax (it then changes nothing)")
      _check_drop(e, d, first)
      chain.drop = j
      continue
    chain.body.add(j)
    if len(ins_full) > 1:
      raise _Reject(f"{name} combines two values with the sink column")
    if ins_full:
      x = ins_full[0]
      other = [a for a in e.ins if a is not x and not is_literal(a)]
      if name in _CAST_OPS:
        full[out] = full[x]
      elif name == "exp":
        full[out] = True
      elif (
        name in ("sub", "div", "mul")
        and len(e.ins) == 2
        and len(other) == 1
        and other[0] in stats
        and (name == "mul" or e.ins[0] is x)
      ):
        full[out] = full[x]
      elif name in ("reduce_max", "reduce_sum") and tuple(e.params["axes"]) == (d,):
        stats.add(out)
      elif name == "custom_jvp_call" and attention.softmax_axis(e.params) == d:
        if any(not is_literal(a) and a is not x for a in e.ins):
          raise _Reject("a softmax with a where= mask or another operand")
        full[out] = True
      elif name == "dot_general" and full[x]:
        raise _Reject("the probabilities meet v with the sink column still in them (drop it after the softmax)")
      else:
        raise _Reject(
          f"{name} on the logits after the sink column was joined (only a softmax over the joined axis may run "
          "between the join and the slice that drops the column: a scale, cap or mask applied after the join "
          "would also change the sink)"
        )
      continue
    if any(not is_literal(a) and a not in stats for a in e.ins):
      raise _Reject(
        f"the softmax statistic over the sink column meets a value without the column in {name} (the softmax "
        "must be finished before the column is dropped)"
      )
    if name in _STAT_PASS or name == "div":
      stats.add(out)
    else:
      raise _Reject(f"the softmax statistic over the sink column goes into {name}")
  if chain.drop < 0:
    raise _Reject("the sink column is never dropped after the softmax (the probabilities keep it)")


def _check_drop(e, d, first):
  """The slice must keep every key and drop the sink column: [..., :-1] when it was appended, [..., 1:] when it
  was prepended."""
  shape = tuple(e.ins[0].aval.shape)
  start, limit = tuple(e.params["start_indices"]), tuple(e.params["limit_indices"])
  strides = e.params.get("strides")
  want_start = tuple(1 if (a == d and first) else 0 for a in range(len(shape)))
  want_limit = tuple(n - 1 if (a == d and not first) else n for a, n in enumerate(shape))
  if (strides is not None and any(s != 1 for s in strides)) or start != want_start or limit != want_limit:
    where = "first" if first else "last"
    raise _Reject(
      f"the slice after the softmax keeps {start[d]}:{limit[d]} of the {shape[d]} columns on the joined axis, not "
      f"the keys alone (the sink column is the {where}; it must be the one dropped, and only it)"
    )


def _reaches(prog, g1, target, consumers, limit=256):
  """Whether equation `target` reads a value computed from g1's logits before any further contraction (so
  within g1's attention, not in a later layer's)."""
  seen, frontier = set(), [prog.eqns[g1].outs[0]]
  while frontier and len(seen) < limit:
    v = frontier.pop()
    for j in consumers.get(v, ()):
      if j == target:
        return True
      if j not in seen and prog.eqns[j].name != "dot_general":
        seen.add(j)
        frontier.extend(prog.eqns[j].outs)
  return False


# -- the view and the claimed site ---------------------------------------------------------------------------------


def _view(prog, chains):
  """The program as plain attention: readers of a joined array read its logits, readers of a slice read its
  input; the join and the slice read no attention value (see the module, step 2)."""
  swap, eqns = {}, list(prog.eqns)
  for c in chains:
    swap[prog.eqns[c.concat].outs[0]] = c.logits
    swap[prog.eqns[c.drop].outs[0]] = prog.eqns[c.drop].ins[0]
    eqns[c.concat] = dataclasses.replace(prog.eqns[c.concat], ins=[c.column])
    eqns[c.drop] = dataclasses.replace(prog.eqns[c.drop], ins=[])
  for i, e in enumerate(eqns):
    if any(not is_literal(a) and a in swap for a in e.ins):
      eqns[i] = dataclasses.replace(e, ins=[swap.get(a, a) if not is_literal(a) else a for a in e.ins])
  return Program(prog.invars, prog.outvars, eqns)


def _claim(prog, site, chain, producers, consumers, outputs):
  """Adds the join and the slice to the site, after checking it covers the chain; redoes the escape check on the
  real program (the view hid the joined array's readers)."""
  if not chain.body <= site.interior:
    raise _Reject("the softmax around the sink column is not all part of the attention")
  site.interior |= {chain.concat, chain.drop}
  for j in site.interior - {site.g2}:
    for v in prog.eqns[j].outs:
      if v in outputs or any(u not in site.interior for u in consumers.get(v, ())):
        raise _Reject("attention weights or logits are used outside the attention (returned or sown)")


def _sink_ref(prog, site, chain, producers):
  """The sinks as an array over the site's head atoms (see the module, step 3)."""
  lay = _layout(prog, site, chain.logits)
  if lay is None:
    raise _Reject("the layout of the logits at the join is not understood")
  lay = tuple(() if n == chain.axis else ax for n, ax in enumerate(lay))
  atom, lay = _trace_column(prog, chain.column, lay, producers, site.sizes)
  heads = [a for a in (site.roles.get("K"), site.roles.get("G")) if a is not None]
  if site.kv_repeated:  # the matcher split the repeated head atom into (kv head, group)
    whole = site.roles["K"][:-1]
    lay = tuple(
      tuple(b for a in ax for b in ((site.roles["K"], site.roles["G"]) if a == whole else (a,))) for ax in lay
    )
  extra = [a for ax in lay for a in ax if site.sizes[a] > 1 and a not in heads]
  if extra:
    raise _Reject("the sink column varies over more than the heads (batch or query positions)")
  return SinkRef(atom, tuple(tuple(a for a in ax if site.sizes[a] > 1) for ax in lay), chain.column.aval.dtype)


def _layout(prog, site, target):
  """The atom layout of `target`, computed from the site's logits by the ops allowed before a softmax, with the
  atoms named as `attention` names them; None when `target` is not reached that way."""
  e1 = prog.eqns[site.g1]
  (lc, rc), (lb, rb) = e1.params["dimension_numbers"]
  out = [(f"b{n}",) for n in range(len(lb))]
  for shape, used, tag in (
    (e1.ins[0].aval.shape, set(lc) | set(lb), "l"),
    (e1.ins[1].aval.shape, set(rc) | set(rb), "r"),
  ):
    free = [ax for ax in range(len(shape)) if ax not in used]
    out += [(f"{tag}{n}",) for n in range(len(free))]
  lays = {e1.outs[0]: tuple(out)}
  for j in range(site.g1 + 1, len(prog.eqns)):
    if target in lays:
      break
    e = prog.eqns[j]
    tracked = [a for a in e.ins if not is_literal(a) and a in lays]
    if not tracked or not e.outs:
      continue
    lay, out_shape = lays[tracked[0]], tuple(e.outs[0].aval.shape)
    if e.name == "transpose":
      lay = tuple(lay[p] for p in e.params["permutation"])
    elif e.name == "reshape":
      lay = reshape_layout(lay, site.sizes, e.params["new_sizes"]) if e.params.get("dimensions") is None else None
    elif e.name == "squeeze":
      lay = tuple(ax for n, ax in enumerate(lay) if n not in e.params["dimensions"])
    elif e.name == "broadcast_in_dim":
      new = [()] * len(out_shape)
      for src, dst in enumerate(e.params["broadcast_dimensions"]):
        new[dst] = lay[src]
      lay = tuple(new)
    elif len(out_shape) != len(lay):
      continue
    if lay is not None:
      lays[e.outs[0]] = lay
  return lays.get(target)


def _trace_column(prog, atom, lay, producers, sizes):
  """(source, layout): the column traced back through broadcasts, reshapes that keep its atoms and float casts."""
  while atom in producers:
    e = prog.eqns[producers[atom]]
    src = e.ins[0] if e.ins else None
    if src is None or is_literal(src):
      break
    if e.name == "broadcast_in_dim":
      src_shape = tuple(src.aval.shape)
      lay = tuple(lay[d] if src_shape[n] != 1 else () for n, d in enumerate(e.params["broadcast_dimensions"]))
    elif e.name in _CAST_OPS and jnp.issubdtype(src.aval.dtype, jnp.floating):
      pass
    elif e.name == "reshape" and e.params.get("dimensions") is None:
      src_shape = tuple(src.aval.shape)
      keep = [ax for ax in lay if any(sizes[a] > 1 for a in ax)]
      if [s for s in src_shape if s != 1] != [math.prod(sizes[a] for a in ax) for ax in keep]:
        break
      it = iter(keep)
      lay = tuple(next(it) if s != 1 else () for s in src_shape)
    else:
      break
    atom = src
  return atom, lay


def read_sinks(site, ref: SinkRef, read):
  """The site's sinks [N] (K-major, as its q heads) from the program's values."""
  r, sz = site.roles, site.sizes
  heads = [a for a in (r.get("K"), r.get("G")) if a is not None]
  x = jnp.asarray(read(ref.atom)).astype(ref.dtype)
  x = to_atoms(x, ref.layout, sz, heads)
  n = math.prod(sz[a] for a in heads)
  return jnp.broadcast_to(x, tuple(sz[a] for a in heads)).reshape(n)

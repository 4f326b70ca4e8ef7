"""A recognised attention site: what it computes, how it is built from the matched path, and how it is run.

`Site` (with `MaskRef`, `Rejected`) is what the matcher in `attention.py` finds; `finish` builds one at the second
`dot_general` (assigning the roles B, T, S, K, G, H, tracing masks back to the model's arrays, undoing
`jnp.repeat` of k and v), and `site_inputs` / `site_output` move values between the model's layouts and the
ring's `[B, T, N, H]` through the atom layouts (`to_atoms` / `from_atoms`).  Builds on `program.py` and
`band.py` (a constant band too big to build); imported by `attention.py`, never the other way round.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np

from flax_ringattn._src.matcher.band import band_extent, is_large_constant
from flax_ringattn._src.matcher.program import const_value, is_literal, scalar_value

# -- layouts --------------------------------------------------------------------------------------


def reshape_layout(layout, sizes, new_sizes):
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


# -- sites ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class MaskRef:
  """A boolean mask or additive bias the model built, traced back to its source array."""

  atom: object  # the source array
  layout: tuple  # atom tuple of each source axis
  kind: str  # "mask" (visible where nonzero) or "bias"
  negate: bool = False  # visible where the source is zero
  window: tuple | None = None  # a constant band factor of the mask: (left, right)
  causal: bool = False  # a constant factor hides every later key (the causal triangle, or a causal band)
  from_data: bool = True  # the mask has factors other than constants (read from the model's data at each call)


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
      # What the model's code fixes (constant factors) and whether the rest comes from its data at each call.
      "mask_causal": any(m.causal for m in self.masks),
      "mask_from_data": any(m.from_data or m.kind == "bias" for m in self.masks),
      "softmax": f"{self.softmax} in {self.softmax_dtype}",
      "kv_repeated": self.kv_repeated,
    }


@dataclasses.dataclass
class Rejected:
  """An attention-like computation (a dot_general whose result reaches an exp / softmax) left alone."""

  g1: int
  reason: str


class Fail(Exception):
  pass


# -- building a site ------------------------------------------------------------------------------


def mask_ref(prog, atom, lay, producers, kind, *, negate=False, sizes):
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
  window, causal, from_data = _constant_band(prog, atom, src_lay, producers, sizes) if kind == "mask" else (None,) * 3
  layout = tuple(tuple(a for a in ax if sizes[a] > 1) for ax in src_lay)
  # A negated source hides where it is nonzero: its constant band says nothing about causality.
  return MaskRef(
    atom, layout, kind, negate, window, causal=bool(causal) and not negate, from_data=from_data is not False
  )


def _is_zero(prog, atom, producers):
  return scalar_value(prog, atom, producers) == 0.0


def _constant_band(prog, atom, src_lay, producers, sizes):
  """What the model built from constants into the mask (`triu` / `tril` bands ANDed or multiplied in):
  (window, causal, from_data).  window: the (left, right) of the constant factors' band, or None (no band, or
  the whole causal triangle); causal: that band hides every later key; from_data: the mask has other factors
  (the model's inputs: recovered at each call).  A factor too big for `const_value` (a [B, T, T] band at large
  B * T * T) is read at points instead (`band.band_extent`)."""
  consts, large, data = [], [], []

  def collect(a, depth=8):
    val = const_value(prog, a, producers)
    if val is not None:
      consts.append(val)
      return
    if not is_literal(a) and is_large_constant(prog, a, producers):
      large.append(a)
      return
    if depth == 0 or is_literal(a) or a not in producers:
      data.append(a)
      return
    e = prog.eqns[producers[a]]
    if e.name in ("and", "mul"):
      for b in e.ins:
        collect(b, depth - 1)
    elif e.name in ("convert_element_type", "broadcast_in_dim") or (
      e.name == "ne" and _is_zero(prog, e.ins[1], producers)
    ):
      collect(e.ins[0], depth - 1)
    else:
      data.append(a)

  collect(atom)
  from_data = bool(data) or (not consts and not large)
  slices = [v for v in map(_band_slice, consts) if v is not None]
  if large:
    extent = band_extent(prog, producers, slices, large)
  else:
    extent = _slices_extent(slices)
  if extent is None:
    return None, False, from_data
  left, right, n = extent
  return _window(left, right, n), right == 0, from_data


def _slices_extent(slices):
  """(left, right, n) of the AND of [n, n] constant bands, or None (none, empty, or not whole diagonals)."""
  band = None
  for v in slices:
    band = v if band is None else band & v
  if band is None:
    return None
  i, j = np.nonzero(band)
  if i.size == 0:
    return None
  left, right = int(np.max(i - j)), int(np.max(j - i))
  rows, cols = np.indices(band.shape)
  if not np.array_equal(band, (cols >= rows - left) & (cols <= rows + right)):
    return None
  return left, right, band.shape[0]


def _band_slice(val):
  """A constant factor as one [n, n] bool band, or None (its leading axes hold different bands, or not square)."""
  v = np.asarray(val) != 0
  while v.ndim > 2 and (v.shape[0] == 1 or bool(np.all(v == v[:1]))):
    v = v[0]  # leading (batch, head) axes of a band built like the mask: the same band in each
  return v if v.ndim == 2 and v.shape[0] == v.shape[1] else None


def _window(left, right, n):
  if left < 0 or right < 0:
    # A band off the diagonal (`tril(ones, -1)`: strictly earlier keys) leaves a row with no key: no window.
    raise Fail(
      f"a constant band without the diagonal (window {(left, right)}: a query that cannot see its own key) is "
      "outside the mask family"
    )
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


def finish(prog, g1, g2, e2, tracks, sizes, lay_l, lay_r, e1, state, interior, producers, consumers, outputs):
  """The second dot_general: probabilities times v.  Assigns roles and builds the Site."""
  if state["S"] is None or state["softmax"] is None:
    raise Fail("no softmax before the second contraction")
  p_atom = next(a for a in e2.ins if not is_literal(a) and a in tracks)
  p = tracks[p_atom]
  if p.stage != "probs":
    raise Fail(f"the {p.stage} (not the probabilities) meet a contraction")
  (c0, c1), (b0, b1) = e2.params["dimension_numbers"]
  p_is_lhs = e2.ins[0] is p_atom
  pc, vc = (c0, c1) if p_is_lhs else (c1, c0)
  pb, vb = (b0, b1) if p_is_lhs else (b1, b0)
  v_atom = e2.ins[1] if p_is_lhs else e2.ins[0]
  S = state["S"]
  if len(pc) != 1 or tuple(a for a in p.layout[pc[0]] if sizes[a] > 1) != (S,):
    raise Fail("the probabilities are contracted over something other than the key axis")
  vshape = tuple(v_atom.aval.shape)
  v_lay = [None] * len(vshape)
  v_lay[vc[0]] = (S,)
  for a, b in zip(pb, vb, strict=True):
    v_lay[b] = p.layout[a]
  free = [n for n in range(len(vshape)) if v_lay[n] is None]
  if len(free) != 1:
    raise Fail(f"v has {len(free)} free axes (expected one head dim)")
  sizes["Hv"] = vshape[free[0]]
  v_lay[free[0]] = ("Hv",)
  p_free = [p.layout[n] for n in range(len(p.layout)) if n not in pc and n not in pb]
  batch = [p.layout[n] for n in pb]
  out_layout = tuple(batch + (p_free + [("Hv",)] if p_is_lhs else [("Hv",)] + p_free))
  # The escape check: nothing computed inside the site is used outside it.
  for j in interior - {g2}:
    for v in prog.eqns[j].outs:
      if v in outputs or any(u not in interior and u != g2 for u in consumers.get(v, ())):
        raise Fail("attention weights or logits are used outside the attention (returned or sown)")
  # Which dot_general operand is q: the one without the key axis.
  s_on_r = any(S in ax for ax in lay_r)
  q_atom, q_lay = (e1.ins[0], tuple(lay_l)) if s_on_r else (e1.ins[1], tuple(lay_r))
  k_atom, k_lay = (e1.ins[1], tuple(lay_r)) if s_on_r else (e1.ins[0], tuple(lay_l))
  q_free = [ax[0] for ax in q_lay if ax[0][0] in "lr" and sizes[ax[0]] > 1]
  k_free = [ax[0] for ax in k_lay if ax[0][0] in "lr" and sizes[ax[0]] > 1]
  if k_free != [S]:
    raise Fail(f"k has free axes {k_free} besides the key axis")
  batch_atoms = [ax[0] for ax in q_lay if ax[0].startswith("b") and sizes[ax[0]] > 1]
  form = p.form
  mask_atoms = {a for m in form.masks for ax in m.layout for a in ax}
  B = next((a for a in batch_atoms if a in mask_atoms), None)
  heads = [a for a in batch_atoms if a != B]
  if B is None and len(heads) > 1:
    B, heads = heads[0], heads[1:]
  if len(heads) > 1:
    raise Fail(f"more than one head axis {heads}")
  T = next((a for a in q_free if a in mask_atoms), None)
  if T is None:
    same = [a for a in q_free if sizes[a] == sizes[S]]
    T = same[0] if len(same) == 1 else (q_free[0] if q_free else None)
  if T is None:
    raise Fail("no query axis")
  groups = [a for a in q_free if a != T]
  if len(groups) > 1:
    raise Fail(f"more than one group axis {groups}")
  for m in form.masks:
    extra = [a for ax in m.layout for a in ax if a not in (B, T, S)]
    if extra:
      raise Fail("a per-head mask")
  if sizes[T] != sizes[S]:
    raise Fail(f"cross or cached attention: {sizes[T]} queries against {sizes[S]} keys")
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
        raise Fail("GQA both grouped in the einsum and repeated")
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

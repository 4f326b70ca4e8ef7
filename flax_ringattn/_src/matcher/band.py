"""Constants of the flattened program read at chosen points, never built whole: sliding-window bands of any size.

`const_value` (program.py) evaluates a constant on the host, up to `MAX_CONST_ELEMENTS` elements.  A band
the model builds like its mask (`jnp.triu(ones_like(mask), 1 - w) * jnp.tril(ones_like(mask), w - 1)` on a
[B, T, T] mask, as google-tunix does) passes that at B = 2, T = 2944.  `const_at` evaluates the same expressions
(literals, constants and `iota` through the ops of `CONST_OPS`, as deep as `const_value` reads) at an array of
index points: each layout op maps the points to points of its input (`broadcast_in_dim` picks its dims, `reshape`
ravels and unravels, `transpose` permutes, `iota` is one index column), each elementwise op runs on the values
gathered there.  On it:

* `band_extent`: the (left, right) of the AND of constant band factors, read from their diagonals, checked at
  every point of a small band, at a sample of points (both edge rows and columns, points along every diagonal,
  random points; the leading axes' corners) of a large one;
* `const_sample`: a large constant's values at its corners and random points (an additive bias's values).

A band checked at a sample can only be wrong about points it did not read, and the run checks the whole mask
against the recovered structure (a wrong window makes the output NaN, never silently different).  Imports
`program.py` only; `site.py` and `attention.py` use it.
"""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jex_core

from flax_ringattn._src.matcher.program import CONST_OPS, MAX_CONST_ELEMENTS, Const

_DEPTH = 12  # the reach of const_value: a constant the one reads, the other reads too
_VISITS = 4096  # equations visited by one evaluation (a shared sub-expression counts at each use)
EXHAUSTIVE = 1 << 16  # a [n, n] band of at most this many points is checked at every point
_PER_DIAGONAL = 10  # points read along each diagonal of a larger band (its two ends among them)
_RANDOM = 4096  # random points read of a large band or constant
_LEADING = 8  # leading (batch, head) indices a large band is compared at, besides index 0


class _Unknown(Exception):
  """Not a constant the point evaluator reads (an input, an unknown op, too deep)."""


def shape_of(atom) -> tuple:
  if isinstance(atom, Const):
    return tuple(np.shape(atom.val))
  return tuple(atom.aval.shape)


def const_at(prog, atom, producers, index, depth: int = _DEPTH):
  """The values [P] of `atom` at the index points `index` [P, ndim] when `atom` is computed from literals,
  constants and `iota` only (through the ops of `CONST_OPS`), else None.  Never builds the whole array."""
  shape = shape_of(atom)
  index = np.asarray(index, np.int64)
  if index.ndim != 2 or index.shape[1] != len(shape):
    raise ValueError(f"index points must be [P, {len(shape)}] for shape {shape}, got {index.shape}")
  if index.size and (np.any(index < 0) or np.any(index >= np.asarray(shape, np.int64))):
    raise IndexError(f"index points outside shape {shape}")
  try:
    return _Points(prog, producers).at(atom, index, depth)
  except _Unknown:
    return None


def is_large_constant(prog, atom, producers) -> bool:
  """True when `atom` has more than MAX_CONST_ELEMENTS elements (const_value gives up) and is a constant the
  point evaluator reads."""
  shape = shape_of(atom)
  if math.prod(shape) <= MAX_CONST_ELEMENTS:
    return False
  return const_at(prog, atom, producers, np.zeros((1, len(shape)), np.int64)) is not None


def const_sample(prog, atom, producers, count: int = _RANDOM, seed: int = 0):
  """The values of the constant `atom` at its corners (up to 64), at `count` random points and, when its last two
  axes are square, at the points a band is read at (`_band_points`, leading index 0), or None when it is not a
  constant the point evaluator reads."""
  shape = shape_of(atom)
  if 0 in shape:
    return None
  rng = np.random.default_rng(seed)
  corners = itertools.islice(itertools.product(*[sorted({0, s - 1}) for s in shape]), 64)
  points = [np.asarray(list(corners), np.int64).reshape(-1, len(shape))]
  points.append(rng.integers(0, np.asarray(shape, np.int64), size=(count, len(shape))).reshape(count, len(shape)))
  if len(shape) >= 2 and shape[-1] == shape[-2]:
    rows, cols = _band_points(shape[-1], rng)
    points.append(np.concatenate([np.zeros((rows.size, len(shape) - 2), np.int64), rows[:, None], cols[:, None]], 1))
  return const_at(prog, atom, producers, np.concatenate(points))


def band_extent(prog, producers, slices, large, seed: int = 0):
  """(left, right, n) of the AND of constant band factors, or None.

  `slices`: [n, n] bool bands already evaluated (`const_value`, leading axes dropped); `large`: atoms of constants
  too big for that, each [..., n, n].  As with `slices`, a large factor is one band [n, n] only when each leading
  slice is the same: one that differs at the leading indices read is left out, and so is one that is not
  [..., n, n].  The band must be whole diagonals `left` below to `right` above the main one (every diagonal all
  visible or all hidden, the visible ones contiguous): checked at every point when n * n <= EXHAUSTIVE, else at
  a sample."""
  ns = {s.shape[0] for s in slices}
  square = [a for a in large if len(shape_of(a)) >= 2 and shape_of(a)[-1] == shape_of(a)[-2]]
  ns |= {shape_of(a)[-1] for a in square}
  if len(ns) != 1:
    return None
  (n,) = ns
  if n < 1:
    return None
  rng = np.random.default_rng(seed)
  rows, cols = _band_points(n, rng)
  visible = np.ones(rows.size, bool)
  for s in slices:
    visible &= s[rows, cols]
  kept = len(slices)
  for a in square:
    vals = _slice_values(prog, producers, a, rows, cols, rng)
    if vals is None:
      return None
    if vals is not False:
      visible &= vals
      kept += 1
  if not kept:
    return None
  diag = cols - rows + (n - 1)  # 0 .. 2n - 2: the diagonal j - i, shifted
  total = np.bincount(diag, minlength=2 * n - 1)
  hits = np.bincount(diag, weights=visible, minlength=2 * n - 1)
  full, empty = hits == total, hits == 0
  if not np.all(total > 0) or not np.all(full | empty):
    return None
  on = np.nonzero(full)[0]
  if on.size == 0 or on[-1] - on[0] + 1 != on.size:
    return None
  return int(n - 1 - on[0]), int(on[-1] - (n - 1)), n


def _band_points(n, rng):
  """(rows, cols) of the points a [n, n] band is read at: all of them when small, else both edge rows and
  columns, the two ends and _PER_DIAGONAL - 2 more points of each diagonal, and _RANDOM random points."""
  if n * n <= EXHAUSTIVE:
    rows, cols = np.indices((n, n)).reshape(2, -1)
    return rows, cols
  ar, last = np.arange(n), np.full(n, n - 1)
  edge_r = np.concatenate([np.zeros(n, np.int64), last, ar, ar])
  edge_c = np.concatenate([ar, ar, np.zeros(n, np.int64), last])
  d = np.arange(-(n - 1), n)
  length = n - np.abs(d)
  even = (length[None] * np.arange(1, _PER_DIAGONAL // 2)[:, None]) // (_PER_DIAGONAL // 2)
  rand = (rng.random((_PER_DIAGONAL - _PER_DIAGONAL // 2 - 1, d.size)) * length).astype(np.int64)
  t = np.concatenate([np.zeros((1, d.size), np.int64), (length - 1)[None], even, rand])
  diag_r = (np.maximum(0, -d)[None] + t).reshape(-1)
  diag_c = diag_r + np.broadcast_to(d, t.shape).reshape(-1)
  rand_r, rand_c = rng.integers(0, n, size=(2, _RANDOM))
  rows = np.concatenate([edge_r, diag_r, rand_r]).astype(np.int64)
  cols = np.concatenate([edge_c, diag_c, rand_c]).astype(np.int64)
  return rows, cols


def _slice_values(prog, producers, atom, rows, cols, rng):
  """The band of a large factor [..., n, n] at (rows, cols), read at leading index 0 (bool), False when another
  leading index read differs there (not one band for all), None when it cannot be read."""
  lead = shape_of(atom)[:-2]
  corners = itertools.islice(itertools.product(*[sorted({0, s - 1}) for s in lead]), 1, _LEADING - 1)
  randoms = [tuple(int(rng.integers(0, s)) for s in lead) for _ in range(2)] if lead else []
  others = [c for c in dict.fromkeys([*corners, *randoms]) if any(c)]

  def points(c):
    return np.concatenate([np.tile(np.asarray(c, np.int64), (rows.size, 1)), rows[:, None], cols[:, None]], 1)

  index = np.concatenate([points((0,) * len(lead)), *map(points, others)])
  vals = const_at(prog, atom, producers, index)
  if vals is None:
    return None
  vals = (vals != 0).reshape(1 + len(others), rows.size)
  if not np.all(vals == vals[:1]):
    return False
  return vals[0]


# -- the point evaluator ----------------------------------------------------------------------------


def _select_n(pred, *cases):
  out = cases[0]
  for k, case in enumerate(cases[1:], 1):
    out = np.where(pred == k, case, out)
  return out


# Elementwise ops numpy computes exactly as XLA does (on bool, integer and float dtypes numpy knows); the other
# elementwise ops of CONST_OPS (div, exp, ...) are bound as JAX primitives on the gathered values.
_NUMPY = {
  "add": np.add,
  "sub": np.subtract,
  "mul": np.multiply,
  "neg": np.negative,
  "abs": np.abs,
  "max": np.maximum,
  "min": np.minimum,
  "ge": np.greater_equal,
  "le": np.less_equal,
  "gt": np.greater,
  "lt": np.less,
  "eq": np.equal,
  "ne": np.not_equal,
  "and": np.bitwise_and,
  "or": np.bitwise_or,
  "not": np.invert,
  "select_n": _select_n,
  "square": lambda x: np.multiply(x, x),
  "stop_gradient": lambda x: x,
}
_LAYOUT = ("broadcast_in_dim", "reshape", "squeeze", "transpose", "iota")


class _Points:
  def __init__(self, prog, producers):
    self.prog, self.producers, self.visits = prog, producers, _VISITS

  def at(self, atom, idx, depth):
    n = idx.shape[0]
    if isinstance(atom, (Const, jex_core.Literal)):
      val = atom.val
      if isinstance(val, jax.core.Tracer):
        raise _Unknown
      arr = np.asarray(val, dtype=atom.aval.dtype) if isinstance(atom, jex_core.Literal) else np.asarray(val)
      return np.full(n, arr, arr.dtype) if arr.ndim == 0 else arr[tuple(idx.T)]
    if depth == 0 or atom not in self.producers or self.visits == 0:
      raise _Unknown
    self.visits -= 1
    e = self.prog.eqns[self.producers[atom]]
    name = e.name
    if name not in CONST_OPS or len(e.outs) != 1:
      raise _Unknown
    out_dtype = e.outs[0].aval.dtype
    if name in _LAYOUT:
      return self._layout(e, idx, depth)
    rank = idx.shape[1]
    vals = []
    for a in e.ins:
      r = len(shape_of(a))
      if r not in (0, rank):
        raise _Unknown
      vals.append(self.at(a, idx if r else idx[:, :0], depth - 1))
    if name == "convert_element_type":
      src, dst = vals[0].dtype, np.dtype(out_dtype)
      if src.kind in "biuf" and dst.kind in "biuf" and not (src.kind == "f" and dst.kind != "f"):
        return vals[0].astype(dst)  # float to integer (rounding, saturation) is left to XLA
    elif name in _NUMPY and all(v.dtype.kind in "biuf" for v in vals):
      return np.asarray(_NUMPY[name](*vals)).astype(out_dtype, copy=False)
    return _bind(e, vals, n)

  def _layout(self, e, idx, depth):
    name, p = e.name, e.params
    if name == "iota":
      return idx[:, p["dimension"]].astype(p["dtype"])
    if len(e.ins) != 1:
      raise _Unknown  # a dynamic shape
    src = e.ins[0]
    in_shape = shape_of(src)
    sub = np.zeros((idx.shape[0], len(in_shape)), np.int64)
    if name == "broadcast_in_dim":
      for k, d in enumerate(p["broadcast_dimensions"]):
        if in_shape[k] != 1:
          sub[:, k] = idx[:, d]
    elif name == "reshape":
      if p.get("dimensions") is not None:
        raise _Unknown
      out_shape = tuple(e.outs[0].aval.shape)
      flat = np.ravel_multi_index(tuple(idx.T), out_shape) if out_shape else np.zeros(idx.shape[0], np.int64)
      if in_shape:
        sub = np.stack(np.unravel_index(flat, in_shape), 1).astype(np.int64)
    elif name == "squeeze":
      keep = [k for k in range(len(in_shape)) if k not in set(p["dimensions"])]
      sub[:, keep] = idx
    else:  # transpose: output axis k is input axis perm[k]
      sub[:, list(p["permutation"])] = idx
    return self.at(src, sub, depth - 1)


def _bind(e, vals, n):
  """The primitive of `e` bound on the gathered values (padded to a power of two: few shapes to compile)."""
  size = max(64, 1 << max(n - 1, 0).bit_length())
  params = e.eqn.primitive.get_bind_params(e.params)
  try:
    with jax.ensure_compile_time_eval():
      out = e.eqn.primitive.bind(*[jnp.asarray(np.resize(v, size)) for v in vals], **params)
    return np.asarray(out)[:n]
  except Exception as err:  # noqa: BLE001 (a primitive that does not take the gathered values: not read)
    raise _Unknown from err

"""Which (query, key) pairs may attend, from the tokens' own positions.

One source of truth for every mask feature, used at three granularities:

* elementwise (`visible`, `pair_visible`): the reference and the partially
  masked tiles of a block kernel;
* per tile (`classify`): a block kernel skips tiles that are `EMPTY` and drops
  the mask arithmetic on tiles that are `FULL`;
* per hop: the ring loop skips a whole (q shard, kv shard) pair that is `EMPTY`.

The mask is two objects.  `MaskSpec` is static (which terms exist: causal,
window, chunk, segments, bidirectional spans, positions given per row); it is
hashable, a jit static argument.  `Tokens` is one side's per-token data
(positions, segment ids, bidirectional ids), a pytree that travels with q or
with K/V through shard_map, the ring's rotation and the custom_vjp.  For query
i and key j the rule is

    seg_q[i] == seg_kv[j]  and  ( [causal: kv_pos <= q_pos]
                                 & [window: q_pos - left <= kv_pos <= q_pos + right]
                                 & [chunk: q_pos // C == kv_pos // C]
                                 or [bid_q[i] != 0 and bid_q[i] == bid_kv[j]] )

Positions are the tokens' own (global) positions, not their index in the
array: the layout's positions ([L], the same for every row: contiguous shards
or zigzag) by default, or [B, L] given by the caller, so the tokens may come in
any order.  Causal and window semantics follow `jax.nn.dot_product_attention`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flax_ringattn._src import validation

# An additive bias entry at or below this hides its key (exp underflows to exactly 0 in every float type).
BIAS_MASKED = -1e6

# Tile classes shared by the ring loop and every backend.
EMPTY = 0  # no pair is visible: skip all work
PARTIAL = 1  # some pairs are visible: apply the elementwise mask
FULL = 2  # every pair is visible: no mask needed


@dataclasses.dataclass(frozen=True, kw_only=True)
class MaskSpec:
  """Static description of the mask; hashable so it can be a jit static arg."""

  is_causal: bool = False
  window: tuple[int, int] | None = None  # (left, right), both >= 0
  chunk_size: int | None = None  # Llama 4's chunked attention: q_pos // C == kv_pos // C
  has_segments: bool = False
  has_bidirectional: bool = False  # bidirectional ids: equal nonzero ids see each other (image spans, prefix-LM)
  has_positions: bool = False  # positions given per row ([B, L], travelling with the tokens), not the layout's

  @property
  def is_trivial(self) -> bool:
    return not (self.is_causal or self.window is not None or self.chunk_size is not None or self.has_segments)

  @property
  def data_fields(self) -> tuple[str, ...]:
    """The `Tokens` fields this mask holds as per-row data, in `Tokens` order: positions given per row, segment
    ids, bidirectional ids.  The kernels take each as a q column and a kv row, and their VMEM models count them
    from here: a further per-token term is a field of `Tokens` and a name here, nothing in the kernels."""
    named = (("pos", self.has_positions), ("seg", self.has_segments), ("bid", self.has_bidirectional))
    return tuple(name for name, on in named if on)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Tokens:
  """One side's per-token mask data (a pytree; every field [B, L] int32, or None when the mask lacks it).

  pos: the tokens' positions: [B, L] when given, [L] for the layout's own (shared by every row), or None
    inside the ring where the layout's are recomputed per hop.
  seg: segment ids; bid: bidirectional ids (0: none).
  """

  pos: object = None
  seg: object = None
  bid: object = None

  def slice(self, start, size: int) -> Tokens:
    """Tokens start .. start + size - 1 of every field (start may be traced)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, start, size, axis=a.ndim - 1), self)

  def rows(self) -> Tokens:
    """Every field with a leading row axis: a shared [L] position array becomes [1, L]."""
    return jax.tree.map(lambda a: a if a.ndim == 2 else a[None], self)

  def per_row(self, B: int) -> Tokens:
    """Every field [B, L] int32 (shared positions repeated for each row): what a kernel blocks by batch row."""
    return jax.tree.map(lambda a: jnp.broadcast_to(jnp.asarray(a, jnp.int32), (B, a.shape[-1])), self)


def visible(spec: MaskSpec, q: Tokens, kv: Tokens):
  """Elementwise visibility of every (query, key) pair: bool [B | 1, T, S]."""
  return tile_visible(spec, q.rows(), kv.rows())


def tokens_visible(spec: MaskSpec, q: Tokens, kv: Tokens):
  """Visibility of q and kv tokens whose fields already broadcast against each other (e.g. a kernel's (bq, 1)
  column against its (1, bk) row)."""
  return pair_visible(spec, q.pos, kv.pos, q.seg, kv.seg, q.bid, kv.bid)


def tile_visible(spec: MaskSpec, q: Tokens, kv: Tokens):
  """Visibility of every pair of q tokens [..., T] and kv tokens [..., S] (fields with the same leading axes, e.g.
  one tile's [bq] and [bk] inside a kernel): bool [..., T, S]."""
  col = lambda a: None if a is None else a[..., :, None]  # noqa: E731
  row = lambda a: None if a is None else a[..., None, :]  # noqa: E731
  return pair_visible(spec, col(q.pos), row(kv.pos), col(q.seg), row(kv.seg), col(q.bid), row(kv.bid))


def pair_visible(spec: MaskSpec, qp, kp, qs=None, ks=None, qb=None, kb=None):
  """Visibility of mutually broadcastable query / key arrays (positions, segment ids, bidirectional ids).

  The one place the mask rules live: `visible` calls it on whole shards and a
  kernel calls it on a tile (qp [bq, 1] against kp [1, bk]).
  """
  mask = jnp.ones(jnp.broadcast_shapes(jnp.shape(qp), jnp.shape(kp)), dtype=bool)
  if spec.is_causal:
    mask = mask & (kp <= qp)
  if spec.window is not None:
    left, right = spec.window
    mask = mask & (kp >= qp - left) & (kp <= qp + right)
  if spec.chunk_size is not None:
    mask = mask & (chunk_index(qp, spec.chunk_size) == chunk_index(kp, spec.chunk_size))
  if spec.has_bidirectional:
    mask = mask | ((qb != 0) & (qb == kb))
  if spec.has_segments:
    mask = mask & (qs == ks)
  return mask


def chunk_index(pos, chunk_size: int):
  """pos // chunk_size (floor, also for negative positions) without `lax.sign`, which Mosaic lowers only on a
  TPU: truncating division, minus one where the remainder is negative.  numpy in, numpy out (static tables)."""
  if isinstance(pos, (np.ndarray, np.generic, int)):
    return np.floor_divide(pos, chunk_size)
  pos = jnp.asarray(pos)
  c = jnp.asarray(chunk_size, pos.dtype)
  return jax.lax.div(pos, c) - (jax.lax.rem(pos, c) < 0).astype(pos.dtype)


def first_visible_position(spec: MaskSpec, pos):
  """The smallest key position a causal query at `pos` (>= 0, may be traced) can see: 0, the window's left edge
  or its chunk's first position, whichever is last (never negative).  Paged attention skips the kv blocks before
  it."""
  lo = jnp.zeros_like(jnp.asarray(pos))
  if spec.window is not None:
    lo = jnp.maximum(lo, pos - spec.window[0])
  if spec.chunk_size is not None:
    lo = jnp.maximum(lo, chunk_index(pos, spec.chunk_size) * spec.chunk_size)
  return lo


@dataclasses.dataclass(frozen=True)
class Extent:
  """Min/max of each `Tokens` field over tiles, with a leading row axis ([B | 1, n] or broadcast forms of it);
  a field the mask lacks is None."""

  pos_min: object
  pos_max: object
  seg_min: object = None
  seg_max: object = None
  bid_min: object = None
  bid_max: object = None

  def map(self, f) -> Extent:
    return Extent(*(None if a is None else f(a) for a in dataclasses.astuple(self)))


def tile_extent(tokens: Tokens, tile: int) -> Extent:
  """Extents of consecutive tiles of `tile` tokens: every field [B | 1, L] -> [B | 1, L // tile]."""
  t = tokens.rows()
  xp = np if isinstance(t.pos, np.ndarray) else jnp

  def minmax(a):
    if a is None:
      return None, None
    a = a.reshape(a.shape[0], a.shape[1] // tile, tile)
    return xp.min(a, axis=2), xp.max(a, axis=2)

  return Extent(*minmax(t.pos), *minmax(t.seg), *minmax(t.bid))


def classify(spec: MaskSpec, q: Extent, kv: Extent):
  """EMPTY / PARTIAL / FULL for every (q tile, kv tile) pair, over every row.

  `q` and `kv` extents must broadcast against each other after their row axis
  (e.g. q of shape [B, nq, 1] and kv of shape [1, 1, nk] give an [nq, nk]
  table).  The answer is exact for causal, window and chunk masks on the
  layout's positions, and conservative (never EMPTY or FULL by mistake)
  otherwise: a term is EMPTY on a tile pair when the min/max ranges already
  rule out every pair, FULL when they guarantee every pair.  With numpy
  extents it computes in numpy (static tables decided at trace time).
  """
  xp = np if isinstance(q.pos_min, np.ndarray) and isinstance(kv.pos_min, np.ndarray) else jnp
  shapes = [xp.shape(a) for a in dataclasses.astuple(q) + dataclasses.astuple(kv) if a is not None]
  empty = xp.zeros(xp.broadcast_shapes(*shapes), bool)
  full = xp.ones_like(empty)
  if spec.is_causal:
    empty = empty | (kv.pos_min > q.pos_max)
    full = full & (kv.pos_max <= q.pos_min)
  if spec.window is not None:
    left, right = spec.window
    empty = empty | (kv.pos_max < q.pos_min - left) | (kv.pos_min > q.pos_max + right)
    full = full & (kv.pos_min >= q.pos_max - left) & (kv.pos_max <= q.pos_min + right)
  if spec.chunk_size is not None:
    # Floor division is monotone: a tile's chunks span [chunk(min), chunk(max)].
    qlo, qhi, klo, khi = (chunk_index(a, spec.chunk_size) for a in (q.pos_min, q.pos_max, kv.pos_min, kv.pos_max))
    empty = empty | (klo > qhi) | (khi < qlo)
    full = full & (qlo == qhi) & (klo == khi) & (qlo == klo)
  if spec.has_bidirectional:
    # The span term sees some pair unless the id ranges are disjoint or a side holds only id 0; it sees every
    # pair when both tiles hold one and the same nonzero id.
    none = (q.bid_max < kv.bid_min) | (kv.bid_max < q.bid_min)
    none = none | ((q.bid_min == 0) & (q.bid_max == 0)) | ((kv.bid_min == 0) & (kv.bid_max == 0))
    every = (q.bid_min == q.bid_max) & (kv.bid_min == kv.bid_max) & (q.bid_min == kv.bid_min) & (q.bid_min != 0)
    empty, full = empty & none, full | every
  if spec.has_segments:
    empty = empty | (q.seg_max < kv.seg_min) | (kv.seg_max < q.seg_min)
    full = full & (q.seg_min == q.seg_max) & (kv.seg_min == kv.seg_max) & (q.seg_min == kv.seg_min)
  empty, full = xp.all(empty, axis=0), xp.all(full, axis=0)  # every row
  return xp.where(empty, EMPTY, xp.where(full, FULL, PARTIAL)).astype(xp.int32)


def tile_kinds(spec: MaskSpec, q: Tokens, kv: Tokens, bq: int, bk: int):
  """[T / bq, S / bk] table of EMPTY / PARTIAL / FULL for every tile pair of a block."""
  qe = tile_extent(q, bq).map(lambda a: a[:, :, None])
  ke = tile_extent(kv, bk).map(lambda a: a[:, None, :])
  return classify(spec, qe, ke)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Mask:
  """The whole mask of a call as one object: `mask=fr.Mask(...)` in `ring_attention`, `dot_product_attention`,
  `reference_attention` and the ring layers' call.

  Its fields are the ops' mask keywords, with their meaning (see `ring_attention`): `is_causal`,
  `local_window_size` and `chunk_size` are static; `segment_ids`, `bidirectional_ids`, `q_positions` and
  `kv_positions` are arrays (or None), the leaves of the pytree it is, so a `Mask` passes through `jax.jit`
  whole.  A term given both here and as a keyword must agree.  Every term of the family is a field here:
  a term added later is not added to each signature.
  """

  is_causal: bool = False
  local_window_size: object = None
  chunk_size: int | None = None
  segment_ids: object = None
  bidirectional_ids: object = None
  q_positions: object = None
  kv_positions: object = None

  def __post_init__(self):
    validation.check_bool("Mask.is_causal", self.is_causal)
    object.__setattr__(self, "local_window_size", validation.normalize_window(self.local_window_size))
    object.__setattr__(self, "chunk_size", validation.check_chunk_size(self.chunk_size))


_MASK_STATIC = ("is_causal", "local_window_size", "chunk_size")
jax.tree_util.register_dataclass(
  Mask,
  data_fields=[f.name for f in dataclasses.fields(Mask) if f.name not in _MASK_STATIC],
  meta_fields=list(_MASK_STATIC),
)


def mask_keywords(mask, **given) -> dict:
  """The mask keywords of one call: `given` (keyword arguments, defaults included) joined with the fields of
  `mask` (a `Mask`, or None).  A term set in both must agree (static terms by value, arrays by identity)."""
  if mask is None:
    return given
  if not isinstance(mask, Mask):
    raise TypeError(
      f"mask must be a flax_ringattn.Mask here (the mask's terms as one object), got {type(mask).__name__}; a dense "
      "boolean mask goes to dot_product_attention(mask=...) or a layer's mask="
    )
  out = dict(given)
  for f in dataclasses.fields(Mask):
    mine, theirs = getattr(mask, f.name), given.get(f.name)
    if mine is None or mine is False:
      continue
    if f.name == "local_window_size":
      theirs = validation.normalize_window(theirs)
    if (
      theirs is not None and theirs is not False and not (theirs is mine or (f.name in _MASK_STATIC and theirs == mine))
    ):
      raise ValueError(
        f"{f.name} is given twice, as a keyword ({_short(theirs)}) and in mask= ({_short(mine)}); pass it once"
      )
    out[f.name] = mine
  return out


def _short(x) -> str:
  return f"an array of shape {tuple(x.shape)}" if hasattr(x, "shape") else repr(x)


def build(
  B: int,
  T: int,
  S: int,
  *,
  mask=None,
  is_causal=False,
  local_window_size=None,
  chunk_size=None,
  segment_ids=None,
  bidirectional_ids=None,
  q_positions=None,
  kv_positions=None,
):
  """The mask arguments of one call, validated once: (MaskSpec, q Tokens, kv Tokens).

  Every entry point (the ring op, `dot_product_attention`, the reference) builds its mask here; the two
  `Tokens` then travel with q and with K/V unchanged to the kernels.  Positions left out are None: the
  caller's layout fills them in (0 .. L-1, or the ring's shards).  One side given alone serves both sides of
  self attention (T == S); with T != S the other side is at its index 0 .. L-1.  `mask`: a `Mask` (or None)
  joined with the keywords (`mask_keywords`).
  """
  if mask is not None:
    given = mask_keywords(
      mask,
      is_causal=is_causal,
      local_window_size=local_window_size,
      chunk_size=chunk_size,
      segment_ids=segment_ids,
      bidirectional_ids=bidirectional_ids,
      q_positions=q_positions,
      kv_positions=kv_positions,
    )
    return build(B, T, S, **given)
  validation.check_bool("is_causal", is_causal)
  q_seg, kv_seg = validation.normalize_segment_ids(segment_ids, B, T, S)
  q_bid, kv_bid = validation.normalize_segment_ids(bidirectional_ids, B, T, S, name="bidirectional_ids")
  q_pos = validation.check_positions("q_positions", q_positions, B, T, "T")
  kv_pos = validation.check_positions("kv_positions", kv_positions, B, S, "S")
  if (q_pos is None) != (kv_pos is None):
    # Self attention (T == S): the keys are the queries' tokens.  Otherwise the side not given is at its index in
    # the sequence (e.g. q_positions = the last T of S positions: new tokens after a cache).
    if q_pos is None:
      q_pos = kv_pos if T == S else jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    else:
      kv_pos = q_pos if T == S else jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  spec = MaskSpec(
    is_causal=bool(is_causal),
    window=validation.normalize_window(local_window_size),
    chunk_size=validation.check_chunk_size(chunk_size),
    has_segments=q_seg is not None,
    has_bidirectional=q_bid is not None,
    has_positions=q_pos is not None,
  )
  return spec, Tokens(q_pos, q_seg, q_bid), Tokens(kv_pos, kv_seg, kv_bid)


def with_positions(tokens: Tokens, pos) -> Tokens:
  """`tokens` with the layout's positions `pos` where the caller gave none."""
  return tokens if tokens.pos is not None else dataclasses.replace(tokens, pos=pos)

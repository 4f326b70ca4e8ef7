"""Work-balanced layouts for packed batches: which shard of the ring holds which token.

The zigzag layout balances the causal work of one sequence.  A packed row holds documents of different lengths,
and its causal work sits inside each document (a token sees only the earlier tokens of its own document), so
zigzag over the whole row is not balanced at all: a shard that holds the late part of a long document does far
more than one that holds short documents.

`balanced_layout` balances per *region*: a maximal run of tokens whose visible keys all lie in it (one document,
or one chunk of one document with `chunk_size`).  Each region of length L is cut into 2n pieces, and shard r gets
pieces r and 2n - 1 - r (zigzag inside the region: an early piece and a late piece), so every shard gets about
L / n tokens and 1 / n of the region's causal work.  Token counts must be exactly T / n per shard: each region's
split sizes are rounded with a rotating offset, so that the rounding errors of all regions cancel.  Each shard's
tokens keep their document order, so tiles hold runs of consecutive positions and tile skipping stays effective.

The ring then runs on the reordered tokens with their positions (`layout.order`, the index in the original row):
the mask is evaluated on positions, so the result is the one of the original order, exactly.

Worked example, one row of documents [6, 2] over n = 2 shards (8 tokens, 4 per shard), causal:
  document 0 (positions 0..5) in 4 pieces: [0 1] [2] [3] [4 5]  -> shard 0: [0 1] + [4 5], shard 1: [2] + [3]
  document 1 (positions 6..7) in 4 pieces: [] [6] [7] []        -> shard 1 gets both (the offset rotated)
  order = [0 1 4 5 | 2 3 6 7]
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flax_ringattn._src import masks, validation


@dataclasses.dataclass(frozen=True, eq=False)
class Layout:
  """A token order for a ring of `num_shards`: `order` [B, T] int32 gives, for each slot of the new order, the
  token's index in the original row (pass it as `q_positions`, or reorder your own positions with `apply_layout`).
  `imbalance`: max over shards of the visible (query, key) pairs, divided by the mean (1.0 is perfect), or None
  for a layout built by hand from an order (`Layout(order=..., num_shards=...)`, e.g. to compare orders).
  `tile_imbalance` (with `balanced_layout(tile=...)`): max over shards of the (q tile, kv tile) pairs with a
  visible pair, what the kernels compute, divided by the mean."""

  order: np.ndarray
  num_shards: int
  imbalance: float | None = None
  tile_imbalance: float | None = None  # with `balanced_layout(tile=...)`: the same over the kernels' tiles

  def __post_init__(self):
    order = np.asarray(self.order)
    if order.ndim != 2 or not np.issubdtype(order.dtype, np.integer):
      raise ValueError(f"order must be an integer array [B, T], got shape={order.shape}, dtype={order.dtype}")
    if not (np.sort(order, axis=1) == np.arange(order.shape[1])).all():
      raise ValueError("order must hold a permutation of 0 .. T-1 in every row")
    object.__setattr__(self, "order", order.astype(np.int32))

  @property
  def inverse(self) -> np.ndarray:
    """[B, T] int32: for each token of the original row, its slot in the new order."""
    return np.argsort(self.order, axis=1).astype(np.int32)


def _regions(segment_ids_row, chunk_size):
  """(start, end) of the maximal runs of equal segment id (and equal chunk of the index with chunk_size)."""
  T = len(segment_ids_row)
  cut = np.flatnonzero(np.diff(segment_ids_row) != 0) + 1
  if chunk_size is not None:
    cut = np.union1d(cut, np.arange(chunk_size, T, chunk_size))
  edges = np.concatenate([[0], cut, [T]]).astype(np.int64)
  return list(zip(edges[:-1], edges[1:], strict=True))


def visible_pairs_per_token(segment_ids, *, is_causal=True, local_window_size=None, chunk_size=None):
  """[B, T] int64: how many keys each query of the original order sees (self attention on the index)."""
  seg = np.asarray(segment_ids)
  window = validation.normalize_window(local_window_size)
  B, T = seg.shape
  out = np.zeros((B, T), np.int64)
  i = np.arange(T)
  for b in range(B):
    for start, end in _regions(seg[b], None):
      idx = i[start:end]
      lo = np.full_like(idx, start)
      hi = idx.copy() if is_causal else np.full_like(idx, end - 1)
      if window is not None:
        lo, hi = np.maximum(lo, idx - window[0]), np.minimum(hi, idx + window[1])
      if chunk_size is not None:
        lo = np.maximum(lo, idx // chunk_size * chunk_size)
        hi = np.minimum(hi, (idx // chunk_size + 1) * chunk_size - 1)
      out[b, start:end] = np.maximum(hi - lo + 1, 0)
  return out


def imbalance_of(order, work, num_shards: int) -> float:
  """max / mean over shards of the work (visible pairs) of the tokens each shard holds; `order` [B, T]."""
  held = np.take_along_axis(work, np.asarray(order), axis=1)  # [B, T] in slot order
  per_shard = held.reshape(held.shape[0], num_shards, -1).sum(axis=(0, 2))
  mean = per_shard.mean()
  return float(per_shard.max() / mean) if mean > 0 else 1.0


def layout_imbalance(segment_ids, order, num_shards: int, *, is_causal=True, local_window_size=None, chunk_size=None):
  """The imbalance of any token order on a packed batch: max over shards of the visible (query, key) pairs,
  divided by the mean.  `segment_ids` [B, T] in the original order; `order` [B, T] or [T] (for each slot, the
  token's index in the original row: e.g. `zigzag_positions(T, n)`, or a `Layout`'s order)."""
  seg = np.asarray(segment_ids)
  order = np.broadcast_to(np.asarray(order), seg.shape)
  if seg.shape[1] % num_shards:
    raise ValueError(f"the row length T={seg.shape[1]} must be a multiple of num_shards={num_shards}")
  work = visible_pairs_per_token(seg, is_causal=is_causal, local_window_size=local_window_size, chunk_size=chunk_size)
  return imbalance_of(order, work, num_shards)


def _row_order(seg_row, n: int, chunk_size):
  """One row's order: every region cut into 2n pieces dealt zigzag; exactly T / n tokens per shard."""
  T = len(seg_row)
  shards = [[] for _ in range(n)]
  offset = 0
  for start, end in _regions(seg_row, chunk_size):
    L = end - start
    # Shard sizes of this region: the extra tokens go to the shards that are shortest so far (then by the
    # rotating offset), so every shard ends at exactly T / n.
    counts = np.array([len(s) for s in shards])
    base, extra = divmod(L, n)
    per_shard = np.full(n, base, np.int64)
    if extra:
      rank = np.lexsort(((np.arange(n) - offset) % n, counts))
      per_shard[rank[:extra]] += 1
      offset = (offset + extra) % n
    # Shard r: a head piece (early tokens) and a tail piece (late tokens) of sizes summing to per_shard[r].
    heads = per_shard // 2 + (per_shard % 2) * (np.arange(n) % 2)
    tails = per_shard - heads
    pieces = np.concatenate([heads, tails[::-1]])  # pieces 0 .. 2n-1 along the region
    bounds = start + np.concatenate([[0], np.cumsum(pieces)])
    for r in range(n):
      head = np.arange(bounds[r], bounds[r + 1])
      tail = np.arange(bounds[2 * n - 1 - r], bounds[2 * n - r])
      shards[r] += [*head, *tail]
  order = np.concatenate([np.sort(np.asarray(s, np.int64)) for s in shards]).astype(np.int32)
  assert len(order) == T and all(len(s) == T // n for s in shards), [len(s) for s in shards]
  return order


def balanced_layout(
  segment_ids, num_shards: int, *, is_causal: bool = True, local_window_size=None, chunk_size=None, tile=None
):
  """A work-balanced token order for a packed batch on a ring of `num_shards` devices.

  Args:
    segment_ids: [B, T] int ids of the packed documents (a document is a run of equal ids; padding is a document
      of its own).  Concrete values: a layout is decided in the data pipeline, on the host.
    num_shards: the ring size n; T must be a multiple of n.
    is_causal, local_window_size, chunk_size: the mask the model will run, which decides where the work is.
    tile: None: balance the visible (query, key) pairs token by token.  An int: the kernels' tile (the larger
      of their q and kv tiles; T / n a multiple of it): shards are built of whole blocks of `tile` consecutive
      tokens and balanced on the tiles the kernels compute (the non-empty (q tile, kv tile) pairs), which is
      what a ring step takes.  Use it whenever documents are longer than a few tiles: token-level pieces
      scatter every tile over the documents, so no tile is empty and the kernels compute more in all.

  Returns:
    A `Layout`: `order` [B, T] (for each slot of the new order, the token's index in the original row),
    `imbalance` (max over shards of the visible pairs / the mean) and, with `tile`, `tile_imbalance`.
    Reorder every per-token array with `apply_layout` (tokens, labels, segment ids, positions), pass
    `q_positions=layout.order` (or your reordered positions) to the ring, and `undo_layout` its outputs if you
    need the original order back.
  """
  if isinstance(segment_ids, jax.core.Tracer):
    raise TypeError(
      "balanced_layout needs concrete segment_ids (decide the layout in the data pipeline, not under jit)"
    )
  seg = np.asarray(segment_ids)
  if seg.ndim != 2 or not np.issubdtype(seg.dtype, np.integer):
    raise ValueError(f"segment_ids must be an integer array [B, T], got shape={seg.shape}, dtype={seg.dtype}")
  if not isinstance(num_shards, (int, np.integer)) or isinstance(num_shards, bool) or num_shards < 1:
    raise ValueError(f"num_shards must be a positive int, got {num_shards!r}")
  validation.check_bool("is_causal", is_causal)
  chunk_size = validation.check_chunk_size(chunk_size)
  B, T = seg.shape
  if T % num_shards:
    raise ValueError(f"the row length T={T} must be a multiple of num_shards={num_shards} (equal shards)")
  work = visible_pairs_per_token(seg, is_causal=is_causal, local_window_size=local_window_size, chunk_size=chunk_size)
  n = int(num_shards)
  if tile is not None:
    if not isinstance(tile, (int, np.integer)) or isinstance(tile, bool) or tile < 1 or (T // n) % tile:
      raise ValueError(f"tile must be a positive int dividing the shard length T / num_shards = {T // n}, got {tile!r}")
    spec = masks.MaskSpec(
      is_causal=is_causal,
      window=validation.normalize_window(local_window_size),
      chunk_size=chunk_size,
      has_segments=True,
    )
    weights = [_block_work(spec, seg[b], int(tile)) for b in range(B)]
    blocks = [_deal_blocks(w, n) for w in weights]
    order = np.stack([np.concatenate([_tokens_of(g, int(tile)) for g in groups]) for groups in blocks])
    loads = np.sum([[w[g].sum() for g in groups] for w, groups in zip(weights, blocks, strict=True)], axis=0)
    tiles = float(loads.max() / loads.mean()) if B and loads.mean() > 0 else 1.0
    return Layout(
      order=order.astype(np.int32), num_shards=n, imbalance=imbalance_of(order, work, n), tile_imbalance=tiles
    )
  order = np.stack([_row_order(seg[b], n, chunk_size) for b in range(B)]) if B else seg.astype(np.int32)
  order = _refine(order, work, n)
  return Layout(order=order, num_shards=n, imbalance=imbalance_of(order, work, num_shards))


def _block_work(spec, seg_row, tile: int):
  """[T / tile]: for every block of `tile` consecutive tokens (a q tile), the kv blocks it has a visible pair
  with: the tiles a kernel computes for it.  Blocks keep their tile classes wherever they are dealt, since the
  mask is evaluated on the original positions."""
  tok = masks.Tokens(np.arange(len(seg_row))[None], np.asarray(seg_row)[None])
  return (masks.tile_kinds(spec, tok, tok, tile, tile) != masks.EMPTY).sum(axis=1).astype(np.int64)


def _deal_blocks(work, n: int):
  """Blocks dealt to n shards of equal block counts, heaviest first to the lightest shard with room (LPT), then
  pairwise swaps between the heaviest and the lightest shard while one lowers the heavier: [n] block indices."""
  per = len(work) // n
  groups, load = [[] for _ in range(n)], np.zeros(n, np.int64)
  for b in np.argsort(-work, kind="stable"):
    r = min((r for r in range(n) if len(groups[r]) < per), key=lambda r: (load[r], r))
    groups[r].append(int(b))
    load[r] += work[b]
  for _ in range(len(work)):
    h, lo = int(np.argmax(load)), int(np.argmin(load))
    gap = load[h] - load[lo]
    pairs = [
      (abs(work[a] - work[c] - gap / 2), a, c) for a in groups[h] for c in groups[lo] if 0 < work[a] - work[c] < gap
    ]
    if not pairs:
      break
    _, a, c = min(pairs)
    groups[h][groups[h].index(a)], groups[lo][groups[lo].index(c)] = c, a
    load[h] += work[c] - work[a]
    load[lo] += work[a] - work[c]
  return [np.sort(np.asarray(g, np.int64)) for g in groups]


def _tokens_of(blocks, tile: int):
  """The token indices of `blocks` (sorted), block after block."""
  return (blocks[:, None] * tile + np.arange(tile)[None]).reshape(-1)


def _refine(order, work, n: int, max_swaps: int | None = None):
  """Swaps single tokens between the heaviest and the lightest shard while that lowers the heavier of the two.

  The zigzag split leaves what it cannot balance by counting tokens: a sliding window's or a chunk's ramp (the
  first tokens of a region see fewer keys) lands on the shards that got the region's first pieces.  Each swap
  moves a token of work w_a from the heaviest shard and one of work w_b < w_a from the lightest, the pair whose
  difference is closest to half the gap, so token counts stay exact.  A few swaps per row; every shard's tokens
  are kept in document order afterwards.
  """
  order = order.copy()
  B, T = order.shape
  L = T // n
  held = np.take_along_axis(work, order, axis=1)  # [B, T] in slot order
  totals = held.reshape(B, n, L).sum(axis=(0, 2)).astype(np.int64)
  for _ in range(max_swaps if max_swaps is not None else 4 * L):
    h, lo = int(np.argmax(totals)), int(np.argmin(totals))
    gap = totals[h] - totals[lo]
    best = None
    for b in range(B):
      wh, wl = held[b, h * L : (h + 1) * L], held[b, lo * L : (lo + 1) * L]
      sorted_l = np.argsort(wl, kind="stable")
      # For every token a of the heavy shard, the light shard's token b with w_b closest to w_a - gap / 2.
      at = np.clip(np.searchsorted(wl[sorted_l], wh - gap / 2), 0, L - 1)
      for cand in (at, np.maximum(at - 1, 0)):
        j = sorted_l[cand]
        delta = wh - wl[j]  # work moved from h to lo
        ok = (delta > 0) & (delta < gap)
        if ok.any():
          score = np.where(ok, np.abs(delta - gap / 2), np.inf)
          i = int(np.argmin(score))
          if best is None or score[i] < best[0]:
            best = (score[i], b, h * L + i, lo * L + int(j[i]), int(delta[i]))
    if best is None:
      break
    _, b, si, sj, delta = best
    order[b, si], order[b, sj] = order[b, sj], order[b, si]
    held[b, si], held[b, sj] = held[b, sj], held[b, si]
    totals[h] -= delta
    totals[lo] += delta
  # Document order inside every shard again (the swapped tokens join their new neighbours).
  shards = order.reshape(B, n, L)
  return np.sort(shards, axis=2).reshape(B, T).astype(np.int32)


def _check_layout(x, layout: Layout, axis: int):
  if not isinstance(layout, Layout):
    raise TypeError(f"layout must be a flax_ringattn.Layout (from balanced_layout), got {type(layout).__name__}")
  shape = tuple(np.shape(x))
  axis = axis % len(shape) if shape else axis
  if len(shape) < 2 or axis == 0 or shape[0] != layout.order.shape[0] or shape[axis] != layout.order.shape[1]:
    raise ValueError(
      f"x must be [B, ..., T, ...] with B={layout.order.shape[0]} first and T={layout.order.shape[1]} on "
      f"axis={axis}, got x.shape={shape}"
    )
  return axis


def _gather(x, index, axis: int):
  """x with x[b, ..., index[b, i], ...] at slot i along `axis`, per batch row b."""
  idx = index.reshape(index.shape[:1] + (1,) * (axis - 1) + index.shape[1:] + (1,) * (np.ndim(x) - axis - 1))
  if isinstance(x, np.ndarray):
    return np.take_along_axis(x, idx, axis=axis)
  return jnp.take_along_axis(jnp.asarray(x), jnp.asarray(idx), axis=axis)


def apply_layout(x, layout: Layout, axis: int = 1):
  """`x` ([B, ..., T, ...], the sequence on `axis`) in the layout's order; numpy in, numpy out."""
  axis = _check_layout(x, layout, axis)
  return _gather(x, layout.order, axis)


def undo_layout(x, layout: Layout, axis: int = 1):
  """The inverse of `apply_layout`: back to the original order."""
  axis = _check_layout(x, layout, axis)
  return _gather(x, layout.inverse, axis)

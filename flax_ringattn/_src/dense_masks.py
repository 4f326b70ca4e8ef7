"""Dense masks as models build them, and back: the structure (causal, segment ids, bidirectional spans) a dense
mask encodes, recovered and verified with the rule of `masks`, and the mask rebuilt from a structure."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from flax_ringattn._src import validation
from flax_ringattn._src.masks import MaskSpec, pair_visible

# Dense masks as models build them ------------------------------------------------
#
# flax models (the lm1b example and most code written like it) hand attention a
# dense [B, 1, T, T] mask: nnx.combine_masks(make_attention_mask(valid, valid),
# make_causal_mask(tokens), make_attention_mask(segments, segments, jnp.equal)).
# That family is exactly "causal (or not) + segment ids + padding", and padding
# is a segment of its own with one twist: a padding query sees nothing (its row
# is all zero) and a padding key is seen by nobody.  A (q_ids, kv_ids) pair
# expresses that exactly: valid tokens carry their segment's id on both sides,
# padding gets PAD_Q_ID as a query and PAD_KV_ID as a key, which never match.
#
# Hand-written decoders (Gemma, Llama, Qwen styles) mask keys only: a padding
# query still sees the valid keys before it, and a sliding window is ANDed in.
# A (q_ids, kv_ids) pair expresses that too: the padding query carries the id of
# the keys it sees.  So the family recovered is exactly
#   [causal] & [window] & (q_ids[i] == kv_ids[j]),
# with the window given by the caller (it is static for the ring), and the
# recovery from the dense mask m (self attention, T == S), per batch row, is:
#   first[i]   = first key row i sees            (its segment's start, or the
#                                                 window's left edge in it)
#   label0[j]  = first[j] when row j sees key j (<= j; a segment's keys chain
#                                                 down to its first key)
#   label      = label0 iterated to its fixed point by pointer jumping
#                (ceil(log2 S) + 1 gathers: window chains are long)
#   kv_ids[j]  = label[j], or PAD_KV_ID for a key its own row does not see
#   q_ids[i]   = label[first[i]], or PAD_Q_ID for a row that sees nothing
#   causal     = no m[i, j] with j > i
# and the recovery is verified by rebuilding the mask from (causal, window,
# q_ids, kv_ids) with `pair_visible` and comparing it with m elementwise.
#
# When that fails, a causal mask may still hold bidirectional spans: Gemma 3's
# `causal | same image` and prefix-LM masks.  Under causal only a span shows a
# row a later key, so a contiguous span [a, b] is where rows see up to b:
#   last[i]    = last key row i sees
#   bid[i]     = last[i] + 1 when last[i] > i, or when row i - 1 sees up to i
#                exactly (i is a span's last token), else 0
# verified the same way with the span term.  A span may come in pieces, but
# its last token must follow one of its own (only rows are read).  Any mask
# outside both (a window that was not declared, per-head masks, ...) fails the
# comparison.
#
# A chunked mask (Llama 4) needs no term of its own here: read on the index,
# each document's chunks are blocks, so they come back as segment ids, exactly.

PAD_Q_ID = -1  # segment id of a padding query
PAD_KV_ID = -2  # segment id of a padding key: no query ever matches it


_NO_SEGMENTS = object()


def padded_segment_ids(valid, segment_ids=_NO_SEGMENTS, *, mask_queries: bool = True):
  """(q_ids, kv_ids) [B, T] int32 for packed, padded self attention, without any [T, T] mask.

  Pass the result as `segment_ids=` together with `is_causal=True` instead of
  building `combine_masks(make_attention_mask(valid, valid), make_causal_mask(x),
  make_attention_mask(segment_ids, segment_ids, jnp.equal))`: the two describe the
  same mask.

  Args:
    valid: [B, T] bool (or 0/1): True for real tokens, False for padding.
    segment_ids: [B, T] int ids of packed documents, or None for one document
      per row.  Required: forgetting the documents of a packed batch would let
      them see each other with no error, so None must be said explicitly.
    mask_queries: True (flax's `make_attention_mask(valid, valid)`): a padding
      query sees nothing and a padding key is seen by nobody.  False (the
      key-only masks of hand-written decoders such as Gemma's or Llama's): a
      padding query still sees the valid keys of its own document.
  """
  if segment_ids is _NO_SEGMENTS:
    raise TypeError(
      "padded_segment_ids(valid, segment_ids): pass the packed documents' ids, or segment_ids=None when every row "
      "is one document (a packed batch without its ids would let documents see each other, with no error)"
    )
  valid = jnp.asarray(valid) != 0
  if segment_ids is None:
    seg = jnp.zeros(valid.shape, jnp.int32)
  else:
    seg = jnp.asarray(segment_ids).astype(jnp.int32)
    if seg.shape != valid.shape:
      raise ValueError(f"segment_ids must have the shape of valid {tuple(valid.shape)}, got {tuple(seg.shape)}")
  # Padding ids below every real id, so a user id can never collide with them.
  low = jnp.minimum(jnp.min(jnp.where(valid, seg, 0)), 0)
  q_ids = jnp.where(valid, seg, low + PAD_Q_ID) if mask_queries else seg
  return q_ids, jnp.where(valid, seg, low + PAD_KV_ID)


def dense_mask_4d(mask, B: int, N: int, T: int, S: int):
  """`mask` as a [B | 1, N | 1, T, S] array, broadcast the way nnx.MultiHeadAttention broadcasts it to
  [B, N, T, S]: missing leading axes are added (a [T, S] mask is [1, 1, T, S], a 3-D one [1, N | 1, T, S]) and
  size-1 query or key axes are broadcast (a [B, 1, 1, S] key-padding mask).  Any dtype: nonzero is visible."""
  shape = tuple(getattr(mask, "shape", ()))
  target = (B, N, T, S)
  full = (1,) * (4 - len(shape)) + shape
  if not 2 <= len(shape) <= 4 or any(d not in (1, t) for d, t in zip(full, target, strict=True)):
    raise ValueError(
      f"mask must broadcast to [B, N, T, S] = {list(target)} as nnx.MultiHeadAttention's does ([T, S], "
      f"[N | 1, T, S] or [B | 1, N | 1, T | 1, S | 1], e.g. nnx.make_attention_mask's [B, 1, T, S]), got mask.shape="
      f"{shape}"
    )
  mask = jnp.reshape(jnp.asarray(mask), full)
  if full[2:] != (T, S):
    mask = jnp.broadcast_to(mask, (*full[:2], T, S))
  return mask


class DenseStructure(NamedTuple):
  """What `structure_from_dense_mask` recovers: the arguments of `ring_attention` that describe the mask.

  `is_causal` bool scalar; `q_ids`, `kv_ids` [B, T] int32 segment ids of the queries and keys (padding: see
  `padded_segment_ids`); `bidirectional_ids` [B, T] int32 span ids (0: no span), or None when spans were not
  looked for; `exact` bool scalar: the structure rebuilds the mask in every entry (every head included).
  """

  is_causal: jax.Array  # bool scalar
  q_ids: jax.Array  # [B, T] int32 segment ids of the queries (see `padded_segment_ids`)
  kv_ids: jax.Array  # [B, T] int32 segment ids of the keys
  exact: jax.Array  # bool scalar: the structure rebuilds the mask in every entry (every head included)
  bidirectional_ids: jax.Array | None  # [B, T] int32 (0: no span), or None when spans were not looked for


def structure_from_dense_mask(
  mask, *, local_window_size=None, spans: bool = True, fused: bool = False
) -> DenseStructure:
  """The structure (causal, segment ids, bidirectional spans) of a dense self-attention mask, verified.

  Args:
    mask: [B, N | 1, T, T] or [B, T, T], nonzero = visible.
    local_window_size: None, w or (left, right): a sliding window the mask is
      known to include (jax.nn's meaning); it is part of the rebuilt mask.
    spans: also look for bidirectional spans (a causal mask OR-ed with blocks
      of tokens that see each other: Gemma 3's image tokens, a prefix-LM
      prefix) when causal + segments do not rebuild the mask.
    fused: read a traced mask by fused reductions only (no gather from it, no
      reversed copy) and look for spans unconditionally (no `lax.cond`, whose
      operand XLA writes to memory): every pass then fuses with the mask's
      own construction, so a mask a model builds from iota is never written
      whole.  What a TPU compiles well (`ring.dense.fused_recovery`); the
      CPU's compiler holds [T, S] temporaries for these passes instead.  The
      same structure either way.

  Returns:
    A `DenseStructure`: `is_causal`, `q_ids`, `kv_ids` (padding: see
    `padded_segment_ids`; a padding query that sees keys carries their id),
    `bidirectional_ids` (each span's tokens carry one nonzero id; zeros when
    causal + segments already rebuild the mask) and `exact`: True iff the
    mask rebuilt from the structure equals `mask` in every entry.  Costs a few
    elementwise passes and reductions over the mask (no matmul).
  """
  window = validation.normalize_window(local_window_size)
  m = _replicated(jnp.asarray(mask))
  if m.dtype != jnp.bool_:
    m = m != 0  # a [B, T, S] bool copy; a bool mask is read in place by every reduction below
  if m.ndim == 3:
    m = m[:, None]
  B, _, T, S = m.shape
  bid = jnp.zeros((B, T), jnp.int32) if spans else None
  if 0 in m.shape:
    # No entry to recover from: every query sees nothing, which the padding ids say exactly.
    q_ids, kv_ids = jnp.full((B, T), PAD_Q_ID, jnp.int32), jnp.full((B, S), PAD_KV_ID, jnp.int32)
    return DenseStructure(jnp.asarray(True), q_ids, kv_ids, jnp.asarray(True), bid)
  m0 = m[:, 0]  # [B, T, S]
  sees = jnp.any(m0, axis=-1)  # [B, T]
  first = jnp.argmax(m0, axis=-1).astype(jnp.int32)
  # A key of the family is seen exactly when its own row sees it (a valid token sees itself; a padding key
  # is seen by nobody), and then label0[j] = first[j].  So only row-wise reductions run: they fuse with the
  # mask and stay on the device's rows when T is sharded (a column-wise one would not, and would hold a
  # [B, T / n, S] int32 temporary).  For any other mask a wrong label only makes the verification fail.
  if T != S:
    seen = jnp.any(m0, axis=1)  # [B, S]
  elif fused:  # the diagonal by a row-wise reduction (a gather from the mask writes it whole)
    seen = jnp.any(m0 & _eye(T), axis=-1)
  else:
    seen = jnp.diagonal(m0, axis1=1, axis2=2)
  label = first if T == S else jnp.take_along_axis(first, jnp.argmax(m0, axis=1).astype(jnp.int32), axis=1)
  label = jnp.where(seen, label, jnp.arange(S, dtype=jnp.int32)[None])
  for _ in range(max(1, int(np.ceil(np.log2(max(S, 2))))) + 1):
    label = jnp.take_along_axis(label, label, axis=1)
  kv_ids = jnp.where(seen, label, PAD_KV_ID)
  q_ids = jnp.where(sees, jnp.take_along_axis(label, first, axis=1), PAD_Q_ID)
  is_causal = ~_any_pair(m, lambda mv, i, j, qid, kid, qb, kb: mv & (j > i), q_ids, kv_ids, fused=fused)
  rule = _structure_rule(is_causal, window)
  exact = ~_any_pair(m, lambda mv, i, j, qid, kid, qb, kb: mv != rule(i, j, qid, kid), q_ids, kv_ids, fused=fused)
  if spans and T == S:
    rule = _structure_rule(True, window, spans=True)

    def with_spans():
      candidate = _span_ids(m0, sees, fused=fused)
      ok = ~_any_pair(
        m, lambda mv, i, j, qid, kid, qb, kb: mv != rule(i, j, qid, kid, qb, kb), q_ids, kv_ids, candidate,
        fused=fused,
      )  # fmt: skip
      return jnp.where(ok, candidate, 0), ok

    # Only when causal + segments do not already rebuild the mask (the common case pays no further pass).
    if validation.all_concrete(exact):
      bid, found = (bid, jnp.asarray(False)) if bool(exact) else with_spans()
    elif fused:  # always, selected after
      candidate, ok = with_spans()
      found = ~exact & ok
      bid = jnp.where(found, candidate, 0)
    else:
      bid, found = jax.lax.cond(exact, lambda: (jnp.zeros_like(first), jnp.asarray(False)), with_spans)
    is_causal, exact = is_causal | found, exact | found
  return DenseStructure(is_causal, q_ids, kv_ids, exact, bid)


def _eye(T: int):
  """[T, T] bool identity from iota (it fuses with its reader)."""
  i = jnp.arange(T, dtype=jnp.int32)
  return i[:, None] == i[None, :]


def _replicated(x):
  """x, gathered whole onto every device when its type is sharded over Explicit mesh axes: the recovery's
  gathers (labels, winners) cannot be resolved on a sharded query or key axis.  The mask is O(T * S) already."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or all(a is None for a in spec):
    return x
  return jax.reshard(x, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec()))


def _span_ids(m0, sees, *, fused: bool = False):
  """Candidate bidirectional ids of a causal mask with spans, [B, T] from m0 [B, T, T]: under causal only a
  span lets a row see a later key, so every token of a contiguous span but its last sees up to the span's
  last token b, and the last one is where its predecessor's view ends.  Each span's tokens get b + 1, the
  others 0.  (A row-wise argmax from the right; a wrong guess only fails the verification.)"""
  T = m0.shape[-1]
  idx = jnp.arange(T, dtype=jnp.int32)[None]
  if fused:  # the last key each row sees by a max (a reversed argmax writes a reversed copy); none: T - 1
    last = jnp.where(sees, jnp.max(jnp.where(m0, idx, -1), axis=-1), T - 1)
  else:
    last = (T - 1 - jnp.argmax(m0[..., ::-1], axis=-1)).astype(jnp.int32)
  ahead = sees & (last > idx)
  before = jnp.pad(jnp.where(ahead, last, -1)[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
  return jnp.where(ahead | (before == idx), last + 1, 0)


def _any_pair(m, pred, q_ids, kv_ids, bid=None, *, fused: bool = False):
  """any(pred) over every (batch, head, query i, key j) of m [B, N, T, S], with an argmax over j (which XLA
  fuses with the elementwise predicate) and the predicate recomputed at the [B, N, T] winners only.

  pred(mv, i, j, q_id, kv_id, q_bid, kv_bid) is elementwise over broadcastable mask values, positions, segment
  ids and bidirectional ids (`bid`: [B, T] of self attention, or None).
  """
  B, N, T, S = m.shape
  i = jnp.arange(T, dtype=jnp.int32)[:, None]
  j = jnp.arange(S, dtype=jnp.int32)[None, :]
  qb = None if bid is None else bid[:, None, :, None]
  kb = None if bid is None else bid[:, None, None, :]
  full = pred(m, i, j, q_ids[:, None, :, None], kv_ids[:, None, None, :], qb, kb)
  idx = jnp.argmax(full, axis=-1).astype(jnp.int32)  # [B, N, T]
  if fused:  # m at the winners by a fused reduction, not a gather
    mv = jnp.any(m & (j == idx[..., None]), axis=-1)
  else:
    mv = jnp.take_along_axis(m, idx[..., None], axis=-1)[..., 0]
  at = lambda ids: jnp.take_along_axis(jnp.broadcast_to(ids[:, None, :], (B, N, S)), idx, axis=-1)  # noqa: E731
  qb = None if bid is None else bid[:, None, :]
  return jnp.any(pred(mv, i[:, 0], idx, q_ids[:, None, :], at(kv_ids), qb, None if bid is None else at(bid)))


def dense_mask_from_structure(is_causal, q_ids, kv_ids, *, local_window_size=None, bidirectional_ids=None):
  """[B, 1, T, S] bool mask of (causal, window, segment ids, bidirectional spans): the inverse of
  `structure_from_dense_mask`.

  `local_window_size` is None, w or (left, right), as in `ring_attention`; `bidirectional_ids` [B, T] (self
  attention) or None.
  """
  window = validation.normalize_window(local_window_size)
  T, S = q_ids.shape[1], kv_ids.shape[1]
  pos_q = jnp.arange(T, dtype=jnp.int32)[None, :, None]
  pos_kv = jnp.arange(S, dtype=jnp.int32)[None, None, :]
  spans = bidirectional_ids is not None
  rule = _structure_rule(is_causal, window, spans=spans)
  bids = (bidirectional_ids[:, :, None], bidirectional_ids[:, None, :]) if spans else ()
  return rule(pos_q, pos_kv, q_ids[:, :, None], kv_ids[:, None, :], *bids)[:, None]


def _structure_rule(is_causal, window, *, spans: bool = False):
  """visible(i, j, q_id, kv_id[, q_bid, kv_bid]), elementwise over broadcastable arrays:
  ([causal] & [window] | same nonzero span) & (q_id == kv_id).

  The one rule `dense_mask_from_structure` builds and `structure_from_dense_mask` verifies against;
  `is_causal` may be traced.
  """
  if not spans:
    spec = MaskSpec(window=window, has_segments=True)
    causal = jnp.asarray(is_causal)
    return lambda i, j, qid, kid: pair_visible(spec, i, j, qid, kid) & ((j <= i) | ~causal)

  def rule(i, j, qid, kid, qb, kb):
    # The span term overrides causal, so causal goes into the spec (static): both, picked per entry, if traced.
    on = lambda c: pair_visible(  # noqa: E731
      MaskSpec(is_causal=c, window=window, has_segments=True, has_bidirectional=True), i, j, qid, kid, qb, kb
    )
    return on(is_causal) if isinstance(is_causal, bool) else jnp.where(is_causal, on(True), on(False))

  return rule

"""`PagedKVCache`: page-major K/V pages, page table, allocator, prefix sharing.

A functional pytree (usable under jit and as `nnx.Cache` state): every method
returns a new cache.  Slots are sequence indices 0 .. max_num_seqs - 1; the
ragged batch of a step lists the new tokens of slot i at rows
cu_q_lens[i] .. cu_q_lens[i + 1] - 1 (see `_src/paged/metadata.py`).

Invariants:
* slot s owns page_indices[s, :ceil(kv_lens[s] / page_size)]; the rest of its
  row is -1;
* ref_counts[p] is the number of slots referencing page p (0 = free);
* a free page holds zeros: `free` zeroes a page when its last reference goes,
  so a new owner can never read a previous request's keys and values;
* a write into a page shared by several slots first copies it (copy-on-write);
* a write is all or nothing per slot: a slot whose new tokens do not fit (past
  `pages_per_seq * page_size` tokens, or more pages than are free) stores none
  of them and is marked in `overflowed` until `free` (see `reserve`).  Called
  on concrete arrays, the write raises `CacheOverflowError` instead.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import checkify

from flax_ringattn._src.paged import common, metadata
from flax_ringattn._src.validation import all_concrete, check_bool


class CacheOverflowError(ValueError):
  """A write to a `PagedKVCache` slot does not fit: past its pages, or more pages than are free."""


@dataclasses.dataclass(frozen=True)
class _Admission:
  """Per slot [S], for a write of `new_lens` tokens: whether it fits, and why not."""

  new_lens: jax.Array
  wants: jax.Array  # new_lens > 0
  within: jax.Array  # kv_lens + new_lens <= pages_per_seq * page_size
  extra: jax.Array  # pages it needs beyond those it holds (copy-on-write included)
  free_before: jax.Array  # free pages left after the slots before it were served
  accepted: jax.Array  # served (wants, within, not overflowed, enough pages)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  k_pages: jax.Array  # [P, page_size, K, H]
  v_pages: jax.Array  # [P, page_size, K, Hv] (Hv == H unless v's head dim differs, as in MLA)
  page_indices: jax.Array  # [S, pages_per_seq] int32, -1 = no page
  kv_lens: jax.Array  # [S] int32 tokens stored per slot
  ref_counts: jax.Array  # [P] int32
  k_scale: jax.Array | None = None  # [P, page_size, K] for quantized pages
  v_scale: jax.Array | None = None
  # [S] bool: a write to the slot did not fit; the slot stores nothing more until `free` (None: all False).
  overflowed: jax.Array | None = None

  @classmethod
  def create(
    cls,
    *,
    num_pages: int,
    page_size: int,
    max_num_seqs: int,
    pages_per_seq: int,
    num_kv_heads: int,
    head_dim: int,
    v_head_dim: int | None = None,
    dtype=jnp.float32,
  ) -> PagedKVCache:
    """An empty cache; int8 / float8 dtypes store per-token, per-head scales.

    k pages hold `head_dim` H per kv head, v pages `v_head_dim` Hv (None: H; MLA stores e.g. H = 192, Hv = 128).
    """
    v_head_dim = head_dim if v_head_dim is None else v_head_dim
    for name, value in (
      ("num_pages", num_pages),
      ("page_size", page_size),
      ("max_num_seqs", max_num_seqs),
      ("pages_per_seq", pages_per_seq),
      ("num_kv_heads", num_kv_heads),
      ("head_dim", head_dim),
      ("v_head_dim", v_head_dim),
    ):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"PagedKVCache.create: {name} must be a positive int, got {name}={value!r}")
    quantized = jnp.dtype(dtype).name in common.QUANTIZED_MAX
    scale = jnp.zeros((num_pages, page_size, num_kv_heads), jnp.float32) if quantized else None
    return cls(
      k_pages=jnp.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype),
      v_pages=jnp.zeros((num_pages, page_size, num_kv_heads, v_head_dim), dtype),
      page_indices=jnp.full((max_num_seqs, pages_per_seq), -1, jnp.int32),
      kv_lens=jnp.zeros((max_num_seqs,), jnp.int32),
      ref_counts=jnp.zeros((num_pages,), jnp.int32),
      k_scale=scale,
      v_scale=scale,
      overflowed=jnp.zeros((max_num_seqs,), bool),
    )

  # -- shapes -----------------------------------------------------------------
  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[0]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[1]

  @property
  def max_num_seqs(self) -> int:
    return self.page_indices.shape[0]

  @property
  def pages_per_seq(self) -> int:
    return self.page_indices.shape[1]

  @property
  def num_kv_heads(self) -> int:
    return self.k_pages.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[3]

  @property
  def v_head_dim(self) -> int:
    return self.v_pages.shape[3]

  def _check_new(self, k, v, where: str):
    """The new tokens' k [T, K, H] and v [T, K, Hv] must match the pages: the scatter would broadcast a size-1
    head dim silently, and fail deep inside for other mismatches."""
    want = {"k": (self.num_kv_heads, self.head_dim), "v": (self.num_kv_heads, self.v_head_dim)}
    for name, x in (("k", k), ("v", v)):
      shape = tuple(getattr(x, "shape", ()))
      if len(shape) != 3 or shape[1:] != want[name]:
        letters = "[T, K, H]" if name == "k" else "[T, K, Hv]"
        raise ValueError(
          f"PagedKVCache.{where}: {name} must be {letters} = [T, {want[name][0]}, {want[name][1]}] as the cache "
          f"stores it (num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, v_head_dim={self.v_head_dim}), "
          f"got {name}.shape={shape}"
        )
    if k.shape[0] != v.shape[0]:
      raise ValueError(f"PagedKVCache.{where}: k and v must have the same T, got k.shape={k.shape}, v.shape={v.shape}")

  # -- queries ----------------------------------------------------------------
  def num_free_pages(self):
    return jnp.sum(self.ref_counts == 0)

  def _overflowed(self):
    return jnp.zeros((self.max_num_seqs,), bool) if self.overflowed is None else self.overflowed

  def pages_needed(self, new_lens):
    """Pages the slots need beyond what they hold to store `new_lens` [S] more tokens (copy-on-write included)."""
    return jnp.sum(self._admission(new_lens).extra)

  def fits(self, new_lens):
    """[S] bool: the slots whose `new_lens` [S] more tokens `reserve` would store (served in slot order).

    A slot with no new tokens fits; a slot past its capacity, or already `overflowed`, fits no new token.
    Check this before a step to refuse work the cache cannot hold.
    """
    a = self._admission(new_lens)
    return a.accepted | ~a.wants

  def utilization(self):
    """Token slots holding data / token slots of allocated pages (shared pages counted once)."""
    ps = self.page_size
    j = jnp.arange(self.pages_per_seq)
    filled = jnp.clip(self.kv_lens[:, None] - j[None] * ps, 0, ps)
    ids = jnp.where(self.page_indices >= 0, self.page_indices, self.num_pages)
    per_page = jnp.zeros((self.num_pages,), jnp.int32).at[ids].max(filled, mode="drop")
    allocated = jnp.sum(self.ref_counts > 0) * ps
    return jnp.where(allocated > 0, jnp.sum(per_page) / jnp.maximum(allocated, 1), 1.0)

  def attention_view(self):
    """(kv_lens, page_indices) as attention reads them: `overflowed` slots have length 0 and no pages, so their
    rows see nothing (they return 0) and a fused cache write stores nothing for them."""
    over = self._overflowed()
    return jnp.where(over, 0, self.kv_lens), jnp.where(over[:, None], -1, self.page_indices)

  # -- allocation ---------------------------------------------------------------
  def _copy_on_write_mask(self, new_lens):
    ps = self.page_size
    j0 = self.kv_lens // ps
    partial = (self.kv_lens % ps != 0) & (new_lens > 0)
    page = jnp.take_along_axis(self.page_indices, jnp.clip(j0, 0, self.pages_per_seq - 1)[:, None], 1)[:, 0]
    shared = self.ref_counts[jnp.clip(page, 0, self.num_pages - 1)] > 1
    return (partial & (page >= 0) & shared).astype(jnp.int32)

  def _admission(self, new_lens) -> _Admission:
    """Which slots' writes of `new_lens` [S] tokens fit, served greedily in slot order (all or nothing each)."""
    ps, pps = self.page_size, self.pages_per_seq
    new_lens = jnp.asarray(new_lens, jnp.int32)
    wants = new_lens > 0
    within = self.kv_lens + new_lens <= pps * ps
    have = -(-self.kv_lens // ps)
    extra = jnp.maximum(-(-(self.kv_lens + new_lens) // ps) - have, 0) + self._copy_on_write_mask(new_lens)
    free = self.num_free_pages().astype(jnp.int32)
    candidate = wants & within & ~self._overflowed()

    def serve(used, x):
      pages, ok = x
      take = ok & (used + pages <= free)
      return used + jnp.where(take, pages, 0), (take, free - used)

    _, (accepted, free_before) = jax.lax.scan(serve, jnp.int32(0), (extra, candidate))
    return _Admission(new_lens, wants, within, extra, free_before, accepted)

  def _overflow_problems(self, a: _Admission):
    """[(slots [S] bool, message, values(slot) -> dict)] of the writes `_admission` refused, one per reason; the
    same message serves the eager error and the `checkify` check."""
    refused = a.wants & ~a.accepted
    was = self._overflowed()
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    pps, ps = self.pages_per_seq, self.page_size
    return [
      (
        refused & ~a.within & ~was,
        "PagedKVCache: slot {s} cannot take {n} more tokens: it holds {kv} and a slot holds at most "
        "pages_per_seq * page_size = {pps} * {ps} = {cap} tokens (create the cache with more pages_per_seq, or "
        "split the request)",
        lambda s: dict(s=s, n=a.new_lens[s], kv=self.kv_lens[s], pps=i32(pps), ps=i32(ps), cap=i32(pps * ps)),
      ),
      (
        refused & a.within & ~was,
        "PagedKVCache: slot {s} needs {need} more pages for {n} new tokens (it holds {kv}), but only {free} of "
        "num_pages={P} are free after the slots before it (free finished slots, or refuse the work: check "
        "fits(new_lens) before the step)",
        lambda s: dict(
          s=s, need=a.extra[s], n=a.new_lens[s], kv=self.kv_lens[s], free=a.free_before[s], P=i32(self.num_pages)
        ),
      ),
      (
        refused & was,
        "PagedKVCache: slot {s} overflowed in an earlier step and stores nothing more ({n} new tokens refused): "
        "free it (free(slots)) and re-admit its request",
        lambda s: dict(s=s, n=a.new_lens[s]),
      ),
    ]

  def _check_admission(self, a: _Admission, checked: bool):
    """Raises `CacheOverflowError` for a refused write on concrete arrays; adds checkify checks when `checked`."""
    concrete = all_concrete(a.accepted, self.kv_lens, a.new_lens)
    if not concrete and not checked:
      return
    for slots, message, values in self._overflow_problems(a):
      s = jnp.argmax(slots).astype(jnp.int32)
      if concrete:
        if bool(jnp.any(slots)):
          raise CacheOverflowError(message.format(**{k: int(v) for k, v in values(s).items()}))
      else:
        checkify.check(~jnp.any(slots), message, **values(s))

  def reserve(self, new_lens, *, checked: bool = False) -> PagedKVCache:
    """Gives every slot the pages it needs for `new_lens` [S] more tokens.

    Pages come from the free list in slot order.  A shared page about to be
    written is first copied.  A slot whose tokens do not fit (more than
    `pages_per_seq * page_size` in all, or more pages than are free after the
    slots before it) gets nothing: its write is refused whole, never cut short.
    On concrete arrays that raises `CacheOverflowError` (naming the slot, the
    tokens and the capacity).  Under `jit` the slot is marked in
    `overflowed` (it then stores nothing more until `free`): check that flag
    after a step, or `fits(new_lens)` before it, or pass `checked=True` and
    run under `jax.experimental.checkify.checkify` to raise instead.
    """
    a = self._admission(new_lens)
    self._check_admission(a, check_bool("checked", checked))
    refused = a.wants & ~a.accepted
    new_lens = jnp.where(a.accepted, a.new_lens, 0)
    cache = dataclasses.replace(self, overflowed=self._overflowed() | refused)
    return cache._grow(new_lens)

  def _grow(self, new_lens) -> PagedKVCache:
    """The page moves of `reserve` for `new_lens` [S] that fit (all of them, by `_admission`)."""
    ps, P, S, pps = self.page_size, self.num_pages, self.max_num_seqs, self.pages_per_seq
    have = -(-self.kv_lens // ps)
    need = jnp.minimum(-(-(self.kv_lens + new_lens) // ps), pps)
    cow = self._copy_on_write_mask(new_lens)
    extra = jnp.maximum(need - have, 0) + cow
    offset = jnp.cumsum(extra) - extra
    free_ids = jnp.nonzero(self.ref_counts == 0, size=P, fill_value=P)[0].astype(jnp.int32)
    take = lambda rank: jnp.where(rank < P, free_ids[jnp.clip(rank, 0, P - 1)], P)

    # Copy-on-write of the partially filled, shared page of each slot.
    j0 = jnp.clip(self.kv_lens // ps, 0, pps - 1)
    old = jnp.take_along_axis(self.page_indices, j0[:, None], 1)[:, 0]
    fresh = jnp.where(cow > 0, take(offset), P)
    ok_copy = fresh < P
    k_pages = self.k_pages.at[fresh].set(self.k_pages[jnp.clip(old, 0, P - 1)], mode="drop")
    v_pages = self.v_pages.at[fresh].set(self.v_pages[jnp.clip(old, 0, P - 1)], mode="drop")
    k_scale, v_scale = self.k_scale, self.v_scale
    if k_scale is not None:
      k_scale = k_scale.at[fresh].set(k_scale[jnp.clip(old, 0, P - 1)], mode="drop")
      v_scale = v_scale.at[fresh].set(v_scale[jnp.clip(old, 0, P - 1)], mode="drop")
    # Admission leaves every served slot its pages, so a copy always finds one; were it not to, the slot
    # must still not write into the shared page: it lets go of it.
    lost = (cow > 0) & ~ok_copy
    refs = self.ref_counts.at[jnp.where(cow > 0, old, P)].add(-1, mode="drop")
    # Two slots sharing a page may both copy it in the same step; the original
    # then loses its last reference and, like any released page, is zeroed.
    released = (refs <= 0) & (self.ref_counts > 0)
    k_pages, v_pages, k_scale, v_scale = (_zero_pages(x, released) for x in (k_pages, v_pages, k_scale, v_scale))
    table = self.page_indices.at[jnp.arange(S), j0].set(jnp.where(ok_copy, fresh, jnp.where(lost, -1, old)))

    # New pages for the tokens beyond what each slot holds.
    j = jnp.arange(pps)[None]
    grow = (j >= have[:, None]) & (j < need[:, None])
    ids = jnp.where(grow, take(offset[:, None] + cow[:, None] + j - have[:, None]), P)
    table = jnp.where(grow, jnp.where(ids < P, ids, -1), table)
    refs = refs.at[jnp.where(ok_copy, fresh, P)].set(1, mode="drop")
    refs = refs.at[ids.reshape(-1)].set(1, mode="drop")
    return dataclasses.replace(
      self, k_pages=k_pages, v_pages=v_pages, page_indices=table, ref_counts=refs, k_scale=k_scale, v_scale=v_scale
    )

  def _stored_lens(self, q_lens):
    """[S] new tokens each slot stores this step: its q_lens, or 0 where its write was refused (`overflowed`)."""
    return jnp.where(self._overflowed(), 0, q_lens)

  def append(self, k, v, cu_q_lens, num_seqs, *, checked: bool = False) -> PagedKVCache:
    """Reserves pages and writes the new k [T, K, H] and v [T, K, Hv] of a ragged batch; kv_lens grows (see
    `reserve` for a write that does not fit)."""
    self._check_new(k, v, "append")
    T = k.shape[0]
    q_lens = metadata.seq_q_lens(cu_q_lens, num_seqs)
    cache = self.reserve(q_lens, checked=checked)
    return cache._write(k, v, cu_q_lens, num_seqs, cache._stored_lens(q_lens), T)

  def reserve_append(self, k, v, cu_q_lens, num_seqs, *, checked: bool = False):
    """`append` without the page writes, for a kernel that writes the new tokens itself (the fused write).

    Returns (cache, stored_k, stored_v, k_token_scale, v_token_scale): the cache with its pages reserved
    (copy-on-write done) and kv_lens grown, and the new k [T, K, H] / v [T, K, Hv] as the pages store them
    (quantized, with per-token scales [T, K], when the cache keeps scales; else the scales are None).  The
    kernel must read the lengths and page table of `cache.attention_view()`, so that a refused slot's tokens are
    stored nowhere.
    """
    self._check_new(k, v, "reserve_append")
    q_lens = metadata.seq_q_lens(cu_q_lens, num_seqs)
    cache = self.reserve(q_lens, checked=checked)
    k_store, k_sc = _quantize(cache.k_pages.dtype, cache.k_scale is not None, k)
    v_store, v_sc = _quantize(cache.v_pages.dtype, cache.v_scale is not None, v)
    cache = dataclasses.replace(cache, kv_lens=cache.kv_lens + cache._stored_lens(q_lens))
    return cache, k_store, v_store, k_sc, v_sc

  def _write(self, k, v, cu_q_lens, num_seqs, q_lens, T) -> PagedKVCache:
    """Stores the rows of the slots with q_lens [S] > 0 (the others' rows are refused, or padding)."""
    cache = self
    seq, start, valid = metadata.token_owner(cu_q_lens, num_seqs, T)
    pos = cache.kv_lens[seq] + jnp.arange(T) - start
    ps, P = cache.page_size, cache.num_pages
    col = jnp.clip(pos // ps, 0, cache.pages_per_seq - 1)
    page = cache.page_indices[seq, col]
    ok = valid & (q_lens[seq] > 0) & (pos // ps < cache.pages_per_seq) & (page >= 0)
    page = jnp.where(ok, page, P)
    slot = pos % ps
    k_pages, k_scale = _store(cache.k_pages, cache.k_scale, page, slot, k)
    v_pages, v_scale = _store(cache.v_pages, cache.v_scale, page, slot, v)
    return dataclasses.replace(
      cache, k_pages=k_pages, v_pages=v_pages, k_scale=k_scale, v_scale=v_scale, kv_lens=cache.kv_lens + q_lens
    )

  def free(self, slots) -> PagedKVCache:
    """Releases the pages of the slots where `slots` [S] is True; pages nobody
    references any more are zeroed."""
    slots = jnp.asarray(slots, bool)
    P = self.num_pages
    ids = jnp.where(slots[:, None] & (self.page_indices >= 0), self.page_indices, P)
    refs = self.ref_counts.at[ids.reshape(-1)].add(-1, mode="drop")
    released = (refs <= 0) & (self.ref_counts > 0)
    refs = jnp.maximum(refs, 0)
    return dataclasses.replace(
      self,
      k_pages=_zero_pages(self.k_pages, released),
      v_pages=_zero_pages(self.v_pages, released),
      k_scale=_zero_pages(self.k_scale, released),
      v_scale=_zero_pages(self.v_scale, released),
      page_indices=jnp.where(slots[:, None], -1, self.page_indices),
      kv_lens=jnp.where(slots, 0, self.kv_lens),
      ref_counts=refs,
      overflowed=None if self.overflowed is None else self.overflowed & ~slots,
    )

  def share_prefix(self, src, dst, num_tokens) -> PagedKVCache:
    """Slot `dst` (empty) starts with the first `num_tokens` tokens of slot `src`,
    referencing the same pages (no copy; a later write into the last, partial
    page copies it first)."""
    ps = self.page_size
    n_pages = -(-num_tokens // ps)
    j = jnp.arange(self.pages_per_seq)
    shared = j < n_pages
    row = jnp.where(shared, self.page_indices[src], -1)
    ids = jnp.where(shared & (row >= 0), row, self.num_pages)
    return dataclasses.replace(
      self,
      page_indices=self.page_indices.at[dst].set(row),
      kv_lens=self.kv_lens.at[dst].set(jnp.minimum(num_tokens, self.kv_lens[src])),
      ref_counts=self.ref_counts.at[ids].add(1, mode="drop"),
    )


def _zero_pages(x, released):
  if x is None:
    return None
  return jnp.where(released.reshape((x.shape[0],) + (1,) * (x.ndim - 1)), jnp.zeros((), x.dtype), x)


def _quantize(dtype, scaled: bool, x):
  """x [T, K, H | Hv] as pages of `dtype` store it, and its per-token scales [T, K] (None without scales)."""
  if not scaled:
    return x.astype(dtype), None
  qmax = common.QUANTIZED_MAX[jnp.dtype(dtype).name]
  xf = x.astype(jnp.float32)
  s = jnp.max(jnp.abs(xf), axis=-1) / qmax  # [T, K]
  s = jnp.where(s == 0, 1.0, s)
  stored = xf / s[..., None]
  if jnp.issubdtype(dtype, jnp.integer):
    stored = jnp.round(stored)
  return stored.astype(dtype), s


def _store(pages, scale, page, slot, x):
  """Writes x [T, K, H | Hv] at (page, slot); quantizes per token and head when `scale` is kept."""
  stored, s = _quantize(pages.dtype, scale is not None, x)
  pages = pages.at[page, slot].set(stored, mode="drop")
  return pages, None if scale is None else scale.at[page, slot].set(s, mode="drop")

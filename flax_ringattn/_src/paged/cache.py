"""`PagedKVCache`: page-major K/V pages, page table, allocator, prefix sharing.

A functional pytree (usable under jit and as `nnx.Cache` state): every method
returns a new cache.  Slots are sequence indices 0 .. max_num_seqs - 1; the
ragged batch of a step lists the new tokens of slot i at rows
cu_q_lens[i] .. cu_q_lens[i + 1] - 1 (see `_src/ragged.py`).

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
  on concrete arrays, the write raises `CacheOverflowError` instead;
* a method checks its arguments before it changes anything (`contracts.py`):
  one that raises leaves the cache as it was, and under jit a call whose
  values break its contract changes nothing it must not.

Spread over a mesh axis (`create(mesh=, seq_axis=)`, n devices), device d owns
the page ids d * P/n .. (d + 1) * P/n - 1 and column j of every page table is
allocated on owner (s + j) % n, a ring prefill's in zigzag chunks (`allocator.py`).  The
invariants then hold per owner: a write needing more pages on some owner than
it has free is refused whole, a copy-on-write copies into a page of the same
owner, and a freed page goes back to its owner's free list, zeroed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_ringattn._src import ragged, sharding, validation
from flax_ringattn._src.paged import admission, allocator, checks, common, contracts, eager, reservations, storage
from flax_ringattn._src.paged.admission import CacheOverflowError
from flax_ringattn._src.paged.reservations import Reservation
from flax_ringattn._src.paged.rollback import rollback as rollback_tokens
from flax_ringattn._src.validation import check_bool

__all__ = ["CacheOverflowError", "PagedKVCache"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedKVCache:
  """The K/V of up to `max_num_seqs` sequences (slots) in P pages of `page_size` tokens, with their page table.

  Made empty by `PagedKVCache.create(num_pages=, page_size=, max_num_seqs=, pages_per_seq=, num_kv_heads=,
  head_dim=)` (or a layer's `init_cache`); a pytree whose methods return a new cache (`append`, `reserve`,
  `free`, `rollback`, `share_prefix`, ...).  `paged_attention` reads `k_pages`, `v_pages` and `attention_view()`.

  Fields: `k_pages` [P, page_size, K, H], `v_pages` [P, page_size, K, Hv] (merged: [P, page_size, K * H], ...,
  with `merged_kv_heads` (static) K, `create(merged=True)`; kv pages: `k_pages` [P, 2, page_size, K * H] holds
  both, `v_pages` None, `kv_together` (static), `create(merged="kv")`); `page_indices` [max_num_seqs,
  pages_per_seq] int32 page ids (-1: none); `kv_lens` [max_num_seqs] int32 tokens stored; `ref_counts` [P] int32
  slots holding each page (0: free); `k_scale` / `v_scale` [P, page_size, K] for int8 / float8 pages (else
  None); `overflowed` [max_num_seqs] bool, a write did not fit (None: none); `num_shards` (static) devices the
  pages are spread over.
  """

  k_pages: jax.Array  # [P, page_size, K, H]
  v_pages: jax.Array  # [P, page_size, K, Hv] (Hv == H unless v's head dim differs, as in MLA)
  page_indices: jax.Array  # [S, pages_per_seq] int32, -1 = no page
  kv_lens: jax.Array  # [S] int32 tokens stored per slot
  ref_counts: jax.Array  # [P] int32
  k_scale: jax.Array | None = None  # [P, page_size, K] for quantized pages
  v_scale: jax.Array | None = None
  # [S] bool: a write to the slot did not fit; the slot stores nothing more until `free` (None: all False).
  overflowed: jax.Array | None = None
  # n, the devices the pages are spread over (see the module docstring).  Static: part of the pytree's structure,
  # so a jitted step is compiled per n; the mesh itself stays out (the arrays carry their sharding).
  num_shards: int = dataclasses.field(default=1, metadata=dict(static=True))
  # K of a merged cache (pages [P, page_size, K * H]); 0: pages [P, page_size, K, H].  Static, as the layout.
  merged_kv_heads: int = dataclasses.field(default=0, metadata=dict(static=True))
  # kv pages: k_pages [P, 2, page_size, K * H] holds a page's K, then its V; v_pages is None.  Static.
  kv_together: bool = dataclasses.field(default=False, metadata=dict(static=True))

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
    mesh=None,
    seq_axis=None,
    merged: bool | str = False,
  ) -> PagedKVCache:
    """An empty cache; int8 / float8 dtypes store per-token, per-head scales.

    k pages hold `head_dim` H per kv head, v pages `v_head_dim` Hv (None: H; MLA stores e.g. H = 192, Hv = 128).

    `merged=True` stores pages [P, page_size, K * H] (a token's kv heads side by side), which the Pallas TPU
    kernel reads densely for any K and head dim (docs/guarantees.md: with few kv heads per chip or head dim 64,
    [P, page_size, K, H] pages are padded on a TPU).  `merged="kv"` also keeps a page's K and V together:
    `k_pages` [P, 2, page_size, K * H] (its K, then its V) and `v_pages` None, so the kernel copies a page with one
    DMA instead of two (with few kv heads a page is small, and a decode step's time goes to issuing the copies);
    it needs v_head_dim == head_dim.  Context-parallel serving (`paged_ring_prefill`) needs 4-D pages.  "auto":
    kv pages, merged ones for MLA, 4-D ones over a mesh or where a page is a partial tile (`contracts.pages`).

    With `mesh` and `seq_axis` (a mesh axis, or a tuple of them, with n devices along it; default: the mesh's
    only axis), the pages, their scales and `ref_counts` are sharded on the page dimension over `seq_axis`:
    device d owns the page ids d * P/n .. (d + 1) * P/n - 1 (num_pages must be a multiple of n).  The page
    table, lengths and flags are replicated.  Every slot's pages are striped over the devices, its page j on
    device (s + j) % n for slot s, so each device holds 1/n of a long sequence, plus at most one page.
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
    dtype = contracts.page_dtype(dtype)
    merged, together = contracts.pages(merged, page_size, dtype, head_dim, v_head_dim, mesh)
    seq_axis, n = contracts.seq_axis(num_pages, mesh, seq_axis)
    explicit = mesh is not None and sharding.has_explicit_axes(mesh, P(seq_axis))

    def full(shape, value, dtype, *, by_page=False):
      if mesh is None:
        return jnp.full(shape, value, dtype)
      # Made in place on the mesh, each device its part: the whole cache need not fit on one device.  The specs
      # are spelled as a jitted step returns them (a jit's cache compares specs as written: P() is not
      # P(None, None)), so the second step does not compile again: in full on Explicit axes, where the spec is
      # part of the type; trimmed on Auto axes, as jit converts XLA's output shardings back.
      spec = (seq_axis,) if by_page else ()
      if explicit:
        spec += (None,) * (len(shape) - len(spec))
      x = jnp.full(shape, value, dtype, device=NamedSharding(mesh, P(*spec)))
      # Under a trace (create inside jit) `device=` places nothing: say it as a sharding of the traced value.
      return sharding.constrain(x, mesh, P(*spec)) if isinstance(x, jax.core.Tracer) else x

    quantized = jnp.dtype(dtype).name in common.QUANTIZED_MAX
    scale = full((num_pages, page_size, num_kv_heads), 0, jnp.float32, by_page=True) if quantized else None
    heads = lambda h: (num_kv_heads * h,) if merged else (num_kv_heads, h)  # noqa: E731
    k_shape = (
      (num_pages, 2, page_size, num_kv_heads * head_dim) if together else (num_pages, page_size, *heads(head_dim))
    )
    k_pages = full(k_shape, 0, dtype, by_page=True)  # kv pages: K and V in one array, v_pages None
    v_pages = None if together else full((num_pages, page_size, *heads(v_head_dim)), 0, dtype, by_page=True)
    return cls(
      k_pages=k_pages,
      v_pages=v_pages,
      page_indices=full((max_num_seqs, pages_per_seq), -1, jnp.int32),
      kv_lens=full((max_num_seqs,), 0, jnp.int32),
      ref_counts=full((num_pages,), 0, jnp.int32, by_page=True),
      k_scale=scale,
      v_scale=scale,
      overflowed=full((max_num_seqs,), False, bool),
      num_shards=n,
      merged_kv_heads=num_kv_heads if merged else 0,
      kv_together=together,
    )

  # -- shapes -----------------------------------------------------------------
  @property
  def num_pages(self) -> int:
    return self.k_pages.shape[0]

  @property
  def page_size(self) -> int:
    return self.k_pages.shape[2 if self.kv_together else 1]

  @property
  def max_num_seqs(self) -> int:
    return self.page_indices.shape[0]

  @property
  def pages_per_seq(self) -> int:
    return self.page_indices.shape[1]

  @property
  def num_kv_heads(self) -> int:
    return self.merged_kv_heads or self.k_pages.shape[2]

  @property
  def head_dim(self) -> int:
    return self.k_pages.shape[-1] // self.merged_kv_heads if self.merged_kv_heads else self.k_pages.shape[3]

  @property
  def v_head_dim(self) -> int:
    if self.kv_together:
      return self.head_dim
    return self.v_pages.shape[2] // self.merged_kv_heads if self.merged_kv_heads else self.v_pages.shape[3]

  @property
  def pages_per_owner(self) -> int:
    """P / n: the page ids each device along `seq_axis` owns (all of them when the cache is not spread)."""
    return self.num_pages // self.num_shards

  @eager.method
  def page_owner(self, page_ids):
    """The owner (device along `seq_axis`) of each page id (-1 for a negative id: no page)."""
    page_ids = jnp.asarray(page_ids)
    return jnp.where(page_ids >= 0, page_ids // self.pages_per_owner, -1)

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
  @eager.method
  def num_free_pages(self):
    return jnp.sum(self.ref_counts == 0)

  @eager.method
  def num_free_pages_per_owner(self):
    """[n] int32: the free pages of each owner (device along `seq_axis`); [num_free_pages()] when n = 1."""
    return allocator.free_per_owner(allocator.replicated(self.ref_counts), self.num_shards)

  def _overflowed(self):
    return jnp.zeros((self.max_num_seqs,), bool) if self.overflowed is None else self.overflowed

  def _new_lens(self, new_lens, where: str, checked: bool = False):
    """`new_lens` checked ([S] ints, none negative: see `contracts.new_lens`) as int32."""
    lens = contracts.new_lens(new_lens, self.max_num_seqs, f"PagedKVCache.{where}")
    checks.enforce(lambda: contracts.new_lens_problems(lens), (lens,), where=f"PagedKVCache.{where}", checked=checked)
    return lens

  @eager.method
  def pages_needed(self, new_lens):
    """Pages the slots need beyond what they hold to store `new_lens` [S] more tokens (copy-on-write included)."""
    return jnp.sum(admission.admit(self, self._new_lens(new_lens, "pages_needed")).extra)

  @eager.method
  def pages_needed_per_owner(self, new_lens):
    """[n]: `pages_needed` per owner (device along `seq_axis`); compare with `num_free_pages_per_owner()`."""
    return jnp.sum(admission.admit(self, self._new_lens(new_lens, "pages_needed_per_owner")).extra, axis=0)

  @eager.method
  def fits(self, new_lens):
    """[S] bool: the slots whose `new_lens` [S] more tokens `reserve` would store (served in slot order).

    A slot with no new tokens fits; a slot past its capacity, or already `overflowed`, fits no new token.
    Check this before a step to refuse work the cache cannot hold.
    """
    a = admission.admit(self, self._new_lens(new_lens, "fits"))
    return a.accepted | ~a.wants

  @eager.method
  def utilization(self):
    """Token slots holding data / token slots of allocated pages (shared pages counted once)."""
    ps = self.page_size
    j = jnp.arange(self.pages_per_seq)
    filled = jnp.clip(self.kv_lens[:, None] - j[None] * ps, 0, ps)
    ids = jnp.where(self.page_indices >= 0, self.page_indices, self.num_pages)
    per_page = jnp.zeros((self.num_pages,), jnp.int32).at[ids].max(filled, mode="drop")
    allocated = jnp.sum(allocator.replicated(self.ref_counts) > 0) * ps
    return jnp.where(allocated > 0, jnp.sum(per_page) / jnp.maximum(allocated, 1), 1.0)

  @eager.method
  def attention_view(self):
    """(kv_lens, page_indices) as attention reads them: `overflowed` slots have length 0 and no pages, so their
    rows see nothing (they return 0) and a fused cache write stores nothing for them."""
    over = self._overflowed()
    return jnp.where(over, 0, self.kv_lens), jnp.where(over[:, None], -1, self.page_indices)

  # -- allocation ---------------------------------------------------------------
  def _copy_on_write_mask(self, new_lens, refs):
    """[S] int32 1 where the slot writes into its partial page and that page is shared (refs: `ref_counts`,
    replicated)."""
    _, page = self._partial_page()
    partial = (self.kv_lens % self.page_size != 0) & (new_lens > 0)
    shared = refs[jnp.clip(page, 0, self.num_pages - 1)] > 1
    return (partial & (page >= 0) & shared).astype(jnp.int32)

  def _held(self):
    """[S] int32: the pages each slot holds (the leading entries of its row)."""
    return jnp.sum(self.page_indices >= 0, axis=1).astype(jnp.int32)

  def _partial_page(self):
    """(j0 [S], page [S]): each slot's column that its next token goes to, and the page id there (its partially
    filled page, the one a write copies first when it is shared; -1 for none)."""
    j0 = jnp.clip(self.kv_lens // self.page_size, 0, self.pages_per_seq - 1)
    return j0, jnp.take_along_axis(self.page_indices, j0[:, None], 1)[:, 0]

  def _extra(self, new_lens, refs, owners=None):
    """(extra [S, n] pages per owner beyond those held, have [S], need [S], cow [S], cow_owner [S]) for
    `new_lens` [S] more tokens: the new columns have .. need - 1 and the copy of the shared partial page, on that
    page's owner (`_partial_page`)."""
    ps = self.page_size
    # The pages a slot holds: its tokens', and any `reserve` gave it beyond them (reused, not replaced: a second
    # reserve before the write would otherwise leak the first one's pages).
    have = jnp.maximum(-(-self.kv_lens // ps), self._held())
    need = jnp.maximum(-(-(self.kv_lens + new_lens) // ps), have)
    cow = self._copy_on_write_mask(new_lens, refs)
    cow_owner = jnp.maximum(self._partial_page()[1], 0) // self.pages_per_owner
    extra = allocator.extra_per_owner(have, need, cow, cow_owner, self.num_shards, owners)
    return extra, have, need, cow, cow_owner

  @eager.method
  def reserve(self, new_lens, *, checked: bool = False) -> PagedKVCache:
    """Gives every slot the pages it needs for `new_lens` [S] more tokens.

    Pages come from the free list in slot order (page j of a slot from the
    free list of owner (s + j) % n).  A shared page about to be written is first
    copied, into a page of the same owner.  A slot whose tokens do not fit
    (more than `pages_per_seq * page_size` in all, or more pages than are free
    on some owner after the slots before it) gets nothing: its write is
    refused whole, never cut short.
    On concrete arrays that raises `CacheOverflowError` (naming the slot, the
    tokens and the capacity).  Under `jit` the slot is marked in
    `overflowed` (it then stores nothing more until `free`): check that flag
    after a step, or `fits(new_lens)` before it, or pass `checked=True` and
    run under `jax.experimental.checkify.checkify` to raise instead.

    `new_lens` must be [max_num_seqs] ints >= 0 (a negative count raises eagerly; under jit it stores nothing).
    """
    checked = check_bool("checked", checked)
    return self._reserve(self._new_lens(new_lens, "reserve", checked), checked)

  def _reserve(self, new_lens, checked: bool, owners=None, reservation: Reservation | None = None) -> PagedKVCache:
    """`reserve` of `new_lens` [S] more tokens; or, given a `reservation` that `reservation(new_lens)` of a cache
    with this one's page table made, its page moves applied to this cache's pages (the allocation not run
    again)."""
    r = self.reservation(new_lens, owners) if reservation is None else reservation
    admission.check(self, r.admission, checked)
    return reservations.apply(self, r)

  def reservation(self, new_lens, owners=None) -> Reservation:
    """The page allocation of `reserve` for `new_lens` [S] (its admission, the new page table and reference
    counts, the copy-on-write and release page moves), without touching the pages.

    Every cache of one page table (`ServingEngine` keeps one for all the layers of a model) gets the same
    allocation: compute it once per step and pass it to each layer's write, instead of allocating per layer."""
    a = admission.admit(self, new_lens, owners)
    refused = a.wants & ~a.accepted
    new_lens = jnp.where(a.accepted, a.new_lens, 0)
    return reservations.grow(self, new_lens, a, self._overflowed() | refused, owners)

  def _stored_lens(self, q_lens):
    """[S] new tokens each slot stores this step: its q_lens, or 0 where its write was refused (`overflowed`)."""
    return jnp.where(self._overflowed(), 0, q_lens)

  def _ragged(self, k, v, cu_q_lens, num_seqs, where: str, checked: bool):
    """The new k, v and their ragged batch checked before anything is written: k / v as the pages store them
    (`_check_new`), and `paged_attention`'s rules of the batch's layout (`checks.check_ragged`: cu_q_lens from 0,
    non-decreasing over its first num_seqs + 1 entries, at most T = k.shape[0] tokens, num_seqs in [0, S]).
    Returns (cu_q_lens, num_seqs) as int32 and the new tokens per slot [S]."""
    self._check_new(k, v, where)
    where = f"PagedKVCache.{where}"
    common.check_ragged_shapes(cu_q_lens, num_seqs, self.max_num_seqs, where=where)
    checked = check_bool("checked", checked)
    cu, n = jnp.asarray(cu_q_lens, jnp.int32), jnp.asarray(num_seqs, jnp.int32)
    checks.check_ragged(cu, n, self.max_num_seqs, k.shape[0], where=where, rows="k.shape[0]", checked=checked)
    return cu, n, ragged.seq_q_lens(cu, n)

  @eager.method
  def append(self, k, v, cu_q_lens, num_seqs, *, checked: bool = False) -> PagedKVCache:
    """Reserves pages and writes the new k [T, K, H] and v [T, K, Hv] of a ragged batch; kv_lens grows (see
    `reserve` for a write that does not fit).  The batch's metadata follows `paged_attention`'s rules (`_ragged`):
    eagerly a breach raises `ValueError`; under jit, `checked=True` reports it under checkify."""
    return self._append(k, v, cu_q_lens, num_seqs, checked)

  def _append(self, k, v, cu_q_lens, num_seqs, checked: bool, reservation: Reservation | None = None):
    """`append`, with the step's allocation given (`reservation`) or made here (None)."""
    cu, n, q_lens = self._ragged(k, v, cu_q_lens, num_seqs, "append", checked)
    cache = self._reserve(q_lens, checked, reservation=reservation)
    return cache._write(k, v, cu, n, cache._stored_lens(q_lens), k.shape[0])

  @eager.method
  def reserve_append(self, k, v, cu_q_lens, num_seqs, *, checked: bool = False):
    """`append` without the page writes, for a kernel that writes the new tokens itself (the fused write).

    Returns (cache, stored_k, stored_v, k_token_scale, v_token_scale): the cache with its pages reserved
    (copy-on-write done) and kv_lens grown, and the new k [T, K, H] / v [T, K, Hv] as the pages store them
    (quantized, with per-token scales [T, K], when the cache keeps scales; else the scales are None).  The
    kernel must read the lengths and page table of `cache.attention_view()`, so that a refused slot's tokens are
    stored nowhere.
    """
    return self._reserve_append(k, v, cu_q_lens, num_seqs, checked)

  def _reserve_append(self, k, v, cu_q_lens, num_seqs, checked: bool, reservation: Reservation | None = None):
    """`reserve_append`, with the step's allocation given (`reservation`) or made here (None)."""
    _, _, q_lens = self._ragged(k, v, cu_q_lens, num_seqs, "reserve_append", checked)
    cache = self._reserve(q_lens, checked, reservation=reservation)
    k_store, k_sc = storage.quantize(cache.k_pages.dtype, cache.k_scale is not None, k)
    v_store, v_sc = storage.quantize(cache.k_pages.dtype, cache.v_scale is not None, v)
    cache = dataclasses.replace(cache, kv_lens=cache.kv_lens + cache._stored_lens(q_lens))
    return cache, k_store, v_store, k_sc, v_sc

  def ring_prefill_len(self, num_tokens: int) -> int:
    """The prompt length a ring prefill of `num_tokens` tokens runs at: the next multiple of 2 n page_size (its
    2n zigzag chunks are whole pages).  Pad the prompt to it (`paged_ring_prefill`)."""
    unit = 2 * self.num_shards * self.page_size
    return max(unit, -(-int(num_tokens) // unit) * unit)

  @eager.method
  def reserve_prefill(self, slot, num_tokens, *, padded_len: int, checked: bool = False) -> PagedKVCache:
    """`reserve` for a ring prefill (`paged_ring_prefill`) of `num_tokens` tokens of slot `slot`, laid out as a
    prompt of `padded_len` tokens (`ring_prefill_len`): the prompt's pages are placed in the ring prefill layout
    (chunk c of its 2n zigzag chunks on device c, or 2n - 1 - c, so each device's prompt shard lands in its own
    pages; `allocator.prefill_owners`), and kv_lens grows by num_tokens.

    The prompt must start on a page boundary (kv_lens[slot] a multiple of page_size: a new slot, or one whose
    earlier chunks filled whole pages) and num_tokens <= padded_len.  A write that does not fit, or breaks those
    rules, is refused whole as in `reserve`: eagerly with `CacheOverflowError` / `ValueError`, under jit by
    flagging the slot in `overflowed` (its prefill then stores and sees nothing).
    """
    n, ps, S = self.num_shards, self.page_size, self.max_num_seqs
    if not isinstance(padded_len, int) or padded_len < 1 or padded_len % (2 * n * ps):
      raise ValueError(
        f"PagedKVCache.reserve_prefill: padded_len={padded_len!r} must be a positive multiple of 2 * n * page_size "
        f"= 2 * {n} * {ps} = {2 * n * ps} (the prompt's 2n zigzag chunks are whole pages; see ring_prefill_len)"
      )
    where = "PagedKVCache.reserve_prefill"
    checked = check_bool("checked", checked)
    index, slot, in_range = contracts.slot("slot", slot, S, where)
    num_tokens = contracts.scalar_int("num_tokens", num_tokens, where)
    # Pages `reserve` gave the slot past its tokens would sit where the prompt's pages go, on the wrong devices.
    misfit = lambda: (  # noqa: E731
      (self.kv_lens[slot] % ps != 0)
      | (self._held()[slot] * ps != self.kv_lens[slot])
      | (num_tokens > padded_len)
      | (num_tokens < 0)
    )
    message = (
      "slot {s} cannot take a ring prefill of num_tokens={t} laid out as "
      f"padded_len={padded_len}: it holds {{kv}} tokens ({{p}} pages), and a ring prefill starts on a page boundary "
      f"(a multiple of page_size={ps}, no page reserved past it) with 0 <= num_tokens <= padded_len (prefill the "
      "first tokens with paged_attention until the slot's length is a multiple of page_size)"
    )

    def problems():
      values = dict(s=slot, t=num_tokens, kv=self.kv_lens[slot], p=self._held()[slot])
      return [*contracts.slot_problems("slot", index, S), (misfit(), message, values)]

    checks.enforce(problems, (index, num_tokens, self.kv_lens, self.page_indices), where=where, checked=checked)
    # A traced slot out of range is no slot: nothing is stored or flagged (the clipped index is another slot's).
    in_range = jnp.asarray(in_range, bool)
    misfit = misfit() & in_range
    new_lens = jnp.zeros((S,), jnp.int32).at[slot].set(jnp.where(misfit | ~in_range, 0, num_tokens))
    owners = allocator.prefill_owners(self.kv_lens, slot, padded_len, ps, self.pages_per_seq, n)
    cache = self._reserve(new_lens, checked, owners)
    cache = dataclasses.replace(cache, overflowed=cache._overflowed().at[slot].set(cache._overflowed()[slot] | misfit))
    return dataclasses.replace(cache, kv_lens=cache.kv_lens + cache._stored_lens(new_lens))

  def _write(self, k, v, cu_q_lens, num_seqs, q_lens, T) -> PagedKVCache:
    """Stores the rows of the slots with q_lens [S] > 0 (the others' rows are refused, or padding)."""
    cache = self
    seq, start, valid = ragged.token_owner(cu_q_lens, num_seqs, T)
    pos = cache.kv_lens[seq] + jnp.arange(T) - start
    ps, P = cache.page_size, cache.num_pages
    col = jnp.clip(pos // ps, 0, cache.pages_per_seq - 1)
    page = cache.page_indices[seq, col]
    ok = valid & (q_lens[seq] > 0) & (pos // ps < cache.pages_per_seq) & (page >= 0)
    page = jnp.where(ok, page, P)
    slot = pos % ps
    if cache.kv_together:
      k_pages, v_pages, k_scale, v_scale = storage.store_kv(
        cache.k_pages, cache.k_scale, cache.v_scale, page, slot, k, v
      )
    else:
      k_pages, k_scale = storage.store(cache.k_pages, cache.k_scale, page, slot, k)
      v_pages, v_scale = storage.store(cache.v_pages, cache.v_scale, page, slot, v)
    return dataclasses.replace(
      cache, k_pages=k_pages, v_pages=v_pages, k_scale=k_scale, v_scale=v_scale, kv_lens=cache.kv_lens + q_lens
    )

  @eager.method
  def free(self, slots) -> PagedKVCache:
    """Releases the pages of the slots where `slots` [S] is True; pages nobody
    references any more are zeroed.  `slots` must be a bool mask of shape [max_num_seqs] (an int array, which
    would broadcast or read as truthy, raises `TypeError`, also under jit)."""
    slots = contracts.slot_mask(slots, self.max_num_seqs, "PagedKVCache.free")
    P = self.num_pages
    ids = jnp.where(slots[:, None] & (self.page_indices >= 0), self.page_indices, P)
    refs_in = allocator.replicated(self.ref_counts)
    refs = refs_in.at[ids.reshape(-1)].add(-1, mode="drop")
    released = (refs <= 0) & (refs_in > 0)
    refs = allocator.placed_like(jnp.maximum(refs, 0), self.ref_counts)
    return dataclasses.replace(
      self,
      k_pages=storage.zero_pages(self.k_pages, released),
      v_pages=storage.zero_pages(self.v_pages, released),
      k_scale=storage.zero_pages(self.k_scale, released),
      v_scale=storage.zero_pages(self.v_scale, released),
      page_indices=jnp.where(slots[:, None], -1, self.page_indices),
      kv_lens=jnp.where(slots, 0, self.kv_lens),
      ref_counts=refs,
      overflowed=None if self.overflowed is None else self.overflowed & ~slots,
    )

  @eager.method
  def rollback(self, num_tokens, *, checked: bool = False) -> PagedKVCache:
    """Drops the last `num_tokens` [S] (ints, 0 <= n <= kv_lens) tokens of each slot: pages past the new length are
    released (zeroed when free), dropped rows of pages only this slot reads are zeroed (`rollback.py`).  A bad
    count raises `ValueError` eagerly; under jit that slot is left as it was (`checked=True`: checkify)."""
    return rollback_tokens(self, num_tokens, check_bool("checked", checked))

  @eager.method
  def share_prefix(self, src, dst, num_tokens, *, checked: bool = False) -> PagedKVCache:
    """Slot `dst` starts with the first `num_tokens` tokens of slot `src`, referencing the same pages (no copy; a
    later write into the last, partial page copies it first).

    dst must be empty (no tokens, no pages, not `overflowed`: free it first) and another slot than src, with
    0 <= num_tokens <= kv_lens[src].  A call that breaks this raises `ValueError` when its values are concrete
    (slot indices as Python ints are checked inside jit too); under jit it changes nothing (pass `checked=True`
    and run under `jax.experimental.checkify.checkify` to raise instead).
    """
    where = "PagedKVCache.share_prefix"
    checked = check_bool("checked", checked)
    S, ps = self.max_num_seqs, self.page_size
    same = "src={s} and dst={d} must be different slots (a slot cannot share its own prefix)"
    src_i, src_c, _ = contracts.slot("src", src, S, where)
    dst_i, dst_c, _ = contracts.slot("dst", dst, S, where)
    if validation.all_concrete(src, dst) and int(src) == int(dst):  # Python ints: checked inside jit too
      raise ValueError(f"{where}: " + same.format(s=int(src), d=int(dst)))
    src, dst = src_c, dst_c
    num_tokens = contracts.scalar_int("num_tokens", num_tokens, where)

    def problems():
      kv_src, kv_dst, held = self.kv_lens[src], self.kv_lens[dst], jnp.sum(self.page_indices[dst] >= 0)
      return [
        *contracts.slot_problems("src", src_i, S),
        *contracts.slot_problems("dst", dst_i, S),
        (src_i == dst_i, same, dict(s=src_i, d=dst_i)),
        (num_tokens < 0, "num_tokens={t} must be >= 0", dict(t=num_tokens)),
        (
          num_tokens > kv_src,
          "num_tokens={t} is more than slot src={s} holds (kv_lens[{s}]={kv}): a shared prefix is at most the "
          "source's length",
          dict(t=num_tokens, s=src_i, kv=kv_src),
        ),
        (
          (kv_dst != 0) | (held != 0),
          "slot dst={d} must be empty, but it holds kv_lens[{d}]={kv} tokens and {p} page(s): free it first "
          "(free(slots)), or share into an empty slot",
          dict(d=dst_i, kv=kv_dst, p=held),
        ),
        (
          self._overflowed()[dst],
          "slot dst={d} is flagged overflowed (an earlier write to it was refused): free it first (free(slots))",
          dict(d=dst_i),
        ),
      ]

    operands = (src_i, dst_i, num_tokens, self.kv_lens, self.page_indices, self._overflowed())
    ok = checks.enforce(problems, operands, where=where, checked=checked, need_ok=True)
    # Under jit a refused share changes nothing: no reference is taken, dst keeps its row and length.
    pick = (lambda new, old: new) if ok is True else (lambda new, old: jnp.where(ok, new, old))  # noqa: E731
    j = jnp.arange(self.pages_per_seq)
    row = jnp.where(j < -(-num_tokens // ps), self.page_indices[src], -1)
    ids = jnp.where((row >= 0) & ok, row, self.num_pages)
    refs = allocator.replicated(self.ref_counts).at[ids].add(1, mode="drop")
    return dataclasses.replace(
      self,
      page_indices=pick(self.page_indices.at[dst].set(row), self.page_indices),
      kv_lens=pick(self.kv_lens.at[dst].set(num_tokens), self.kv_lens),
      ref_counts=allocator.placed_like(refs, self.ref_counts),
    )

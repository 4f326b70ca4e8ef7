"""`PagedKVCache`: writes land where the page table says, freeing, prefix sharing, a full cache, int8."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import flax_ringattn as fr

KH, HD = 2, 4  # kv heads, head dim
F32 = jnp.float32


def _create(num_pages=16, page_size=4, max_num_seqs=4, pages_per_seq=4, dtype=F32, v_head_dim=None):
  return fr.PagedKVCache.create(
    num_pages=num_pages,
    page_size=page_size,
    max_num_seqs=max_num_seqs,
    pages_per_seq=pages_per_seq,
    num_kv_heads=KH,
    head_dim=HD,
    v_head_dim=v_head_dim,
    dtype=dtype,
  )


@jax.jit
def _append(cache, k, v, cu_q_lens, num_seqs):
  return cache.append(k, v, cu_q_lens, num_seqs)


def _slots(cache, *slots):
  """[max_num_seqs] bool mask of `slots`."""
  return jnp.asarray(np.isin(np.arange(cache.max_num_seqs), slots))


def _lens(cache, *lens):
  """[max_num_seqs] int32 new-token counts (zero past the given ones)."""
  return jnp.asarray(list(lens) + [0] * (cache.max_num_seqs - len(lens)), jnp.int32)


# Every cache method runs jitted (the cache as argument and result); eager op-by-op dispatch is slow.
_free = jax.jit(fr.PagedKVCache.free)
_share = jax.jit(fr.PagedKVCache.share_prefix)
_needed = jax.jit(fr.PagedKVCache.pages_needed)
_num_free = jax.jit(fr.PagedKVCache.num_free_pages)
_util = jax.jit(fr.PagedKVCache.utilization)
_fits = jax.jit(fr.PagedKVCache.fits)


def _batch(rng, lens, num_tokens=16, pad_value=1e6, max_num_seqs=None, v_dim=HD):
  """k [num_tokens, KH, HD], v [num_tokens, KH, v_dim] with lens[i] new tokens for live slot i (padding rows = pad_value), cu_q_lens
  [max_num_seqs + 1] (entries past the live slots repeat the total), num_seqs."""
  total = int(sum(lens))
  max_num_seqs = len(lens) if max_num_seqs is None else max_num_seqs
  k = np.full((num_tokens, KH, HD), pad_value, np.float32)
  v = np.full((num_tokens, KH, v_dim), -pad_value, np.float32)
  k[:total] = rng.normal(size=(total, KH, HD))
  v[:total] = rng.normal(size=(total, KH, v_dim))
  cu = np.concatenate([[0], np.cumsum(lens), [total] * (max_num_seqs - len(lens))]).astype(np.int32)
  per_slot = [(k[cu[i] : cu[i + 1]], v[cu[i] : cu[i + 1]]) for i in range(len(lens))]
  return jnp.asarray(k), jnp.asarray(v), jnp.asarray(cu), jnp.asarray([len(lens)], jnp.int32), per_slot


def _step(cache, rng, lens, history=None, num_tokens=16):
  """Appends random tokens (lens[i] for slot i; slots past len(lens) idle); extends `history` (slot -> [(k, v)])."""
  k, v, cu, n, per_slot = _batch(rng, lens, num_tokens, max_num_seqs=cache.max_num_seqs, v_dim=cache.v_head_dim)
  cache = _append(cache, k, v, cu, n)
  if history is not None:
    for i, (kk, vv) in enumerate(per_slot):
      history.setdefault(i, []).append((kk, vv))
  return cache


def _gather(cache, slot):
  """(k [kv_len, KH, HD], v [kv_len, KH, Hv]) of a slot as float32, read through its page table (dequantized)."""
  table = np.asarray(cache.page_indices)[slot]
  n, ps = int(cache.kv_lens[slot]), cache.page_size
  pages = [np.asarray(cache.k_pages, np.float32), np.asarray(cache.v_pages, np.float32)]
  if cache.k_scale is not None:
    pages[0] = pages[0] * np.asarray(cache.k_scale)[..., None]
    pages[1] = pages[1] * np.asarray(cache.v_scale)[..., None]
  out = []
  for x in pages:
    rows = []
    for t in range(n):
      p = table[t // ps]
      assert p >= 0, f"slot {slot} has no page for token {t}"
      rows.append(x[p, t % ps])
    out.append(np.stack(rows) if rows else np.zeros((0, KH, x.shape[-1]), np.float32))
  return tuple(out)


def _expected(history, slot, v_dim=HD):
  parts = history.get(slot, [])
  if not parts:
    return np.zeros((0, KH, HD)), np.zeros((0, KH, v_dim))
  return np.concatenate([k for k, _ in parts]), np.concatenate([v for _, v in parts])


def _assert_slot(cache, slot, history):
  """The slot reads exactly its history (within half an int8 step per token and head for an int8 cache)."""
  k, v = _gather(cache, slot)
  ek, ev = _expected(history, slot, cache.v_head_dim)
  assert k.shape == ek.shape and v.shape == ev.shape, (k.shape, ek.shape, v.shape, ev.shape)
  for got, want in ((k, ek), (v, ev)):
    if cache.k_pages.dtype == jnp.int8:
      step = np.abs(want).max(-1, keepdims=True) / 127
      assert (np.abs(got - want) <= step / 2 * (1 + 1e-5)).all()
    else:
      np.testing.assert_array_equal(got, want)


def _check_invariants(cache):
  """ref_counts match the page table, slots own exactly ceil(kv_lens / page_size) leading entries, free pages are 0."""
  table, kv_lens, refs = (np.asarray(x) for x in (cache.page_indices, cache.kv_lens, cache.ref_counts))
  ps = cache.page_size
  counts = np.bincount(table[table >= 0].ravel(), minlength=cache.num_pages)
  np.testing.assert_array_equal(counts, refs)
  for s in range(cache.max_num_seqs):
    np.testing.assert_array_equal(table[s, -(-kv_lens[s] // ps) :], -1)
  free = refs == 0
  assert not np.asarray(cache.k_pages, np.float32)[free].any()
  assert not np.asarray(cache.v_pages, np.float32)[free].any()
  assert int(_num_free(cache)) == int(free.sum())


# -- create / append -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, jnp.bfloat16, jnp.int8, jnp.float8_e4m3fn])
def test_create_empty(dtype):
  c = _create(num_pages=10, page_size=4, max_num_seqs=3, pages_per_seq=5, dtype=dtype)
  assert (c.num_pages, c.page_size, c.max_num_seqs, c.pages_per_seq) == (10, 4, 3, 5)
  assert c.k_pages.shape == c.v_pages.shape == (10, 4, KH, HD) and c.k_pages.dtype == dtype
  np.testing.assert_array_equal(c.page_indices, -1)
  np.testing.assert_array_equal(c.kv_lens, 0)
  assert int(_num_free(c)) == 10 and float(_util(c)) == 1.0
  if jnp.dtype(dtype).itemsize == 1:
    assert c.k_scale.shape == c.v_scale.shape == (10, 4, KH) and c.k_scale.dtype == F32
  else:
    assert c.k_scale is None and c.v_scale is None
  _check_invariants(c)


@pytest.mark.parametrize("bad", [dict(num_pages=0), dict(page_size=-1), dict(pages_per_seq=2.0)])
def test_create_rejects_bad_sizes(bad):
  kw = dict(num_pages=4, page_size=4, max_num_seqs=2, pages_per_seq=2, num_kv_heads=1, head_dim=4) | bad
  with pytest.raises(ValueError, match=f"{next(iter(bad))} must be a positive int"):
    fr.PagedKVCache.create(**kw)


def test_create_rejects_bad_layouts():
  """`merged` is a bool, "kv" or "auto"; kv pages hold K and V in one array, so their head dims must match (MLA:
  merged)."""
  kw = dict(num_pages=4, page_size=8, max_num_seqs=2, pages_per_seq=2, num_kv_heads=1, head_dim=4)
  with pytest.raises(TypeError, match="merged must be a bool, 'kv' or 'auto', got merged='KV'"):
    fr.PagedKVCache.create(**kw, merged="KV")
  with pytest.raises(ValueError, match="merged='kv' .* v_head_dim must equal head_dim, got head_dim=4, v_head_dim=2"):
    fr.PagedKVCache.create(**kw, v_head_dim=2, merged="kv")


def test_append_jitted_writes_tokens():
  rng = np.random.default_rng(0)
  c = _create()
  history = {}
  # 3 live slots of 4 (slot 3 idle), 9 new tokens and 7 padding rows holding 1e6.
  c = _step(c, rng, [5, 1, 3], history)
  np.testing.assert_array_equal(c.kv_lens, [5, 1, 3, 0])
  table = np.asarray(c.page_indices)
  assert (table[0, :2] >= 0).all() and (table[0, 2:] == -1).all()
  assert table[1, 0] >= 0 and table[2, 0] >= 0 and (table[3] == -1).all()
  assert len({*table[table >= 0].tolist()}) == 4  # distinct pages
  for s in range(4):
    _assert_slot(c, s, history)
  # The padding rows were written nowhere.
  assert np.abs(np.asarray(c.k_pages)).max() < 1e5 and np.abs(np.asarray(c.v_pages)).max() < 1e5
  _check_invariants(c)
  assert int(_num_free(c)) == 12


def test_append_across_page_boundaries():
  rng = np.random.default_rng(1)
  c = _create()
  history = {}
  schedule = [[3, 4, 1, 0], [2, 1, 1, 5], [1, 4, 0, 4], [4, 0, 1, 1], [1, 1, 7, 3], [0, 5, 1, 2]]
  for lens in schedule:
    c = _step(c, rng, lens, history)
    for s in range(4):
      _assert_slot(c, s, history)
    _check_invariants(c)
  np.testing.assert_array_equal(c.kv_lens, np.sum(schedule, axis=0))


def test_append_idle_slots_untouched():
  """Slots past num_seqs keep their tokens and lengths."""
  rng = np.random.default_rng(2)
  c = _create()
  history = {}
  c = _step(c, rng, [2, 3, 4, 1], history)
  c = _step(c, rng, [3, 2], history)  # num_seqs = 2 of 4
  for s in range(4):
    _assert_slot(c, s, history)
  np.testing.assert_array_equal(c.kv_lens, [5, 5, 4, 1])
  _check_invariants(c)


def test_append_ignores_cu_q_lens_past_num_seqs():
  rng = np.random.default_rng(2)
  c = _create()
  history = {}
  k, v, _, _, per_slot = _batch(rng, [3, 2])
  cu = jnp.asarray([0, 3, 5, 1, 0], jnp.int32)  # entries past num_seqs = 2 are junk
  c = _append(c, k, v, cu, jnp.asarray([2], jnp.int32))
  for i, kv in enumerate(per_slot):
    history[i] = [kv]
  for s in range(4):
    _assert_slot(c, s, history)


# -- free ---------------------------------------------------------------------------


def test_free_zeroes_pages_and_resets_slot():
  rng = np.random.default_rng(3)
  c = _create()
  history = {}
  c = _step(c, rng, [6, 5, 2, 0], history)
  freed_pages = np.asarray(c.page_indices)[1, :2]
  c = _free(c, jnp.asarray([False, True, False, False]))
  np.testing.assert_array_equal(np.asarray(c.page_indices)[1], -1)
  assert int(np.asarray(c.kv_lens)[1]) == 0
  np.testing.assert_array_equal(np.asarray(c.ref_counts)[freed_pages], 0)
  assert (
    not np.asarray(np.asarray(c.k_pages)[freed_pages]).any()
    and not np.asarray(np.asarray(c.v_pages)[freed_pages]).any()
  )
  for s in (0, 2):
    _assert_slot(c, s, history)
  _check_invariants(c)
  # Freeing again (or an empty slot) changes nothing.
  c2 = _free(c, jnp.asarray([False, True, False, True]))
  jax.tree.map(np.testing.assert_array_equal, c2, c)


@pytest.mark.parametrize("dtype", [F32, jnp.int8])
def test_reallocated_page_reads_zeros(dtype):
  """A new owner never sees the previous request's keys and values."""
  rng = np.random.default_rng(4)
  c = _create(dtype=dtype)
  c = _step(c, rng, [7, 0])  # slot 0 takes pages 0 and 1, the first two of the free list
  old_pages = np.asarray(c.page_indices)[0].tolist()
  c = _free(c, _slots(c, 0))
  history = {}
  c = _step(c, rng, [0, 1], history)  # slot 1: one token, on a recycled page
  page = int(np.asarray(c.page_indices)[1, 0])
  assert page in old_pages
  _assert_slot(c, 1, history)
  # The page's other slots hold zeros (and zero scales for int8), not the old tokens.
  assert not np.asarray(np.asarray(c.k_pages)[page, 1:], np.float32).any()
  assert not np.asarray(np.asarray(c.v_pages)[page, 1:], np.float32).any()
  if c.k_scale is not None:
    assert not np.asarray(np.asarray(c.k_scale)[page, 1:]).any()
  _check_invariants(c)


# -- prefix sharing ---------------------------------------------------------------------


def test_share_prefix_copy_on_write_mid_page():
  rng = np.random.default_rng(5)
  c = _create()
  history = {}
  c = _step(c, rng, [6, 0, 0], history)  # slot 0: a full page and a partial one (2 of 4)
  src_pages = np.asarray(c.page_indices)[0, :2]
  c = _share(c, 0, 1, 5)  # slot 1: the first 5 tokens
  np.testing.assert_array_equal(np.asarray(c.page_indices)[1, :2], src_pages)
  np.testing.assert_array_equal(np.asarray(c.ref_counts)[src_pages], [2, 2])
  assert int(np.asarray(c.kv_lens)[1]) == 5
  k0, v0 = _expected(history, 0)
  history[1] = [(k0[:5], v0[:5])]
  _assert_slot(c, 1, history)
  _check_invariants(c)
  assert float(_util(c)) == pytest.approx(6 / 8)  # shared pages counted once

  # Slot 1 writes position 5 of the shared partial page: it gets a private copy first.
  c = _step(c, rng, [0, 3, 0], history)
  table = np.asarray(c.page_indices)
  assert table[1, 0] == src_pages[0] and table[1, 1] not in src_pages
  np.testing.assert_array_equal(table[0, :2], src_pages)
  np.testing.assert_array_equal(np.asarray(c.ref_counts)[src_pages], [2, 1])
  for s in (0, 1):
    _assert_slot(c, s, history)  # slot 0 still reads its own token 5; slot 1 reads its continuation
  _check_invariants(c)

  # Now slot 0 owns its partial page alone: it writes in place.
  c = _step(c, rng, [3, 1, 0], history)
  np.testing.assert_array_equal(np.asarray(c.page_indices)[0, :2], src_pages)
  for s in (0, 1):
    _assert_slot(c, s, history)
  _check_invariants(c)


def test_share_prefix_at_page_boundary_needs_no_copy():
  rng = np.random.default_rng(6)
  c = _create()
  history = {}
  c = _step(c, rng, [6, 0], history)
  c = _share(c, 0, 1, 4)
  k0, v0 = _expected(history, 0)
  history[1] = [(k0[:4], v0[:4])]
  needed = int(_needed(c, _lens(c, 0, 2)))
  free = int(_num_free(c))
  c = _step(c, rng, [0, 2], history)
  assert needed == 1 and int(_num_free(c)) == free - 1
  table = np.asarray(c.page_indices)
  assert table[1, 0] == table[0, 0] and table[1, 1] != table[0, 1]
  assert int(np.asarray(c.ref_counts)[table[0, 0]]) == 2
  for s in (0, 1):
    _assert_slot(c, s, history)
  _check_invariants(c)


def test_both_sharers_write_in_the_same_step():
  rng = np.random.default_rng(7)
  c = _create()
  history = {}
  c = _step(c, rng, [6, 0, 0], history)
  shared_partial = int(np.asarray(c.page_indices)[0, 1])
  c = _share(c, 0, 1, 6)
  k0, v0 = _expected(history, 0)
  history[1] = [(k0, v0)]
  assert int(_needed(c, _lens(c, 1, 3))) == 2 + 1  # two copies, one new page for slot 1
  c = _step(c, rng, [1, 3, 0], history)  # slot 1 crosses into a third page
  table = np.asarray(c.page_indices)
  assert table[0, 1] != shared_partial and table[1, 1] != shared_partial and table[0, 1] != table[1, 1]
  # The original partial page lost both references: released and zeroed.
  assert int(np.asarray(c.ref_counts)[shared_partial]) == 0
  assert not np.asarray(np.asarray(c.k_pages)[shared_partial]).any()
  for s in (0, 1):
    _assert_slot(c, s, history)
  _check_invariants(c)


def test_free_one_sharer_keeps_shared_pages():
  rng = np.random.default_rng(8)
  c = _create()
  history = {}
  c = _step(c, rng, [7, 0], history)
  c = _share(c, 0, 1, 7)
  pages = np.asarray(c.page_indices)[0, :2]
  c = _free(c, _slots(c, 0))
  np.testing.assert_array_equal(np.asarray(c.ref_counts)[pages], [1, 1])
  history[1], history[0] = history[0], []
  _assert_slot(c, 1, history)
  _check_invariants(c)
  c = _free(c, _slots(c, 1))
  assert not np.asarray(c.k_pages).any() and int(_num_free(c)) == c.num_pages
  _check_invariants(c)


# -- a full cache -----------------------------------------------------------------------
#
# A write is all or nothing per slot.  Eagerly (concrete arrays) a write that does not fit raises
# CacheOverflowError; under jit the slot stores none of its tokens and is flagged in `overflowed` until freed.


def _eager_append(cache, k, v, cu, n, **kw):
  return cache.append(k, v, cu, n, **kw)


def test_cache_full_refuses_whole_writes_of_unserved_slots():
  rng = np.random.default_rng(9)
  c = _create(num_pages=5, max_num_seqs=3, pages_per_seq=3)
  history = {}
  c = _step(c, rng, [7, 0, 0], history)  # 2 pages used, 3 free
  new = jnp.asarray([1, 6, 6])  # slot 0: 0 pages (room in its page), slot 1: 2, slot 2: 2
  assert int(_needed(c, new)) == 4 and int(_num_free(c)) == 3
  np.testing.assert_array_equal(_fits(c, new), [True, True, False])
  before = c
  k, v, cu, n, per_slot = _batch(rng, [1, 6, 6])
  c = _append(c, k, v, cu, n)
  table = np.asarray(c.page_indices)
  # Served in slot order: slot 1 gets both pages; slot 2 none, and stores none of its 6 tokens.
  assert (table[1, :2] >= 0).all() and (table[2] == -1).all()
  np.testing.assert_array_equal(c.overflowed, [False, False, True])
  np.testing.assert_array_equal(c.kv_lens, [8, 6, 0])
  assert int(_num_free(c)) == 1
  for i in (0, 1):
    history[i].append(per_slot[i])
    _assert_slot(c, i, history)
  np.testing.assert_array_equal(np.asarray(c.page_indices)[0], np.asarray(before.page_indices)[0])
  _check_invariants(c)
  # The flag sticks: a later write to slot 2 is refused too, even with pages free, until it is freed.
  k, v, cu, n, _ = _batch(rng, [0, 0, 1])
  c = _append(c, k, v, cu, n)
  assert bool(c.overflowed[2]) and int(c.kv_lens[2]) == 0 and int(_num_free(c)) == 1
  lens, table = c.attention_view()
  assert int(lens[2]) == 0 and (np.asarray(table)[2] == -1).all()
  c = _free(c, _slots(c, 2))
  assert not np.asarray(c.overflowed).any()
  c = _step(c, rng, [0, 0, 1])
  assert int(c.kv_lens[2]) == 1 and not bool(c.overflowed[2])


def test_cache_full_no_page_at_all():
  rng = np.random.default_rng(10)
  c = _create(num_pages=2, max_num_seqs=2, pages_per_seq=2)
  history = {}
  c = _step(c, rng, [8, 0], history)  # every page taken
  assert int(_num_free(c)) == 0 and int(_needed(c, jnp.asarray([0, 3]))) == 1
  c = _step(c, rng, [0, 3])
  np.testing.assert_array_equal(np.asarray(c.page_indices)[1], -1)
  np.testing.assert_array_equal(c.overflowed, [False, True])
  _assert_slot(c, 0, history)
  np.testing.assert_array_equal(c.ref_counts, [1, 1])


def test_cache_full_copy_on_write_does_not_corrupt_sharer():
  rng = np.random.default_rng(11)
  c = _create(num_pages=2, max_num_seqs=2, pages_per_seq=2)
  history = {}
  c = _step(c, rng, [6, 0], history)  # both pages of the cache
  c = _share(c, 0, 1, 5)
  assert int(_num_free(c)) == 0 and int(_needed(c, jnp.asarray([0, 1]))) == 1
  c = _step(c, rng, [0, 1])  # slot 1 writes position 5 of the shared page: no page for the copy
  _assert_slot(c, 0, history)  # slot 0's token 5 must be intact
  assert bool(c.overflowed[1]) and int(c.kv_lens[1]) == 5  # slot 1 keeps its shared prefix, stores nothing new
  _check_invariants(c)


def test_cache_past_pages_per_seq_refused_under_jit():
  """The issue's case: 40 tokens into a slot of 4 pages of 8."""
  c = _create(num_pages=16, page_size=8, max_num_seqs=2, pages_per_seq=4)
  k, v, cu, n, _ = _batch(np.random.default_rng(12), [40, 3], num_tokens=48)
  c = _append(c, k, v, cu, n)
  np.testing.assert_array_equal(c.overflowed, [True, False])
  np.testing.assert_array_equal(c.kv_lens, [0, 3])
  _check_invariants(c)


# (capacity limit, slot lens, expected message)
OVERFLOWS = {
  "pages_per_seq": (
    dict(num_pages=16, page_size=8, max_num_seqs=2, pages_per_seq=4),
    [40, 3],
    "slot 0 cannot take 40 more tokens: it holds 0 and a slot holds at most pages_per_seq * page_size = 4 * 8 = 32",
  ),
  "free_pages": (
    dict(num_pages=3, page_size=8, max_num_seqs=2, pages_per_seq=4),
    [16, 16],
    "slot 1 needs 2 more pages for 16 new tokens (it holds 0), but only 1 of num_pages=3 are free",
  ),
}


@pytest.mark.parametrize("limit", list(OVERFLOWS))
def test_cache_overflow_raises_eagerly(limit):
  sizes, lens, message = OVERFLOWS[limit]
  c = _create(**sizes)
  k, v, cu, n, _ = _batch(np.random.default_rng(13), lens, num_tokens=48)
  with pytest.raises(fr.CacheOverflowError, match=re.escape(message)):
    _eager_append(c, k, v, cu, n)
  with pytest.raises(fr.CacheOverflowError, match=re.escape(message)):
    c.reserve(_lens(c, *lens))
  # Within capacity, the same eager write goes through.
  ok = _eager_append(c, k[:8], v[:8], jnp.asarray([0, 4, 8], jnp.int32), n)
  np.testing.assert_array_equal(ok.kv_lens, [4, 4])


@pytest.mark.parametrize("limit", list(OVERFLOWS))
def test_cache_overflow_checked_under_jit(limit):
  sizes, lens, message = OVERFLOWS[limit]
  c = _create(**sizes)
  k, v, cu, n, _ = _batch(np.random.default_rng(14), lens, num_tokens=48)
  checked = jax.jit(checkify.checkify(lambda c, k, v, cu, n: c.append(k, v, cu, n, checked=True)))
  err, _ = checked(c, k, v, cu, n)
  short = message.split(" (it holds")[0] if limit == "free_pages" else message.split(": it holds")[0]
  assert err.get() is not None and short in err.get(), err.get()
  # A slot flagged by an earlier step and written again: the third check.
  flagged = dataclasses.replace(c, overflowed=jnp.asarray([False, True]))
  err, _ = checked(flagged, k, v, jnp.asarray([0, 0, 1], jnp.int32), n)
  assert "slot 1 overflowed in an earlier step" in err.get(), err.get()
  err, _ = checked(c, k[:8], v[:8], jnp.asarray([0, 4, 8], jnp.int32), n)
  assert err.get() is None


# -- utilization -----------------------------------------------------------------------


@pytest.mark.parametrize(
  "lens, expected",
  [([5, 0], 5 / 8), ([4, 1], 5 / 8), ([4, 4], 1.0), ([1, 1], 2 / 8), ([0, 0], 1.0), ([9, 3], 12 / 16)],
)
def test_utilization(lens, expected):
  c = _create()
  c = _step(c, np.random.default_rng(12), lens)
  assert float(_util(c)) == pytest.approx(expected)


def test_utilization_after_free():
  c = _step(_create(), np.random.default_rng(13), [5, 2])
  assert float(_util(c)) == pytest.approx(7 / 12)
  c = _free(c, _slots(c, 0))
  assert float(_util(c)) == pytest.approx(2 / 4)


# -- quantized pages -------------------------------------------------------------------------


def test_int8_quantizes_per_token_and_head():
  rng = np.random.default_rng(14)
  c = _create(dtype=jnp.int8)
  k, v, cu, n, per_slot = _batch(rng, [5, 3, 0, 2])
  # Magnitudes that differ per token and head; one all-zero token.
  mag = (10.0 ** rng.uniform(-3, 3, size=(10, KH, 1))).astype(np.float32)
  k, v = np.array(k), np.array(v)
  k[:10] *= mag
  v[:10] *= mag
  k[3] = 0.0
  c = _append(c, jnp.asarray(k), jnp.asarray(v), cu, n)
  assert c.k_pages.dtype == jnp.int8
  table = np.asarray(c.page_indices)
  for x, pages, scale in ((k, c.k_pages, c.k_scale), (v, c.v_pages, c.v_scale)):
    x, pages, scale = np.asarray(x), np.asarray(pages), np.asarray(scale)
    for s, (lo, hi) in enumerate(zip(np.asarray(cu)[:-1], np.asarray(cu)[1:], strict=True)):
      for t in range(hi - lo):
        p, slot = table[s, t // 4], t % 4
        step = np.asarray(scale[p, slot])  # [KH]: one scale per token and head
        np.testing.assert_allclose(step, np.abs(x[lo + t]).max(-1) / 127 if x[lo + t].any() else 1.0, rtol=1e-6)
        deq = np.asarray(pages[p, slot], np.float32) * step[:, None]
        assert (np.abs(deq - x[lo + t]) <= step[:, None] / 2 * (1 + 1e-5)).all()


def test_float8_cache_round_trip():
  rng = np.random.default_rng(15)
  c = _create(dtype=jnp.float8_e4m3fn)
  history = {}
  c = _step(c, rng, [3, 2, 6, 1], history)
  for s in range(4):
    k, v = _gather(c, s)
    ek, ev = _expected(history, s)
    for got, want in ((k, ek), (v, ev)):
      bound = np.abs(want).max(-1, keepdims=True) / 448
      assert (np.abs(got - want) <= (np.abs(want) * 2.0**-4 + bound * 2.0**-9) * (1 + 1e-5)).all()


# -- under jit -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, jnp.int8])
def test_cache_through_jit_and_scan(dtype):
  rng = np.random.default_rng(16)
  c = _create(dtype=dtype)
  leaves = jax.tree.leaves(c)
  assert len(leaves) == (8 if dtype == jnp.int8 else 6)  # pages, table, lens, refs, overflowed (+ 2 scales)
  k, v, cu, n, _ = _batch(rng, [2, 3, 1, 4])

  @jax.jit
  def serve(cache, k, v, cu, n):
    cache = cache.append(k, v, cu, n)
    cache = _free(cache, jnp.asarray([False, False, True, False]))
    return cache, cache.utilization()

  got, util = serve(c, k, v, cu, n)
  # The same through a jitted append then a jitted free (cache in and out of each jit).
  want = _free(_append(c, k, v, cu, n), jnp.asarray([False, False, True, False]))
  assert isinstance(got, fr.PagedKVCache) and got.k_pages.dtype == dtype
  jax.tree.map(np.testing.assert_array_equal, got, want)
  assert float(util) == pytest.approx((2 + 3 + 4) / (3 * 4))

  if dtype != F32:
    return
  # The cache as a scan carry: four single-token decode steps for every slot.
  steps = jnp.asarray(rng.normal(size=(4, 16, KH, HD)), F32)
  one = jnp.asarray([0, 1, 2, 3, 4], jnp.int32)

  def body(cache, x):
    return cache.append(x, x, one, jnp.asarray([4], jnp.int32)), None

  scanned, _ = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))(got, steps)
  np.testing.assert_array_equal(scanned.kv_lens, np.asarray(got.kv_lens) + 4)
  _check_invariants(scanned)


def test_eager_calls_compile_once_per_configuration():
  """An eager method runs as one compiled program (`paged/eager.py`): the same shapes with other values trace it
  once, a new geometry once more, and a call that breaks a contract still raises the method's own error (the
  plain op-by-op path) and leaves the cache as it was."""
  from flax_ringattn._src.paged import eager

  rng = np.random.default_rng(5)
  c = _create(num_pages=12)  # a geometry no other test uses: its first call traces
  before = eager.TRACES["PagedKVCache.append"]
  k, v, cu, n, _ = _batch(rng, [3, 5], max_num_seqs=4)
  c1 = c.append(k, v, cu, n)
  k2, v2, cu2, n2, _ = _batch(rng, [2, 1, 4], max_num_seqs=4)
  c2 = c1.append(k2, v2, cu2, n2)
  assert eager.TRACES["PagedKVCache.append"] == before + 1
  np.testing.assert_array_equal(c2.kv_lens, [5, 6, 4, 0])
  jitted = _append(c1, k2, v2, cu2, n2)  # the eager program's result is the jitted method's
  for name in ("k_pages", "v_pages", "page_indices", "kv_lens", "ref_counts"):
    np.testing.assert_array_equal(getattr(c2, name), getattr(jitted, name))
  c3 = _create(num_pages=24, page_size=2)
  c3.append(k, v, cu, n)
  assert eager.TRACES["PagedKVCache.append"] == before + 2
  # Python-int slots are traced, not baked in: other slots and lengths reuse the program.
  traces = eager.TRACES["PagedKVCache.share_prefix"]
  shared = c2.share_prefix(0, 3, 4).free(_slots(c2, 3)).share_prefix(1, 3, 2)
  assert eager.TRACES["PagedKVCache.share_prefix"] == traces + 1
  np.testing.assert_array_equal(shared.kv_lens, [5, 6, 4, 2])
  with pytest.raises(ValueError, match=re.escape("slot dst=1 must be empty, but it holds kv_lens[1]=6 tokens")):
    c2.share_prefix(0, 1, 4)
  with pytest.raises(ValueError, match=re.escape("cu_q_lens[0]=1 must be 0")):
    c2.append(k2, v2, cu2.at[0].set(1), n2)
  np.testing.assert_array_equal(c2.kv_lens, [5, 6, 4, 0])

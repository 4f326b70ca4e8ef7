"""`PagedKVCache` spread over a mesh axis (`create(mesh=, seq_axis=)`, n devices): page j of slot s on owner
(s + j) % n, each owner's share of a slot floor or ceil(pages / n), one-page slots spread over every owner,
admission and overflow per owner, copy-on-write, free and prefix sharing per owner, the arrays' placement under
jit, attention equal to a one-device cache, and one compile.  Helpers from `test_paged_cache.py` (K = 2 kv heads,
H = 4)."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.experimental import checkify
from test_paged_cache import HD, KH, _append, _assert_slot, _batch, _check_invariants, _expected, _free, _share
from tolerances import assert_close

import flax_ringattn as fr

F32 = jnp.float32
# 32 tokens a slot (16 pages of 2); 64 pages, so P/n = 8 pages a device on 8 devices.
SIZES = dict(num_pages=64, page_size=2, max_num_seqs=4, pages_per_seq=16)
T = 32  # max_num_batched_tokens of every step
N = 2 * KH  # q heads of the attention check (groups of 2)

_fits = jax.jit(fr.PagedKVCache.fits)
_needed_per_owner = jax.jit(fr.PagedKVCache.pages_needed_per_owner)
_free_per_owner = jax.jit(fr.PagedKVCache.num_free_pages_per_owner)


def _create(n, *, explicit=True, dtype=F32, **sizes):
  kw = dict(SIZES, num_kv_heads=KH, head_dim=HD, dtype=dtype) | sizes
  if n == 1:
    return fr.PagedKVCache.create(**kw)
  return fr.PagedKVCache.create(**kw, mesh=make_mesh((n,), ("sp",), explicit=explicit), seq_axis="sp")


def _step(cache, rng, lens, history):
  """Appends random tokens, lens[i] for slot i (jitted), and records them in `history` (slot -> [(k, v)])."""
  k, v, cu, n, per_slot = _batch(rng, lens, T, max_num_seqs=cache.max_num_seqs)
  cache = _append(cache, k, v, cu, n)
  for i, part in enumerate(per_slot):
    history.setdefault(i, []).append(part)
  return cache


def _schedule(rng, steps, capacity=32, slots=4):
  """Ragged batches: a prefill, a chunked prefill, decode steps, then random mixes of decode (1 token) and chunks
  (up to 9 tokens), idle slots included; no slot past `capacity` tokens, no step past T tokens."""
  plan = [[9, 13, 4, 0], [6, 0, 7, 11], [1, 1, 1, 1], [1, 1, 0, 1]]
  held = np.sum(plan, axis=0)
  while len(plan) < steps:
    lens = []
    for s in range(slots):
      room = min(capacity - held[s], T - sum(lens))
      kind = rng.integers(3)  # idle, decode, chunk
      lens.append(0 if kind == 0 or room <= 0 else 1 if kind == 1 else int(rng.integers(1, min(room, 9) + 1)))
    held += lens
    plan.append(lens)
  return plan


def _owner(cache, pages):
  return np.asarray(pages) // cache.pages_per_owner


def _assert_striped(cache, shared=None):
  """Page j of slot s sits on owner (s + j) % n, so each owner holds floor or ceil(its pages / n) of it.

  shared: {dst: (src, pages)} for a slot that started with `share_prefix(src, dst, ...)`: its first `pages`
  columns are src's pages, on owners (src + j) % n, and stay there (a copy-on-write copies a page within its
  owner); its later columns are its own, on (dst + j) % n, so only the slots not in `shared` are balanced."""
  n, shared = cache.num_shards, shared or {}
  table, lens = np.asarray(cache.page_indices), np.asarray(cache.kv_lens)
  for s in range(cache.max_num_seqs):
    m = -(-int(lens[s]) // cache.page_size)
    pages = table[s, :m]
    assert (pages >= 0).all(), (s, table[s])
    src, prefix = shared.get(s, (s, 0))
    j = np.arange(m)
    want = np.where(j < prefix, src + j, s + j) % n
    np.testing.assert_array_equal(_owner(cache, pages), want, err_msg=f"slot {s}: {pages}")
    if s not in shared:
      per_owner = np.bincount(_owner(cache, pages), minlength=n)
      assert set(per_owner.tolist()) <= {m // n, -(-m // n)}, (s, per_owner)


def _assert_free_per_owner(cache):
  """num_free_pages_per_owner() counts each owner's pages with no reference."""
  free = np.asarray(cache.ref_counts) == 0
  want = free.reshape(cache.num_shards, -1).sum(1)
  np.testing.assert_array_equal(_free_per_owner(cache), want)
  assert int(want.sum()) == int(free.sum())


def _full_spec(x, *entries):
  spec = tuple(x.sharding.spec)
  return spec + (None,) * (x.ndim - len(spec)) == tuple(entries) + (None,) * (x.ndim - len(entries))


def _assert_placed(cache, axis="sp"):
  """The pages, their scales and ref_counts sharded on the page dimension, device d of the axis holding the ids
  d * P/n .. (d + 1) * P/n - 1; the page table, lengths and flags replicated."""
  q = cache.pages_per_owner
  for name in ("k_pages", "v_pages", "k_scale", "v_scale", "ref_counts"):
    x = getattr(cache, name)
    if x is None:
      continue
    assert _full_spec(x, axis), (name, x.sharding)
    devices = list(x.sharding.mesh.devices.flat)
    assert len(x.addressable_shards) == cache.num_shards == len(devices)
    for shard in x.addressable_shards:
      lo = shard.index[0].start or 0
      assert shard.data.shape[0] == q and lo % q == 0 and shard.device == devices[lo // q], (name, shard)
  for name in ("page_indices", "kv_lens", "overflowed"):
    assert _full_spec(getattr(cache, name)), (name, getattr(cache, name).sharding)


def _host(x):
  return None if x is None else np.asarray(x)


@jax.jit
def _reference(q, k_pages, v_pages, kv_lens, table, cu, n, k_scale, v_scale):
  return fr.paged_reference_attention(q, k_pages, v_pages, kv_lens, table, cu, n, k_scale=k_scale, v_scale=v_scale)


def _attend(cache, q, cu, n, *, poison_free=False):
  """The reference's output for q over the cache as `attention_view()` shows it, the pages gathered to the host
  (the global arrays, as the unsharded oracle reads them).  poison_free: free pages hold NaN."""
  pages = [_host(cache.k_pages), _host(cache.v_pages)]
  if poison_free:  # float pages only
    free = np.asarray(cache.ref_counts) == 0
    pages = [np.where(free[:, None, None, None], np.nan, x) for x in pages]
  kv_lens, table = (np.asarray(x) for x in cache.attention_view())
  return np.asarray(_reference(q, *pages, kv_lens, table, cu, n, _host(cache.k_scale), _host(cache.v_scale)))


# -- balance ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pages_striped_over_owners(n):
  """Prefill, chunked prefill and decode steps of ragged batches: page j of slot s on owner (s + j) % n, every
  slot reads back exactly its tokens, ref counts and free pages agree per owner."""
  rng = np.random.default_rng(n)
  c = _create(n)
  assert c.num_shards == n and c.pages_per_owner == 64 // n
  history = {}
  for lens in _schedule(rng, 10):
    c = _step(c, rng, lens, history)
    _assert_striped(c)
    _assert_free_per_owner(c)
    for s in range(c.max_num_seqs):
      _assert_slot(c, s, history)
    _check_invariants(c)
  assert not np.asarray(c.overflowed).any()
  # Slots 0 and 1 span every owner (ceil(pages / n) of each at most on any device), starting from owners 0 and 1:
  # the stripe is rotated by the slot.
  pages = -(-np.asarray(c.kv_lens) // c.page_size)
  assert pages[:2].min() >= n
  owners = np.asarray(c.page_owner(c.page_indices))
  np.testing.assert_array_equal(owners[0, :n], np.arange(n))
  np.testing.assert_array_equal(owners[1, :n], (1 + np.arange(n)) % n)


# -- placement --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_arrays_stay_sharded_under_jit(explicit):
  """create places the arrays; jitted append, free, share_prefix and reserve_append, and an eager append, keep
  them there.  No collective of the compiled append moves a page: pages and scales are float, the only traffic is
  the allocator's integer / bool bookkeeping."""
  rng = np.random.default_rng(0)
  c = _create(4, explicit=explicit, dtype=jnp.int8)
  _assert_placed(c)
  k, v, cu, n, _ = _batch(rng, [7, 3, 12, 1], T, max_num_seqs=4)
  c = _append(c, k, v, cu, n)
  _assert_placed(c)
  c = _free(c, jnp.asarray([False, True, False, False]))
  _assert_placed(c)
  c = _share(c, 0, 1, 5)
  _assert_placed(c)
  reserved = jax.jit(lambda c, k, v, cu, n: c.reserve_append(k, v, cu, n)[0])(c, k, v, cu, n)
  _assert_placed(reserved)
  k, v, cu, n, _ = _batch(rng, [1, 2, 1, 1], T, max_num_seqs=4)
  _assert_placed(c.append(k, v, cu, n))  # eager, op by op
  _assert_striped(c, shared={1: (0, 3)})  # slot 1: slot 0's columns 0 .. 2 (5 tokens)

  hlo = _append.lower(c, k, v, cu, n).compile().as_text()
  collective = r"=\s*(.*?)\s(?:all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)(?:-start)?\("
  moved = [t for m in re.finditer(collective, hlo) for t in re.findall(r"(\w+)\[", m.group(1))]
  assert set(moved) <= {"s32", "u32", "pred"}, moved


# -- isolation ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [F32, jnp.int8])
@pytest.mark.parametrize("n", [2, 4, 8])
def test_attention_reads_the_same_as_one_device(n, dtype):
  """The same appends into a one-device cache and a spread one: the page ids differ, the reference attention of
  every step's tokens over `attention_view()` does not, even with NaN in every free page."""
  rng = np.random.default_rng(10 + n)
  one, spread = _create(1, dtype=dtype), _create(n, dtype=dtype)
  for lens in _schedule(rng, 6):
    k, v, cu, ns, _ = _batch(rng, lens, T, max_num_seqs=4)
    one, spread = _append(one, k, v, cu, ns), _append(spread, k, v, cu, ns)
    q = rng.normal(size=(T, N, HD)).astype(np.float32)
    want = _attend(one, q, cu, ns)
    np.testing.assert_array_equal(_attend(spread, q, cu, ns), want)
    if dtype == F32:
      np.testing.assert_array_equal(_attend(spread, q, cu, ns, poison_free=True), want)
  assert (np.asarray(one.page_indices) != np.asarray(spread.page_indices)).any()
  np.testing.assert_array_equal(one.kv_lens, spread.kv_lens)


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_sharded_op_reads_the_cache_in_place(explicit):
  """The cache's arrays feed `paged_attention(mesh=, seq_axis=)` as they are, append and attention in one jit
  (compiled once): the op's output equals the reference over the gathered arrays."""
  mesh = make_mesh((4,), ("sp",), explicit=explicit)
  kw = dict(SIZES, num_kv_heads=KH, head_dim=HD)
  c = fr.PagedKVCache.create(**kw, mesh=mesh, seq_axis="sp")

  @jax.jit
  def step(cache, q, k, v, cu, n):
    cache = cache.append(k, v, cu, n)
    kv_lens, table = cache.attention_view()
    out = fr.paged_attention(
      q, cache.k_pages, cache.v_pages, kv_lens, table, cu, n, mesh=mesh, seq_axis="sp", implementation="xla"
    )
    return cache, out

  rng = np.random.default_rng(60)
  for lens in _schedule(rng, 4):
    k, v, cu, n, _ = _batch(rng, lens, T, max_num_seqs=4)
    q = rng.normal(size=(T, N, HD)).astype(np.float32)
    c, out = step(c, q, k, v, cu, n)
    assert_close(out, _attend(c, q, cu, n), F32)
  assert step._cache_size() == 1
  _assert_placed(c)


# -- a full owner ---------------------------------------------------------------------------------------------


def _pages_outside(cache, pages):
  """The cache's page arrays and ref counts with the given page ids left out (for before/after comparisons)."""
  keep = np.ones(cache.num_pages, bool)
  keep[list(pages)] = False
  return [np.asarray(x)[keep] for x in (cache.k_pages, cache.v_pages, cache.ref_counts)]


def test_owner_0_full_refuses_while_others_have_room():
  """Owner 0 full (its 4 pages: one column of slots 0, 2, 6 and 7), owners 1 .. 3 with room: a slot whose page is
  on owner 0 is refused; a slot that needs owner 0 and owner 3 takes neither, so a later slot that needs only
  owners 1 .. 3 is served, with owner 3's last page."""
  rng = np.random.default_rng(20)
  c = _create(4, num_pages=16, max_num_seqs=8, pages_per_seq=4)  # 4 pages a device: owner d holds 4d .. 4d + 3
  history = {}
  # Slot 0: column 0 on owner 0; slots 2 and 6: columns 0 .. 2 on owners 2, 3, 0; slot 7: columns 0, 1 on owners
  # 3, 0.  Owners [4, 0, 2, 3] used.
  c = _step(c, rng, [2, 0, 6, 0, 0, 0, 6, 4], history)
  np.testing.assert_array_equal(_free_per_owner(c), [0, 4, 2, 1])
  assert int(c.num_free_pages()) == 7
  # Slot 3: columns 0, 1 on owners 3, 0; slot 4: column 0 on owner 0; slot 5: columns 0 .. 2 on owners 1, 2, 3.
  new = jnp.asarray([0, 0, 0, 3, 1, 6, 0, 0])
  np.testing.assert_array_equal(_fits(c, new), [True, True, True, False, False, True, True, True])
  np.testing.assert_array_equal(_needed_per_owner(c, new), [2, 1, 1, 2])  # [1, 0, 0, 1] + [1, 0, 0, 0] + [0, 1, 1, 1]

  k, v, cu, n, per_slot = _batch(rng, [0, 0, 0, 3, 1, 6], T, max_num_seqs=8)
  message = (
    "slot 3 needs 1 more pages on owner 0 (device 0 of the n=4 along seq_axis, page ids 0 .. 3; page j of slot s "
    "lives on device (s + j) % n) for 3 new tokens (it holds 0), but only 0 of that device's 4 pages are free"
  )
  with pytest.raises(fr.CacheOverflowError, match=re.escape(message)):
    c.append(k, v, cu, n)  # eager: concrete arrays raise

  before = c
  c = _append(c, k, v, cu, n)
  np.testing.assert_array_equal(c.overflowed, [False] * 3 + [True, True] + [False] * 3)
  np.testing.assert_array_equal(c.kv_lens, [2, 0, 6, 0, 0, 6, 6, 4])
  np.testing.assert_array_equal(_free_per_owner(c), [0, 3, 1, 0])  # slot 5 took one page of owners 1, 2, 3
  table, old = np.asarray(c.page_indices), np.asarray(before.page_indices)
  np.testing.assert_array_equal(np.delete(table, 5, axis=0), np.delete(old, 5, axis=0))  # refused rows stay -1
  new_pages = [int(p) for p in table[5, :3]]
  np.testing.assert_array_equal(_owner(c, new_pages), [1, 2, 3])
  for got, was in zip(_pages_outside(c, new_pages), _pages_outside(before, new_pages), strict=True):
    np.testing.assert_array_equal(got, was)
  history[5] = [per_slot[5]]
  for s in range(8):
    _assert_slot(c, s, history)
  _assert_striped(c)
  _check_invariants(c)


def test_owner_2_full_refuses_a_slot_that_needs_only_owner_2():
  """A slot whose next page is column 6 (slot 4: owner (4 + 6) % 4 = 2) is refused when the slots before it took
  owner 2's last pages, though owner 3 has room; the error names owner 2 and its page ids; the refused slot keeps
  its shared prefix and stores nothing, the slot after it is served, every other page is untouched.  Under
  checkify the same message."""
  rng = np.random.default_rng(21)
  c = _create(4, num_pages=20, max_num_seqs=8, pages_per_seq=8)  # 5 pages a device: owner 2 holds 10 .. 14
  history = {}
  # Slot 0: 6 pages on owners 0, 1, 2, 3, 0, 1; slot 1: 6 pages on 1, 2, 3, 0, 1, 2; slot 3: 3 pages on 3, 0, 1.
  # Owners [4, 5, 3, 3] used.
  c = _step(c, rng, [12, 12, 0, 6], history)
  # Slot 4: slot 0's six pages, no new page.  4 = 0 (mod n): the prefix's owners are those slot 4's own columns
  # would have.
  c = _share(c, 0, 4, 12)
  k0, v0 = _expected(history, 0)
  history[4] = [(k0, v0)]
  np.testing.assert_array_equal(_free_per_owner(c), [1, 0, 2, 2])
  # Slot 0: column 6 on owner 2; slot 1: column 6 on owner 3; slot 3: column 3 on owner 2, so owner 2 has none
  # left for slot 4's column 6; slot 7: column 0 on owner 3.
  lens = [2, 2, 0, 2, 2, 0, 0, 2]
  k, v, cu, n, per_slot = _batch(rng, lens, T, max_num_seqs=8)
  message = (
    "slot 4 needs 1 more pages on owner 2 (device 2 of the n=4 along seq_axis, page ids 10 .. 14; page j of slot s "
    "lives on device (s + j) % n) for 2 new tokens (it holds 12), but only 0 of that device's 5 pages are free "
    "after the slots before it"
  )
  with pytest.raises(fr.CacheOverflowError, match=re.escape(message)):
    c.append(k, v, cu, n)
  checked = jax.jit(checkify.checkify(lambda c, k, v, cu, n: c.append(k, v, cu, n, checked=True)))
  err, _ = checked(c, k, v, cu, n)
  assert err.get() is not None and message in err.get(), err.get()

  before = c
  c = _append(c, k, v, cu, n)
  np.testing.assert_array_equal(c.overflowed, [False] * 4 + [True] + [False] * 3)
  np.testing.assert_array_equal(c.kv_lens, [14, 14, 0, 8, 12, 0, 0, 2])
  np.testing.assert_array_equal(_free_per_owner(c), [1, 0, 0, 0])
  table, old = np.asarray(c.page_indices), np.asarray(before.page_indices)
  np.testing.assert_array_equal(table[4], old[4])
  new_pages = [int(table[0, 6]), int(table[1, 6]), int(table[3, 3]), int(table[7, 0])]
  np.testing.assert_array_equal(_owner(c, new_pages), [2, 3, 2, 3])
  for got, was in zip(_pages_outside(c, new_pages), _pages_outside(before, new_pages), strict=True):
    np.testing.assert_array_equal(got, was)
  for s in (0, 1, 3, 7):
    history.setdefault(s, []).append(per_slot[s])
  for s in range(8):
    _assert_slot(c, s, history)
  _assert_striped(c)
  _check_invariants(c)
  # Slots 0 and 4 freed: slot 0's seven pages (owners 0, 1, 2, 3, 0, 1, 2) go back; slot 1 (7 pages on owners 1,
  # 2, 3, 0, 1, 2, 3), slot 3 (4 pages on 3, 0, 1, 2) and slot 7 (1 page on 3) leave owners [3, 2, 2, 1] free.
  c = _free(c, jnp.asarray([True, False, False, False, True, False, False, False]))
  np.testing.assert_array_equal(_free_per_owner(c), [3, 2, 2, 1])
  _check_invariants(c)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_one_page_slots_spread_over_every_owner(n):
  """As many one-page slots as pages (2n of each, 2 pages a device): slot s's page is on owner s % n, so every n
  slots take one page of each owner and the batch fills the cache with no slot refused.  Unrotated (page j of
  every slot on owner j % n), every first page would be on owner 0, which would refuse all but P/n = 2 slots."""
  rng = np.random.default_rng(70 + n)
  c = _create(n, num_pages=2 * n, max_num_seqs=2 * n, pages_per_seq=4)
  lens = [1 + s % 2 for s in range(2 * n)]  # 1 or 2 tokens: one page each
  np.testing.assert_array_equal(_fits(c, jnp.asarray(lens)), [True] * (2 * n))
  np.testing.assert_array_equal(_needed_per_owner(c, jnp.asarray(lens)), [2] * n)
  history = {}
  c = _step(c, rng, lens, history)
  assert not np.asarray(c.overflowed).any()
  np.testing.assert_array_equal(c.kv_lens, lens)
  owners = np.asarray(c.page_owner(c.page_indices))[:, 0]
  np.testing.assert_array_equal(owners.reshape(2, n), [np.arange(n), np.arange(n)])  # slots 0 .. n-1, n .. 2n-1
  np.testing.assert_array_equal(_free_per_owner(c), [0] * n)
  assert int(c.num_free_pages()) == 0
  for s in range(2 * n):
    _assert_slot(c, s, history)
  _assert_striped(c)
  _check_invariants(c)
  # Full: slot 0's next token fits in its page (1 of 2 tokens); slot 1's needs column 1 (owner 2 % n), none free.
  np.testing.assert_array_equal(_fits(c, jnp.asarray([1, 1] + [0] * (2 * n - 2))), [True, False] + [True] * (2 * n - 2))


# -- copy-on-write, free, prefix sharing -------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
def test_copy_on_write_free_and_share_prefix_per_owner(n):
  """Slots 1 and 2 share slot 0's prefix, whose column j is on owner (0 + j) % n (for slot 1 not its own
  (1 + j) % n): a copy-on-write of the shared partial page stays on the original's owner, their new columns go
  on their own; free returns each page to its owner."""
  rng = np.random.default_rng(30 + n)
  c = _create(n)
  history = {}
  c = _step(c, rng, [11, 0, 0, 0], history)  # slot 0: columns 0 .. 5, column 5 partial (1 of 2)
  src = np.asarray(c.page_indices)[0, :6]
  c = _share(c, 0, 1, 11)
  np.testing.assert_array_equal(np.asarray(c.page_indices)[1, :6], src)  # same ids, so the same owners
  np.testing.assert_array_equal(np.asarray(c.ref_counts)[src], 2)
  k0, v0 = _expected(history, 0)
  history[1] = [(k0, v0)]
  _assert_striped(c, shared={1: (0, 6)})

  # Slot 1 writes into the shared partial page (column 5): a private copy on the original's owner 5 % n (a copy
  # never crosses devices), not on (1 + 5) % n; the original untouched.
  original = int(src[5])
  kept = [np.asarray(x)[original] for x in (c.k_pages, c.v_pages)]
  free_before = np.asarray(_free_per_owner(c))
  c = _step(c, rng, [0, 3, 0, 0], history)  # copy of column 5, and column 6 (slot 1's own: owner (1 + 6) % n)
  table = np.asarray(c.page_indices)
  copy = int(table[1, 5])
  assert copy != original and _owner(c, copy) == 5 % n == _owner(c, original)
  assert int(table[0, 5]) == original and int(np.asarray(c.ref_counts)[original]) == 1
  for x, was in zip((c.k_pages, c.v_pages), kept, strict=True):
    np.testing.assert_array_equal(np.asarray(x)[original], was)
  used = free_before - np.asarray(_free_per_owner(c))
  np.testing.assert_array_equal(used, np.bincount([5 % n, 7 % n], minlength=n))
  assert _owner(c, table[1, 6]) == 7 % n
  for s in (0, 1):
    _assert_slot(c, s, history)
  _assert_striped(c, shared={1: (0, 6)})
  _check_invariants(c)

  # Both sharers of a partial page write in the same step: two copies on its owner 5 % n, slot 2's too (for n = 4
  # not on its own (2 + 5) % n); the original, released, is zeroed (it rejoins its owner's free list, so that
  # owner has one page fewer free, not two).
  shared = int(np.asarray(c.page_indices)[0, 5])
  c = _share(c, 0, 2, 11)  # slot 2: slot 0's columns 0 .. 5, column 5 partial and now shared again
  history[2] = [(k0, v0)]
  free_before = np.asarray(_free_per_owner(c))
  c = _step(c, rng, [1, 0, 1, 0], history)
  table = np.asarray(c.page_indices)
  copies = [int(table[0, 5]), int(table[2, 5])]
  assert shared not in copies and copies[0] != copies[1]
  np.testing.assert_array_equal(_owner(c, copies), [5 % n, 5 % n])
  assert int(np.asarray(c.ref_counts)[shared]) == 0
  assert not np.asarray(c.k_pages)[shared].any() and not np.asarray(c.v_pages)[shared].any()
  np.testing.assert_array_equal(free_before - np.asarray(_free_per_owner(c)), np.eye(n, dtype=int)[5 % n])
  for s in (0, 1, 2):
    _assert_slot(c, s, history)
  _assert_striped(c, shared={1: (0, 6), 2: (0, 6)})
  _check_invariants(c)

  # free zeroes what nobody references and returns it to its owner's pool.
  free_before = np.asarray(_free_per_owner(c))
  held = {int(p) for p in table[1] if p >= 0} - {int(p) for p in table[[0, 2]].ravel() if p >= 0}
  assert len(held) == 2  # slot 1's copy of column 5 (owner 5 % n) and its column 6 (owner 7 % n)
  c = _free(c, jnp.asarray([False, True, False, False]))
  np.testing.assert_array_equal(np.asarray(c.ref_counts)[sorted(held)], 0)
  assert not np.asarray(c.k_pages)[sorted(held)].any() and not np.asarray(c.v_pages)[sorted(held)].any()
  np.testing.assert_array_equal(np.asarray(_free_per_owner(c)) - free_before, np.bincount([5 % n, 7 % n], minlength=n))
  for s in (0, 2):
    _assert_slot(c, s, history)
  _check_invariants(c)
  c = _free(c, jnp.asarray([True] * 4))
  np.testing.assert_array_equal(_free_per_owner(c), [c.pages_per_owner] * n)
  assert not np.asarray(c.k_pages).any()
  _check_invariants(c)


# -- one compile ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_one_compile_across_changing_batches(explicit):
  """12 batch compositions (prefill, chunks, decode, idle slots, fewer live slots), with frees and prefix shares
  between them, through one jitted append on 4 devices: one trace, one compile."""
  rng = np.random.default_rng(40)
  traces = []

  @jax.jit
  def step(cache, k, v, cu, n):
    traces.append(1)
    return cache.append(k, v, cu, n)

  c = _create(4, explicit=explicit)
  history = {}
  plan = _schedule(rng, 12, capacity=20)
  for i, lens in enumerate(plan):
    live = 4 if i % 3 else 2 + i % 2  # num_seqs changes too
    lens = lens[:live]
    k, v, cu, n, per_slot = _batch(rng, lens, T, max_num_seqs=4)
    c = step(c, k, v, cu, n)
    for s, part in enumerate(per_slot):
      history.setdefault(s, []).append(part)
    if i == 5:
      c = _free(c, jnp.asarray([False, False, True, False]))
      history[2] = []
    if i == 6:
      c = _share(c, 0, 2, 7)
      k0, v0 = _expected(history, 0)
      history[2] = [(k0[:7], v0[:7])]
  assert len(traces) == 1 and step._cache_size() == 1
  for s in range(4):
    _assert_slot(c, s, history)
  _assert_striped(c, shared={2: (0, 4)})  # slot 2: slot 0's columns 0 .. 3 (7 tokens)
  _check_invariants(c)
  _assert_placed(c)


# -- create -----------------------------------------------------------------------------------------------------


def test_n1_is_the_unsharded_cache():
  """No mesh: n = 1, one owner, the structure of before (num_shards is static, not a leaf)."""
  c = _create(1)
  assert c.num_shards == 1 and c.pages_per_owner == c.num_pages
  assert len(jax.tree.leaves(c)) == 6
  np.testing.assert_array_equal(_free_per_owner(c), [c.num_pages])
  spread = _create(2)
  assert jax.tree.structure(spread) != jax.tree.structure(c)  # a jit keyed on n


def test_tuple_seq_axis_and_default_axis():
  """seq_axis over two mesh axes: n is their product, device (a, b) is owner a * 2 + b; without seq_axis a
  one-axis mesh is spread over its axis."""
  mesh = make_mesh((2, 2), ("a", "b"))
  kw = dict(SIZES, num_kv_heads=KH, head_dim=HD)
  c = fr.PagedKVCache.create(**kw, mesh=mesh, seq_axis=("a", "b"))
  assert c.num_shards == 4
  _assert_placed(c, axis=("a", "b"))
  devices = mesh.devices  # [2, 2]
  for shard in c.k_pages.addressable_shards:
    d = (shard.index[0].start or 0) // c.pages_per_owner
    assert shard.device == devices[d // 2, d % 2]
  history = {}
  c = _step(c, np.random.default_rng(50), [9, 3, 0, 12], history)
  _assert_striped(c)
  _assert_placed(c, axis=("a", "b"))
  for s in range(4):
    _assert_slot(c, s, history)
  assert fr.PagedKVCache.create(**kw, mesh=mesh, seq_axis=["b"]).num_shards == 2
  assert fr.PagedKVCache.create(**kw, mesh=make_mesh((4,), ("sp",))).num_shards == 4


@pytest.mark.parametrize(
  "bad, match",
  [
    (dict(num_pages=30), r"num_pages=30 must be a multiple of the 4 devices along seq_axis='sp'"),
    (dict(seq_axis="tp"), r"PagedKVCache.create: seq_axis='tp' is not an axis of the mesh \(mesh axes: \('sp',\)\)"),
    (dict(seq_axis=("sp", "tp")), r"seq_axis=\('sp', 'tp'\) names 'tp', which is not an axis of the mesh"),
    (dict(mesh=None), r"PagedKVCache.create: seq_axis='sp' needs mesh=\.\.\."),
    (dict(mesh="two_axes", seq_axis=None), r"mesh has axes \('sp', 'tp'\): pass seq_axis=\.\.\."),
  ],
)
def test_create_rejects_bad_placement(bad, match):
  kw = dict(SIZES, num_kv_heads=KH, head_dim=HD, mesh=make_mesh((4,), ("sp",)), seq_axis="sp") | bad
  if isinstance(kw["mesh"], str):
    kw["mesh"] = make_mesh((2, 2), ("sp", "tp"))
  with pytest.raises(ValueError, match=match):
    fr.PagedKVCache.create(**kw)


def test_replace_keeps_num_shards():
  c = _create(4)
  assert dataclasses.replace(c, overflowed=None).num_shards == 4
  assert _free(c, jnp.zeros((4,), bool)).num_shards == 4


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
def test_create_under_jit_keeps_the_spread(explicit):
  """`create` traced inside a jit places its arrays as the eager call does (`device=` alone places nothing
  under a trace): the pages come out split over the axis, not on one device."""
  mesh = make_mesh((4,), ("sp",), explicit=explicit)
  dims = dict(num_pages=16, page_size=4, max_num_seqs=2, pages_per_seq=4, num_kv_heads=2, head_dim=8)
  cache = jax.jit(lambda: fr.PagedKVCache.create(**dims, mesh=mesh, seq_axis="sp"))()
  assert cache.num_shards == 4
  _assert_placed(cache)

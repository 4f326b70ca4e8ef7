"""`PagedKVCache.rollback`: the last tokens of each slot taken back out, as speculative decoding needs."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh

import flax_ringattn as fr

GEOM = dict(num_pages=8, page_size=4, max_num_seqs=3, pages_per_seq=4, num_kv_heads=2, head_dim=8)


def _append(cache, lens, seed=0):
  """Appends lens[s] tokens to each slot (random K/V), one ragged batch."""
  k = jax.random.normal(jax.random.key(seed), (max(sum(lens), 1), 2, 8))
  cu = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
  return cache.append(k, -k, cu, np.array([len(lens)], np.int32))


def _fields(cache):
  return [cache.k_pages, cache.v_pages, cache.page_indices, cache.kv_lens, cache.ref_counts, cache.k_scale]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_rollback_equals_never_having_the_tokens(dtype):
  base = _append(fr.PagedKVCache.create(**GEOM, dtype=dtype), [3, 6, 5])
  # The same first writes, then 7, 2 and 4 more tokens, of which the last 6, 2 and 1 are taken back.
  k = jax.random.normal(jax.random.key(1), (13, 2, 8))
  full = base.append(k, -k, np.array([0, 7, 9, 13], np.int32), np.array([3], np.int32))
  kept = jnp.concatenate([k[:1], k[7:7], k[9:12]])
  want = base.append(kept, -kept, np.array([0, 1, 1, 4], np.int32), np.array([3], np.int32))
  got = full.rollback(np.array([6, 2, 1], np.int32))
  chex.assert_trees_all_equal(_fields(got), _fields(want))
  assert int(got.num_free_pages()) == int(want.num_free_pages())


def test_rollback_leaves_a_shared_page_to_its_other_reader():
  cache = _append(fr.PagedKVCache.create(**GEOM), [6, 0, 0])
  cache = cache.share_prefix(0, 1, 6)  # slot 1 reads slot 0's two pages, the second partly filled
  before = np.asarray(cache.k_pages)
  got = cache.rollback(np.array([0, 3, 0], np.int32))
  assert list(np.asarray(got.kv_lens)) == [6, 3, 0]
  assert list(np.asarray(got.page_indices[1])) == [int(cache.page_indices[0, 0]), -1, -1, -1]
  np.testing.assert_array_equal(np.asarray(got.k_pages), before)  # slot 0's data untouched
  first, second = (int(cache.page_indices[0, c]) for c in (0, 1))
  assert int(got.ref_counts[first]) == 2 and int(got.ref_counts[second]) == 1  # its reference let go
  got = got.rollback(np.array([6, 0, 0], np.int32))  # slot 0 lets go too: its second page is free and zero
  page = int(cache.page_indices[0, 1])
  assert int(got.ref_counts[page]) == 0 and not np.asarray(got.k_pages[page]).any()


def test_bad_counts_raise_eagerly_and_change_nothing_under_jit():
  cache = _append(fr.PagedKVCache.create(**GEOM), [3, 2, 0])
  with pytest.raises(ValueError, match=r"num_tokens\[1\]=3 is more than slot 1 holds \(kv_lens\[1\]=2\)"):
    cache.rollback(np.array([0, 3, 0], np.int32))
  with pytest.raises(ValueError, match=r"num_tokens\[0\]=-1 must be >= 0"):
    cache.rollback(np.array([-1, 0, 0], np.int32))
  got = jax.jit(lambda c, n: c.rollback(n))(cache, np.array([1, 5, 0], np.int32))
  assert list(np.asarray(got.kv_lens)) == [2, 2, 0]


def test_spread_cache_rolls_back_as_one_device():
  mesh = make_mesh((2,), ("sp",))
  lens, drop = [7, 5, 2], np.array([4, 1, 2], np.int32)
  one = _append(fr.PagedKVCache.create(**GEOM), lens).rollback(drop)
  spread = _append(fr.PagedKVCache.create(**GEOM, mesh=mesh, seq_axis="sp"), lens).rollback(drop)
  assert list(np.asarray(spread.kv_lens)) == list(np.asarray(one.kv_lens)) == [3, 4, 0]
  # Same tokens kept, wherever their pages are: read each slot's kept K back in order.
  for c in (one, spread):
    assert int(c.num_free_pages()) == GEOM["num_pages"] - 2

  def tokens(c, s):
    pages, table = np.asarray(c.k_pages), np.asarray(c.page_indices)
    rows = [pages[table[s, p // 4], p % 4] for p in range(int(c.kv_lens[s]))]
    return np.stack(rows) if rows else np.zeros((0, 2, 8))

  for s in range(3):
    np.testing.assert_array_equal(tokens(spread, s), tokens(one, s))

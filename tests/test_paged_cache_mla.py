"""`PagedKVCache` with v pages of their own head dim (MLA: Hv != H): create, append, decode, prefix sharing with
copy-on-write, free, int8, and the shape checks of a write.  Helpers from `test_paged_cache.py` (H = 4 there);
v's head dim here is 3."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from test_paged_cache import (
  KH,
  _append,
  _assert_slot,
  _batch,
  _check_invariants,
  _create,
  _expected,
  _free,
  _share,
  _step,
)
from tolerances import assert_close

import flax_ringattn as fr

HV = 3
N = 2 * KH  # q heads of the decode check (groups of 2)


def test_create_with_v_head_dim():
  c = _create(v_head_dim=HV)
  assert c.k_pages.shape == (16, 4, KH, 4) and c.v_pages.shape == (16, 4, KH, HV)
  assert (c.head_dim, c.v_head_dim, c.num_kv_heads) == (4, HV, KH)
  same = _create()
  assert same.v_pages.shape == same.k_pages.shape and same.v_head_dim == same.head_dim == 4
  int8 = _create(dtype=jnp.int8, v_head_dim=HV)  # one scale per token and kv head, whatever the head dims
  assert int8.k_scale.shape == int8.v_scale.shape == (16, 4, KH)


@pytest.mark.parametrize("bad", [0, -2, 2.0, True])
def test_create_rejects_a_bad_v_head_dim(bad):
  with pytest.raises(ValueError, match=rf"v_head_dim must be a positive int, got v_head_dim={bad!r}"):
    _create(v_head_dim=bad)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.int8])
def test_prefill_then_decode_reads_each_slot_and_attends(dtype):
  """Prefill chunks then one token per step, in three slots: each slot reads back its own k (H) and v (Hv), and
  attention of each step's new tokens over the cache (with sinks) equals dense attention over the history."""
  rng = np.random.default_rng(0)
  c = _create(dtype=dtype, v_head_dim=HV)
  history = {}
  sinks = jnp.asarray([0.5, -1.0, 2.0, 0.0])
  for lens in ([6, 3, 1], [1, 1, 1], [0, 1, 2], [1, 1, 1]):
    k, v, cu, n, per_slot = _batch(rng, lens, max_num_seqs=c.max_num_seqs, v_dim=HV)
    c = _append(c, k, v, cu, n)
    for i, part in enumerate(per_slot):
      history.setdefault(i, []).append(part)
    for s in range(3):
      _assert_slot(c, s, history)
    _check_invariants(c)
    if dtype != jnp.float32:
      continue
    q = jnp.asarray(rng.normal(size=(16, N, 4)), jnp.float32)
    got = fr.paged_attention(q, c.k_pages, c.v_pages, c.kv_lens, c.page_indices, cu, n, sinks=sinks)
    assert got.shape == (16, N, HV)
    for s, length in enumerate(lens):
      hk, hv = (jnp.asarray(x)[None] for x in _expected(history, s, HV))
      L = hk.shape[1]
      rows = slice(int(cu[s]), int(cu[s + 1]))
      want = fr.reference_attention(
        q[None, rows], hk, hv, is_causal=True, sinks=sinks, q_positions=jnp.arange(L - length, L)
      )
      assert_close(got[rows], want[0], jnp.float32)


def test_shared_prefix_copy_on_write_copies_v_pages_of_their_own_dim():
  rng = np.random.default_rng(1)
  c = _create(v_head_dim=HV)
  history = {}
  c = _step(c, rng, [6, 0, 0], history)  # slot 0: a full page and a partial one (2 of 4)
  src = np.asarray(c.page_indices)[0, :2]
  c = _share(c, 0, 1, 5)
  k0, v0 = _expected(history, 0, HV)
  history[1] = [(k0[:5], v0[:5])]
  _assert_slot(c, 1, history)
  c = _step(c, rng, [0, 3, 0], history)  # slot 1 writes into the shared partial page: it copies it first
  table = np.asarray(c.page_indices)
  assert table[1, 0] == src[0] and table[1, 1] not in src
  for s in (0, 1):
    _assert_slot(c, s, history)  # slot 0 still reads its own token 5, k and v
  _check_invariants(c)
  c = _free(c, jnp.asarray([True, False, False, False]))  # slot 0's private page is zeroed, the shared one kept
  history.pop(0)
  _assert_slot(c, 1, history)
  _check_invariants(c)


@pytest.mark.parametrize(
  "k_shape,v_shape,match",
  [
    ((16, KH, 4), (16, KH, 4), r"v must be \[T, K, Hv\] = \[T, 2, 3\] .* got v.shape=\(16, 2, 4\)"),
    ((16, KH, HV), (16, KH, HV), r"k must be \[T, K, H\] = \[T, 2, 4\] .* got k.shape=\(16, 2, 3\)"),
    ((16, 1, 4), (16, 1, HV), r"k must be .*num_kv_heads=2, head_dim=4, v_head_dim=3\), got k.shape=\(16, 1, 4\)"),
    ((16, KH, 4), (8, KH, HV), r"k and v must have the same T"),
  ],
)
def test_append_checks_the_new_tokens_shapes(k_shape, v_shape, match):
  c = _create(v_head_dim=HV)
  cu, n = jnp.asarray([0, 2, 2, 2, 2], jnp.int32), jnp.asarray([1], jnp.int32)
  for method in (c.append, c.reserve_append):
    with pytest.raises(ValueError, match=match):
      method(jnp.zeros(k_shape), jnp.zeros(v_shape), cu, n)

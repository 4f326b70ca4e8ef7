"""The paged API's argument contracts (issue 30): every refused call names the argument and its value, and leaves
the cache as it was; under jit a refused call changes nothing (no page leaks); empty inputs give empty outputs."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from jax.experimental import checkify
from paged_cases import make_batch
from tolerances import assert_close

import flax_ringattn as fr

F32 = jnp.float32
S = 3  # slots of the small cache
GEOM = dict(num_pages=8, page_size=4, max_num_seqs=S, pages_per_seq=4, num_kv_heads=1, head_dim=2)


def _assert_unchanged(before, after):
  """Every leaf of the cache pytree (and its structure) as it was."""
  assert jax.tree.structure(before) == jax.tree.structure(after)
  same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), before, after)
  assert all(jax.tree.leaves(same)), same


@jax.jit
def _append(cache, k, v, cu, n):
  return cache.append(k, v, cu, n)


@functools.cache
def _filled():
  """Slot 0 holds 5 tokens (2 pages), slot 1 3 tokens (1 page), slot 2 nothing: 5 of 8 pages free."""
  cache = fr.PagedKVCache.create(**GEOM)
  kv = jnp.asarray(np.random.default_rng(0).normal(size=(8, 1, 2)), F32)
  return _append(cache, kv, kv, jnp.asarray([0, 5, 8, 8], jnp.int32), jnp.asarray([2], jnp.int32))


def _raises(error, message, fn, cache):
  """fn(cache) raises `error` whose message contains `message`; the cache is unchanged."""
  before = jax.tree.map(np.asarray, cache)
  with pytest.raises(error, match=re.escape(message)):
    fn(cache)
  _assert_unchanged(before, cache)


# -- free ------------------------------------------------------------------------------------------------------

FREE_TYPES = {
  "int_array_meant_as_slot": (jnp.array([1]), "got slots=[1] of dtype int32"),
  "int_mask": (jnp.array([0, 2, 0]), "got slots=[0, 2, 0] of dtype int32"),
  "python_int": (1, "got slots=1"),
  "int_list": ([0, 1, 0], "got slots=[0, 1, 0] of dtype int"),
}


@pytest.mark.parametrize("case", list(FREE_TYPES))
def test_free_takes_a_bool_mask_only(case):
  slots, shown = FREE_TYPES[case]
  want = "PagedKVCache.free: slots must be a bool mask of shape [max_num_seqs]=(3,)"
  for message in (want, shown, "jnp.arange(3) == i"):
    _raises(TypeError, message, lambda c: c.free(slots), _filled())


def test_free_refuses_a_mask_of_the_wrong_length():
  message = "PagedKVCache.free: slots.shape=(2,) must be [max_num_seqs]=(3,), got slots=[True, False]"
  _raises(ValueError, message, lambda c: c.free(jnp.array([True, False])), _filled())


def test_free_checks_a_traced_mask_statically():
  free = jax.jit(fr.PagedKVCache.free)
  _raises(
    TypeError, "got slots=a traced array of shape (3,) of dtype int32", lambda c: free(c, jnp.arange(3)), _filled()
  )
  _raises(ValueError, "slots.shape=(4,) must be [max_num_seqs]=(3,)", lambda c: free(c, jnp.ones(4, bool)), _filled())


def test_free_of_a_bool_list_frees_those_slots():
  c = _filled().free([False, True, False])
  np.testing.assert_array_equal(c.kv_lens, [5, 0, 0])
  assert int(c.num_free_pages()) == 6


# -- share_prefix ----------------------------------------------------------------------------------------------

SHARE_REFUSED = {
  "dst_holds_pages": ((0, 1, 4), "slot dst=1 must be empty, but it holds kv_lens[1]=3 tokens and 1 page(s)"),
  "src_is_dst": ((0, 0, 4), "src=0 and dst=0 must be different slots"),
  "dst_past_the_slots": ((0, 5, 4), "dst=5 must be a slot in [0, max_num_seqs=3)"),
  "negative_src": ((-1, 2, 4), "src=-1 must be a slot in [0, max_num_seqs=3)"),
  "negative_num_tokens": ((0, 2, -1), "num_tokens=-1 must be >= 0"),
  "longer_than_src": ((0, 2, 6), "num_tokens=6 is more than slot src=0 holds (kv_lens[0]=5)"),
}


@pytest.mark.parametrize("case", list(SHARE_REFUSED))
def test_share_prefix_refusals_raise_eagerly(case):
  args, message = SHARE_REFUSED[case]
  _raises(ValueError, "PagedKVCache.share_prefix: " + message, lambda c: c.share_prefix(*args), _filled())


def test_share_prefix_into_an_overflowed_slot_raises():
  cache = jax.jit(lambda c: c.reserve(jnp.asarray([0, 0, 99], jnp.int32)))(_filled())  # slot 2 refused: flagged
  assert bool(cache.overflowed[2]) and int(cache.kv_lens[2]) == 0
  _raises(ValueError, "slot dst=2 is flagged overflowed", lambda c: c.share_prefix(0, 2, 4), cache)


def test_share_prefix_python_int_slots_are_checked_inside_jit():
  _raises(ValueError, "dst=5 must be a slot", lambda c: jax.jit(lambda c: c.share_prefix(0, 5, 4))(c), _filled())
  _raises(
    ValueError, "src=1 and dst=1 must be different", lambda c: jax.jit(lambda c: c.share_prefix(1, 1, 2))(c), _filled()
  )


def test_share_prefix_refused_under_jit_changes_nothing_and_leaks_nothing():
  """Traced slots and counts: each refused share is a no-op; after freeing every slot all pages are free."""
  share = jax.jit(fr.PagedKVCache.share_prefix)
  cache = _filled()
  for args, _ in SHARE_REFUSED.values():
    after = share(cache, *args)
    _assert_unchanged(cache, after)
    assert int(after.free(jnp.ones(S, bool)).num_free_pages()) == GEOM["num_pages"], args
  # A valid share still works under jit: slot 2 references slot 0's first page.
  after = share(cache, 0, 2, 4)
  np.testing.assert_array_equal(after.kv_lens, [5, 3, 4])
  assert (
    int(after.page_indices[2, 0]) == int(cache.page_indices[0, 0])
    and int(after.ref_counts[cache.page_indices[0, 0]]) == 2
  )
  assert int(after.free(jnp.ones(S, bool)).num_free_pages()) == GEOM["num_pages"]


def test_share_prefix_checked_reports_under_checkify():
  share = checkify.checkify(
    jax.jit(lambda c, s, d, n: c.share_prefix(s, d, n, checked=True)), errors=checkify.user_checks
  )
  for args, message in SHARE_REFUSED.values():
    err, _ = share(_filled(), *args)
    assert err.get() is not None and message in err.get(), (message, err.get())
  err, _ = share(_filled(), 0, 2, 4)
  assert err.get() is None


# -- reserve ---------------------------------------------------------------------------------------------------

RESERVE_REFUSED = {
  "negative": ([-3, 0, 0], ValueError, "PagedKVCache.reserve: new_lens[0]=-3 must be >= 0"),
  "negative_later": (jnp.asarray([0, 2, -1], jnp.int32), ValueError, "new_lens[2]=-1 must be >= 0"),
  "short": (jnp.zeros((2,), jnp.int32), ValueError, "new_lens.shape=(2,) must be [max_num_seqs]=(3,)"),
  "scalar": (
    3,
    TypeError,
    "new_lens must be an integer array of shape [max_num_seqs]=(3,) (new tokens per slot), got new_lens=3",
  ),
  "float": (jnp.ones((3,), F32), TypeError, "got new_lens=[1.0, 1.0, 1.0] of dtype float32"),
}


@pytest.mark.parametrize("case", list(RESERVE_REFUSED))
def test_reserve_refuses_bad_new_lens(case):
  lens, error, message = RESERVE_REFUSED[case]
  _raises(error, message, lambda c: c.reserve(lens), _filled())


def test_reserve_checked_reports_a_negative_count_under_checkify():
  reserve = checkify.checkify(jax.jit(lambda c, n: c.reserve(n, checked=True)), errors=checkify.user_checks)
  err, after = reserve(_filled(), jnp.asarray([0, -2, 0], jnp.int32))
  assert err.get() is not None and "new_lens[1]=-2 must be >= 0" in err.get(), err.get()


def test_reserve_twice_before_a_write_reuses_the_pages():
  """A second reserve counts the pages the first one gave (it used to replace them: they leaked)."""
  reserve = jax.jit(fr.PagedKVCache.reserve)
  cache = reserve(
    reserve(fr.PagedKVCache.create(**GEOM), jnp.asarray([1, 1, 1], jnp.int32)), jnp.asarray([0, 1, 5], jnp.int32)
  )
  table, refs = np.asarray(cache.page_indices), np.asarray(cache.ref_counts)
  np.testing.assert_array_equal((table >= 0).sum(1), [1, 1, 2])
  np.testing.assert_array_equal(np.bincount(table[table >= 0], minlength=GEOM["num_pages"]), refs)
  assert int(cache.pages_needed(jnp.asarray([4, 4, 8], jnp.int32))) == 0
  assert int(cache.free(jnp.ones(S, bool)).num_free_pages()) == GEOM["num_pages"]


# -- append / reserve_append: the op's metadata rules ---------------------------------------------------------

K8 = jnp.ones((8, 1, 2), F32)
APPEND_REFUSED = {
  "rows_before_the_first_sequence": (([2, 4, 4, 4], 3), "cu_q_lens[0]=2 must be 0"),
  "decreasing": (
    ([0, 3, 2, 2], 2),
    "cu_q_lens must be non-decreasing over its first num_seqs + 1 entries: cu_q_lens[1]=3 > cu_q_lens[2]=2",
  ),
  "num_seqs_past_the_slots": (([0, 4, 4, 4], 5), "num_seqs=5 must be in [0, max_num_seqs=3]"),
  "negative_num_seqs": (([0, 4, 4, 4], -1), "num_seqs=-1 must be in [0, max_num_seqs=3]"),
  "more_tokens_than_rows": (
    ([0, 5, 9, 9], 2),
    "the batch has 9 new tokens (cu_q_lens[num_seqs=2]), more than max_num_batched_tokens=8 (k.shape[0])",
  ),
}


@pytest.mark.parametrize("method", ["append", "reserve_append"])
@pytest.mark.parametrize("case", list(APPEND_REFUSED))
def test_append_applies_the_ops_metadata_rules(case, method):
  (cu, n), message = APPEND_REFUSED[case]
  cu, n = jnp.asarray(cu, jnp.int32), jnp.asarray([n], jnp.int32)
  call = lambda c: getattr(c, method)(K8, K8, cu, n)  # noqa: E731
  _raises(ValueError, f"PagedKVCache.{method}: {message}", call, _filled())


def test_append_and_the_op_share_one_check():
  """paged_attention refuses the same metadata with the same words (one check, two callers)."""
  cache = fr.PagedKVCache.create(**GEOM)
  cu, n = jnp.asarray([2, 4, 4, 4], jnp.int32), jnp.asarray([3], jnp.int32)
  q = jnp.ones((8, 1, 2), F32)
  with pytest.raises(ValueError, match=re.escape("paged_attention: cu_q_lens[0]=2 must be 0")):
    fr.paged_attention(q, cache.k_pages, cache.v_pages, cache.kv_lens, cache.page_indices, cu, n)


def test_append_checked_reports_under_checkify():
  append = checkify.checkify(
    jax.jit(lambda c, cu, n: c.append(K8, K8, cu, n, checked=True)), errors=checkify.user_checks
  )
  err, _ = append(_filled(), jnp.asarray([2, 4, 4, 4], jnp.int32), jnp.asarray([3], jnp.int32))
  assert err.get() is not None and "PagedKVCache.append: cu_q_lens[0]=2 must be 0" in err.get(), err.get()


def test_append_refuses_float_metadata():
  _raises(
    TypeError,
    "PagedKVCache.append: cu_q_lens must be an integer array, got cu_q_lens.dtype=float32",
    lambda c: c.append(K8, K8, jnp.zeros((4,), F32), jnp.asarray([0], jnp.int32)),
    _filled(),
  )


# -- create ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int16, jnp.uint8, jnp.bool_, jnp.complex64])
def test_create_refuses_dtypes_it_cannot_store(dtype):
  name = jnp.dtype(dtype).name
  with pytest.raises(
    TypeError, match=re.escape(f"PagedKVCache.create: dtype={name} cannot store keys and values")
  ) as e:
    fr.PagedKVCache.create(**GEOM, dtype=dtype)
  assert "float32, bfloat16" in str(e.value) and "'int8', 'float8_e4m3fn', 'float8_e5m2'" in str(e.value)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8, jnp.float8_e4m3fn])
def test_create_takes_float_and_quantized_dtypes(dtype):
  cache = fr.PagedKVCache.create(**GEOM, dtype=dtype)
  assert cache.k_pages.dtype == dtype and (cache.k_scale is not None) == (jnp.dtype(dtype).itemsize == 1)


# -- reserve_prefill / paged_ring_prefill / the layer's prefill: the slot --------------------------------------


@pytest.mark.parametrize("slot", [-1, 3, 10])
def test_reserve_prefill_refuses_a_slot_out_of_range(slot):
  message = f"PagedKVCache.reserve_prefill: slot={slot} must be a slot in [0, max_num_seqs=3)"
  _raises(ValueError, message, lambda c: c.reserve_prefill(slot, 4, padded_len=8), _filled())


def test_reserve_prefill_refuses_non_int_arguments():
  _raises(TypeError, "slot must be an int", lambda c: c.reserve_prefill(1.0, 4, padded_len=8), _filled())
  _raises(TypeError, "num_tokens must be an int", lambda c: c.reserve_prefill(2, 4.5, padded_len=8), _filled())
  _raises(
    ValueError,
    "num_tokens=1099511627776 does not fit int32",
    lambda c: c.reserve_prefill(2, 2**40, padded_len=8),
    _filled(),
  )
  _raises(
    ValueError,
    "slot 2 cannot take a ring prefill of num_tokens=-1",
    lambda c: c.reserve_prefill(2, -1, padded_len=8),
    _filled(),
  )


def test_reserve_prefill_traced_slot_out_of_range_changes_nothing():
  """slot=-1 must not wrap to the last slot: no pages, no length, no flag anywhere."""
  reserve = jax.jit(lambda c, s, n: c.reserve_prefill(s, n, padded_len=8))
  cache = _filled()
  for slot in (-1, 3):
    _assert_unchanged(cache, reserve(cache, slot, 4))
  err, _ = checkify.checkify(jax.jit(lambda c, s: c.reserve_prefill(s, 4, padded_len=8, checked=True)))(cache, -1)
  assert (
    err.get() is not None and "PagedKVCache.reserve_prefill: slot=-1 must be a slot in [0, max_num_seqs=3)" in err.get()
  )


def test_reserve_prefill_refuses_a_slot_with_pages_reserved_past_its_tokens():
  """Those pages would sit where the prompt's go, on the stripe's devices, not the ring prefill's."""
  cache = fr.PagedKVCache.create(**GEOM).reserve(jnp.asarray([0, 0, 2], jnp.int32))
  _raises(
    ValueError,
    "slot 2 cannot take a ring prefill of num_tokens=4 laid out as padded_len=8: it holds 0 tokens (1 pages)",
    lambda c: c.reserve_prefill(2, 4, padded_len=8),
    cache,
  )


@functools.cache
def _spread_cache():
  """Two devices; slot 1 holds a 16-token prompt in the ring prefill layout (the slot a wrapped -1 would hit)."""
  mesh = make_mesh((2,), ("sp",))
  geom = dict(GEOM, num_pages=16, max_num_seqs=2, pages_per_seq=8, head_dim=4)
  cache = fr.PagedKVCache.create(**geom, mesh=mesh, seq_axis="sp")
  return mesh, jax.jit(lambda c: c.reserve_prefill(1, 16, padded_len=16))(cache)


def test_paged_ring_prefill_refuses_a_slot_out_of_range():
  mesh, cache = _spread_cache()
  kv_lens, table = cache.attention_view()
  q = k = jnp.ones((16, 1, 4), F32)
  kw = dict(num_tokens=16, mesh=mesh, seq_axis="sp", implementation="xla")
  for slot in (-1, 2):
    with pytest.raises(
      ValueError, match=re.escape(f"paged_ring_prefill: slot={slot} must be a slot in [0, max_num_seqs=2)")
    ):
      fr.paged_ring_prefill(q, k, k, cache.k_pages, cache.v_pages, kv_lens, table, slot=slot, **kw)
  with pytest.raises(ValueError, match=re.escape("paged_ring_prefill: num_tokens=17 must be in [0, Tp=16]")):
    fr.paged_ring_prefill(q, k, k, cache.k_pages, cache.v_pages, kv_lens, table, slot=1, **{**kw, "num_tokens": 17})


def test_paged_ring_prefill_traced_slot_out_of_range_writes_nothing():
  """Under jit slot=-1 would wrap to slot 1 and overwrite its prompt: it stores nothing and returns zeros."""
  mesh, cache = _spread_cache()
  kv_lens, table = cache.attention_view()
  q = k = jnp.full((16, 1, 4), 3.0, F32)
  prefill = jax.jit(
    lambda kp, vp, slot: fr.paged_ring_prefill(
      q, k, k, kp, vp, kv_lens, table, slot=slot, num_tokens=16, mesh=mesh, seq_axis="sp", implementation="xla"
    )
  )
  out, k_pages, v_pages, _, _ = prefill(cache.k_pages, cache.v_pages, -1)
  np.testing.assert_array_equal(out, 0.0)
  np.testing.assert_array_equal(k_pages, cache.k_pages)
  np.testing.assert_array_equal(v_pages, cache.v_pages)


def test_layer_prefill_refuses_a_slot_out_of_range():
  mesh = make_mesh((2,), ("sp",))
  layer = fr.PagedMultiHeadAttention(2, 8, mesh=mesh, seq_axis="sp", rngs=nnx.Rngs(0))
  layer.init_cache(num_pages=16, page_size=4, max_num_seqs=3, pages_per_seq=4)
  before = jax.tree.map(np.asarray, layer.kv_cache.get_value())
  for slot in (-1, 10):
    message = f"PagedMultiHeadAttention.prefill: slot={slot} must be a slot in [0, max_num_seqs=3)"
    with pytest.raises(ValueError, match=re.escape(message)):
      layer.prefill(jnp.ones((16, 8), F32), slot=slot, num_tokens=16)
  _assert_unchanged(before, layer.kv_cache.get_value())


# -- the layer: atomic eager steps, free, empty steps, options checked at construction ------------------------

NUM_HEADS, FEATURES = 2, 8
LAYER_CACHE = dict(num_pages=8, page_size=4, max_num_seqs=S, pages_per_seq=4)


def _layer(**kw):
  layer = fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, rngs=nnx.Rngs(0), **kw)
  layer.init_cache(**LAYER_CACHE)
  return layer


def _x(T=8, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(T, FEATURES)), F32)


def test_layer_step_with_bad_metadata_leaves_the_cache_and_the_retry_matches_a_fresh_layer():
  layer = _layer()
  before = jax.tree.map(np.asarray, layer.kv_cache.get_value())
  bad = {
    "cu_q_lens[0]=2 must be 0": (jnp.asarray([2, 4, 4, 4], jnp.int32), jnp.asarray([3], jnp.int32)),
    "num_seqs=5 must be in [0, max_num_seqs=3]": (jnp.asarray([0, 3, 3, 3], jnp.int32), jnp.asarray([5], jnp.int32)),
  }
  for message, (cu, n) in bad.items():
    with pytest.raises(ValueError, match=re.escape(message)):
      layer(_x(), cu_q_lens=cu, num_seqs=n)
    _assert_unchanged(before, layer.kv_cache.get_value())
  cu, n = jnp.asarray([0, 3, 3, 3], jnp.int32), jnp.asarray([1], jnp.int32)
  step = nnx.jit(lambda m, x: m(x, cu_q_lens=cu, num_seqs=n))  # one compiled step for both: bitwise equal
  np.testing.assert_array_equal(step(layer, _x()), step(_layer(), _x()))
  np.testing.assert_array_equal(layer.kv_cache.get_value().kv_lens, [3, 0, 0])


def test_layer_step_that_overflows_leaves_the_cache():
  layer = _layer()
  before = jax.tree.map(np.asarray, layer.kv_cache.get_value())
  with pytest.raises(fr.CacheOverflowError, match="slot 0 cannot take 17 more tokens"):
    layer(_x(17), cu_q_lens=jnp.asarray([0, 17, 17, 17], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32))
  _assert_unchanged(before, layer.kv_cache.get_value())


def test_layer_free_takes_a_bool_mask_only():
  layer = _layer()
  layer(_x(), cu_q_lens=jnp.asarray([0, 3, 5, 5], jnp.int32), num_seqs=jnp.asarray([2], jnp.int32))
  before = jax.tree.map(np.asarray, layer.kv_cache.get_value())
  message = "PagedMultiHeadAttention.free: slots must be a bool mask of shape [max_num_seqs]=(3,) (True frees the slot), got slots=[1]"
  with pytest.raises(TypeError, match=re.escape(message)):
    layer.free(jnp.array([1]))
  with pytest.raises(ValueError, match=re.escape("PagedMultiHeadAttention.free: slots.shape=(1,) must be")):
    layer.free(jnp.array([True]))
  with pytest.raises(TypeError, match="got slots=a traced array"):
    nnx.jit(lambda m, s: m.free(s))(layer, jnp.array([0, 1, 0]))
  _assert_unchanged(before, layer.kv_cache.get_value())
  layer.free(jnp.arange(S) == 1)
  np.testing.assert_array_equal(layer.kv_cache.get_value().kv_lens, [3, 0, 0])


@pytest.mark.parametrize("jit", [False, True])
def test_layer_empty_step_returns_empty_and_leaves_the_cache(jit):
  layer = _layer(out_features=5)
  layer(_x(), cu_q_lens=jnp.asarray([0, 3, 5, 5], jnp.int32), num_seqs=jnp.asarray([2], jnp.int32))
  before = jax.tree.map(np.asarray, layer.kv_cache.get_value())
  step = (
    nnx.jit(lambda m, x, cu, n: m(x, cu_q_lens=cu, num_seqs=n))
    if jit
    else (lambda m, x, cu, n: m(x, cu_q_lens=cu, num_seqs=n))
  )
  y = step(layer, jnp.zeros((0, FEATURES), F32), jnp.zeros((S + 1,), jnp.int32), jnp.asarray([2], jnp.int32))
  assert y.shape == (0, 5) and y.dtype == F32
  _assert_unchanged(before, layer.kv_cache.get_value())
  if not jit:  # the empty step's metadata is still checked: one token for a step of none
    with pytest.raises(ValueError, match=re.escape("more than max_num_batched_tokens=0")):
      layer(
        jnp.zeros((0, FEATURES), F32),
        cu_q_lens=jnp.asarray([0, 1, 1, 1], jnp.int32),
        num_seqs=jnp.asarray([1], jnp.int32),
      )


def test_layer_checks_the_implementation_at_construction():
  cache = fr.PagedKVCache.create(**GEOM)
  with pytest.raises(ValueError) as op_error:
    q = jnp.ones((4, 1, 2), F32)
    fr.paged_attention(
      q,
      cache.k_pages,
      cache.v_pages,
      cache.kv_lens,
      cache.page_indices,
      jnp.zeros((4,), jnp.int32),
      jnp.zeros((1,), jnp.int32),
      implementation="bogus",
    )
  assert "unknown implementation='bogus'" in str(op_error.value)
  with pytest.raises(ValueError, match=re.escape(str(op_error.value))):
    fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, implementation="bogus", rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="implementation must be a string or None, got 3"):
    fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, implementation=3, rngs=nnx.Rngs(0))
  fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, implementation="xla", rngs=nnx.Rngs(0))


LAYER_OPTIONS = {
  "block_sizes_tuple": (
    dict(block_sizes=(16, 128)),
    TypeError,
    "block_sizes must be a flax_ringattn.BlockSizes, got tuple",
  ),
  "soft_cap_negative": (dict(logits_soft_cap=-1.0), ValueError, "logits_soft_cap must be > 0 and finite"),
  "soft_cap_string": (dict(logits_soft_cap="30"), TypeError, "logits_soft_cap must be a positive float, got '30'"),
  "window_negative": (dict(local_window_size=-1), ValueError, "local_window_size must be non-negative"),
  "window_string": (dict(local_window_size="8"), TypeError, "local_window_size must be an int or a (left, right) pair"),
}


@pytest.mark.parametrize("case", list(LAYER_OPTIONS))
def test_layer_checks_its_options_at_construction(case):
  kw, error, message = LAYER_OPTIONS[case]
  with pytest.raises(error, match=re.escape(message)):
    fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, rngs=nnx.Rngs(0), **kw)


# -- paged_attention: empty q, wide windows ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(0, 4, 16), (8, 0, 16)])
def test_paged_attention_of_an_empty_q_is_empty(shape):
  """Empty in, empty out, as jax.nn.dot_product_attention: [T, N, Hv] with T or N = 0, and zero gradients."""
  b = make_batch(np.random.default_rng(0), [(0, 5), (0, 9)], num_heads=4, num_kv_heads=2, v_head_dim=6)
  q = jnp.zeros(shape, F32)
  args = (b.kv_lens, b.page_indices, jnp.zeros_like(b.cu_q_lens), b.num_seqs)
  out = fr.paged_attention(q, b.k_pages, b.v_pages, *args)
  assert out.shape == (*shape[:2], 6) and out.dtype == F32
  grads = jax.grad(lambda q, kp, vp: jnp.sum(fr.paged_attention(q, kp, vp, *args)), argnums=(0, 1, 2))(
    q, b.k_pages, b.v_pages
  )
  for g, x in zip(grads, (q, b.k_pages, b.v_pages), strict=True):
    assert g.shape == x.shape and not np.asarray(g).any()


def test_paged_attention_empty_q_still_checks_the_call():
  b = make_batch(np.random.default_rng(0), [(0, 5)])
  q = jnp.zeros((0, *b.q.shape[1:]), F32)
  with pytest.raises(ValueError, match=re.escape("unknown implementation='bogus'")):
    fr.paged_attention(
      q, b.k_pages, b.v_pages, b.kv_lens, b.page_indices, b.cu_q_lens, b.num_seqs, implementation="bogus"
    )
  with pytest.raises(ValueError, match=re.escape("paged_attention: cu_q_lens[0]=1 must be 0")):
    fr.paged_attention(q, b.k_pages, b.v_pages, b.kv_lens, b.page_indices, b.cu_q_lens.at[0].set(1), b.num_seqs)


def test_paged_attention_windows_wider_than_any_sequence_never_overflow():
  """Each side is clamped (validation.MAX_WINDOW): a left side past every sequence is no window; the right side
  changes nothing (paged attention is causal), so (0, 2**31 - 1) is the diagonal (0, 0)."""
  b = make_batch(np.random.default_rng(3), [(3, 13), (2, 19), (1, 6)])
  run = lambda window: jax.jit(functools.partial(fr.paged_attention, local_window_size=window))(*b.args)  # noqa: E731
  full, diagonal = run(None), run((0, 0))
  for window, want in ((10**12, full), ((0, 2**31 - 1), diagonal)):
    got = run(window)
    assert np.isfinite(np.asarray(got)).all(), window
    assert_close({str(window): got}, {str(window): want}, F32)


@pytest.mark.parametrize(
  "kwargs, names",
  [
    (dict(num_heads=0, in_features=8), ("num_heads", "0")),
    (dict(num_heads=2, in_features=-1), ("in_features", "-1")),
    (dict(num_heads=4, in_features=8, num_kv_heads=3), ("num_kv_heads", "3")),
  ],
)
def test_layer_checks_its_sizes_at_construction(kwargs, names):
  with pytest.raises(ValueError) as info:
    fr.PagedMultiHeadAttention(**kwargs, rngs=nnx.Rngs(0))
  for name in ("PagedMultiHeadAttention", *names):
    assert name in str(info.value), str(info.value)


@pytest.mark.parametrize("H,Hv", [(0, 0), (4, 0)], ids=["head_dim", "v_head_dim"])
def test_paged_attention_refuses_empty_heads(H, Hv):
  """A head dim of 0 is refused by name (H = 0 used to fail with a ZeroDivisionError in the scale, Hv = 0 ran)."""
  q = jnp.zeros((4, 2, H), jnp.float32)
  k_pages, v_pages = jnp.zeros((4, 2, 1, H), jnp.float32), jnp.zeros((4, 2, 1, Hv), jnp.float32)
  lens, table = jnp.asarray([3], jnp.int32), jnp.asarray([[0, 1]], jnp.int32)
  cu, n = jnp.asarray([0, 3], jnp.int32), jnp.asarray([1], jnp.int32)
  for op in (fr.paged_attention, fr.paged_reference_attention):
    with pytest.raises(ValueError, match=re.escape(f"q.shape[2]={H} (head_dim) and v_pages.shape[3]={Hv}")):
      op(q, k_pages, v_pages, lens, table, cu, n)

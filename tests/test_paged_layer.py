"""`PagedMultiHeadAttention` serving ragged batches equals `nnx.MultiHeadAttention` on whole sequences."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from tolerances import assert_close

import flax_ringattn as fr

NUM_HEADS, NUM_KV, FEATURES, QKV = 8, 2, 32, 64
CACHE = dict(num_pages=32, page_size=4, max_num_seqs=4, pages_per_seq=4)  # up to 16 tokens per sequence
T = 8  # max_num_batched_tokens of every step
F32 = jnp.float32


def _mha(seed=0):
  return nnx.MultiHeadAttention(NUM_HEADS, FEATURES, QKV, num_kv_heads=NUM_KV, decode=False, rngs=nnx.Rngs(seed))


def _paged(seed=1, cache=True, **kw):
  layer = fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, QKV, num_kv_heads=NUM_KV, rngs=nnx.Rngs(seed), **kw)
  if cache:
    layer.init_cache(**CACHE)
  return layer


def _loaded(source, **kw):
  layer = _paged(**kw)
  nnx.update(layer, nnx.state(source, nnx.Param))
  return layer


@nnx.jit
def _step(layer, x, cu_q_lens, num_seqs):
  return layer(x, cu_q_lens=cu_q_lens, num_seqs=num_seqs)


@nnx.jit
def _free(layer, slots):
  layer.free(slots)


@nnx.jit
def _dense(mha, x):
  return mha(x, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))


def _inputs(lengths, seed=0):
  """[len(lengths), max(lengths), FEATURES]; sequence b uses the first lengths[b] rows."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.normal(size=(len(lengths), max(lengths), FEATURES)), F32)


def serve(layer, xs, lengths, chunk, start=None, slots=None, num_slots=CACHE["max_num_seqs"]):
  """Feeds sequence b (rows :lengths[b] of xs[b]) to slot slots[b], chunk(b, pos) tokens per step from step
  start[b] on, all sequences in one ragged batch per step; returns each sequence's outputs [lengths[b], F].

  Batches are assembled in numpy: only the jitted layer step runs in JAX."""
  B = len(lengths)
  xs = np.asarray(xs)
  start = [0] * B if start is None else start
  slots = list(range(B)) if slots is None else slots
  pos, outs, step = [0] * B, [[] for _ in range(B)], 0
  while any(p < n for p, n in zip(pos, lengths, strict=True)):
    take = [0] * num_slots
    for b in range(B):
      if step >= start[b] and pos[b] < lengths[b]:
        take[slots[b]] = min(chunk(b, pos[b]), lengths[b] - pos[b])
    assert sum(take) <= T
    cu = np.concatenate([[0], np.cumsum(take)]).astype(np.int32)
    x = np.full((T, FEATURES), 7.0, np.float32)  # padding rows hold garbage
    for b in range(B):
      x[cu[slots[b]] : cu[slots[b] + 1]] = xs[b, pos[b] : pos[b] + take[slots[b]]]
    y = np.asarray(_step(layer, jnp.asarray(x), jnp.asarray(cu), jnp.asarray([num_slots], jnp.int32)))
    for b in range(B):
      s = slots[b]
      outs[b].append(y[cu[s] : cu[s + 1]])
      pos[b] += take[s]
    step += 1
  return [np.concatenate(o) for o in outs]


def _assert_matches(outs, expected, lengths):
  expected = np.asarray(expected)
  for b, n in enumerate(lengths):
    assert outs[b].shape == (n, FEATURES)
    assert_close(outs[b], expected[b, :n], F32)


# -- equivalence with nnx.MultiHeadAttention ---------------------------------------------------


def test_decode_token_by_token():
  mha = _mha()
  lengths = [10, 10, 10]
  xs = _inputs(lengths)
  outs = serve(_loaded(mha), xs, lengths, chunk=lambda b, p: 1)
  _assert_matches(outs, _dense(mha, xs), lengths)


def test_prefill_chunk_then_decode():
  mha = _mha()
  lengths = [11, 9, 10]
  xs = _inputs(lengths, seed=1)
  first = [5, 2, 1]  # prompt chunks, then one token per step
  outs = serve(_loaded(mha), xs, lengths, chunk=lambda b, p: first[b] if p == 0 else 1)
  _assert_matches(outs, _dense(mha, xs), lengths)


def _ragged_plan():
  """Different lengths, chunk sizes and start steps: prefill, chunked prefill and decode mix in each step."""
  lengths = [13, 3, 7, 1]
  sizes = [3, 2, 2, 1]
  start = [0, 1, 0, 4]
  chunk = lambda b, p: sizes[b] if p < 6 else 1
  return lengths, chunk, start


def test_ragged_lengths_interleaved():
  mha = _mha()
  lengths, chunk, start = _ragged_plan()
  xs = _inputs(lengths, seed=2)
  outs = serve(_loaded(mha), xs, lengths, chunk, start)
  _assert_matches(outs, _dense(mha, xs), lengths)


def test_ragged_small_blocks_and_slot_order():
  """Sequences in permuted slots, with several q chunks and kv blocks per step."""
  mha = _mha(seed=3)
  lengths, chunk, start = _ragged_plan()
  xs = _inputs(lengths, seed=3)
  layer = _loaded(mha, block_sizes=fr.BlockSizes(block_q=2, block_kv=4))
  outs = serve(layer, xs, lengths, chunk, start, slots=[2, 0, 3, 1])
  _assert_matches(outs, _dense(mha, xs), lengths)


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_tensor_parallel_mesh(explicit):
  mesh = make_mesh((2,), ("tp",), explicit=explicit)
  mha = _mha(seed=4)
  layer = _loaded(mha, mesh=mesh, head_axis="tp")
  lengths, chunk, start = _ragged_plan()
  xs = _inputs(lengths, seed=4)
  outs = serve(layer, xs, lengths, chunk, start)
  _assert_matches(outs, _dense(mha, xs), lengths)
  k_pages = layer.kv_cache.get_value().k_pages
  assert k_pages.sharding.spec[2] == "tp"  # the kv heads of the pages stay sharded


@pytest.mark.parametrize("explicit", [False, True], ids=["auto", "explicit"])
def test_weights_from_ring_attention(explicit):
  """Parameters of a RingMultiHeadAttention that has run (so they live on its mesh) load with nnx.update."""
  mesh = make_mesh((2,), ("sp",), explicit=explicit)
  ring = fr.RingMultiHeadAttention(
    NUM_HEADS, FEATURES, QKV, num_kv_heads=NUM_KV, decode=False, rngs=nnx.Rngs(5), mesh=mesh
  )
  lengths = [8, 8]
  xs = _inputs(lengths, seed=5)
  expected = nnx.jit(lambda m, x: m(x, is_causal=True))(ring, xs)
  outs = serve(_loaded(ring), xs, lengths, chunk=lambda b, p: 3 if p == 0 else 1)
  _assert_matches(outs, expected, lengths)


def _ring_twin(seed, **options):
  """A one-device RingMultiHeadAttention with trained-looking sinks: the reference of the paged layer."""
  ring = fr.RingMultiHeadAttention(NUM_HEADS, FEATURES, QKV, num_kv_heads=NUM_KV, rngs=nnx.Rngs(seed), **options)
  if options.get("use_sinks"):
    ring.sinks.set_value(jnp.linspace(-1.5, 2.5, NUM_HEADS))
  return ring


@pytest.mark.parametrize("head_axis", [None, "tp"])
def test_sinks_and_v_head_dim_serve_like_ring_attention(head_axis):
  """Sinks and an MLA value head dim (Hv = 4, H = 8): v pages of Hv, ragged steps equal whole sequences through
  the ring layer with the same weights (on one device, or with the kv heads and sinks over a tensor axis)."""
  options = dict(use_sinks=True, v_head_dim=4)
  ring = _ring_twin(8, **options)
  mesh = make_mesh((2,), ("tp",)) if head_axis else None
  layer = _loaded(ring, mesh=mesh, head_axis=head_axis, **options)
  cache = layer.kv_cache.get_value()
  assert cache.k_pages.shape[3] == 8 and cache.v_pages.shape[3] == 4 and cache.v_head_dim == 4
  lengths, chunk, start = _ragged_plan()
  xs = _inputs(lengths, seed=8)
  outs = serve(layer, xs, lengths, chunk, start)
  _assert_matches(outs, ring(xs, is_causal=True), lengths)


def test_sinks_gradient_through_a_prefill_step():
  """A prefill step is differentiable in every parameter, the sinks included (RL log-probs, tuning)."""
  options = dict(use_sinks=True, v_head_dim=4)
  ring = _ring_twin(9, **options)
  layer = _loaded(ring, **options)
  xs = _inputs([5, 3], seed=9)
  x = jnp.concatenate([xs[0, :5], xs[1, :3]])
  cu, n = jnp.asarray([0, 5, 8, 8, 8], jnp.int32), jnp.asarray([2], jnp.int32)

  def paged_loss(m):
    return jnp.sum(m(x, cu_q_lens=cu, num_seqs=n) ** 2)

  def ring_loss(m):
    y = m(xs, is_causal=True)
    return jnp.sum(y[0, :5] ** 2) + jnp.sum(y[1, :3] ** 2)

  # Jitted: an eager grad would compile every primitive of both layers' forward and backward on its own.
  paged_grad = nnx.jit(lambda m: nnx.grad(paged_loss, argnums=nnx.DiffState(0, nnx.Param))(m))
  got = nnx.to_pure_dict(nnx.state(paged_grad(layer), nnx.Param))
  want = nnx.to_pure_dict(nnx.state(nnx.jit(nnx.grad(ring_loss))(ring), nnx.Param))
  assert np.abs(np.asarray(want["sinks"])).max() > 1e-4
  assert_close(got, want, F32, "grad")


def test_free_then_reuse_slot():
  """A new sequence in a freed slot gets its own outputs; the other slot carries on undisturbed."""
  mha = _mha(seed=6)
  layer = _loaded(mha)
  xs = _inputs([9, 12, 7], seed=6)  # a (slot 0), b (slot 1, spans the free), c (slot 0 after a)
  expected = _dense(mha, xs)
  one = lambda b, p: 1
  a, b_first = serve(layer, xs[:2], [9, 9], one)
  _free(layer, jnp.asarray([True, False, False, False]))
  cache = layer.kv_cache.get_value()
  assert int(cache.kv_lens[0]) == 0 and (np.asarray(cache.page_indices[0]) == -1).all()
  assert int(cache.kv_lens[1]) == 9
  c, b_rest = serve(
    layer,
    np.stack([xs[2], np.concatenate([xs[1, 9:], np.zeros((9, FEATURES), np.float32)])]),
    [7, 3],
    chunk=lambda b, p: 4 if (b == 0 and p == 0) else 1,
  )
  _assert_matches([a], expected[0:1], [9])
  _assert_matches([np.concatenate([b_first, b_rest])], expected[1:2], [12])
  _assert_matches([c], expected[2:3], [7])


def test_int8_cache_close_to_dense():
  """An int8 cache (per-token scales) stays close to the float layer (quantization error, not a tolerance-table check)."""
  mha = _mha(seed=7)
  layer = _loaded(mha, cache=False)
  layer.init_cache(**CACHE, dtype=jnp.int8)
  assert layer.kv_cache.get_value().k_pages.dtype == jnp.int8
  lengths = [6, 4]
  xs = _inputs(lengths, seed=7)
  outs = serve(layer, xs, lengths, chunk=lambda b, p: 2)
  expected = _dense(mha, xs)
  for b, n in enumerate(lengths):
    np.testing.assert_allclose(np.asarray(outs[b]), np.asarray(expected[b, :n]), atol=5e-2)


# -- errors -------------------------------------------------------------------------------------


def test_call_before_init_cache():
  layer = _paged(cache=False)
  with pytest.raises(ValueError, match=r"not initialised: call init_cache\(...\) first"):
    layer(jnp.zeros((T, FEATURES)), cu_q_lens=jnp.zeros((5,), jnp.int32), num_seqs=jnp.zeros((1,), jnp.int32))


def test_free_before_init_cache():
  layer = _paged(cache=False)
  with pytest.raises(ValueError, match="not initialised"):
    layer.free(jnp.zeros((4,), bool))


@pytest.mark.parametrize(
  "x, match",
  [
    (jnp.zeros((1, T, FEATURES)), r"inputs must be \[max_num_batched_tokens, features\] \(rank 2\)"),
    (jnp.zeros((FEATURES,)), r"rank 2"),
    (jnp.zeros((T, FEATURES + 1)), "inputs has 33 features but the layer expects in_features=32"),
  ],
)
def test_bad_inputs(x, match):
  layer = _paged()
  with pytest.raises(ValueError, match=match):
    layer(x, cu_q_lens=jnp.zeros((5,), jnp.int32), num_seqs=jnp.zeros((1,), jnp.int32))


def test_unsupported_options():
  layer = _paged()
  meta = dict(cu_q_lens=jnp.zeros((5,), jnp.int32), num_seqs=jnp.zeros((1,), jnp.int32))
  with pytest.raises(NotImplementedError, match="sow_weights=True is not supported"):
    layer(jnp.zeros((T, FEATURES)), sow_weights=True, **meta)
  with pytest.raises(NotImplementedError, match="takes no dense mask"):
    layer(jnp.zeros((T, FEATURES)), mask=jnp.ones((T, T), bool), **meta)
  with pytest.raises(NotImplementedError, match="is_causal=False is not supported"):
    layer(jnp.zeros((T, FEATURES)), is_causal=False, **meta)
  with pytest.raises(NotImplementedError, match=r"does not implement dropout \(dropout_rate=0.1\)"):
    _paged(cache=False, dropout_rate=0.1)


def test_head_axis_must_divide_kv_heads():
  mesh = make_mesh((4,), ("tp",), explicit=False)
  with pytest.raises(ValueError, match="num_kv_heads=2 must be a multiple of the 'tp' axis size 4"):
    _paged(cache=False, mesh=mesh, head_axis="tp")

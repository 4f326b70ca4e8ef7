"""`fr.Mask`: every term of the mask as one object, accepted by every ring entry point as `mask=`.

The same terms as keywords or as a `Mask` give the same program and the same numbers; a `Mask` is a pytree
(its arrays are leaves, its static terms part of the tree's structure), so it passes through `jax.jit` whole;
a term given both ways must agree.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from dense_oracle import dense_oracle
from flax import nnx
from tolerances import assert_close

import flax_ringattn as fr

B, T, N, H = 2, 32, 2, 8
F32 = jnp.float32


def _terms():
  """Every term at once, on tokens in a random order: causal, a window, a chunk, two documents, a span."""
  rng = np.random.default_rng(3)
  order = np.stack([rng.permutation(T) for _ in range(B)]).astype(np.int32)
  seg = np.where(order < 20, 1, 2).astype(np.int32)
  bid = np.where((order >= 4) & (order < 12), 7, 0).astype(np.int32)
  return dict(
    is_causal=True,
    local_window_size=(9, 0),
    chunk_size=16,
    segment_ids=jnp.asarray(seg),
    bidirectional_ids=jnp.asarray(bid),
    q_positions=jnp.asarray(order),
  )


def _qkv():
  keys = jax.random.split(jax.random.PRNGKey(0), 3)
  return tuple(jax.random.normal(key, (B, T, N, H), F32) for key in keys)


def test_every_entry_point_takes_the_mask_object():
  q, k, v = _qkv()
  terms = _terms()
  mask = fr.Mask(**terms)
  want, _ = dense_oracle(q, k, v, **terms)
  mesh = make_mesh((4,), ("sp",))
  calls = {
    "reference_attention": lambda **kw: fr.reference_attention(q, k, v, **kw),
    "ring_attention": lambda **kw: jax.jit(lambda q, k, v: fr.ring_attention(q, k, v, mesh=mesh, **kw))(q, k, v),
    "dot_product_attention": lambda **kw: fr.dot_product_attention(q, k, v, implementation="xla", **kw),
  }
  for name, call in calls.items():
    by_object, by_keywords = call(mask=mask), call(**terms)
    np.testing.assert_array_equal(np.asarray(by_object), np.asarray(by_keywords), err_msg=name)
    assert_close(by_object, want, F32)
  # Terms split between the object and the keywords join (the layers pass their static options that way).
  split = fr.Mask(segment_ids=terms["segment_ids"], q_positions=terms["q_positions"])
  rest = {key: terms[key] for key in ("is_causal", "local_window_size", "chunk_size", "bidirectional_ids")}
  assert_close(fr.reference_attention(q, k, v, mask=split, **rest), want, F32)


def test_the_layer_call_takes_the_mask_object():
  terms = _terms()
  layer = fr.RingMultiHeadAttention(N, 16, decode=False, chunk_size=16, local_window_size=(9, 0), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(1), (B, T, 16))
  call = dict(is_causal=True, segment_ids=terms["segment_ids"], bidirectional_ids=terms["bidirectional_ids"])
  by_keywords = layer(x, positions=terms["q_positions"], **call)
  by_object = layer(x, mask=fr.Mask(q_positions=terms["q_positions"], **call))
  np.testing.assert_array_equal(np.asarray(by_object), np.asarray(by_keywords))


def test_flax_attention_fn_hook_passes_the_mask_object_through():
  """nnx.MultiHeadAttention hands its `mask=` to `attention_fn` as it is: a `Mask` reaches the ring whole, and the
  answer is flax's own attention on the same mask built dense."""
  x = jax.random.normal(jax.random.PRNGKey(2), (B, T, 16))
  seg = jnp.asarray(np.where(np.arange(T) < 20, 1, 2)[None].repeat(B, 0))
  hooked = nnx.MultiHeadAttention(N, 16, decode=False, rngs=nnx.Rngs(0), attention_fn=fr.make_ring_attention_fn())
  flax_own = nnx.MultiHeadAttention(N, 16, decode=False, rngs=nnx.Rngs(0))
  i = np.arange(T)
  dense = (i[None, :] <= i[:, None]) & (seg[:, :, None] == seg[:, None, :]) & (i[:, None] // 8 == i[None, :] // 8)
  got = hooked(x, mask=fr.Mask(is_causal=True, segment_ids=seg, chunk_size=8))
  assert_close(got, flax_own(x, mask=jnp.asarray(dense)[:, None]), F32)


def test_a_mask_object_passes_through_jit_as_a_pytree():
  q, k, v = _qkv()
  terms = _terms()
  traces = []

  @jax.jit
  def f(q, mask):
    traces.append(mask)
    return fr.ring_attention(q, k, v, mask=mask)

  first = f(q, fr.Mask(**terms))
  # New arrays in the same static terms reuse the program; a new static term traces again.
  other = dict(terms, segment_ids=jnp.ones((B, T), jnp.int32))
  f(q, fr.Mask(**other))
  assert len(traces) == 1
  f(q, fr.Mask(**dict(terms, chunk_size=8)))
  assert len(traces) == 2
  assert isinstance(traces[0].segment_ids, jax.core.Tracer) and traces[0].chunk_size == 16
  assert_close(first, fr.reference_attention(q, k, v, **terms), F32)
  leaves = jax.tree.leaves(fr.Mask(**terms))
  assert len(leaves) == 3  # segment ids, bidirectional ids, positions


@pytest.mark.parametrize(
  ("mask", "keywords", "error", "match"),
  [
    (dict(chunk_size=8), dict(chunk_size=16), ValueError, r"chunk_size is given twice, as a keyword \(16\)"),
    (dict(is_causal=True, local_window_size=3), dict(local_window_size=(3, 3), is_causal=True), None, None),
    (
      dict(segment_ids=np.zeros((B, T), np.int32)),
      dict(segment_ids=np.zeros((B, T), np.int32)),
      ValueError,
      r"segment_ids is given twice.*array of shape \(2, 32\)",
    ),
  ],
  ids=["static_terms_disagree", "static_terms_agree", "arrays_twice"],
)
def test_a_term_given_twice_must_agree(mask, keywords, error, match):
  q, k, v = _qkv()
  if error is None:
    fr.reference_attention(q, k, v, mask=fr.Mask(**mask), **keywords)
    return
  with pytest.raises(error, match=match):
    fr.reference_attention(q, k, v, mask=fr.Mask(**mask), **keywords)


def test_mask_errors():
  q, k, v = _qkv()
  with pytest.raises(TypeError, match=r"mask must be a flax_ringattn.Mask here.*dot_product_attention"):
    fr.ring_attention(q, k, v, mask=jnp.ones((T, T), bool))
  with pytest.raises(TypeError, match=r"Mask.is_causal must be a bool, got 1"):
    fr.Mask(is_causal=1)
  with pytest.raises(ValueError, match="chunk_size"):
    fr.Mask(chunk_size=0)
  with pytest.raises(ValueError, match="segment_ids"):
    fr.ring_attention(q, k, v, mask=fr.Mask(segment_ids=jnp.zeros((B, T + 1), jnp.int32)))

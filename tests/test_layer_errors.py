"""The layers fail early and in the library's words: a full cache, wrong axes, typos, decode, lengths."""

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

import flax_ringattn as fr

NUM_HEADS, NUM_KV, FEATURES = 4, 2, 16
T = 8  # rows of every paged step
F32 = jnp.float32

# -- a paged layer's full cache ------------------------------------------------------------------

# Per limit: cache sizes, the steps that fill it (tokens per slot), the step that does not fit, and its message.
LIMITS = {
  "pages_per_seq": (
    dict(num_pages=16, page_size=4, max_num_seqs=2, pages_per_seq=2),
    [[4, 2], [4, 0]],
    [1, 1],
    "slot 0 cannot take 1 more tokens: it holds 8 and a slot holds at most pages_per_seq * page_size = 2 * 4 = 8",
  ),
  "free_pages": (
    dict(num_pages=3, page_size=4, max_num_seqs=2, pages_per_seq=4),
    [[7, 0]],
    [1, 5],
    "slot 1 needs 2 more pages for 5 new tokens (it holds 0), but only 1 of num_pages=3 are free",
  ),
}


def _paged(cache, **kw):
  layer = fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, num_kv_heads=NUM_KV, rngs=nnx.Rngs(0), **kw)
  layer.init_cache(**cache)
  return layer


def _meta(lens, slots):
  cu = np.zeros(slots + 1, np.int32)
  cu[1 : len(lens) + 1] = np.cumsum(lens)
  cu[len(lens) + 1 :] = cu[len(lens)]
  return jnp.asarray(cu), jnp.asarray([slots], jnp.int32)


def _x(seed):
  return jnp.asarray(np.random.default_rng(seed).normal(size=(T, FEATURES)), F32)


@nnx.jit
def _step(layer, x, cu, n):
  return layer(x, cu_q_lens=cu, num_seqs=n)


def _fill(layer, steps, slots):
  for i, lens in enumerate(steps):
    _step(layer, _x(i), *_meta(lens, slots))


@pytest.mark.parametrize("limit", list(LIMITS))
def test_paged_layer_overflow_raises_eagerly(limit):
  cache, steps, last, message = LIMITS[limit]
  layer = _paged(cache)
  _fill(layer, steps, cache["max_num_seqs"])
  before = layer.kv_cache.get_value()
  with pytest.raises(fr.CacheOverflowError, match=re.escape(message)):
    layer(_x(9), cu_q_lens=_meta(last, cache["max_num_seqs"])[0], num_seqs=_meta(last, 2)[1])
  # Nothing was written: the layer's cache is the one before the call.
  for got, want in zip(jax.tree.leaves(layer.kv_cache.get_value()), jax.tree.leaves(before), strict=True):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("limit", list(LIMITS))
def test_paged_layer_overflow_flagged_under_jit(limit):
  """Under jit the refused slot stores nothing, its rows return 0, `overflowed()` flags it until `free`, and
  the other slot is served exactly as in a run without the refused tokens."""
  cache, steps, last, _ = LIMITS[limit]
  S = cache["max_num_seqs"]
  layer, twin = _paged(cache), _paged(cache)
  _fill(layer, steps, S)
  _fill(twin, steps, S)
  bad = 0 if limit == "pages_per_seq" else 1
  ok_slot = 1 - bad
  y = np.asarray(_step(layer, _x(9), *_meta(last, S)))
  np.testing.assert_array_equal(np.asarray(layer.overflowed()), [i == bad for i in range(S)])
  cu = np.asarray(_meta(last, S)[0])
  np.testing.assert_array_equal(y[cu[bad] : cu[bad + 1]], 0.0)
  # The twin gets the same step without the refused slot's tokens (same rows for the served slot).
  x_twin = np.asarray(_x(9)).copy()
  lens_twin = list(last)
  lens_twin[bad] = 0
  cu_twin = np.asarray(_meta(lens_twin, S)[0])
  x_twin[cu_twin[ok_slot] : cu_twin[ok_slot + 1]] = np.asarray(_x(9))[cu[ok_slot] : cu[ok_slot + 1]]
  y_twin = np.asarray(_step(twin, jnp.asarray(x_twin), *_meta(lens_twin, S)))
  np.testing.assert_array_equal(y[cu[ok_slot] : cu[ok_slot + 1]], y_twin[cu_twin[ok_slot] : cu_twin[ok_slot + 1]])
  got, want = layer.kv_cache.get_value(), twin.kv_cache.get_value()
  np.testing.assert_array_equal(got.kv_lens, want.kv_lens)
  np.testing.assert_array_equal(got.k_pages, want.k_pages)
  # The flag stays until the slot is freed (a token that would fit is refused too); then the slot serves again.
  _step(layer, _x(10), *_meta([int(i == bad) for i in range(S)], S))
  assert bool(layer.overflowed()[bad])
  nnx.jit(lambda m, s: m.free(s))(layer, jnp.arange(S) == bad)
  assert not np.asarray(layer.overflowed()).any()
  _step(layer, _x(11), *_meta([int(i == bad) for i in range(S)], S))
  assert not np.asarray(layer.overflowed()).any()


@functools.partial(checkify.checkify, errors=checkify.user_checks)
@jax.jit
def _checked_step(graphdef, state, x, cu, n):
  """The README's checked serving step: nnx's functional API inside checkify, under jit."""
  layer = nnx.merge(graphdef, state)
  y = layer(x, cu_q_lens=cu, num_seqs=n)
  return y, nnx.state(layer)


def test_paged_layer_checked_raises_under_checkify():
  cache, steps, last, message = LIMITS["pages_per_seq"]
  layer = _paged(cache, checked=True)
  graphdef, state = nnx.split(layer)
  for i, lens in enumerate(steps):
    err, (_, state) = _checked_step(graphdef, state, _x(i), *_meta(lens, 2))
    assert err.get() is None, err.get()
  err, _ = _checked_step(graphdef, state, _x(9), *_meta(last, 2))
  assert err.get() is not None and message.split(": it holds")[0] in err.get(), err.get()
  # The op's metadata checks run in the layer too: a decreasing cu_q_lens.
  graphdef, state = nnx.split(_paged(cache, checked=True))
  err, _ = _checked_step(graphdef, state, _x(0), jnp.asarray([0, 3, 2], jnp.int32), jnp.asarray([2], jnp.int32))
  assert err.get() is not None and "cu_q_lens[1]=3 > cu_q_lens[2]=2" in err.get(), err.get()


# -- paged layer: arguments -------------------------------------------------------------------------


def test_paged_layer_call_rejects_unknown_keywords():
  layer = _paged(LIMITS["free_pages"][0])
  cu, n = _meta([1, 0], 2)
  with pytest.raises(
    TypeError, match=r"PagedMultiHeadAttention.__call__\(\) got an unexpected keyword argument 'is_casual'"
  ):
    layer(_x(0), cu_q_lens=cu, num_seqs=n, is_casual=True)
  # flax's call keywords are accepted (and unused: no dropout).
  layer(_x(0), cu_q_lens=cu, num_seqs=n, deterministic=True, rngs=None, decode=True)


@pytest.mark.parametrize("cls", [fr.PagedMultiHeadAttention, fr.RingMultiHeadAttention])
def test_layer_constructor_rejects_unknown_keywords(cls):
  with pytest.raises(
    TypeError,
    match=rf"{cls.__name__}\(\) got an unexpected keyword argument 'num_kv_head' \(did you mean 'num_kv_heads'\?\)",
  ):
    cls(NUM_HEADS, FEATURES, num_kv_head=2, rngs=nnx.Rngs(0))
  with pytest.raises(
    TypeError,
    match=rf"{cls.__name__}\(\) got an unexpected keyword argument 'logit_soft_cap' \(did you mean 'logits_soft_cap'\?\)",
  ):
    cls(NUM_HEADS, FEATURES, logit_soft_cap=2.0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("cls", [fr.PagedMultiHeadAttention, fr.RingMultiHeadAttention])
def test_layer_sinks_and_v_head_dim_options_checked(cls):
  make = functools.partial(cls, NUM_HEADS, FEATURES, rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError, match=r"v_head_dim must be a positive int .* or None \(the q/k head dim 4\), got v_head_dim=0"
  ):
    make(v_head_dim=0)
  with pytest.raises(ValueError, match=r"got v_head_dim=2.5"):
    make(v_head_dim=2.5)
  with pytest.raises(TypeError, match=r"use_sinks must be a bool, got 'yes'"):
    make(use_sinks="yes")
  with pytest.raises(TypeError, match=r"unexpected keyword argument 'use_sink' \(did you mean 'use_sinks'\?\)"):
    make(use_sink=True)
  layer = make(v_head_dim=4)  # the q/k head dim: the parameter tree of nnx.MultiHeadAttention
  assert layer.v_head_dim == 4 and layer.value.kernel.shape == (FEATURES, NUM_HEADS, 4) and layer.sinks is None


def test_decode_flag():
  with pytest.raises(NotImplementedError, match="decode=True .* is not supported by RingMultiHeadAttention"):
    fr.RingMultiHeadAttention(NUM_HEADS, FEATURES, decode=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="PagedMultiHeadAttention always samples from its paged cache"):
    fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0))
  fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, decode=True, rngs=nnx.Rngs(0))  # it decodes: accepted


# -- ring layer: axes and lengths -------------------------------------------------------------------


@pytest.mark.parametrize("role", ["seq_axis", "head_axis", "batch_axis"])
def test_ring_layer_axes_checked_at_construction(role):
  mesh = make_mesh((8,), ("sp",))
  kw = {"seq_axis": "sp", role: "seq"}
  message = f"RingMultiHeadAttention: {role}='seq' is not an axis of the mesh (mesh axes: ('sp',))"
  with pytest.raises(ValueError, match=re.escape(message)):
    fr.RingMultiHeadAttention(NUM_HEADS, FEATURES, mesh=mesh, rngs=nnx.Rngs(0), **kw)
  with pytest.raises(ValueError, match=re.escape(message.replace("RingMultiHeadAttention", "make_ring_attention_fn"))):
    fr.make_ring_attention_fn(mesh=mesh, **kw)
  with pytest.raises(ValueError, match=re.escape(message.replace("RingMultiHeadAttention", "convert"))):
    model = nnx.MultiHeadAttention(NUM_HEADS, FEATURES, decode=False, rngs=nnx.Rngs(0))
    holder = nnx.Dict(attn=model)
    fr.convert(holder, mesh=mesh, **kw)
  assert isinstance(holder["attn"], nnx.MultiHeadAttention) and not isinstance(
    holder["attn"], fr.RingMultiHeadAttention
  )


def test_paged_layer_head_axis_checked_at_construction():
  mesh = make_mesh((2,), ("tp",))
  message = "PagedMultiHeadAttention: head_axis='heads' is not an axis of the mesh (mesh axes: ('tp',))"
  with pytest.raises(ValueError, match=re.escape(message)):
    fr.PagedMultiHeadAttention(NUM_HEADS, FEATURES, mesh=mesh, head_axis="heads", rngs=nnx.Rngs(0))


def test_ring_layer_strategy_axes_checked_at_construction():
  mesh = make_mesh((8,), ("sp",))
  with pytest.raises(ValueError, match="unknown strategy='ulyses'"):
    fr.RingMultiHeadAttention(NUM_HEADS, FEATURES, mesh=mesh, strategy="ulyses", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"strategy='ulysses_ring' needs axis_name=\(ring_axis, ulysses_axis\)"):
    fr.RingMultiHeadAttention(NUM_HEADS, FEATURES, mesh=mesh, strategy="ulysses_ring", rngs=nnx.Rngs(0))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize(
  "T_, load_balance, message",
  [
    (100, False, "global q_len=100 must be a multiple of 8 (ring_size=8 over axis 'sp', load_balance=False)"),
    (24, True, "global q_len=24 must be a multiple of 16 (ring_size=8 over axis 'sp', load_balance=True)"),
  ],
)
def test_ring_layer_length_gets_the_op_message(T_, load_balance, message, jit):
  mesh = make_mesh((8,), ("sp",))
  layer = fr.RingMultiHeadAttention(NUM_HEADS, FEATURES, mesh=mesh, load_balance=load_balance, rngs=nnx.Rngs(0))
  call = nnx.jit(lambda m, x: m(x, is_causal=True)) if jit else (lambda m, x: m(x, is_causal=True))
  with pytest.raises(ValueError, match=re.escape(message)):
    call(layer, jnp.zeros((1, T_, FEATURES)))


def test_ring_layer_call_rejects_unknown_keywords():
  layer = fr.RingMultiHeadAttention(NUM_HEADS, FEATURES, rngs=nnx.Rngs(0))
  with pytest.raises(
    TypeError, match=r"RingMultiHeadAttention.__call__\(\) got an unexpected keyword argument 'is_casual'"
  ):
    layer(jnp.zeros((1, 8, FEATURES)), is_casual=True)

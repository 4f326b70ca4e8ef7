"""RingMultiHeadAttention / make_ring_attention_fn as drop-ins for nnx.MultiHeadAttention."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import flax_ringattn as fr

NUM_HEADS, NUM_KV, FEATURES, QKV = 8, 2, 32, 64


def _mha(seed=0, **kw):
  return nnx.MultiHeadAttention(NUM_HEADS, FEATURES, QKV, num_kv_heads=NUM_KV, decode=False, rngs=nnx.Rngs(seed), **kw)


def _ring(mesh, seed=1, **kw):
  return fr.RingMultiHeadAttention(
    NUM_HEADS, FEATURES, QKV, num_kv_heads=NUM_KV, decode=False, rngs=nnx.Rngs(seed), mesh=mesh, **kw
  )


def _loss(model, x):
  return jnp.mean(model(x, is_causal=True) ** 2)


def _param_grads(model, x):
  return nnx.state(nnx.grad(_loss)(model, x), nnx.Param)


@pytest.mark.parametrize("explicit", [True, False], ids=["explicit", "auto"])
@pytest.mark.parametrize("head_axis", [None, "tp"])
def test_swap_layer_same_outputs_and_param_grads(explicit, head_axis):
  shape, names = ((4, 2), ("sp", "tp")) if head_axis else ((8,), ("sp",))
  mesh = make_mesh(shape, names, explicit=explicit)
  mha = _mha()
  ring = _ring(mesh, seq_axis="sp", head_axis=head_axis)
  nnx.update(ring, nnx.state(mha))  # the parameter trees are the same
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 64, FEATURES))
  assert_close(nnx.jit(lambda m, x: m(x, is_causal=True))(ring, x), mha(x, is_causal=True), jnp.float32)
  assert_close(nnx.jit(_param_grads)(ring, x), _param_grads(mha, x), jnp.float32, "grad")


def test_swap_through_attention_fn():
  mesh = make_mesh((8,), ("sp",))
  mha = _mha()
  swapped = _mha(attention_fn=fr.make_ring_attention_fn(mesh=mesh))
  nnx.update(swapped, nnx.state(mha))
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 64, FEATURES))
  assert_close(nnx.jit(lambda m, x: m(x, is_causal=True))(swapped, x), mha(x, is_causal=True), jnp.float32)
  assert_close(nnx.jit(_param_grads)(swapped, x), _param_grads(mha, x), jnp.float32, "grad")
  # is_causal may also be fixed by the factory.
  causal = _mha(attention_fn=fr.make_ring_attention_fn(mesh=mesh, is_causal=True))
  nnx.update(causal, nnx.state(mha))
  assert_close(nnx.jit(lambda m, x: m(x))(causal, x), mha(x, is_causal=True), jnp.float32)


def test_ring_layer_initialises_like_mha():
  """Same constructor arguments and rngs -> the very same parameters."""
  mha, ring = _mha(seed=3), _ring(None, seed=3)
  chex_leaves = jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(a, b), nnx.state(mha), nnx.state(ring)))
  assert all(chex_leaves)


def test_params_carry_head_sharding():
  mesh = make_mesh((4, 2), ("sp", "tp"))
  ring = _ring(mesh, seq_axis="sp", head_axis="tp")
  specs = nnx.get_partition_spec(nnx.state(ring, nnx.Param))
  assert specs["query"]["kernel"].get_value() == P(None, "tp", None)
  assert specs["key"]["bias"].get_value() == P("tp", None)
  assert specs["out"]["kernel"].get_value() == P("tp", None, None)
  assert ring.query.kernel[...].sharding.spec == P(None, "tp", None)


def test_segment_ids_and_window_options():
  mesh = make_mesh((4,), ("sp",))
  ring = _ring(mesh, local_window_size=(5, 0), logits_soft_cap=3.0)
  x = jax.random.normal(jax.random.PRNGKey(2), (2, 32, FEATURES))
  seg = jnp.repeat(jnp.array([[0, 1], [1, 2]]), 16, axis=1)
  got = nnx.jit(lambda m, x, s: m(x, is_causal=True, segment_ids=s))(ring, x, seg)
  q, k, v = ring.query(x), ring.key(x), ring.value(x)
  ref = fr.reference_attention(q, k, v, is_causal=True, segment_ids=seg, local_window_size=(5, 0), logits_soft_cap=3.0)
  assert_close(got, ring.out(ref), jnp.float32)


@pytest.mark.parametrize(
  "call,match",
  [
    (lambda m, x: m(x, sow_weights=True), "sow_weights"),
    (lambda m, x: m(x, decode=True), "decode=True"),
  ],
  ids=["sow_weights", "decode"],
)
def test_unsupported_layer_options_raise(call, match):
  ring = _ring(None)
  with pytest.raises(NotImplementedError, match=match):
    call(ring, jnp.zeros((2, 16, FEATURES)))


@pytest.mark.parametrize(
  "kwargs,match",
  [
    (dict(bias=jnp.zeros((2, 1, 16, 16))), "bias"),
    (dict(module=object()), "sow_weights"),
  ],
  ids=["bias", "sow_weights"],
)
def test_unsupported_attention_fn_options_raise(kwargs, match):
  fn = fr.make_ring_attention_fn()
  q = jnp.zeros((2, 16, 4, 8))
  with pytest.raises(NotImplementedError, match=match):
    fn(q, q, q, **kwargs)


def test_attention_fn_accepts_every_flax_keyword():
  fn = fr.make_ring_attention_fn()
  q = jax.random.normal(jax.random.PRNGKey(0), (2, 16, 4, 8))
  out = fn(
    q,
    q,
    q,
    bias=None,
    mask=None,
    broadcast_dropout=True,
    dropout_rng=jax.random.PRNGKey(1),
    dropout_rate=0.1,
    deterministic=True,
    dtype=jnp.float32,
    precision=None,
    module=None,
    is_causal=True,
  )
  assert_close(out, fr.reference_attention(q, q, q, is_causal=True), jnp.float32)


class _Block(nnx.Module):
  def __init__(self, attn, rngs):
    self.attn = attn(rngs)
    self.norm = nnx.LayerNorm(FEATURES, rngs=rngs)

  def __call__(self, x):
    return x + self.attn(self.norm(x), is_causal=True)


def _stack(attn, num_layers=2):
  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def create(rngs):
    return _Block(attn, rngs)

  return create(nnx.Rngs(0))


def _scan_apply(stack, x, remat):
  def layer(block, x):
    return block(x)

  if remat:
    layer = nnx.remat(layer)
  body = nnx.scan(layer, in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  return body(stack, x)


@pytest.mark.parametrize("remat", [False, True], ids=["scan", "scan+remat"])
def test_nnx_scan_and_remat_over_layers(remat):
  # Auto axes: with Explicit axes, the transpose of flax's out projection inside
  # nnx.scan asks for an out_sharding (see README "Known limits").
  mesh = make_mesh((4,), ("sp",), explicit=False)
  ring_stack = _stack(
    lambda r: fr.RingMultiHeadAttention(NUM_HEADS, FEATURES, QKV, num_kv_heads=NUM_KV, mesh=mesh, rngs=r)
  )
  ref_stack = _stack(
    lambda r: nnx.MultiHeadAttention(NUM_HEADS, FEATURES, QKV, num_kv_heads=NUM_KV, decode=False, rngs=r)
  )
  x = jax.random.normal(jax.random.PRNGKey(5), (2, 32, FEATURES))
  loss = lambda stack, x: jnp.mean(_scan_apply(stack, x, remat) ** 2)
  got_loss, got_grads = nnx.jit(nnx.value_and_grad(loss))(ring_stack, x)
  ref_loss, ref_grads = nnx.value_and_grad(loss)(ref_stack, x)
  assert_close(got_loss, ref_loss, jnp.float32)
  # (pure dicts: the ring layer's parameters also carry their mesh placement as metadata)
  pure = lambda g: nnx.to_pure_dict(nnx.state(g, nnx.Param))  # noqa: E731
  assert_close(pure(got_grads), pure(ref_grads), jnp.float32, "grad")


def _attend_reference(m, x):
  """The layer's projections around `reference_attention` (one device, the sinks of the layer if any)."""
  sinks = None if m.sinks is None else m.sinks[...]
  return m.out(fr.reference_attention(m.query(x), m.key(x), m.value(x), is_causal=True, sinks=sinks))


@pytest.mark.parametrize(
  "options,head_axis",
  [(dict(use_sinks=True), "tp"), (dict(use_sinks=True, v_head_dim=4), None), (dict(v_head_dim=12), "tp")],
  ids=["sinks-tp", "sinks+mla", "mla-tp"],
)
def test_sinks_and_v_head_dim_match_the_reference_and_train(options, head_axis):
  """The sinks parameter ([N], zeros, over head_axis) and the MLA value head dim: forward and every parameter's
  gradient match `reference_attention(..., sinks=)` on the same projections, and an optax step moves the sinks."""
  shape, names = ((4, 2), ("sp", "tp")) if head_axis else ((8,), ("sp",))
  mesh = make_mesh(shape, names)
  ring = _ring(mesh, seq_axis="sp", head_axis=head_axis, **options)
  twin = _ring(None, **options)
  Hv = options.get("v_head_dim", QKV // NUM_HEADS)
  assert ring.value.kernel.shape == (FEATURES, NUM_KV, Hv) and ring.out.kernel.shape == (NUM_HEADS, Hv, FEATURES)
  assert ring.query.kernel.shape == (FEATURES, NUM_HEADS, QKV // NUM_HEADS)
  if options.get("use_sinks"):
    np.testing.assert_array_equal(np.asarray(ring.sinks[...]), np.zeros(NUM_HEADS))
    spec = nnx.get_partition_spec(nnx.state(ring, nnx.Param))["sinks"].get_value()
    assert spec == P(head_axis) and ring.sinks[...].sharding.spec == P(head_axis)
    twin.sinks.set_value(jnp.linspace(-2.0, 3.0, NUM_HEADS))  # trained-looking values, one per head
  else:
    assert ring.sinks is None and "sinks" not in nnx.state(ring, nnx.Param)
  nnx.update(ring, nnx.state(twin, nnx.Param))
  x = jax.random.normal(jax.random.PRNGKey(6), (2, 32, FEATURES))
  assert_close(nnx.jit(lambda m, x: m(x, is_causal=True))(ring, x), _attend_reference(twin, x), jnp.float32)
  ref_loss = lambda m, x: jnp.mean(_attend_reference(m, x) ** 2)  # noqa: E731
  pure = lambda g: nnx.to_pure_dict(nnx.state(g, nnx.Param))  # noqa: E731
  assert_close(pure(nnx.jit(nnx.grad(_loss))(ring, x)), pure(nnx.grad(ref_loss)(twin, x)), jnp.float32, "grad")
  if not options.get("use_sinks"):
    return
  opt = nnx.Optimizer(ring, optax.sgd(0.5), wrt=nnx.Param)
  before = np.asarray(ring.sinks[...])
  grad = np.asarray(nnx.grad(ref_loss)(twin, x).sinks[...])
  nnx.jit(lambda m, o, x: o.update(m, nnx.grad(_loss)(m, x)))(ring, opt, x)
  assert np.abs(grad).max() > 1e-4
  np.testing.assert_allclose(np.asarray(ring.sinks[...]), before - 0.5 * grad, rtol=1e-4, atol=1e-6)

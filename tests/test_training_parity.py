"""A 20-step optax run on 8 devices (sequence sharded, zigzag) matches one device step by step."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import make_mesh
from flax import nnx
from tolerances import assert_close

import flax_ringattn as fr

VOCAB, D, HEADS, KV_HEADS, SEQ, BATCH, LAYERS = 32, 32, 4, 2, 64, 2, 2


class TinyLM(nnx.Module):
  """Two pre-norm attention + MLP blocks; `attention` builds each attention layer."""

  def __init__(self, attention, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.pos = nnx.Embed(SEQ, D, rngs=rngs)
    self.blocks = nnx.List(
      [
        nnx.Dict(
          norm1=nnx.LayerNorm(D, rngs=rngs),
          attn=attention(rngs),
          norm2=nnx.LayerNorm(D, rngs=rngs),
          mlp=nnx.Linear(D, D, rngs=rngs),
        )
        for _ in range(LAYERS)
      ]
    )
    self.head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens, positions):
    x = self.embed(tokens) + self.pos(positions)
    for b in self.blocks:
      x = x + b["attn"](b["norm1"](x), is_causal=True)
      x = x + jax.nn.gelu(b["mlp"](b["norm2"](x)))
    return self.head(x)


def _train(model, tokens, targets, positions, steps, jit=True):
  opt = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  def step(model, opt, tokens, targets, positions):
    def loss_fn(model):
      logits = model(tokens, positions)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    opt.update(model, grads)
    return loss

  if jit:
    step = nnx.jit(step)
  return [float(step(model, opt, tokens, targets, positions)) for _ in range(steps)]


@pytest.mark.slow
def test_twenty_steps_match_single_device():
  n = 8
  mesh = make_mesh((n,), ("sp",))
  data = np.random.default_rng(0).integers(0, VOCAB, (BATCH, SEQ + 1))
  tokens, targets = jnp.asarray(data[:, :-1]), jnp.asarray(data[:, 1:])
  positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))

  reference = TinyLM(
    lambda r: nnx.MultiHeadAttention(HEADS, D, num_kv_heads=KV_HEADS, decode=False, rngs=r), nnx.Rngs(0)
  )
  # Explicit axes: build and train under the mesh, so that every parameter is
  # typed as replicated on it and weight gradients know where they live.
  with jax.set_mesh(mesh):
    ring = TinyLM(
      lambda r: fr.RingMultiHeadAttention(HEADS, D, num_kv_heads=KV_HEADS, mesh=mesh, load_balance=True, rngs=r),
      nnx.Rngs(0),
    )
  # Same init (identical parameter trees and rng use), checked rather than assumed.
  for a, b in zip(jax.tree.leaves(nnx.state(reference)), jax.tree.leaves(nnx.state(ring)), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  with jax.default_device(jax.devices()[0]):
    ref_losses = _train(reference, tokens, targets, positions, steps=20)
  # The data pipeline reorders once into the zigzag layout; positions travel with the tokens.
  zz = lambda x: fr.zigzag_order(x, n, axis=1)
  with jax.set_mesh(mesh):
    ring_losses = _train(ring, zz(tokens), zz(targets), zz(positions), steps=20)

  np.testing.assert_allclose(ring_losses, ref_losses, rtol=2e-5, atol=2e-5)
  assert ring_losses[-1] < ring_losses[0] - 0.5, ring_losses  # it really trained
  ring_params = dict(nnx.to_flat_state(nnx.state(ring, nnx.Param)))
  ref_params = dict(nnx.to_flat_state(nnx.state(reference, nnx.Param)))
  assert ring_params.keys() == ref_params.keys()
  for path, value in ring_params.items():
    if path[-2:] == ("key", "bias"):
      # Adding a constant to every key of a row shifts its logits uniformly, so
      # the key bias has an exactly zero gradient; Adam turns the rounding noise
      # of that zero into lr-sized steps, different on 8 devices and on 1.
      continue
    np.testing.assert_allclose(
      np.asarray(value[...]), np.asarray(ref_params[path][...]), rtol=1e-4, atol=1e-4, err_msg=str(path)
    )


def test_remat_policy_saves_the_attention_forward():
  """`save_attention_residuals` under `jax.checkpoint`: the gradients of a plain remat, and a backward that does
  not run the attention forward again (as many exps as without remat at all; a plain remat has more)."""
  layer = fr.RingMultiHeadAttention(HEADS, D, num_kv_heads=KV_HEADS, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(layer)
  x = jax.random.normal(jax.random.key(1), (BATCH, SEQ, D))

  def loss(params, x):
    return jnp.sum(jnp.tanh(nnx.merge(graphdef, params)(x, is_causal=True)))

  def exps(f):
    return str(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(params, x)).count(" exp ")

  saved = jax.checkpoint(loss, policy=fr.save_attention_residuals)
  assert exps(saved) == exps(loss) < exps(jax.checkpoint(loss))
  got, want = (jax.jit(jax.grad(f, argnums=(0, 1)))(params, x) for f in (saved, loss))
  assert_close(got, want, jnp.float32, "grad")

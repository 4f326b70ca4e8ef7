"""Training a converted model: `place_on_mesh` (one compile of the train step), the ring really runs sharded
(`flax_ringattn.testing.collective_counts`), and a ring of one device warns once."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import jax_events, make_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import flax_ringattn as fr
from flax_ringattn import testing as fr_testing
from flax_ringattn._src import validation
from flax_ringattn._src.nnx.common import RING_OF_ONE_KEY, RingOfOneWarning

D, T = 16, 32
_COMPILE = "/jax/core/compile/backend_compile_duration"


class Model(nnx.Module):
  """A pre-norm block with the stock nnx.MultiHeadAttention, as a model written for flax has it."""

  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(2, D, decode=False, rngs=rngs)
    self.mlp = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm(x))
    return x + self.mlp(x)


def _converted(mesh):
  model = Model(nnx.Rngs(0))
  fr.convert(model, mesh=mesh, implementation="xla")
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  return model, optimizer


def _train(model, optimizer, x, steps=3):
  """Runs a jitted train step `steps` times: (losses, traces, backend compiles, the step)."""
  traces = []

  @nnx.jit
  def step(model, optimizer, x):
    traces.append(1)  # runs only when the step is traced
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  with jax_events() as events:
    losses = [float(step(model, optimizer, x)) for _ in range(steps)]
  return losses, len(traces), events.count(_COMPILE), step


@pytest.mark.parametrize("placed", [True, False], ids=["place_on_mesh", "without"])
def test_a_converted_model_trains_with_one_compile(placed):
  mesh = make_mesh((8,), ("sp",), explicit=False)
  model, optimizer = _converted(mesh)
  x = jax.device_put(jax.random.normal(jax.random.key(0), (2, T, D)), NamedSharding(mesh, P()))
  assert not isinstance(optimizer.step[...].sharding, NamedSharding)  # the step counter starts on one device
  if placed:
    params = {p: v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert fr.place_on_mesh(optimizer, mesh) is optimizer
    assert optimizer.step[...].sharding.is_equivalent_to(NamedSharding(mesh, P()), 0)
    for path, var in nnx.iter_graph(optimizer):
      if isinstance(var, nnx.Variable) and isinstance(var.get_value(), jax.Array):
        assert var.get_value().sharding.device_set == set(mesh.devices.flat), path
    # Arrays already on the mesh are left as they are (the same objects).
    assert all(params[p] is v[...] for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  losses, traces, compiles, step = _train(model, optimizer, x)
  assert np.all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  # Without it the first step returns the counter on the mesh: the second step sees new input shardings.
  want = 1 if placed else 2
  assert (traces, compiles) == (want, want), f"{traces=} {compiles=}"
  assert int(optimizer.step[...]) == 3
  if placed:
    # The ring really runs over the 8 devices: its hops are in the compiled step.
    assert fr_testing.collective_counts(step, model, optimizer, x)["collective-permute"] > 0


def test_collective_counts_of_a_jitted_function():
  mesh = make_mesh((8,), ("sp",))
  q = jax.random.normal(jax.random.key(1), (1, T, 2, 8))
  counts = fr_testing.collective_counts(
    lambda q: fr.ring_attention(q, q, q, mesh=mesh, is_causal=True, implementation="xla"), q
  )
  assert counts["collective-permute"] > 0 and set(counts) >= {"all-to-all", "all-gather"}, counts
  assert fr_testing.collective_counts(jax.jit(lambda q: q * 2), q) == dict.fromkeys(counts, 0)


def test_place_on_mesh_of_a_pytree_and_of_a_state():
  mesh = make_mesh((8,), ("sp",), explicit=False)
  sharded = jax.device_put(jnp.arange(16.0), NamedSharding(mesh, P("sp")))
  tree = {"one_device": jnp.ones(3), "sharded": sharded, "other": "not an array", "none": None}
  placed = fr.place_on_mesh(tree, mesh)
  assert placed["one_device"].sharding.is_equivalent_to(NamedSharding(mesh, P()), 1)
  assert placed["sharded"] is sharded and placed["other"] == "not an array" and placed["none"] is None
  assert not isinstance(tree["one_device"].sharding, NamedSharding)  # a pytree is not changed in place
  model, optimizer = _converted(mesh)
  state = fr.place_on_mesh(nnx.state(optimizer), mesh)
  assert state["step"][...].sharding.device_set == set(mesh.devices.flat)
  assert not isinstance(optimizer.step[...].sharding, NamedSharding)  # only the returned state is placed
  nnx.update(optimizer, state)
  assert isinstance(optimizer.step[...].sharding, NamedSharding)


def test_place_on_mesh_moves_arrays_of_another_mesh():
  """An array on a mesh over other devices is not on this one: it is replicated here."""
  mesh = make_mesh((8,), ("sp",), explicit=False)
  elsewhere = jax.device_put(jnp.ones(4), NamedSharding(make_mesh((2,), ("sp",), explicit=False), P()))
  assert fr.place_on_mesh([elsewhere], mesh)[0].sharding.device_set == set(mesh.devices.flat)


@pytest.mark.parametrize(
  "mesh, error, match",
  [
    ("sp", TypeError, r"place_on_mesh\(tree, mesh\): mesh must be a jax.sharding.Mesh .*got str: 'sp'"),
    (None, TypeError, r"mesh must be a jax.sharding.Mesh .*got NoneType: None"),
    (
      jax.sharding.AbstractMesh((8,), ("sp",)),
      TypeError,
      r"mesh=AbstractMesh\(.*\) is an AbstractMesh, which has no devices",
    ),
  ],
)
def test_place_on_mesh_errors(mesh, error, match):
  with pytest.raises(error, match=match):
    fr.place_on_mesh({"a": jnp.ones(2)}, mesh)


# -- a ring of one device warns, once ---------------------------------------------------------------------


def _ring_of_one_warnings(build):
  """The RingOfOneWarnings `build()` raises, with the once-per-process key reset first."""
  validation._warned.discard(RING_OF_ONE_KEY)
  with warnings.catch_warnings(record=True) as record:
    warnings.simplefilter("always")
    build()
  return [str(w.message) for w in record if issubclass(w.category, RingOfOneWarning)]


def test_a_ring_of_one_warns_once():
  mesh = make_mesh((1,), ("sp",))

  def build():
    for _ in range(2):
      layer = fr.RingMultiHeadAttention(2, D, mesh=mesh, implementation="xla", rngs=nnx.Rngs(0))
    layer(jnp.ones((1, 8, D)))
    fr.make_ring_attention_fn(mesh=mesh)

  (message,) = _ring_of_one_warnings(build)
  assert issubclass(RingOfOneWarning, UserWarning)
  assert message.startswith("RingMultiHeadAttention: the sequence axis seq_axis='sp' has 1 device"), message
  assert "ring of one" in message and "JAX sees 8 device(s)" in message, message
  assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in message, message


@pytest.mark.parametrize("where", ["make_ring_attention_fn", "convert_mha", "convert_handwritten"])
def test_each_entry_point_warns_for_a_ring_of_one(where):
  mesh = make_mesh((2, 1), ("dp", "sp"))  # a sequence axis of one device on a larger mesh

  def build():
    if where == "make_ring_attention_fn":
      fr.make_ring_attention_fn(mesh=mesh, seq_axis="sp")
    elif where == "convert_mha":
      fr.convert(Model(nnx.Rngs(0)), mesh=mesh, seq_axis="sp")
    else:
      fr.convert(_HandWritten(nnx.Rngs(0)), mesh=mesh, seq_axis="sp")

  (message,) = _ring_of_one_warnings(build)
  first = {
    "make_ring_attention_fn": "make_ring_attention_fn",
    "convert_mha": "RingMultiHeadAttention",
    "convert_handwritten": "convert(to='ring')",
  }[where]
  assert message.startswith(f"{first}: the sequence axis seq_axis='sp' has 1 device"), message


def test_a_ring_of_eight_does_not_warn():
  mesh = make_mesh((8,), ("sp",))

  def build():
    layer = fr.RingMultiHeadAttention(2, D, mesh=mesh, implementation="xla", rngs=nnx.Rngs(0))
    layer(jnp.ones((1, 8, D)))
    fr.make_ring_attention_fn(mesh=mesh)
    fr.convert(Model(nnx.Rngs(0)), mesh=mesh)
    fr.convert(_HandWritten(nnx.Rngs(0)), mesh=mesh)
    fr.RingMultiHeadAttention(2, D, rngs=nnx.Rngs(0))  # no mesh: one device, and no ring asked for

  assert _ring_of_one_warnings(build) == []


def test_a_meshless_layer_in_a_shard_map_of_one_warns():
  """Without a mesh the layer learns the axis size at its first call, inside the caller's shard_map."""
  mesh = make_mesh((1,), ("sp",), explicit=False)
  layer = fr.RingMultiHeadAttention(2, D, seq_axis="sp", implementation="xla", rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(layer)

  def body(x):
    return nnx.merge(graphdef, state)(x)

  run = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(None, "sp"), out_specs=P(None, "sp"), check_vma=False))
  (message,) = _ring_of_one_warnings(lambda: run(jnp.ones((1, 8, D))))
  assert message.startswith("RingMultiHeadAttention: the sequence axis seq_axis='sp' has 1 device"), message


class _HandWritten(nnx.Module):
  """Attention written by hand (for convert's watching of the model's own modules)."""

  def __init__(self, rngs):
    self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)

  def __call__(self, x):
    B, T_, _ = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(B, T_, 3 * 2, D // 2), 3, axis=2)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * (D // 2) ** -0.5
    return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), v).reshape(B, T_, D)

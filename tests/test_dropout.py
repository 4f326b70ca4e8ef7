"""Attention dropout: one keep mask per (key, global batch, head, q position, kv position).

The matrices draw the registry's dropout axis (`DROPOUT` in tests/cases.py: per head or broadcast over heads) on
its causal GQA packed-document cases, through `assert_dropout_matches_reference`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import DROPOUT, assert_dropout_matches_reference, dropout, make_case
from conftest import make_mesh
from flax import nnx

import flax_ringattn as fr
from flax_ringattn._src.testing.interpret import interpret_params, no_races


@pytest.mark.parametrize("kind", ["per-head", "broadcast"])
def test_keep_rate_through_the_op_and_the_reference(kind):
  """q = k = 0 makes every probability 1/S and v = 1 sums them: out * (1 - rate) * S counts the kept keys."""
  B, T, N, H = 2, 256, 4, 8
  q = jnp.zeros((B, T, N, H))
  v = jnp.ones((B, T, N, H))
  rate, broadcast = DROPOUT[kind].rate, DROPOUT[kind].broadcast
  kw = dict(dropout_rate=rate, dropout_rng=jax.random.key(3), broadcast_dropout=broadcast)
  # One device: that the mask does not depend on the ring is the next test's subject.
  ring = jax.jit(lambda q, v: fr.ring_attention(q, q, v, implementation="xla", **kw))(q, v)
  ref = fr.reference_attention(q, q, v, **kw)
  kept = np.asarray(ring[..., 0]) * (1 - rate) * T  # [B, T, N]
  np.testing.assert_allclose(kept, np.round(kept), atol=1e-3)  # whole numbers of kept keys
  np.testing.assert_allclose(np.asarray(ref[..., 0]) * (1 - rate) * T, kept, atol=1e-3)
  # 2 * 4 * 256 * 256 draws (or 256 * 256 with broadcast): within 5 sigma of the keep probability.
  draws = T * T * (1 if broadcast else B * N)
  sigma = np.sqrt(rate * (1 - rate) / draws)
  assert abs(kept.sum() / (B * N * T * T) - (1 - rate)) < 5 * sigma
  same_across_heads = np.array_equal(kept[..., 0], kept[..., 1]) and np.array_equal(kept[0], kept[1])
  assert same_across_heads == broadcast


@pytest.mark.parametrize(
  "mesh_shape,names,axes,load_balance",
  [
    ((8,), ("sp",), {}, True),
    ((2, 2, 2), ("dp", "sp", "tp"), {"batch_axis": "dp", "head_axis": "tp"}, False),
  ],
  ids=["ring8-zigzag", "batch-seq-head-sharded"],
)
def test_forward_and_backward_use_the_same_mask_as_the_reference(mesh_shape, names, axes, load_balance):
  """Ring size, zigzag layout and batch/head sharding do not change the mask; grads regenerate it."""
  mesh = make_mesh(mesh_shape, names)
  n = dict(zip(names, mesh_shape, strict=True))["sp"]
  case = make_case(
    "docs", "segments", "gqa", N=4, group=2, B=2, T=128, load_balance=load_balance, dropout=dropout("per-head", 9)
  )
  assert_dropout_matches_reference(
    mesh,
    "sp",
    n,
    case,
    doc_len=40,
    implementation="xla",
    block_sizes=fr.BlockSizes(block_q=8, block_kv=8),
    **axes,
  )


@pytest.mark.interpret
@pytest.mark.parametrize(
  "implementation,ring,kind,cap",
  [
    ("pallas_tpu", 2, "per-head", None),
    ("pallas_tpu", 1, "broadcast", 30.0),
    ("pallas_tpu_ring", 2, "per-head", None),
  ],
  ids=["block-ring2-per-head", "block-ring1-broadcast-cap", "kernel-ring2-per-head"],
)
def test_pallas_tpu_kernels_hash_the_same_mask(implementation, ring, kind, cap):
  """The TPU kernels hash each tile's keep mask from the global indices (interpret mode, race detector on):
  forward and q/k/v gradients equal the reference's with the same key, on zigzag GQA segments.  Several q tiles
  per shard, so a mask tied to the tile would differ."""
  case = make_case(
    "docs",
    "segments",
    "gqa",
    N=4,
    group=2,
    B=1,
    T=128 * ring,
    load_balance=True,
    soft_cap=cap,
    dropout=dropout(kind, 5),
  )
  with no_races():
    assert_dropout_matches_reference(
      make_mesh((ring,), ("sp",)),
      "sp",
      ring,
      case,
      doc_len=40,
      seed=1,
      implementation=implementation,
      interpret=interpret_params(),
      block_sizes=fr.BlockSizes(block_q=16, block_kv=128),
    )


def test_layer_dropout_follows_nnx_rules():
  layer = fr.RingMultiHeadAttention(4, 16, decode=False, dropout_rate=0.5, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.PRNGKey(0), (1, 32, 16))
  with pytest.raises(ValueError, match="needs deterministic=... in the call or the constructor"):
    layer(x)
  det = layer(x, deterministic=True)
  a, b = layer(x, deterministic=False), layer(x, deterministic=False)
  assert not np.allclose(a, b)  # the layer's rng stream advances
  assert not np.allclose(a, det)
  layer.eval()
  np.testing.assert_array_equal(layer(x), det)
  # rngs= in the call, as in nnx.MultiHeadAttention (keep_rngs=False needs it).
  bare = fr.RingMultiHeadAttention(4, 16, decode=False, dropout_rate=0.5, keep_rngs=False, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="rngs=... must be given to __call__"):
    bare(x, deterministic=False)
  c, d = bare(x, deterministic=False, rngs=nnx.Rngs(dropout=1)), bare(x, deterministic=False, rngs=nnx.Rngs(dropout=1))
  np.testing.assert_array_equal(c, d)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(dropout_rate=1.0, dropout_rng=jax.random.key(0)), ValueError, r"dropout_rate=1.0 must be in \[0, 1\)"),
    (dict(dropout_rate="0.1"), TypeError, "dropout_rate must be a Python float, got str"),
    (dict(dropout_rate=0.1), ValueError, r"dropout_rate > 0 needs dropout_rng=\.\.\."),
  ],
  ids=["rate", "type", "no-rng"],
)
def test_dropout_errors(kwargs, error, match):
  x = jnp.zeros((1, 16, 2, 8))
  with pytest.raises(error, match=match):
    fr.ring_attention(x, x, x, **kwargs)


@pytest.mark.parametrize("implementation", ["xla", "pallas_tpu", "pallas_gpu"])
def test_block_backends_refuse_a_rate_without_the_operand(implementation):
  """Block contract: dropout_rate > 0 without dropout= is an error in every backend, never dropout skipped."""
  from flax_ringattn._src import masks
  from flax_ringattn._src.backends.base import AttentionSpec
  from flax_ringattn._src.ring.implementations import get_backend

  spec = AttentionSpec(mask=masks.MaskSpec(is_causal=True), scale=0.25, dropout_rate=0.1)
  q = k = v = jnp.zeros((1, 128, 1, 16))
  pos = jnp.arange(128, dtype=jnp.int32)
  interpret = {"xla": None, "pallas_tpu": interpret_params(), "pallas_gpu": True}[implementation]
  backend = get_backend(implementation, dtype=q.dtype, spec=spec, shapes=(q.shape, k.shape), interpret=interpret)
  lse = jnp.zeros((1, 1, 128))
  match = r"dropout_rate=0\.1 needs the int32\[4\] dropout= operand"
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(lambda q, k, v: backend.fwd(q, k, v, masks.Tokens(pos), masks.Tokens(pos), spec=spec), q, k, v)
  with pytest.raises(ValueError, match=match):
    jax.eval_shape(
      lambda q, k, v: backend.bwd(q, k, v, q, lse, lse, masks.Tokens(pos), masks.Tokens(pos), spec=spec), q, k, v
    )


@pytest.mark.parametrize(
  "strategy,mesh_shape,names,axis_name,head_axis",
  [
    ("ulysses", (4, 2), ("sp", "tp"), "sp", "tp"),
    ("all_gather", (4,), ("sp",), "sp", None),
    ("ulysses_ring", (2, 2, 2), ("ring", "uly", "tp"), ("ring", "uly"), "tp"),
  ],
  ids=["ulysses-head-sharded", "all_gather", "ulysses_ring-head-sharded"],
)
def test_every_strategy_drops_the_same_probabilities(strategy, mesh_shape, names, axis_name, head_axis):
  """The mask follows the global head through the Ulysses all-to-all (and a head_axis on top of it) and the
  gathered K/V: forward and gradients equal the reference's with the same key, zigzag, GQA and segments."""
  sizes = dict(zip(names, mesh_shape, strict=True))
  n = int(np.prod([sizes[a] for a in (axis_name if isinstance(axis_name, tuple) else (axis_name,))]))
  case = make_case("docs", "segments", "gqa", N=8, B=1, T=64, H=8, load_balance=True, dropout=dropout("per-head", 4))
  assert_dropout_matches_reference(
    make_mesh(mesh_shape, names),
    axis_name,
    n,
    case,
    doc_len=20,
    seed=2,
    head_axis=head_axis,
    strategy=strategy,
    implementation="xla",
    block_sizes=fr.BlockSizes(block_q=8, block_kv=8),
  )


def test_dropout_with_sinks_matches_the_reference():
  """Dropout acts on the probabilities normalised with the sink in the denominator (the sink's share is never
  dropped): forward and every gradient, dsinks included, against the reference on a ring of 4 (xla)."""
  import jax
  import jax.numpy as jnp
  from conftest import make_mesh
  from tolerances import assert_close

  import flax_ringattn as fr

  ks = jax.random.split(jax.random.key(3), 5)
  q, k, v, do = (jax.random.normal(x, (2, 32, 4, 8)) for x in ks[:4])
  sinks = 1.0 + jax.random.normal(ks[4], (4,))
  kw = dict(is_causal=True, dropout_rate=0.25, dropout_rng=jax.random.key(9), broadcast_dropout=False)
  mesh = make_mesh((4,), ("sp",))
  op = jax.jit(lambda q, k, v, s: fr.ring_attention(q, k, v, mesh=mesh, implementation="xla", sinks=s, **kw))
  out, vjp = jax.vjp(op, q, k, v, sinks)
  ref, ref_vjp = jax.vjp(lambda q, k, v, s: fr.reference_attention(q, k, v, sinks=s, **kw), q, k, v, sinks)
  assert_close(out, ref, jnp.float32)
  assert_close(vjp(do), ref_vjp(do), jnp.float32, "grad")

"""Contracts of the ring/dense public API that a fuzzing of it found broken (issue 30), one section each.

* windows never overflow: any `local_window_size` (2**31 - 1, 10**12, one huge side) is clamped to
  `validation.MAX_WINDOW` once, so the result is the dense float64 oracle's (`tests/dense_oracle.py`);
* empty inputs (B, T, N or S = 0) give empty (S = 0: all-zero) outputs of the right shape, and zero gradients;
* `dropout_rng` must be one jax.random key, `dropout_rate` in [0, 1);
* length and head-count errors show the shapes and the [B, T, N, H] layout;
* an eager call with a mesh compiles once per configuration and shapes;
* the layers and `make_ring_attention_fn` check their arguments when they are built.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import jax_events, make_mesh
from dense_oracle import dense_oracle
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import masks, validation
from flax_ringattn._src.nnx.common import check_layer_arguments

F32 = jnp.float32
B, S, N, K, H = 2, 16, 4, 2, 8


def _qkv(B=B, T=S, S=S, N=N, K=K, H=H, seed=0):
  ks = jax.random.split(jax.random.key(seed), 3)
  return (
    jax.random.normal(ks[0], (B, T, N, H), F32),
    jax.random.normal(ks[1], (B, S, K, H), F32),
    jax.random.normal(ks[2], (B, S, K, H), F32),
  )


def _mesh4():
  return make_mesh((4,), ("sp",))


def _ring(q, k, v, **kw):
  return fr.ring_attention(q, k, v, mesh=_mesh4(), implementation="xla", **kw)


def _dense(q, k, v, **kw):
  return fr.dot_product_attention(q, k, v, mesh=_mesh4(), implementation="xla", **kw)


OPS = {"ring_mesh": _ring, "reference": fr.reference_attention, "dot_product_attention": _dense}


# --------------------------------------------------------------------------------------------
# 1. Windows never overflow
# --------------------------------------------------------------------------------------------

# Windows that cover the whole sequence (S = 16 tokens) on the side(s) they name: the smallest that does, and
# the ones past int32 (S and S + 1 behave as S - 1 and as 2**31 - 1: the op clamps, it does not branch on them).
HUGE = [S - 1, 2**31 - 1, 10**12, (2**31 - 1, 0), (0, 2**31 - 1), (10**12, 2**31 - 1)]


@pytest.mark.parametrize("window", HUGE, ids=str)
def test_normalize_window_clamps_each_side(window):
  left, right = (window, window) if isinstance(window, int) else window
  assert validation.normalize_window(window) == (min(left, 2**30), min(right, 2**30))
  assert validation.MAX_WINDOW == 2**30


@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("window", HUGE, ids=str)
@pytest.mark.parametrize("op", list(OPS))
def test_huge_window_matches_the_oracle(op, window, is_causal):
  """A window of S - 1 or more tokens on a side is no limit on that side: (w, w) equals no window, (w, 0) causal,
  (0, w) with is_causal=True the diagonal (it was all zeros: `i + right` overflowed int32)."""
  q, k, v = _qkv()
  out = OPS[op](q, k, v, is_causal=is_causal, local_window_size=window)
  want, _ = dense_oracle(q, k, v, is_causal=is_causal, local_window_size=window)
  assert_close(out, want, F32)
  if isinstance(window, int):  # covers everything: the same as no window at all
    unwindowed, _ = dense_oracle(q, k, v, is_causal=is_causal)
    assert_close(out, unwindowed, F32)
  elif window == (2**31 - 1, 0):  # every earlier key: causal, whatever is_causal says
    assert_close(out, dense_oracle(q, k, v, is_causal=True)[0], F32)


def test_huge_window_gradients_match_the_unwindowed_ones():
  q, k, v = _qkv()
  do = jax.random.normal(jax.random.key(7), q.shape, F32)
  mesh = make_mesh((4,), ("sp",), explicit=False)

  def grads(window):
    f = lambda q, k, v: fr.ring_attention(  # noqa: E731
      q, k, v, mesh=mesh, implementation="xla", is_causal=True, local_window_size=window
    )

    @jax.jit
    def fwd_bwd(q, k, v, do):
      out, vjp = jax.vjp(f, q, k, v)
      return out, vjp(do)

    return fwd_bwd(q, k, v, do)

  want = dense_oracle(q, k, v, do=do, is_causal=True)
  for window in (2**31 - 1, 10**12, (2**31 - 1, 0)):
    out, g = grads(window)
    assert_close(out, want[0], F32)
    assert_close(g, want[1], F32, "grad")


@pytest.mark.parametrize("window", [2**31 - 1, 10**12, (2**31 - 1, 2**31 - 1)], ids=str)
def test_dense_mask_recovery_takes_huge_windows(window):
  """`dense_mask_from_structure` and `structure_from_dense_mask` clamp the window as the ops do."""
  ids = jnp.zeros((1, S), jnp.int32)
  causal = jnp.tril(jnp.ones((S, S), bool))[None, None]
  np.testing.assert_array_equal(fr.dense_mask_from_structure(True, ids, ids, local_window_size=window), causal)
  is_causal, _, _, exact, _ = fr.structure_from_dense_mask(causal, local_window_size=window)
  assert bool(is_causal) and bool(exact)


def test_tile_kinds_do_not_overflow_at_the_largest_positions():
  """Positions just under 2**30 and the widest window: `pos + right` and `pos - left` stay inside int32."""
  spec = masks.MaskSpec(is_causal=False, window=validation.normalize_window(2**31 - 1))
  pos = jnp.arange(2**30 - 16, 2**30, dtype=jnp.int32)
  kinds = masks.tile_kinds(spec, masks.Tokens(pos), masks.Tokens(pos[::-1]), 4, 4)
  np.testing.assert_array_equal(kinds, masks.FULL)
  assert bool(masks.visible(spec, masks.Tokens(pos), masks.Tokens(pos)).all())


def test_sequences_longer_than_the_widest_window_are_refused():
  """Positions are int32 and a window side is clamped to 2**30: a longer sequence is refused up front (checked on
  abstract shapes: nothing is allocated)."""
  big = jax.ShapeDtypeStruct((1, 2**30 + 8, 1, 8), F32)
  with pytest.raises(NotImplementedError, match=r"more than 2\*\*30 = 1073741824 tokens .*got q_len T=1073741832"):
    jax.eval_shape(lambda q: fr.reference_attention(q, q, q), big)


def test_layer_with_a_huge_window_matches_the_unwindowed_layer():
  x = jax.random.normal(jax.random.key(3), (1, S, 16), F32)
  plain = fr.RingMultiHeadAttention(2, 16, rngs=nnx.Rngs(0))
  huge = fr.RingMultiHeadAttention(2, 16, local_window_size=10**12, rngs=nnx.Rngs(0))
  assert_close(huge(x, is_causal=True), plain(x, is_causal=True), F32)


# --------------------------------------------------------------------------------------------
# 2. Empty inputs: empty outputs, zero gradients
# --------------------------------------------------------------------------------------------

# (B, T, S, N): no batch row, no query, no key and no query, no key (rows see nothing: zeros), no q head.
EMPTY = {"B0": (0, 8, 8, 4), "T0_S0": (2, 0, 0, 4), "S0": (2, 8, 0, 4), "T0": (2, 0, 8, 4), "N0": (2, 8, 8, 0)}


def _ring_in_shard_map(q, k, v):
  mesh, spec = make_mesh((4,), ("sp",), explicit=False), P(None, "sp")
  body = lambda q, k, v: fr.ring_attention(q, k, v, axis_name="sp", implementation="xla")  # noqa: E731
  return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))(q, k, v)


EMPTY_OPS = {
  "ring_local": lambda q, k, v: fr.ring_attention(q, k, v, implementation="xla"),
  "ring_mesh": _ring,
  "ring_shard_map": _ring_in_shard_map,
  "reference": fr.reference_attention,
  "dot_product_attention": _dense,
}


@pytest.mark.parametrize("dims", list(EMPTY.values()), ids=list(EMPTY))
@pytest.mark.parametrize("op", list(EMPTY_OPS))
def test_empty_inputs_give_empty_outputs_and_zero_gradients(op, dims):
  b, t, s, n = dims
  q, k, v = _qkv(B=b, T=t, S=s, N=n, K=2 if n else 1)
  v = v[..., :6]  # v's head dim is the output's
  fn = EMPTY_OPS[op]
  # An eager grad on Explicit mesh axes needs the mesh set (a JAX rule, empty or not).
  with jax.set_mesh(_mesh4()) if op in ("ring_mesh", "dot_product_attention") else contextlib.nullcontext():
    out = fn(q, k, v)
    grads = jax.grad(lambda q, k, v: fn(q, k, v).sum(), argnums=(0, 1, 2))(q, k, v)
  assert out.shape == (b, t, n, 6) and out.dtype == q.dtype
  np.testing.assert_array_equal(out, 0.0)
  for g, x in zip(grads, (q, k, v), strict=True):
    assert g.shape == x.shape
    np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("dims", list(EMPTY.values()), ids=list(EMPTY))
@pytest.mark.parametrize("implementation", fr.available_implementations("ring"))
def test_empty_inputs_run_no_kernel_on_any_implementation(implementation, dims):
  """No backend is asked to run an empty call (pallas_gpu would refuse N=0: no power-of-two q heads per kv head)."""
  b, t, s, n = dims
  q, k, v = _qkv(B=b, T=t, S=s, N=n, K=2 if n else 1)
  out = fr.ring_attention(q, k, v, implementation=implementation, interpret=None if implementation == "xla" else True)
  assert out.shape == (b, t, n, H)
  np.testing.assert_array_equal(out, 0.0)


def test_empty_inputs_match_jax_nn():
  q, k, v = _qkv(T=0, S=0)
  ours = fr.reference_attention(q, k, v, is_causal=True)
  assert ours.shape == jax.nn.dot_product_attention(q, k, v, is_causal=True).shape == (B, 0, N, H)


@pytest.mark.parametrize("op", list(EMPTY_OPS))
def test_empty_inputs_are_still_checked(op):
  q, k, v = _qkv(T=0, S=0, N=3, K=2)
  with pytest.raises(ValueError, match=r"the number of q heads N=3 must be a multiple of the number of kv heads K=2"):
    EMPTY_OPS[op](q, k, v)
  q, k, v = _qkv(B=0)
  with pytest.raises(ValueError, match=r"head_dim differs: q\.shape\[3\]=8 but k\.shape\[3\]=4"):
    EMPTY_OPS[op](q, k[..., :4], v)


def test_empty_inputs_still_check_the_mesh():
  q, k, v = _qkv(T=0, S=0)
  with pytest.raises(ValueError, match=r"batch size B=3 must be a multiple of the 'dp' mesh axis size 2"):
    fr.ring_attention(*_qkv(B=3, T=0, S=0), mesh=make_mesh((2, 4), ("dp", "sp")), axis_name="sp", batch_axis="dp")
  with pytest.raises(ValueError, match=r"dropout_rate=1\.5 must be in \[0, 1\)"):
    _ring(q, k, v, dropout_rate=1.5)


def test_zero_head_dim_is_rejected():
  q, k, v = _qkv(H=0)
  with pytest.raises(ValueError, match=r"q and k's head dim H must be positive, got q\.shape=\(2, 16, 4, 0\)"):
    fr.reference_attention(q, k, v)


def test_empty_dense_mask_is_recovered():
  q, k, v = _qkv(T=0, S=0)
  out = _dense(q, k, v, mask=jnp.ones((B, 1, 0, 0), bool))
  assert out.shape == (B, 0, N, H)
  is_causal, q_ids, kv_ids, exact, _ = fr.structure_from_dense_mask(jnp.ones((B, 0, 0), bool))
  assert bool(exact) and q_ids.shape == kv_ids.shape == (B, 0)


@pytest.mark.parametrize("mesh", [False, True], ids=["one_device", "mesh"])
@pytest.mark.parametrize("shape", [(1, 0, 16), (0, 8, 16)], ids=["T0", "B0"])
def test_layer_on_empty_inputs(shape, mesh):
  mesh = _mesh4() if mesh else None
  layer = fr.RingMultiHeadAttention(2, 16, out_features=12, mesh=mesh, implementation="xla", rngs=nnx.Rngs(0))
  x = jnp.ones(shape, F32)
  with jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext():
    out = layer(x, is_causal=True)
    grads = nnx.grad(lambda m, x: m(x).sum())(layer, x)
  assert out.shape == (*shape[:2], 12)
  for g in jax.tree.leaves(grads):
    np.testing.assert_array_equal(g, 0.0)


# --------------------------------------------------------------------------------------------
# 3. dropout_rng and dropout_rate
# --------------------------------------------------------------------------------------------

BAD_KEYS = {
  "int": (0, r"got int 0"),
  "float": (1.5, r"got float 1\.5"),
  "float_array": (jnp.zeros(2), r"got an array of shape \(2,\) and dtype float32"),
  "uint32_3": (jnp.zeros(3, jnp.uint32), r"got an array of shape \(3,\) and dtype uint32"),
  "two_keys": (jax.random.split(jax.random.key(0), 2), r"got an array of shape \(2,\) and dtype key<fry>"),
}


@pytest.mark.parametrize("op", ["ring_local", "ring_mesh", "reference"])
@pytest.mark.parametrize("name", list(BAD_KEYS))
def test_dropout_rng_must_be_one_key(name, op):
  rng, got = BAD_KEYS[name]
  fn = {"ring_local": fr.ring_attention, "ring_mesh": _ring, "reference": fr.reference_attention}[op]
  with pytest.raises(
    TypeError, match=rf"dropout_rng must be one jax\.random key, {got}: pass jax\.random\.key\(seed\)"
  ):
    fn(*_qkv(), dropout_rate=0.1, dropout_rng=rng)


def test_dropout_rng_legacy_key_is_the_typed_key():
  q, k, v = _qkv()
  typed = fr.ring_attention(q, k, v, dropout_rate=0.25, dropout_rng=jax.random.key(5))
  legacy = fr.ring_attention(q, k, v, dropout_rate=0.25, dropout_rng=jax.random.PRNGKey(5))
  np.testing.assert_array_equal(typed, legacy)


def test_dropout_rng_under_jit_is_checked_at_trace():
  q, k, v = _qkv()
  with pytest.raises(TypeError, match=r"dropout_rng must be one jax\.random key, got an array of shape \(\)"):
    jax.jit(lambda r: fr.ring_attention(q, k, v, dropout_rate=0.1, dropout_rng=r))(jnp.int32(3))


@pytest.mark.parametrize(
  "rate,error,match",
  [
    (-0.1, ValueError, r"dropout_rate=-0\.1 must be in \[0, 1\)"),
    (1.0, ValueError, r"dropout_rate=1\.0 must be in \[0, 1\)"),
    (float("nan"), ValueError, r"dropout_rate=nan must be in \[0, 1\)"),
    ("0.1", TypeError, r"dropout_rate must be a Python float, got str '0\.1'"),
    (jnp.float32(0.1), TypeError, r"dropout_rate must be a Python float, got "),
  ],
  ids=["negative", "one", "nan", "str", "jax"],
)
def test_dropout_rate_range(rate, error, match):
  for fn in (fr.ring_attention, fr.reference_attention):
    with pytest.raises(error, match=match):
      fn(*_qkv(), dropout_rate=rate, dropout_rng=jax.random.key(0))
  with pytest.raises(error, match=match):
    fr.RingMultiHeadAttention(2, 16, dropout_rate=rate, rngs=nnx.Rngs(0))


# --------------------------------------------------------------------------------------------
# 4. Length and head errors show the shapes and the layout
# --------------------------------------------------------------------------------------------

_LAYOUT = r"q is \[B, T, N, H\] and k/v \[B, S, K, H\] \(if your arrays are \[B, N, T, H\], swap axes 1 and 2\)"


def test_transposed_layout_is_hinted_with_a_mesh():
  q, k, v = (x.transpose(0, 2, 1, 3) for x in _qkv(B=1, N=2, K=2))  # [B, N, T, H]: T reads as 2
  with pytest.raises(
    ValueError,
    match=r"global q_len=2 must be a multiple of 4 .*; got q\.shape=\(1, 2, 16, 8\), k\.shape=\(1, 2, 16, 8\): "
    + _LAYOUT,
  ):
    _ring(q, k, v)


def test_transposed_layout_is_hinted_inside_shard_map():
  mesh, spec = _mesh4(), P(None, "sp")
  qkv = (x.transpose(0, 2, 1, 3) for x in _qkv(B=1, T=8, S=8, N=12, K=12))  # [B, N, T, H]: 3 "tokens" a shard
  q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in qkv)
  fn = jax.shard_map(
    lambda q, k, v: fr.ring_attention(q, k, v, axis_name="sp", load_balance=True),
    mesh=mesh,
    in_specs=(spec,) * 3,
    out_specs=spec,
  )
  with pytest.raises(
    ValueError, match=r"local shard q_len=3 must be a multiple of 2 .*; got q\.shape=\(1, 3, 8, 8\), .*" + _LAYOUT
  ):
    fn(q, k, v)


def test_ulysses_head_error_shows_the_shapes():
  q, k, v = _qkv(B=1, N=6, K=2)
  with pytest.raises(ValueError, match=r"the number of q heads N=6 must be a multiple of 4 .*; got q\.shape=\(1, 16"):
    _ring(q, k, v, strategy="ulysses")


def test_layer_length_error_shows_the_inputs():
  layer = fr.RingMultiHeadAttention(2, 16, mesh=_mesh4(), rngs=nnx.Rngs(0))
  with pytest.raises(
    ValueError,
    match=r"global q_len=6 must be a multiple of 4 .*got inputs_q\.shape=\(1, 6, 16\), .*\[B, T, features\]",
  ):
    layer(jnp.ones((1, 6, 16)))


# --------------------------------------------------------------------------------------------
# 5. Eager calls compile once per configuration and shapes
# --------------------------------------------------------------------------------------------

_TRACE, _COMPILE = "/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/backend_compile_duration"


def _compiles_of(call):
  with jax_events() as events:
    jax.block_until_ready(call())
  return events.count(_TRACE), events.count(_COMPILE)


def _assert_compiles_once(call, other_shape):
  _compiles_of(call)  # the first call may compile
  assert _compiles_of(call) == (0, 0), "a second eager call with the same shapes traced or compiled again"
  traces, _ = _compiles_of(other_shape)
  assert traces >= 1, "a call with a new shape must trace"


@pytest.mark.parametrize("load_balance", [False, True])
def test_eager_ring_on_a_mesh_compiles_once(load_balance):
  mesh = _mesh4()
  q, k, v = _qkv(T=24, S=24, seed=1)
  q2, k2, v2 = _qkv(T=40, S=40, seed=2)
  kw = dict(mesh=mesh, implementation="xla", is_causal=True, load_balance=load_balance, local_window_size=2**31 - 1)
  _assert_compiles_once(lambda: fr.ring_attention(q, k, v, **kw), lambda: fr.ring_attention(q2, k2, v2, **kw))


def test_eager_dot_product_attention_compiles_once():
  mesh = _mesh4()
  q, k, v = _qkv(T=24, S=24, seed=3)
  q2, k2, v2 = _qkv(T=48, S=48, seed=4)
  mask = lambda t: jnp.tril(jnp.ones((t, t), bool))  # noqa: E731
  _assert_compiles_once(
    lambda: fr.dot_product_attention(q, k, v, mesh=mesh, mask=mask(24), implementation="xla"),
    lambda: fr.dot_product_attention(q2, k2, v2, mesh=mesh, mask=mask(48), implementation="xla"),
  )


@pytest.mark.parametrize("kind", ["layer", "attention_fn"])
def test_eager_layers_on_a_mesh_compile_once(kind):
  mesh = _mesh4()
  if kind == "layer":
    layer = fr.RingMultiHeadAttention(2, 16, mesh=mesh, implementation="xla", rngs=nnx.Rngs(0))
  else:
    fn = fr.make_ring_attention_fn(mesh=mesh, is_causal=True, implementation="xla")
    layer = nnx.MultiHeadAttention(2, 16, attention_fn=fn, decode=False, rngs=nnx.Rngs(0))
  x, x2 = jnp.ones((1, 28, 16)), jnp.ones((1, 44, 16))
  _assert_compiles_once(lambda: layer(x), lambda: layer(x2))


# --------------------------------------------------------------------------------------------
# 6. The layers check their arguments when they are built
# --------------------------------------------------------------------------------------------

SIZES = dict(num_heads=2, in_features=16, qkv_features=None, out_features=None, num_kv_heads=None, in_kv_features=None)


@pytest.mark.parametrize(
  "changes,error,match",
  [
    (dict(num_heads=0), ValueError, r"num_heads must be a positive int, got num_heads=0"),
    (dict(num_heads=-2), ValueError, r"num_heads must be a positive int, got num_heads=-2"),
    (dict(in_features=-1), ValueError, r"in_features must be a positive int, got in_features=-1"),
    (dict(qkv_features=0), ValueError, r"qkv_features must be a positive int or None, got qkv_features=0"),
    (dict(out_features=-3), ValueError, r"out_features must be a positive int or None, got out_features=-3"),
    (dict(num_kv_heads=0), ValueError, r"num_kv_heads must be a positive int or None, got num_kv_heads=0"),
    (dict(in_kv_features=0), ValueError, r"in_kv_features must be a positive int or None, got in_kv_features=0"),
    (dict(num_heads=2.0), TypeError, r"num_heads must be a positive int, got num_heads=2\.0 \(float\)"),
    (dict(num_heads=True), TypeError, r"num_heads must be a positive int, got num_heads=True \(bool\)"),
    (dict(in_features="16"), TypeError, r"in_features must be a positive int, got in_features='16' \(str\)"),
    (dict(qkv_features=12, num_heads=5), ValueError, r"qkv_features=12 must be a multiple of num_heads=5"),
    (dict(num_heads=3), ValueError, r"qkv_features \(default in_features=16\) must be a multiple of num_heads=3"),
    (dict(num_heads=4, num_kv_heads=3), ValueError, r"num_heads=4 must be a multiple of num_kv_heads=3 \(GQA"),
  ],
)
def test_layer_sizes_are_checked_at_construction(changes, error, match):
  sizes = {**SIZES, **changes}
  with pytest.raises(error, match=r"RingMultiHeadAttention: " + match):
    fr.RingMultiHeadAttention(**sizes, rngs=nnx.Rngs(0))
  with pytest.raises(error, match=r"PagedMultiHeadAttention: " + match):
    check_layer_arguments("PagedMultiHeadAttention", **sizes)


OPTIONS = [
  (dict(implementation="bogus"), ValueError, r"unknown implementation='bogus'; available implementations: "),
  (dict(implementation=1), TypeError, r"implementation must be a string or None, got 1"),
  (dict(strategy="tree"), ValueError, r"unknown strategy='tree'; choose one of"),
  (dict(local_window_size=-1), ValueError, r"local_window_size must be non-negative, got local_window_size=-1"),
  (dict(local_window_size=1.5), TypeError, r"local_window_size must be an int or a \(left, right\) pair"),
  (dict(logits_soft_cap=0.0), ValueError, r"logits_soft_cap must be > 0 and finite .*logits_soft_cap=0\.0"),
  (dict(logits_soft_cap="30"), TypeError, r"logits_soft_cap must be a positive float, got '30'"),
  (dict(block_sizes=(128, 128)), TypeError, r"block_sizes must be a flax_ringattn\.BlockSizes, got tuple"),
  (dict(scale=float("nan")), ValueError, r"scale must be finite, got scale=nan"),
  (dict(load_balance=1), TypeError, r"load_balance must be a bool, got 1"),
  (dict(check_mask="yes"), TypeError, r"check_mask must be a bool or 'report', got 'yes'"),
]


@pytest.mark.parametrize("changes,error,match", OPTIONS)
def test_layer_options_are_checked_at_construction(changes, error, match):
  with pytest.raises(error, match=match):
    fr.RingMultiHeadAttention(2, 16, rngs=nnx.Rngs(0), **changes)


@pytest.mark.parametrize("changes,error,match", OPTIONS)
def test_attention_fn_options_are_checked_when_made(changes, error, match):
  with pytest.raises(error, match=match):
    fr.make_ring_attention_fn(**changes)


def test_every_registered_implementation_is_accepted_at_construction():
  for name in fr.available_implementations("ring"):
    fr.make_ring_attention_fn(implementation=name)

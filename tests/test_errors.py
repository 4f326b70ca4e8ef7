"""Every error of the public API: exception type and a meaningful part of the message."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_ringattn import (
  BlockSizes,
  reference_attention,
  ring_attention,
  zigzag_inverse,
  zigzag_order,
  zigzag_positions,
)

B, T, N, K, H = 2, 8, 4, 2, 4


def _qkv(T=T, S=None, N=N, K=K, H=H, B=B, dtype=jnp.float32):
  S = T if S is None else S
  return jnp.ones((B, T, N, H), dtype), jnp.ones((B, S, K, H), dtype), jnp.ones((B, S, K, H), dtype)


def _ring_mesh(q, k, v, **kw):
  return ring_attention(q, k, v, mesh=make_mesh((4,), ("sp",)), axis_name="sp", **kw)


# The argument checks shared by both ops (validation.py) run through each front end.
OPS = {
  "reference": reference_attention,
  "ring_local": ring_attention,  # one device: axis_name=None, mesh=None
  "ring_mesh": _ring_mesh,
}


@pytest.fixture(params=list(OPS))
def op(request):
  return OPS[request.param]


# --------------------------------------------------------------------------------------------
# q / k / v (validation.check_qkv)
# --------------------------------------------------------------------------------------------


def test_not_an_array(op):
  q, k, v = _qkv()
  with pytest.raises(TypeError, match=r"q must be an array, got list"):
    op(np.ones((B, T, N, H)).tolist(), k, v)
  with pytest.raises(TypeError, match=r"v must be an array, got float"):
    op(q, k, 1.0)


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(B, T, N), (B, T, N, H, 1), (T,)])
def test_wrong_rank(op, which, shape):
  args = dict(zip("qkv", _qkv(), strict=True))
  args[which] = jnp.ones(shape)
  with pytest.raises(ValueError, match=rf"{which} must have rank 4 .*got {which}\.shape={re.escape(str(shape))}"):
    op(args["q"], args["k"], args["v"])


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64])
def test_non_float_dtype(op, which, dtype):
  args = dict(zip("qkv", _qkv(), strict=True))
  args[which] = args[which].astype(dtype)
  with pytest.raises(TypeError, match=rf"{which} must be a floating-point array, got {which}\.dtype="):
    op(args["q"], args["k"], args["v"])


def test_mismatched_dtypes(op):
  q, k, v = _qkv()
  with pytest.raises(TypeError, match=r"q, k and v must share a dtype, got q\.dtype=bfloat16, k\.dtype=float32"):
    op(q.astype(jnp.bfloat16), k, v)
  with pytest.raises(TypeError, match=r"must share a dtype.*v\.dtype=float16"):
    op(q, k, v.astype(jnp.float16))


def test_kv_shape_mismatch(op):
  q, k, _ = _qkv()
  v = jnp.ones((B, T + 1, K, H))
  with pytest.raises(ValueError, match=r"k and v must have the same \[B, S, K\].*v\.shape=\(2, 9, 2, 4\)"):
    op(q, k, v)


def test_sinks_errors(op):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=r"sinks must have shape \[N\]=\(4,\), one logit per q head .*got \(2,\)"):
    op(q, k, v, sinks=jnp.zeros((K,)))
  with pytest.raises(TypeError, match=r"sinks must be a floating-point array, got sinks\.dtype=int32"):
    op(q, k, v, sinks=jnp.zeros((N,), jnp.int32))
  with pytest.raises(TypeError, match=r"sinks must be a float array of shape \[N\]=\(4,\)"):
    op(q, k, v, sinks=[0.0] * N)


def test_v_head_dim_may_differ(op):
  q, k, _ = _qkv()
  out = op(q, k, jnp.ones((B, T, K, H + 3)))
  assert out.shape == (B, T, N, H + 3)


def test_batch_mismatch(op):
  q, _, _ = _qkv()
  _, k, v = _qkv(B=4)
  with pytest.raises(ValueError, match=r"batch sizes differ: q\.shape\[0\]=2 but k\.shape\[0\]=4"):
    op(q, k, v)


def test_head_dim_mismatch(op):
  q, _, _ = _qkv()
  _, k, v = _qkv(H=8)
  with pytest.raises(ValueError, match=r"head_dim differs: q\.shape\[3\]=4 but k\.shape\[3\]=8"):
    op(q, k, v)


@pytest.mark.parametrize("n_q,n_kv", [(4, 3), (2, 4), (4, 0)])
def test_heads_not_multiple(op, n_q, n_kv):
  q, _, _ = _qkv(N=n_q)
  _, k, v = _qkv(K=n_kv)
  with pytest.raises(ValueError, match=rf"q heads N={n_q} must be a multiple of the number of kv heads K={n_kv}"):
    op(q, k, v)


# --------------------------------------------------------------------------------------------
# Mask and logit options (validation.normalize_window / check_soft_cap / check_scale / segment ids)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window", [-1, (-1, 2), (2, -3), [0, -1]])
def test_window_negative(op, window):
  with pytest.raises(ValueError, match=r"local_window_size must be non-negative"):
    op(*_qkv(), local_window_size=window)


@pytest.mark.parametrize("window", [1.5, "3", True, (1, 2, 3), (1,), (1.0, 2), (1, True), {1: 2}])
def test_window_wrong_type(op, window):
  with pytest.raises(TypeError, match=r"local_window_size must be an int or a \(left, right\) pair of ints"):
    op(*_qkv(), local_window_size=window)


@pytest.mark.parametrize("cap", [0, 0.0, -1.0, float("nan")])
def test_soft_cap_not_positive(op, cap):
  with pytest.raises(ValueError, match=r"logits_soft_cap must be > 0"):
    op(*_qkv(), logits_soft_cap=cap)


@pytest.mark.parametrize("cap", ["30", True, jnp.array(30.0), (30.0,)])
def test_soft_cap_wrong_type(op, cap):
  with pytest.raises(TypeError, match=r"logits_soft_cap must be a positive float"):
    op(*_qkv(), logits_soft_cap=cap)


def test_soft_cap_infinite_is_rejected(op):
  with pytest.raises(ValueError, match=r"logits_soft_cap"):
    op(*_qkv(), logits_soft_cap=float("inf"))


@pytest.mark.parametrize("scale", [jnp.float32(0.5), jnp.array(0.5), jnp.array([0.5])])
def test_scale_as_jax_array(op, scale):
  with pytest.raises(TypeError, match=r"scale must be a Python float \(it is baked into the kernel\)"):
    op(*_qkv(), scale=scale)


@pytest.mark.parametrize("scale", ["0.5", True, np.array([0.5])])
def test_scale_wrong_type(op, scale):
  with pytest.raises(TypeError, match=r"scale must be a Python float"):
    op(*_qkv(), scale=scale)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_scale_not_finite(op, scale):
  with pytest.raises(ValueError, match=r"scale must be finite"):
    op(*_qkv(), scale=scale)


def test_scale_under_jit_is_rejected():
  # A traced scale would have to be baked into the kernel: rejected with the same message.
  q, k, v = _qkv()
  with pytest.raises(TypeError, match=r"scale must be a Python float"):
    jax.jit(lambda q, k, v, s: ring_attention(q, k, v, scale=s))(q, k, v, 0.5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bool_])
def test_segment_ids_wrong_dtype(op, dtype):
  seg = jnp.zeros((B, T), dtype)
  with pytest.raises(TypeError, match=r"q segment_ids must be an integer array, got dtype="):
    op(*_qkv(), segment_ids=seg)
  ints = jnp.zeros((B, T), jnp.int32)
  with pytest.raises(TypeError, match=r"kv segment_ids must be an integer array"):
    op(*_qkv(), segment_ids=(ints, seg))


@pytest.mark.parametrize("shape", [(B,), (B, T - 2), (B + 1, T), (B, T, 1)])
def test_segment_ids_wrong_shape(op, shape):
  seg = jnp.zeros(shape, jnp.int32)
  with pytest.raises(
    ValueError, match=rf"q segment_ids must have shape \[B, T\]=\({B}, {T}\), got {re.escape(str(shape))}"
  ):
    op(*_qkv(), segment_ids=seg)


def test_kv_segment_ids_wrong_shape(op):
  q, k, v = _qkv(S=16)
  q_ids, kv_ids = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, 12), jnp.int32)
  with pytest.raises(ValueError, match=r"kv segment_ids must have shape \[B, S\]=\(2, 16\), got \(2, 12\)"):
    op(q, k, v, segment_ids=(q_ids, kv_ids))


def test_kv_segment_ids_message_says_S_when_T_equals_S():
  q_ids, kv_ids = jnp.zeros((B, T), jnp.int32), jnp.zeros((B, T - 1), jnp.int32)
  with pytest.raises(ValueError, match=r"kv segment_ids must have shape \[B, S\]"):
    reference_attention(*_qkv(), segment_ids=(q_ids, kv_ids))


def test_segment_ids_single_array_cross_attention(op):
  q, k, v = _qkv(T=8, S=16)
  with pytest.raises(ValueError, match=r"a single segment_ids array needs T == S \(self attention\), got T=8, S=16"):
    op(q, k, v, segment_ids=jnp.zeros((B, 8), jnp.int32))


@pytest.mark.parametrize("n", [0, 1, 3])
def test_segment_ids_tuple_wrong_length(op, n):
  ids = tuple(jnp.zeros((B, T), jnp.int32) for _ in range(n))
  with pytest.raises(
    ValueError, match=rf"segment_ids must be an array or a \(q_segment_ids, kv_segment_ids\) pair, got {n}"
  ):
    op(*_qkv(), segment_ids=ids)


def test_segment_ids_not_arrays(op):
  with pytest.raises(TypeError, match=r"q segment_ids must be an array, got list"):
    op(*_qkv(), segment_ids=([0] * T, jnp.zeros((B, T), jnp.int32)))


# --------------------------------------------------------------------------------------------
# reference_attention only
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arg", ["q_positions", "kv_positions"])
def test_reference_positions_wrong_length(arg):
  with pytest.raises(ValueError, match=arg):
    reference_attention(*_qkv(), **{arg: jnp.arange(T - 3)})


def test_reference_is_causal_not_bool():
  with pytest.raises(TypeError, match=r"is_causal must be a bool"):
    reference_attention(*_qkv(), is_causal="yes")


# --------------------------------------------------------------------------------------------
# ring_attention options
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_sizes", [512, (128, 128), {"block_q": 128}])
def test_block_sizes_wrong_type(block_sizes):
  with pytest.raises(TypeError, match=r"block_sizes must be a flax_ringattn\.BlockSizes, got "):
    ring_attention(*_qkv(), block_sizes=block_sizes)


@pytest.mark.parametrize("field", ["block_q", "block_kv", "block_q_bwd", "block_kv_bwd"])
@pytest.mark.parametrize("value", [0, -4])
def test_block_sizes_not_positive(field, value):
  with pytest.raises(ValueError, match=rf"BlockSizes\.{field} must be >= 1, got {field}={value}"):
    BlockSizes(**{field: value})


@pytest.mark.parametrize("field", ["block_q", "block_kv", "block_q_bwd", "block_kv_bwd"])
@pytest.mark.parametrize("value", [1.5, 128.0, "128", True])
def test_block_sizes_not_int(field, value):
  with pytest.raises(TypeError, match=rf"BlockSizes\.{field} must be an int, got {value!r}"):
    BlockSizes(**{field: value})


def test_block_sizes_none_only_for_bwd():
  BlockSizes(block_q_bwd=None, block_kv_bwd=None)  # fine: fall back to the forward sizes
  with pytest.raises(TypeError, match=r"BlockSizes\.block_q must be an int, got None"):
    BlockSizes(block_q=None)


def test_block_sizes_positional_rejected():
  with pytest.raises(TypeError):
    BlockSizes(128, 128)  # kw_only


@pytest.mark.parametrize("name", ["cuda", "XLA", "pallas_nonexistent", ""])
def test_unknown_implementation(name):
  with pytest.raises(ValueError, match=rf"unknown implementation='{name}'; available implementations: \("):
    ring_attention(*_qkv(), implementation=name)


@pytest.mark.parametrize("impl", [1, ["xla"], True])
def test_implementation_not_a_string(impl):
  with pytest.raises(TypeError, match=r"implementation must be a string or None, got "):
    ring_attention(*_qkv(), implementation=impl)


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.bool_(True)])
def test_load_balance_not_bool(value):
  with pytest.raises(TypeError, match=rf"load_balance must be a bool, got {value!r}"):
    ring_attention(*_qkv(), load_balance=value)


@pytest.mark.parametrize("value", [1, "yes", None])
def test_is_causal_not_bool(value):
  with pytest.raises(TypeError, match=rf"is_causal must be a bool, got {value!r}"):
    ring_attention(*_qkv(), is_causal=value)


# --------------------------------------------------------------------------------------------
# Axes, meshes and shard_map
# --------------------------------------------------------------------------------------------


def test_axis_name_not_bound():
  with pytest.raises(ValueError, match=r"axis_name='sp' is not bound: call ring_attention inside jax\.shard_map"):
    ring_attention(*_qkv(), axis_name="sp")
  # Also under jit (still no shard_map binding the axis).
  with pytest.raises(ValueError, match=r"axis_name='sp' is not bound"):
    jax.jit(lambda q, k, v: ring_attention(q, k, v, axis_name="sp"))(*_qkv())


def test_axis_name_not_bound_inside_other_shard_map():
  mesh = make_mesh((4,), ("sp",))
  spec = P(None, "sp")
  fn = jax.shard_map(
    lambda q, k, v: ring_attention(q, k, v, axis_name="cp"), mesh=mesh, in_specs=(spec,) * 3, out_specs=spec
  )
  q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in _qkv(T=16))
  with pytest.raises(ValueError, match=r"axis_name='cp' is not bound"):
    fn(q, k, v)


@pytest.mark.parametrize("role", ["axis_name", "batch_axis", "head_axis"])
def test_mesh_axis_missing(role):
  mesh = make_mesh((4,), ("sp",))
  kw = {"axis_name": "sp", role: "nope"}
  with pytest.raises(ValueError, match=rf"{role}='nope' is not an axis of the mesh \(mesh axes: \('sp',\)\)"):
    ring_attention(*_qkv(), mesh=mesh, **kw)


@pytest.mark.parametrize("kw", [{"batch_axis": "dp"}, {"head_axis": "tp"}, {"batch_axis": "dp", "axis_name": "sp"}])
def test_batch_or_head_axis_without_mesh(kw):
  with pytest.raises(ValueError, match=r"batch_axis=.* / head_axis=.* only apply with mesh=\.\.\."):
    ring_attention(*_qkv(), **kw)


def test_multi_axis_mesh_without_axis_name():
  mesh = make_mesh((2, 4), ("dp", "sp"))
  with pytest.raises(ValueError, match=r"mesh has axes \('dp', 'sp'\): pass axis_name=\.\.\."):
    ring_attention(*_qkv(), mesh=mesh)


def test_single_axis_mesh_defaults_axis_name():
  # The one-axis mesh needs no axis_name: a check on the happy path next to its error.
  out = ring_attention(*_qkv(), mesh=make_mesh((4,), ("sp",)))
  assert out.shape == (B, T, N, H)


@pytest.mark.parametrize(
  "kw",
  [
    {"axis_name": "sp", "batch_axis": "sp"},
    {"axis_name": "sp", "head_axis": "sp"},
    {"axis_name": "sp", "batch_axis": "dp", "head_axis": "dp"},
  ],
)
def test_duplicate_axes(kw):
  mesh = make_mesh((2, 2, 2), ("dp", "sp", "tp"))
  with pytest.raises(ValueError, match=r"axis_name, batch_axis and head_axis must be different mesh axes, got \["):
    ring_attention(*_qkv(), mesh=mesh, **kw)


@pytest.mark.parametrize("mesh", ["sp", ("sp",), {"sp": 4}, np.arange(4)])
def test_mesh_not_a_mesh(mesh):
  with pytest.raises(TypeError, match=r"mesh must be a jax\.sharding\.Mesh, got "):
    ring_attention(*_qkv(), mesh=mesh, axis_name="sp")


@pytest.mark.parametrize(
  "T_,S_,load_balance,name,L,need",
  [
    (6, 8, False, "q_len", 6, 4),  # 6 % 4
    (8, 10, False, "kv_len", 10, 4),
    (12, 16, True, "q_len", 12, 8),  # zigzag: 2 chunks per shard
    (16, 20, True, "kv_len", 20, 8),
  ],
)
def test_global_length_not_divisible_by_ring(T_, S_, load_balance, name, L, need):
  q, k, v = _qkv(T=T_, S=S_)
  with pytest.raises(
    ValueError,
    match=rf"global {name}={L} must be a multiple of {need} \(ring_size=4 over axis 'sp', load_balance={load_balance}\)",
  ):
    _ring_mesh(q, k, v, load_balance=load_balance)


def test_local_length_odd_with_load_balance_inside_shard_map():
  mesh = make_mesh((4,), ("sp",))
  spec = P(None, "sp")
  q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in _qkv(T=12))  # 3 tokens per shard
  fn = jax.shard_map(
    lambda q, k, v: ring_attention(q, k, v, axis_name="sp", load_balance=True),
    mesh=mesh,
    in_specs=(spec,) * 3,
    out_specs=spec,
  )
  with pytest.raises(
    ValueError,
    match=r"local shard q_len=3 must be a multiple of 2 \(ring_size=4 over axis 'sp', load_balance=True\): "
    r"the zigzag layout splits each shard into two chunks",
  ):
    fn(q, k, v)


def test_local_length_odd_with_load_balance_one_device():
  q, k, v = _qkv(T=5)
  with pytest.raises(ValueError, match=r"local shard q_len=5 must be a multiple of 2 \(ring_size=1 over axis None"):
    ring_attention(q, k, v, load_balance=True)


def test_batch_not_divisible_by_batch_axis():
  mesh = make_mesh((2, 4), ("dp", "sp"))
  q, k, v = _qkv(B=3)
  with pytest.raises(ValueError, match=r"batch size B=3 must be a multiple of the 'dp' mesh axis size 2"):
    ring_attention(q, k, v, mesh=mesh, axis_name="sp", batch_axis="dp")


@pytest.mark.parametrize("n_q,n_kv", [(4, 1), (3, 3)])
def test_heads_not_divisible_by_head_axis(n_q, n_kv):
  mesh = make_mesh((2, 4), ("tp", "sp"))
  q, k, v = _qkv(N=n_q, K=n_kv)
  with pytest.raises(
    ValueError, match=rf"kv heads K={n_kv} \(and q heads N={n_q}\) must be a multiple of the 'tp' mesh axis size 2"
  ):
    ring_attention(q, k, v, mesh=mesh, axis_name="sp", head_axis="tp")


# --------------------------------------------------------------------------------------------
# Layout helpers
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [zigzag_order, zigzag_inverse])
@pytest.mark.parametrize("as_jax", [False, True])
def test_zigzag_length_not_multiple(fn, as_jax):
  x = np.zeros((2, 12, 3))
  if as_jax:
    x = jnp.asarray(x)
  with pytest.raises(ValueError, match=r"seq_len=12 must be a multiple of 2 \* num_shards=4 for the zigzag layout"):
    fn(x, 4)
  with pytest.raises(ValueError, match=r"seq_len=3 must be a multiple of 2 \* num_shards=1"):
    fn(x, 1, axis=2)


def test_zigzag_positions_length_not_multiple():
  with pytest.raises(ValueError, match=r"seq_len=10 must be a multiple of 2 \* num_shards=4"):
    zigzag_positions(10, 4)


@pytest.mark.parametrize("n", [0, -2])
def test_zigzag_num_shards_below_one(n):
  with pytest.raises(ValueError, match=rf"num_shards={n} must be >= 1"):
    zigzag_positions(8, n)
  with pytest.raises(ValueError, match=rf"num_shards={n} must be >= 1"):
    zigzag_order(np.zeros((1, 8)), n)
  with pytest.raises(ValueError, match=rf"num_shards={n} must be >= 1"):
    zigzag_inverse(jnp.zeros((1, 8)), n)

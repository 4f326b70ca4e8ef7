"""Zigzag (load-balanced) sequence layout: `zigzag_order`, `zigzag_inverse`, `zigzag_positions`."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_ringattn import zigzag_inverse, zigzag_order, zigzag_positions


def _expected_perm(seq_len, n):
  """Independent construction: device r holds chunks r and 2n-1-r, in that order."""
  c = seq_len // (2 * n)
  perm = []
  for r in range(n):
    perm += list(range(r * c, (r + 1) * c))
    perm += list(range((2 * n - 1 - r) * c, (2 * n - r) * c))
  return np.array(perm)


def test_docstring_worked_example():
  # n = 2, 8 tokens, chunk = 2: natural 0..7 -> 0 1 6 7 | 2 3 4 5.
  x = np.arange(8)[None]  # [1, 8]
  np.testing.assert_array_equal(zigzag_order(x, 2)[0], [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(zigzag_positions(8, 2), [0, 1, 6, 7, 2, 3, 4, 5])
  np.testing.assert_array_equal(zigzag_inverse(np.array([[0, 1, 6, 7, 2, 3, 4, 5]]), 2)[0], np.arange(8))


@pytest.mark.parametrize("seq_len,n", [(8, 1), (8, 2), (16, 2), (16, 4), (32, 8), (48, 4)])
def test_positions_match_independent_construction(seq_len, n):
  pos = zigzag_positions(seq_len, n)
  assert pos.dtype == np.int32
  assert pos.shape == (seq_len,)
  np.testing.assert_array_equal(pos, _expected_perm(seq_len, n))
  # A permutation of 0..seq_len-1.
  np.testing.assert_array_equal(np.sort(pos), np.arange(seq_len))


def test_one_shard_is_identity():
  x = np.arange(2 * 6 * 3).reshape(2, 6, 3)
  np.testing.assert_array_equal(zigzag_order(x, 1), x)
  np.testing.assert_array_equal(zigzag_positions(6, 1), np.arange(6))


@pytest.mark.parametrize("seq_len,n", [(8, 2), (16, 4), (32, 8)])
def test_positions_equal_zigzag_order_of_arange(seq_len, n):
  np.testing.assert_array_equal(zigzag_positions(seq_len, n), zigzag_order(np.arange(seq_len), n, axis=0))
  np.testing.assert_array_equal(zigzag_positions(seq_len, n), np.asarray(zigzag_order(jnp.arange(seq_len), n, axis=0)))
  # Also along axis=1 of a [B, T] array of positions.
  pos2d = np.broadcast_to(np.arange(seq_len), (2, seq_len))
  np.testing.assert_array_equal(zigzag_order(pos2d, n), np.broadcast_to(zigzag_positions(seq_len, n), (2, seq_len)))


@pytest.mark.parametrize("as_jax", [False, True])
@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_inverse_round_trip(as_jax, axis):
  rng = np.random.default_rng(0)
  x = rng.standard_normal((8, 16, 8, 8)).astype(np.float32)
  if as_jax:
    x = jnp.asarray(x)
  for n in (1, 2, 4):
    y = zigzag_order(x, n, axis=axis)
    assert type(y) is type(x) or (as_jax and isinstance(y, jax.Array))
    chex.assert_shape(y, x.shape)
    # The reordering is the documented permutation along `axis`.
    np.testing.assert_array_equal(np.asarray(y), np.take(np.asarray(x), _expected_perm(x.shape[axis], n), axis=axis))
    back = zigzag_inverse(y, n, axis=axis)
    np.testing.assert_array_equal(np.asarray(back), np.asarray(x))
    # zigzag_order also undoes zigzag_inverse.
    np.testing.assert_array_equal(
      np.asarray(zigzag_order(zigzag_inverse(x, n, axis=axis), n, axis=axis)), np.asarray(x)
    )


def test_numpy_input_stays_numpy():
  x = np.arange(16).reshape(2, 8)
  assert isinstance(zigzag_order(x, 2), np.ndarray)
  assert isinstance(zigzag_inverse(x, 2), np.ndarray)


def test_works_under_jit():
  x = jnp.arange(2 * 16 * 2, dtype=jnp.float32).reshape(2, 16, 2)
  y = jax.jit(lambda a: zigzag_order(a, 4))(x)
  np.testing.assert_array_equal(np.asarray(y), np.take(np.asarray(x), _expected_perm(16, 4), axis=1))
  z = jax.jit(lambda a: zigzag_inverse(a, 4))(y)
  np.testing.assert_array_equal(np.asarray(z), np.asarray(x))


def _causal_pairs_per_shard(positions, n):
  """Visible causal (q, k) pairs per shard: q held by the shard, k any key (global position <= q)."""
  per_shard = np.asarray(positions).reshape(n, -1)
  return [int(np.sum(p + 1)) for p in per_shard]


@pytest.mark.parametrize("n", [2, 4, 8])
def test_zigzag_balances_causal_work(n):
  seq_len = 4 * n  # chunk of 2 tokens
  contiguous = _causal_pairs_per_shard(np.arange(seq_len), n)
  zigzag = _causal_pairs_per_shard(zigzag_positions(seq_len, n), n)
  total = seq_len * (seq_len + 1) // 2
  assert sum(contiguous) == sum(zigzag) == total
  assert len(set(zigzag)) == 1, zigzag
  assert zigzag[0] * n == total
  assert len(set(contiguous)) == n, contiguous  # strictly increasing with the shard index
  assert contiguous == sorted(contiguous)

  # The same counts from an explicit [T, S] causal mask over the actual tokens.
  q_pos = zigzag_positions(seq_len, n)
  mask = np.arange(seq_len)[None, :] <= q_pos[:, None]
  assert [int(m.sum()) for m in mask.reshape(n, -1, seq_len)] == zigzag


def test_explicit_sharded_input():
  mesh = make_mesh((4,), ("sp",))
  sharding = NamedSharding(mesh, P(None, "sp"))
  x_np = np.arange(2 * 16 * 3, dtype=np.float32).reshape(2, 16, 3)
  x = jax.device_put(x_np, sharding)
  y = zigzag_order(x, 4)
  np.testing.assert_array_equal(np.asarray(y), np.take(x_np, _expected_perm(16, 4), axis=1))
  assert y.sharding.is_equivalent_to(sharding, y.ndim), y.sharding
  # Under jit too, and back again.
  y_jit = jax.jit(lambda a: zigzag_order(a, 4))(x)
  np.testing.assert_array_equal(np.asarray(y_jit), np.asarray(y))
  assert y_jit.sharding.is_equivalent_to(sharding, y.ndim), y_jit.sharding
  back = zigzag_inverse(y, 4)
  np.testing.assert_array_equal(np.asarray(back), x_np)
  assert back.sharding.is_equivalent_to(sharding, y.ndim), back.sharding
  # Device r holds chunks r and 2n-1-r: check the local shards directly.
  c = 16 // 8
  for shard in y.addressable_shards:
    r = shard.index[1].start // (16 // 4)
    expected = np.concatenate([np.arange(r * c, (r + 1) * c), np.arange((7 - r) * c, (8 - r) * c)])
    np.testing.assert_array_equal(np.asarray(shard.data)[0, :, 0], x_np[0, expected, 0])


def test_bad_arguments():
  with pytest.raises(ValueError, match=r"must be a multiple of 2 \* num_shards"):
    zigzag_positions(6, 2)
  with pytest.raises(ValueError, match=r"num_shards=0 must be >= 1"):
    zigzag_positions(8, 0)

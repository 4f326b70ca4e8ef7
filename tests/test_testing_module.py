"""The public `flax_ringattn.testing` module: checks pass on right answers and say what is wrong otherwise."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import flax_ringattn as fr
from flax_ringattn import testing


def _qkv(dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(ks[0], (1, 32, 4, 8), dtype)
  k, v = (jax.random.normal(x, (1, 32, 2, 8), dtype) for x in ks[1:])
  return q, k, v


@pytest.mark.parametrize("dtype", [jnp.bfloat16])
def test_passes_for_the_ring(dtype):
  fn = lambda q, k, v: fr.ring_attention(q, k, v, is_causal=True, implementation="xla")  # noqa: E731
  testing.assert_matches_reference(fn, *_qkv(dtype), is_causal=True)


def test_forward_error_names_tensor_index_and_size():
  fn = lambda q, k, v: fr.reference_attention(q, k, v, is_causal=True).at[0, 5, 2, 1].add(0.5)  # noqa: E731
  with pytest.raises(
    AssertionError, match=r"output \(fwd, float32.*1 of 1024 elements differ; worst at index \(0, 5, 2, 1\)"
  ):
    testing.assert_matches_reference(fn, *_qkv(), is_causal=True)


def test_gradient_error_names_the_gradient():
  fn = lambda q, k, v: fr.reference_attention(q, k, jax.lax.stop_gradient(v), is_causal=True)  # noqa: E731
  with pytest.raises(AssertionError, match=r"^dv \(grad, float32"):
    testing.assert_matches_reference(fn, *_qkv(), is_causal=True)
  testing.assert_matches_reference(fn, *_qkv(), is_causal=True, grads=False)


def test_wrong_mask_option_is_caught():
  fn = lambda q, k, v: fr.reference_attention(q, k, v)  # noqa: E731  (not causal)
  with pytest.raises(AssertionError, match="output"):
    testing.assert_matches_reference(fn, *_qkv(), is_causal=True)


def test_tolerances_and_errors():
  assert testing.tolerance(jnp.bfloat16, "grad") == {"atol": 2e-2, "rtol": 2e-2}
  assert testing.TOLERANCES["float32"]["fwd"] == (1e-5, 1e-5)
  with pytest.raises(ValueError, match=r"no tolerance for dtype=int8"):
    testing.tolerance(jnp.int8)
  with pytest.raises(ValueError, match="kind='bwd' must be 'fwd' or 'grad'"):
    testing.tolerance(jnp.float32, "bwd")
  with pytest.raises(AssertionError, match=r"value\['a'\]: 1 non-finite values, first at index \(1,\)"):
    testing.assert_close({"a": jnp.array([0.0, jnp.nan])}, {"a": jnp.zeros(2)}, jnp.float32)


def test_interpret_helpers_are_exported():
  params = testing.interpret_params()
  assert params.detect_races
  assert callable(testing.no_races) and callable(testing.ensure_cpu_threads)

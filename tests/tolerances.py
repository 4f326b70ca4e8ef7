"""The one tolerance table (per dtype, forward and gradients); compare in f32."""

import chex
import jax
import jax.numpy as jnp
import numpy as np

TOLERANCES = {
  # dtype: (atol, rtol) for forward outputs and for gradients
  "float32": {"fwd": (1e-5, 1e-5), "grad": (1e-5, 1e-5)},
  "bfloat16": {"fwd": (2e-2, 2e-2), "grad": (2e-2, 2e-2)},
  "float16": {"fwd": (5e-3, 5e-3), "grad": (1e-2, 1e-2)},  # 10-bit mantissa (bf16: 7)
}


def tol(dtype, kind: str = "fwd") -> dict:
  atol, rtol = TOLERANCES[jnp.dtype(dtype).name][kind]
  return {"atol": atol, "rtol": rtol}


def assert_close(actual, expected, dtype, kind: str = "fwd"):
  """Tree-wise comparison in float32 with the table's tolerance; no NaN allowed."""
  actual = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.float32)), actual)
  expected = jax.tree.map(lambda x: np.asarray(jnp.asarray(x, jnp.float32)), expected)
  chex.assert_tree_all_finite(actual)
  chex.assert_trees_all_close(actual, expected, **tol(dtype, kind))

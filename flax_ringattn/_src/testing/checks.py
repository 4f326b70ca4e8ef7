"""chex-based checks of attention functions against the reference, for the public `flax_ringattn.testing`.

One tolerance table (per dtype, forward and gradients) used by this library's
own tests (`tests/tolerances.py` re-exports it) and offered to users' tests.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from flax_ringattn._src.reference import reference_attention

try:
  import chex
except ImportError as e:  # chex is a test dependency (pip install "flax_ringattn[test]")
  raise ImportError("flax_ringattn.testing needs chex: pip install chex (or flax_ringattn[test])") from e

TOLERANCES = {
  # dtype: (atol, rtol) for forward outputs and for gradients
  "float32": {"fwd": (1e-5, 1e-5), "grad": (1e-5, 1e-5)},
  "bfloat16": {"fwd": (2e-2, 2e-2), "grad": (2e-2, 2e-2)},
  "float16": {"fwd": (5e-3, 5e-3), "grad": (1e-2, 1e-2)},  # 10-bit mantissa (bf16: 7); pallas_gpu f16 checked at these
}


def tolerance(dtype, kind: str = "fwd") -> dict:
  """{"atol": ..., "rtol": ...} for `dtype` and kind "fwd" or "grad"."""
  name = jnp.dtype(dtype).name
  if name not in TOLERANCES:
    raise ValueError(f"no tolerance for dtype={name}; known: {tuple(TOLERANCES)}")
  if kind not in ("fwd", "grad"):
    raise ValueError(f"{kind=} must be 'fwd' or 'grad'")
  atol, rtol = TOLERANCES[name][kind]
  return {"atol": atol, "rtol": rtol}


def _f32(x):
  return np.asarray(jnp.asarray(x, jnp.float32))


def assert_close(actual, expected, dtype, kind: str = "fwd", *, name: str = "value"):
  """Compares (trees of) arrays in float32 at the table's tolerance; no NaN / inf allowed.

  The message names the tensor, the index of the worst element, both values
  and the error against the allowed one.
  """
  tol = tolerance(dtype, kind)
  actual = jax.tree.map(_f32, actual)
  expected = jax.tree.map(_f32, expected)
  chex.assert_trees_all_equal_shapes(actual, expected)
  flat_a, _ = jax.tree_util.tree_flatten_with_path(actual)
  flat_e = jax.tree.leaves(expected)
  for (path, a), e in zip(flat_a, flat_e, strict=True):
    where = f"{name}{jax.tree_util.keystr(path)}"
    if not np.isfinite(a).all():
      bad = np.argwhere(~np.isfinite(a))
      raise AssertionError(f"{where}: {len(bad)} non-finite values, first at index {tuple(int(i) for i in bad[0])}")
    err = np.abs(a - e)
    allowed = tol["atol"] + tol["rtol"] * np.abs(e)
    if (err > allowed).any():
      idx = np.unravel_index(np.argmax(err - allowed), err.shape)
      n_bad = int((err > allowed).sum())
      raise AssertionError(
        f"{where} ({kind}, {jnp.dtype(dtype).name}, atol={tol['atol']}, rtol={tol['rtol']}): {n_bad} of {err.size} "
        f"elements differ; worst at index {tuple(int(i) for i in idx)}: got {a[idx]:.6g}, expected {e[idx]:.6g}, "
        f"|diff| = {err[idx]:.3g} > allowed {allowed[idx]:.3g} (max |diff| overall {err.max():.3g})"
      )
  chex.assert_trees_all_close(actual, expected, **tol)


def assert_matches_reference(fn, q, k, v, *, grads: bool = True, dtype=None, seed: int = 0, **mask_options):
  """Checks fn(q, k, v) and its q/k/v gradients against `flax_ringattn.reference_attention`.

  Args:
    fn: the attention function under test, called as fn(q, k, v) with
      jax.nn.dot_product_attention's layout (q [B, T, N, H], k/v [B, S, K, H]);
      bind its own options (mesh, implementation, ...) beforehand.
    q, k, v: inputs.
    grads: also compare d/dq, d/dk, d/dv of sum(fn(q, k, v) * ct) for a fixed
      random cotangent ct.
    dtype: tolerance row (default q.dtype).
    seed: seed of the cotangent.
    **mask_options: what fn computes, for the reference: is_causal,
      segment_ids, local_window_size, logits_soft_cap, scale, q_positions,
      kv_positions, dropout_rate, dropout_rng, broadcast_dropout.

  Raises:
    AssertionError naming the tensor ("output", "dq", "dk", "dv"), the worst
    index and by how much it is off.
  """
  dtype = q.dtype if dtype is None else dtype
  ref = lambda q, k, v: reference_attention(q, k, v, **mask_options)  # noqa: E731
  out = fn(q, k, v)
  want = ref(q, k, v)
  if out.shape != want.shape:
    raise AssertionError(f"output has shape {tuple(out.shape)}, the reference {tuple(want.shape)}")
  assert_close(out, want, dtype, "fwd", name="output")
  if not grads:
    return
  ct = jax.random.normal(jax.random.PRNGKey(seed), want.shape, jnp.float32).astype(want.dtype)

  def vjp(f):
    _, pullback = jax.vjp(f, q, k, v)
    return pullback(ct)

  for name, got, exp in zip(("dq", "dk", "dv"), vjp(fn), vjp(ref), strict=True):
    assert_close(got, exp, dtype, "grad", name=name)


_COLLECTIVES = ("collective-permute", "all-to-all", "all-gather", "all-reduce", "reduce-scatter")
_COLLECTIVE_OP = re.compile(r" (" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")


def collective_counts(fn, *args, **kwargs) -> dict[str, int]:
  """The cross-device collectives in the compiled program of `fn(*args, **kwargs)`: {name: instructions}.

  A one-line check that attention really runs sharded, e.g. on a jitted train step:
  `assert collective_counts(train_step, model, optimizer, batch)["collective-permute"]` (the ring's hops;
  Ulysses shows "all-to-all", all-gather attention "all-gather").  Counts instructions in the optimized HLO
  text (a ring loop's hop is one instruction however many times it runs), for "collective-permute",
  "all-to-all", "all-gather", "all-reduce" and "reduce-scatter".  `fn` is a jitted function (`jax.jit`,
  `nnx.jit`: anything with `.lower`), else it is wrapped in `jax.jit`.  Compiles the program once more.
  """
  jitted = fn if hasattr(fn, "lower") else jax.jit(fn)
  text = jitted.lower(*args, **kwargs).compile().as_text()
  found = _COLLECTIVE_OP.findall(text)
  return {name: found.count(name) for name in _COLLECTIVES}

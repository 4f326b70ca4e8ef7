"""Next-token choice of `ServingEngine`: greedy at temperature 0, else sampling with temperature, top-k, top-p.

Every sampled token draws from its own key, `fold_in(fold_in(PRNGKey(seed), prompt_index), token_index)`, so
a prompt's output depends on the seed, its index among the prompts and the model only: not on which other
prompts share the step, on chunking, on evictions, nor on a draft (speculative decoding samples the same token
at the same index, and keeps a proposal only where it equals that token).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check(temperature, top_k, top_p, seed):
  """The sampling options, validated: (temperature float, top_k int | None, top_p float | None, seed int)."""
  if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
    raise ValueError(f"temperature must be a float >= 0 (0: greedy), got temperature={temperature!r}")
  if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k < 1):
    raise ValueError(f"top_k must be None or an int >= 1, got top_k={top_k!r}")
  if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
    raise ValueError(f"top_p must be None or a float in (0, 1], got top_p={top_p!r}")
  if not isinstance(seed, int) or isinstance(seed, bool):
    raise TypeError(f"seed must be an int, got seed={seed!r}")
  return float(temperature), top_k, None if top_p is None else float(top_p), seed


def choose(logits, row_ids, seed, temperature, *, top_k, top_p):
  """tokens [T] int32 of logits [T, V]: argmax where temperature == 0, else one sample per row drawn with the
  row's key (row_ids [T, 2]: prompt index, token index).  top_k / top_p are static (None: off)."""
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def sample(_):
    x = logits / jnp.maximum(temperature, 1e-6)
    if top_k is not None and top_k < x.shape[-1]:
      kth = jax.lax.top_k(x, top_k)[0][:, -1:]
      x = jnp.where(x < kth, -jnp.inf, x)
    if top_p is not None:
      order = jnp.argsort(-x, axis=-1)
      sorted_x = jnp.take_along_axis(x, order, axis=-1)
      probs = jax.nn.softmax(sorted_x, axis=-1)
      # Keep the smallest head of the sorted tokens whose mass reaches top_p (the first token always).
      keep_sorted = (jnp.cumsum(probs, axis=-1) - probs) < top_p
      keep = jnp.zeros_like(keep_sorted).at[jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
      x = jnp.where(keep, x, -jnp.inf)
    base = jax.random.key(seed)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(base, i[0]), i[1]))(row_ids)
    return jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, x).astype(jnp.int32)

  return jax.lax.cond(temperature > 0, sample, lambda _: greedy, None)

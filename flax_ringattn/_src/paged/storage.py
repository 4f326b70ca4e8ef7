"""Where a `PagedKVCache`'s tokens are stored: quantization, the page writes, the zeroing of freed pages.

Shared by the cache (`cache.py`) and the ring prefill (`ring_prefill.py`), which writes each device's prompt
rows into that device's own pages.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src.paged import allocator, common


def zero_pages(x, released):
  """x [P, ...] with the pages where `released` [P] is True zeroed (a release of slots, a rollback).  Behind a
  `lax.cond` on any of them: the select reads and writes every page.  A serving step's reserve, which releases
  at most a copy-on-write's original per slot, zeroes those by id instead (`zero_listed_pages`)."""
  if x is None:
    return None

  def zeroed(x):
    return jnp.where(released.reshape((x.shape[0],) + (1,) * (x.ndim - 1)), jnp.zeros((), x.dtype), x)

  return jax.lax.cond(jnp.any(released), zeroed, lambda x: x, x)


def zero_listed_pages(x, ids):
  """x [P, ...] with the pages ids [n] (P: none) zeroed: a scatter into those pages alone, for a few pages known by
  id (`zero_pages` takes a mask over every page)."""
  if x is None:
    return None
  return allocator.scatter_set(x, ids, jnp.zeros((), x.dtype))


def quantize(dtype, scaled: bool, x):
  """x [T, K, H | Hv] as pages of `dtype` store it, and its per-token scales [T, K] (None without scales)."""
  if not scaled:
    return x.astype(dtype), None
  qmax = common.QUANTIZED_MAX[jnp.dtype(dtype).name]
  xf = x.astype(jnp.float32)
  s = jnp.max(jnp.abs(xf), axis=-1) / qmax  # [T, K]
  s = jnp.where(s == 0, 1.0, s)
  stored = xf / s[..., None]
  if jnp.issubdtype(dtype, jnp.integer):
    stored = jnp.round(stored)
  return stored.astype(dtype), s


def store(pages, scale, page, slot, x):
  """Writes x [T, K, H | Hv] at (page, slot); quantizes per token and head when `scale` is kept.  Spread over a
  mesh axis, each device stores the tokens whose pages it owns."""
  return write(pages, scale, page, slot, *quantize(pages.dtype, scale is not None, x))


def write(pages, scale, page, slot, stored, s):
  """`store` of tokens already in the pages' form: `quantize`'s (stored, per-token scales or None).  Merged pages
  [P, page_size, K * h] take each token's [K, h] as one row."""
  if pages.ndim == 3:
    stored = stored.reshape(stored.shape[0], -1)
  return allocator.scatter_set(pages, (page, slot), stored), allocator.scatter_set(scale, (page, slot), s)


def store_kv(kv_pages, k_scale, v_scale, page, slot, k, v):
  """`store` into kv pages [P, 2, page_size, K * H] (a page's K, then its V): (kv_pages, None, k_scale, v_scale),
  the tokens' k and v [T, K, H] written as one [T, 2, K * H] scatter."""
  k_store, k_sc = quantize(kv_pages.dtype, k_scale is not None, k)
  v_store, v_sc = quantize(kv_pages.dtype, v_scale is not None, v)
  T = k.shape[0]
  if allocator.explicit_sharding(kv_pages) is None:
    # As rows of a [2P, page_size, K * H] view (page p's K at 2p, its V at 2p + 1; a free reshape): a scatter of
    # whole minor rows, as into merged pages.  Scattered at (page, :, slot) instead, XLA on a TPU relays the whole
    # cache out to [P, page_size, 2, K * H] and back around the scatter, in every layer of every step.
    P, _, ps, KH = kv_pages.shape
    rows = jnp.concatenate([k_store.reshape(T, KH), v_store.reshape(T, KH)])  # [2T, K * H]
    at = jnp.concatenate([2 * page, 2 * page + 1])  # a dropped token's page P lands past 2P - 1: dropped too
    halves = allocator.scatter_set(kv_pages.reshape(2 * P, ps, KH), (at, jnp.concatenate([slot, slot])), rows)
    kv_pages = halves.reshape(kv_pages.shape)
  else:
    rows = jnp.stack([k_store.reshape(T, -1), v_store.reshape(T, -1)], axis=1)  # [T, 2, K * H]
    kv_pages = allocator.scatter_set(kv_pages, (page, slice(None), slot), rows)
  return (
    kv_pages,
    None,
    allocator.scatter_set(k_scale, (page, slot), k_sc),
    allocator.scatter_set(v_scale, (page, slot), v_sc),
  )

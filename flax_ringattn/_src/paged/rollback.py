"""`PagedKVCache.rollback`: the last tokens of each slot taken back out of the cache (speculative decoding
rejects drafted tokens whose K/V a step has already written).

After a rollback of `drop` [S] tokens, slot s holds kv_lens[s] - drop[s] tokens; its pages past the new length
are released (a page whose last reference goes is zeroed and free again, as `free` does), and the dropped rows
of the pages it keeps are zeroed when the slot is their only reader.  So, with nothing shared, the cache equals
one that never had those tokens, array for array.  Rows of a shared page are left as they are: they are the
other reader's data too.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flax_ringattn._src.paged import allocator, checks, contracts, storage


def rollback(cache, num_tokens, checked: bool):
  where = "PagedKVCache.rollback"
  S, ps, P, pps = cache.max_num_seqs, cache.page_size, cache.num_pages, cache.pages_per_seq
  drop = contracts.new_lens(num_tokens, S, where)

  def problems():
    negative, over = drop < 0, drop > cache.kv_lens
    i, j = jnp.argmax(negative).astype(jnp.int32), jnp.argmax(over).astype(jnp.int32)
    return [
      (jnp.any(negative), "num_tokens[{i}]={n} must be >= 0 (tokens to drop per slot)", dict(i=i, n=drop[i])),
      (
        jnp.any(over),
        "num_tokens[{i}]={n} is more than slot {i} holds (kv_lens[{i}]={kv}): a rollback drops at most every token",
        dict(i=j, n=drop[j], kv=cache.kv_lens[j]),
      ),
    ]

  checks.enforce(problems, (drop, cache.kv_lens), where=where, checked=checked)
  # Under jit a slot whose count breaks the contract changes nothing.
  drop = jnp.where((drop >= 0) & (drop <= cache.kv_lens), drop, 0)
  old_len = cache.kv_lens
  new_len = old_len - drop
  keep = -(-new_len // ps)  # pages the slot keeps
  j = jnp.arange(pps)[None]
  table = cache.page_indices
  release = (drop[:, None] > 0) & (j >= keep[:, None]) & (table >= 0)
  refs_in = allocator.replicated(cache.ref_counts)
  refs = refs_in.at[jnp.where(release, table, P).reshape(-1)].add(-1, mode="drop")
  released = (refs <= 0) & (refs_in > 0)
  # The dropped rows of the pages kept, where the slot is the page's only reader.
  r = jnp.arange(ps)
  pos = j[..., None] * ps + r  # [1, pps, ps]
  rows = (pos >= new_len[:, None, None]) & (pos < old_len[:, None, None]) & (j < keep[:, None])[..., None]
  page = jnp.broadcast_to(table[..., None], rows.shape)
  own = refs_in[jnp.clip(page, 0, P - 1)] == 1
  page = jnp.where(rows & own & (page >= 0), page, P).reshape(-1)
  slot = jnp.broadcast_to(r, rows.shape).reshape(-1)

  def clear(x, together=False):
    if x is None:
      return None
    x = storage.zero_pages(x, released)
    at = (page, slice(None), slot) if together else (page, slot)  # kv pages [P, 2, ps, K * H]: K's row and V's
    return allocator.scatter_set(x, at, jnp.zeros((), x.dtype))

  return dataclasses.replace(
    cache,
    k_pages=clear(cache.k_pages, cache.kv_together),
    v_pages=clear(cache.v_pages),
    k_scale=clear(cache.k_scale),
    v_scale=clear(cache.v_scale),
    page_indices=jnp.where(release, -1, table),
    kv_lens=new_len,
    ref_counts=allocator.placed_like(jnp.maximum(refs, 0), cache.ref_counts),
  )

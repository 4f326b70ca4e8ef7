"""A `PagedKVCache` write's page allocation, apart from the pages it moves (`Reservation`), and its application to a
cache's pages.

`ServingEngine` keeps one page table for all the layers of a model: a step makes the allocation once
(`PagedKVCache.reservation`) and every layer's cache applies it to its own pages (`apply`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_ringattn._src.paged import allocator, storage
from flax_ringattn._src.paged.admission import Admission


@dataclasses.dataclass(frozen=True)
class Reservation:
  """A write's page allocation (`PagedKVCache.reservation`), apart from the pages it moves: what any cache of the
  same page table becomes (`PagedKVCache._reserve(..., reservation=...)`)."""

  admission: Admission  # who fits, and why not (its errors are raised by each cache that applies it)
  overflowed: jax.Array  # [S] bool, refused writes included
  page_indices: jax.Array  # [S, pages_per_seq] the new page table
  ref_counts: jax.Array  # [P] (replicated)
  copy_from: jax.Array  # [S] each slot's shared partial page, copied (copy-on-write) ...
  copy_to: jax.Array  # [S] ... into this page (num_pages: no copy)
  released: jax.Array  # [S] page ids zeroed, originals of copies left without a reference (num_pages: none)


def grow(cache, new_lens, a, overflowed, owners=None) -> Reservation:
  """The page moves of `reserve` for `new_lens` [S] that fit (all of them, by `admission.admit`: `a`)."""
  P, S, pps, n = cache.num_pages, cache.max_num_seqs, cache.pages_per_seq, cache.num_shards
  refs_in = allocator.replicated(cache.ref_counts)
  extra, have, need, cow, cow_owner = cache._extra(new_lens, refs_in, owners)
  j0, old = cache._partial_page()
  need = jnp.minimum(need, pps)
  fresh, ids = allocator.allocate(allocator.free_lists(refs_in, n), extra, have, need, cow, cow_owner, pps, owners)

  # Copy-on-write of the partially filled, shared page of each slot (fresh is on the same owner as old).
  ok_copy = fresh < P
  # Admission leaves every served slot its pages, so a copy always finds one; were it not to, the slot
  # must still not write into the shared page: it lets go of it.
  lost = (cow > 0) & ~ok_copy
  refs = refs_in.at[jnp.where(cow > 0, old, P)].add(-1, mode="drop")
  # Two slots sharing a page may both copy it in the same step; the original then loses its last reference and,
  # like any released page, is zeroed.  Only such originals can be released here, at most one per slot: zeros go
  # into those pages alone (a select over every page passed over the whole cache in every layer and step).
  at = jnp.clip(old, 0, P - 1)
  released = jnp.where((cow > 0) & (refs[at] <= 0) & (refs_in[at] > 0), old, P)  # [S] page ids, P: none
  table = cache.page_indices.at[jnp.arange(S), j0].set(jnp.where(ok_copy, fresh, jnp.where(lost, -1, old)))

  # New pages for the tokens beyond what each slot holds.
  j = jnp.arange(pps)[None]
  grow = (j >= have[:, None]) & (j < need[:, None])
  table = jnp.where(grow, jnp.where(ids < P, ids, -1), table)
  refs = refs.at[jnp.where(ok_copy, fresh, P)].set(1, mode="drop")
  refs = refs.at[ids.reshape(-1)].set(1, mode="drop")
  return Reservation(a, overflowed, table, refs, old, fresh, released)


def apply(cache, r: Reservation):
  """This cache with reservation `r` made: its pages copied (copy-on-write) and zeroed (released), and r's page
  table, reference counts and refusals."""
  n = cache.num_shards
  moved = []
  for x in (cache.k_pages, cache.v_pages, cache.k_scale, cache.v_scale):
    x = allocator.copy_pages(x, r.copy_from, r.copy_to, n)
    moved.append(storage.zero_listed_pages(x, r.released))
  k_pages, v_pages, k_scale, v_scale = moved
  return dataclasses.replace(
    cache,
    k_pages=k_pages,
    v_pages=v_pages,
    page_indices=r.page_indices,
    ref_counts=allocator.placed_like(r.ref_counts, cache.ref_counts),
    k_scale=k_scale,
    v_scale=v_scale,
    overflowed=r.overflowed,
  )

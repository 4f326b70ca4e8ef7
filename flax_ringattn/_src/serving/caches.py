"""The engine's caches held as flat leaves between steps: committing them beside the weights, running a step on
leaves, finding and checking the model's `PagedKVCache`s, and the host's count of the pages a step takes."""

from __future__ import annotations

import jax
import numpy as np

from flax_ringattn._src.paged.cache import PagedKVCache


def committed_beside(caches, weights):
  """`caches` with their uncommitted arrays committed to the one device the committed weights are on (a restored
  checkpoint's): fresh caches are uncommitted, and a step with committed weights returns committed ones, so the
  first generate's second step compiled the step program again (a new signature, no new trace, so
  `stats.compiles` did not see it).  Weights that are uncommitted, or on several devices, leave them as they are."""
  devices = {d for x in jax.tree.leaves(weights) if isinstance(x, jax.Array) and x.committed for d in x.devices()}
  if len(devices) != 1:
    return caches
  (device,) = devices
  return jax.tree.map(
    lambda x: jax.device_put(x, device) if isinstance(x, jax.Array) and not x.committed else x, caches
  )


def on_leaves(fn):
  """fn(caches, rest, *args, **kw) -> (out, caches) as a function of the caches' and the weights' leaves and
  their (static) tree definitions, returning the new caches' leaves."""

  def run(cache_leaves, rest_leaves, *args, cache_def, rest_def, **kwargs):
    caches, rest = jax.tree.unflatten(cache_def, cache_leaves), jax.tree.unflatten(rest_def, rest_leaves)
    out, caches = fn(caches, rest, *args, **kwargs)
    leaves, new_def = jax.tree.flatten(caches)
    if new_def != cache_def:  # the host keeps one definition for the caches it holds as leaves
      raise AssertionError(f"ServingEngine: a step changed the caches' structure: {cache_def} -> {new_def}")
    return out, leaves

  run.__name__, run.__qualname__ = fn.__name__, fn.__qualname__  # jit's name in logs and profiles: the step's
  return run


def is_paged_cache(x) -> bool:
  return isinstance(x, PagedKVCache)


def map_caches(fn, caches):
  """fn applied to every `PagedKVCache` of a state (other leaves unchanged)."""
  return jax.tree.map(lambda x: fn(x) if is_paged_cache(x) else x, caches, is_leaf=is_paged_cache)


PAGE_TABLE = ("kv_lens", "page_indices", "ref_counts", "overflowed")


def check_one_page_table(cache_leaves, cache_def) -> None:
  """Raises ValueError unless every cache of the model has the first one's page table (lengths, pages, reference
  counts, refusals): a step allocates pages once for all of them (`PagedKVCache.reservation`).  The engine's own
  calls keep them equal; a cache changed by hand between calls would not be."""
  caches = [x for x in jax.tree.leaves(jax.tree.unflatten(cache_def, cache_leaves), is_leaf=is_paged_cache)
            if is_paged_cache(x)]  # fmt: skip
  if len(caches) < 2:
    return
  tables = jax.device_get([[getattr(c, f) for f in PAGE_TABLE] for c in caches])
  for i, table in enumerate(tables[1:], 1):
    for name, a, b in zip(PAGE_TABLE, tables[0], table, strict=True):
      if (a is None) != (b is None) or (a is not None and not np.array_equal(a, b)):
        raise ValueError(
          f"ServingEngine: the model's paged caches must share one page table, but cache {i}'s {name} differs "
          f"from cache 0's (a cache written outside the engine, e.g. by calling the model or "
          "PagedKVCache.append by hand between calls): re-create the caches (init_cache) before serving"
        )


def first_cache(caches) -> PagedKVCache:
  return next(x for x in jax.tree.leaves(caches, is_leaf=is_paged_cache) if is_paged_cache(x))


def pages_taken(new_lens, kv_lens, page_size: int, pages_per_seq: int, shared_tail):
  """The most free pages that slots holding `kv_lens` tokens take to store `new_lens` more ([S] int each), or None
  where a slot would pass its `pages_per_seq` pages.

  A slot takes a page for each page past its last that its new tokens reach, and none for its last, partly
  filled page: that page is its own, unless a share of a partial page or a rollback touched the slot since it
  was last freed (`shared_tail` [S] bool); such a slot may copy every page it touches, 1 + (new - 1) /
  page_size.  A share of whole pages (the scheduler's only kind) leaves both slots' partial pages unshared."""
  new_lens, kv_lens = np.asarray(new_lens), np.asarray(kv_lens)
  live = new_lens > 0
  kv, new, ps = kv_lens[live], new_lens[live], page_size
  if np.any(kv + new > pages_per_seq * ps):
    return None
  fresh = -(-(kv + new) // ps) + kv // -ps  # pages past the slot's last that its new tokens reach
  touched = 1 + (new + ps - 2) // ps
  return int(np.where(np.asarray(shared_tail)[live], touched, fresh).sum())

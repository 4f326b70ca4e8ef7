"""Page ownership and free lists of a `PagedKVCache` spread over the n devices of a mesh's `seq_axis`.

Layout (the sharded `paged_attention` relies on it):
* the pages [P, page_size, K, H | Hv], their scales and `ref_counts` [P] are one global array each, sharded on the
  page dimension: owner d (device d along `seq_axis`) holds the page ids d * P/n .. (d + 1) * P/n - 1;
* page tables keep global ids, so the unsharded reference reads the same arrays;
* page j of slot s (column j of its page table) lives on owner (s + j) % n: striped, and rotated by the slot so
  that the first pages of many short sequences do not all land on owner 0.  A slot of m pages then holds
  floor(m / n) or ceil(m / n) of them on each owner: 1/n of it, plus at most one page.  A slot that shares
  another's prefix (`share_prefix`) keeps that slot's owners for the shared pages, and its copy-on-write of the
  shared partial page stays on that page's owner (so no page crosses devices); its own new columns follow its
  own stripe;
* a ring prefill (`PagedKVCache.reserve_prefill`, `paged_ring_prefill`) places its prompt's columns otherwise:
  cut into 2n chunks of whole pages, chunk c on owner c for c < n and 2n - 1 - c after (`prefill_owners`), the
  zigzag layout of the prompt's shards, so shard d writes only into its own device's pages.  Each owner then
  holds exactly 1/n of the prompt; the columns after it follow the stripe again.

Worked example, n = 4, P = 32, so P/n = 8: owner 2 holds ids 16 .. 23.  Slot 1 with 6 pages has its columns 0
and 4 on owner 1, 1 and 5 on owner 2, 2 on owner 3, 3 on owner 0; its copy-on-write of a shared partial page in
column 5 takes a fresh page of owner 2.

Each owner has its own free list, and a write needs extra[s, d] new pages on owner d; it is admitted only when
every owner has them (all or nothing per slot).  With n = 1 every function reduces to the single free list of the
unsharded cache, with the same page ids.

Sharding: the bookkeeping (free lists, ranks, page table, ref counts) is small and computed replicated (`ref_counts`
is gathered, P int32s, and stored back sharded).  Only the page arrays and their scales are touched sharded: by scatters whose global indices each device masks to its own range, and by the
copy-on-write, which stays on one owner and so runs per owner in an [n, P/n, ...] view: no page crosses devices.
On Explicit mesh axes these ops need their output sharding spelled out; on Auto axes XLA propagates the
arrays' sharding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def explicit_sharding(x):
  """x's `NamedSharding` when x is typed on a mesh with Explicit axes (ops must then spell shardings out), else
  None (no mesh, or Auto axes: XLA propagates)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or not mesh.axis_names or not any(t == AxisType.Explicit for t in mesh.axis_types):
    return None
  return sharding


def eager_mesh(x):
  """The concrete mesh of x when x is a concrete array typed on Explicit mesh axes and no trace is under way, else
  None.  Op by op (no jit), JAX places each op's Python scalars on the context mesh, and fails without one."""
  if isinstance(x, jax.core.Tracer) or explicit_sharding(x) is None:
    return None
  mesh = getattr(getattr(x, "sharding", None), "mesh", None)
  if not isinstance(mesh, Mesh) or under_trace():
    return None
  return mesh


def under_trace() -> bool:
  """True inside a jit's (or any transformation's) trace, where even closed-over concrete arrays meet tracers."""
  return isinstance(jnp.zeros(()), jax.core.Tracer)


def replicated(x):
  """x on every device (for the allocator's small bookkeeping arrays such as `ref_counts`)."""
  sharding = explicit_sharding(x)
  return x if sharding is None else jax.reshard(x, NamedSharding(sharding.mesh, P()))


def placed_like(x, like):
  """x with the sharding of `like` (Explicit axes; elsewhere XLA propagates it)."""
  sharding = explicit_sharding(like)
  return x if sharding is None else jax.reshard(x, sharding)


def scatter_set(x, index, value):
  """`x.at[index].set(value, mode="drop")`, keeping x's sharding: every device keeps the rows in its range."""
  if x is None:
    return None
  return x.at[index].set(value, mode="drop", out_sharding=explicit_sharding(x))


def column_owner(j, slot, n: int):
  """The owner of page column j of `slot`: (slot + j) % n (broadcast together)."""
  return (slot + j) % n


def pages_on(m, d, n: int):
  """How many of the page columns 0 .. m - 1 (m >= 0) of slot 0 lie on owner d (column j on owner j % n); for
  slot s pass d - s (mod n)."""
  return (m + n - 1 - d) // n


def extra_per_owner(have, need, cow, cow_owner, n: int, owners=None):
  """[S, n] pages each slot needs on each owner: its new columns have .. need - 1 ([S] each, need >= have), plus
  a fresh page for the copy-on-write (cow [S] 0 or 1) of its partial page, on that page's owner cow_owner [S]
  (a shared prefix keeps the owners of the slot it came from).  `owners` [S, pages_per_seq]: each column's owner
  when the columns are not striped (`prefill_owners`); None: the stripe (s + j) % n."""
  d = jnp.arange(n)[None]
  if owners is None:
    slot = jnp.arange(have.shape[0])[:, None]
    rel = (d - slot) % n  # the slot-0 owner whose columns lie on owner d for this slot
    grow = pages_on(need[:, None], rel, n) - pages_on(have[:, None], rel, n)
  else:
    grow = _owner_counts(owners, have, need, n)[0]
  return grow + cow[:, None] * (cow_owner[:, None] == d)


def _owner_counts(owners, have, need, n: int):
  """For explicit column owners [S, pps]: (new columns per owner [S, n], before [S, pps]: the new columns of the
  same slot and owner left of each column)."""
  j = jnp.arange(owners.shape[1])[None]
  grow = (j >= have[:, None]) & (j < need[:, None])
  one_hot = ((owners[..., None] == jnp.arange(n)) & grow[..., None]).astype(jnp.int32)  # [S, pps, n]
  count = jnp.cumsum(one_hot, axis=1)
  before = jnp.take_along_axis(count - one_hot, jnp.clip(owners, 0, n - 1)[..., None], axis=2)[..., 0]
  return count[:, -1], before


def prefill_owners(kv_lens, slot, padded_len: int, page_size: int, pages_per_seq: int, n: int):
  """[S, pps] column owners for a ring prefill of slot `slot` (the ring prefill layout): the stripe everywhere,
  except the prompt's columns, from kv_lens[slot] / page_size on (a page boundary), which are cut into 2n chunks
  of padded_len / (2n) tokens each, chunk c on owner c for c < n and 2n - 1 - c after: the zigzag layout of
  `zigzag_order`, so prefill shard d (chunks d and 2n - 1 - d) writes only into its own device's pages."""
  S = kv_lens.shape[0]
  j = jnp.arange(pages_per_seq)[None]
  rows = jnp.arange(S)[:, None]
  chunk_pages = padded_len // (2 * n * page_size)
  c = (j - kv_lens[slot] // page_size) // chunk_pages
  prompt = (rows == slot) & (c >= 0) & (c < 2 * n)
  return jnp.where(prompt, jnp.where(c < n, c, 2 * n - 1 - c), column_owner(j, rows, n))


def free_per_owner(refs, n: int):
  """[n] int32 free pages (ref count 0) of each owner; `refs` [P] replicated."""
  return jnp.sum((refs == 0).reshape(n, -1), axis=1).astype(jnp.int32)


def serve(extra, candidate, free):
  """Admission in slot order: slot s takes its extra[s] [n] pages when candidate[s] and every owner still has
  them.  Returns (accepted [S] bool, free_before [S, n]: each owner's pages left after the slots before s).

  When every candidate's pages fit at once (a serving step, as a rule) all are taken, and the pages left before
  each slot are a prefix sum; only otherwise does the slot-by-slot scan run (on a TPU, a `while` of S tiny steps:
  0.12 ms a layer in a decode step of 64 sequences)."""
  wanted = jnp.where(candidate[:, None], extra, 0)

  def all_fit():
    return candidate, free - (jnp.cumsum(wanted, axis=0) - wanted)

  def in_order():
    def step(used, x):
      pages, ok = x
      take = ok & jnp.all(used + pages <= free)
      return used + jnp.where(take, pages, 0), (take, free - used)

    return jax.lax.scan(step, jnp.zeros_like(free), (extra, candidate))[1]

  return jax.lax.cond(jnp.all(jnp.sum(wanted, axis=0) <= free), all_fit, in_order)


def free_lists(refs, n: int):
  """[n, P/n] int32: each owner's free page ids (global) in increasing order, padded with P."""
  num_pages = refs.shape[0]
  q = num_pages // n
  local = jax.vmap(lambda r: jnp.nonzero(r == 0, size=q, fill_value=q)[0])(refs.reshape(n, q))
  return jnp.where(local < q, local + q * jnp.arange(n)[:, None], num_pages).astype(jnp.int32)


def take(free, owner, rank):
  """The id at `rank` of `owner`'s free list (owner and rank broadcast together); P where the list is shorter."""
  n, q = free.shape
  return jnp.where(rank < q, free[owner, jnp.clip(rank, 0, q - 1)], n * q)


def allocate(free, extra, have, need, cow, cow_owner, pages_per_seq: int, owners=None):
  """The page ids a reservation takes: (fresh [S], ids [S, pages_per_seq]).

  fresh[s] is the copy-on-write page of slot s (on cow_owner[s], the copied page's owner; P: none); ids[s, j] the new page of column j
  (owner (s + j) % n) for have[s] <= j < need[s], P elsewhere.  Slots are served in order from each owner's free list:
  the exclusive prefix sum of extra [S, n] is where a slot starts on each owner; there its copy comes first, then
  its new columns on that owner in order (n apart, so column j has (j - have) // n of them before it; with
  explicit `owners` [S, pps] the count of the same owner's new columns left of it).
  """
  n = free.shape[0]
  rows = jnp.arange(extra.shape[0])
  offset = jnp.cumsum(extra, axis=0) - extra  # [S, n]
  d0 = cow_owner
  fresh = jnp.where(cow > 0, take(free, d0, offset[rows, d0]), n * free.shape[1])
  j = jnp.arange(pages_per_seq)[None]
  if owners is None:
    d, before = column_owner(j, rows[:, None], n), (j - have[:, None]) // n
  else:
    d, before = owners, _owner_counts(owners, have, need, n)[1]
  rank = offset[rows[:, None], d] + cow[:, None] * (d == d0[:, None]) + before
  grow = (j >= have[:, None]) & (j < need[:, None])
  return fresh, jnp.where(grow, take(free, d, rank), n * free.shape[1])


def copy_pages(x, src, dst, n: int):
  """x [P, ...] with page dst[i] set to page src[i] (dst[i] = P: no copy).  src[i] and dst[i] must lie on the same
  owner (a copy-on-write stays on its column's owner), so on n devices each device copies within its own pages."""
  if x is None:
    return None
  num_pages = x.shape[0]
  if n == 1:
    return x.at[dst].set(x[jnp.clip(src, 0, num_pages - 1)], mode="drop")
  q = num_pages // n
  owner = jnp.arange(n)[:, None]
  # [n, S] local ids: the copies of owner d in row d; q (dropped) where a copy is not d's.
  src_local = jnp.where(src[None] // q == owner, src[None] % q, q)
  dst_local = jnp.where(dst[None] // q == owner, dst[None] % q, q)
  per_owner = x.reshape(n, q, *x.shape[1:])
  sharding = explicit_sharding(x)
  if sharding is not None:
    # Row d of the ids to the device holding row d of the pages, so the gather and scatter stay local.
    rows = NamedSharding(sharding.mesh, P(sharding.spec[0], None))
    src_local, dst_local = jax.reshard(src_local, rows), jax.reshard(dst_local, rows)
  copied = jax.vmap(lambda xd, s: xd[jnp.clip(s, 0, q - 1)])(per_owner, src_local)
  per_owner = jax.vmap(lambda xd, t, c: xd.at[t].set(c, mode="drop"))(per_owner, dst_local, copied)
  return per_owner.reshape(x.shape)

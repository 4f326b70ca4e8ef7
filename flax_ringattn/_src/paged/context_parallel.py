"""Context parallelism for paged attention: the cache's pages spread over a sequence axis, partials merged exactly.

Layout (`PagedKVCache.create(..., mesh=, seq_axis=)` allocates it): the page arrays stay one global
`[P, page_size, K, H]` array sharded on the page dimension over the axis, so device d of n holds the global page
ids `[d * P / n, (d + 1) * P / n)`; page tables keep global ids (the unsharded reference reads the same arrays).

Per call, inside `jax.shard_map` over the axis:

    local ids  : a page id this device owns becomes its local index, any other id becomes -1, which every paged
                 kernel already treats as a page that is not there (masked, never read)
    compaction : a decode row (q_len 1) sees every earlier token, so without a window its sequence's table is
                 compacted to the device's own pages in order, with their token count as its length: the kernel
                 walks 1/n of the context instead of every block with n - 1 of n pages masked.  Prefill and
                 chunked rows keep global columns (their causal mask needs global positions)
    forward    : (o_d, lse_d) = the kernel over this device's pages only: o_d normalised over them, lse_d = -inf
                 for a row that sees none of them
    merge      : m = pmax(lse_d); w_d = exp(lse_d - m) (0 for -inf); one psum of [T, N, Hv + 1] (o_d * w_d, w_d)
                 gives o = sum_d o_d w_d / sum_d w_d and lse = m + log(sum_d w_d): exact, and 0 / -inf for a row
                 that sees nothing on any device (no NaN)
    backward   : the kernel's backward over this device's pages with the *merged* lse and delta (the block
                 contract: exp(s - lse) are then the true probabilities), so dK / dV land in this device's
                 pages and dq is this device's share, summed over the axis

The sinks, applied by `flash` to the merged rows, enter once.  Memory per device: 1 / n of the pages and one
[T, N, Hv + 1] buffer; the q rows, the metadata and the output are replicated over the axis.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src import ragged
from flax_ringattn._src.paged import common

F32 = jnp.float32


def owned_page_ids(page_indices, axis_name, local_pages: int):
  """The page table in this device's local ids: an id it owns -> id - first, any other -> -1 (not there)."""
  first = jax.lax.axis_index(axis_name) * local_pages
  mine = (page_indices >= first) & (page_indices < first + local_pages)
  return jnp.where(mine, page_indices - first, -1).astype(page_indices.dtype)


def local_operands(operands, axis_name, compact: bool = False):
  """The paged operands (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale, and
  the optional bidirectional ids) with
  the page table in this device's ids (the pages and per-page scales are already its shards); with `compact`
  (no window), decode rows' sequences compacted to this device's pages (`compact_decode_rows`)."""
  q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *rest = operands
  table = owned_page_ids(page_indices, axis_name, k_pages.shape[0])
  if compact:
    kv_lens, table = compact_decode_rows(kv_lens, table, cu_q_lens, num_seqs, common.page_size_of(k_pages, v_pages))
  return q, k_pages, v_pages, kv_lens, table, cu_q_lens, num_seqs, *rest


def compact_decode_rows(kv_lens, table, cu_q_lens, num_seqs, page_size: int):
  """(kv_lens, table) with every sequence of one new token (q_len 1) rewritten over this device's pages only:
  its pages (local ids, -1 elsewhere in `table`) moved to the front in column order, its length their tokens.
  Every page but a sequence's last is full, so the local positions stay dense and the decode row, at the last
  local position, still sees every key it saw.  Other sequences are returned unchanged."""
  j = jnp.arange(table.shape[1])[None]
  used = (table >= 0) & (j * page_size < kv_lens[:, None])
  tokens = jnp.sum(jnp.where(used, jnp.clip(kv_lens[:, None] - j * page_size, 0, page_size), 0), axis=1)
  compacted, _ = compact(table, used)
  decode = ragged.seq_q_lens(cu_q_lens, num_seqs) == 1
  return jnp.where(decode, tokens.astype(kv_lens.dtype), kv_lens), jnp.where(decode[:, None], compacted, table)


def compact(table, keep):
  """(table [S, pps] with each row's entries where `keep` moved to its front in column order and -1 after them,
  how many each row kept [S]): a device's own pages of a sequence as one dense local sequence."""
  S, pps = table.shape
  to = jnp.where(keep, jnp.cumsum(keep, axis=1) - 1, pps)  # where each kept entry goes; pps: dropped
  out = jnp.full_like(table, -1).at[jnp.arange(S)[:, None], to].set(table, mode="drop")
  return out, jnp.sum(keep, axis=1).astype(jnp.int32)


def merge_partials(o, lse, axis_name):
  """The exact merge of the devices' partials o [T, N, Hv] (normalised over each device's keys) and lse [T, N]
  (-inf where a device saw no key): (o, lse) of the whole cache, identical on every device."""
  m = jax.lax.pmax(lse, axis_name)
  m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
  w = jnp.where(jnp.isneginf(lse), 0.0, jnp.exp(lse - m_safe))  # this device's share of each row's mass
  both = jnp.concatenate([o.astype(F32) * w[..., None], w[..., None]], axis=-1)
  both = jax.lax.psum(both, axis_name)  # the one [T, N, Hv + 1] collective
  total = both[..., -1]
  empty = total == 0.0
  safe = jnp.where(empty, 1.0, total)
  out = both[..., :-1] / safe[..., None]
  return out, jnp.where(empty, -jnp.inf, m_safe + jnp.log(safe))

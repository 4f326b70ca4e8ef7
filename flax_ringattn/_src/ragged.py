"""What every paged backend reads, below them all: the ragged batch's schedule, and pages as stored.

A ragged batch packs the new tokens of up to S sequences into q [T, N, H]:
sequence i owns rows cu_q_lens[i] .. cu_q_lens[i + 1] - 1, and its new tokens
are the last q_len_i of its kv_lens[i] tokens, so row j of sequence i sits at
position kv_lens[i] - q_len_i + j and sees the cached positions <= its own.

Worked example, page_size 4, two sequences:
  cu_q_lens = [0, 3, 4], kv_lens = [3, 9]       (a 3-token prefill, a decode)
  rows 0, 1, 2 -> sequence 0, positions 0, 1, 2 (sees 0..0, 0..1, 0..2)
  row 3        -> sequence 1, position 8        (sees 0..8: pages 0, 1, 2 of its row)

Backends walk the batch in "chunks" of at most `block_q` rows of one sequence.
The number of chunks is at most S + ceil(T / block_q), a static bound, so the
schedule has static shapes and nothing recompiles when the batch mix changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


def effective_cu(cu_q_lens, num_seqs):
  """cu_q_lens as the kernels read it: entries past num_seqs repeat the total and
  a decrease is flattened (cumulative max), so rows never belong to two
  sequences, whatever the metadata says (checked mode reports such input)."""
  S = cu_q_lens.shape[0] - 1
  idx = jnp.minimum(jnp.arange(S + 1), jnp.clip(num_seqs[0], 0, S))
  return jax.lax.cummax(cu_q_lens[idx], axis=0)


def seq_q_lens(cu_q_lens, num_seqs):
  """[S] new-token count per sequence; 0 past num_seqs and for decreasing cu_q_lens."""
  cu = effective_cu(cu_q_lens, num_seqs)
  return cu[1:] - cu[:-1]


def _count_at_most(ends, x):
  """int32 [X]: how many of the ascending `ends` [S] are <= each x (`searchsorted(side="right")`), by comparing
  all pairs: S is the batch's sequence count, and on a TPU the default binary search is a `while` loop (0.3 ms
  of a serving step, profiled on a v5e) where these [X, S] compares are one fused reduction."""
  return jnp.searchsorted(ends, x, side="right", method="compare_all").astype(jnp.int32)


def token_owner(cu_q_lens, num_seqs, num_tokens: int):
  """(seq [T], position [T], valid [T]) for every row of q."""
  S = cu_q_lens.shape[0] - 1
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  cu = effective_cu(cu_q_lens, num_seqs)
  seq = jnp.clip(_count_at_most(cu[1:], t), 0, S - 1)
  lens = cu[1:] - cu[:-1]
  start = cu[seq]
  valid = (t >= start) & (t - start < lens[seq])
  return seq, start, valid


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Chunks:
  """Static-size schedule of (sequence, rows) work items; entries >= count are unused."""

  seq: jax.Array  # [C] sequence of each chunk
  q_start: jax.Array  # [C] first row of q
  row0: jax.Array  # [C] index of that row among the sequence's new tokens
  num_rows: jax.Array  # [C] rows used (<= block_q)
  count: jax.Array  # [] chunks in use


def chunk_schedule(cu_q_lens, num_seqs, num_tokens: int, block_q: int, select=None, max_chunks=None) -> Chunks:
  """Chunks of the sequences where `select` [S] is True (default: all).

  `max_chunks` may tighten the static bound S + ceil(T / block_q) when the
  caller knows more (the decode pass: one chunk per sequence).
  """
  S = cu_q_lens.shape[0] - 1
  C = S + -(-num_tokens // block_q) if max_chunks is None else max_chunks
  lens = seq_q_lens(cu_q_lens, num_seqs)
  if select is not None:
    lens = jnp.where(select, lens, 0)
  per_seq = -(-lens // block_q)
  ends = jnp.cumsum(per_seq)
  starts = ends - per_seq
  c = jnp.arange(C, dtype=jnp.int32)
  seq = jnp.clip(_count_at_most(ends, c), 0, S - 1)
  row0 = (c - starts[seq]) * block_q
  q_start = effective_cu(cu_q_lens, num_seqs)[seq] + row0
  num_rows = jnp.where(c < ends[-1], jnp.clip(lens[seq] - row0, 0, block_q), 0)
  # Rows past the end of q (only with inconsistent cu_q_lens) are never used.
  num_rows = jnp.clip(jnp.minimum(num_rows, num_tokens - q_start), 0, block_q)
  return Chunks(seq=seq, q_start=q_start, row0=row0, num_rows=num_rows, count=ends[-1].astype(jnp.int32))


def dequantize(pages, scale, page_ids=None):
  """pages [..., page_size, K, H] (gathered at `page_ids` if given) to float32 times scale."""
  x = pages.astype(jnp.float32)
  if scale is None:
    return x
  scale = scale.astype(jnp.float32)
  if scale.ndim == 0:
    return x * scale
  if page_ids is not None:
    scale = scale[page_ids]
  if scale.ndim == x.ndim - 2:  # [..., K] per page
    return x * scale[..., None, :, None]
  return x * scale[..., None]  # [..., page_size, K] per token

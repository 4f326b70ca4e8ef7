"""Tile layout helpers shared by the XLA forward and backward."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from flax_ringattn._src import dropout as dropout_lib
from flax_ringattn._src import masks
from flax_ringattn._src.block_sizes import BlockSizes, effective_tile

F32 = jnp.float32

# Measured on a 2-core CPU for one 1024 x 1024 block, B=1, 4 heads, head_dim 64,
# f32 (interleaved medians): narrow kv tiles keep the backward's score, p, dp
# and ds tiles in cache (fwd+bwd 73 ms at 512x128 vs 87 ms at 512x512), and a q
# tile of at most half a shard keeps zigzag chunks in separate tiles so causal
# tiles can be skipped.
DEFAULT_BLOCKS = BlockSizes(block_q=512, block_kv=128)


def tiles(spec, T: int, S: int, *, backward: bool) -> tuple[int, int]:
  """(bq, bk) tile sizes that divide T and S."""
  blocks = spec.block_sizes or DEFAULT_BLOCKS
  req_q, req_kv = blocks.bwd if backward else (blocks.block_q, blocks.block_kv)
  return effective_tile(T, req_q), effective_tile(S, req_kv)


def zeros_after(shape, *deps):
  """f32 zeros of `shape` that XLA cannot materialise before `deps` exist.

  XLA:CPU's default scheduler is breadth-first (it runs every instruction as
  soon as its operands are ready, for concurrency), so a plain `jnp.zeros`
  feeding a loop is allocated at program start and stays live until its loop
  runs: the output buffers of the hops outside the ring loops (the forward's
  last, the backward's first and last) would sit through the whole forward.
  Deriving the zero from one element of each dependency (a predicate that is
  always false, even for NaN) keeps the buffer behind them.  Other schedulers
  are unaffected; the cost is one scalar per call.
  """
  x = sum(d.reshape(-1)[0].astype(F32) for d in deps)
  never = (x != x) & (x == x)
  return jnp.broadcast_to(never.astype(F32), shape)


# Tiles are cut from (and written back into) the shards in their own [B, L, ...]
# layout with dynamic slices inside the loops: no tile-major copy of a whole
# shard is ever made, so a block costs its outputs plus a few tiles of memory.
# Inside a tile the heads lead ([B, K, G, tile, H]) so every matmul works on
# contiguous per-head slabs; those transposes are tile-sized.


def q_tile(x, i, tile: int, kv_heads: int):
  """Tile `i` of [B, T, N, H] as [B, K, G, tile, H]."""
  B, _, N, H = x.shape
  x = jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=1)
  return x.reshape(B, tile, kv_heads, N // kv_heads, H).transpose(0, 2, 3, 1, 4)


def put_q_tile(x, tile_value, i):
  """Writes a [B, K, G, tile, H] tile into [B, T, N, H] at tile `i` (inverse of `q_tile`)."""
  B, K, G, t, H = tile_value.shape
  tile_value = tile_value.transpose(0, 3, 1, 2, 4).reshape(B, t, K * G, H).astype(x.dtype)
  return jax.lax.dynamic_update_slice_in_dim(x, tile_value, i * t, axis=1)


def kv_tile(x, j, tile: int):
  """Tile `j` of [B, S, K, H] as [B, K, tile, H]."""
  return jax.lax.dynamic_slice_in_dim(x, j * tile, tile, axis=1).transpose(0, 2, 1, 3)


def put_kv_tile(x, tile_value, j):
  """Writes a [B, K, tile, H] tile into [B, S, K, H] at tile `j` (inverse of `kv_tile`)."""
  t = tile_value.shape[2]
  return jax.lax.dynamic_update_slice_in_dim(x, tile_value.transpose(0, 2, 1, 3).astype(x.dtype), j * t, axis=1)


def row_tile(x, i, tile: int, kv_heads: int):
  """Tile `i` of per-row statistics [B, N, T] as [B, K, G, tile]."""
  B, N, _ = x.shape
  return jax.lax.dynamic_slice_in_dim(x, i * tile, tile, axis=2).reshape(B, kv_heads, N // kv_heads, tile)


def put_row_tile(x, tile_value, i):
  """Writes a [B, K, G, tile] tile into [B, N, T] at tile `i` (inverse of `row_tile`)."""
  B, K, G, t = tile_value.shape
  return jax.lax.dynamic_update_slice_in_dim(x, tile_value.reshape(B, K * G, t).astype(x.dtype), i * t, axis=2)


def scores(q_i, k_j, spec):
  """Scaled (and soft-capped) f32 scores of one tile pair: [B, K, G, bq, bk].

  Returns (s, t) where t = tanh(raw / cap) is kept for the soft-cap gradient
  (None without a cap).
  """
  s = jnp.einsum("bkgqh,bkth->bkgqt", q_i, k_j, preferred_element_type=F32, precision=spec.precision)
  s = s * spec.scale
  if spec.logits_soft_cap is None:
    return s, None
  t = jnp.tanh(s / spec.logits_soft_cap)
  return spec.logits_soft_cap * t, t


def apply_mask(s, spec, q_tok, kv_tok):
  """Scores [B, K, G, bq, bk] with the pairs the mask hides set to -inf (tokens: one tile's `masks.Tokens`)."""
  vis = masks.visible(spec.mask, q_tok, kv_tok)  # [B|1, bq, bk]
  return jnp.where(vis[:, None, None], s, -jnp.inf)


def dropout_scale(spec, dropout, qp_i, kp_j, shape):
  """keep / (1 - rate) of one [B, K, G, bq, bk] tile pair (None without dropout)."""
  if not dropout_lib.require_operand(spec.dropout_rate, dropout):
    return None
  B, K, G = shape[:3]
  keep = dropout_lib.keep_grouped(
    dropout, qp_i, kp_j, rate=spec.dropout_rate, broadcast=spec.dropout_broadcast, B=B, K=K, G=G
  )
  return dropout_lib.keep_scale(keep, spec.dropout_rate)

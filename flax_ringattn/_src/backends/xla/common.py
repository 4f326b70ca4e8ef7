"""Tile layout helpers shared by the XLA forward and backward."""

from __future__ import annotations

import jax.numpy as jnp

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


def q_tiles(x, tile: int, kv_heads: int):
  """[B, T, N, H] -> [T/tile, B, K, G, tile, H]: tile axis first so loops scan over it."""
  B, T, N, H = x.shape
  return x.reshape(B, T // tile, tile, kv_heads, N // kv_heads, H).transpose(1, 0, 3, 4, 2, 5)


def q_untile(x):
  """Inverse of `q_tiles`."""
  n, B, K, G, t, H = x.shape
  return x.transpose(1, 0, 4, 2, 3, 5).reshape(B, n * t, K * G, H)


def kv_tiles(x, tile: int):
  """[B, S, K, H] -> [S/tile, B, K, tile, H]."""
  B, S, K, H = x.shape
  return x.reshape(B, S // tile, tile, K, H).transpose(1, 0, 3, 2, 4)


def kv_untile(x):
  n, B, K, t, H = x.shape
  return x.transpose(1, 0, 3, 2, 4).reshape(B, n * t, K, H)


def row_tiles(x, tile: int, kv_heads: int):
  """Per-row statistics [B, N, T] -> [T/tile, B, K, G, tile]."""
  B, N, T = x.shape
  return x.reshape(B, kv_heads, N // kv_heads, T // tile, tile).transpose(3, 0, 1, 2, 4)


def row_untile(x):
  n, B, K, G, t = x.shape
  return x.transpose(1, 2, 3, 0, 4).reshape(B, K * G, n * t)


def pos_tiles(pos, tile: int):
  return pos.reshape(pos.shape[0] // tile, tile)


def seg_tiles(seg, tile: int):
  """[B, L] -> [L/tile, B, tile] (or None)."""
  if seg is None:
    return None
  B, L = seg.shape
  return seg.reshape(B, L // tile, tile).transpose(1, 0, 2)


def tile_kinds(mask_spec, q_pos, kv_pos, q_seg, kv_seg, bq: int, bk: int):
  """[T/bq, S/bk] table of masks.EMPTY / PARTIAL / FULL."""
  qe = masks.tile_extent(q_pos, q_seg, bq)
  ke = masks.tile_extent(kv_pos, kv_seg, bk)
  col = lambda a: None if a is None else a[..., :, None]  # noqa: E731
  row = lambda a: None if a is None else a[..., None, :]  # noqa: E731
  return masks.classify(
    mask_spec,
    masks.Extent(col(qe.pos_min), col(qe.pos_max), col(qe.seg_min), col(qe.seg_max)),
    masks.Extent(row(ke.pos_min), row(ke.pos_max), row(ke.seg_min), row(ke.seg_max)),
  )


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


def apply_mask(s, spec, qp_i, kp_j, qs_i, ks_j):
  vis = masks.visible(spec.mask, qp_i, kp_j, qs_i, ks_j)  # [B|1, bq, bk]
  return jnp.where(vis[:, None, None], s, -jnp.inf)

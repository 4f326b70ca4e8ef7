"""`balanced_layout`, `apply_layout`, `undo_layout`: work-balanced orders for packed batches (issue 32 item 3)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from dense_oracle import _visible, dense_oracle
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src.packing import imbalance_of, visible_pairs_per_token

SKEWED = (600, 200, 100, 50, 40, 34)


def _pack(lengths, rows=1):
  seg = np.concatenate([np.full(L, i) for i, L in enumerate(lengths)]).astype(np.int32)
  return np.stack([np.roll(seg, 37 * b) for b in range(rows)])


def _brute_pairs(seg, **mask):
  """Visible keys per query from the oracle's own elementwise rule."""
  T = seg.shape[1]
  window = mask.get("local_window_size")
  return np.stack(
    [
      _visible(T, T, np.arange(T), np.arange(T), mask.get("is_causal", True), window, s, s, mask.get("chunk_size")).sum(
        1
      )
      for s in seg
    ]
  )


@pytest.mark.parametrize(
  "mask",
  [
    dict(),
    dict(chunk_size=96),
    dict(local_window_size=(40, 0)),
    dict(is_causal=False),
    dict(is_causal=False, local_window_size=(7, 5)),
  ],
  ids=["causal", "chunk", "window", "bidirectional", "two_sided_window"],
)
def test_skewed_pack_reaches_the_imbalance_target(mask):
  """The issue's pack (600, 200, 100, 50, 40, 34 in 1024 over 8 shards): <= 1.05, where zigzag is far above."""
  seg = _pack(SKEWED)
  work = visible_pairs_per_token(seg, **mask)
  np.testing.assert_array_equal(work, _brute_pairs(seg, **mask))
  layout = fr.balanced_layout(seg, 8, **mask)
  assert layout.imbalance <= 1.05, layout.imbalance
  assert layout.imbalance == pytest.approx(imbalance_of(layout.order, work, 8))
  zigzag = imbalance_of(fr.zigzag_positions(1024, 8)[None], work, 8)
  if mask.get("is_causal", True):
    assert zigzag > layout.imbalance + 0.1, zigzag  # causal 2.5, chunk 1.2, window 1.1
  # Every row a permutation; each shard keeps its tokens in document order.
  np.testing.assert_array_equal(np.sort(layout.order, axis=1), np.arange(1024)[None])
  assert (np.diff(layout.order.reshape(8, 128), axis=1) > 0).all()


def _brute_tiles(seg, order, n, tile, **mask):
  """Per shard: the (q tile, kv tile) pairs over every hop with a visible pair, from the oracle's rule on the
  original positions, in the slot order `order` [1, T]."""
  T = seg.shape[1]
  vis = _visible(T, T, np.arange(T), np.arange(T), mask.get("is_causal", True), None, seg[0], seg[0])
  slots = vis[order[0]][:, order[0]]
  nb = T // tile
  any_pair = slots.reshape(nb, tile, nb, tile).any(axis=(1, 3))  # [q block, kv block]
  return any_pair.sum(axis=1).reshape(n, -1).sum(axis=1)


@pytest.mark.parametrize("tile", [16, 32])
def test_tile_layout_balances_the_tiles_the_kernels_compute(tile):
  """With `tile`, shards are whole blocks of `tile` tokens balanced on the non-empty tile pairs: on the skewed
  pack the busiest shard computes about half the tiles of zigzag's and fewer than the token-level layout's, and
  the tiles computed in all are no more than the natural order's."""
  seg = _pack(SKEWED)
  layout = fr.balanced_layout(seg, 8, tile=tile)
  blocks = layout.order.reshape(-1, tile)
  np.testing.assert_array_equal(blocks, blocks[:, :1] + np.arange(tile))  # whole blocks of consecutive tokens
  assert blocks[:, 0].min() >= 0 and (blocks[:, 0] % tile == 0).all()
  counts = _brute_tiles(seg, layout.order, 8, tile)
  assert layout.tile_imbalance == pytest.approx(counts.max() / counts.mean())
  assert layout.tile_imbalance <= 1.05, layout.tile_imbalance
  assert layout.imbalance == pytest.approx(imbalance_of(layout.order, visible_pairs_per_token(seg), 8))
  zigzag = _brute_tiles(seg, fr.zigzag_positions(1024, 8)[None], 8, tile)
  by_token = _brute_tiles(seg, fr.balanced_layout(seg, 8).order, 8, tile)
  natural = _brute_tiles(seg, np.arange(1024)[None], 8, tile)
  assert counts.max() < 0.6 * zigzag.max() and counts.max() < by_token.max(), (counts, zigzag, by_token)
  assert counts.sum() == natural.sum() < by_token.sum()


def test_random_packs_of_several_rows():
  rng = np.random.default_rng(0)
  rows = []
  for _ in range(3):
    cuts = np.sort(rng.choice(np.arange(1, 2048), rng.integers(2, 12), replace=False))
    rows.append(np.searchsorted(cuts, np.arange(2048), side="right"))
  layout = fr.balanced_layout(np.stack(rows).astype(np.int32), 16)
  assert layout.order.shape == (3, 2048) and layout.num_shards == 16
  assert layout.imbalance <= 1.05, layout.imbalance


@pytest.mark.parametrize("array", ["numpy", "jax"])
def test_apply_and_undo_are_inverse(array):
  layout = fr.balanced_layout(_pack((40, 16, 8), rows=2), 4)
  x = np.arange(2 * 3 * 64 * 5).reshape(2, 3, 64, 5)
  if array == "jax":
    x = jnp.asarray(x)
  moved = fr.apply_layout(x, layout, axis=2)
  assert isinstance(moved, np.ndarray) == (array == "numpy")
  np.testing.assert_array_equal(np.asarray(moved)[1, 2, :, 0], np.asarray(x)[1, 2, layout.order[1], 0])
  np.testing.assert_array_equal(np.asarray(fr.undo_layout(moved, layout, axis=2)), np.asarray(x))
  np.testing.assert_array_equal(
    np.asarray(fr.undo_layout(fr.apply_layout(x[:, 0], layout), layout)), np.asarray(x[:, 0])
  )


@pytest.mark.parametrize("tile", [None, 8])
def test_the_balanced_layout_through_the_ring_is_exact(tile):
  """Packed rows in the balanced order, positions given: the oracle's output and gradients, on a ring of 4."""
  B, T, N, H = 2, 64, 2, 8
  seg = _pack((30, 20, 9, 5), rows=B)
  layout = fr.balanced_layout(seg, 4, tile=tile)
  ks = jax.random.split(jax.random.key(0), 4)
  q, k, v, do = (jax.random.normal(x, (B, T, N, H)) for x in ks)
  want, grads = dense_oracle(q, k, v, do=do, is_causal=True, segment_ids=seg)
  mesh = make_mesh((4,), ("sp",))
  moved = [jnp.asarray(fr.apply_layout(np.asarray(x), layout)) for x in (q, k, v, do)]

  def f(q, k, v):
    return fr.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name="sp",
      is_causal=True,
      segment_ids=jnp.asarray(fr.apply_layout(seg, layout)),
      q_positions=jnp.asarray(layout.order),
      implementation="xla",
      block_sizes=fr.BlockSizes(block_q=8, block_kv=8),
    )

  out, vjp = jax.vjp(jax.jit(f), *moved[:3])
  assert_close(fr.undo_layout(np.asarray(out), layout), want, jnp.float32)
  assert_close(tuple(fr.undo_layout(np.asarray(g), layout) for g in vjp(moved[3])), grads, jnp.float32, "grad")


@pytest.mark.parametrize(
  "call, error, match",
  [
    (
      lambda: fr.balanced_layout(np.zeros((1, 30), np.int32), 4),
      ValueError,
      r"T=30 must be a multiple of num_shards=4",
    ),
    (
      lambda: fr.balanced_layout(np.zeros((30,), np.int32), 2),
      ValueError,
      r"segment_ids must be an integer array \[B, T\], got shape=\(30,\)",
    ),
    (
      lambda: fr.balanced_layout(np.zeros((1, 32), np.int32), 0),
      ValueError,
      r"num_shards must be a positive int, got 0",
    ),
    (lambda: fr.balanced_layout(np.zeros((1, 32), np.int32), 2, chunk_size=0), ValueError, r"chunk_size must be >= 1"),
    (
      lambda: jax.jit(lambda s: fr.balanced_layout(s, 2))(jnp.zeros((1, 32), jnp.int32)),
      TypeError,
      r"balanced_layout needs concrete segment_ids",
    ),
    (
      lambda: fr.apply_layout(np.zeros((1, 31)), fr.balanced_layout(np.zeros((1, 32), np.int32), 2)),
      ValueError,
      r"x must be \[B, \.\.\., T, \.\.\.\] with B=1 first and T=32 on axis=1, got x\.shape=\(1, 31\)",
    ),
    (lambda: fr.apply_layout(np.zeros((1, 32)), np.arange(32)), TypeError, r"layout must be a flax_ringattn\.Layout"),
    (
      lambda: fr.Layout(order=np.zeros((1, 4), np.int32), num_shards=2),
      ValueError,
      r"order must hold a permutation of 0 \.\. T-1 in every row",
    ),
    (
      lambda: fr.balanced_layout(np.zeros((1, 64), np.int32), 4, tile=12),
      ValueError,
      r"tile must be a positive int dividing the shard length T / num_shards = 16, got 12",
    ),
  ],
  ids=["length", "rank", "shards", "chunk", "traced", "apply_shape", "apply_type", "not_a_permutation", "tile"],
)
def test_errors(call, error, match):
  with pytest.raises(error, match=match):
    call()

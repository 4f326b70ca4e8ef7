"""Tile and hop classification: exact for causal/window, conservative for segments."""

from __future__ import annotations

import itertools

import jax.numpy as jnp
import numpy as np
import pytest

from flax_ringattn._src import masks
from flax_ringattn._src.layout import shard_positions


def _brute_kinds(spec, q_pos, kv_pos, q_seg, kv_seg, bq, bk, q_bid=None, kv_bid=None):
  qt = masks.Tokens(jnp.asarray(q_pos), q_seg, q_bid)
  kt = masks.Tokens(jnp.asarray(kv_pos), kv_seg, kv_bid)
  vis = np.asarray(masks.visible(spec, qt, kt)).all(axis=0)
  vis_any = np.asarray(masks.visible(spec, qt, kt)).any(axis=0)
  nq, nk = q_pos.shape[-1] // bq, kv_pos.shape[-1] // bk
  out = np.zeros((nq, nk), int)
  for i, j in itertools.product(range(nq), range(nk)):
    blk_all = vis[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
    blk_any = vis_any[i * bq : (i + 1) * bq, j * bk : (j + 1) * bk]
    out[i, j] = masks.FULL if blk_all.all() else (masks.EMPTY if not blk_any.any() else masks.PARTIAL)
  return out


@pytest.mark.parametrize("load_balance", [False, True])
@pytest.mark.parametrize(
  "spec",
  [
    masks.MaskSpec(is_causal=True),
    masks.MaskSpec(window=(5, 2)),
    masks.MaskSpec(is_causal=True, window=(11, 0)),
    masks.MaskSpec(),
  ],
  ids=["causal", "window", "causal_window", "none"],
)
def test_causal_and_window_classes_are_exact(spec, load_balance):
  n, L, bq, bk = 4, 16, 4, 2
  for r, s in itertools.product(range(n), range(n)):
    qp = shard_positions(r, n, L, load_balance)
    kp = shard_positions(s, n, L, load_balance)
    got = np.asarray(masks.tile_kinds(spec, masks.Tokens(qp), masks.Tokens(kp), bq, bk))
    np.testing.assert_array_equal(got, _brute_kinds(spec, qp, kp, None, None, bq, bk), err_msg=f"{r=} {s=}")


def test_segment_classes_are_conservative():
  """EMPTY and FULL are never claimed wrongly; sorted packed ids give real EMPTY/FULL tiles."""
  spec = masks.MaskSpec(is_causal=True, has_segments=True)
  pos = jnp.arange(32, dtype=jnp.int32)
  seg = jnp.asarray([[0] * 8 + [1] * 16 + [2] * 8, [0] * 16 + [1] * 16], jnp.int32)
  got = np.asarray(masks.tile_kinds(spec, masks.Tokens(pos, seg), masks.Tokens(pos, seg), 8, 8))
  brute = _brute_kinds(spec, pos, pos, seg, seg, 8, 8)
  assert not np.any((got == masks.EMPTY) & (brute != masks.EMPTY))
  assert not np.any((got == masks.FULL) & (brute != masks.FULL))
  assert (got == masks.EMPTY).sum() > 6  # causal + segment skipping both happen
  # Tile (1, 0): q ids {1} / {0}, kv ids {0} / {0}: only the first row sees nothing.
  assert got[1, 0] == masks.PARTIAL


def test_causal_ring_skips_half_the_tiles():
  """Contiguous: hops above the diagonal are EMPTY; zigzag: every device computes
  the same number of tiles, and about half of all tiles are skipped either way."""
  n, L, t = 8, 32, 8
  spec = masks.MaskSpec(is_causal=True)
  for load_balance in (False, True):
    per_device = []
    for r in range(n):
      qp = shard_positions(r, n, L, load_balance)
      kinds = [
        np.asarray(masks.tile_kinds(spec, masks.Tokens(qp), masks.Tokens(shard_positions(s, n, L, load_balance)), t, t))
        for s in range(n)
      ]
      per_device.append(sum(int((k != masks.EMPTY).sum()) for k in kinds))
    total = n * n * (L // t) ** 2
    computed = sum(per_device)
    assert computed / total < 0.57, (load_balance, computed, total)
    if load_balance:
      assert len(set(per_device)) == 1, per_device
    else:
      assert per_device[-1] > 4 * per_device[0], per_device


def test_hop_level_empty_for_contiguous_causal():
  spec = masks.MaskSpec(is_causal=True)
  n, L = 4, 8
  for r, s in itertools.product(range(n), range(n)):
    qp, kp = shard_positions(r, n, L, False), shard_positions(s, n, L, False)
    kind = int(masks.classify(spec, masks.tile_extent(masks.Tokens(qp), L), masks.tile_extent(masks.Tokens(kp), L))[0])
    expected = masks.EMPTY if s > r else (masks.PARTIAL if s == r else masks.FULL)
    assert kind == expected, (r, s, kind)

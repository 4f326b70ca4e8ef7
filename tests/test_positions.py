"""Masks on the tokens' own positions: any order, chunked attention, bidirectional spans (issue 32).

Every numerical test builds the problem in natural order, asks the float64 oracle (`dense_oracle.py`, no library
code) for the answer and every gradient there, then hands the library the tokens in another order (a random
permutation per row, zigzag, ...) with their positions, and checks that the output and the gradients are the
oracle's in that order: f32 1e-5, bf16 2e-2.
"""

from __future__ import annotations

import contextlib
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from dense_oracle import dense_oracle
from flax import nnx
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import masks, validation
from flax_ringattn._src.testing.interpret import interpret_params, no_races
from flax_ringattn.testing import kernel_debug

B, T, N, K, H = 2, 32, 4, 2, 8
BLOCKS = fr.BlockSizes(block_q=8, block_kv=8)
# Triton's smallest matmul; TPU kv tiles of 128 lanes (at T = 32 a ring of 1 or 2 has one kv tile per shard).
KERNEL_BLOCKS = {
  "pallas_gpu": fr.BlockSizes(block_q=16, block_kv=16),
  "pallas_tpu": fr.BlockSizes(block_q=8, block_kv=128),
  "pallas_tpu_ring": fr.BlockSizes(block_q=8, block_kv=128),
}
INTERPRET = {"pallas_gpu": lambda: True, "pallas_tpu": interpret_params, "pallas_tpu_ring": interpret_params}
# The kernels that take every mask term, and the cases each runs (every term at least once, at ring 1 and 2).
KERNEL_CASES = ["chunk_window_segments", "image_spans_chunk", "prefix_lm_packed"]


def _inputs(dtype=jnp.float32, seed=0):
  ks = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(ks[0], (B, T, N, H), dtype)
  k = jax.random.normal(ks[1], (B, T, K, H), dtype)
  v = jax.random.normal(ks[2], (B, T, K, H), dtype)
  do = jax.random.normal(ks[3], (B, T, N, H), dtype)
  return q, k, v, do


def _permutations(seed=0):
  """[B, T] int32: a different random order for every row."""
  rng = np.random.default_rng(seed)
  return np.stack([rng.permutation(T) for _ in range(B)]).astype(np.int32)


def _take(x, order):
  """x [B, T, ...] in the order `order` [B, T] (order[b, i]: the natural index of slot i)."""
  x = np.asarray(x)
  idx = order.reshape(order.shape + (1,) * (x.ndim - 2))
  return np.take_along_axis(x, idx, axis=1)


# The mask of each case in natural order: the oracle's keywords and the library's (ids are [B, T] in natural order).
SEGMENTS = np.array([[0] * 12 + [1] * 20, [0] * 20 + [1] * 12], np.int32)
# Image spans that cross the shard edges of a ring of 4 (shards of 8 tokens: edges at 8, 16, 24).
SPANS = np.zeros((B, T), np.int32)
SPANS[0, 6:14], SPANS[0, 20:27], SPANS[1, 3:19] = 1, 2, 5
# Prefix-LM inside packed rows: each document's first tokens are its prefix (its own nonzero id).
PREFIXES = np.zeros((B, T), np.int32)
PREFIXES[0, 0:5], PREFIXES[0, 12:20], PREFIXES[1, 0:9], PREFIXES[1, 20:23] = 1, 2, 1, 2

CASES = {
  "causal_window_segments": dict(is_causal=True, local_window_size=(9, 0), segment_ids=SEGMENTS),
  "chunk_causal": dict(is_causal=True, chunk_size=8),
  "chunk_window_segments": dict(is_causal=True, chunk_size=12, local_window_size=(5, 2), segment_ids=SEGMENTS),
  "image_spans": dict(is_causal=True, bidirectional_ids=SPANS),
  "image_spans_chunk": dict(is_causal=True, chunk_size=16, bidirectional_ids=SPANS),
  "prefix_lm_packed": dict(is_causal=True, segment_ids=SEGMENTS, bidirectional_ids=PREFIXES),
}


def _expected(case, q, k, v, do):
  return dense_oracle(q, k, v, do=do, **CASES[case])


def _ordered_options(case, order):
  """The library's keywords for the tokens in `order`: ids reordered, positions given."""
  opts = dict(CASES[case])
  for name in ("segment_ids", "bidirectional_ids"):
    if name in opts:
      opts[name] = jnp.asarray(_take(opts[name], order))
  return opts | dict(q_positions=jnp.asarray(order))


def _run(q, k, v, do, opts, *, n=1, strategy="ring", implementation="xla", mesh_shape=None, axis=None):
  """(out, (dq, dk, dv)) of `fr.ring_attention` on global arrays, over a mesh of n devices when n > 1."""
  kw = dict(implementation=implementation, block_sizes=KERNEL_BLOCKS.get(implementation, BLOCKS), strategy=strategy)
  if implementation != "xla":
    kw["interpret"] = INTERPRET[implementation]()
  if n > 1:
    shape, names = mesh_shape or ((n,), ("sp",))
    kw |= dict(mesh=make_mesh(shape, names), axis_name=axis or names[0])

  def f(q, k, v):
    return fr.ring_attention(q, k, v, **opts, **kw)

  out, vjp = jax.vjp(jax.jit(f), q, k, v)
  return out, vjp(do)


def _check(case, order, *, dtype=jnp.float32, **run):
  q, k, v, do = _inputs(dtype)
  want, grads = _expected(case, q, k, v, do)
  got, got_grads = _run(
    *(jnp.asarray(_take(x, order), dtype) for x in (q, k, v, do)), _ordered_options(case, order), **run
  )
  assert_close(got, _take(want, order), dtype)
  assert_close(got_grads, tuple(_take(g, order) for g in grads), dtype, "grad")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("n", [1, 4], ids=["ring1", "ring4"])
def test_any_order_is_exact(case, n):
  """A random permutation per row, with its positions: the oracle's answer and gradients in that order."""
  _check(case, _permutations(seed=len(case)), n=n)


# pallas_tpu in TPU interpret mode costs 30-70 s a case here: the kernels run every case at ring 1 (one block:
# the whole mask inside the kernel); the hops around them are the portable ring loop, run at rings 2 and 4 by
# xla on every case and once by pallas_gpu.
KERNEL_RUNS = [
  *(("pallas_gpu", 1, case) for case in KERNEL_CASES),
  ("pallas_gpu", 2, "prefix_lm_packed"),  # per-row positions, segments and spans travelling with K/V
  *(("pallas_tpu", 1, case) for case in KERNEL_CASES),
]


@pytest.mark.parametrize("implementation, n, case", KERNEL_RUNS)
def test_kernels_take_any_order(implementation, n, case):
  """The Pallas kernels on a random permutation with chunks, windows, segments and spans (interpret mode)."""
  with no_races() if implementation.startswith("pallas_tpu") else contextlib.nullcontext():
    _check(case, _permutations(seed=len(case)), n=n, implementation=implementation)


# The in-kernel ring (pallas_tpu_ring), mostly on a ring of 2 (shards of 16 tokens in two q tiles of 8): the kv side's
# positions and ids travel with K/V in the kernel's own DMAs, every hop's tile classes come from all-gathered
# extents, and every hop runs (positions or spans given: no hop or send is known EMPTY before the data).  Both
# kinds of slots, forced with `kernel_debug`: "vmem" (whole shards resident) and "hbm" (tiles streamed).
CHUNKS = dict(is_causal=True, chunk_size=12)  # chunk edges at 12 and 24: they cut zigzag's halves of 8 at ring 2


def _check_kernel_ring(mask, slots, layout, *, n=2):
  """pallas_tpu_ring with its slots in `slots` on a ring of n against the oracle, forward and every gradient:
  the tokens in `layout` order, "contiguous" or "zigzag" (load_balance=True) on the layout's own positions, or
  a [B, T] order given with its positions."""
  q, k, v, do = _inputs()
  want, grads = dense_oracle(q, k, v, do=do, **mask)
  move = jnp.asarray
  opts = dict(mask)
  if isinstance(layout, str):
    if layout == "zigzag":
      move = lambda x: fr.zigzag_order(jnp.asarray(x), n, axis=1)  # noqa: E731
      opts["load_balance"] = True
  else:
    move = lambda x: jnp.asarray(_take(x, layout))  # noqa: E731
    opts["q_positions"] = jnp.asarray(layout)
  for name in ("segment_ids", "bidirectional_ids"):
    if name in opts:
      opts[name] = move(opts[name])
  with kernel_debug(slots=slots), no_races():
    got, got_grads = _run(*(move(x) for x in (q, k, v, do)), opts, n=n, implementation="pallas_tpu_ring")
  assert_close(got, move(want), jnp.float32)
  assert_close(got_grads, tuple(move(g) for g in grads), jnp.float32, "grad")


@pytest.mark.interpret
@pytest.mark.parametrize(
  "case, layout, n, slots",
  [
    ("chunks", "zigzag", 2, "vmem"),
    ("chunks", "zigzag", 2, "hbm"),
    ("image_spans", "contiguous", 2, "vmem"),
    ("image_spans", "contiguous", 2, "hbm"),
    ("chunks", "contiguous", 4, "vmem"),
  ],
)
def test_kernel_ring_on_the_layouts_positions(case, layout, n, slots):
  """No positions given.  Chunks whose edges cut zigzag's halves: the chunk term in the static hop tables (at
  ring 2 member 0 sees nothing of shard 1, so that send is skipped; contiguous at ring 4, shards of 8, the ring
  ends after 2 hops), the tile classes and the kernel's mask.  Contiguous causal with image spans across the
  shard edge: shard 0's queries see shard 1's span keys, which causal alone would never send them (the ids
  travel with K/V)."""
  _check_kernel_ring(CHUNKS if case == "chunks" else CASES[case], slots, layout, n=n)


@pytest.mark.interpret
@pytest.mark.parametrize("case, slots", [("chunk_window_segments", "vmem"), ("prefix_lm_packed", "hbm")])
def test_kernel_ring_takes_any_order(case, slots):
  """A random permutation per row with its positions: chunks, a window and segments (the tile classes must come
  from the positions that travel, not the layout's), or prefix-LM spans in packed documents."""
  _check_kernel_ring(CASES[case], slots, _permutations(seed=len(case)))


@pytest.mark.parametrize(
  "strategy, mesh_shape, axis",
  [
    ("ulysses", ((4,), ("sp",)), "sp"),
    ("all_gather", ((4,), ("sp",)), "sp"),
    ("ulysses_ring", ((2, 2), ("ring", "uly")), ("ring", "uly")),
  ],
)
@pytest.mark.parametrize("case", ["chunk_window_segments", "prefix_lm_packed"])
def test_strategies_take_positions(case, strategy, mesh_shape, axis):
  _check(case, _permutations(seed=7), n=4, strategy=strategy, mesh_shape=mesh_shape, axis=axis)


def test_bf16_permuted_chunk_and_spans():
  _check("image_spans_chunk", _permutations(seed=3), dtype=jnp.bfloat16, n=2)


@pytest.mark.parametrize("case", ["chunk_causal", "image_spans"])
def test_zigzag_layout_without_positions(case):
  """load_balance=True and no positions: the zigzag layout's positions, with chunks and spans across shards."""
  n = 4
  q, k, v, do = _inputs()
  want, grads = _expected(case, q, k, v, do)
  zz = lambda x: fr.zigzag_order(jnp.asarray(x), n, axis=1)  # noqa: E731
  opts = dict(CASES[case])
  if "bidirectional_ids" in opts:
    opts["bidirectional_ids"] = zz(opts["bidirectional_ids"])
  got, got_grads = _run(*(zz(x) for x in (q, k, v, do)), opts | dict(load_balance=True), n=n)
  assert_close(got, zz(want), jnp.float32)
  assert_close(got_grads, tuple(zz(g) for g in grads), jnp.float32, "grad")


def test_a_wrong_order_is_caught_by_positions():
  """The issue's first finding: zigzag trusted on natural-order data is wrong; the same data with its positions
  is right."""
  n = 4
  q, k, v, do = _inputs()
  want, _ = dense_oracle(q, k, v, is_causal=True)
  mesh = make_mesh((n,), ("sp",))
  kw = dict(mesh=mesh, axis_name="sp", is_causal=True, implementation="xla", block_sizes=BLOCKS, load_balance=True)
  trusted = fr.ring_attention(q, k, v, **kw)
  assert float(jnp.abs(trusted - want).max()) > 0.1
  given = fr.ring_attention(q, k, v, q_positions=jnp.arange(T, dtype=jnp.int32), **kw)
  assert_close(given, want, jnp.float32)


def test_dropout_mask_follows_the_tokens():
  """The keep mask hashes the tokens' positions: a permuted call drops the same (query, key) pairs."""
  q, k, v, _ = _inputs()
  order = _permutations(seed=11)
  kw = dict(
    is_causal=True, implementation="xla", dropout_rate=0.3, dropout_rng=jax.random.key(4), broadcast_dropout=False
  )
  natural = fr.ring_attention(q, k, v, **kw)
  permuted = fr.ring_attention(*(jnp.asarray(_take(x, order)) for x in (q, k, v)), q_positions=jnp.asarray(order), **kw)
  assert_close(permuted, _take(natural, order), jnp.float32)


@pytest.mark.interpret
def test_kernel_ring_dropout_follows_the_tokens():
  """The in-kernel ring hashes its keep mask from the positions that travel with the tokens: a permuted call on a
  ring of 2 drops what xla's drops (the test above ties xla's to the natural order)."""
  q, k, v, _ = _inputs()
  order = _permutations(seed=11)
  mesh = make_mesh((2,), ("sp",))
  kw = dict(is_causal=True, dropout_rate=0.3, dropout_rng=jax.random.key(4), broadcast_dropout=False, mesh=mesh)
  kw |= dict(axis_name="sp", q_positions=jnp.asarray(order))
  permuted = [jnp.asarray(_take(x, order)) for x in (q, k, v)]
  want = fr.ring_attention(*permuted, implementation="xla", **kw)
  ring = dict(
    implementation="pallas_tpu_ring", interpret=interpret_params(), block_sizes=KERNEL_BLOCKS["pallas_tpu_ring"]
  )
  with no_races():
    got = fr.ring_attention(*permuted, **ring, **kw)
  assert_close(got, want, jnp.float32)


def test_dot_product_attention_and_reference_take_positions():
  q, k, v, _ = _inputs()
  order = _permutations(seed=5)
  opts = _ordered_options("prefix_lm_packed", order)
  want = _take(dense_oracle(q, k, v, **CASES["prefix_lm_packed"])[0], order)
  qp, kp, vp = (jnp.asarray(_take(x, order)) for x in (q, k, v))
  assert_close(fr.dot_product_attention(qp, kp, vp, implementation="xla", **opts), want, jnp.float32)
  assert_close(fr.reference_attention(qp, kp, vp, **opts), want, jnp.float32)


def test_layer_forwards_positions_and_chunk():
  """`RingMultiHeadAttention(chunk_size=...)` and `__call__(positions=...)`: a permuted batch gives the permuted
  output of the natural-order call."""
  layer = fr.RingMultiHeadAttention(
    num_heads=N, in_features=16, num_kv_heads=K, chunk_size=8, implementation="xla", rngs=nnx.Rngs(0)
  )
  assert layer.chunk_size == 8
  x = jax.random.normal(jax.random.key(1), (B, T, 16))
  order = _permutations(seed=2)
  natural = layer(x, is_causal=True, bidirectional_ids=jnp.asarray(SPANS))
  permuted = layer(
    jnp.asarray(_take(x, order)),
    is_causal=True,
    positions=jnp.asarray(order),
    bidirectional_ids=jnp.asarray(_take(SPANS, order)),
  )
  assert_close(permuted, _take(natural, order), jnp.float32)
  plain = fr.RingMultiHeadAttention(num_heads=N, in_features=16, num_kv_heads=K, implementation="xla", rngs=nnx.Rngs(0))
  assert float(jnp.abs(plain(x, is_causal=True) - layer(x, is_causal=True)).max()) > 1e-3  # the chunk is applied


def test_layer_warns_once_when_zigzag_is_taken_on_trust():
  layer = fr.RingMultiHeadAttention(
    num_heads=2, in_features=8, load_balance=True, implementation="xla", rngs=nnx.Rngs(0)
  )
  x = jnp.ones((1, 8, 8))
  validation._warned.discard("load_balance_on_trust")
  with pytest.warns(UserWarning, match=r"load_balance=True without positions=: the inputs are taken to be in zigzag"):
    layer(x, is_causal=True)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    layer(x, is_causal=True)  # once
    layer(x, is_causal=True, positions=fr.zigzag_positions(8, 1))


@pytest.mark.parametrize(
  "kwargs, error, match",
  [
    (dict(chunk_size=0), ValueError, r"chunk_size must be >= 1 \(None means no chunks\), got chunk_size=0"),
    (dict(chunk_size=2.0), TypeError, r"chunk_size must be a positive int or None, got 2\.0"),
    (
      dict(q_positions=np.zeros((B, T + 1), np.int32)),
      ValueError,
      r"q_positions must be an integer array of shape \[B, T\]=\(2, 32\) or \[T\]=\(32,\), got shape=\(2, 33\)",
    ),
    (
      dict(q_positions=np.zeros((B, T), np.float32)),
      ValueError,
      r"q_positions must be an integer array .* dtype=float32",
    ),
    (
      dict(bidirectional_ids=np.zeros((B, T - 1), np.int32)),
      ValueError,
      r"q bidirectional_ids must have shape \[B, T\]=\(2, 32\), got \(2, 31\)",
    ),
    (dict(bidirectional_ids=np.zeros((B, T), np.float32)), TypeError, r"q bidirectional_ids must be an integer array"),
  ],
  ids=["chunk0", "chunk_float", "positions_shape", "positions_dtype", "bid_shape", "bid_dtype"],
)
def test_mask_arguments_are_checked(kwargs, error, match):
  q, k, v, _ = _inputs()
  with pytest.raises(error, match=match):
    fr.ring_attention(q, k, v, implementation="xla", **kwargs)


def test_one_side_of_positions_serves_self_attention_or_defaults_to_the_index():
  """T == S: the side not given takes the given one (the same tokens); T != S: its index 0 .. L-1."""
  q, k, v, _ = _inputs()
  pos = jnp.asarray(_permutations(seed=1))
  both = fr.reference_attention(q, k, v, is_causal=True, q_positions=pos, kv_positions=pos)
  assert_close(fr.reference_attention(q, k, v, is_causal=True, kv_positions=pos), both, jnp.float32)
  assert_close(fr.ring_attention(q, k, v, is_causal=True, q_positions=pos, implementation="xla"), both, jnp.float32)
  tail = jnp.arange(T - 8, T, dtype=jnp.int32)  # 8 new tokens after 24 cached ones
  got = fr.reference_attention(q[:, :8], k, v, is_causal=True, q_positions=tail)
  want = dense_oracle(q[:, :8], k, v, is_causal=True, q_positions=tail, kv_positions=np.arange(T))[0]
  assert_close(got, want, jnp.float32)


def test_a_dense_mask_with_positions_is_refused():
  q, k, v, _ = _inputs()
  with pytest.raises(
    NotImplementedError, match=r"a dense mask=\.\.\. \(or bias\) is read on the tokens' index .* with q_positions"
  ):
    fr.dot_product_attention(q, k, v, mask=jnp.ones((T, T), bool), q_positions=jnp.arange(T), implementation="xla")


# Tile classification on positions ---------------------------------------------------------------------------


def _brute(spec, qt, kt, bq, bk):
  """EMPTY / PARTIAL / FULL of every tile pair from the elementwise mask (over every row)."""
  vis = np.asarray(masks.visible(spec, qt, kt))
  nq, nk = vis.shape[1] // bq, vis.shape[2] // bk
  tiles = vis.reshape(vis.shape[0], nq, bq, nk, bk)
  every = tiles.all(axis=(2, 4)).all(axis=0)
  some = tiles.any(axis=(2, 4)).any(axis=0)
  return np.where(every, masks.FULL, np.where(some, masks.PARTIAL, masks.EMPTY))


def _tokens(pos, seg=None, bid=None):
  j = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
  return masks.Tokens(j(pos), j(seg), j(bid))


@pytest.mark.parametrize(
  "spec",
  [
    masks.MaskSpec(is_causal=True, chunk_size=8, has_positions=True),
    masks.MaskSpec(is_causal=True, window=(6, 0), chunk_size=16, has_positions=True),
    masks.MaskSpec(is_causal=True, has_bidirectional=True, has_positions=True),
    masks.MaskSpec(is_causal=True, chunk_size=8, has_segments=True, has_bidirectional=True, has_positions=True),
  ],
  ids=["chunk", "chunk_window", "spans", "chunk_segments_spans"],
)
def test_tile_classes_are_conservative_on_any_order(spec):
  """A random order: EMPTY and FULL are never claimed wrongly."""
  order = jnp.asarray(_permutations(seed=9))
  bid = jnp.asarray(_take(SPANS, np.asarray(order))) if spec.has_bidirectional else None
  seg = jnp.asarray(_take(SEGMENTS, np.asarray(order))) if spec.has_segments else None
  tok = _tokens(order, seg, bid)
  got = np.asarray(masks.tile_kinds(spec, tok, tok, 4, 4))
  brute = _brute(spec, tok, tok, 4, 4)
  assert not np.any((got == masks.EMPTY) & (brute != masks.EMPTY))
  assert not np.any((got == masks.FULL) & (brute != masks.FULL))


@pytest.mark.parametrize("tile", [4, 8])
def test_skipping_on_positions_computes_only_tiles_with_visible_pairs(tile):
  """Zigzag given as positions, causal and chunked causal, on every (q shard, kv shard) pair of a ring of 4.

  Tiles of 4 hold one zigzag chunk each (a contiguous run of positions), so the min/max summaries are exact: the
  tiles computed are exactly the tiles with a visible pair.  A tile of 8 is a whole shard, two chunks far apart:
  its summary spans both, so it stays conservative (never skips a visible pair) and may compute an empty tile."""
  n, L = 4, T // 4
  pos = fr.zigzag_positions(T, n)
  for spec in (
    masks.MaskSpec(is_causal=True, has_positions=True),
    masks.MaskSpec(is_causal=True, chunk_size=8, has_positions=True),
  ):
    for r, s in itertools.product(range(n), range(n)):
      qt = _tokens(np.broadcast_to(pos[r * L : (r + 1) * L], (B, L)))
      kt = _tokens(np.broadcast_to(pos[s * L : (s + 1) * L], (B, L)))
      got = np.asarray(masks.tile_kinds(spec, qt, kt, tile, tile))
      brute = _brute(spec, qt, kt, tile, tile)
      if tile == 4:
        np.testing.assert_array_equal(got, brute, err_msg=f"{spec} {r=} {s=}")
      assert not np.any((got == masks.EMPTY) & (brute != masks.EMPTY))
      assert not np.any((got == masks.FULL) & (brute != masks.FULL))


def test_chunk_index_is_floor_division_for_any_sign():
  """The kernels' chunk index avoids `lax.sign` (Mosaic lowers it only on a TPU) and still floors."""
  pos = np.arange(-9, 10, dtype=np.int32)
  for c in (1, 3, 4):
    np.testing.assert_array_equal(np.asarray(masks.chunk_index(jnp.asarray(pos), c)), pos // c)

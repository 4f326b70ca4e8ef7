"""The Pallas TPU ragged paged attention kernel (`_src/backends/pallas_tpu/paged/`) in TPU interpret mode.

Batches come from tests/paged_cases.py (`make_batch`, `scenario`, the feature
cases of the registry) in a geometry the kernel tiles (page_size 8 for float32,
16 for bfloat16).  Each jitted
function is compiled once per static configuration and then fed many batches
(interpret-mode compiles dominate the cost).  Every interpret-mode call runs
with the race detector and asserts that it found nothing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import pick
from conftest import make_mesh
from flax import nnx
from jax import export
from paged_cases import (
  FEATURE_KEYWORDS,
  SCENARIOS,
  WINDOW_CAP,
  case_batch,
  features,
  make_batch,
  merged,
  numpy_oracle,
  paged_vjp,
  poison,
  scenario,
  slot_mask,
)
from paged_oracle import paged_oracle
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import validation
from flax_ringattn._src.backends.pallas_tpu import common, tiling
from flax_ringattn._src.backends.pallas_tpu import paged as pallas_paged
from flax_ringattn._src.backends.pallas_tpu import planners as planner
from flax_ringattn._src.masks import MaskSpec
from flax_ringattn._src.options import AttentionSpec
from flax_ringattn._src.paged import op as paged_ops
from flax_ringattn._src.paged.implementations import PagedPallasTpu
from flax_ringattn._src.testing.interpret import interpret_params, no_races

interpret = pytest.mark.interpret
F32, BF16 = jnp.float32, jnp.bfloat16

# P pages of PS tokens, PPS pages per sequence, T rows in q blocks of 8, kv blocks of 2 pages.
P, PS, PPS, T, S = 32, 8, 4, 32, 6
GEOM = dict(num_pages=P, page_size=PS, pages_per_seq=PPS, num_tokens=T, max_num_seqs=S, num_heads=8, head_dim=8)
BLOCKS = fr.BlockSizes(block_q=8, block_kv=16)
_STATIC = ("local_window_size", "logits_soft_cap", "scale", "blocks")


def _op(impl, *args, k_scale=None, v_scale=None, blocks=BLOCKS, **kw):
  if impl == "reference":
    return fr.paged_reference_attention(*args, k_scale=k_scale, v_scale=v_scale, **kw)
  return fr.paged_attention(
    *args,
    k_scale=k_scale,
    v_scale=v_scale,
    block_sizes=blocks,
    implementation="pallas_tpu",
    interpret=interpret_params(),
    **kw,
  )


@functools.partial(jax.jit, static_argnames=("impl", *_STATIC))
def vjp_fn(args, do, k_scale=None, v_scale=None, sinks=None, *, impl, **kw):
  """Output and (dq, dk_pages, dv_pages[, dsinks])."""
  f = functools.partial(_op, impl)
  return paged_vjp(f, args, do, sinks, k_scale=k_scale, v_scale=v_scale, **kw)


@functools.partial(jax.jit, static_argnames=("impl", *_STATIC))
def fwd_fn(args, k_scale=None, v_scale=None, sinks=None, *, impl, **kw):
  return _op(impl, *args, k_scale=k_scale, v_scale=v_scale, sinks=sinks, **kw)


def _check_vjp(b, dtype=F32, *, oracle=False, page_grads=True, **kw):
  """Kernel forward and gradients (dsinks too, with sinks) against the reference, and with `oracle` against the
  float64 oracle; NaN in unread slots changes nothing.  `page_grads=False` for quantized pages (no float
  gradient)."""
  rng = np.random.default_rng(100)
  do = jnp.asarray(rng.normal(size=b.out_shape), dtype)
  ref_out, ref_grads = vjp_fn(b.args, do, **b.operands, impl="reference", **kw)
  # int8 holds no NaN: its unread slots get the extreme -128 instead.
  poisoned = poison(b, np.nan if jnp.issubdtype(b.k_pages.dtype, jnp.floating) else -128)
  with no_races():
    out, grads = vjp_fn(poisoned.args, do, **b.operands, impl="pallas_tpu", **kw)
    jax.block_until_ready((out, grads))
  assert out.shape == b.out_shape and out.dtype == b.q.dtype
  assert len(grads) == 3 + (b.sinks is not None)
  checked = lambda g: (g[0], *g[3:]) if not page_grads else g  # noqa: E731  (dq[, dsinks] for quantized pages)
  assert_close(out, ref_out, dtype)
  assert_close(checked(grads), checked(ref_grads), dtype, "grad")
  if oracle:
    features_kw = {k: v for k, v in kw.items() if k in FEATURE_KEYWORDS}
    oracle_out, oracle_grads = paged_oracle(*b.args, **b.operands, do=do, **features_kw)
    assert_close(out, oracle_out, dtype)
    assert_close(checked(grads), checked(oracle_grads), dtype, "grad")
  np.testing.assert_array_equal(np.asarray(out[b.total :], F32), 0.0)  # padding rows
  np.testing.assert_array_equal(np.asarray(grads[0][b.total :], F32), 0.0)
  if page_grads:
    assert grads[1].shape == b.k_pages.shape and grads[2].shape == b.v_pages.shape
    unread = slot_mask(b, ~b.read_mask())
    for g in grads[1:3]:  # slots no sequence reads receive no gradient
      assert not np.asarray(jnp.where(unread, g, 0.0)).any()
  return out, grads


@interpret
@pytest.mark.parametrize("name", SCENARIOS)
def test_matches_reference_gqa(name):
  """Ragged mixes (prefill, chunked prefill, decode, q_len 0 and 1, partial and full pages, num_seqs < S and
  = 0) with 4:1 GQA, forward and gradients, foreign pages and tails NaN-poisoned."""
  rng = np.random.default_rng([71, SCENARIOS.index(name)])
  b = make_batch(rng, scenario(name, rng), num_kv_heads=2, **GEOM)
  _check_vjp(b)


def _dims(N, K, bq, spans=False):
  return pallas_paged.PagedDims(
    T=4 * bq, N=N, K=K, H=8, P=P, ps=PS, S=S, ppt=PPS, bq=bq, ppb=2, q_dtype=F32, page_dtype=F32,
    scale_rows=(0, 0), spans=spans,
  )  # fmt: skip


def test_window_rows_hold_any_tokens_heads_from_their_tile():
  """The forward's narrow window: the least multiple of 8 rows that holds any one token's G folded rows from the
  8-row tile they start in; None when that is the whole q block or with span ids."""
  got = {G: _dims(8 * G, 8, bq=16).window_rows for G in (1, 2, 3, 4, 5, 8, 12, 16)}
  assert got == {1: 8, 2: 8, 3: 16, 4: 8, 5: 16, 8: 8, 12: 16, 16: 16}, got
  for G in got:  # every token t of a block: rows [t G, t G + G) lie in [8 (t G // 8), that + window)
    w = got[G]
    assert all((t * G) % 8 + G <= w for t in range(16)), G
  assert _dims(8, 2, bq=2).window_rows is None  # 8 rows in all: the window is the block
  assert _dims(8, 2, bq=8, spans=True).window_rows is None


@interpret
@pytest.mark.parametrize("heads", [(6, 2), (8, 8)], ids=["G3", "G1"])
def test_decode_window_any_group_size(heads):
  """Decodes (computed on their window) beside prefills crossing q blocks (the whole block), with G = 3 (a token's
  rows may straddle an 8-row tile: a 16-row window) and G = 1 (8 tokens share a window); foreign pages and tails
  NaN-poisoned."""
  N, K = heads
  bq = 8 if N // K == 3 else 16  # q blocks of 24 and 16 folded rows: the window is narrower
  assert _dims(N, K, bq=bq).window_rows == (16 if N // K == 3 else 8)
  rng = np.random.default_rng([73, N])
  b = make_batch(rng, [(1, 17), (1, 9), (11, 27), (1, 32), (1, 1), (3, 12)], num_kv_heads=K, **dict(GEOM, num_heads=N))
  want = fwd_fn(b.args, **b.operands, impl="reference")
  blocks = fr.BlockSizes(block_q=bq, block_kv=16)
  with no_races():
    out = jax.block_until_ready(fwd_fn(poison(b, np.nan).args, **b.operands, impl="pallas_tpu", blocks=blocks))
  assert_close(out, want, F32)
  np.testing.assert_array_equal(np.asarray(out[b.total :]), 0.0)


@interpret
def test_rows_spanning_q_blocks_and_shared_prefix():
  """Sequences cross the 8-row q blocks; two read the same prefix pages (their dK/dV add up)."""
  rng = np.random.default_rng(72)
  b = make_batch(rng, [(11, 27), (6, 22), (1, 1), (9, 9), (0, 5), (4, 32)], share_prefix=True, num_kv_heads=2, **GEOM)
  assert int(b.page_indices[0, 0]) == int(b.page_indices[1, 0])
  _check_vjp(b)


@interpret
def test_out_of_range_page_ids_are_masked():
  rng = np.random.default_rng(73)
  b = make_batch(rng, [(1, 25), (3, 19), (2, 2), (4, 9)], exclude_pages=(0, P - 1), num_kv_heads=2, **GEOM)
  table = np.asarray(b.page_indices).copy()
  table[0, 1], table[1, 0], table[2, 0] = -1, P, P + 7
  b = b.replace(page_indices=jnp.asarray(table, jnp.int32))
  out, _ = _check_vjp(b)
  np.testing.assert_allclose(np.asarray(out), numpy_oracle(poison(b)), atol=1e-5, rtol=1e-5)


@interpret
def test_window_soft_cap_mqa_shared_prefix():
  rng = np.random.default_rng(74)
  b = make_batch(rng, [(3, 21), (2, 26), (7, 7), (1, 12)], share_prefix=True, num_kv_heads=1, **GEOM)
  _check_vjp(b, **features(WINDOW_CAP))
  _check_vjp(make_batch(rng, scenario("mixed", rng), num_kv_heads=1, **GEOM), **features(WINDOW_CAP))


@interpret
def test_scaled_float_pages_gradients():
  """k_scale [P, K] and v_scale [P, page_size, K] on float pages: gradients with respect to the stored values."""
  rng = np.random.default_rng(75)
  _check_vjp(make_batch(rng, scenario("mixed", rng), num_kv_heads=2, scale_shape=("page", "token"), **GEOM))


@interpret
def test_bfloat16():
  rng = np.random.default_rng(76)
  geom = dict(GEOM, page_size=16, pages_per_seq=2)
  b = make_batch(rng, [(1, 25), (5, 5), (3, 17), (0, 4), (9, 30)], num_kv_heads=2, dtype=BF16, **geom)
  _check_vjp(b, BF16, blocks=fr.BlockSizes(block_q=16, block_kv=32))  # bf16 q blocks: 16-row sublane tiles


@interpret
@pytest.mark.parametrize("dtype", [F32, BF16], ids=["f32", "bf16"])
def test_flat_kv_buffers(dtype):
  """8 kv heads: pages travel as [P, page_size * K, H] into flat kv buffers and a head is one strided load
  (`tiling.flat_kv_pages`); with holes in the table (-1 and out-of-range ids, whose slots are zeroed in VMEM), a
  shared prefix, partial pages and (f32) scales, forward and gradients, foreign pages NaN-poisoned."""
  assert common.flat_kv_pages(dtype, 8, (128, 128)) and not common.flat_kv_pages(dtype, 2, (128, 128))
  assert not common.flat_kv_pages(dtype, 8, (192, 128))  # Mosaic strides buffers exactly 128 lanes wide only
  rng = np.random.default_rng(79)
  geom = dict(GEOM, num_heads=16, head_dim=128)
  blocks = BLOCKS
  if dtype == BF16:
    geom.update(page_size=16, pages_per_seq=2)
    blocks = fr.BlockSizes(block_q=16, block_kv=32)
  seqs = [(1, 25), (5, 5), (3, 17), (0, 4), (9, 30), (2, 32)] if dtype == BF16 else [(11, 27), (6, 22), (1, 1), (9, 9)]
  scales = ("page", "token") if dtype == F32 else None
  b = make_batch(rng, seqs, share_prefix=True, num_kv_heads=8, dtype=dtype, scale_shape=scales, **geom)
  table = np.asarray(b.page_indices).copy()
  table[2, 0], table[3, 1] = -1, geom["num_pages"] + 3
  if dtype == BF16:  # a hole in a kv block wholly below kv_len, which copies whole pages (`walk._start_whole_pages`)
    table[5, 0] = -1
  b = b.replace(page_indices=jnp.asarray(table, jnp.int32))
  _check_vjp(b, dtype, blocks=blocks)


MERGED_LAYOUTS = pytest.mark.parametrize(
  "heads, head_dim, dtype, scales",
  [((8, 2), 8, F32, ("page", "token")), ((4, 2), 64, F32, None), ((8, 1), 128, BF16, None)],
  ids=["K2-scaled", "H64-two-heads-a-lane-group", "K1-bf16"],
)


def _merged_case(heads, head_dim, dtype, scales):
  """(batch with merged pages, blocks, feature keywords) of `MERGED_LAYOUTS`: holes in the table (one in a whole
  kv block), a shared prefix and partial pages; head dim 64 with a window and a soft cap."""
  N, K = heads
  rng = np.random.default_rng([80, N, head_dim])
  geom = dict(GEOM, num_heads=N, head_dim=head_dim)
  blocks = BLOCKS
  if dtype == BF16:
    geom.update(page_size=16, pages_per_seq=2)
    blocks = fr.BlockSizes(block_q=16, block_kv=32)
  seqs = [(1, 25), (5, 5), (3, 17), (0, 4), (9, 30), (2, 32)]
  b = make_batch(rng, seqs, share_prefix=True, num_kv_heads=K, dtype=dtype, scale_shape=scales, **geom)
  table = np.asarray(b.page_indices).copy()
  table[2, 0] = -1
  table[5, 1] = geom["num_pages"] + 3  # a hole in a kv block wholly below kv_len (`walk._start_whole_pages`)
  b = merged(b.replace(page_indices=jnp.asarray(table, jnp.int32)))
  return b, blocks, features(WINDOW_CAP) if head_dim == 64 else {}


@interpret
@MERGED_LAYOUTS
def test_merged_pages(heads, head_dim, dtype, scales):
  """Merged pages [P, page_size, K * H] (any K, heads side by side along the lanes): forward and gradients against
  the reference on the same values as [P, page_size, K, H] pages, foreign pages NaN-poisoned; the gradients come
  back merged.  Head dim 64 runs as K / 2 heads of 128 lanes (`plans.lane_groups`)."""
  b, blocks, kw = _merged_case(heads, head_dim, dtype, scales)
  assert b.k_pages.ndim == 3
  f = pallas_paged.lane_groups(b.q, b.k_pages, b.v_pages, *(b.operands.get(n) for n in ("k_scale", "v_scale")))[0]
  assert f == (2 if head_dim == 64 else 1)
  _, grads = _check_vjp(b, dtype, blocks=blocks, **kw)
  assert grads[1].shape == b.k_pages.shape and grads[2].shape == b.v_pages.shape


@interpret
@MERGED_LAYOUTS
def test_kv_pages(heads, head_dim, dtype, scales):
  """kv pages [P, 2, page_size, K * H] (v_pages=None: a page's K and V in one array, copied with one DMA): the
  kernel's output and gradients equal the reference's on the same values as merged K and V pages, foreign pages
  and tails NaN-poisoned; the pages' cotangent comes back as one [P, 2, page_size, K * H] array, v_pages' None."""
  b, blocks, kw = _merged_case(heads, head_dim, dtype, scales)
  do = jnp.asarray(np.random.default_rng(101).normal(size=b.out_shape), dtype)
  want_out, (dq, dk, dv) = vjp_fn(b.args, do, **b.operands, impl="reference", **kw)
  bad = poison(b, np.nan)
  kv = jnp.stack([bad.k_pages, bad.v_pages], axis=1)
  with no_races():
    out, grads = vjp_fn((b.q, kv, None, *b.args[3:]), do, **b.operands, impl="pallas_tpu", blocks=blocks, **kw)
    jax.block_until_ready((out, grads))
  assert grads[2] is None and grads[1].shape == kv.shape
  assert_close(out, want_out, dtype)
  assert_close((grads[0], grads[1]), (dq, jnp.stack([dk, dv], axis=1)), dtype, "grad")
  assert not np.isnan(np.asarray(out, F32)).any()


@interpret
@pytest.mark.parametrize("slots", [None, 2, 4])
def test_partial_kv_blocks_compute_on_their_keys(slots, monkeypatch):
  """A sequence's last kv block, partly filled, is computed on the least of `walk.key_levels` that holds its keys
  (128, 512 or the whole 1024 here): last blocks of 16, 128, 129, 600 and 100 keys, full blocks, a hole in a
  partial block, decodes and a prefill, on merged pages with foreign pages and tails NaN-poisoned; the forward
  equals the reference's (the backward computes on whole blocks), with the forward's kv slots as planned and with
  2 and 4 (1 and 3 blocks in flight, `walk.walk`).  (Mutation: a level one token short of its keys fails.)"""
  if slots is not None:
    monkeypatch.setattr(tiling, "PAGED_FWD_SLOTS", slots)
  rng = np.random.default_rng(61)
  geom = dict(num_pages=160, page_size=64, pages_per_seq=32, num_tokens=48, max_num_seqs=8, num_heads=4, head_dim=64)
  seqs = [(1, 1040), (1, 1152), (1, 1153), (5, 1624), (1, 100), (1, 2048), (24, 1100)]
  b = make_batch(rng, seqs, num_kv_heads=2, **geom)
  table = np.asarray(b.page_indices).copy()
  table[3, 20] = -1  # a hole in a partial block (its tokens then read as missing: `block_keys`)
  b = merged(b.replace(page_indices=jnp.asarray(table, jnp.int32)))
  blocks = fr.BlockSizes(block_q=16, block_kv=1024)
  d = pallas_paged.dims_of(b.q, b.k_pages, b.v_pages, b.page_indices, None, None, bq=16, ppb=16)
  assert pallas_paged.walk.key_levels(d) == (128, 512, 1024)
  want = fwd_fn(b.args, impl="reference")
  run = jax.jit(functools.partial(_op, "pallas_tpu", blocks=blocks))  # traced here: with this test's slots
  with no_races():
    got = jax.block_until_ready(run(*poison(b).args))
  assert_close(got, want, F32)


@interpret
@pytest.mark.parametrize(
  "page_dtype, scales, blocks",
  [("int8", ("token", "page"), BLOCKS), ("float8_e4m3fn", ("scalar", "token"), None)],
  ids=["int8", "fp8-planned-blocks"],
)
def test_quantized_pages_compile_once(page_dtype, scales, blocks):
  """int8 / fp8 pages with every scale shape; changing batch mixes, tables and scale values reuse one compile.

  The fp8 case leaves the blocks to `plan_paged_block_sizes`."""
  rng = np.random.default_rng([77, len(page_dtype)])
  traces = []

  @jax.jit
  def step(args, k_scale, v_scale):
    traces.append(1)
    return _op("pallas_tpu", *args, k_scale=k_scale, v_scale=v_scale, blocks=blocks)

  for i, name in enumerate(["mixed", "decode", "prefill", "edge"]):
    b = make_batch(
      rng, scenario(name, rng), num_kv_heads=2, page_dtype=jnp.dtype(page_dtype), scale_shape=scales, **GEOM
    )
    with no_races():
      out = jax.block_until_ready(step(b.args, b.k_scale * (i + 1), b.v_scale))
    assert_close(out, fwd_fn(b.args, b.k_scale * (i + 1), b.v_scale, impl="reference"), F32)
  assert len(traces) == 1 and step._cache_size() == 1


# -- attention sinks and MLA head shapes (registry cases: tests/cases.py) --------------------------------------
#
# Sinks need no kernel change (flash.py applies them), but the backward runs on the sink-inclusive lse, finite on
# rows that see no key; MLA pages carry v at Hv != H (the v buffers, DMAs, o/dV accumulators and outputs).

# (registry case, batch): window with sinks, MLA and GQA 4:1 (mla_sinks); window + soft cap with sinks, MHA 4:4
# (sinks_window_cap); MLA GQA chunked prefill (mla_gqa); GQA sinks over sequences crossing q blocks (sinks_gqa).
SINKS_MLA = [
  ("mla_sinks", "mixed"),
  ("sinks_window_cap", "decode"),
  ("mla_gqa", "chunked"),
  ("sinks_gqa", "edge"),
]


@interpret
@pytest.mark.parametrize("case, name", SINKS_MLA, ids=[f"{c}-{n}" for c, n in SINKS_MLA])
def test_sinks_mla_match_reference_and_oracle(case, name):
  """Forward, dq, dk_pages, dv_pages [P, page_size, K, Hv] and dsinks against the reference and the float64
  oracle; foreign pages and tails NaN-poisoned; race detector on."""
  (c,) = pick(case)
  rng = np.random.default_rng([84, SINKS_MLA.index((case, name))])
  b = case_batch(c, rng, scenario(name, rng), **GEOM)
  _check_vjp(b, oracle=True, **features(c))


@interpret
def test_sinks_mla_shared_prefix_rows_spanning_q_blocks():
  """Prefix-shared pages at Hv collect both readers' dV; sequences cross the 8-row q blocks."""
  (c,) = pick("mla_sinks")
  rng = np.random.default_rng(85)
  b = case_batch(c, rng, [(11, 27), (6, 22), (1, 1), (9, 9), (0, 5)], share_prefix=True, **GEOM)
  assert int(b.page_indices[0, 0]) == int(b.page_indices[1, 0])
  _check_vjp(b, oracle=True, **features(c))


@interpret
def test_sinks_rows_without_keys_get_zero_gradients():
  """Rows that see no key (every page id invalid) and padding rows have lse' = s_h (finite) in the backward:
  output, dq and their share of dsinks are exactly 0, and no page of another sequence is read."""
  (c,) = pick("mla_sinks")
  rng = np.random.default_rng(86)
  b = case_batch(c, rng, [(1, 25), (3, 19), (2, 2), (4, 9)], exclude_pages=(0, P - 1), **GEOM)
  table = np.asarray(b.page_indices).copy()
  table[1, :] = -1  # sequence 1 (rows 1 to 3) sees nothing
  b = b.replace(page_indices=jnp.asarray(table, jnp.int32))
  out, (dq, _, _, dsinks) = _check_vjp(b, oracle=True, **features(c))
  np.testing.assert_array_equal(np.asarray(out[1:4]), 0.0)
  np.testing.assert_array_equal(np.asarray(dq[1:4]), 0.0)
  do = jnp.asarray(np.random.default_rng(100).normal(size=b.out_shape), F32)  # _check_vjp's
  with no_races():
    _, (_, _, _, dsinks_live) = vjp_fn(
      poison(b).args, do.at[1:4].set(0.0).at[b.total :].set(0.0), **b.operands, impl="pallas_tpu", **features(c)
    )
  np.testing.assert_array_equal(np.asarray(dsinks_live), np.asarray(dsinks))  # they added nothing


@interpret
def test_sinks_mla_bfloat16():
  (c,) = pick("mla_sinks")
  rng = np.random.default_rng(87)
  geom = dict(GEOM, page_size=16, pages_per_seq=2)
  b = case_batch(c, rng, [(1, 25), (5, 5), (3, 17), (0, 4), (9, 30)], dtype=BF16, **geom)
  _check_vjp(b, BF16, oracle=True, blocks=fr.BlockSizes(block_q=16, block_kv=32), **features(c))


@interpret
@pytest.mark.parametrize(
  "case, page_dtype, scales",
  [("mla_sinks", "int8", ("token", "page")), ("sinks_gqa", "float8_e4m3fn", ("scalar", "token"))],
  ids=["int8-mla_sinks", "fp8-sinks_gqa"],
)
def test_sinks_mla_quantized_pages(case, page_dtype, scales):
  """int8 / fp8 pages with scales: output, dq and dsinks against the reference and the oracle."""
  (c,) = pick(case)
  rng = np.random.default_rng([88, len(page_dtype)])
  b = case_batch(c, rng, scenario("mixed", rng), page_dtype=jnp.dtype(page_dtype), scale_shape=scales, **GEOM)
  _check_vjp(b, oracle=True, page_grads=False, **features(c))


def test_float_scales_reach_the_kernel_as_arrays():
  rng = np.random.default_rng(78)
  b = make_batch(rng, [(1, 9)], num_kv_heads=2, page_dtype=jnp.int8, scale_shape="scalar", **GEOM)
  jaxpr = str(jax.make_jaxpr(lambda *a: _op("pallas_tpu", *a, k_scale=0.02, v_scale=0.01))(*b.args))
  assert "pallas_call" in jaxpr


# -- backend choice and errors ------------------------------------------------------------


def _uses_pallas(**kw):
  rng = np.random.default_rng(79)
  b = make_batch(rng, [(1, 9)], num_kv_heads=2, **GEOM)
  return "pallas_call" in str(jax.make_jaxpr(lambda *a: fr.paged_attention(*a, block_sizes=BLOCKS, **kw))(*b.args))


def test_backend_choice():
  # interpret= without implementation= still picks pallas_tpu, deprecated: one DeprecationWarning per process (its
  # key is discarded first: another test may have spent it).
  validation._warned.discard(("paged_attention", "interpret"))
  match = r"paged_attention: interpret=\.\.\. without implementation= picks implementation='pallas_tpu'"
  with pytest.warns(DeprecationWarning, match=match) as record:
    assert _uses_pallas(interpret=True)
    assert _uses_pallas(interpret=True)
  assert len([r for r in record if "without implementation=" in str(r.message)]) == 1
  assert _uses_pallas(implementation="pallas_tpu", interpret=interpret_params())
  assert not _uses_pallas()  # None off TPU: XLA
  assert not _uses_pallas(implementation="xla")


def _small(page_size=PS, dtype=F32):
  return (
    jnp.zeros((16, 4, 8), dtype),
    jnp.zeros((6, page_size, 2, 8), dtype),
    jnp.zeros((6, page_size, 2, 8), dtype),
    jnp.zeros((3,), jnp.int32),
    jnp.zeros((3, 2), jnp.int32),
    jnp.zeros((4,), jnp.int32),
    jnp.zeros((1,), jnp.int32),
  )


def _traces_pallas(*args, **kw):
  return "pallas_call" in str(jax.make_jaxpr(lambda *a: fr.paged_attention(*a, **kw))(*args))


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="checks the off-TPU error")
def test_pallas_tpu_off_tpu_needs_interpret():
  with pytest.raises(NotImplementedError, match="pallas_tpu needs a TPU"):
    fr.paged_attention(*_small(), implementation="pallas_tpu")


def test_interpret_with_xla_is_an_error():
  with pytest.raises(ValueError, match="interpret=... applies to implementation='pallas_tpu' only"):
    fr.paged_attention(*_small(), implementation="xla", interpret=True)
  with pytest.raises(TypeError, match="interpret must be a bool, None or"):
    fr.paged_attention(*_small(), implementation="pallas_tpu", interpret="yes")


def test_unsupported_shapes_raise_not_implemented():
  with pytest.raises(NotImplementedError, match="page_size to be a multiple of 8 for float32"):
    fr.paged_attention(*_small(page_size=4), implementation="pallas_tpu", interpret=True)
  with pytest.raises(NotImplementedError, match="page_size to be a multiple of 16 for bfloat16"):
    fr.paged_attention(*_small(page_size=8, dtype=BF16), implementation="pallas_tpu", interpret=True)
  q, kp, vp, *meta = _small(page_size=16, dtype=BF16)
  int8 = jnp.zeros((6, 16, 16), jnp.int8)  # merged int8 pages of 16 tokens: half an int8 sublane tile
  with pytest.raises(NotImplementedError, match="merged pages .* of int8 needs page_size to be a multiple of 32"):
    fr.paged_attention(q, int8, int8, *meta, k_scale=1.0, v_scale=1.0, implementation="pallas_tpu", interpret=True)


@interpret
@pytest.mark.parametrize("rows, block_q", [(20, 16), (13, 8)])
def test_any_token_count(rows, block_q):
  """A row count no aligned q block divides (or below one sublane tile) runs, padded inside: forward and
  gradients equal the XLA path's, and the padding rows come back as zeros."""
  rng = np.random.default_rng(rows)
  q = jnp.asarray(rng.normal(size=(rows, 4, 8)), F32)
  k_pages, v_pages = (jnp.asarray(rng.normal(size=(6, PS, 2, 8)), F32) for _ in range(2))
  kv_lens = jnp.array([9, 12, 0], jnp.int32)
  table = jnp.array([[4, 1], [0, 5], [2, 3]], jnp.int32)
  cu = jnp.array([0, 7, rows - 1, rows - 1], jnp.int32)  # the last row is padding
  args = (q, k_pages, v_pages, kv_lens, table, cu, jnp.array([3], jnp.int32))
  blocks = fr.BlockSizes(block_q=block_q, block_kv=8)

  def loss(impl, q, k, v):
    kw = dict(interpret=interpret_params()) if impl == "pallas_tpu" else {}
    o = fr.paged_attention(q, k, v, *args[3:], implementation=impl, block_sizes=blocks, **kw)
    return jnp.sum(o * jnp.cos(o)), o

  with no_races():
    (_, out), grads = jax.jit(jax.value_and_grad(functools.partial(loss, "pallas_tpu"), (0, 1, 2), has_aux=True))(
      *args[:3]
    )
  (_, ref), ref_grads = jax.value_and_grad(functools.partial(loss, "xla"), (0, 1, 2), has_aux=True)(*args[:3])
  assert out.shape == (rows, 4, 8)
  assert_close(out, ref, F32)
  assert_close(grads, ref_grads, F32, "grad")
  np.testing.assert_array_equal(np.asarray(out[rows - 1]), 0.0)


# -- Mosaic lowering ------------------------------------------------------------------------


@pytest.mark.parametrize(
  "dtype, page_dtype, scales, kw",
  [
    (F32, F32, None, dict(window=(4, 0), logits_soft_cap=3.0)),
    (BF16, "int8", ("token", "page"), {}),
    (BF16, "float8_e4m3fn", ("scalar", "scalar"), {}),
    (BF16, BF16, None, dict(head_dim=24, v_head_dim=16)),  # MLA head shapes
    (BF16, BF16, None, dict(num_kv_heads=8, head_dim=128)),  # flat kv buffers, bf16 read through 32-bit words
  ],
)
def test_lowers_for_tpu(dtype, page_dtype, scales, kw):
  """jax.export runs the Pallas -> Mosaic lowering of the forward and backward kernels for TPU on CPU."""
  rng = np.random.default_rng(80)
  kw = dict(kw)  # (the parametrize dict is shared)
  geom = dict(GEOM, page_size=16, pages_per_seq=2, head_dim=kw.pop("head_dim", 8))
  b = make_batch(
    rng,
    [(1, 9)],
    num_kv_heads=kw.pop("num_kv_heads", 2),
    dtype=dtype,
    page_dtype=jnp.dtype(page_dtype),
    scale_shape=scales,
    v_head_dim=kw.pop("v_head_dim", None),
    **geom,
  )
  window = kw.pop("window", None)
  spec = AttentionSpec(
    mask=MaskSpec(is_causal=True, window=window), scale=0.3, block_sizes=fr.BlockSizes(block_q=16, block_kv=32), **kw
  )
  args = (*b.args, b.k_scale, b.v_scale)
  fwd = jax.jit(lambda *a: pallas_paged.paged_fwd(*a, spec=spec, interpret=None))
  text = export.export(fwd, platforms=("tpu",))(*args).mlir_module()
  out = jax.ShapeDtypeStruct(b.out_shape, dtype)
  lse = jax.ShapeDtypeStruct(b.q.shape[:2], F32)
  bwd = jax.jit(lambda *a: pallas_paged.paged_bwd(*a, spec=spec, interpret=None))
  text += export.export(bwd, platforms=("tpu",))(*args, lse, out, lse).mlir_module()  # lse, do, delta
  assert text.count("tpu_custom_call") >= 2
  # Each kernel clamps its page copies itself, without Mosaic's per-DMA range checks (`common.compiler_params`).
  assert text.count("disable_bounds_checks") == 2


@pytest.mark.parametrize("H, Hv", [(128, 128), (192, 128)], ids=["mha", "mla"])
def test_fused_write_lowers_for_tpu(H, Hv):
  sds = jax.ShapeDtypeStruct
  Tq, N, K, P_, ps = 64, 16, 4, 64, 16
  spec = AttentionSpec(mask=MaskSpec(is_causal=True), scale=0.1, block_sizes=fr.BlockSizes(block_q=32, block_kv=4 * ps))
  meta = (sds((8,), jnp.int32), sds((8, 8), jnp.int32), sds((9,), jnp.int32), sds((1,), jnp.int32))
  k_pages, v_pages = sds((P_, ps, K, H), jnp.int8), sds((P_, ps, K, Hv), jnp.int8)
  scale, new_scale = sds((P_, ps, K), F32), sds((Tq, K), F32)
  k_new, v_new = sds((Tq, K, H), jnp.int8), sds((Tq, K, Hv), jnp.int8)
  fn = jax.jit(lambda *a: pallas_paged.paged_fwd_write(*a, spec=spec, interpret=None))
  args = (sds((Tq, N, H), BF16), k_new, v_new, k_pages, v_pages, *meta, scale, scale, new_scale, new_scale)
  text = export.export(fn, platforms=("tpu",))(*args).mlir_module()
  assert text.count("tpu_custom_call") == 1


# -- planner --------------------------------------------------------------------------------


@pytest.mark.parametrize("page_dtype", [jnp.bfloat16, jnp.int8], ids=["bf16", "int8"])
@pytest.mark.parametrize("kernel", ["paged_fwd", "paged_bwd"])
def test_planner_model_counts_exactly_the_kernels_buffers(kernel, page_dtype):
  """The planner's paged model equals the VMEM of the kernel's own BlockSpecs and scratch shapes."""
  plans = {"paged_fwd": pallas_paged.fwd_plan, "paged_bwd": pallas_paged.bwd_plan}
  for bq, ppb, ps, (N, K), (H, Hv), rows in [
    (16, 4, 16, (8, 2), (128, None), (0, 0)),
    (128, 8, 16, (32, 8), (128, None), (1, 16)),
    (256, 32, 16, (16, 1), (256, None), (16, 1)),
    (64, 2, 32, (4, 4), (64, None), (1, 1)),
    (32, 4, 16, (16, 16), (192, 128), (16, 16)),  # MLA: qk 192, v 128
    (16, 2, 16, (8, 1), (576, 512), (1, 0)),  # MLA's absorbed latent form: one kv head, v narrower than k
  ]:
    rows = rows if page_dtype == jnp.int8 else (0, 0)
    d = pallas_paged.PagedDims(
      T=2 * bq,
      N=N,
      K=K,
      H=H,
      P=64,
      ps=ps,
      S=8,
      ppt=4 * ppb,
      bq=bq,
      ppb=ppb,
      q_dtype=jnp.dtype(BF16),
      page_dtype=jnp.dtype(page_dtype),
      scale_rows=rows,
      v_head_dim=Hv,
      slots=tiling.PAGED_FWD_SLOTS if kernel == "paged_fwd" else tiling.PAGED_BWD_SLOTS,
    )
    model = planner.paged_footprint(
      kernel,
      bq=bq,
      pages_per_block=ppb,
      page_size=ps,
      num_heads=N,
      num_kv_heads=K,
      head_dim=H,
      dtype=BF16,
      page_dtype=page_dtype,
      scale_rows=rows,
      v_head_dim=Hv,
    )
    assert model.buffers == common.plan_vmem_bytes(plans[kernel](d)), (kernel, bq, ppb, ps, N, K, H, Hv, rows)


@pytest.mark.parametrize("generation", ["v4", "v5e", "v7x"])
def test_planner_fits_the_budget(generation):
  dims = dict(num_heads=32, num_kv_heads=8, head_dim=128, dtype=BF16, page_dtype=BF16)
  blocks = planner.plan_paged_block_sizes(512, 16, 64, **dims, generation=generation)
  bq, ppb = blocks.block_q, blocks.block_kv // 16
  assert 512 % bq == 0 and bq % 16 == 0 and ppb * 16 <= planner.PAGED_MAX_BLOCK_TOKENS
  budget = planner.budget_bytes(generation)
  fit = lambda bq, ppb: max(  # noqa: E731
    planner.paged_footprint(k, bq=bq, pages_per_block=ppb, page_size=16, **dims).total
    for k in ("paged_fwd", "paged_bwd")
  )
  assert fit(bq, ppb) <= budget
  taller = [t for t in planner.candidates(512, 16) if bq < t <= planner.PAGED_MAX_BLOCK_Q]
  assert not taller or fit(taller[0], ppb) > budget  # the next taller q block would not fit
  with pytest.raises(ValueError, match="fits the v4 VMEM budget"):
    planner.plan_paged_block_sizes(512, 16, 64, 64, 1, 8192, BF16, generation="v4")


def test_registry_plans_with_v_pages_head_dim():
  """The registry's pallas_tpu entry plans with v_pages' head dim (DeepSeek-V3's 128 heads split 8 ways: 16 heads,
  qk 192, v 128): its blocks are the planner's at v_head_dim=128, not at q/k's 192."""
  sds = jax.ShapeDtypeStruct
  call = dict(
    q=sds((256, 16, 192), BF16),
    k_pages=sds((512, 16, 16, 192), BF16),
    block_sizes=None,
    k_scale=None,
    v_scale=None,
    pages_per_seq=64,
    logits_soft_cap=None,
  )
  plan = functools.partial(planner.plan_paged_block_sizes, 256, 16, 64, 16, 16, 192, BF16, BF16)
  backend = PagedPallasTpu(interpret=interpret_params())
  assert backend.blocks(**call, v_pages=sds((512, 16, 16, 128), BF16)) == plan(v_head_dim=128)
  assert backend.blocks(**call) == backend.blocks(**call, v_pages=sds((512, 16, 16, 192), BF16)) == plan()
  if planner.current_generation() == "v4":  # off TPU: the generation the expectations below were measured on
    assert plan(v_head_dim=128).block_kv > plan().block_kv  # 208 > 160 tokens: the narrower v pays


# -- fused cache write ------------------------------------------------------------------------

KV, HD = 2, 8
CACHE = dict(num_pages=24, page_size=PS, max_num_seqs=4, pages_per_seq=4, num_kv_heads=KV, head_dim=HD)


def _ragged(rng, lens, num_tokens=16, heads=8, kv=KV, hd=HD):
  total = int(sum(lens))
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens), [total] * (4 - len(lens))]), jnp.int32)
  k, v = (jnp.asarray(rng.normal(size=(num_tokens, kv, hd)), F32) for _ in range(2))
  q = jnp.asarray(rng.normal(size=(num_tokens, heads, hd)), F32)
  return q, k, v, cu, jnp.asarray([len(lens)], jnp.int32)


@jax.jit
def _separate(cache, q, k, v, cu, n):
  cache = cache.append(k, v, cu, n)
  out = fr.paged_attention(
    q,
    cache.k_pages,
    cache.v_pages,
    cache.kv_lens,
    cache.page_indices,
    cu,
    n,
    k_scale=cache.k_scale,
    v_scale=cache.v_scale,
    implementation="xla",
  )
  return out, cache


@jax.jit
def _fused(cache, q, k, v, cu, n):
  cache, k_new, v_new, k_sc, v_sc = cache.reserve_append(k, v, cu, n)
  call = paged_ops.plan_call(
    q,
    cache.k_pages,
    cache.v_pages,
    cache.kv_lens,
    cache.page_indices,
    cu,
    n,
    k_scale=cache.k_scale,
    v_scale=cache.v_scale,
    block_sizes=BLOCKS,
    implementation="pallas_tpu",
    interpret=interpret_params(),
  )
  assert call.fuses_cache_write
  out, k_pages, v_pages, k_scale, v_scale = call.attend_and_write(
    q, k_new, v_new, cache.k_pages, cache.v_pages, k_new_scale=k_sc, v_new_scale=v_sc
  )
  return out, dataclasses.replace(cache, k_pages=k_pages, v_pages=v_pages, k_scale=k_scale, v_scale=v_scale)


@interpret
def test_fused_write_equals_separate_append_int8_copy_on_write():
  """Pages (and per-token scales) after a fused step equal those of PagedKVCache.append, including a step that
  writes into a prefix-shared partial page (copy-on-write) and sequences crossing q blocks."""
  rng = np.random.default_rng(81)
  cache = fr.PagedKVCache.create(**CACHE, dtype=jnp.int8)
  _, cache = _separate(cache, *_ragged(rng, [13, 3]))  # slot 0: a page and 5 of the next; slot 1: 3 tokens
  cache = jax.jit(fr.PagedKVCache.share_prefix)(cache, 0, 2, 11)  # slot 2 shares slot 0's partial page
  for lens in ([1, 2, 4], [5, 1, 1, 9], [0, 0, 1, 1]):  # the first writes into the shared page
    batch = _ragged(rng, lens)
    expected_out, expected = _separate(cache, *batch)
    with no_races():
      out, cache = jax.block_until_ready(_fused(cache, *batch))
    for name in ("k_pages", "v_pages", "k_scale", "v_scale", "page_indices", "kv_lens", "ref_counts"):
      np.testing.assert_array_equal(np.asarray(getattr(cache, name)), np.asarray(getattr(expected, name)), name)
    assert_close(out, expected_out, F32)


@interpret
def test_fused_write_flat_pages():
  """The fused write into flat pages (8 kv heads, bf16: a token's K rows of a [P, page_size * K, H] view) leaves
  the cache PagedKVCache.append leaves, across q blocks and a prefix-shared page."""
  rng = np.random.default_rng(82)
  cache = fr.PagedKVCache.create(**dict(CACHE, num_kv_heads=8, page_size=16, head_dim=128), dtype=BF16)
  _, cache = _separate(cache, *_ragged(rng, [13, 3], heads=16, kv=8, hd=128))
  cache = jax.jit(fr.PagedKVCache.share_prefix)(cache, 0, 2, 11)
  for lens in ([1, 2, 4], [5, 1, 1, 9]):
    batch = _ragged(rng, lens, heads=16, kv=8, hd=128)
    expected_out, expected = _separate(cache, *batch)
    with no_races():
      out, cache = jax.block_until_ready(_fused(cache, *batch))
    for name in ("k_pages", "v_pages", "page_indices", "kv_lens"):
      np.testing.assert_array_equal(np.asarray(getattr(cache, name)), np.asarray(getattr(expected, name)), name)
    assert_close(out, expected_out, F32)


@interpret
@pytest.mark.parametrize(
  "use_sinks,spread", [(False, False), (True, False), (True, True)], ids=["plain", "sinks", "sinks-spread"]
)
def test_layer_uses_fused_write(use_sinks, spread):
  """The layer on pallas_tpu (interpret=True) takes the fused path and matches the XLA layer step by step (with
  sinks too: the fused write's finished rows are rescaled by them; and with the cache spread over 4 devices, where
  each device writes the rows of the pages it owns and the partials merge)."""
  kw = dict(num_kv_heads=KV, use_sinks=use_sinks)
  if spread:
    kw.update(mesh=make_mesh((4,), ("sp",)), seq_axis="sp")
  fused = fr.PagedMultiHeadAttention(8, 16, 64, implementation="pallas_tpu", interpret=True, rngs=nnx.Rngs(0), **kw)
  plain = fr.PagedMultiHeadAttention(8, 16, 64, implementation="xla", rngs=nnx.Rngs(0), **kw)
  for layer in (fused, plain):
    if use_sinks:  # learned values, not the zeros they start from (loaded before init_cache places them)
      layer.sinks.set_value(jnp.linspace(-1.0, 3.0, 8, dtype=F32))
    layer.init_cache(**{k: v for k, v in CACHE.items() if k not in ("num_kv_heads", "head_dim")})
  calls = []
  real = paged_ops.PagedCall.attend_and_write

  def spy(self, *a, **k):
    calls.append(1)
    return real(self, *a, **k)

  step = nnx.jit(lambda layer, x, cu, n: layer(x, cu_q_lens=cu, num_seqs=n))
  rng = np.random.default_rng(82)
  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(paged_ops.PagedCall, "attend_and_write", spy)
    # The last step overflows slot 0 (26 + 7 tokens > pages_per_seq * page_size = 32): the fused kernel must
    # store none of them (it reads the cache's attention_view) and return 0 for its rows, as the XLA path does.
    for lens in ([9, 3], [1, 1, 6], [1, 1, 1, 1], [15, 1], [7, 1, 0, 1]):
      _, _, _, cu, n = _ragged(rng, lens)
      x = jnp.asarray(rng.normal(size=(16, 16)), F32)
      with no_races():
        y = jax.block_until_ready(step(fused, x, cu, n))
      assert_close(y, step(plain, x, cu, n), F32)
      for name in ("k_pages", "v_pages", "kv_lens", "overflowed"):
        got, want = (np.asarray(getattr(layer.kv_cache.get_value(), name)) for layer in (fused, plain))
        np.testing.assert_array_equal(got, want, name)
  np.testing.assert_array_equal(np.asarray(fused.overflowed()), [True, False, False, False])
  np.testing.assert_array_equal(np.asarray(y[:7]), 0.0)
  assert calls == [1]  # traced once: one compile across the changing batches


@interpret
def test_fused_write_mla_pages():
  """The fused write stores v_new [T, K, Hv] into v pages at Hv != H (and k_new at H), then attends over them
  with sinks: pages equal a numpy scatter of the new rows, the output the reference's over those pages (sinks
  rescale the kernel's finished rows, as in `flash`)."""
  rng = np.random.default_rng(83)
  seqs = [(3, 11), (1, 17), (9, 9), (0, 4), (6, 30)]  # chunked, decode, prefill, no new token, crossing q blocks
  b = make_batch(rng, seqs, num_kv_heads=KV, v_head_dim=4, **GEOM)
  k_new = jnp.asarray(rng.normal(size=(T, KV, GEOM["head_dim"])), F32)
  v_new = jnp.asarray(rng.normal(size=(T, KV, 4)), F32)
  k_want, v_want = np.asarray(b.k_pages).copy(), np.asarray(b.v_pages).copy()
  table, cu = np.asarray(b.page_indices), np.asarray(b.cu_q_lens)
  for i, (q_len, kv_len) in enumerate(seqs):
    for j in range(q_len):
      pos, row = kv_len - q_len + j, cu[i] + j
      k_want[table[i, pos // PS], pos % PS] = k_new[row]
      v_want[table[i, pos // PS], pos % PS] = v_new[row]
  sinks = jnp.asarray(2.0 + rng.normal(size=GEOM["num_heads"]), F32)
  write = jax.jit(
    lambda q, k_pages, v_pages, *a: paged_ops.plan_call(
      q, k_pages, v_pages, *a, block_sizes=BLOCKS, implementation="pallas_tpu", interpret=interpret_params()
    ).attend_and_write(q, k_new, v_new, k_pages, v_pages, sinks=sinks)
  )  # fmt: skip
  with no_races():
    out, k_pages, v_pages, _, _ = jax.block_until_ready(write(*b.args))
  np.testing.assert_array_equal(np.asarray(k_pages), k_want)
  np.testing.assert_array_equal(np.asarray(v_pages), v_want)
  assert out.shape == (T, GEOM["num_heads"], 4)
  written = b.replace(k_pages=jnp.asarray(k_want), v_pages=jnp.asarray(v_want))
  assert_close(out, fwd_fn(written.args, sinks=sinks, impl="reference"), F32)
  assert not np.allclose(np.asarray(out), np.asarray(fwd_fn(written.args, impl="reference")), atol=1e-3)


@interpret
@pytest.mark.parametrize("heads, hd", [((4, 2), 64), ((8, 1), 128)], ids=["H64-K2", "K1"])
def test_merged_cache_appends_then_attends(heads, hd):
  """A merged cache (`PagedKVCache.create(merged=True)`: pages [P, page_size, K * H]) and a kv cache
  (`merged="kv"`: [P, 2, page_size, K * H]) hold exactly the values a 4-D cache holds after the same appends,
  prefix sharing and rollback, and the Pallas TPU kernel attends over each as the XLA backend does over the 4-D
  one.  Their calls have no fused write (Mosaic refuses one-row writes into merged pages on a TPU):
  `fuses_cache_write` is False and `attend_and_write` says why."""
  N, K = heads
  rng = np.random.default_rng([83, hd])
  caches = [fr.PagedKVCache.create(**dict(CACHE, num_kv_heads=K, head_dim=hd), merged=m) for m in (True, "kv", False)]
  assert caches[0].k_pages.shape == (24, PS, K * hd) and (caches[0].num_kv_heads, caches[0].head_dim) == (K, hd)
  assert caches[1].k_pages.shape == (24, 2, PS, K * hd) and caches[1].v_pages is None
  assert (caches[1].page_size, caches[1].num_kv_heads, caches[1].head_dim, caches[1].v_head_dim) == (PS, K, hd, hd)

  def check_pages(merged_cache, kv_cache, flat_cache):
    for i, name in enumerate(("k_pages", "v_pages")):
      flat = np.asarray(getattr(flat_cache, name))
      np.testing.assert_array_equal(np.asarray(getattr(merged_cache, name)).reshape(flat.shape), flat, name)
      np.testing.assert_array_equal(np.asarray(kv_cache.k_pages[:, i]).reshape(flat.shape), flat, f"kv {name}")

  for lens in ([13, 3], [1, 2, 4], [5, 1, 1, 9]):
    batch = _ragged(rng, lens, heads=N, kv=K, hd=hd)
    (_, merged_cache), (_, kv_cache), (want, flat_cache) = (_separate(c, *batch) for c in caches)
    check_pages(merged_cache, kv_cache, flat_cache)
    q, _, _, cu, n = batch
    for c in (merged_cache, kv_cache):
      with no_races():
        out = jax.block_until_ready(_op("pallas", q, c.k_pages, c.v_pages, c.kv_lens, c.page_indices, cu, n))
      assert_close(out, want, F32)
    caches = [merged_cache, kv_cache, flat_cache]
    if lens == [13, 3]:
      caches = [jax.jit(fr.PagedKVCache.share_prefix)(x, 0, 2, 11) for x in caches]
  drop = np.asarray([1, 0, 0, 3], np.int32)  # slot 3 reads its pages alone: its dropped rows are zeroed
  after = [x.rollback(drop).free(np.arange(CACHE["max_num_seqs"]) == 1) for x in caches]
  assert not np.array_equal(np.asarray(after[2].k_pages), np.asarray(caches[2].k_pages))
  check_pages(*after)
  for c in caches[:2]:
    call = paged_ops.plan_call(
      q, c.k_pages, c.v_pages, c.kv_lens, c.page_indices, cu, n, implementation="pallas_tpu",
      interpret=interpret_params(),
    )  # fmt: skip
    assert call.merged and not call.fuses_cache_write
    with pytest.raises(NotImplementedError, match="merged pages True"):
      call.attend_and_write(q, *batch[1:3], c.k_pages, c.v_pages)


def test_layers_with_the_same_shapes_share_one_paged_kernel(monkeypatch):
  """The paged kernels sit behind one jit each (`implementations._paged_fwd` / `_paged_bwd`): the layers of a
  decoder, which call them with the same shapes and options, lower to one Mosaic kernel per direction that each
  calls (lowered for TPU on this CPU machine), so a serving step of a 24-block model compiles its kernel once, not
  24 times; a call of another shape gets its own."""
  import flax_ringattn._src.backends.pallas_tpu as pallas_tpu

  monkeypatch.setattr(pallas_tpu, "on_tpu", lambda: True)  # lower the compiled kernels, as on a chip
  sds = jax.ShapeDtypeStruct
  S, pps, ps = 4, 4, 16
  meta = [sds(x, jnp.int32) for x in ((S,), (S, pps), (S + 1,), (1,))]

  def layers(q, kv, q2, *m):
    out = q
    for _ in range(3):  # three layers, one shape
      out = fr.paged_attention(out, kv, None, *m, implementation="pallas_tpu")
    return out, fr.paged_attention(q2, kv, None, *m, implementation="pallas_tpu")

  def grad(q, kv, q2, *m):
    return jax.grad(lambda q: layers(q, kv, q2, *m)[0].astype(jnp.float32).sum())(q)

  q, q2 = sds((32, 8, 128), jnp.bfloat16), sds((64, 8, 128), jnp.bfloat16)
  kv = sds((S * pps, 2, ps, 128), jnp.bfloat16)
  text = export.export(jax.jit(layers), platforms=("tpu",))(q, kv, q2, *meta).mlir_module()
  assert text.count("tpu_custom_call") == 2  # one kernel for the three 32-row calls, one for the 64-row call
  text = export.export(jax.jit(grad), platforms=("tpu",))(q, kv, q2, *meta).mlir_module()
  assert text.count("tpu_custom_call") == 2  # the forward and the backward, each shared by the three layers


def _visits_one_by_one(d, spec, cu, kv_lens, n):
  """Each q block's visits, listed pair by pair: sequence s's kv blocks [lo, hi) in the q block (`walk.seq_bounds`,
  the rule the kernel reads), q block by q block, sequence by sequence."""
  from flax_ringattn._src.backends.pallas_tpu.paged import walk

  q_lo = np.arange(d.T // d.bq)[:, None] * d.bq
  g = walk.seq_bounds(d, spec, jnp.asarray(cu[None, :-1]), jnp.asarray(cu[None, 1:]), jnp.asarray(kv_lens[None]), q_lo)
  lo, hi = np.asarray(g.lo), np.asarray(g.hi)
  return [[(s, b) for s in range(n) for b in range(lo[qb, s], hi[qb, s])] for qb in range(d.T // d.bq)]


@pytest.mark.parametrize(
  "mask",
  [MaskSpec(is_causal=True), MaskSpec(is_causal=True, window=(40, 0)), MaskSpec(is_causal=True, chunk_size=48),
   MaskSpec(is_causal=True, has_bidirectional=True)],
  ids=["causal", "window", "chunked", "spans"],
)  # fmt: skip
def test_schedule_lists_every_visit_in_order(mask):
  """The kernels' visit list (`walk.schedule`, built by XLA before the launch) holds exactly each q block's
  (sequence, kv block) visits, in the walk's order, within `visit_capacity` (the kernel would skip visits past
  it): ragged batches of decodes, prefill chunks spanning q blocks, empty and dead sequences, few and many
  (q block, sequence) pairs (the second takes the searchsorted path)."""
  from flax_ringattn._src.backends.pallas_tpu.paged import walk

  spec = AttentionSpec(mask=mask, scale=1.0)
  rng = np.random.default_rng(0)
  for T, bq, S, ps, ppb, ppt in [(64, 16, 64, 16, 4, 40), (96, 8, 12, 8, 2, 16), (256, 32, 3, 16, 1, 20),
                                 (4096, 16, 16, 16, 4, 16)]:  # fmt: skip
    for trial in range(4):
      q_lens = rng.integers(0, 2 * bq, S) if trial % 2 else np.ones(S, np.int64)  # decodes, then chunks
      q_lens = np.where(rng.random(S) < 0.2, 0, q_lens)  # some sequences without rows here
      q_lens = np.minimum(q_lens, np.maximum(T - np.concatenate([[0], np.cumsum(q_lens)[:-1]]), 0))
      kv_lens = np.minimum(q_lens + rng.integers(0, ppt * ps, S), ppt * ps)
      cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
      n = int(rng.integers(S // 2, S + 1))
      d = pallas_paged.PagedDims(
        T=T, N=2, K=1, H=128, P=64, ps=ps, S=S, ppt=ppt, bq=bq, ppb=ppb, q_dtype=jnp.dtype(BF16),
        page_dtype=jnp.dtype(BF16), scale_rows=(0, 0), spans=mask.has_bidirectional,
      )  # fmt: skip
      sched = np.asarray(walk.schedule(d, spec, jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), jnp.asarray([n])))
      nq, V = T // bq, walk.visit_capacity(d)
      assert sched.shape == (2 + nq + 2 * V,) and sched[0] == n
      offsets, seqs, blocks = sched[1 : 2 + nq], sched[2 + nq : 2 + nq + V], sched[2 + nq + V :]
      want = _visits_one_by_one(d, spec, cu, kv_lens, n)
      assert offsets[0] == 0 and offsets[-1] <= V
      for qb in range(nq):
        got = list(zip(seqs[offsets[qb] : offsets[qb + 1]], blocks[offsets[qb] : offsets[qb + 1]], strict=True))
        assert got == want[qb], (T, bq, S, trial, qb)
      assert sum(map(len, want)) > 0


def test_visit_capacity_holds_the_most_visits():
  """The capacity bound is met exactly by its worst case (every q block boundary inside a sequence, every
  sequence seeing every kv block) and never exceeded."""
  from flax_ringattn._src.backends.pallas_tpu.paged import walk

  spec = AttentionSpec(mask=MaskSpec(is_causal=True), scale=1.0)
  T, bq, S, ps, ppb, ppt = 64, 8, 9, 16, 1, 4
  q_lens = np.array([4] + [8] * 7 + [4])  # 9 sequences over 8 q blocks: each boundary inside one
  kv_lens = np.full(S, ppt * ps)  # each sees all its kv blocks
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  d = pallas_paged.PagedDims(
    T=T, N=2, K=1, H=128, P=64, ps=ps, S=S, ppt=ppt, bq=bq, ppb=ppb, q_dtype=jnp.dtype(BF16),
    page_dtype=jnp.dtype(BF16), scale_rows=(0, 0),
  )  # fmt: skip
  sched = np.asarray(walk.schedule(d, spec, jnp.asarray(cu), jnp.asarray(kv_lens, jnp.int32), jnp.asarray([S])))
  V = walk.visit_capacity(d)
  assert V == (S + T // bq - 1) * (ppt // ppb)
  assert sched[1 + T // bq] == V


def test_scalar_operands_beyond_smem_are_refused():
  """A page table and schedule larger than a core's SMEM get an error naming their sizes, not a Mosaic failure."""
  from flax_ringattn._src.backends.pallas_tpu.paged import walk

  S, ppt = 1024, 512
  d = pallas_paged.PagedDims(
    T=1024, N=2, K=1, H=128, P=64, ps=16, S=S, ppt=ppt, bq=16, ppb=8, q_dtype=jnp.dtype(BF16),
    page_dtype=jnp.dtype(BF16), scale_rows=(0, 0),
  )  # fmt: skip
  spec = AttentionSpec(mask=MaskSpec(is_causal=True), scale=1.0)
  prefetch = (jnp.arange(S + 1, dtype=jnp.int32), jnp.ones(S, jnp.int32), jnp.zeros(S * ppt, jnp.int32),
              jnp.asarray([S], jnp.int32))  # fmt: skip
  with pytest.raises(ValueError, match=r"SMEM.*524288 entries \(1024 sequences x 512\)"):
    walk.scheduled(d, spec, prefetch)
  small = dataclasses.replace(d, S=64, T=64)
  prefetch = (jnp.arange(65, dtype=jnp.int32), jnp.ones(64, jnp.int32), jnp.zeros(64 * ppt, jnp.int32),
              jnp.asarray([64], jnp.int32))  # fmt: skip
  assert walk.scheduled(small, spec, prefetch)[3].shape == (2 + 4 + 2 * walk.visit_capacity(small),)

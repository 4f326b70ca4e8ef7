"""The Pallas TPU planners: the block kernels' and the in-kernel ring's footprint models and choices, and tile
validation."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

import flax_ringattn as fr
from flax_ringattn._src import masks
from flax_ringattn._src.backends.pallas_tpu import common
from flax_ringattn._src.backends.pallas_tpu import planners as planner
from flax_ringattn._src.backends.pallas_tpu.block import backward as block_backward
from flax_ringattn._src.backends.pallas_tpu.block import forward as block_forward
from flax_ringattn._src.backends.pallas_tpu.planners import block as block_planner
from flax_ringattn._src.backends.pallas_tpu.ring import protocol as rp
from flax_ringattn._src.backends.pallas_tpu.ring.hbm_backward import bwd_plan_hbm
from flax_ringattn._src.backends.pallas_tpu.ring.hbm_forward import fwd_plan_hbm
from flax_ringattn._src.backends.pallas_tpu.ring.vmem_backward import bwd_plan
from flax_ringattn._src.backends.pallas_tpu.ring.vmem_forward import fwd_plan
from flax_ringattn._src.options import ProblemShape

PLANS = {
  "fwd": block_forward.fwd_plan,
  "dq": block_backward.dq_plan,
  "dkv": block_backward.dkv_plan,
  "dkv_fused": functools.partial(block_backward.dkv_plan, fused=True),
}


@pytest.mark.parametrize("kernel", sorted(PLANS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
  "has_segments,dropout",
  [(False, False), (True, False), (True, True), ("spans", False)],
  ids=["", "seg", "seg-drop", "seg-spans-positions"],
)
def test_model_counts_exactly_the_kernels_buffers(kernel, dtype, has_segments, dropout):
  """The closed-form model equals the VMEM of the kernel's own BlockSpecs and scratch shapes (the dropout
  operand lives in SMEM: no VMEM buffer, but its hash and scale tiles are temporaries), with v's head dim equal
  to q/k's and not (MLA: DeepSeek's qk 192, v 128, and a v wider than q/k)."""
  for (bq, bk), (N, K), (H, Hv) in itertools.product(
    [(16, 128), (128, 256), (512, 128), (24, 384)],
    [(8, 2), (4, 4), (8, 1)],
    [(64, None), (128, None), (80, None), (192, 128), (24, 160)],
  ):
    spans = has_segments == "spans"  # bidirectional ids and positions per row as well
    dims = dict(B=2, T=4 * bq, S=2 * bk, N=N, K=K, H=H, dtype=dtype, bq=bq, bk=bk)
    mask = masks.MaskSpec(has_segments=bool(has_segments), has_bidirectional=spans, has_positions=spans)
    plan = PLANS[kernel](**dims, mask=mask, has_dropout=dropout, Hv=Hv)
    model = planner.footprint(
      kernel,
      bq=bq,
      bk=bk,
      num_heads=N,
      num_kv_heads=K,
      head_dim=H,
      dtype=dtype,
      has_segments=bool(has_segments),
      dropout=dropout,
      v_head_dim=Hv,
      extra_fields=("pos", "bid") if spans else (),
    )
    assert model.buffers == common.plan_vmem_bytes(plan), (kernel, bq, bk, N, K, H, Hv)
    assert model.temporaries >= 2 * (N // K) * bq * bk * 4  # at least the f32 score tile and p
    if dropout:
      without = planner.footprint(kernel, bq=bq, bk=bk, num_heads=N, num_kv_heads=K, head_dim=H, dtype=dtype)
      assert model.temporaries >= without.temporaries + 2 * (N // K) * bq * bk * 4  # int32 hash and f32 scale


def test_forward_runs_token_major_only_where_it_fits():
  """The block forward's layout (`forward_token_major`, which the planner and the kernel both decide by): the
  token-major one where the layout rule allows it and its footprint (q and o tiles of all N heads) fits the
  budget, else the heads-major one, whose tiles hold a group's G heads."""
  budget = planner.budget_bytes("v5e")
  dims = dict(num_kv_heads=8, head_dim=128, dtype=jnp.bfloat16)
  assert planner.forward_token_major(bq=512, bk=512, budget=budget, num_heads=8, **dims)
  assert not planner.forward_token_major(bq=512, bk=512, budget=budget, num_heads=8, **(dims | {"head_dim": 192}))
  assert not planner.forward_token_major(bq=64, bk=512, budget=budget, num_heads=8, **dims)  # lse's lane blocks
  big = dict(bq=1024, bk=256, num_heads=64, **dims)
  token_major = planner.footprint("fwd", **big, token_major=True).total
  heads_major = planner.footprint("fwd", **big, token_major=False).total
  assert heads_major < budget < token_major
  assert not planner.forward_token_major(budget=budget, **big)
  # The planner counts the forward in the layout that runs, so 64 heads still get the forward's largest q tiles
  # (heads-major); counted token-major they would not fit above 512 rows.
  blocks = planner.plan_block_sizes(8192, 8192, 64, 64, 128, jnp.bfloat16, generation="v5e")
  assert blocks.block_q == planner.FWD_MAX_Q > 512
  mha = dims | {"num_kv_heads": 64}
  assert not planner.forward_token_major(bq=blocks.block_q, bk=blocks.block_kv, budget=budget, num_heads=64, **mha)


def test_vmem_table_matches_jax_hardware_table():
  chips = {
    "v4": pltpu.ChipVersion.TPU_V4,
    "v5e": pltpu.ChipVersion.TPU_V5E,
    "v5p": pltpu.ChipVersion.TPU_V5P,
    "v6e": pltpu.ChipVersion.TPU_V6E,
    "v7x": pltpu.ChipVersion.TPU_7X,
  }
  assert set(chips) == set(planner.VMEM_BYTES)
  for gen, chip in chips.items():
    assert planner.VMEM_BYTES[gen] == pltpu.get_tpu_info_for_chip(chip, 1).vmem_capacity_bytes, gen


SHAPES = [
  # (q_len, kv_len, N, K, H, dtype[, Hv: v's head dim when it differs])
  (4096, 4096, 8, 8, 128, jnp.bfloat16),
  (8192, 8192, 32, 8, 128, jnp.bfloat16),
  (2048, 2048, 16, 1, 256, jnp.bfloat16),
  (16384, 16384, 8, 2, 64, jnp.float32),
  (1024, 3072, 4, 4, 128, jnp.float32),
  (640, 640, 8, 8, 128, jnp.bfloat16),
  (8192, 8192, 16, 16, 192, jnp.bfloat16, 128),  # MLA (DeepSeek's head dims)
  (4096, 4096, 8, 2, 64, jnp.float32, 256),  # a v wider than q/k
]


def _shape_id(s):
  return "x".join(map(str, s[:5])) + f"-{jnp.dtype(s[5]).name}" + "".join(f"-v{h}" for h in s[6:])


def _total(kernels, bq, bk, N, K, H, dtype, Hv=None, budget=None):
  """The largest footprint of `kernels` at (bq, bk); with a `budget`, the forward's in the layout it runs there
  (`forward_token_major`)."""
  dims = dict(bq=bq, bk=bk, num_heads=N, num_kv_heads=K, head_dim=H, dtype=dtype, v_head_dim=Hv)
  token_major = None if budget is None else planner.forward_token_major(budget=budget, **dims)
  return max(planner.footprint(k, **dims, token_major=token_major if k == "fwd" else None).total for k in kernels)


def _next(values, v):
  bigger = [x for x in values if x > v]
  return bigger[0] if bigger else None


def _fwd_caps(N, K):
  """The forward's (q, kv) tile caps: FWD_MAX_Q x FWD_MAX_KV, or with grouped heads FWD_GROUPED_MAX_KV wide and
  at most FWD_MAX_ROWS stacked rows."""
  if N == K:
    return planner.FWD_MAX_Q, planner.FWD_MAX_KV
  return min(planner.FWD_MAX_Q, planner.FWD_MAX_ROWS // (N // K)), planner.FWD_GROUPED_MAX_KV


@pytest.mark.parametrize("generation", sorted(planner.VMEM_BYTES))
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_plan_fits_and_one_step_larger_does_not(generation, shape):
  """With MLA head dims the planner counts v at its own width: were it to plan v at q/k's, it would stop one
  step short of (or past) what fits.  The forward's tiles also stop at their caps (`_fwd_caps`, measured: larger
  ones gain nothing or spill), the backward's at its stacked score cap (the fused kernel's: also a kv cap), so
  only a larger tile within those may not fit.  Fused backward tiles (fused_bwd None) fit the two-kernel backward
  too, which runs at them where a batch's dq partials would not fit."""
  T, S, N, K, H, dtype, *Hv = shape
  Hv = Hv[0] if Hv else None
  G = N // K
  budget = planner.budget_bytes(generation)
  bs = fr.plan_block_sizes(T, S, N, K, H, dtype, generation=generation, v_head_dim=Hv)
  assert bs.fused_bwd in (None, False)
  bwd_kernels = ("dkv_fused",) if bs.fused_bwd is None else ("dq", "dkv")
  qs, ks = planner.candidates(T, common.sublanes(dtype)), planner.candidates(S, common.LANES)
  below = lambda ts, cap: max((t for t in ts if t <= cap), default=0) >= cap // 2  # noqa: E731
  for kernels, (bq, bk) in ((("fwd",), (bs.block_q, bs.block_kv)), (bwd_kernels, bs.bwd)):
    assert bq in qs and bk in ks and T % bq == 0 and S % bk == 0
    assert _total(kernels, bq, bk, N, K, H, dtype, Hv, budget) <= budget
    if kernels == ("dkv_fused",):
      assert _total(("dq", "dkv"), bq, bk, N, K, H, dtype, Hv, budget) <= budget
    q_cap = kv_cap = score_cap = None
    if kernels == ("fwd",):
      q_cap, kv_cap = _fwd_caps(N, K)
      q_cap, kv_cap = (q_cap if below(qs, q_cap) else None), (kv_cap if below(ks, kv_cap) else None)
    elif kernels == ("dkv_fused",):
      kv_cap = planner.BWD_FUSED_MAX_KV if below(ks, planner.BWD_FUSED_MAX_KV) else None
      score_cap = planner.BWD_FUSED_MAX_SCORES // G
    else:
      score_cap = planner.BWD_MAX_SCORES // G
    assert (q_cap is None or bq <= q_cap) and (kv_cap is None or bk <= kv_cap)
    for bigger in ((_next(qs, bq), bk), (bq, _next(ks, bk))):
      if None not in bigger and ((q_cap and bigger[0] > q_cap) or (kv_cap and bigger[1] > kv_cap)):
        continue  # past a tile cap: may fit
      if None not in bigger and score_cap and bigger[0] * bigger[1] > score_cap >= bq * bk:
        continue  # past the backward's score cap: may fit
      if None not in bigger:
        assert _total(kernels, *bigger, N, K, H, dtype, Hv, budget) > budget, (generation, kernels, (bq, bk), bigger)


def test_forward_tiles_stop_at_the_cap_unless_only_small_tiles_are_below_it():
  """The forward's tiles stop at FWD_MAX_Q x FWD_MAX_KV (measured fastest on a v5e); a length whose only tiles
  below the cap are small (8 x 131 = 1048 rows: 8; 640 columns: 128) keeps the whole axis, as before the cap."""
  bs = fr.plan_block_sizes(8192, 8192, 8, 8, 128, jnp.bfloat16, generation="v5e")
  assert (bs.block_q, bs.block_kv) == (planner.FWD_MAX_Q, planner.FWD_MAX_KV) == (1024, 512)
  assert bs.bwd == (1024, 1024) and bs.fused_bwd is None  # the fused backward's: 1M scores, 1024 wide
  awkward = fr.plan_block_sizes(1048, 640, 8, 8, 128, jnp.bfloat16, generation="v5e")
  assert (awkward.block_q, awkward.block_kv) == (1048, 640)


@pytest.mark.parametrize(
  "N, K, H, fwd, bwd",
  [
    # measured on a v5e (8k causal): Llama-3.2-1B's and Qwen2.5-0.5B's layouts, tuned on
    (32, 8, 64, (1024, 1024), (256, 1024)),
    (14, 2, 64, (512, 1024), (128, 1024)),
    # checked on the chip after tuning: Qwen2.5-7B's layout
    (28, 4, 128, (512, 1024), (128, 1024)),
    (8, 1, 256, (512, 1024), (128, 1024)),
    (16, 8, 256, (1024, 1024), (512, 1024)),
  ],
)
def test_grouped_heads_get_wide_forward_tiles_and_fused_backward_tiles(N, K, H, fwd, bwd):
  """With G = N / K > 1 q heads stacked per kv head, the forward's tiles are 1024 wide and at most FWD_MAX_ROWS
  stacked rows tall (a 1024 x 512 forward with G = 7 ran 1.42x the time of 512 x 1024); the backward is fused, its
  stacked score tile within BWD_FUSED_MAX_SCORES and the cap binding (one step taller would pass it)."""
  bs = fr.plan_block_sizes(8192, 8192, N, K, H, jnp.bfloat16, generation="v5e")
  assert ((bs.block_q, bs.block_kv), bs.bwd, bs.fused_bwd) == (fwd, bwd, None)
  G, (bq, bk) = N // K, bs.bwd
  assert G * bq <= planner.FWD_MAX_ROWS or bq == fwd[0]
  assert G * bq * bk <= planner.BWD_FUSED_MAX_SCORES < G * 2 * bq * bk


def test_fused_backward_runs_in_kv_chunks_where_its_dq_partials_would_not_fit(monkeypatch):
  """Where the fused backward's dq partials pass FUSED_DQ_MAX_BYTES (32k tokens, 8 heads of 128: 32 partials of 64
  MiB) its kernel runs over the fewest equal kv chunks within it (`fused_dq_chunks`), and the plan stays fused;
  the two kernels run only where one kv tile's partial alone would pass it, where the stacked tile passes 2M
  scores, or where the fused kernel does not fit VMEM (`fused_backward_auto`)."""
  bs = fr.plan_block_sizes(32768, 32768, 8, 8, 128, jnp.bfloat16, generation="v5e")
  assert bs.fused_bwd is None and bs.bwd == (1024, 1024)
  assert planner.fused_dq_bytes(B=1, T=32768, S=32768, N=8, H=128, bk=1024, dtype=jnp.bfloat16) == 32 * 64 * 2**20
  assert planner.fused_dq_chunks(B=1, T=32768, S=32768, N=8, H=128, bk=1024, dtype=jnp.bfloat16) == 2
  assert planner.fused_dq_chunks(B=1, T=8192, S=8192, N=8, H=128, bk=1024, dtype=jnp.bfloat16) == 1
  # 24 kv tiles: 16 MiB partials each, 64 per chunk at most; chunks divide the tiles (not 5: 6)
  monkeypatch.setattr(block_planner, "FUSED_DQ_MAX_BYTES", 80 * 2**20)
  assert planner.fused_dq_chunks(B=1, T=8192, S=24 * 128, N=8, H=128, bk=128, dtype=jnp.bfloat16) == 6
  monkeypatch.setattr(block_planner, "FUSED_DQ_MAX_BYTES", 16 * 2**20 - 1)
  assert planner.fused_dq_chunks(B=1, T=8192, S=24 * 128, N=8, H=128, bk=128, dtype=jnp.bfloat16) is None
  monkeypatch.undo()
  llama = ProblemShape(q_len=8192, kv_len=8192, num_heads=32, num_kv_heads=8, head_dim=64, dtype=jnp.bfloat16)
  auto = functools.partial(planner.fused_backward_auto, llama, generation="v5e")
  assert auto(batch=1, bq=256, bk=1024) and auto(batch=8, bq=256, bk=1024)  # 8 rows: 2 chunks of 4 kv tiles
  assert not auto(batch=64, bq=256, bk=1024)  # one kv tile's partial for 64 rows: 2 GiB
  assert not auto(batch=1, bq=1024, bk=1024)  # 4M stacked scores: spills
  # A VMEM budget between the two kernels' footprints and the fused kernel's (which holds both of their tiles
  # plus dq's): the two kernels run
  need = {k: planner.footprint(k, bq=256, bk=1024, dtype=jnp.bfloat16, **llama.heads).total for k in PLANS}
  assert max(need["dq"], need["dkv"]) < need["dkv_fused"]
  monkeypatch.setattr(block_planner, "budget_bytes", lambda generation: need["dkv_fused"] - 1)
  assert not auto(batch=1, bq=256, bk=1024)


@pytest.mark.parametrize("N, K, H", [(32, 8, 64), (14, 2, 64), (28, 4, 128), (8, 1, 256), (8, 8, 128)])
def test_two_kernel_backward_score_tile_stops_at_the_cap(N, K, H, monkeypatch):
  """The two-kernel backward's stacked score tile (G q heads x bq rows x bk columns) stays within BWD_MAX_SCORES
  (measured on a v5e: 1024 x 2048 with 4 q heads per kv head ran 1.7x the time of 512 x 512); the cap binds, so
  the tile is not smaller than it needs to be: one step larger in either axis would pass it or not fit."""
  monkeypatch.setattr(block_planner, "FUSED_DQ_MAX_BYTES", 0)  # no kv tile's partial fits: two kernels
  bs = fr.plan_block_sizes(8192, 8192, N, K, H, jnp.bfloat16, generation="v5e")
  assert bs.fused_bwd is False
  bq, bk = bs.bwd
  assert (N // K) * bq * bk <= planner.BWD_MAX_SCORES
  assert (N // K) * 2 * bq * bk > planner.BWD_MAX_SCORES or bk == 2048


def test_tiles_keep_their_tables_within_smem():
  """A long shard (262144 tokens) at the forward's capped tiles would need more SMEM for its tile tables than
  `common.block_setup` allows: the planner moves on to tiles whose tables fit (past the cap where none below it
  does), which the kernels then accept."""
  T = 262144
  bs = fr.plan_block_sizes(T, T, 8, 8, 128, jnp.bfloat16, generation="v5e")
  assert planner.block_table_bytes(T // planner.FWD_MAX_Q, T // planner.FWD_MAX_KV) > common.SMEM_TABLE_BYTES
  for bq, bk in ((bs.block_q, bs.block_kv), bs.bwd):
    assert planner.block_table_bytes(T // bq, T // bk) <= common.SMEM_TABLE_BYTES, (bq, bk)


def test_smaller_vmem_gets_smaller_tiles():
  big = fr.plan_block_sizes(8192, 8192, 32, 8, 128, jnp.bfloat16, generation="v6e")
  small = fr.plan_block_sizes(8192, 8192, 32, 8, 128, jnp.bfloat16, generation="v4")
  assert small.block_q * small.block_kv < big.block_q * big.block_kv


def test_off_tpu_plans_for_the_smallest_vmem():
  if jax.default_backend() == "tpu":
    pytest.skip("plans for the attached TPU")
  assert fr.plan_block_sizes(4096, 4096, 8, 8, 128, jnp.bfloat16) == fr.plan_block_sizes(
    4096, 4096, 8, 8, 128, jnp.bfloat16, generation=planner.DEFAULT_GENERATION
  )


def test_planner_errors():
  with pytest.raises(ValueError, match=r"unknown TPU generation='v9'.*known generations"):
    fr.plan_block_sizes(1024, 1024, 8, 8, 128, jnp.bfloat16, generation="v9")
  with pytest.raises(ValueError, match=r"num_heads=6 must be a multiple of num_kv_heads=4"):
    fr.plan_block_sizes(1024, 1024, 6, 4, 128, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"q_len must be a positive int, got q_len=0"):
    fr.plan_block_sizes(0, 1024, 8, 8, 128, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"no legal tiles for q_len=4096, kv_len=4096 fit both the v4 VMEM budget"):
    fr.plan_block_sizes(4096, 4096, 64, 1, 4096, jnp.float32, generation="v4")
  with pytest.raises(ValueError, match=r"no legal TPU tile for q_len=4000 .* or kv_len=4000 \(multiples of 128"):
    fr.plan_block_sizes(4000, 4000, 32, 8, 128, jnp.bfloat16, generation="v5e")
  with pytest.raises(ValueError, match=r"v_head_dim must be a positive int, got v_head_dim=0"):
    fr.plan_block_sizes(1024, 1024, 8, 8, 128, jnp.bfloat16, v_head_dim=0)
  with pytest.raises(ValueError, match=r"fit both the v4 VMEM budget .* head_dim=128, v_head_dim=65536\)"):
    fr.plan_block_sizes(4096, 4096, 8, 8, 128, jnp.float32, generation="v4", v_head_dim=65536)
  # Long axes: tiles small enough for VMEM have tile tables too large for SMEM (Qwen2.5-0.5B's heads at 64k on v4).
  with pytest.raises(ValueError, match=r"SMEM's 512 KiB of tile tables .* KiB of tables.*shard the sequence"):
    fr.plan_block_sizes(65536, 65536, 14, 2, 64, jnp.bfloat16, generation="v4")


def _pallas(q, k, v, blocks):
  return fr.ring_attention(q, k, v, implementation="pallas_tpu", interpret=True, block_sizes=blocks)


@pytest.mark.parametrize(
  "dtype,T,S,blocks,match",
  [
    (jnp.bfloat16, 64, 64, fr.BlockSizes(block_q=8, block_kv=128), r"block_q tile <= 8 .* multiples of 16"),
    (jnp.float32, 64, 64, fr.BlockSizes(block_q=4, block_kv=128), r"block_q tile <= 4 .* multiples of 8"),
    (jnp.float32, 64, 384, fr.BlockSizes(block_q=64, block_kv=100), r"block_kv tile <= 100 .* shard length 384 .* 128"),
    (jnp.float32, 36, 64, fr.BlockSizes(block_q=16, block_kv=128), r"block_q tile <= 16 .* shard length 36 .* 8"),
  ],
)
def test_unaligned_tiles_are_rejected(dtype, T, S, blocks, match):
  q = jnp.zeros((1, T, 2, 16), dtype)
  k = v = jnp.zeros((1, S, 2, 16), dtype)
  with pytest.raises(ValueError, match=match):
    _pallas(q, k, v, blocks)


def test_grouped_heads_need_aligned_q_tiles():
  q = jnp.zeros((1, 36, 4, 16))  # 2 q heads per kv head, the whole 36-row shard as one q tile
  k = v = jnp.zeros((1, 64, 2, 16))
  with pytest.raises(
    ValueError, match=r"with 2 q heads per kv head the q tile must be a multiple of 8 rows .* q_len=36"
  ):
    _pallas(q, k, v, fr.BlockSizes(block_q=64, block_kv=128))
  # The planner never picks such a tile: here there is no legal one.
  with pytest.raises(ValueError, match=r"no legal TPU tile for q_len=36 .*with grouped heads it must be aligned"):
    fr.plan_block_sizes(36, 64, 4, 2, 16, jnp.float32)
  assert fr.plan_block_sizes(36, 64, 2, 2, 16, jnp.float32).block_q == 36  # without grouping the whole axis is fine


def test_tile_tables_must_fit_smem():
  x = jnp.zeros((1, 16384, 1, 8))
  with pytest.raises(ValueError, match=r"2048 x 128 tiles .* need 2097152 bytes of tile tables in SMEM"):
    _pallas(x, x, x, fr.BlockSizes(block_q=8, block_kv=128))


# -- the in-kernel ring's planner (`planners/ring.py`) ---------------------------------------------------------


@pytest.mark.parametrize(
  "segments,dropout,spans,positions",
  [(False, False, False, False), (True, False, False, False), (True, True, False, False), (False, False, True, True),
   (True, False, True, True), (False, True, False, True)],
  ids=["", "seg", "seg-drop", "spans-positions", "seg-spans-positions", "drop-positions"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_planner_counts_every_ring_buffer(segments, dropout, spans, positions, dtype):
  """`ring_footprint` equals the VMEM of each ring kernel's own plan, with VMEM and HBM slots, with v's head dim
  equal to q/k's, narrower and wider, on kv tiles the HBM backward's fold adds in halves (128) or with partner
  buffers (200: a whole short shard), with every combination of token fields (segment ids, bidirectional ids,
  positions given per row: a q column and travelling kv row slots each)."""
  extra = (("pos",) if positions else ()) + (("bid",) if spans else ())
  for Hv, (S, bk) in itertools.product((None, 48, 160), ((384, 128), (200, 200))):
    d = rp.RingDims(
      axes=("sp",),
      sizes=(4,),
      n=4,
      load_balance=False,
      B=2,
      T=256,
      S=S,
      N=8,
      K=2,
      H=64,
      dtype=jnp.dtype(dtype),
      bq=64,
      bk=bk,
      has_segments=segments,
      live=4,
      has_dropout=dropout,
      v_head_dim=Hv,
      extra_fields=extra,
    )
    dims = dict(T=256, S=S, bq=64, bk=bk, num_heads=8, num_kv_heads=2, head_dim=64, dtype=dtype, v_head_dim=Hv)
    dims.update(has_segments=segments, dropout=dropout, extra_fields=extra)
    plans = dict(ring_fwd=fwd_plan, ring_bwd=bwd_plan, ring_fwd_hbm=fwd_plan_hbm, ring_bwd_hbm=bwd_plan_hbm)
    for kernel, plan in plans.items():
      slots = "hbm" if kernel.endswith("_hbm") else "vmem"
      got = common.plan_vmem_bytes(plan(dataclasses.replace(d, slots=slots)))
      assert planner.ring_footprint(kernel, **dims).buffers == got, (kernel, Hv, S, bk)
    # HBM slots: no VMEM buffer grows with the shard
    longer = dict(dims, T=64 * 1024, S=64 * 1024)
    for kernel in ("ring_fwd_hbm", "ring_bwd_hbm"):
      assert planner.ring_footprint(kernel, **longer) == planner.ring_footprint(kernel, **dims)
  with pytest.raises(ValueError, match="kernel must be 'ring_fwd', 'ring_bwd', 'ring_fwd_hbm' or 'ring_bwd_hbm'"):
    planner.ring_footprint("fwd", **dims)


def test_ring_plan():
  """The ring's planner: VMEM slots at the largest tiles that fit with whole shards resident, else HBM slots at
  the least-traffic tiles; the tile table of n hops always within SMEM; the caller's tiles kept."""
  small = dict(num_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16, generation="v5e")
  plan = lambda **kw: planner.plan_ring(**small, **kw)  # noqa: E731
  budget = planner.budget_bytes("v5e")
  for L, backward in ((1024, False), (4096, False), (4096, True)):
    got = plan(T=L, S=L, n=8, backward=backward)
    assert got.slots == "vmem", (L, backward, got)
    name = "ring_bwd" if backward else "ring_fwd"
    dims = dict(T=L, S=L, num_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)

    def need(bq, bk, name=name, dims=dims):
      return planner.ring_footprint(name, bq=bq, bk=bk, **dims).total

    assert need(got.bq, got.bk) <= budget
    # the largest: every legal pair of larger area does not fit
    bigger = [
      (bq, bk)
      for bq in planner.q_candidates(L, jnp.bfloat16, grouped=True)
      for bk in planner.candidates(L, 128)
      if bq * bk > got.bq * got.bk
    ]
    assert all(need(bq, bk) > budget for bq, bk in bigger), (L, backward, got)
    if L == 4096:
      assert bigger, "the choice is below the whole shard, so the check above compares something"
  # Token fields (segment ids, bidirectional ids, positions given per row) are counted where the slots and tiles
  # are chosen, through the `ProblemShape` the kernels plan from (positions come apart: the shape has no flag).
  fields = dict(has_segments=True, extra_fields=("pos", "bid"))
  shape = ProblemShape(
    q_len=4096, kv_len=4096, num_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16, has_segments=True,
    extra_fields=("pos", "bid"),
  )  # fmt: skip
  with_fields = planner.plan_ring_for(shape, n=8, backward=True, generation="v5e")
  assert with_fields == plan(T=4096, S=4096, n=8, backward=True, **fields)
  name = "ring_bwd" if with_fields.slots == "vmem" else "ring_bwd_hbm"
  dims = dict(T=4096, S=4096, num_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
  assert planner.ring_footprint(name, bq=with_fields.bq, bk=with_fields.bk, **dims, **fields).total <= budget
  plain = plan(T=4096, S=4096, n=8, backward=True)
  for kernel in ("ring_fwd", "ring_bwd", "ring_fwd_hbm", "ring_bwd_hbm"):
    at = dict(bq=plain.bq, bk=plain.bk, **dims)
    assert planner.ring_footprint(kernel, **at, **fields).buffers > planner.ring_footprint(kernel, **at).buffers
  # A shard too long for VMEM: HBM slots, and the tile table of a ring of 8 fits SMEM.
  for backward in (False, True):
    long = plan(T=1 << 17, S=1 << 17, n=8, backward=backward)
    assert long.slots == "hbm", long
    assert planner.ring_table_bytes(8, (1 << 17) // long.bq, (1 << 17) // long.bk) <= common.SMEM_TABLE_BYTES
  # The caller's tiles are kept; only the slots are chosen.
  assert plan(T=1024, S=1024, n=4, backward=False, tiles=(64, 128)) == planner.RingPlan("vmem", 64, 128)
  assert plan(T=1 << 17, S=1 << 17, n=4, backward=False, tiles=(512, 512)) == planner.RingPlan("hbm", 512, 512)
  with pytest.raises(ValueError, match=r"plan_ring: no legal TPU tile for q_len=100"):
    plan(T=100, S=1024, n=4, backward=False)  # no legal grouped q tile
  assert planner.ring_fits(T=1024, S=1024, n=4, **small)
  assert planner.ring_fits(T=1 << 17, S=1 << 17, n=4, **small)  # HBM slots: no VMEM cap on the shard length
  # ... but the tile table is: n x T/bq x S/bk tiles of 2 bits within 512 KiB, at most 2048-token tiles.
  assert planner.ring_table_bytes(4, 512, 512) == 4 * 512 * 32 * 4
  assert not planner.ring_fits(T=1 << 21, S=1 << 21, n=4, **small)
  assert not planner.ring_fits(T=100, S=1024, n=4, **small)
  # Not even the smallest tiles fit: a group of 2048 q heads of head_dim 512 is 32 MiB per 16-row q tile.
  wide = dict(small, num_heads=2048, num_kv_heads=1, head_dim=512)
  assert not planner.ring_fits(T=1024, S=1024, n=4, **wide)
  with pytest.raises(ValueError, match=r"plan_ring: no legal tiles .* fit the v5e VMEM budget .* with HBM slots"):
    planner.plan_ring(T=1024, S=1024, n=4, backward=True, **wide)


# DeepSeek-V3's attention at full size (prefill, the latent projections expanded: 128 heads, qk 192 = 128 + 64
# rope, v 128), bf16, on a 16K-token shard (a 128K sequence over a ring of 8).  The block kernels' grid holds one
# kv head's group per step, so MHA (K = N) is the shape they see.
DEEPSEEK_V3 = dict(num_heads=128, num_kv_heads=128, head_dim=192, dtype=jnp.bfloat16)


@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e"])
def test_deepseek_v3_mla_plans_fit_with_v_at_its_own_width(generation):
  """The block and ring planners' choices for DeepSeek-V3 fit the budget, and at the chosen tiles the footprint
  (and the HBM traffic) with v at 128 is smaller than with v at q/k's 192: the models count v, o, dO and dv at
  Hv.  The keyword forms and the `ProblemShape` forms agree."""
  L, budget = 16384, planner.budget_bytes(generation)
  bs = fr.plan_block_sizes(L, L, 128, 128, 192, jnp.bfloat16, generation=generation, v_head_dim=128)
  shape = ProblemShape(q_len=L, kv_len=L, v_head_dim=128, **DEEPSEEK_V3)
  assert planner.plan_block_sizes_for(shape, generation=generation) == bs
  for kernels, (bq, bk) in ((("fwd",), (bs.block_q, bs.block_kv)), (("dq", "dkv"), bs.bwd)):
    for kernel in kernels:
      mla, wide = (planner.footprint(kernel, bq=bq, bk=bk, **DEEPSEEK_V3, v_head_dim=w).total for w in (128, 192))
      assert mla <= budget and mla < wide, (kernel, bq, bk, mla, wide)
      traffic = dict(bq=bq, bk=bk, q_len=L, kv_len=L, **DEEPSEEK_V3)
      assert planner.hbm_bytes(kernel, **traffic, v_head_dim=128) < planner.hbm_bytes(kernel, **traffic), kernel
  for backward in (False, True):
    plan = planner.plan_ring(T=L, S=L, n=8, backward=backward, generation=generation, v_head_dim=128, **DEEPSEEK_V3)
    assert planner.plan_ring_for(shape, n=8, backward=backward, generation=generation) == plan
    name = ("ring_bwd" if backward else "ring_fwd") + ("_hbm" if plan.slots == "hbm" else "")
    tiles = dict(T=L, S=L, bq=plan.bq, bk=plan.bk, **DEEPSEEK_V3)
    mla, wide = (planner.ring_footprint(name, **tiles, v_head_dim=w).total for w in (128, 192))
    assert mla <= budget and mla < wide, (name, plan, mla, wide)
  assert planner.ring_fits(T=L, S=L, n=8, generation=generation, v_head_dim=128, **DEEPSEEK_V3)
  assert planner.ring_fits_for(shape, n=8, generation=generation)


# -- the paged planner (`plan_paged_block_sizes`) at MLA head shapes ------------------------------------------

# DeepSeek-V3 serving at full size, paged: 128 q heads, the latent projections expanded to MHA (K = 128), qk 192
# (128 + 64 rope), v 128, bf16 pages of 16 tokens, a 128K-token context (8192 pages), 512 batched tokens.
DEEPSEEK_V3_PAGED = dict(num_heads=128, num_kv_heads=128, head_dim=192, dtype=jnp.bfloat16)
PAGED_GEOMETRY = dict(max_num_batched_tokens=512, page_size=16, pages_per_seq=8192)


def _paged_plan(generation, **kw):
  return planner.plan_paged_block_sizes(**PAGED_GEOMETRY, **DEEPSEEK_V3_PAGED, generation=generation, **kw)


@pytest.mark.parametrize("generation", ["v5e", "v5p", "v6e", "v7x"])
def test_paged_plan_deepseek_v3_mla_fits_with_v_at_its_own_width(generation):
  """The paged planner's choice for DeepSeek-V3 (v 128) fits the chip's budget, and at those blocks both paged
  kernels' footprints are below the ones with v at q/k's 192 (v pages, o, dO, the o and dV accumulators at Hv):
  the narrower v leaves room for a kv block at least as long."""
  budget = planner.budget_bytes(generation)
  mla, wide = _paged_plan(generation, v_head_dim=128), _paged_plan(generation)
  assert _paged_plan(generation, v_head_dim=192) == wide  # v_head_dim == head_dim is no MLA
  blocks = dict(bq=mla.block_q, pages_per_block=mla.block_kv // 16, page_size=16, page_dtype=jnp.bfloat16)
  blocks.update(DEEPSEEK_V3_PAGED)
  for kernel in ("paged_fwd", "paged_bwd"):
    at_128, at_192 = (planner.paged_footprint(kernel, **blocks, v_head_dim=hv).total for hv in (128, 192))
    assert at_128 <= budget and at_128 < at_192, (kernel, mla, at_128, at_192)
  assert mla.block_kv >= wide.block_kv and mla.block_q >= wide.block_q, (mla, wide)


def test_paged_plan_deepseek_v3_mla_does_not_fit_v4():
  """v4's 12 MiB budget cannot hold the backward's 128-head q / dq blocks and one page of 128 kv heads even at the
  smallest blocks (about 18 MiB at v 128, 20 at 192): the planner says so, naming v's head dim, and the registry
  turns that into "not supported here" (XLA runs the call)."""
  smallest = dict(bq=16, pages_per_block=1, page_size=16, page_dtype=jnp.bfloat16, **DEEPSEEK_V3_PAGED)
  assert planner.paged_footprint("paged_bwd", **smallest, v_head_dim=128).total > planner.budget_bytes("v4")
  with pytest.raises(ValueError, match=r"fits the v4 VMEM budget of 12\.0 MiB .*head_dim=192, v_head_dim=128\)"):
    _paged_plan("v4", v_head_dim=128)

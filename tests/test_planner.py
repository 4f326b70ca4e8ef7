"""The Pallas TPU tile planner: its footprint model, its choices, and tile validation."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import tpu as pltpu

import flax_ringattn as fr
from flax_ringattn._src.backends.pallas_tpu import common
from flax_ringattn._src.backends.pallas_tpu import planners as planner
from flax_ringattn._src.backends.pallas_tpu.block import backward, forward

PLANS = {"fwd": forward.fwd_plan, "dq": backward.dq_plan, "dkv": backward.dkv_plan}


@pytest.mark.parametrize("kernel", sorted(PLANS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
  "has_segments,dropout", [(False, False), (True, False), (True, True)], ids=["", "seg", "seg-drop"]
)
def test_model_counts_exactly_the_kernels_buffers(kernel, dtype, has_segments, dropout):
  """The closed-form model equals the VMEM of the kernel's own BlockSpecs and scratch shapes (the dropout
  operand lives in SMEM: no VMEM buffer, but its hash and scale tiles are temporaries)."""
  for (bq, bk), (N, K), H in itertools.product(
    [(16, 128), (128, 256), (512, 128), (24, 384)], [(8, 2), (4, 4), (8, 1)], [64, 128, 80]
  ):
    dims = dict(B=2, T=4 * bq, S=2 * bk, N=N, K=K, H=H, dtype=dtype, bq=bq, bk=bk, has_segments=has_segments)
    plan = PLANS[kernel](**dims, has_dropout=dropout)
    model = planner.footprint(
      kernel,
      bq=bq,
      bk=bk,
      num_heads=N,
      num_kv_heads=K,
      head_dim=H,
      dtype=dtype,
      has_segments=has_segments,
      dropout=dropout,
    )
    assert model.buffers == common.plan_vmem_bytes(plan), (kernel, bq, bk, N, K, H)
    assert model.temporaries >= 2 * (N // K) * bq * bk * 4  # at least the f32 score tile and p
    if dropout:
      without = planner.footprint(kernel, bq=bq, bk=bk, num_heads=N, num_kv_heads=K, head_dim=H, dtype=dtype)
      assert model.temporaries >= without.temporaries + 2 * (N // K) * bq * bk * 4  # int32 hash and f32 scale


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
  # (q_len, kv_len, N, K, H, dtype)
  (4096, 4096, 8, 8, 128, jnp.bfloat16),
  (8192, 8192, 32, 8, 128, jnp.bfloat16),
  (2048, 2048, 16, 1, 256, jnp.bfloat16),
  (16384, 16384, 8, 2, 64, jnp.float32),
  (1024, 3072, 4, 4, 128, jnp.float32),
  (640, 640, 8, 8, 128, jnp.bfloat16),
]


def _total(kernels, bq, bk, N, K, H, dtype):
  return max(
    planner.footprint(k, bq=bq, bk=bk, num_heads=N, num_kv_heads=K, head_dim=H, dtype=dtype).total for k in kernels
  )


def _next(values, v):
  bigger = [x for x in values if x > v]
  return bigger[0] if bigger else None


@pytest.mark.parametrize("generation", sorted(planner.VMEM_BYTES))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + f"-{jnp.dtype(s[5]).name}")
def test_plan_fits_and_one_step_larger_does_not(generation, shape):
  T, S, N, K, H, dtype = shape
  budget = planner.budget_bytes(generation)
  bs = fr.plan_block_sizes(T, S, N, K, H, dtype, generation=generation)
  qs, ks = planner.candidates(T, common.sublanes(dtype)), planner.candidates(S, common.LANES)
  for kernels, (bq, bk) in ((("fwd",), (bs.block_q, bs.block_kv)), (("dq", "dkv"), bs.bwd)):
    assert bq in qs and bk in ks and T % bq == 0 and S % bk == 0
    assert _total(kernels, bq, bk, N, K, H, dtype) <= budget
    for bigger in ((_next(qs, bq), bk), (bq, _next(ks, bk))):
      if None not in bigger:
        assert _total(kernels, *bigger, N, K, H, dtype) > budget, (generation, kernels, (bq, bk), bigger)


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
  with pytest.raises(ValueError, match=r"no legal tiles for q_len=4096, kv_len=4096 fit the v4 VMEM budget"):
    fr.plan_block_sizes(4096, 4096, 64, 1, 4096, jnp.float32, generation="v4")
  with pytest.raises(ValueError, match=r"no legal TPU tile for q_len=4000 .* or kv_len=4000 \(multiples of 128"):
    fr.plan_block_sizes(4000, 4000, 32, 8, 128, jnp.bfloat16, generation="v5e")


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

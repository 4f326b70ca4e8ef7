"""VMEM-aware planners of the Pallas TPU kernels, one per kernel family, over one chip model (`chip.py`).

Each footprint model counts every buffer its kernels allocate (pipelined tiles
twice, for double buffering; VMEM scratch once) plus the f32 score-sized
temporaries a kernel body keeps live; `tests/test_planner.py` checks each model
against `tiling.plan_vmem_bytes` of the kernels' own `CallPlan`s.
"""

from flax_ringattn._src.backends.pallas_tpu.planners import tuned
from flax_ringattn._src.backends.pallas_tpu.planners.block import (
  BWD_MAX_SCORES,
  FWD_MAX_KV,
  FWD_MAX_Q,
  MAX_TILE,
  Footprint,
  block_table_bytes,
  candidates,
  footprint,
  forward_token_major,
  forward_token_major_for,
  fwd_score_temporaries,
  hbm_bytes,
  plan_block_sizes,
  plan_block_sizes_for,
  q_candidates,
)
from flax_ringattn._src.backends.pallas_tpu.planners.chip import (
  DEFAULT_GENERATION,
  SAFETY_MARGIN,
  VMEM_BYTES,
  MiB,
  budget_bytes,
  current_generation,
  vmem_bytes,
  vmem_limit_bytes,
)
from flax_ringattn._src.backends.pallas_tpu.planners.paged import (
  PAGED_MAX_BLOCK_Q,
  PAGED_MAX_BLOCK_TOKENS,
  paged_footprint,
  plan_paged_block_sizes,
)
from flax_ringattn._src.backends.pallas_tpu.planners.ring import (
  RING_KINDS_PER_WORD,
  RingPlan,
  plan_ring,
  plan_ring_for,
  ring_fits,
  ring_fits_for,
  ring_footprint,
  ring_table_bytes,
)

__all__ = [
  "tuned",
  "DEFAULT_GENERATION",
  "BWD_MAX_SCORES",
  "FWD_MAX_KV",
  "FWD_MAX_Q",
  "MAX_TILE",
  "PAGED_MAX_BLOCK_Q",
  "PAGED_MAX_BLOCK_TOKENS",
  "RING_KINDS_PER_WORD",
  "SAFETY_MARGIN",
  "VMEM_BYTES",
  "Footprint",
  "block_table_bytes",
  "MiB",
  "RingPlan",
  "budget_bytes",
  "candidates",
  "current_generation",
  "footprint",
  "forward_token_major",
  "forward_token_major_for",
  "fwd_score_temporaries",
  "hbm_bytes",
  "paged_footprint",
  "plan_block_sizes",
  "plan_block_sizes_for",
  "plan_paged_block_sizes",
  "plan_ring",
  "plan_ring_for",
  "q_candidates",
  "ring_fits",
  "ring_fits_for",
  "ring_footprint",
  "ring_table_bytes",
  "vmem_bytes",
  "vmem_limit_bytes",
]

"""VMEM-aware block planner of the ragged paged kernel (`paged/`): its footprint model and `plan_paged_block_sizes`."""

from __future__ import annotations

import jax.numpy as jnp

from flax_ringattn._src.backends.pallas_tpu import tiling as c
from flax_ringattn._src.backends.pallas_tpu.planners import tuned
from flax_ringattn._src.backends.pallas_tpu.planners.block import Footprint
from flax_ringattn._src.backends.pallas_tpu.planners.chip import MiB, budget_bytes, current_generation
from flax_ringattn._src.block_sizes import BlockSizes

# Pages per kv block stop paying past this many tokens: a block's copies already
# keep the DMA engines busy while the previous block is used, and a larger block
# wastes more of a sequence's last, partial block.  On a v5e (2026-12-05, bf16,
# N=32, K=8, pages of 16, shuffled; docs/performance.md), against 512-token
# blocks, 1024-token ones ran a 64 x 2048 decode 1.16x faster (1.59 ms vs
# 1.84 ms), and 2048-token ones were slower than 1024 on both decodes (1.65 vs
# 1.59 ms; 2.55 vs 2.39 ms for 16 x 16384), and with the forward's window too
# (2026-12-06: 2.23 vs 2.16-2.18 ms for 16 x 16384).
PAGED_MAX_BLOCK_TOKENS = 1024
# A sequence with more rows in a q block than fit in the forward's window
# (`plans.window_rows`, 8 rows for G = 4; a prefill) costs the whole block's rows in its
# matmuls and softmax.  Before the window, every sequence did, and on a v5e
# 32-row q blocks ran a mixed 1024-row step (2 prefills + 32 decodes) 1.11x
# faster than 64-row ones (1.93 vs 2.15 ms) and the 1054-token step 1.16x
# (1.45 vs 1.68 ms).  With the window (2026-12-06), 64-row blocks ran the
# 1024-row step 1.07x faster than 32-row ones (1.65 vs 1.75-1.77 ms); the
# 1054-token step has not been measured at 64 since, so the cap stays.  The q
# block is at most PAGED_MAX_BLOCK_Q rows and at most a quarter of the batch's
# (one sublane tile of q's dtype at least: a bf16 decode of 64 sequences runs
# 16-row blocks).
PAGED_MAX_BLOCK_Q = 32


def paged_footprint(
  kernel: str,
  *,
  bq,
  pages_per_block,
  page_size,
  num_heads,
  num_kv_heads,
  head_dim,
  dtype,
  page_dtype,
  scale_rows=(0, 0),
  soft_cap=False,
  v_head_dim=None,
  bidirectional=False,
  merged=False,
) -> Footprint:
  """VMEM of the paged kernel 'paged_fwd' or 'paged_bwd' at `bq` rows and `pages_per_block` pages per kv block.

  `scale_rows`: per-page rows of (k_scale, v_scale): 0 without a scale, 1 per page (and for a scalar scale),
  page_size per token.  `v_head_dim`: v's (and the output's) head dim when it differs from `head_dim` (MLA):
  the v pages, the output, do and the accumulators of o and dV are that wide.  Pages stay in HBM; the kernel
  copies them into a buffer of kv slots itself (`tiling.PAGED_FWD_SLOTS`, `PAGED_BWD_SLOTS`).
  `bidirectional`: span ids, the q block's [bq, 1] (pipelined) and the kv block's [1, L] (with the pages' slots).
  `merged`: pages [P, page_size, K * H] (`paged.plans.PagedDims`): a kv block's buffer is [L, K * H], dense for
  any K.
  """
  N, K, H, ps, ppb = num_heads, num_kv_heads, head_dim, page_size, pages_per_block
  Hv = H if v_head_dim is None else v_head_dim
  G, L, f32 = N // K, pages_per_block * page_size, jnp.float32
  q_block = c.padded_bytes((bq, N, H), dtype)
  o_block = c.padded_bytes((bq, N, Hv), dtype)  # o, or do
  slots = c.PAGED_FWD_SLOTS if kernel == "paged_fwd" else c.PAGED_BWD_SLOTS  # kv blocks in VMEM
  kv_slots = sum(
    c.padded_bytes(c.paged_kv_buffer_shape(ppb, ps, K, h, page_dtype, (H, Hv), merged, slots), page_dtype)
    for h in (H, Hv)
  )
  kv_slots += sum(c.padded_bytes((slots, ppb, r, K), f32) for r in scale_rows if r)
  kv_slots += c.padded_bytes((1, L), jnp.int32)  # which slots hold a key
  span_block = 0
  if bidirectional:
    kv_slots += c.padded_bytes((slots, 1, L), jnp.int32)
    span_block = c.padded_bytes((bq, 1), jnp.int32)
  score = G * bq * L * 4  # one f32 [bq * G, L] tile
  head_kv = L * (H + Hv) * 4  # one kv head's K and V block, dequantised to f32
  if kernel == "paged_fwd":
    pipelined = q_block + o_block + c.padded_bytes((bq, N), f32) + span_block  # q; o, lse; span ids
    scratch = kv_slots + 2 * c.padded_bytes((K, bq * G, c.LANES), f32) + c.padded_bytes((K, bq * G, Hv), f32)
    scratch += c.padded_bytes((K, bq * G, H), f32)  # q folded per head group (f32: `PagedDims.window_rows`)
    temporaries = 3 * score + head_kv
  elif kernel == "paged_bwd":
    # q, do, lse, delta; dq
    stats = c.padded_bytes((K, bq * G, 2), f32)  # (lse, delta), folded per head group
    pipelined = q_block + o_block + stats + c.padded_bytes((bq, N, H), f32) + span_block
    scratch = kv_slots + c.padded_bytes((bq, N, H), f32)
    scratch += c.padded_bytes((ppb, ps, K, H), f32) + c.padded_bytes((ppb, ps, K, Hv), f32)  # dK, dV of a block
    # One page of the read-add-write: one buffer for dK and dV, or one each when their head dims differ.
    scratch += sum(c.padded_bytes((ps, K, h), f32) for h in ((H,) if Hv == H else (H, Hv)))
    temporaries = 5 * score + head_kv
  else:
    raise ValueError(f"kernel must be 'paged_fwd' or 'paged_bwd', got {kernel!r}")
  if soft_cap:
    temporaries += score
  return Footprint(buffers=2 * pipelined + scratch, temporaries=temporaries)


def plan_paged_block_sizes(
  max_num_batched_tokens: int,
  page_size: int,
  pages_per_seq: int,
  num_heads: int,
  num_kv_heads: int,
  head_dim: int,
  dtype,
  page_dtype=None,
  *,
  scale_rows=(0, 0),
  soft_cap=False,
  v_head_dim=None,
  bidirectional=False,
  merged=False,
  generation: str | None = None,
) -> BlockSizes:
  """`BlockSizes(block_q=rows per grid step, block_kv=tokens per kv block)` for the paged kernel.

  The largest kv block up to PAGED_MAX_BLOCK_TOKENS tokens (whole pages, at most a sequence's pages), then the
  tallest q block up to min(PAGED_MAX_BLOCK_Q, max_num_batched_tokens // 4) rows (a prefill spanning several
  q blocks reads its pages once per block; any token count: the kernels pad q to a multiple of it), such that
  both the forward and the backward kernels fit `generation`'s VMEM budget.  `v_head_dim`: v's head dim when it
  differs from `head_dim` (MLA), `bidirectional` (span ids) and `merged` (pages [P, page_size, K * H]), as in
  `paged_footprint`.
  """
  generation = current_generation() if generation is None else generation
  budget = budget_bytes(generation)
  page_dtype = dtype if page_dtype is None else page_dtype
  sub = c.sublanes(dtype)
  # Any token count: the kernels pad q to a multiple of the q block (`paged.plans.q_block`).
  T = max_num_batched_tokens
  cap = min(PAGED_MAX_BLOCK_Q, max(sub, T // 4))
  qs = [T] if T <= cap else []
  qs += [t for t in range(sub, min(cap, T) + 1, sub) if t != T]
  pbs = [p for p in range(1, pages_per_seq + 1) if p * page_size <= max(PAGED_MAX_BLOCK_TOKENS, page_size)]
  dims = dict(
    page_size=page_size,
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    dtype=dtype,
    page_dtype=page_dtype,
    scale_rows=scale_rows,
    soft_cap=soft_cap,
    v_head_dim=None if v_head_dim == head_dim else v_head_dim,
    bidirectional=bidirectional,
    merged=merged,
  )

  def fits(bq, ppb):  # both kernels within the VMEM budget
    return budget >= max(
      paged_footprint(k, bq=bq, pages_per_block=ppb, **dims).total for k in ("paged_fwd", "paged_bwd")
    )

  key = tuned.paged_key(
    T, page_size, pages_per_seq, num_heads, num_kv_heads, head_dim, dims["v_head_dim"], dtype, page_dtype,
    scale_rows, soft_cap, bidirectional, merged,
  )  # fmt: skip
  entry = tuned.lookup(generation, key)
  if entry is not None:  # a measured choice, where the model's rules accept it (`tuned.py`)
    bq, ppb = entry["block_q"], entry["block_kv"] // page_size
    legal = (bq % sub == 0 or bq == T) and 0 < bq <= max(T, sub)  # a q block the kernel runs as asked
    legal &= entry["block_kv"] % page_size == 0 and 1 <= ppb <= pages_per_seq  # whole pages of one sequence
    if legal and fits(bq, ppb):
      return BlockSizes(block_q=bq, block_kv=ppb * page_size)
  for ppb in sorted(pbs, reverse=True):
    for bq in sorted(qs, reverse=True):
      if fits(bq, ppb):
        return BlockSizes(block_q=bq, block_kv=ppb * page_size)
  raise ValueError(
    f"plan_paged_block_sizes: no q block of {max_num_batched_tokens=} (multiples of {sub} up to "
    f"{PAGED_MAX_BLOCK_Q}) with whole pages of {page_size=} fits the {generation} VMEM budget of "
    f"{budget / MiB:.1f} MiB ({num_heads=}, {num_kv_heads=}, {head_dim=}"
    + ("" if v_head_dim in (None, head_dim) else f", {v_head_dim=}")
    + ")"
  )

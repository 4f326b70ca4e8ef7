"""Pallas TPU ragged paged attention: one launch for a mixed prefill + decode batch, forward and backward.

Grid: one step per block of `bq` consecutive rows of q (q stays [T, N, H] as
projected; its BlockSpec is (bq, N, H), the output's (bq, N, Hv), so nothing
is transposed outside the kernel).  A block may hold rows of several
sequences.  Before the launch, XLA lists every q block's visits, its
(sequence, kv block) pairs in order, into the fourth scalar-prefetched operand
(`walk.schedule`); the step reads each visit there, and the rest from the
scalar-prefetched metadata (SMEM):

  1. the block's visits: [offsets[i], offsets[i + 1]) of the schedule;
  2. for each sequence s overlapping the block (`walk.seq_bounds`, the one
     rule both the schedule and the kernel read): its rows in the block, their
     positions (the new tokens are the last q_len of kv_lens[s]), and the kv
     blocks they can see (causal upper end, sliding-window lower end);
  3. for each kv block of `ppb` pages: async copies of the pages (all kv
     heads of a page are contiguous, so one copy per page and per K/V) into a
     VMEM buffer of `PagedDims.slots` kv blocks; the visits run in one loop,
     and the next slots - 1 blocks (of this sequence or the next ones) are in
     flight while block b is used (one in the forward and the backward:
     `tiling.PAGED_FWD_SLOTS`, `PAGED_BWD_SLOTS`).  Each
     copy moves exactly the page's tokens below kv_len (a dynamic size, 0 for
     a page past kv_len or missing from the table), so the starts take no
     branch per page, and the DMA semaphore, which counts bytes, is waited on
     once per K and V buffer for the block's token count (kept in SMEM
     from the start of its copies).  bf16
     and 32-bit pages with K a multiple of 8 travel as a free [P, ps * K, H]
     view into a flat [ppb * ps * K, H] buffer, where a kv head is one
     sublane-strided load (bf16 as 32-bit words holding heads 2i and 2i + 1);
     other pages land in a [ppb * ps, K, H] buffer and a head is a slice
     (`tiling.flat_kv_pages`);
  4. for each kv head: the G = N / K q heads of its group, folded to one
     (bq * G, H) operand (row r is token r // G, head r % G), meet the block
     in one matmul, so decode under 8:1 GQA fills 8 rows of the MXU per token.
     The forward keeps q folded in f32 scratch; a sequence whose rows fit in
     `PagedDims.window_rows` rows from a multiple of 8 (a decode token's G
     rows) is computed on that window alone, not on all bq * G rows.

MLA head shapes: v pages may be [P, page_size, K, Hv] with Hv != H (q and k's).
The v buffers, their copies, the o / dV accumulators and the outputs are Hv wide;
only q . k and dq, dK use H.  Attention sinks need nothing here: `_src/flash.py`
applies them after the forward, and the backward only reads p where a key is
visible, so the sink-inclusive lse it receives (finite, s_h, on rows that see no
key) still gives those rows exact-zero gradients.

Isolation: a page's tokens are copied only if the page id is in [0, P), and
only those below kv_lens[s] (an int8/fp8 cache's scales: the page's whole
scale rows).  Slots not copied (stale VMEM) and scale rows past kv_lens are
zeroed in VMEM (`walk.block_keys`, on the blocks that have any) and masked, so
NaN in foreign pages or tails cannot reach an output.

Backward (one kernel, sequential grid): the same walk recomputes p from the
forward's lse and accumulates dq for the block in VMEM, while dK/dV of each
kv block are added into f32 page buffers in HBM (aliased to the outputs) by
read-add-write copies, one page at a time, so pages shared by several
sequences (prefix sharing) collect the gradient of every reader.

JAX 0.10.2's TPU interpreter cannot index through reshaped refs, so refs are
only indexed (`ref.at[...]`, `ref[...]`) and loaded values are reshaped.  Nor
can it bitcast a ref: in interpret mode a flat bf16 head is a strided bf16
load, compiled it goes through 32-bit words (`walk._flat_head`).
"""

from flax_ringattn._src.backends.pallas_tpu.paged.backward import paged_bwd
from flax_ringattn._src.backends.pallas_tpu.paged.forward import paged_fwd, paged_fwd_write
from flax_ringattn._src.backends.pallas_tpu.paged.plans import (
  SUPPORTED_Q_DTYPES,
  PagedDims,
  bwd_plan,
  check_supported,
  dims_of,
  fwd_plan,
  lane_groups,
)

__all__ = [
  "SUPPORTED_Q_DTYPES",
  "PagedDims",
  "bwd_plan",
  "check_supported",
  "dims_of",
  "fwd_plan",
  "lane_groups",
  "paged_bwd",
  "paged_fwd",
  "paged_fwd_write",
]

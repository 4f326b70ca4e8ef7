"""Roofline model of the Pallas TPU ring-attention kernels per TPU generation (model-derived, runs on CPU).

What it prints
--------------
* per generation (v4, v5e, v5p, v6e, v7x), global length T, mask and pass, one
  device's whole ring at the tiles `plan_block_sizes` picks for the shard T / n
  (`tpu_dma_walk.py`: tile tables on the real positions, the block DMAs the
  Pallas pipeline issues, checked against the kernels' own index maps): FLOPs
  and the share on visible pairs, HBM bytes, dead DMAs, the roofline time
  max(FLOPs / peak, bytes / HBM bandwidth) and its bound, skip% and imbalance;
* ICI: the bytes a device sends per hop (`cost.ring_hop_bytes`) against the
  hop's compute, and a one-link estimate; the shard below which the in-kernel
  ring (`implementation="pallas_tpu_ring"`) cannot hide its send
  (`cost.ring_min_shard`);
* the in-kernel ring with HBM slots (`ring/hbm_forward.py`,
  `ring/hbm_backward.py`), one full-mask hop (`ring_hbm_hop`): its HBM bytes are
  the planner's own model (`planners.hbm_bytes` of the block passes it mirrors,
  which `planners.plan_ring` minimises) plus the ring's state, fold and sends;
* the ragged paged kernel (`_src/backends/pallas_tpu/paged/`, blocks from
  `planners.plan_paged_block_sizes`): a decode step and a mixed step, walked as
  the kernel walks them (`paged_table`);
* MLA (`mla_table`): DeepSeek-V3's attention (128 q heads and kv heads, q/k
  head dim 192, v 128, bf16) through the same walk, beside the same call with v
  at 192: tiles, time and the share v's narrower head saves.
* context-parallel decode (`cp_decode_table`): one decode step of a 1M-token
  context (GQA K=8, H=128, N=64, bf16) with the pages spread over n = 8..64
  devices of v5e, v5p, v6e: each device's 1/n of the K/V at HBM bandwidth,
  then the exact merge (an all-reduce of [T_q, N, H + 1] f32 and a pmax of
  [T_q, N]) over one ICI link; per-device KV GiB, step time, merge share.
* ring prefill (`cp_prefill_table`): one hop of `paged_ring_prefill` for a
  32k-token prompt chunk after 0, 512k or ~1M cached tokens on n = 8..64
  devices: the hop's compute against what it sends, pass-Q (q and the
  accumulator, what the op does) beside pass-KV (the device's K/V).

Hardware figures are the package's table (`flax_ringattn.benchmarking.hardware`:
JAX's per-TensorCore numbers times the cores of one JAX device, ICI from the
Cloud TPU pages); the compute bound uses the bf16 peak.  The model ignores VPU
work, the ~0.35 us per-grid-step overhead, XLA ops around the kernels and DMA
efficiency.  With a TPU attached it also times `ring_attention(...,
implementation="pallas_tpu")` (a ring of one per shard length) against
`jax.nn.dot_product_attention`, checked against each other first, interleaved.

Run it::

  python benchmarks/tpu_roofline.py --quick          # a few seconds
  python benchmarks/tpu_roofline.py                  # default table, < 1 min on CPU
  python benchmarks/tpu_roofline.py --generations v5e,v6e --seq-lens 131072,1048576 --masks causal,causal-lb --json
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tpu_dma_walk as walk  # the block kernels' DMA walk over the ring, checked against their index maps

import flax_ringattn as fr
from flax_ringattn._src.backends.pallas_tpu import common
from flax_ringattn._src.backends.pallas_tpu import planners as planner
from flax_ringattn._src.backends.pallas_tpu.paged import plans as paged_plans
from flax_ringattn.benchmarking import (
  PROBLEM_SETS,
  Report,
  add_report_args,
  compare,
  cost,
  hardware,
  median,
  paired_ratio,
  time_interleaved,
)
from flax_ringattn.benchmarking import fwd_bwd as make_fwd_bwd

Problem, PassResult, GENERATIONS, PASSES, ALL_MASKS = (
  walk.Problem,
  walk.PassResult,
  walk.GENERATIONS,
  walk.PASSES,
  walk.ALL_MASKS,
)
GB, MB, MIB, GIB = walk.GB, walk.MB, walk.MIB, walk.GIB
DEFAULTS = PROBLEM_SETS["tpu_roofline"][0]
DEFAULT_SEQ_LENS = tuple(p.T for p in PROBLEM_SETS["tpu_roofline"])
QUICK_SEQ_LENS = tuple(p.T for p in PROBLEM_SETS["tpu_roofline_quick"])
STEP_OVERHEAD_S = 0.35e-6  # per grid step (see the module docstring)


# ------------------------------------------------------------------------------------------
# Tables.


def hardware_table(report: Report, gens: Sequence[str]) -> None:
  rows = []
  for g in gens:
    c = hardware.tpu(g)
    peak, bw = walk.rates(g)
    bidir, link = c.ici_bidir, c.ici_link
    rows.append([g, c.cores_per_device, peak / 1e12, bw / GB, peak / bw, c.vmem_bytes / MIB]
                + [None if x is None else x / GB for x in (bidir, link)])  # fmt: skip
  header = ["gen", "cores", "bf16 TF/s", "HBM GB/s", "ridge F/B", "VMEM MiB", "ICI bidir GB/s/chip"]
  header.append("1 link GB/s (est)")
  title = "Hardware (the package's table, per JAX device; ICI per chip)"
  report.table(title, header, rows, formats=dict.fromkeys(header[2:], ".0f"))


def tiles_table(report: Report, gens: Sequence[str], seq_lens: Sequence[int], p: Problem) -> None:
  shards = [T // p.n for T in seq_lens]
  rows = []
  for g in gens:
    cells = []
    for L in shards:
      try:
        t = walk.tiles(g, L, p)
        cells.append(f"{t['fwd'][0]}x{t['fwd'][1]} / {t['bwd'][0]}x{t['bwd'][1]}")
      except ValueError:
        cells.append("error (see rows)")
    rows.append([g, *cells])
  title = f"Tiles from plan_block_sizes(T/n, T/n, N={p.N}, K={p.K}, H={p.H}, {p.dtype}), bq x bk (fwd / bwd)"
  report.table(title, ["gen", *(f"T/n={L}" for L in shards)], rows)


PASS_HEADER = ["gen", "T", "T/n", "mask", "pass", "tiles", "skip%", "dev skip%", "TFLOP", "useful%", "GB", "dead GB"]
PASS_HEADER += ["FLOP/B", "bound", "t_dev ms", "t_ring ms", "imbal"]


def pass_row(r: PassResult) -> list:
  if r.error:
    return [r.gen, r.T, r.shard, r.mask, r.pas, f"error: {r.error}", *[None] * 11]
  dev = f"{100 * r.skip_dev[0]:.0f}-{100 * r.skip_dev[1]:.0f}"
  useful = 100 * r.useful / r.flops if r.flops else 0.0
  ai = r.flops / r.bytes if r.bytes else 0.0
  return [r.gen, r.T, r.shard, r.mask, r.pas, f"{r.tiles[0]}x{r.tiles[1]}", 100 * r.skip, dev, r.flops / 1e12,
          useful, r.bytes / GB, r.dead / GB, ai, r.bound, r.t_dev * 1e3, r.t_ring * 1e3, r.imbal]  # fmt: skip


PASS_FORMATS = {"skip%": ".1f", "TFLOP": ".2f", "useful%": ".1f", "GB": ".2f", "dead GB": ".2f", "FLOP/B": ".0f"}
PASS_FORMATS |= {"imbal": ".2f"}


def ici_table(report: Report, results: dict, gens, seq_lens, mask_names, p: Problem) -> None:
  rows = []
  for g in gens:
    link = hardware.tpu(g).ici_link
    for T in seq_lens:
      L = T // p.n
      for mask in mask_names:
        for pas in PASSES:
          r = results.get((g, T, mask, pas))
          if r is None or r.error:
            continue
          sent = cost.ring_hop_bytes(B=p.B, S=L, K=p.K, H=p.H, itemsize=p.itemsize, direction=pas, Hv=p.Hv)
          sending = r.hop_times[: p.n - 1] if pas == "fwd" else r.hop_times  # bwd: accumulators move every hop
          t_min = float(sending.min()) if len(sending) else float("nan")
          t_ici = sent / link if link else None
          hidden = None if t_ici is None else t_ici <= t_min
          rows.append([g, L, mask, pas, sent / MB, t_min * 1e3, sent / t_min / GB if t_min > 0 else None,
                       link and link / GB, t_ici and t_ici * 1e3, hidden])  # fmt: skip
  report.table(
    "ICI per hop (model-derived)",
    ["gen", "T/n", "mask", "pass", "MB/hop", "min hop ms", "needs GB/s", "link GB/s", "ICI ms", "hidden"],
    rows,
    formats={"MB/hop": ".1f", "needs GB/s": ".1f", "link GB/s": ".0f"},
    notes=[
      "Bytes each device sends per hop (forward K and V; backward also the f32 dK/dV accumulators) vs the slowest",
      "device's compute in the sending hops; 'needs' = the one-way bandwidth that would hide the send; 'link' assumes",
      "the ring's neighbour is one ICI link away and the send uses one direction of it.",
    ],
  )


# DeepSeek-V3's attention (MLA, the q/k head dim 192 = 128 + 64 rope, v 128), per device on a ring of the
# problem's size, against the same call with v at q/k's width.
MLA = dict(N=128, K=128, H=192, Hv=128, dtype="bfloat16")


def mla_table(report: Report, gens: Sequence[str], seq_lens: Sequence[int], p: Problem, tiled: bool) -> None:
  T = max(seq_lens)
  mla = dataclasses.replace(p, B=1, **MLA)
  wide = dataclasses.replace(mla, Hv=None)
  rows = []
  for g in gens:
    for pas in PASSES:
      try:
        r, w = (walk.evaluate(g, T, "causal-lb", pas, x, tiled) for x in (mla, wide))
      except ValueError as e:
        rows.append([g, T, pas, f"error: {e}", *[None] * 6])
        continue
      rows.append([g, T, pas, f"{r.tiles[0]}x{r.tiles[1]}", f"{w.tiles[0]}x{w.tiles[1]}", r.flops / 1e12,
                   r.bytes / GB, r.t_dev * 1e3, w.t_dev * 1e3, r.t_dev / w.t_dev])  # fmt: skip
  report.table(
    f"MLA: DeepSeek-V3 attention (N=K=128, qk 192, v 128, bf16), causal-lb, T={T} on a ring of {p.n}",
    ["gen", "T", "pass", "tiles", "tiles v=192", "TFLOP", "GB", "t_dev ms", "t_dev v=192 ms", "ratio"],
    rows,
    formats={"TFLOP": ".2f", "GB": ".2f", "ratio": ".2f"},
    notes=[
      "The same walk as the table above with v, o, dO and dV at 128 (plan_block_sizes(v_head_dim=128)); 'v=192' is",
      "the call with v at q/k's 192, for scale.  Model-derived; the busiest device.",
    ],
  )


def kernel_ring_table(report: Report, gens: Sequence[str], p: Problem) -> None:
  """Per generation, `cost.ring_min_shard`: the shard below which a full-mask hop of the in-kernel ring computes
  (at the bf16 peak) for less time than its send over one ICI link takes."""
  rows = []
  for g in gens:
    link = hardware.tpu(g).ici_link
    dims = dict(peak=walk.rates(g)[0], link=link, B=p.B, N=p.N, K=p.K, H=p.H, itemsize=p.itemsize)
    rows.append([g, link and link / GB, *(link and cost.ring_min_shard(**dims, direction=d) for d in ("fwd", "bwd"))])
  report.table(
    "In-kernel ring (pallas_tpu_ring): shortest shard T/n whose full-mask hop hides its ICI send",
    ["gen", "link GB/s", "fwd min T/n", "bwd min T/n"],
    rows,
    formats={"link GB/s": ".0f", "fwd min T/n": ".0f", "bwd min T/n": ".0f"},
    notes=["A causal or windowed hop computes less and needs a longer shard.  Links as in the ICI table."],
  )


# ------------------------------------------------------------------------------------------
# The in-kernel ring with HBM slots (`ring/hbm_forward.py`, `ring/hbm_backward.py`): per-hop model, full mask.

KERNEL_RING_HBM_SHARDS = (1024, 8192, 32768, 131072)  # per-device shard lengths T / n of `kernel_ring_hbm_table`


@dataclasses.dataclass(frozen=True)
class RingHop:
  """One hop of an HBM-slot ring kernel on one device (all B x K grid steps), full mask: every tile computes."""

  pas: str  # "fwd" or "bwd"
  hop: int
  tiles: tuple[int, int]  # (bq, bk) the kernel runs with
  slots: str  # what `planner.plan_ring` picks at this shape: "hbm" = this kernel runs, "vmem" = the other one
  smem_table: int  # bytes of the ring's tile table (`planner.ring_table_bytes`, within common.SMEM_TABLE_BYTES)
  flops: float
  tile_bytes: float  # HBM bytes of the kernel's own copies: the block passes it mirrors, state, fold
  ring_bytes: float  # HBM bytes of the ring's sends: the outgoing copy read here plus the incoming one written here
  sent: float  # bytes this device sends to its neighbour over ICI this hop
  t_mxu: float  # flops / bf16 peak
  t_hbm: float  # bytes / HBM bandwidth
  t_ici: float | None  # sent / one ICI link one way; None where the link is unknown

  @property
  def bytes(self) -> float:
    return self.tile_bytes + self.ring_bytes

  @property
  def bound(self) -> str:
    return "mxu" if self.t_mxu >= self.t_hbm else "hbm"

  @property
  def t_hop(self) -> float:
    return max(self.t_mxu, self.t_hbm)

  @property
  def hidden(self) -> bool | None:
    """Whether the hop's compute (roofline) is at least as long as its send; None without a link figure."""
    return None if self.t_ici is None else self.t_ici <= self.t_hop


def middle_hop(n: int) -> int:
  """The hop the table shows: hop 1 of a ring of 3 or more (state read and written, K/V sent; backward also dq
  read, the fold, and the dK/dV accumulators sent), else hop 0."""
  return 1 if n > 2 else 0


def pass_bytes(kernel: str, *, bq: int, bk: int, L: int, p: Problem, tiled: bool) -> float:
  """`planners.hbm_bytes` of block pass `kernel` on (L, L) shards, all B batch rows; `tiled`: the (sublane, 128)
  HBM tiles the copies span.  The planner's tiles are sublane-aligned, so tiling pads only lanes: head_dim to a
  multiple of 128, and the f32 [G, bq, 1] lse / delta tiles to 128 lanes (the terms of `hbm_bytes` that do not
  grow with head_dim)."""
  dims = dict(bq=bq, bk=bk, q_len=L, kv_len=L, num_heads=p.N, num_kv_heads=p.K, dtype=jnp.dtype(p.dtype))
  if not tiled:
    return float(p.B * planner.hbm_bytes(kernel, head_dim=p.H, **dims))
  lanes = common.LANES
  stats = planner.hbm_bytes(kernel, head_dim=0, **dims)
  return float(p.B * (planner.hbm_bytes(kernel, head_dim=-(-p.H // lanes) * lanes, **dims) + (lanes - 1) * stats))


def ring_hbm_hop(gen: str, L: int, p: Problem, pas: str, *, hop=None, tile=None, tiled: bool = True) -> RingHop:
  """HBM bytes, FLOPs and ICI send of hop `hop` (default `middle_hop(p.n)`) of the HBM-slot ring kernel `pas`
  ("fwd": hops 0 .. n-1; "bwd": hops 0 .. n, hop n only sending the accumulators home) on one device with shard
  L = T = S, full mask (every member sends).  `tile` (bq, bk) defaults to the ring planner's (`plan_ring`).

  The passes copy what the block kernels they mirror copy (`pass_bytes`: `planners.hbm_bytes`, the model
  `plan_ring` minimises; forward: q, all K/V tiles per q tile, o and lse written; backward: the dq pass and the
  dk/dv pass), plus what the ring adds: the softmax state o / lse (forward) or the f32 dq (backward) read back
  on hops after the first; the fold (hops 1 .. n-1: for dK and dV, read the arrived accumulator and the local
  sum, write the sum); after the last hop the accumulators copied out.  Sends (`cost.ring_hop_bytes`): K and V
  on hops t < n - 1, the backward's accumulators on hops t >= 1; each sent byte is read here and written here by
  the upstream neighbour: 2 x sent.
  """
  if pas not in PASSES:
    raise ValueError(f"pas must be one of {tuple(PASSES)}, got {pas!r}")
  n = p.n
  t = middle_hop(n) if hop is None else hop
  last = n - 1 if pas == "fwd" else (n if n > 1 else 0)
  if not 0 <= t <= last:
    raise ValueError(f"hop {t} is not a hop of the {pas} ring of {n} (0 .. {last})")
  dtype = jnp.dtype(p.dtype)
  dims = dict(T=L, S=L, n=n, num_heads=p.N, num_kv_heads=p.K, head_dim=p.H, dtype=dtype, generation=gen)
  plan = planner.plan_ring(**dims, backward=pas == "bwd", tiles=tile)
  bq, bk = plan.bq, plan.bk
  if L % bq or L % bk:
    raise ValueError(f"tiles {bq}x{bk} do not divide the shard length {L}")
  bh, bb = p.B * p.K, functools.partial(walk.block_bytes, tiled=tiled)
  q_f32 = bh * bb((p.G, L, p.H), "float32")  # o or dq of the q shard
  acc = bh * bb((L, p.H), "float32")  # one dK (or dV) accumulator
  hop_bytes = functools.partial(cost.ring_hop_bytes, B=p.B, S=L, K=p.K, H=p.H, itemsize=p.itemsize)
  passes = dict(bq=bq, bk=bk, L=L, p=p, tiled=tiled)
  computes = t < n  # backward hop n only sends
  if pas == "fwd":
    state = q_f32 + bh * bb((p.G, L, 1), "float32")  # o, lse
    tile_bytes = pass_bytes("fwd", **passes) + (state if t > 0 else 0)
    sent = hop_bytes(direction="fwd") if t < n - 1 else 0.0
  else:
    dq = pass_bytes("dq", **passes) + (q_f32 if t > 0 else 0)
    fold = 2 * 3 * acc if 1 <= t < n else 0
    copy_out = 2 * 2 * acc if t == last else 0  # dK, dV: read the home slot, write the output
    tile_bytes = (dq + pass_bytes("dkv", **passes) if computes else 0) + fold + copy_out
    accs = hop_bytes(direction="bwd") - hop_bytes(direction="fwd")
    sent = (hop_bytes(direction="fwd") if t < n - 1 else 0.0) + (accs if t >= 1 else 0.0)
  matmuls = sum(cost.KERNEL_MATMULS[k] for k in PASSES[pas])
  flops = cost.pair_flops(L * L, B=p.B, N=p.N, H=p.H, matmuls=matmuls) if computes else 0.0
  peak, bw = walk.rates(gen)
  link = hardware.tpu(gen).ici_link
  return RingHop(
    pas=pas,
    hop=t,
    tiles=(bq, bk),
    slots=plan.slots,
    smem_table=planner.ring_table_bytes(n, L // bq, L // bk),
    flops=flops,
    tile_bytes=float(tile_bytes),
    ring_bytes=2 * sent,
    sent=sent,
    t_mxu=flops / peak,
    t_hbm=(tile_bytes + 2 * sent) / bw,
    t_ici=sent / link if link else None,
  )


def kernel_ring_hbm_table(report: Report, gens, p: Problem, tiled: bool, shards=KERNEL_RING_HBM_SHARDS) -> None:
  t = middle_hop(p.n)
  rows = []
  for g in gens:
    for L in shards:
      for pas in PASSES:
        try:
          r = ring_hbm_hop(g, L, p, pas, hop=t, tiled=tiled)
        except ValueError as e:
          rows.append([g, L, pas, f"error: {e}", *[None] * 12])
          continue
        smem = f"{r.smem_table / 1024:.1f}{'!' if r.smem_table > common.SMEM_TABLE_BYTES else ''}"
        rows.append([g, L, pas, f"{r.tiles[0]}x{r.tiles[1]}", r.slots, smem, r.flops / 1e9, r.t_mxu * 1e3,
                     r.bytes / GB, r.t_hbm * 1e3, r.flops / r.bytes, r.bound, r.t_hop * 1e3, r.sent / MB,
                     r.t_ici and r.t_ici * 1e3, r.hidden])  # fmt: skip
  header = ["gen", "T/n", "pass", "tiles", "slots", "SMEM KiB", "GFLOP", "mxu ms", "HBM GB", "hbm ms", "FLOP/B"]
  header += ["bound", "hop ms", "sent MB", "ICI ms", "hidden"]
  kib = common.SMEM_TABLE_BYTES // 1024
  report.table(
    f"In-kernel ring with HBM slots (model-derived, not measured): hop {t} of a ring of n={p.n}, full mask",
    header,
    rows,
    formats={"GFLOP": ".1f", "HBM GB": ".3f", "FLOP/B": ".0f", "sent MB": ".1f"},
    notes=[
      "K/V slots, softmax state, dq and the dK/dV accumulators live in HBM; tiles stream through VMEM.",
      "HBM GB: the block passes the kernel mirrors (planners.hbm_bytes) + state, fold and the ring's send read and",
      "receive written; hop ms = max(mxu ms, hbm ms).  tiles, slots: planner.plan_ring per direction ('vmem': the",
      "VMEM-slot kernel runs there, and the row shows what HBM slots would cost).  SMEM KiB: the tile table",
      f"(within {kib} KiB).  Ignores VPU work, grid-step overhead, and that the outer tile's copies are not",
      "overlapped with compute.",
    ],
  )


# ------------------------------------------------------------------------------------------
# The ragged paged attention kernel (`_src/backends/pallas_tpu/paged/`), one decode step and one mixed step.
#
# Model of the kernel's walk: a grid step per q block of bq rows; for each sequence with rows in the block, the
# kv blocks its rows can see (ppb pages each) are copied page by page, only pages below kv_len (so a sequence's
# pages are read once per q block holding its rows), and every kv head's matmuls run on the folded (bq * G,
# ppb * page) tile, or, for a sequence whose folded rows fit the forward's window (`plans.window_rows`: a
# decode), on the window's rows alone.


def paged_workload(num_decodes: int, prefill: int, num_prefills: int, max_history: int) -> list[tuple[int, int]]:
  """(q_len, kv_len) per sequence: decodes with histories evenly spread over 64 .. max_history, then prefills."""
  hist = np.linspace(64, max_history, num_decodes).astype(int) if num_decodes else []
  return [(1, int(h)) for h in hist] + [(prefill, prefill)] * num_prefills


def paged_step_cost(seqs, bq: int, ppb: int, ps: int, p: Problem, tiled: bool) -> dict:
  """FLOPs and HBM bytes of one forward launch of the paged kernel over `seqs`, walked as the kernel does."""
  T = -(-sum(q for q, _ in seqs) // bq) * bq
  page_bytes = walk.block_bytes((ps, p.K, p.H), p.dtype, tiled)
  flops = kv_bytes = 0
  row = 0
  fwd = functools.partial(cost.pair_flops, N=p.N, H=p.H, matmuls=cost.KERNEL_MATMULS["fwd"])
  window, rows_computed = paged_plans.window_rows(p.G, bq), []
  for q_len, kv_len in seqs:
    first = kv_len - q_len
    for blk in range(row // bq, -(-(row + q_len) // bq) if q_len else row // bq):
      lo, hi = max(row, blk * bq), min(row + q_len, (blk + 1) * bq)  # the sequence's rows in this q block
      blocks = (first + (hi - 1 - row)) // (ppb * ps) + 1
      kv_bytes += 2 * min(blocks * ppb, -(-kv_len // ps)) * page_bytes  # K and V pages below kv_len
      lo_f, hi_f = (lo - blk * bq) * p.G, (hi - blk * bq) * p.G  # folded rows (`walk.row_window`)
      narrow = window is not None and paged_plans.fits_window(lo_f, hi_f, window, bq * p.G)[0]
      folded = window if narrow else bq * p.G
      rows_computed.append(folded / ((hi - lo) * p.G))
      flops += fwd(folded / p.G * blocks * ppb * ps)  # every kv head on its folded rows
    row += q_len
  io = 2 * walk.block_bytes((T, p.N, p.H), p.dtype, tiled) + walk.block_bytes(
    (T, p.N), "float32", tiled
  )  # q in; o, lse
  useful = fwd(sum(sum(kv - q + j + 1 for j in range(q)) for q, kv in seqs))  # causal pairs of the new rows
  min_kv = sum(2 * kv * p.K * p.H * p.itemsize for _, kv in seqs)  # each live K/V byte once
  return dict(T=T, flops=flops, kv_bytes=kv_bytes, bytes=kv_bytes + io, min_kv=min_kv, useful=useful, steps=T // bq,
              rows_per_useful=max(rows_computed, default=0.0))  # fmt: skip


def padded_flops(seqs, p: Problem) -> float:
  """A padded batch: every sequence's q padded to the longest q_len and its kv to the longest kv_len."""
  qm, km = max(q for q, _ in seqs), max(kv for _, kv in seqs)
  return cost.pair_flops(len(seqs) * qm * km, N=p.N, H=p.H, matmuls=cost.KERNEL_MATMULS["fwd"])


def paged_table(report: Report, gens: Sequence[str], p: Problem, args, tiled: bool) -> None:
  ps = args.page_size
  decode = paged_workload(args.paged_decodes, 0, 0, args.paged_history)
  mixed = paged_workload(args.paged_decodes, args.paged_prefill, 2, args.paged_history)
  rows = []
  for g in gens:
    peak, bw = walk.rates(g)
    rows_mxu = hardware.tpu(g).mxu_size
    try:
      max_tokens, pages = max(-(-len(decode) // 16) * 16, 16), -(-args.paged_history // ps)
      bs = planner.plan_paged_block_sizes(max_tokens, ps, pages, p.N, p.K, p.H, jnp.dtype(p.dtype), generation=g)
    except ValueError as e:
      rows.append([g, f"error: {e}", *[None] * 12])
      continue
    # The planner's q block (tall: a prefill re-reads its pages once per q block) and the shortest legal one
    # (fewer steps of a prefill's rows; a decode computes its window either way).
    for label, bq in (("plan", bs.block_q), ("min", common.sublanes(jnp.dtype(p.dtype)))):
      ppb = bs.block_kv // ps
      dc, mx = (paged_step_cost(w, bq, ppb, ps, p, tiled) for w in (decode, mixed))
      t_proj, t_mixed = (max(c["flops"] / peak, c["bytes"] / bw) + c["steps"] * STEP_OVERHEAD_S for c in (dc, mx))
      t_bound = (dc["min_kv"] + 2 * len(decode) * p.N * p.H * p.itemsize) / bw
      rows.append([g, label, bq, ppb, dc["kv_bytes"] / MB, dc["kv_bytes"] / dc["min_kv"],
                   100 * min(p.G, rows_mxu) / rows_mxu, 100 / rows_mxu, dc["rows_per_useful"],
                   mx["flops"] / padded_flops(mixed, p),
                   t_proj * 1e6, t_bound * 1e6, t_bound / t_proj, t_mixed * 1e6])  # fmt: skip
  header = ["gen", "q blk", "bq", "pages/blk", "KV MB", "KV x min", "MXU grouped %", "ungrouped %", "rows/useful"]
  header += ["ragged/padded", "t_proj us", "HBM bound us", "bound/proj", "mixed us"]
  fmt = {"KV MB": ".1f", "KV x min": ".2f", "MXU grouped %": ".1f", "ungrouped %": ".1f", "ragged/padded": ".3f"}
  fmt |= {"t_proj us": ".1f", "HBM bound us": ".1f", "bound/proj": ".2f", "mixed us": ".1f", "rows/useful": ".1f"}
  report.table(
    f"Paged kernel (model): page {ps}, {args.paged_decodes} decodes with histories 64..{args.paged_history} (decode "
    f"step), the same + 2 prefills of {args.paged_prefill} (mixed step); N={p.N} K={p.K} H={p.H} {p.dtype}",
    header,
    rows,
    formats=fmt,
    notes=[
      "KV x min: K/V bytes the kernel copies / each live K/V byte once (tiled pages pad K to the sublanes; the v5e's",
      "compiled HLO, 2026-12-06, tiled bf16 [..., 8, 128] arrays (8, 128) with row pairs packed, without padding:",
      "--logical-bytes counts that way).",
      "MXU: useful rows of the decode QK^T matmul per MXU pass, grouped (G q heads of a kv head in one matmul) vs",
      "one q head; rows/useful: folded rows the decode's matmuls compute per useful row (its window: 8 rows for G",
      "= 4, so 2; before the window, bq).  ragged/padded: FLOPs of the",
      "mixed step vs a batch padded to the longest q and kv.  t_proj: decode step, max(FLOPs / peak, bytes / HBM) +",
      "grid-step overhead; HBM bound: live K/V + q/o once at HBM speed.  q blk: plan = plan_paged_block_sizes, min =",
      "one sublane tile.",
    ],
  )


# ------------------------------------------------------------------------------------------
# Context-parallel decode (`paged_attention(..., mesh=, seq_axis=)`): the cache's pages spread over n devices.

# One decode step of one layer: a 1M-token context of a GQA model (8 kv heads of 128, 64 q heads, bf16), merged
# over T_q decode rows (e.g. 64 sequences).
CP_DECODE = dict(S=2**20, T_q=64, N=64, K=8, H=128, dtype="bfloat16")
CP_DEVICES = (8, 16, 32, 64)
CP_GENERATIONS = ("v5e", "v5p", "v6e")


@dataclasses.dataclass(frozen=True)
class CPDecode:
  """One device's share of a context-parallel decode step (model): read its 1/n of the KV pages from HBM, then the
  exact merge over the axis, a ring all-reduce (psum of [T_q, N, H + 1] f32) and a pmax of [T_q, N] f32."""

  gen: str
  n: int
  kv_bytes: float  # K and V bytes this device reads (its 1/n of the pages)
  t_kv: float  # kv_bytes / HBM bandwidth
  merge_bytes: float  # the psum's and the pmax's payloads together
  link: float | None  # one ICI link, one way; None where the table has none
  t_merge_bw: float | None  # what each device sends in the two all-reduces, over `link`
  latency: float | None  # the table's assumed seconds per collective step (None where it gives none)

  @property
  def t_step(self) -> float:
    """HBM read, then the merge at link bandwidth (no latency: the table gives it for some generations only)."""
    return self.t_kv + (self.t_merge_bw or 0.0)

  @property
  def merge_share(self) -> float | None:
    return None if self.t_merge_bw is None else self.t_merge_bw / self.t_step

  @property
  def t_merge_lat(self) -> float | None:
    """The merge with the table's assumed latency per step: a ring all-reduce is 2 (n - 1) steps, two of them."""
    if self.t_merge_bw is None or self.latency is None:
      return None
    return self.t_merge_bw + 4 * (self.n - 1) * self.latency


def cp_decode_model(gen: str, n: int, *, S: int, T_q: int, N: int, K: int, H: int, dtype: str) -> CPDecode:
  """The step on device of `gen` in a slice of n: its KV bytes S K (H + H) itemsize / n at HBM speed, then the
  merge: a ring all-reduce sends 2 (n - 1) / n of its payload per device over one link (the pmax likewise)."""
  chip = hardware.tpu(gen)
  kv = S * K * 2 * H * cost.itemsize(dtype) / n
  f32 = cost.itemsize("float32")
  merge = T_q * N * (H + 1) * f32 + T_q * N * f32
  link = chip.ici_link
  t_bw = None if link is None else 2 * (n - 1) / n * merge / link
  return CPDecode(gen, n, kv, kv / chip.memory_bandwidth, merge, link, t_bw, chip.latency)


def cp_decode_table(report: Report, gens: Sequence[str], devices: Sequence[int] = CP_DEVICES) -> None:
  c = CP_DECODE
  rows = []
  for g in gens:
    for n in devices:
      m = cp_decode_model(g, n, **c)
      rows.append([g, n, m.kv_bytes / GIB, m.t_kv * 1e3, m.merge_bytes / MB, m.link and m.link / GB,
                   m.t_merge_bw and m.t_merge_bw * 1e6, m.t_step * 1e3, m.merge_share and 100 * m.merge_share,
                   m.t_merge_lat and m.t_merge_lat * 1e6])  # fmt: skip
  kv_total = c["S"] * c["K"] * 2 * c["H"] * cost.itemsize(c["dtype"])
  report.table(
    f"Context-parallel decode (MODEL): one layer's step, {c['S']:,}-token context ({kv_total / GIB:.0f} GiB of K/V), "
    f"K={c['K']} H={c['H']} N={c['N']} {c['dtype']}, merge over T_q={c['T_q']} rows",
    ["gen", "n", "KV GiB/dev", "HBM ms", "merge MB", "link GB/s", "merge us", "step ms", "merge %", "merge+lat us"],
    rows,
    formats={"KV GiB/dev": ".3f", "HBM ms": ".3f", "merge MB": ".2f", "link GB/s": ".0f", "merge us": ".1f"}
    | {"step ms": ".3f", "merge %": ".1f", "merge+lat us": ".0f"},
    notes=[
      "Model-derived, not measured.  Each device reads its 1/n of the K/V pages at HBM bandwidth; then the exact",
      "merge: a psum of [T_q, N, H + 1] f32 and a pmax of [T_q, N] f32, each a ring all-reduce sending 2 (n - 1) / n",
      "of its payload over one ICI link (one direction; a torus's other links would shorten it).  step = HBM +",
      "merge, merge % = merge / step, both at link bandwidth only; 'merge+lat' adds 2 (n - 1) steps per all-reduce",
      "at the hardware table's assumed per-step latency where it gives one (v5e, v5p: 10 us, an assumption of the",
      "advisor's model); where 'merge+lat' exceeds 'HBM ms' the latency of the collective, not the read, bounds",
      "the step.  Ignores q, compute and overlap.  Per layer: a 32-layer model reads 32x the K/V.",
    ],
  )


# ------------------------------------------------------------------------------------------
# Ring prefill (`paged_ring_prefill`): a prompt chunk sharded over n devices, q passed around the ring (pass-Q).

# One layer's prefill of a T-token prompt chunk that extends C cached tokens of the same GQA model (chunked
# prefill of a 1M-token context: the last chunk sees the most), bf16.
CP_PREFILL = dict(T=2**15, N=64, K=8, H=128, dtype="bfloat16")
CP_PREFILL_CONTEXTS = (0, 2**19, 2**20 - 2**15)


@dataclasses.dataclass(frozen=True)
class CPPrefillHop:
  """One hop of the ring prefill on one device (model): the visiting q shard [T / n, N, H] against this device's
  1/n of the context (compute), and what a hop sends: pass-Q (q and the f32 accumulator [T / n, N, H + 1], what
  `paged_ring_prefill` does) against pass-KV (this device's K/V of the context and of the chunk)."""

  gen: str
  n: int
  C: int
  flops: float  # one hop's useful FLOPs on one device: the call's total / n^2 (a balanced layout)
  t_compute: float  # at the working (bf16) peak
  q_bytes: float  # pass-Q: q [T / n, N, H] + accumulator [T / n, N, H + 1] f32
  kv_bytes: float  # pass-KV: K and V of (C + T) / n tokens
  link: float | None

  @property
  def t_q(self) -> float | None:
    return None if self.link is None else self.q_bytes / self.link

  @property
  def t_kv(self) -> float | None:
    return None if self.link is None else self.kv_bytes / self.link


def cp_prefill_model(gen: str, n: int, C: int, *, T: int, N: int, K: int, H: int, dtype: str) -> CPPrefillHop:
  """Useful FLOPs of the chunk: 4 N H T (C + (T + 1) / 2) (its rows see the C cached tokens and the causal half
  of the chunk, two matmuls of 2 FLOPs per pair), spread evenly over n devices and n hops."""
  chip = hardware.tpu(gen)
  pairs = T * C + T * (T + 1) / 2
  flops = 4.0 * N * H * pairs / (n * n)
  item, f32 = cost.itemsize(dtype), cost.itemsize("float32")
  q_bytes = T / n * N * (H * item + (H + 1) * f32)
  kv_bytes = (C + T) / n * K * 2 * H * item
  return CPPrefillHop(gen, n, C, flops, flops / chip.peak_flops(), q_bytes, kv_bytes, chip.ici_link)


def cp_prefill_table(report: Report, gens: Sequence[str], devices: Sequence[int] = CP_DEVICES) -> None:
  c = CP_PREFILL
  rows = []
  for g in gens:
    for n in devices:
      for C in CP_PREFILL_CONTEXTS:
        m = cp_prefill_model(g, n, C, **c)
        rows.append([g, n, C, m.flops / 1e9, m.t_compute * 1e6, m.q_bytes / MB, m.t_q and m.t_q * 1e6,
                     m.kv_bytes / MB, m.t_kv and m.t_kv * 1e6])  # fmt: skip
  report.table(
    f"Ring prefill (MODEL): one hop of one layer, a {c['T']:,}-token prompt chunk after C cached tokens, "
    f"K={c['K']} H={c['H']} N={c['N']} {c['dtype']}",
    ["gen", "n", "C", "GFLOP/hop", "compute us", "pass-Q MB", "pass-Q us", "pass-KV MB", "pass-KV us"],
    rows,
    formats={"GFLOP/hop": ".1f", "compute us": ".0f", "pass-Q MB": ".1f", "pass-Q us": ".0f"}
    | {"pass-KV MB": ".1f", "pass-KV us": ".0f"},
    notes=[
      "Model-derived, not measured.  A hop: each device's q shard (T / n rows) against the visited device's 1/n of",
      "the C + T tokens, the call's useful FLOPs / n^2 at the bf16 peak.  pass-Q (what paged_ring_prefill sends):",
      "q [T / n, N, H] and the f32 accumulator [T / n, N, H + 1]; pass-KV: that device's K and V of (C + T) / n",
      "tokens; both over one ICI link one way.  A hop's send hides behind its compute when 'us' <= 'compute us'.",
      "pass-Q's traffic does not grow with C; pass-KV's does: it wins for a fresh GQA prompt (C = 0) and loses",
      "once the cached context is long.  Ignores HBM traffic, latency and the compaction's page-table work.",
    ],
  )


# ------------------------------------------------------------------------------------------
# Timing on an attached TPU.


def time_on_tpu(report: Report, args, p: Problem, tiled: bool) -> None:
  """ring_attention(implementation="pallas_tpu") as a ring of one at each shard length vs jax.nn's attention:
  checked against each other first (a mismatch exits 1), then timed interleaved, next to this model's roofline."""
  if jax.default_backend() != "tpu":
    backend = jax.default_backend()
    report.note(
      f"\nNo TPU attached (default backend: {backend}); kernels not timed, all numbers above are model-derived."
    )
    return
  gen = planner.current_generation()
  if gen not in GENERATIONS:
    report.note(f"\nTPU generation {gen!r} is not one of {GENERATIONS}; kernels not timed.")
    return
  peak, bw = walk.rates(gen)
  one = dataclasses.replace(p, n=1)
  rows = []
  for T in args.seq_lens:
    L = T // p.n
    q, k, v, do = DEFAULTS.replace(B=p.B, T=L, N=p.N, K=p.K, H=p.H, dtype=p.dtype).inputs(0)
    for mask in args.masks:
      if mask == "causal-lb":
        continue  # a ring of one has no layout to balance
      spec, _ = walk.mask_setup(mask, p.window)
      kw = dict(is_causal=spec.is_causal, local_window_size=spec.window)
      roof = {}
      for pas in PASSES:
        bq, bk = walk.tiles(gen, L, one)[pas]
        tab, pairs = walk.ring_tables(mask, p.window, 1, L, bq, bk), walk.visible_pairs(mask, p.window, 1, L)
        costs = [walk.kernel_cost(kn, tab, pairs, one, L, bq, bk, tiled) for kn in PASSES[pas]]
        roof[pas] = (sum(float(np.maximum(c.flops / peak, c.bytes / bw).sum()) for c in costs),
                     sum(float(c.useful.sum()) for c in costs))  # fmt: skip
      impls = {"pallas": lambda q, k, v, kw=kw: fr.ring_attention(q, k, v, implementation="pallas_tpu", **kw)}
      if p.B * p.N * L * L * 4 <= args.xla_max_gib * GIB:  # XLA materialises the f32 scores
        impls["xla"] = lambda q, k, v, kw=kw: jax.nn.dot_product_attention(q, k, v, **kw)
      fns = {(pas, name): (jax.jit(f), (q, k, v)) if pas == "fwd" else (make_fwd_bwd(f), (q, k, v, do))
             for pas in ("fwd", "fwd+bwd") for name, f in impls.items()}  # fmt: skip
      if "xla" in impls:  # the check before timing: the kernel against XLA's attention, output and gradients
        got, want = (fns["fwd+bwd", name][0](*fns["fwd+bwd", name][1]) for name in ("pallas", "xla"))
        report.require([compare(f"pallas_tpu vs xla, L={L} {mask}", got, want, tol=2e-2, metric="rel_max")])
      times = time_interleaved({key: functools.partial(f, *a) for key, (f, a) in fns.items()}, args.repeats)
      for pas in ("fwd", "fwd+bwd"):
        t_roof = roof["fwd"][0] + (roof["bwd"][0] if pas == "fwd+bwd" else 0.0)
        useful = roof["fwd"][1] + (roof["bwd"][1] if pas == "fwd+bwd" else 0.0)
        t_pal, t_xla = median(times[pas, "pallas"]), median(times.get((pas, "xla"), []))
        ratio = paired_ratio(times[pas, "xla"], times[pas, "pallas"]).ratio if t_xla else None
        rows.append([L, mask, pas, t_pal * 1e3, t_roof * 1e3, 100 * t_roof / t_pal, useful / t_pal / 1e12,
                     t_xla and t_xla * 1e3, ratio])  # fmt: skip
  report.table(
    f"Measured on this TPU ({jax.devices()[0].device_kind}, generation {gen!r}): ring_attention(implementation="
    f"'pallas_tpu') as a ring of one vs jax.nn.dot_product_attention, interleaved, median of {args.repeats}",
    ["L", "mask", "pass", "pallas ms", "roof ms", "%roof", "TF/s useful", "xla ms", "xla/pallas (paired)"],
    rows,
    formats={"%roof": ".1f", "TF/s useful": ".1f", "xla/pallas (paired)": ".2f"},
    notes=["'roof' = this model for exactly that call; xla '-' where its f32 scores exceed --xla-max-gib."],
  )


# ------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add = parser.add_argument
  add("--generations", default=",".join(GENERATIONS), help="comma-separated, of " + ",".join(GENERATIONS))
  add("--seq-lens", default=None, help=f"global T, comma-separated (default {DEFAULT_SEQ_LENS})")
  add("--ring-size", type=int, default=8, help="devices n in the ring; the shard length is T / n")
  add("--masks", default=",".join(ALL_MASKS), help="comma-separated, of " + ",".join(ALL_MASKS))
  add("--window", type=int, default=4096, help="left window of the 'window' mask (causal, right 0)")
  add("--batch", type=int, default=DEFAULTS.B)
  add("--num-heads", type=int, default=DEFAULTS.N)
  add("--num-kv-heads", type=int, default=DEFAULTS.K)
  add("--head-dim", type=int, default=DEFAULTS.H)
  add("--dtype", choices=("bfloat16", "float32"), default=DEFAULTS.dtype)
  add("--logical-bytes", action="store_true", help="count bare element bytes per block, not the HBM tiles it spans")
  add("--repeats", type=int, default=10, help="timed rounds per call on a TPU (median)")
  add("--xla-max-gib", type=float, default=4.0, help="on a TPU, time jax.nn's attention if its f32 scores fit this")
  add("--quick", action="store_true", help=f"tiny run (T={QUICK_SEQ_LENS}), a few seconds")
  add("--page-size", type=int, default=16, help="paged kernel: tokens per page")
  add("--paged-decodes", type=int, default=64, help="paged kernel: decode sequences per step")
  add("--paged-history", type=int, default=4096, help="paged kernel: longest decode history")
  add("--paged-prefill", type=int, default=512, help="paged kernel: new tokens per prefill")
  add_report_args(parser)
  args = parser.parse_args(argv)
  args.generations = [g.strip() for g in args.generations.split(",") if g.strip()]
  args.masks = [m.strip() for m in args.masks.split(",") if m.strip()]
  for g in args.generations:
    if g not in GENERATIONS:
      parser.error(f"unknown generation {g!r}; known: {GENERATIONS}")
  for m in args.masks:
    if m not in ALL_MASKS:
      parser.error(f"unknown mask {m!r}; known: {ALL_MASKS}")
  if args.seq_lens is None:
    args.seq_lens = list(QUICK_SEQ_LENS if args.quick else DEFAULT_SEQ_LENS)
  else:
    args.seq_lens = [int(s) for s in args.seq_lens.split(",") if s.strip()]
  for T in args.seq_lens:
    if T % (2 * args.ring_size):
      parser.error(f"T={T} must be a multiple of 2 * ring size ({2 * args.ring_size}) for the zigzag layout")
  if args.num_heads % args.num_kv_heads:
    parser.error("--num-heads must be a multiple of --num-kv-heads")
  return args


def main(argv: Sequence[str] | None = None) -> int:
  args = parse_args(argv)
  t0 = time.perf_counter()
  tiled = not args.logical_bytes
  p = Problem(args.batch, args.num_heads, args.num_kv_heads, args.head_dim, args.dtype, args.ring_size, args.window)
  walk.self_check(tiled)
  counted = "(sublane, 128) tiles" if tiled else "bare elements"
  meta = {"problem": f"B={p.B} N={p.N} K={p.K} (G={p.G}) H={p.H} {p.dtype}, ring of n={p.n}"}
  meta |= {"HBM bytes counted as": counted, "self-check vs the kernels' index maps": "ok"}
  title = "TPU roofline model of the Pallas ring-attention kernels (MODEL-DERIVED numbers, not measurements)"
  report = Report(title, json=args.json, meta=meta)
  hardware_table(report, args.generations)
  tiles_table(report, args.generations, args.seq_lens, p)
  results = {}
  for g in args.generations:
    for T in args.seq_lens:
      for mask in args.masks:
        for pas in PASSES:
          try:
            results[g, T, mask, pas] = walk.evaluate(g, T, mask, pas, p, tiled)
          except ValueError as e:
            empty = ((0, 0), 0, (0, 0), *(0,) * 10, np.zeros(0))
            results[g, T, mask, pas] = PassResult(g, T, T // p.n, mask, pas, *empty, error=str(e))
  report.table(
    "Per pass, one device's whole ring (sum over its n hops); TFLOP .. t_dev: the busiest device",
    PASS_HEADER,
    [pass_row(r) for r in results.values()],
    formats=PASS_FORMATS,
    notes=[
      "masks: full, causal, causal-lb = causal on the zigzag layout (load_balance=True), window = causal with a",
      f"{p.window}-token left window.  skip% = EMPTY tiles over all devices and hops (dev: per-device min-max);",
      "useful% = FLOPs on visible pairs / FLOPs of the non-EMPTY tiles; dead GB = DMAs no computing step needs;",
      "t_ring = sum over hops of the slowest device's hop; imbal = busiest device's FLOPs / the mean's.  bwd = dq",
      "kernel + dk/dv kernel.",
    ],
  )
  ici_masks = [m for m in ("full", "causal-lb") if m in args.masks] or args.masks[:1]
  ici_table(report, results, args.generations, args.seq_lens, ici_masks, p)
  paged_table(report, args.generations, p, args, tiled)
  mla_table(report, args.generations, args.seq_lens, p, tiled)
  kernel_ring_table(report, args.generations, p)
  kernel_ring_hbm_table(report, args.generations, p, tiled)
  cp_decode_table(report, [g for g in CP_GENERATIONS if g in args.generations])
  cp_prefill_table(report, [g for g in CP_GENERATIONS if g in args.generations])
  time_on_tpu(report, args, p, tiled)
  report.progress(f"(model run took {time.perf_counter() - t0:.1f} s)")
  return report.finish()


if __name__ == "__main__":
  sys.exit(main())

"""Time tile choices of the Pallas TPU kernels on this chip and write a table the planners read.

  python -m flax_ringattn.tune block --shape 8192,8,8,128 --shape 8192,16,16,64 --causal --out v5e.json
  python -m flax_ringattn.tune paged --decode 64x4096 --heads 32,8,128 --page-size 16 --merged --out v5e.json

Each shape's candidates (tiles the planner's rules accept: legal, within the chip's VMEM budget) are timed as a
model calls the op: `ring_attention` on one device (forward, then forward + backward for the backward's tiles) or
`paged_attention` on a synthetic decode batch; the fastest goes into the table, under the key the planner looks
up.  `register(path)` (or `planners.tuned.using`) makes a table count in this process; the package ships one per
generation it was tuned on (`_src/backends/pallas_tpu/planners/tables/`).  A table only changes tiles, never
results: the kernels compute the same attention at any legal tile, within rounding.  Plans are read when a
function is traced: register a table before the first call of a jitted step.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import flax_ringattn as fr
from flax_ringattn._src.backends.pallas_tpu import paged, planners
from flax_ringattn._src.options import ProblemShape
from flax_ringattn._src.perf.harness import median, time_interleaved

register = planners.tuned.register
using = planners.tuned.using

BLOCK_TILES = (256, 512, 1024, 2048)
PAGED_Q = (8, 16, 32, 64)
PAGED_KV = (256, 512, 1024, 2048)


@dataclasses.dataclass(frozen=True)
class BlockShape:
  """One block-kernel problem: q [1, T, N, H], k / v [1, T, K, H] in `dtype`, causal or not."""

  T: int
  N: int
  K: int
  H: int
  dtype: str = "bfloat16"
  causal: bool = True

  def problem(self) -> ProblemShape:
    return ProblemShape(q_len=self.T, kv_len=self.T, num_heads=self.N, num_kv_heads=self.K, head_dim=self.H,
                        dtype=jnp.dtype(self.dtype))  # fmt: skip


def _accepted(shape: ProblemShape, generation: str, fwd, bwd, fused_bwd=None) -> bool:
  """Whether the planner would take these tiles (and this backward kernel choice) from a table (`block._tuned`)."""
  blocks = _blocks(fwd, bwd, fused_bwd)
  entry = dict(block_q=fwd[0], block_kv=fwd[1], block_q_bwd=bwd[0], block_kv_bwd=bwd[1], fused_bwd=fused_bwd)
  table = {"generation": generation, "entries": {planners.tuned.block_key(shape): entry}}
  with using(table):
    return planners.plan_block_sizes_for(shape, generation=generation) == blocks


def _blocks(fwd, bwd, fused_bwd=None) -> fr.BlockSizes:
  return fr.BlockSizes(block_q=fwd[0], block_kv=fwd[1], block_q_bwd=bwd[0], block_kv_bwd=bwd[1], fused_bwd=fused_bwd)


def _fastest(calls: dict, repeats: int) -> tuple[object, dict]:
  times = time_interleaved({str(k): functools.partial(f) for k, f in calls.items()}, repeats, warmup=1)
  ms = {k: median(v) * 1e3 for k, v in times.items() if v}
  best = min(ms, key=ms.get)
  return next(k for k in calls if str(k) == best), ms


def tune_block(shapes: Sequence[BlockShape], *, tiles=BLOCK_TILES, repeats: int = 5, interpret=None) -> dict:
  """A table of the fastest forward, then backward, tiles of each shape (candidates: `tiles` x `tiles` that the
  planner accepts; the backward's each as the fused kernel and as two, its `fused_bwd`); each entry also records
  the medians it was chosen on (ms)."""
  generation = planners.current_generation()
  entries = {}
  for s in shapes:
    shape = s.problem()
    model = planners.plan_block_sizes_for(shape, generation=generation)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (1, s.T, s.N, s.H), shape.dtype)
    k, v = (jax.random.normal(x, (1, s.T, s.K, s.H), shape.dtype) for x in keys[1:])
    op = functools.partial(fr.ring_attention, is_causal=s.causal, implementation="pallas_tpu", interpret=interpret)

    def fwd_call(blocks, op=op):
      return jax.jit(functools.partial(op, block_sizes=blocks))

    def grad_call(blocks, op=op):
      loss = lambda a, b, c: op(a, b, c, block_sizes=blocks).astype(jnp.float32).sum()  # noqa: E731
      return jax.jit(jax.grad(loss, (0, 1, 2)))

    pairs = [(bq, bk) for bq in tiles for bk in tiles]
    fwd_ok = [t for t in pairs if _accepted(shape, generation, t, model.bwd)]
    calls = {t: functools.partial(fwd_call(_blocks(t, model.bwd)), q, k, v) for t in fwd_ok}
    fwd, fwd_ms = _fastest(calls, repeats) if calls else ((model.block_q, model.block_kv), {})
    # The backward's candidates: each tile as the fused kernel and as the dq + dk/dv kernels (`BlockSizes.fused_bwd`)
    bwd_ok = [(t, f) for t in pairs for f in (True, False) if _accepted(shape, generation, fwd, t, f)]
    calls = {(t, f): functools.partial(grad_call(_blocks(fwd, t, f)), q, k, v) for t, f in bwd_ok}
    (bwd, fused), bwd_ms = _fastest(calls, repeats) if calls else ((model.bwd, model.fused_bwd), {})
    entries[planners.tuned.block_key(shape)] = dict(
      block_q=fwd[0],
      block_kv=fwd[1],
      block_q_bwd=bwd[0],
      block_kv_bwd=bwd[1],
      fused_bwd=fused,
      fwd_ms=fwd_ms,
      bwd_ms=bwd_ms,
    )
  return {"generation": generation, "jax": jax.__version__, "entries": entries}


def tune_paged(
  *,
  num_seqs: int,
  kv_len: int,
  heads: tuple[int, int, int],
  page_size: int = 16,
  dtype: str = "bfloat16",
  merged: bool | str = False,
  q_blocks=PAGED_Q,
  kv_blocks=PAGED_KV,
  repeats: int = 5,
  interpret=None,
) -> dict:
  """A table entry for one decode batch (`num_seqs` sequences of `kv_len` tokens, one new token each) with
  `heads` = (N, K, H): the fastest (block_q, block_kv) that the planner accepts.  `merged`: False (pages
  [P, page, K, H]), True ([P, page, K * H]) or "kv" (kv pages [P, 2, page, K * H], which share merged pages' key)."""
  N, K, H = heads
  generation = planners.current_generation()
  pps = -(-kv_len // page_size)
  P = num_seqs * pps
  rng = np.random.default_rng(0)
  table = rng.permutation(P).reshape(num_seqs, pps).astype(np.int32)
  dt = jnp.dtype(dtype)
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (num_seqs, N, H), dt)
  if merged == "kv":  # kv pages [P, 2, page, K * H]: one array, v_pages None (planned as merged pages are)
    k, v = jax.random.normal(keys[1], (P, 2, page_size, K * H), dt), None
  else:
    page = (P, page_size, K * H) if merged else (P, page_size, K, H)
    k, v = (jax.random.normal(x, page, dt) for x in keys[1:])
  meta = [jnp.full((num_seqs,), kv_len, jnp.int32), jnp.asarray(table)]
  meta += [jnp.arange(num_seqs + 1, dtype=jnp.int32), jnp.asarray([num_seqs], jnp.int32)]
  f, _ = paged.lane_groups(q, k, v, None, None)
  plan_heads = (N, K // f, H * f)
  merged = bool(merged)  # kv pages buffer as merged ones do: one key
  key = planners.tuned.paged_key(num_seqs, page_size, pps, *plan_heads, None, dt, dt, (0, 0), False, False, merged)
  calls = {}
  for bq in q_blocks:
    for bkv in sorted({min(b, pps * page_size) for b in kv_blocks}):  # at most a sequence's pages
      if bkv % page_size:
        continue
      entry = {"block_q": bq, "block_kv": bkv}
      with using({"generation": generation, "entries": {key: entry}}):
        got = planners.plan_paged_block_sizes(num_seqs, page_size, pps, *plan_heads, dt, merged=merged)
      if (got.block_q, got.block_kv) != (bq, bkv):
        continue  # not accepted: illegal or over the VMEM budget
      blocks = fr.BlockSizes(block_q=bq, block_kv=bkv)
      fn = jax.jit(functools.partial(fr.paged_attention, block_sizes=blocks, implementation="pallas_tpu",
                                     interpret=interpret))  # fmt: skip
      calls[(bq, bkv)] = functools.partial(fn, q, k, v, *meta)
  if not calls:
    return {"generation": generation, "jax": jax.__version__, "entries": {}}
  (bq, bkv), ms = _fastest(calls, repeats)
  return {
    "generation": generation,
    "jax": jax.__version__,
    "entries": {key: {"block_q": bq, "block_kv": bkv, "ms": ms}},
  }


def merge(*tables: dict) -> dict:
  """One table of several of the same generation (later entries win)."""
  if len({t["generation"] for t in tables}) > 1:
    raise ValueError(f"tables of different generations: {sorted({t['generation'] for t in tables})}")
  entries = {}
  for t in tables:
    entries.update(t["entries"])
  return {"generation": tables[0]["generation"], "jax": jax.__version__, "entries": entries}


def _ints(text: str, sep: str = ",") -> list[int]:
  return [int(x) for x in text.split(sep)]


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("kernel", choices=("block", "paged"))
  parser.add_argument("--shape", action="append", default=[], help="block: T,N,K,H (repeat for more shapes)")
  parser.add_argument("--full", action="store_true", help="block: not causal")
  parser.add_argument("--causal", action="store_true", help="block: causal (the default)")
  parser.add_argument("--decode", action="append", default=[], help="paged: SEQSxKV_LEN, e.g. 64x4096")
  parser.add_argument("--heads", default="32,8,128", help="paged: N,K,H")
  parser.add_argument("--page-size", type=int, default=16)
  parser.add_argument("--merged", action="store_true", help="paged: merged pages [P, page, K * H]")
  parser.add_argument("--kv-pages", action="store_true", help="paged: kv pages [P, 2, page, K * H]")
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--repeats", type=int, default=5)
  parser.add_argument("--interpret", action="store_true", help="Pallas TPU interpret mode (CPU; times mean nothing)")
  parser.add_argument("--out", required=True, help="the table to write (merged into it if it exists)")
  args = parser.parse_args(argv)
  interpret = True if args.interpret else None
  if args.kernel == "block":
    if not args.shape:
      parser.error("block: give at least one --shape T,N,K,H")
    shapes = [BlockShape(*_ints(s), dtype=args.dtype, causal=not args.full) for s in args.shape]
    tables = [tune_block(shapes, repeats=args.repeats, interpret=interpret)]
  else:
    if not args.decode:
      parser.error("paged: give at least one --decode SEQSxKV_LEN")
    heads = tuple(_ints(args.heads))
    tables = [
      tune_paged(num_seqs=n, kv_len=kv, heads=heads, page_size=args.page_size, dtype=args.dtype,
                 merged="kv" if args.kv_pages else args.merged, repeats=args.repeats, interpret=interpret)
      for n, kv in (_ints(d, "x") for d in args.decode)
    ]  # fmt: skip
  out = Path(args.out)
  if out.exists():
    tables.insert(0, planners.tuned.check_table(out))
  table = merge(*tables)
  out.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
  for key, entry in table["entries"].items():
    print(f"{key}: { ({k: v for k, v in entry.items() if not k.endswith('ms')}) }")
  return 0


if __name__ == "__main__":
  sys.exit(main())

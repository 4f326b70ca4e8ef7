"""Serving-step throughput of ragged paged attention vs. padded layouts, on one CPU device.

What it measures
----------------
One mixed serving step -- 2 prefills of 512 new tokens (no history) and 30
decodes (1 new token) whose histories are spread evenly over 64..2048 tokens
(``--spread random`` draws them with ``--seed``) -- with GQA 8 q heads : 2 kv
heads, head_dim 128, page_size 16, float32 (``--dtype bfloat16`` for bf16).
Forward only, every call jitted; tokens/s counts the *real* new tokens of the
step (1054 here), whatever the layout pads them to.  Layouts, all with the same
op (``flax_ringattn.paged_attention``, the same ``block_sizes``) and the same
page pool, timed interleaved (the order rotates every repeat), median of
``--repeats``:

* ``ragged``: one call on the ragged batch: q [1054, 8, 128], 32 sequences,
  each with its true q_len and kv_len.
* ``(a) padded``: one call where every sequence is padded to the longest
  new-token count and the longest history: 32 x 512 q rows, kv_len = 2048 +
  512 for all, page tables of 160 pages (own pages, then filler pages).  This
  is the padded multi-query paged attention the ragged design replaced; the
  same op isolates the layout (kernel, block skipping and gathers identical).
  ``(a')`` (info) pads only q: 512 rows, kv_len = own history + 512.
* ``(b) split``: a prefill call (2 x 512 rows, kv_len 512) plus a decode call
  (30 x 1 row, kv_len padded to the longest history + 1 = 2049).

A decode-only step (the same 30 decodes) compares ``ragged`` with (b)'s padded
decode call.  Two more checks:

* compile count: a jitted ragged call over ``--compile-steps`` (200) random
  batches of the mixed step's static shapes; a Python counter inside the
  jitted function counts traces (target 1).
* KV memory utilisation: a ``PagedKVCache`` with exactly the pages the workload
  needs, filled with the histories and then the step's new tokens;
  ``utilization()`` against the expected value (only last pages are partial).

Before timing, the ragged outputs are checked against
``flax_ringattn.paged_reference_attention`` (all decode rows, and the last 64
rows of a prefill); a wrong result exits 1 before anything is timed.
``--sweep`` adds a table of block sizes (ragged mixed and decode steps, and the
split baseline at the same sizes).  Timing, paired ratios, the check and the
report (Markdown, or ``--json``) are ``flax_ringattn.benchmarking``'s; the
heads are its ``paged_step`` problem set.

Run it::

  python benchmarks/paged_throughput.py --quick          # smoke size, < 30 s
  python benchmarks/paged_throughput.py                  # the step above
  python benchmarks/paged_throughput.py --dtype bfloat16 --block-q 8 --block-kv 256
  python benchmarks/paged_throughput.py --sweep --repeats 3

CPU timings on a shared machine are noisy (the machine line prints the load
average); compare the ratios, paired medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

try:
  import flax_ringattn  # noqa: F401 -- installed, or this checkout (below)
except ImportError:  # running from a checkout that is not installed
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flax_ringattn import BlockSizes, PagedKVCache, paged_attention, paged_reference_attention
from flax_ringattn import benchmarking as bench
from flax_ringattn.benchmarking import median, paired_ratio, time_interleaved

# Exit status (`benchmarking.Report.finish`): 0 = outputs correct and every target met (with --quick: outputs
# correct); 1 = the ragged output differs from paged_reference_attention (nothing is timed); 3 = a target missed.
EXIT_WRONG_RESULT, EXIT_TARGET_MISSED = bench.EXIT_WRONG_RESULT, bench.EXIT_TARGET_MISSED

HEADS = bench.PROBLEM_SETS["paged_step"][0]
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = HEADS.N, HEADS.K, HEADS.H
PAGE_SIZE = 16
LIBRARY_DEFAULT_BLOCKS = (16, 128)  # flax_ringattn's paged default (block_q, block_kv)
SWEEP_BLOCK_Q = "1,4,8,16,32,64"
SWEEP_BLOCK_KV = "64,128,256,512"
TARGET_VS_PADDED = 5.0
TARGET_VS_SPLIT = 1.0
TARGET_DECODE = 1.5
TARGET_UTILISATION = 0.95


# ------------------------------------------------------------------------------------------
# Workload and batch layouts.


@dataclasses.dataclass(frozen=True)
class Workload:
  """The sequences of one serving step: prefills (no history) then decodes."""

  prefill_lens: tuple[int, ...]
  decode_hists: tuple[int, ...]  # cached tokens before this step's one new token

  @property
  def q_lens(self) -> np.ndarray:
    return np.array(self.prefill_lens + (1,) * len(self.decode_hists), np.int64)

  @property
  def kv_lens(self) -> np.ndarray:
    return np.array(self.prefill_lens + tuple(h + 1 for h in self.decode_hists), np.int64)

  @property
  def num_seqs(self) -> int:
    return len(self.prefill_lens) + len(self.decode_hists)

  @property
  def num_prefills(self) -> int:
    return len(self.prefill_lens)

  @property
  def new_tokens(self) -> int:
    return int(self.q_lens.sum())


def make_workload(args: argparse.Namespace) -> Workload:
  lo, hi = args.min_history, args.max_history
  if args.spread == "even":
    hists = np.linspace(lo, hi, args.decodes).round().astype(int)
  else:
    hists = np.random.default_rng(args.seed).integers(lo, hi + 1, args.decodes)
  return Workload(prefill_lens=(args.prefill_len,) * args.prefills, decode_hists=tuple(int(h) for h in hists))


def pages_for(tokens) -> np.ndarray:
  return -(-np.asarray(tokens) // PAGE_SIZE)


@dataclasses.dataclass
class Batch:
  """Arguments of one paged_attention call, and the real new tokens it serves."""

  q: jax.Array
  kv_lens: jax.Array
  page_indices: jax.Array
  cu_q_lens: jax.Array
  num_seqs: jax.Array
  new_tokens: int
  rows: np.ndarray  # [S] q rows per sequence (the layout, padding included)
  kv: np.ndarray  # [S] kv_lens of the layout

  def args(self, pool: Pool) -> tuple:
    return (self.q, pool.k, pool.v, self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs)


@dataclasses.dataclass
class Pool:
  """The shared K/V pages and each sequence's own pages, in the workload's order."""

  k: jax.Array
  v: jax.Array
  owned: np.ndarray  # [num_seqs, max pages] page ids, -1 past a sequence's pages


def make_pool(work: Workload, dtype, rng: np.random.Generator) -> Pool:
  """Exactly the pages the workload needs, handed out in a shuffled (fragmented) order."""
  need = pages_for(work.kv_lens)
  num_pages = int(need.sum())
  perm = rng.permutation(num_pages)
  owned = np.full((work.num_seqs, int(need.max())), -1, np.int64)
  offsets = np.concatenate([[0], np.cumsum(need)])
  for i, n in enumerate(need):
    owned[i, :n] = perm[offsets[i] : offsets[i] + n]
  shape = (num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM)
  k = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  v = jnp.asarray(rng.standard_normal(shape, np.float32), dtype)
  return Pool(k=k, v=v, owned=owned)


def make_batch(
  pool: Pool,
  seqs: Sequence[int],
  q_rows: Sequence[int],
  kv_lens: Sequence[int],
  new_tokens: int,
  dtype,
  rng: np.random.Generator,
  *,
  pages_per_seq: int,
  q: np.ndarray | None = None,
) -> Batch:
  """A batch of the workload's sequences `seqs`, laid out with `q_rows` rows and `kv_lens`.

  Each row of the page table starts with the sequence's own pages; where a
  padded kv_len needs more, filler pages drawn from the pool follow (the padded
  layouts read them exactly like real pages).
  """
  num_pages = pool.k.shape[0]
  table = np.full((len(seqs), pages_per_seq), -1, np.int64)
  for row, s in enumerate(seqs):
    own = pool.owned[s][pool.owned[s] >= 0][:pages_per_seq]
    table[row, : len(own)] = own
    need = int(pages_for(kv_lens[row]))
    if need > len(own):
      table[row, len(own) : need] = rng.integers(0, num_pages, need - len(own))
  cu = np.concatenate([[0], np.cumsum(q_rows)])
  if q is None:
    q = rng.standard_normal((int(cu[-1]), NUM_Q_HEADS, HEAD_DIM), np.float32)
  as_i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)
  return Batch(
    q=jnp.asarray(q, dtype),
    kv_lens=as_i32(kv_lens),
    page_indices=as_i32(table),
    cu_q_lens=as_i32(cu),
    num_seqs=as_i32([len(seqs)]),
    new_tokens=new_tokens,
    rows=np.asarray(q_rows, np.int64),
    kv=np.asarray(kv_lens, np.int64),
  )


@dataclasses.dataclass
class Layouts:
  ragged: Batch
  padded: Batch
  padded_q: Batch
  split_prefill: Batch
  split_decode: Batch
  decode_ragged: Batch
  q_real: np.ndarray  # the ragged step's q (float32), for the reference check


def make_layouts(work: Workload, pool: Pool, dtype, rng: np.random.Generator) -> Layouts:
  S, n_pre = work.num_seqs, work.num_prefills
  q_lens, kv_lens = work.q_lens, work.kv_lens
  pps = int(pages_for(kv_lens.max()))
  pre, dec = list(range(n_pre)), list(range(n_pre, S))
  n_dec = len(dec)
  q_real = rng.standard_normal((work.new_tokens, NUM_Q_HEADS, HEAD_DIM), np.float32)

  def batch(seqs, rows, kv, new_tokens, pages_per_seq, q=None):
    return make_batch(pool, seqs, rows, kv, new_tokens, dtype, rng, pages_per_seq=pages_per_seq, q=q)

  ragged = batch(range(S), q_lens, kv_lens, work.new_tokens, pps, q=q_real)
  # (a) every sequence padded to the longest q_len and the longest history.
  max_q = int(q_lens.max())
  pad_kv = int((kv_lens - q_lens).max()) + max_q
  padded = batch(range(S), [max_q] * S, [pad_kv] * S, work.new_tokens, int(pages_for(pad_kv)))
  # (a') informational: q padded to the longest q_len, each sequence keeping its own history.
  padded_q = batch(range(S), [max_q] * S, kv_lens - q_lens + max_q, work.new_tokens, int(pages_for(pad_kv)))
  # (b) prefill group padded to its longest prompt, decode group to its longest history.
  pre_q = max(int(q_lens[pre].max()), 1) if pre else 1
  pre_kv = max(int(kv_lens[pre].max()), pre_q) if pre else 1
  split_prefill = batch(pre, [pre_q] * n_pre, [pre_kv] * n_pre, int(q_lens[pre].sum()), int(pages_for(pre_kv)))
  dec_kv = int(kv_lens[dec].max())
  dec_pps = int(pages_for(dec_kv))
  split_decode = batch(dec, [1] * n_dec, [dec_kv] * n_dec, n_dec, dec_pps)
  decode_ragged = batch(dec, [1] * n_dec, kv_lens[dec], n_dec, dec_pps, q=q_real[-n_dec:])
  return Layouts(ragged, padded, padded_q, split_prefill, split_decode, decode_ragged, q_real)


# ------------------------------------------------------------------------------------------
# Correctness check against the dense reference (small slices only: the reference
# gathers every sequence's pages for every row).


def reference_check(work: Workload, pool: Pool, lay: Layouts, attn: Callable, dtype) -> float:
  """Max |ragged - reference| over the decode rows and the last rows of prefill 0."""
  errs = []
  n_pre, n_dec = work.num_prefills, work.num_seqs - work.num_prefills
  out = np.asarray(attn(*lay.ragged.args(pool)), np.float32)
  if n_dec:
    d = lay.decode_ragged
    ref = np.asarray(paged_reference_attention(*d.args(pool)), np.float32)
    errs.append(np.abs(out[work.new_tokens - n_dec :] - ref).max())
    errs.append(np.abs(np.asarray(attn(*d.args(pool)), np.float32) - ref).max())
  if n_pre:
    L = work.prefill_lens[0]
    rows = min(64, L)
    own = pool.owned[0][pool.owned[0] >= 0]
    ref = paged_reference_attention(
      jnp.asarray(lay.q_real[L - rows : L], dtype),
      pool.k,
      pool.v,
      jnp.array([L], jnp.int32),
      jnp.asarray(own[None], jnp.int32),
      jnp.array([0, rows], jnp.int32),
      jnp.array([1], jnp.int32),
    )
    errs.append(np.abs(out[L - rows : L] - np.asarray(ref, np.float32)).max())
  return float(max(errs))


# ------------------------------------------------------------------------------------------
# Work model: score elements (q row x kv position, per q head) the op computes.


def useful_scores(work: Workload) -> int:
  """Score elements causal attention needs for the real new tokens (row at position p: p + 1)."""
  first = work.kv_lens - work.q_lens
  return int(sum((f + 1 + f + q) * q // 2 for f, q in zip(first, work.q_lens, strict=True)))


def executed_scores(b: Batch, block_q: int, block_kv: int) -> int:
  """Score elements the op computes for batch `b`, mirroring its schedule.

  Sequences with one new token get one-row chunks (the decode pass); the others
  chunks of min(block_q, T) rows (a short chunk still computes every row).
  Each chunk walks the kv blocks 0 .. (its last row's block).
  """
  T = int(b.rows.sum())
  pps = b.page_indices.shape[1]
  bq = min(block_q, T)
  pb = max(1, min(block_kv // PAGE_SIZE, pps))
  bt, max_blocks = pb * PAGE_SIZE, -(-pps // pb)
  total = 0
  for rows, kv in zip(b.rows, b.kv, strict=True):
    step = 1 if rows == 1 else bq
    for r0 in range(0, int(rows), step):
      last = kv - rows + min(r0 + step, rows) - 1
      total += step * min(last // bt + 1, max_blocks) * bt
  return total


# ------------------------------------------------------------------------------------------
# Timing (the harness's interleaved rounds).


def make_attn(block_q: int | None, block_kv: int | None) -> Callable:
  blocks = None
  if block_q is not None or block_kv is not None:
    dq, dkv = LIBRARY_DEFAULT_BLOCKS
    blocks = BlockSizes(block_q=block_q or dq, block_kv=block_kv or dkv)
  return jax.jit(functools.partial(paged_attention, block_sizes=blocks))


def step_calls(attn: Callable, pool: Pool, lay: Layouts, *, with_padded: bool) -> dict[str, Callable]:
  bound = lambda b: functools.partial(attn, *b.args(pool))
  calls = {
    "ragged": bound(lay.ragged),
    "split/prefill": bound(lay.split_prefill),
    "split/decode": bound(lay.split_decode),
    "decode/ragged": bound(lay.decode_ragged),
  }
  if with_padded:
    calls["padded"] = bound(lay.padded)
    calls["padded-q"] = bound(lay.padded_q)
  return calls


@dataclasses.dataclass
class StepTimes:
  ragged: list[float]
  padded: list[float] | None
  padded_q: list[float] | None
  split: list[float]  # prefill + decode of the same repeat
  decode_ragged: list[float]
  decode_padded: list[float]

  @classmethod
  def from_times(cls, t: dict[str, list[float]]) -> StepTimes:
    split = [a + b for a, b in zip(t["split/prefill"], t["split/decode"], strict=True)]
    return cls(t["ragged"], t.get("padded"), t.get("padded-q"), split, t["decode/ragged"], t["split/decode"])


# ------------------------------------------------------------------------------------------
# Compile count over a changing workload.


def random_step(rng, S, T, pps, num_pages, max_prefill) -> tuple[np.ndarray, ...]:
  """A random ragged batch with static shapes [T], [S], [S, pps]."""
  n = int(rng.integers(1, min(S, T) + 1))
  q_lens = np.ones(n, np.int64)
  prefill = rng.random(n) < 0.15
  budget = T - n  # rows left beyond one per sequence
  for i in np.flatnonzero(prefill):
    extra = min(int(rng.integers(0, max_prefill)), budget)
    q_lens[i] += extra
    budget -= extra
  hist = rng.integers(0, pps * PAGE_SIZE - q_lens + 1)
  hist[prefill & (rng.random(n) < 0.5)] = 0  # half the prefills start fresh
  kv = np.minimum(hist + q_lens, pps * PAGE_SIZE)
  need = pages_for(kv)
  ids = rng.choice(num_pages, int(need.sum()), replace=int(need.sum()) > num_pages)
  table = np.full((S, pps), -1, np.int64)
  offsets = np.concatenate([[0], np.cumsum(need)])
  for i in range(n):
    table[i, : need[i]] = ids[offsets[i] : offsets[i + 1]]
  kv_lens = np.zeros(S, np.int64)
  kv_lens[:n] = kv
  cu = np.concatenate([[0], np.cumsum(q_lens), np.full(S - n, q_lens.sum())])
  return kv_lens, table, cu, np.array([n])


def compile_count(attn_blocks: Callable, pool: Pool, work: Workload, steps: int, seed: int) -> tuple[int, float]:
  """(traces of the jitted ragged step over `steps` random batches, median step seconds)."""
  rng = np.random.default_rng(seed + 1)
  S, T = work.num_seqs, work.new_tokens
  pps = int(pages_for(work.kv_lens.max()))
  q = jnp.asarray(rng.standard_normal((T, NUM_Q_HEADS, HEAD_DIM), np.float32), pool.k.dtype)
  # Every round a new batch (drawn before timing); the first, untimed, compiles.
  metas = [random_step(rng, S, T, pps, pool.k.shape[0], max(work.prefill_lens, default=1)) for _ in range(steps)]
  calls = [(q, pool.k, pool.v, *(jnp.asarray(x, jnp.int32) for x in meta)) for meta in metas]
  traces, step_s = bench.count_compiles(attn_blocks, calls)
  return traces, float("nan") if step_s is None else step_s


# ------------------------------------------------------------------------------------------
# KV memory utilisation of PagedKVCache.


def cache_utilisation(work: Workload, dtype, seed: int) -> dict[str, float]:
  """Fill a PagedKVCache with the histories, then the step's new tokens; read utilisation."""
  kv = work.kv_lens
  need = int(pages_for(kv).sum())
  dims = dict(page_size=PAGE_SIZE, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=dtype)
  cache = PagedKVCache.create(
    num_pages=need, max_num_seqs=work.num_seqs, pages_per_seq=int(pages_for(kv.max())), **dims
  )
  rng = np.random.default_rng(seed + 2)
  append = jax.jit(lambda c, k, v, cu, n: c.append(k, v, cu, n))
  room = jax.jit(lambda c, lens: c.pages_needed(lens) <= c.num_free_pages())
  hist = kv - work.q_lens
  rows = int(max(hist.sum(), work.q_lens.sum()))
  for lens in (hist, work.q_lens):  # step 1: the histories; step 2: this step's new tokens
    assert bool(room(cache, jnp.asarray(lens, jnp.int32))), "cache too small"
    # Both steps use the same row count (rows past cu_q_lens[-1] are padding): one compile.
    x = rng.standard_normal((rows, NUM_KV_HEADS, HEAD_DIM), np.float32)
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    cache = append(cache, jnp.asarray(x, dtype), jnp.asarray(-x, dtype), cu, jnp.array([work.num_seqs], jnp.int32))
  assert np.array_equal(np.asarray(cache.kv_lens), kv), "kv_lens after append differ from the workload"
  allocated = int(np.sum(np.asarray(cache.ref_counts) > 0)) * PAGE_SIZE
  used = int(kv.sum())
  measured = float(jax.jit(lambda c: c.utilization())(cache))
  expected = used / (int(pages_for(kv).sum()) * PAGE_SIZE)
  return dict(measured=measured, expected=expected, used=used, allocated=allocated, waste=allocated - used)


# ------------------------------------------------------------------------------------------
# Report.


def fmt_tps(tokens: int, seconds: float) -> str:
  return f"{tokens / seconds:,.0f} tok/s ({seconds * 1e3:.1f} ms)"


def report_step(
  report: bench.Report, work: Workload, st: StepTimes, traces: int, steps: int, step_s: float, util: dict
) -> None:
  """The measurements and targets, as the report's targets table (info rows have no goal)."""
  n_dec, tok = work.num_seqs - work.num_prefills, work.new_tokens
  info = functools.partial(report.target, target="", met=None)
  info("mixed step: ragged (one call)", fmt_tps(tok, median(st.ragged)))
  if st.padded is not None:
    info("mixed step: (a) padded (one call)", fmt_tps(tok, median(st.padded)))
  info("mixed step: (b) split (prefill + decode calls)", fmt_tps(tok, median(st.split)))
  if st.padded is not None:
    r = paired_ratio(st.padded, st.ragged).ratio
    report.target("ragged vs (a) padded", f"{r:.1f}x", f">= {TARGET_VS_PADDED:g}x", r >= TARGET_VS_PADDED)
    r = paired_ratio(st.padded_q, st.ragged).ratio
    info("(info) ragged vs (a') padded q rows, true histories", f"{r:.1f}x ({fmt_tps(tok, median(st.padded_q))})")
  pr = paired_ratio(st.split, st.ragged)
  value = f"{pr.ratio:.2f}x (ragged slower in {pr.losses}/{len(pr.ratios)} paired repeats)"
  report.target("ragged vs (b) split", value, ">= 1x (never slower)", pr.ratio >= TARGET_VS_SPLIT)
  info("decode-only step: ragged", fmt_tps(n_dec, median(st.decode_ragged)))
  info("decode-only step: (b) decode call padded", fmt_tps(n_dec, median(st.decode_padded)))
  r = paired_ratio(st.decode_padded, st.decode_ragged).ratio
  report.target("ragged vs padded decode", f"{r:.2f}x", f">= {TARGET_DECODE:g}x", r >= TARGET_DECODE)
  value = f"{traces} (median step {step_s * 1e3:.1f} ms)"
  report.target(f"compiles over {steps} changing steps (ragged)", value, "1", traces == 1)
  value = (
    f"{util['measured']:.2%} = {util['used']:,} / {util['allocated']:,} slots; "
    f"waste {util['waste']} slots (expected {util['expected']:.2%})"
  )
  met = util["measured"] > TARGET_UTILISATION
  report.target("KV utilisation (PagedKVCache, mixed workload)", value, f"> {TARGET_UTILISATION:.0%}", met)


def work_line(work: Workload, lay: Layouts, bq: int, bkv: int) -> str:
  useful = useful_scores(work)
  dec = Workload(prefill_lens=(), decode_hists=work.decode_hists)
  useful_dec = useful_scores(dec)
  parts = [("ragged", lay.ragged, useful), ("(a) padded", lay.padded, useful), ("(a')", lay.padded_q, useful)]
  parts += [("(b) split", (lay.split_prefill, lay.split_decode), useful)]
  parts += [("decode ragged", lay.decode_ragged, useful_dec), ("decode padded", lay.split_decode, useful_dec)]
  out = []
  for name, batches, ref in parts:
    batches = batches if isinstance(batches, tuple) else (batches,)
    n = sum(executed_scores(b, bq, bkv) for b in batches)
    out.append(f"{name} {count(n)} ({n / max(ref, 1):.1f}x)")
  return (
    f"score elements per q head computed (x the {count(useful)} mixed / {count(useful_dec)} decode "
    "that causal attention needs): " + ", ".join(out)
  )


def count(n: int) -> str:
  return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}k"


def run_sweep(report, pool: Pool, lay: Layouts, work: Workload, repeats: int, grid_q: list[int], grid_kv: list[int]):
  n_dec = work.num_seqs - work.num_prefills
  useful, useful_dec = useful_scores(work), useful_scores(Workload((), work.decode_hists))
  configs = [(bq, bkv) for bq in grid_q for bkv in grid_kv]
  calls = {}  # every configuration's calls in one interleaved run: load changes hit them alike
  for bq, bkv in configs:
    for name, fn in step_calls(make_attn(bq, bkv), pool, lay, with_padded=False).items():
      calls[(bq, bkv, name)] = fn
  times = time_interleaved(calls, repeats)
  rows = []
  for bq, bkv in configs:
    st = StepTimes.from_times({name: t for (q, kv, name), t in times.items() if (q, kv) == (bq, bkv)})
    w = executed_scores(lay.ragged, bq, bkv) / useful
    wd = executed_scores(lay.decode_ragged, bq, bkv) / useful_dec
    rows.append([bq, bkv, f"{work.new_tokens / median(st.ragged):,.0f} tok/s", w,
                 paired_ratio(st.split, st.ragged).ratio, f"{n_dec / median(st.decode_ragged):,.0f} tok/s", wd,
                 paired_ratio(st.decode_padded, st.decode_ragged).ratio])  # fmt: skip
  header = ["block_q", "block_kv", "mixed ragged", "mixed work", "vs (b) split", "decode ragged", "decode work"]
  header.append("vs padded decode")
  report.table(
    f"Block-size sweep ({repeats} repeats; ratios are paired medians, (b) at the same sizes; work = score elements "
    "computed / needed)",
    header,
    rows,
    formats={"mixed work": ".1f", "vs (b) split": ".2f", "decode work": ".1f", "vs padded decode": ".2f"},
  )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--repeats", type=int, default=5, help="timed runs of every call (median)")
  parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="q and K/V pages")
  parser.add_argument("--block-q", type=int, default=None, help="BlockSizes.block_q (default: the library's)")
  parser.add_argument("--block-kv", type=int, default=None, help="BlockSizes.block_kv (default: the library's)")
  parser.add_argument("--quick", action="store_true", help="tiny smoke size (< 30 s)")
  parser.add_argument("--prefills", type=int, default=2)
  parser.add_argument("--prefill-len", type=int, default=512)
  parser.add_argument("--decodes", type=int, default=30)
  parser.add_argument("--min-history", type=int, default=64)
  parser.add_argument("--max-history", type=int, default=2048)
  parser.add_argument("--spread", choices=("even", "random"), default="even", help="decode histories")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--compile-steps", type=int, default=200)
  parser.add_argument("--no-padded", action="store_true", help="skip (a) and (a'), the slowest calls")
  parser.add_argument("--sweep", action="store_true", help="also time a grid of block sizes")
  parser.add_argument("--sweep-block-q", default=SWEEP_BLOCK_Q, help="comma-separated block_q values for --sweep")
  parser.add_argument("--sweep-block-kv", default=SWEEP_BLOCK_KV, help="comma-separated block_kv values for --sweep")
  bench.add_report_args(parser)
  args = parser.parse_args(argv)
  if args.quick:
    args.prefill_len, args.decodes, args.min_history, args.max_history = 64, 6, 16, 256
    args.repeats, args.compile_steps = min(args.repeats, 3), min(args.compile_steps, 20)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  start = time.perf_counter()
  args = parse_args(argv)
  dtype = jnp.dtype(args.dtype)
  work = make_workload(args)
  rng = np.random.default_rng(args.seed)
  pool = make_pool(work, dtype, rng)
  lay = make_layouts(work, pool, dtype, rng)
  bq, bkv = args.block_q or LIBRARY_DEFAULT_BLOCKS[0], args.block_kv or LIBRARY_DEFAULT_BLOCKS[1]
  attn = make_attn(args.block_q, args.block_kv)
  workload = (
    f"{work.num_prefills} prefills x {args.prefill_len} + {len(work.decode_hists)} decodes, histories "
    f"{min(work.decode_hists, default=0)}..{max(work.decode_hists, default=0)} ({args.spread}); "
    f"{work.new_tokens} new tokens, {int(work.kv_lens.sum()):,} kv tokens in {pool.k.shape[0]} pages; "
    f"heads {NUM_Q_HEADS}:{NUM_KV_HEADS}, head_dim {HEAD_DIM}, page {PAGE_SIZE}, {dtype.name}; "
    f"block_q={bq}, block_kv={bkv}; {args.repeats} repeats"
  )
  report = bench.Report(
    "paged_throughput: ragged paged attention vs padded layouts, one serving step",
    json=args.json,
    meta={"machine": bench.machine(), "workload": workload, "work": work_line(work, lay, bq, bkv)},
  )
  err = reference_check(work, pool, lay, attn, dtype)
  tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
  report.require([bench.Check("ragged step vs paged_reference_attention", err, tol)])
  t0 = time.perf_counter()
  times = time_interleaved(step_calls(attn, pool, lay, with_padded=not args.no_padded), args.repeats)
  st = StepTimes.from_times(times)
  medians = ", ".join(f"{name} {median(t) * 1e3:.1f}" for name, t in times.items())
  report.progress(f"timed in {time.perf_counter() - t0:.0f} s; median ms per call: {medians}")
  t0 = time.perf_counter()
  traces, step_s = compile_count(attn, pool, work, args.compile_steps, args.seed)
  t1 = time.perf_counter()
  util = cache_utilisation(work, dtype, args.seed)
  report.progress(f"compile count: {t1 - t0:.0f} s; cache fill: {time.perf_counter() - t1:.0f} s")
  if args.quick:
    report.note("\n(--quick: smoke size; the targets are meant for the default size)")
  report_step(report, work, st, traces, args.compile_steps, step_s, util)
  if args.sweep:
    ints = lambda text: [int(x) for x in text.split(",") if x]
    run_sweep(report, pool, lay, work, args.repeats, ints(args.sweep_block_q), ints(args.sweep_block_kv))
  report.progress(f"{bench.machine()}; ran {time.perf_counter() - start:.0f} s")
  return report.finish(enforce_targets=not args.quick)


if __name__ == "__main__":
  sys.exit(main())

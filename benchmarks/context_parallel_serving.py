"""Context-parallel serving: a paged KV cache spread over 8 CPU devices against one device holding it all.

What it measures
----------------
A `PagedKVCache.create(..., mesh=, seq_axis=)` over a mesh of ``--devices`` (8)
CPU devices holds ``--decodes`` (2) sequences of ``--context`` (65536) tokens
and one prompt of ``--prefill-len`` (2048) tokens, GQA 8 q heads : 2 kv heads,
head_dim 64, page_size 16, float32, all written by the cache's own jitted
``append``.  Then:

* **cache bytes per device**: each device's ``addressable_shards`` of the page
  arrays (allocated) and the pages the sequences hold on it (from the page
  table), against one device holding everything.  Target: 1/n of the total
  plus at most one page per sequence.
* **decode step**: one new token per long sequence,
  ``paged_attention(..., mesh=, seq_axis=, implementation="xla")`` on the
  spread cache against the single-device op (``implementation="xla"``) on the
  same pages gathered onto one device; interleaved rounds, paired-median ratio.
* **prefill**: the prompt's rows (causal over its own pages) through the same
  two calls, and through the ring prefill (``paged_ring_prefill``: the prompt
  sharded over the axis in the ring prefill layout, activations O(T / n), its
  K/V written into each device's own pages) into a cache of its own reserved
  with ``reserve_prefill``, with both schedules: pass-KV (the default for a
  fresh slot: the K/V shards travel the ring) and pass-Q (``schedule="pass_q"``:
  q travels, each device attends its own pages); their times include that
  write.
* **compile count**: ``--compile-steps`` (20) changing batch compositions
  (which slots, decode or chunk, how much history) through one jitted sharded
  step with fixed shapes; a Python counter in the jitted function counts
  traces.  Target: 1.

Before timing, the sharded op's decode and prefill outputs are checked against
the single-device op; a wrong result exits 1 and nothing is timed.  The CPU
devices are simulated (``--xla_force_host_platform_device_count=8``, set here
if unset) and share the host's cores, so the timings say what the merge and
the per-device work cost on CPU, not what 8 accelerators would gain; the TPU
model of the same step is ``tpu_roofline.py``'s "context-parallel decode"
table.  Timing, paired ratios, the check and the report (Markdown, or
``--json``) are ``flax_ringattn.benchmarking``'s.

Run it::

  python benchmarks/context_parallel_serving.py --quick     # smoke size, < 30 s
  python benchmarks/context_parallel_serving.py             # 2 x 64k-token contexts
  python benchmarks/context_parallel_serving.py --context 131072 --decodes 1 --json
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import os

NUM_DEVICES = 8


def _force_host_devices(num_devices: int) -> None:
  """Ask XLA for `num_devices` host devices; must run before jax is imported."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    flag = f"--xla_force_host_platform_device_count={num_devices}"
    os.environ["XLA_FLAGS"] = f"{flags} {flag}".strip()


_force_host_devices(NUM_DEVICES)

import argparse
import dataclasses
import functools
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
from flax_ringattn import PagedKVCache, paged_attention, paged_ring_prefill, zigzag_inverse, zigzag_order
from flax_ringattn import benchmarking as bench
from flax_ringattn.benchmarking import median, paired_ratio, time_interleaved

EXIT_WRONG_RESULT, EXIT_TARGET_MISSED = bench.EXIT_WRONG_RESULT, bench.EXIT_TARGET_MISSED

AXIS = "sp"
NUM_Q_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 64
PAGE_SIZE = 16
IMPLEMENTATION = "xla"
TOL = 1e-4  # f32: the merge reorders the softmax sums, nothing else


# ------------------------------------------------------------------------------------------
# The cache: long decode contexts and one prompt, written by the cache's own append.


@dataclasses.dataclass
class Setup:
  mesh: jax.sharding.Mesh
  cache: PagedKVCache  # spread over the mesh
  lens: np.ndarray  # [S] tokens of each slot: the decodes' contexts, then the prompt
  k_one: jax.Array  # the same pages on one device
  v_one: jax.Array
  kv_lens: np.ndarray  # [S] as attention reads them (host copies: the batches' metadata is not placed on the mesh)
  table: np.ndarray  # [S, pps] global page ids

  @property
  def n(self) -> int:
    return self.mesh.devices.size

  @property
  def page_bytes(self) -> int:
    k, v = self.cache.k_pages, self.cache.v_pages
    return (k.nbytes + v.nbytes) // k.shape[0]


def pages_for(tokens) -> np.ndarray:
  return -(-np.asarray(tokens) // PAGE_SIZE)


def make_setup(args: argparse.Namespace) -> Setup:
  devices = jax.devices()[: args.devices]
  if len(devices) < args.devices:
    raise SystemExit(f"--devices={args.devices} but JAX has {len(jax.devices())}: set XLA_FLAGS before running")
  mesh = jax.make_mesh((args.devices,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
  lens = np.array([args.context] * args.decodes + [args.prefill_len], np.int64)
  need = pages_for(lens)
  n = args.devices
  # Page j of slot s lives on device (s + j) % n: each device needs at most ceil(pages / n) of every slot.
  per_device = int(sum(-(-need // n)))
  cache = PagedKVCache.create(
    num_pages=n * per_device,
    page_size=PAGE_SIZE,
    max_num_seqs=len(lens),
    pages_per_seq=int(need.max()),
    num_kv_heads=NUM_KV_HEADS,
    head_dim=HEAD_DIM,
    mesh=mesh,
    seq_axis=AXIS,
  )
  rng = np.random.default_rng(args.seed)
  rows = int(lens.sum())
  k = jnp.asarray(rng.standard_normal((rows, NUM_KV_HEADS, HEAD_DIM), np.float32))
  v = jnp.asarray(rng.standard_normal((rows, NUM_KV_HEADS, HEAD_DIM), np.float32))
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  append = jax.jit(lambda c, k, v, cu, s: c.append(k, v, cu, s))
  cache = append(cache, k, v, cu, jnp.array([len(lens)], jnp.int32))
  kv_lens, table = jax.jit(lambda c: c.attention_view())(cache)
  if not np.array_equal(np.asarray(kv_lens), lens):
    raise RuntimeError(f"the cache holds {np.asarray(kv_lens)} tokens per slot, expected {lens} (cache too small?)")
  one = devices[0]
  return Setup(
    mesh=mesh,
    cache=cache,
    lens=lens,
    k_one=jax.device_put(np.asarray(cache.k_pages), one),
    v_one=jax.device_put(np.asarray(cache.v_pages), one),
    kv_lens=np.asarray(kv_lens),
    table=np.asarray(table),
  )


# ------------------------------------------------------------------------------------------
# Batches and the two ops.


@dataclasses.dataclass
class Batch:
  q: jax.Array
  kv_lens: jax.Array
  page_indices: jax.Array
  cu_q_lens: jax.Array
  num_seqs: jax.Array

  def meta(self) -> tuple:
    return (self.kv_lens, self.page_indices, self.cu_q_lens, self.num_seqs)


def decode_batch(s: Setup, rng) -> Batch:
  """One new token for each long context (its last cached token stands for the new one)."""
  S = len(s.lens) - 1
  q = rng.standard_normal((S, NUM_Q_HEADS, HEAD_DIM), np.float32)
  i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)
  return Batch(jnp.asarray(q), i32(s.kv_lens[:S]), i32(s.table[:S]), i32(np.arange(S + 1)), i32([S]))


def prefill_batch(s: Setup, rng) -> Batch:
  """The prompt's every row, causal over its own pages (the last slot)."""
  L = int(s.lens[-1])
  q = rng.standard_normal((L, NUM_Q_HEADS, HEAD_DIM), np.float32)
  i32 = lambda x: jnp.asarray(np.asarray(x), jnp.int32)
  return Batch(jnp.asarray(q), i32(s.kv_lens[-1:]), i32(s.table[-1:]), i32([0, L]), i32([1]))


def make_sharded(mesh) -> Callable:
  """The context-parallel op: pages spread over `mesh`'s axis, partials merged exactly."""
  return jax.jit(functools.partial(paged_attention, mesh=mesh, seq_axis=AXIS, implementation=IMPLEMENTATION))


def make_single() -> Callable:
  return jax.jit(functools.partial(paged_attention, implementation=IMPLEMENTATION))


@dataclasses.dataclass
class RingPrefill:
  """The prompt of `Setup` prefilled by the ring into a cache of its own (reserved with `reserve_prefill`)."""

  call: Callable  # () -> (out in the ring prefill layout, pages ...): schedule "auto" (pass-KV here)
  pass_q: Callable  # the same with schedule="pass_q"
  num_tokens: int
  padded_len: int
  n: int

  def natural(self, out) -> np.ndarray:
    return zigzag_inverse(np.asarray(out), self.n, axis=0)[: self.num_tokens]


def make_ring_prefill(s: Setup, b: Batch) -> RingPrefill:
  """The prompt's q of batch `b` and its K/V (read back from the one-device pages) in the ring prefill layout,
  sharded over the mesh; the call writes them into a fresh spread cache and attends."""
  T, n = int(s.lens[-1]), s.n
  probe = PagedKVCache.create(
    num_pages=n,
    page_size=PAGE_SIZE,
    max_num_seqs=1,
    pages_per_seq=1,
    num_kv_heads=1,
    head_dim=1,
    mesh=s.mesh,
    seq_axis=AXIS,
  )
  Tp = probe.ring_prefill_len(T)
  cache = PagedKVCache.create(
    num_pages=Tp // PAGE_SIZE,  # each device owns exactly its shard's pages
    page_size=PAGE_SIZE,
    max_num_seqs=1,
    pages_per_seq=Tp // PAGE_SIZE,
    num_kv_heads=NUM_KV_HEADS,
    head_dim=HEAD_DIM,
    mesh=s.mesh,
    seq_axis=AXIS,
  )
  cache = jax.jit(lambda c: c.reserve_prefill(0, T, padded_len=Tp))(cache)
  kv_lens, table = jax.jit(lambda c: c.attention_view())(cache)
  ids = s.table[-1, : pages_for(T)]
  sharded = jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(AXIS))

  def layout(x):
    x = np.asarray(x)[:T]
    x = np.concatenate([x, np.zeros((Tp - T, *x.shape[1:]), x.dtype)])
    return jax.device_put(zigzag_order(x, n, axis=0), sharded)

  k, v = (np.asarray(pages)[ids].reshape(-1, NUM_KV_HEADS, HEAD_DIM) for pages in (s.k_one, s.v_one))
  fn = functools.partial(
    paged_ring_prefill, slot=0, num_tokens=T, mesh=s.mesh, seq_axis=AXIS, implementation=IMPLEMENTATION
  )
  args = (layout(b.q), layout(k), layout(v), cache.k_pages, cache.v_pages, kv_lens, table)
  calls = (jax.jit(functools.partial(fn, schedule=x)) for x in ("auto", "pass_q"))
  return RingPrefill(*(functools.partial(f, *args) for f in calls), T, Tp, n)


def check(s: Setup, sharded: Callable, single: Callable, batches: dict[str, Batch]) -> list[bench.Check]:
  """The sharded op against the single-device op on the same pages, every batch."""
  checks = []
  for name, b in batches.items():
    got = sharded(b.q, s.cache.k_pages, s.cache.v_pages, *b.meta())
    want = single(b.q, s.k_one, s.v_one, *b.meta())
    checks.append(bench.compare(f"{name}: {s.n} devices vs one device", got, want, tol=TOL))
  return checks


# ------------------------------------------------------------------------------------------
# Cache bytes per device.


def cache_bytes(s: Setup) -> dict:
  """Per device: bytes of its shards of the page arrays (allocated) and of the pages the slots hold there."""
  allocated = {}
  for arr in (s.cache.k_pages, s.cache.v_pages):
    for shard in arr.addressable_shards:
      allocated[shard.device.id] = allocated.get(shard.device.id, 0) + shard.data.nbytes
  table = s.table
  held_ids = table[table >= 0]
  owners = held_ids // s.cache.pages_per_owner
  held = np.bincount(owners, minlength=s.n)
  devices = [d.id for d in s.mesh.devices.flat]
  pb = s.page_bytes
  total_held = int(held.sum()) * pb
  return dict(
    devices=devices,
    allocated=[allocated[d] for d in devices],
    held=[int(h) * pb for h in held],
    held_pages=[int(h) for h in held],
    # One device holding everything: exactly the pages the slots use, all on it.
    one_device=total_held,
    goal=total_held / s.n + len(s.lens) * pb,
    page_bytes=pb,
  )


def report_bytes(report: bench.Report, s: Setup, b: dict) -> None:
  mib = 2**20
  rows = [[d, a / mib, h / mib, p, h / b["one_device"]]
          for d, a, h, p in zip(b["devices"], b["allocated"], b["held"], b["held_pages"], strict=True)]  # fmt: skip
  report.table(
    f"Cache bytes per device (K and V pages; {s.n} devices vs one device holding all {b['one_device'] / mib:.1f} MiB)",
    ["device", "allocated MiB", "held MiB", "held pages", "share of one device"],
    rows,
    formats={"allocated MiB": ".2f", "held MiB": ".2f", "share of one device": ".4f"},
    notes=[
      "allocated = the device's addressable_shards of k_pages and v_pages; held = the pages the slots' page tables",
      f"name on that device (one page = {b['page_bytes']:,} bytes).  Goal per device: 1/{s.n} of one device's bytes",
      f"plus one page per sequence ({len(s.lens)} sequences).",
    ],
  )
  worst_held, worst_alloc = max(b["held"]), max(b["allocated"])
  goal = b["goal"]
  value = f"max {worst_held / mib:.2f} MiB held, {worst_alloc / mib:.2f} MiB allocated (goal <= {goal / mib:.2f} MiB)"
  report.target(
    "per-device cache bytes", value, f"<= 1/{s.n} + 1 page per sequence", max(worst_held, worst_alloc) <= goal
  )


# ------------------------------------------------------------------------------------------
# Compile count over a changing workload.


def random_step(rng, s: Setup, rows: int) -> tuple[np.ndarray, ...]:
  """A random batch of the cache's slots, shapes fixed ([rows] q rows, [S] slots, the full page table): some slots
  decode (1 row), some run a chunk (up to 8 rows), each over a random part of its history."""
  S = len(s.lens)
  order = rng.permutation(S)[: int(rng.integers(1, S + 1))]
  q_lens = np.where(rng.random(len(order)) < 0.5, 1, rng.integers(1, 9, len(order)))
  q_lens = np.minimum(q_lens, max(1, rows // len(order)))
  kv = np.array([int(rng.integers(q, s.lens[i] + 1)) for i, q in zip(order, q_lens, strict=True)])
  table = np.full(s.table.shape, -1, np.int64)
  table[: len(order)] = s.table[order]
  kv_lens = np.zeros(S, np.int64)
  kv_lens[: len(order)] = kv
  cu = np.concatenate([[0], np.cumsum(q_lens), np.full(S - len(order), q_lens.sum())])
  return kv_lens, table, cu, np.array([len(order)])


def compile_count(s: Setup, sharded: Callable, steps: int, seed: int) -> tuple[int, float]:
  """(traces of one jitted sharded step over `steps` random batch compositions, median step seconds)."""
  rng = np.random.default_rng(seed + 1)
  rows = 8 * len(s.lens)
  q = jnp.asarray(rng.standard_normal((rows, NUM_Q_HEADS, HEAD_DIM), np.float32))
  metas = [[jnp.asarray(x, jnp.int32) for x in random_step(rng, s, rows)] for _ in range(steps)]
  traces, step_s = bench.count_compiles(sharded, [(q, s.cache.k_pages, s.cache.v_pages, *m) for m in metas])
  return traces, float("nan") if step_s is None else step_s


# ------------------------------------------------------------------------------------------
# Report.


def report_times(report, title: str, times: dict[str, list[float]], one: str, rows: int) -> None:
  """One row per call (`one` first, the baseline), and each other call's paired ratio against it."""
  notes = []
  for name in times:
    if name == one:
      continue
    pr = paired_ratio(times[one], times[name])
    notes.append(
      f"one device / {name} (paired median of {len(pr.ratios)} interleaved rounds): {pr.ratio:.2f}x; it was the "
      f"slower one in {pr.losses}/{len(pr.ratios)} rounds."
    )
  report.table(
    title,
    ["call", "median ms", "q rows/s"],
    [[name, median(t) * 1e3, rows / median(t)] for name, t in times.items()],
    formats={"median ms": ".2f", "q rows/s": ",.0f"},
    notes=notes,
  )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--devices", type=int, default=NUM_DEVICES, help="devices the cache is spread over")
  parser.add_argument("--context", type=int, default=65536, help="tokens of each long decode context")
  parser.add_argument("--decodes", type=int, default=2, help="long contexts decoding one token each")
  parser.add_argument("--prefill-len", type=int, default=2048, help="tokens of the prompt")
  parser.add_argument("--repeats", type=int, default=5, help="interleaved timed rounds (median)")
  parser.add_argument("--compile-steps", type=int, default=20, help="batch compositions for the compile count")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--quick", action="store_true", help="smoke size (< 30 s)")
  bench.add_report_args(parser)
  args = parser.parse_args(argv)
  if args.quick:
    args.context, args.prefill_len = min(args.context, 4096), min(args.prefill_len, 256)
    args.repeats = min(args.repeats, 3)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  start = time.perf_counter()
  args = parse_args(argv)
  load = os.getloadavg()
  workload = (
    f"{args.decodes} contexts x {args.context:,} tokens decoding 1 token each, 1 prompt of {args.prefill_len:,} "
    f"tokens; heads {NUM_Q_HEADS}:{NUM_KV_HEADS}, head_dim {HEAD_DIM}, page {PAGE_SIZE}, float32, "
    f"implementation={IMPLEMENTATION!r}; {args.repeats} repeats"
  )
  t0 = time.perf_counter()
  s = make_setup(args)
  report = bench.Report(
    f"context_parallel_serving: a paged cache spread over {args.devices} CPU devices vs one device",
    json=args.json,
    meta={
      "machine": bench.machine(),
      "load average at start (1, 5, 15 min)": ", ".join(f"{x:.1f}" for x in load),
      "workload": workload,
    },
  )
  report.progress(f"cache filled in {time.perf_counter() - t0:.1f} s")
  rng = np.random.default_rng(args.seed + 2)
  batches = {"decode": decode_batch(s, rng), "prefill": prefill_batch(s, rng)}
  sharded, single = make_sharded(s.mesh), make_single()
  ring = make_ring_prefill(s, batches["prefill"])
  checks = check(s, sharded, single, batches)
  b = batches["prefill"]
  want = single(b.q, s.k_one, s.v_one, *b.meta())
  got = ring.natural(ring.call()[0])
  checks.append(bench.compare(f"ring prefill: {s.n} devices vs one device", got, want, tol=TOL))
  got = ring.natural(ring.pass_q()[0])
  checks.append(bench.compare(f"ring prefill pass-Q: {s.n} devices vs one device", got, want, tol=TOL))
  report.require(checks)

  report_bytes(report, s, cache_bytes(s))

  spread, one = f"{s.n} devices (mesh=, seq_axis=)", "one device"
  for name, b in batches.items():
    t0 = time.perf_counter()
    calls = {
      one: functools.partial(single, b.q, s.k_one, s.v_one, *b.meta()),
      spread: functools.partial(sharded, b.q, s.cache.k_pages, s.cache.v_pages, *b.meta()),
    }
    if name == "prefill":
      calls[f"{s.n} devices, ring prefill, pass-KV (q sharded)"] = ring.call
      calls[f"{s.n} devices, ring prefill, pass-Q (q sharded)"] = ring.pass_q
    times = time_interleaved(calls, args.repeats)
    report.progress(f"{name} timed in {time.perf_counter() - t0:.1f} s")
    if name == "decode":
      title = f"Decode step: {args.decodes} x {args.context:,}-token contexts, 1 new token each"
    else:
      title = f"Prefill: one {args.prefill_len:,}-token prompt (q replicated, or sharded by the ring prefill)"
    report_times(report, title, times, one, b.q.shape[0])

  t0 = time.perf_counter()
  traces, step_s = compile_count(s, sharded, args.compile_steps, args.seed)
  report.progress(f"compile count in {time.perf_counter() - t0:.1f} s")
  value = f"{traces} (median step {step_s * 1e3:.1f} ms)"
  report.target(f"compiles over {args.compile_steps} changing batch compositions (sharded)", value, "1", traces == 1)

  end_load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  report.note(
    "\nNotes:\n"
    f"- The {s.n} devices are simulated on this host's {os.cpu_count()} cores (load average {end_load} at the end): "
    "they share the cores, so the spread op cannot run n times faster here; the ratios show what the per-device "
    "work and the merge (one psum of [T, N, H + 1], one pmax of [T, N]) cost on CPU.\n"
    f"- Prefill: the ring prefill holds {ring.padded_len // s.n:,} of the prompt's {ring.padded_len:,} padded rows "
    f"(q, k, v, out) on each device, where the spread op with q replicated holds all {ring.num_tokens:,}; its time "
    "includes writing the prompt's K/V into the pages (the other two rows read pages written beforehand).\n"
    "- The TPU model of a 1M-token decode step is tpu_roofline.py's 'context-parallel decode' table."
  )
  if args.quick:
    report.note("\n(--quick: smoke size; the timings are meant for the default size)")
  report.progress(f"{bench.machine()}; ran {time.perf_counter() - start:.0f} s")
  return report.finish()


if __name__ == "__main__":
  sys.exit(main())

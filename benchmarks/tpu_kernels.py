"""This project's Pallas TPU kernels against JAX's own TPU kernels, measured on one TPU chip in one process.

What it prints
--------------
1. Block kernels: `ring_attention(..., implementation="pallas_tpu")` on one
   device (a ring of one: the block kernels, the planner's tiles) against
   JAX's splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`,
   every block 512) on its [N, T, H] layout, the same splash called on
   [B, T, N, H] with the transposes and q's scaling inside the timed call
   ("splash BTNH": what a model with our layout pays to use it), and JAX's
   `flash_attention` (every block 512).  `--block-sizes` fixes our tiles
   (several: a sweep, a row per choice against the same compiled peers).  B=1, N=8 (MHA), H=128, bf16, scale 1/sqrt(H); rows T=8192
   causal and full forward, T=8192 and T=32768 causal and full forward +
   backward.  Columns: ms per call, ratio = peer / ours (> 1: ours is faster),
   our TFLOP/s (forward 4 B N T^2 H, forward + backward 3.5x that, causal
   counted as half) and its share of the chip's bf16 peak.
2. Ragged paged attention: `paged_attention(..., implementation="pallas_tpu")`
   (separate k_pages / v_pages [P, page, K, H]) against JAX's
   `ragged_paged_attention` (one combined cache [P, page, 2K, H], K at even
   and V at odd heads, built from the same pages before timing; its tuned
   default blocks, vmem_limit_bytes 64 MiB).  N=32, K=8, H=128, page 16,
   bf16, pages handed out in a shuffled order; rows: decode 64 x 2048, decode
   16 x 16384, 2 prefills + 32 decodes in 1024 rows, 1054 new tokens in 1056
   rows and the same in exactly 1054 rows.  Columns: ms, ratio = jax / ours,
   our GB/s (the K/V bytes of every sequence's kv_len, plus q and out) and its
   share of the chip's HBM bandwidth.

Every candidate is checked against the peers before anything is timed (max
|ours - peer| <= 2e-2 * max(1, max |peer|) per output and gradient; a
mismatch prints the check and exits 1).  A candidate that raises gets its
error in the row and the run carries on.  Calls are jitted and timed
interleaved (`benchmarking.time_interleaved`: every round runs each
candidate in a rotating order), medians of `--repeats` rounds; ratios are
paired medians.  On a TPU each candidate's turn is `--calls-per-round` (10)
calls dispatched back to back and one wait, so a figure is the chip's time
per call: on the v5e host this was measured on, waiting for each call added
about 0.5 ms of host round trip to every call (the last note line measures
it with a tiny call), which hid short kernels' differences.  The figures in
`docs/performance.md` up to 2026-12-06 were timed one call per round
(`--calls-per-round 1`).

Off a TPU (or with `--interpret`) our kernels run in Pallas TPU interpret mode
on tiny shapes (`--quick` is implied), splash and flash_attention too; JAX's
ragged_paged_attention does not run in interpret mode, so the paged rows are
checked against JAX's `ref_ragged_paged_attention` and it is not timed.  The
numbers then mean nothing: that mode shows that the script works.

Run it (repository root)::

  PYTHONPATH=. python benchmarks/tpu_kernels.py                  # on a TPU: both tables, a few minutes
  PYTHONPATH=. python benchmarks/tpu_kernels.py --quick          # on a TPU: small shapes, well under a minute
  PYTHONPATH=. python benchmarks/tpu_kernels.py --json out.json  # Markdown on stdout, the report as JSON in out.json
  PYTHONPATH=. python benchmarks/tpu_kernels.py --tables paged --paged-blocks 16,1024 32,1024  # a block sweep
  PYTHONPATH=. python benchmarks/tpu_kernels.py --tables block --block-sizes 1024,1024 2048,2048,1024,2048
  python benchmarks/tpu_kernels.py --quick                       # on CPU: interpret mode, < 1 min
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

try:
  import flax_ringattn  # noqa: F401 -- installed, or this checkout (below)
except ImportError:  # running from a checkout that is not installed
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flax_ringattn as fr
from flax_ringattn import benchmarking as bench
from flax_ringattn.benchmarking import Problem, cost, hardware, median, paired_ratio, time_interleaved
from flax_ringattn.testing import kernel_debug

EXIT_WRONG_RESULT = bench.EXIT_WRONG_RESULT
MIB = 2**20
TOL = 2e-2  # bf16: max |ours - peer| <= TOL * max(1, max |peer|), per output and gradient
PEER_BLOCK = 512  # splash's and flash_attention's blocks, every one of them (capped at T)
V5E = hardware.tpu("v5e")  # the figures used when the attached TPU is not in the package's table


# ------------------------------------------------------------------------------------------
# Shapes.


@dataclasses.dataclass(frozen=True)
class BlockRow:
  T: int
  causal: bool
  pas: str  # "fwd" or "fwd+bwd"
  mask: str = ""  # "causal", "full", "window" (causal, --window tokens) or "segments" (causal, --segments documents)

  @property
  def kind(self) -> str:
    return self.mask or ("causal" if self.causal else "full")


@dataclasses.dataclass(frozen=True)
class Step:
  """One ragged paged call: sequence i has q_lens[i] new tokens at the end of its kv_lens[i] cached ones (new
  tokens included), packed back to back into `rows` q rows (T = max_num_batched_tokens; the rest is padding)."""

  name: str
  q_lens: tuple[int, ...]
  kv_lens: tuple[int, ...]
  rows: int

  @property
  def new_tokens(self) -> int:
    return sum(self.q_lens)


@dataclasses.dataclass(frozen=True)
class Config:
  """The shapes of one run: full size, --quick on a TPU, or the interpret-mode smoke size."""

  block: dict  # B, N, H of the block table
  block_rows: tuple[BlockRow, ...]
  paged: dict  # N, K, H of the paged table
  steps: tuple[Step, ...]


def decode(seqs: int, kv: int) -> Step:
  return Step(f"decode {seqs} x {kv}", (1,) * seqs, (kv,) * seqs, seqs)


# The real head layouts per chip (q heads / kv heads / head dim) the paged table covers with --paged-layouts models:
# whole models on one chip and large ones split over tensor-parallel chips (kv heads per chip).
MODEL_LAYOUTS = {
  "Llama-3.2-1B": (32, 8, 64),
  "Qwen2.5-0.5B": (14, 2, 64),
  "Qwen2.5-7B": (28, 4, 128),
  "Gemma-2B": (8, 1, 256),
  "Gemma-2-9B": (16, 8, 256),
  "Llama-3-70B / 8 chips": (8, 1, 128),
  "Mistral-7B / 2 chips": (16, 4, 128),
}


def layout_steps(rng_seed: int = 0) -> dict[str, Step]:
  """The batches of the layout matrix: long decode, decode of random lengths, a mixed step and chunked prefill."""
  rng = np.random.default_rng(rng_seed)
  lens = tuple(int(x) for x in rng.integers(64, 4097, 64))
  return {
    "decode": decode(64, 4096),
    "short": decode(64, 512),
    # The engine's batch-64 decode at 2k: a 2048-token prompt and up to 16 new tokens, so each sequence's last kv
    # block holds a few tokens (`real_models.py --tables serve --contexts 2048`).
    "engine": decode(64, 2064),
    "random": Step("decode 64, random lengths 64..4096", (1,) * 64, lens, 64),
    "mixed": mixed([(512, 0), (512, 0)], tuple(h + 1 for h in spread(64, 2048, 30)), 1056, "2 x 512 new + 30 decodes"),
    "prefill": mixed([(1024, 1024)] * 4, (), 4096, "prefill 4 x 1024 new on 1024 cached"),
  }


def parse_block_layouts(text: str | None) -> list[tuple[int, int, int, int]]:
  """(B, N, K, H) per layout; [] for None; 'models': B=1 and each of MODEL_LAYOUTS' whole models' heads."""
  if text is None:
    return []
  if text == "models":
    whole = {"Llama-3.2-1B": (32, 8, 64), "Qwen2.5-0.5B": (14, 2, 64), "Qwen2.5-7B": (28, 4, 128)}
    whole |= {"Gemma-2B": (8, 1, 256), "Gemma-2-9B": (16, 8, 256)}
    return [(1, *nkh) for nkh in whole.values()]
  out = []
  for item in text.split(","):
    parts = [int(x) for x in item.strip().split("/")]
    if len(parts) != 4 or parts[1] % parts[2]:
      raise ValueError(f"want B/N/K/H with N a multiple of K, got {item!r}")
    out.append(tuple(parts))
  return out


def parse_layouts(text: str | None) -> list[tuple[str, int, int, int, int | None]]:
  """(name, N, K, H, page or None) per layout; None: the one default layout."""
  if text is None:
    return []
  if text == "models":
    return [(name, *nkh, None) for name, nkh in MODEL_LAYOUTS.items()]
  out = []
  for item in text.split(","):
    parts = [int(x) for x in item.strip().split("/")]
    if len(parts) not in (3, 4) or parts[0] % parts[1]:
      raise ValueError(f"want N/K/H[/PAGE] with N a multiple of K, got {item!r}")
    out.append((item.strip(), *parts[:3], parts[3] if len(parts) == 4 else None))
  return out


def spread(lo: int, hi: int, n: int) -> tuple[int, ...]:
  return tuple(int(x) for x in np.linspace(lo, hi, n).round())


def mixed(prefills: Sequence[tuple[int, int]], decode_kv: Sequence[int], rows: int, name: str) -> Step:
  """Prefills of (new tokens, cached tokens before them), then one-token decodes with kv_len `decode_kv`."""
  q_lens = tuple(new for new, _ in prefills) + (1,) * len(decode_kv)
  kv_lens = tuple(new + cached for new, cached in prefills) + tuple(decode_kv)
  return Step(name, q_lens, kv_lens, rows)


def block_rows(seq_lens, fwd_seq_lens, masks) -> tuple[BlockRow, ...]:
  fwd = [BlockRow(T, m != "full", "fwd", m) for T in fwd_seq_lens for m in masks]
  return tuple(fwd + [BlockRow(T, m != "full", "fwd+bwd", m) for T in seq_lens for m in masks])


def config(args) -> Config:
  if args.interpret:  # tiny: every kernel runs in CPU interpret mode
    block = dict(B=1, N=2, H=128)
    rows = block_rows([256], [256], [m for m in args.masks if m != "full"] or ["causal"])
    paged = dict(N=4, K=2, H=128)
    mix = mixed([(12, 20)], (17, 40, 64), 16, "1 prefill (12 new after 20 cached) + 3 decodes (kv 17, 40, 64)")
    steps = (decode(4, 64), mix, dataclasses.replace(mix, rows=mix.new_tokens))
    return Config(block, rows, paged, steps)
  block = dict(B=args.batch, N=args.num_heads, H=args.head_dim)
  paged = dict(N=32, K=8, H=128)
  if args.quick:
    rows = block_rows([1024], [1024], args.masks)
    mix = mixed([(24, 40), (24, 0)], spread(64, 512, 8), 64, "2 prefills (24 new after 40 / 0 cached) + 8 decodes")
    return Config(block, rows, paged, (decode(8, 512), mix, dataclasses.replace(mix, rows=mix.new_tokens)))
  rows = block_rows(args.seq_lens, args.fwd_seq_lens, args.masks)
  # The 1054-token step is paged_throughput.py's: 2 fresh prompts of 512 and 30 decodes whose histories are
  # spread evenly over 64..2048 tokens.
  step_1054 = mixed(
    [(512, 0), (512, 0)],
    tuple(h + 1 for h in spread(64, 2048, 30)),
    1056,
    "2 prefills (512 new, no history) + 30 decodes (history 64..2048)",
  )
  steps = (
    decode(64, 2048),
    decode(16, 16384),
    mixed(
      [(496, 512), (496, 1536)],
      spread(256, 4096, 32),
      1024,
      "2 prefills (496 new after 512 / 1536 cached) + 32 decodes (kv 256..4096)",
    ),
    step_1054,
    dataclasses.replace(step_1054, rows=step_1054.new_tokens),
  )
  return Config(block, rows, paged, steps)


# ------------------------------------------------------------------------------------------
# Running candidates: build, check, time.


def error_text(e: Exception) -> str:
  lines = str(e).strip().splitlines()
  return f"{type(e).__name__}: {lines[0] if lines else ''}"[:200]


def tpu_interpret(fn: Callable, on: bool) -> Callable:
  """`fn` with every pallas_call traced while it runs in TPU interpret mode (for a peer without an `interpret`
  argument: flash_attention).  Pass the jitted call: jit traces on its first call, inside this context."""
  if not on:
    return fn
  from jax.experimental.pallas import tpu as pltpu

  def run(*args):
    with pltpu.force_tpu_interpret_mode(pltpu.InterpretParams()):
      return fn(*args)

  return run


@dataclasses.dataclass
class Candidate:
  """A jitted call on its own inputs; `to_ours` maps its result to our layout (numpy f32) for the check."""

  fn: Callable
  args: tuple
  to_ours: Callable = lambda x: x
  timed: bool = True  # False: a reference that is only checked against
  result: object = None
  error: str | None = None

  def run(self) -> None:
    """The first call (compiles); an exception becomes `error`, reported in the row."""
    if self.error is not None:
      return
    try:
      got = jax.block_until_ready(self.fn(*self.args))
      self.result = jax.tree.map(lambda a: np.asarray(a, np.float32), self.to_ours(got))
    except Exception as e:
      self.error = error_text(e)


def check(name: str, got, want, leaves: Sequence[str]) -> bench.Check:
  """The worst leaf (output or gradient) of `got` against `want`, by its error over its tolerance
  TOL * max(1, max |want|): bf16 outputs near 0 are held to TOL absolute, large gradients relative to their
  scale."""
  worst = None
  for leaf, a, b in zip(leaves, jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    err = bench.error(a, b)
    tol = TOL * max(1.0, float(np.abs(b).max(initial=0.0)))
    if worst is None or err / tol > worst[0] / worst[1] or not np.isfinite(err):
      worst = (err, tol, leaf)
  err, tol, leaf = worst
  return bench.Check(f"{name} (worst: {leaf})" if len(leaves) > 1 else name, err, tol)


def check_and_time(report, row: str, ours: Candidate, peers: dict[str, Candidate], leaves, args) -> dict:
  """Run every candidate once, check ours against each peer that ran (exit 1 on a mismatch), then time ours and
  the peers interleaved.  Returns {"times": {name: [s]}, "err": ours vs the first peer, "errors": {name: text}}."""
  for c in (ours, *peers.values()):
    c.run()
  errors = {name: c.error for name, c in {"ours": ours, **peers}.items() if c.error}
  ran = {name: c for name, c in peers.items() if c.error is None}
  out = {"times": {}, "err": None, "errors": errors}
  if ours.error is None and ran:
    checks = [check(f"{row}: ours vs {name}", ours.result, c.result, leaves) for name, c in ran.items()]
    report.require(checks)  # exits 1 before anything is timed if one fails
    out["err"] = checks[0].error
  elif ours.error is None:
    errors["ours"] = "not checked (no peer ran): not timed"
  for c in (ours, *peers.values()):
    c.result = None  # host copies of outputs and gradients: 0.5 GiB per candidate at T=32768
  timed = {"ours": ours, **ran}
  calls = {name: functools.partial(c.fn, *c.args) for name, c in timed.items() if c.timed and name not in errors}
  if calls:
    report.progress(f"timing {row}: {', '.join(calls)}")
    out["times"] = time_interleaved(
      calls,
      args.repeats,
      warmup=args.warmup,
      on_error=lambda name, e: errors.setdefault(name, error_text(e)),
      calls_per_round=args.calls_per_round,
    )
    # Each row's medians as soon as it is timed: a run stopped before its tables print still leaves them.
    medians = [f"{name} {ms(out['times'], name):.3f} ms" for name in calls if out["times"].get(name)]
    report.progress(f"timed {row}: " + ", ".join(medians))
  return out


def best_peer(times: dict, prefix: str, *, exclude: str | None = None, only: str | None = None) -> str | None:
  """The timed candidate named `prefix`... (without `exclude`, or with `only` in its name) of least median time."""
  names = [n for n in times if n.startswith(prefix) and times[n]]
  names = [n for n in names if (exclude is None or exclude not in n) and (only is None or only in n)]
  return min(names, key=lambda n: median(times[n]), default=None)


def peer_label(name: str | None) -> str | None:
  """'b512 fused' of 'splash b512 fused'."""
  return None if name is None else name.split(" ", 1)[1]


def summarize(report, title: str, rows: Sequence[Sequence], name_cols: Sequence[int], ratio_cols: dict) -> None:
  """One line per ratio column of a table: rows measured, minimum and median ratio (> 1: ours faster), the worst
  row named, and how many rows are below 1.0x."""
  out = []
  for label, col in ratio_cols.items():
    got = [(r[col], " ".join(str(r[i]) for i in name_cols)) for r in rows if r[col] is not None]
    if not got:
      out.append([label, 0, None, None, "-", 0])
      continue
    values = sorted(v for v, _ in got)
    worst = min(got, key=lambda x: x[0])
    out.append([label, len(got), values[0], median(values), worst[1], sum(v < 1.0 for v in values)])
  report.table(
    f"Summary: {title}",
    ["ratio", "rows", "min", "median", "worst row", "rows below 1.0x"],
    out,
    formats={"min": ".2f", "median": ".2f"},
  )


def ms(times: dict, name: str | None) -> float | None:
  t = median(times.get(name, []))
  return None if t is None else t * 1e3


def ratio(times: dict, peer: str | None) -> float | None:
  """peer / ours, the median of the per-round ratios (> 1: ours is faster)."""
  a, b = times.get(peer, []), times.get("ours", [])
  return paired_ratio(a, b).ratio if a and len(a) == len(b) else None


def notes_cell(errors: dict) -> str:
  return "; ".join(f"{name}: {text}" for name, text in errors.items())


# ------------------------------------------------------------------------------------------
# Table 1: block kernels vs splash (and flash_attention).


def ours_block_fn(causal: bool, scale: float, interpret, block_sizes=None, **mask) -> Callable:
  """Our block kernels on [B, T, N, H]: ring_attention without an axis is one device, one hop, no collective;
  `block_sizes` None: the planner's tiles; `mask`: local_window_size or segment_ids ([B, T])."""
  return lambda q, k, v: fr.ring_attention(
    q, k, v, is_causal=causal, scale=scale, implementation="pallas_tpu", interpret=interpret, block_sizes=block_sizes,
    **mask,
  )  # fmt: skip


def mask_options(kind: str, T: int, B: int, args) -> tuple[dict, object]:
  """(ring_attention's keywords, splash's per-head mask or segment ids) of a block row's mask kind: window is
  causal with `--window` tokens (the token itself and the W - 1 before it); segments causal within `--segments`
  equal documents."""
  if kind == "window":
    return {"local_window_size": (args.window - 1, 0)}, None
  if kind == "segments":
    seg = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32) // max(1, T // args.segments), (B, T))
    return {"segment_ids": seg}, seg
  return {}, None


VARIANT_FIELDS = {
  "heads_major": ("forward_layout", "heads_major"),
  "natural_exp": ("natural_exp", True),
  "whole_partial_tiles": ("whole_partial_tiles", True),
  "fused_backward": ("fused_backward", True),
  "split_backward": ("fused_backward", False),
}


def variant_debug(variant: str) -> dict:
  """The `kernel_debug` fields of a '+'-joined variant name ("heads_major+natural_exp")."""
  parts = variant.split("+")
  unknown = [x for x in parts if x not in VARIANT_FIELDS]
  if unknown:
    raise ValueError(f"unknown variant {variant!r}: use {', '.join(VARIANT_FIELDS)}, '+'-joined")
  return dict(VARIANT_FIELDS[x] for x in parts)


def with_variant(fn: Callable, variant: str) -> Callable:
  """`fn` (jitted) traced and run inside `kernel_debug(**variant_debug(variant))`: its first call traces it there,
  and later calls reuse that trace."""

  def run(*args):
    with kernel_debug(**variant_debug(variant)):
      return fn(*args)

  return run


def on_our_layout(kernel: Callable, scale: float) -> Callable:
  """A [B, N, T, H] kernel without a softmax scale (splash) as a user with [B, T, N, H] activations calls it: q,
  k and v transposed and q scaled inside, the output transposed back; gradients come back by our inputs."""
  heads = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731  [B, T, N, H] <-> [B, N, T, H]
  return lambda q, k, v: heads(kernel(heads((q.astype(jnp.float32) * scale).astype(q.dtype)), heads(k), heads(v)))


def our_block_tiles(T: int, N: int, K: int, H: int, block_sizes) -> str | None:
  """The tiles our op runs (display only): (forward q x kv; backward q x kv), `--block-sizes` or the planner's."""
  try:
    from flax_ringattn._src.backends.pallas_tpu import planners
    from flax_ringattn._src.block_sizes import effective_tile

    b = block_sizes or planners.plan_block_sizes(T, T, N, K, H, jnp.bfloat16)
    tiles = [effective_tile(T, x) for x in (b.block_q, b.block_kv, *b.bwd)]  # clamped to T as the kernels do
    return "{}x{}; {}x{}".format(*tiles)
  except Exception:
    return None


def splash_fn(
  p: Problem, fused_bwd: bool, interpret: bool, block: int = PEER_BLOCK, kind: str = "", window=None, seg=None
) -> Callable:
  """Splash on [B, N, T, H] (its per-example layout [N, T, H]; B = 1 drops the batch dim, else vmap), q already
  scaled: splash applies no softmax scale."""
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

  b = min(block, p.T)
  dq = None if fused_bwd else b  # the fused backward computes dq in the dk/dv kernel: no dq blocks
  sizes = splash.BlockSizes(
    block_q=b,
    block_kv=b,
    block_kv_compute=b,
    block_q_dkv=b,
    block_kv_dkv=b,
    block_kv_dkv_compute=b,
    block_q_dq=dq,
    block_kv_dq=dq,
    use_fused_bwd_kernel=fused_bwd,
  )
  if kind == "window":
    head = masks.LocalMask((p.T, p.T), window_size=(window - 1, 0), offset=0)
  else:
    head = masks.CausalMask((p.T, p.T)) if p.is_causal else masks.FullMask((p.T, p.T))
  kernel = splash.make_splash_mha_single_device(
    masks.MultiHeadMask([head] * p.N), block_sizes=sizes, interpret=interpret
  )
  if seg is not None:  # segment ids [B, T] as constants of the call, one row per batch entry
    with_ids = lambda a, b, c, s: kernel(a, b, c, segment_ids=splash.SegmentIds(q=s, kv=s))  # noqa: E731
    return lambda q, k, v: jax.vmap(with_ids)(q, k, v, seg)
  if p.B == 1:
    return lambda q, k, v: kernel(q[0], k[0], v[0])[None]
  return jax.vmap(kernel)


def flash_fn(p: Problem, scale: float, block: int = PEER_BLOCK) -> Callable:
  """JAX's flash_attention on [B, N, T, H], which applies `sm_scale` itself."""
  from jax.experimental.pallas.ops.tpu import flash_attention as fa

  b = min(block, p.T)
  sizes = fa.BlockSizes(
    block_q=b,
    block_k_major=b,
    block_k=b,
    block_b=1,
    block_q_major_dkv=b,
    block_k_major_dkv=b,
    block_k_dkv=b,
    block_q_dkv=b,
    block_k_major_dq=b,
    block_k_dq=b,
    block_q_dq=b,
  )
  return lambda q, k, v: fa.flash_attention(q, k, v, causal=p.is_causal, sm_scale=scale, block_sizes=sizes)


def to_our_layout(result, dq_scale: float = 1.0):
  """A peer's (out) or (out, (dq, dk, dv)) in [B, N, T, H], as ours: [B, T, N, H], dq times `dq_scale`."""
  back = lambda x: x.transpose(0, 2, 1, 3)
  if not isinstance(result, tuple):
    return back(result)
  out, (dq, dk, dv) = result
  return back(out), (back(dq).astype(jnp.float32) * dq_scale, back(dk), back(dv))


def grads_to_our_layout(grads, dq_scale: float = 1.0):
  """A peer's (dq, dk, dv) in [B, N, T, H], as ours: [B, T, N, H], dq times `dq_scale`."""
  dq, dk, dv = (x.transpose(0, 2, 1, 3) for x in grads)
  return dq.astype(jnp.float32) * dq_scale, dk, dv


def block_table(report, cfg: Config, args, chip) -> None:
  """One block table per head layout (--block-layouts B/N/K/H; default --batch, --num-heads, --head-dim with K = N),
  then a summary over all of them."""
  layouts = args.block_layouts or [(cfg.block["B"], cfg.block["N"], cfg.block["N"], cfg.block["H"])]
  everything, ratios = [], {}
  for B, N, K, H in layouts:
    title = f"B={B} N={N} K={K} H={H}: " if args.block_layouts else ""
    rows, header = block_layout_table(report, cfg, args, chip, B, N, K, H, title)
    everything += [[title.rstrip(": "), *row] for row in rows]
    ratios = {c: header.index(c) + 1 for c in ("splash/ours", "splash BTNH/ours", "flash/ours") if c in header}
  summarize(report, "block kernels, every layout", everything, (0, 1, 2, 3), ratios)


def block_layout_table(report, cfg: Config, args, chip, B: int, N: int, K: int, H: int, title: str):
  """The block rows of one head layout; returns (rows, header)."""
  scale = H**-0.5
  peak = chip.peak_flops("bfloat16") if chip else None
  interp = True if args.interpret else None
  rows, inputs = [], {}
  for r in cfg.block_rows:
    p = Problem(B=B, T=r.T, N=N, K=K, H=H, dtype="bfloat16", is_causal=r.causal)
    mask_kw, seg = mask_options(r.kind, r.T, B, args)
    if r.T not in inputs:
      inputs.clear()  # one length's inputs at a time (the mask does not change them)
      q, k, v, do = p.inputs(0)
      # The peers' layout [B, N, T, H], and splash's q scaled beforehand (as a model folds the scale into its q
      # projection): every kernel gets its native layout, and no transpose or scaling is timed.
      qt, kt, vt, dot = (x.transpose(0, 2, 1, 3) for x in (q, k, v, do))
      qs = (qt.astype(jnp.float32) * scale).astype(qt.dtype)
      inputs[r.T] = (q, k, v, do, qt, kt, vt, dot, qs)
    q, k, v, do, qt, kt, vt, dot, qs = inputs[r.T]
    bwd = r.pas == "fwd+bwd"
    # A training step keeps the gradients alone: timing the output too runs a peer's forward twice (splash without
    # and with residuals), which slows the peer, not ours (--with-output: the output and the gradients).
    wrap = functools.partial(bench.fwd_bwd, with_output=args.with_output) if bwd else jax.jit
    # Splash's dq is the gradient by the scaled q: times the scale, by ours.
    from_splash = functools.partial(to_our_layout, dq_scale=scale)
    from_flash = to_our_layout
    cotangent = lambda x, bwd=bwd: (x,) if bwd else ()  # fwd_bwd's extra argument: dO in the candidate's layout
    if bwd and not args.with_output:  # gradients alone: the check and the layouts see (dq, dk, dv)
      from_splash = functools.partial(grads_to_our_layout, dq_scale=scale)
      from_flash = grads_to_our_layout
    peers = {}
    # Each peer at every block size of --peer-blocks (and splash with and without its fused backward with
    # --splash-fused-bwd both): the row reports the fastest, as a user tuning it would run it.
    for blk in sorted({min(b, r.T) for b in args.peer_blocks}):  # blocks are capped at T: each once
      for fused in sorted({False, args.splash_fused_bwd}) if bwd else (False,):
        name = f"splash b{blk}" + (" fused" if fused else "")
        try:
          kernel = splash_fn(p, fused, args.interpret, blk, r.kind, args.window, seg)
          peers[name] = Candidate(wrap(kernel), (qs, kt, vt, *cotangent(dot)), from_splash)
          if not args.no_splash_layout:  # splash as a [B, T, N, H] model calls it: the layout work timed too
            peers[f"{name} BTNH"] = Candidate(wrap(on_our_layout(kernel, scale)), (q, k, v, *cotangent(do)))
        except Exception as e:  # building the kernel (the mask's block tables) can fail too
          peers[name] = Candidate(None, (), error=error_text(e))
      if not args.no_flash and K == N and r.kind in ("causal", "full"):  # flash_attention: MHA, causal or full
        # Interpret mode wraps the jitted call: its backward kernels are traced when jit differentiates, outside
        # flash_fn's own frames.
        flash = tpu_interpret(wrap(flash_fn(p, scale, blk)), args.interpret)
        peers[f"flash b{blk}"] = Candidate(flash, (qt, kt, vt, *cotangent(dot)), from_flash)
    leaves = (("dq", "dk", "dv") if not args.with_output else ("out", "dq", "dk", "dv")) if bwd else ("out",)
    mask = r.kind
    # Several --block-sizes: one checked, timed row per choice, against the same (compiled once) peers.
    for blocks in args.block_sizes or [None]:
      ours = Candidate(wrap(ours_block_fn(r.causal, scale, interp, blocks, **mask_kw)), (q, k, v, *cotangent(do)))
      for variant in args.ours_variants:  # checked against ours like a peer, timed in the same rounds
        fn = with_variant(wrap(ours_block_fn(r.causal, scale, interp, blocks, **mask_kw)), variant)
        peers[f"ours {variant}"] = Candidate(fn, (q, k, v, *cotangent(do)))
      name = f"block {title}T={r.T} {mask} {r.pas}"
      if args.block_sizes and len(args.block_sizes) > 1:
        name += f", ours {our_block_tiles(r.T, N, K, H, blocks)}"
      got = check_and_time(report, name, ours, peers, leaves, args)
      t = got["times"]
      flops = cost.attention_flops(B=B, T=r.T, N=N, H=H, is_causal=r.causal, direction=r.pas)
      if r.kind == "window":  # the visible band: about T x window of T^2 / 2
        flops *= min(1.0, 2 * args.window / r.T)
      elif r.kind == "segments":  # causal within each document: 1 / --segments of the causal pairs
        flops /= args.segments
      t_ours = ms(t, "ours")
      tflops = flops / t_ours / 1e9 if t_ours else None
      splash_best = best_peer(t, "splash b", exclude=" BTNH")
      row = [r.T, mask, r.pas, our_block_tiles(r.T, N, K, H, blocks), t_ours, ms(t, splash_best), ratio(t, splash_best)]
      row += [peer_label(splash_best)]
      if not args.no_splash_layout:
        btnh = best_peer(t, "splash b", only=" BTNH")
        row += [ms(t, btnh), ratio(t, btnh)]
      if not args.no_flash:
        flash_best = best_peer(t, "flash b")
        row += [ms(t, flash_best), ratio(t, flash_best), peer_label(flash_best)]
      for variant in args.ours_variants:
        row += [ms(t, f"ours {variant}"), ratio(t, f"ours {variant}")]
      row += [tflops, tflops and peak and 100 * tflops * 1e12 / peak, got["err"], notes_cell(got["errors"])]
      rows.append(row)
  header = ["T", "mask", "pass", "ours tiles", "ours ms", "splash ms", "splash/ours", "splash at"]
  if not args.no_splash_layout:
    header += ["splash BTNH ms", "splash BTNH/ours"]
  if not args.no_flash:
    header += ["flash ms", "flash/ours", "flash at"]
  for variant in args.ours_variants:
    header += [f"ours {variant} ms", f"{variant}/ours"]
  header += ["ours TFLOP/s", "% peak", "max err", "notes"]
  b = "b"
  splash_blocks = f"splash BlockSizes(block_q={b}, block_kv={b}, block_kv_compute={b}, block_q_dkv={b}, "
  splash_blocks += f"block_kv_dkv={b}, block_kv_dkv_compute={b}, block_q_dq={b}, block_kv_dq={b})"
  splash_blocks += " or use_fused_bwd_kernel=True" * args.splash_fused_bwd
  blocks_text = ", ".join(str(x) for x in args.peer_blocks)
  what = "the gradients alone" if not args.with_output else "the output and the gradients"
  report.table(
    f"{title}Block kernels: ring_attention(implementation='pallas_tpu') on one device vs splash attention at its best of "
    f"blocks b in {{{blocks_text}}} (capped at T){' and flash_attention' * (not args.no_flash)}; B={B} N={N} K={K} H={H} "
    f"bfloat16, scale 1/sqrt(H); fwd+bwd: {what}",
    header,
    rows,
    formats={"ours ms": ".3f", "splash ms": ".3f", "flash ms": ".3f", "splash/ours": ".2f", "flash/ours": ".2f"}
    | {"splash BTNH ms": ".3f", "splash BTNH/ours": ".2f", "ours TFLOP/s": ".1f", "% peak": ".1f", "max err": ".1e"}
    | {f"ours {v} ms": ".3f" for v in args.ours_variants}
    | {f"{v}/ours": ".2f" for v in args.ours_variants},
    notes=[
      f"{splash_blocks}; mask CausalMask / FullMask per head (make_splash_mha_single_device).",
      "splash at / flash at: the block size (and backward) of the peer's fastest candidate, whose time the row shows.",
      "flash_attention BlockSizes: every block b, block_b=1.  Ours: the planner's tiles (block_sizes=None) or",
      "--block-sizes; ours tiles: forward q x kv; backward q x kv.",
      "Layouts: ours q/k/v [B, T, N, H]; the peers [B, N, T, H] (transposed before timing); splash gets q * scale",
      "(it has no softmax scale; scaled before timing, its dq compared times the scale).  splash BTNH: the same",
      "splash on [B, T, N, H] q, k, v, transposing and scaling them and transposing its output back inside the timed",
      "call, as a model with that layout (ours) would call it.  peer/ours: the median of",
      "the per-round ratios (> 1: ours is faster).  TFLOP/s: useful FLOPs, forward 4 B N T^2 H, forward+backward",
      "3.5x the forward (benchmarking.cost), causal counted as half; % peak of the chip's bf16 peak.",
      f"max err: max |ours - splash| of the worst output / gradient (the check: <= {TOL:g} x max(1, max |peer|)).",
      *(
        [
          "ours V: our op with kernel variant V (--ours-variants; test hooks of the kernels, `KernelDebug`) at the",
          "same tiles as ours, checked against ours; V/ours > 1: the default is faster.",
        ]
        if args.ours_variants
        else []
      ),
    ],
  )
  return rows, header


# ------------------------------------------------------------------------------------------
# Table 2: ragged paged attention vs JAX's ragged_paged_attention.


def pages_for(tokens, page_size: int) -> np.ndarray:
  return -(-np.asarray(tokens) // page_size)


@dataclasses.dataclass
class PagedInputs:
  q: jax.Array  # [T, N, H]
  k: jax.Array  # [P, page, K, H]
  v: jax.Array
  meta: tuple  # kv_lens [S], page_indices [S, pages_per_seq], cu_q_lens [S + 1], num_seqs [1], all int32


def paged_inputs(
  step: Step, N: int, K: int, H: int, page_size: int, seed: int, *, contiguous: bool = False
) -> PagedInputs:
  """Exactly the pages the step needs, handed out in a shuffled order so no sequence's pages are contiguous
  (`contiguous`: in order, each sequence's pages one run, as a fresh `ServingEngine` allocates a prompt's)."""
  rng = np.random.default_rng(seed)
  need = pages_for(step.kv_lens, page_size)
  P = int(need.sum())
  perm = np.arange(P) if contiguous else rng.permutation(P)
  table = np.zeros((len(need), int(need.max())), np.int32)  # unused slots name page 0: never read
  starts = np.concatenate([[0], np.cumsum(need)])
  for i, n in enumerate(need):
    table[i, :n] = perm[starts[i] : starts[i] + n]
  cu = np.concatenate([[0], np.cumsum(step.q_lens)])
  keys = jax.random.split(jax.random.key(seed), 3)
  dt = jnp.bfloat16
  q = jax.random.normal(keys[0], (step.rows, N, H), dt)
  k, v = (jax.random.normal(key, (P, page_size, K, H), dt) for key in keys[1:])
  meta = tuple(jnp.asarray(x, jnp.int32) for x in (step.kv_lens, table, cu, [len(need)]))
  return PagedInputs(q, k, v, meta)


def combined_cache(k: jax.Array, v: jax.Array) -> jax.Array:
  """ragged_paged_attention's cache [P, page, 2K, H]: kv head i's K at index 2 i, its V at 2 i + 1."""
  P, page, K, H = k.shape
  return jnp.stack([k, v], axis=3).reshape(P, page, 2 * K, H)


def jax_paged_blocks(x: PagedInputs) -> str | None:
  """The (q rows x kv tokens) blocks ragged_paged_attention picks with its defaults (its tuned table), or None
  where it cannot say (off a TPU)."""
  try:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    T, N, H = x.q.shape
    _, page, K, _ = x.k.shape
    q_heads, kv_heads = rpa.get_min_heads_per_blk(N, 2 * K, x.q.dtype, x.k.dtype)
    pps = x.meta[1].shape[1]
    kv_pages, bq = rpa.get_tuned_block_sizes(x.q.dtype, x.k.dtype, q_heads, kv_heads // 2, H, page, T, pps)
    return f"{bq}x{kv_pages * page}"
  except Exception:
    return None


def our_paged_blocks(x: PagedInputs, blocks, pages=None) -> str | None:
  """The (q rows x kv tokens) blocks our op runs (display only): `--paged-blocks`, else what the op's Pallas TPU
  implementation plans for these operands (`pages`: ours (k, v), merged or not; None: x's), as the kernel takes
  them (`plans.check_supported`: a q block of at least one sublane tile of q's dtype, or all the rows; whole
  pages)."""
  try:
    from flax_ringattn._src.backends.pallas_tpu.paged import plans
    from flax_ringattn._src.paged.implementations import PagedPallasTpu

    k, v = (x.k, x.v) if pages is None else pages
    page = plans.page_size(k, v)
    if blocks is None:
      shape = dict(k_scale=None, v_scale=None, pages_per_seq=x.meta[1].shape[1], logits_soft_cap=None)
      blocks = PagedPallasTpu().blocks(q=x.q, k_pages=k, v_pages=v, block_sizes=None, **shape)
    bq, ppb = plans.check_supported(x.q, k, v, block_q=blocks.block_q, pages_per_block=blocks.block_kv // page)
    return f"{bq}x{ppb * page}"
  except Exception:
    return None


PAGED_FORMATS = {"KV MB": ".1f", "ours ms": ".3f", "jax ms": ".3f", "jax/ours": ".2f", "ours GB/s": ".0f"}
PAGED_FORMATS |= {"% HBM": ".1f", "max err": ".1e"}
PAGED_HEADER = ["batch", "rows", "seqs", "new tokens", "KV MB", "ours ms", "jax ms", "jax/ours", "ours GB/s", "% HBM"]
PAGED_HEADER += ["max err", "ours blocks", "jax blocks", "notes"]


def paged_table(report, cfg: Config, args, chip) -> None:
  if not args.paged_layouts:
    return paged_layout_table(report, cfg.steps, cfg.paged, args.page_size, args, chip, title="")
  pick = args.paged_steps or ["decode", "random", "mixed", "prefill"]
  steps = layout_steps(args.seed)
  if args.interpret:  # tiny: the same kinds of batches
    steps = {"decode": decode(4, 64), "random": Step("decode 4, random", (1,) * 4, (5, 40, 17, 64), 4)}
    steps |= {
      "mixed": cfg.steps[1],
      "prefill": mixed([(16, 16)] * 2, (), 32, "prefill 2 x 16 on 16"),
      "short": decode(4, 8),
    }
  everything = []
  for name, N, K, H, page in args.paged_layouts:
    if args.layout_timeout:  # each layout in a process of its own: one that hangs costs its timeout, no more
      rows = isolated_layout(report, name, args)
    else:
      paged = dict(N=N, K=K, H=H)
      chosen = tuple(steps[s] for s in pick)
      rows = paged_layout_table(report, chosen, paged, page or args.page_size, args, chip, title=f"{name}: ")
    everything += [[name, *row] for row in rows]
  # jax/ours against the peer; % HBM where the peer refuses the layout (the bar there: 60% on decode)
  summarize(report, "paged kernel, every layout", everything, (0, 1), {"jax/ours": 8, "% HBM": 10})


def isolated_layout(report, name: str, args) -> list:
  """--layout-timeout: layout `name`'s table run by this script in a child process (its other flags as given),
  read back from the child's JSON and re-emitted; a child that does not finish in time, or fails, leaves one row
  saying so.  Each child opens the chip anew (about 15 s on a v5e)."""
  with tempfile.TemporaryDirectory() as tmp:
    out = pathlib.Path(tmp) / "layout.json"
    argv = [*child_argv(args.argv), "--tables", "paged", "--paged-layouts", name, "--json", str(out)]
    try:
      proc = subprocess.run([sys.executable, __file__, *argv], timeout=args.layout_timeout, stdout=subprocess.DEVNULL)
      failed = None if proc.returncode == 0 and out.exists() else f"child exited {proc.returncode}"
    except subprocess.TimeoutExpired:
      failed = f"did not finish in {args.layout_timeout} s"
    if failed:
      report.note(f"\n{name}: {failed}")
      return [[failed] + [None] * (len(PAGED_HEADER) - 2) + [failed]]
    sections = json.loads(out.read_text())["sections"]
  (table,) = (x for x in sections if "table" in x and x["table"].startswith(f"{name}: "))
  rows = [[r[c] for c in table["columns"]] for r in table["rows"]]
  report.table(table["table"], table["columns"], rows, formats=PAGED_FORMATS, notes=table["notes"])
  return rows


def child_argv(argv: Sequence[str]) -> list[str]:
  """This run's flags less those `isolated_layout` sets per child (--tables, --paged-layouts, --layout-timeout,
  --json and their values)."""
  drop, out, skip = {"--tables", "--paged-layouts", "--layout-timeout", "--json"}, [], False
  for a in argv:
    if skip:
      skip = False
      if not a.startswith("-"):
        continue
    key = a.split("=", 1)[0]
    if key in drop:
      skip = "=" not in a  # the value follows (--json's is optional)
      continue
    out.append(a)
  return out


def paged_layout_table(report, steps, paged: dict, page: int, args, chip, *, title: str) -> list:
  """One table: every batch of `steps` on one head layout, ours (merged pages with --paged-layouts) against
  ragged_paged_attention, or against the HBM roofline where it refuses the layout."""
  N, K, H = paged["N"], paged["K"], paged["H"]
  scale, item = H**-0.5, 2
  merged_pages = bool(args.paged_layouts)
  bw = chip.memory_bandwidth if chip else None
  choices = args.paged_blocks or [None]  # None: the planner's blocks

  def ours_fn(blocks):
    return jax.jit(
      functools.partial(
        fr.paged_attention,
        scale=scale,
        implementation="pallas_tpu",
        block_sizes=blocks,
        interpret=True if args.interpret else None,
      )
    )

  ours_fns = [ours_fn(blocks) for blocks in choices]
  if args.interpret:
    # JAX's kernel does not run in TPU interpret mode: its jnp reference (one loop step per sequence, on the
    # same combined cache) stands in for it, checked and not timed.
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    peer_name, timed_peer = "jax ref", None
    peer_fn = lambda *a: ref_ragged_paged_attention(*a, sm_scale=scale)  # noqa: E731
  else:
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ragged_paged_attention

    rpa = functools.partial(ragged_paged_attention, sm_scale=scale, vmem_limit_bytes=args.vmem_limit_mib * MIB)
    peer_name, timed_peer, peer_fn = "jax", "jax", jax.jit(rpa)  # one jit: compiled once per shape
    # --jax-paged-blocks: jax's kernel at each (q rows, kv tokens) block too; the row reports its fastest
    sweep = {f"jax {bq}x{kv}": (bq, kv) for bq, kv in args.jax_paged_blocks if kv % page == 0}
    jax_at = {name: jax.jit(functools.partial(rpa, num_queries_per_block=bq, num_kv_pages_per_block=kv // page))
              for name, (bq, kv) in sweep.items()}  # fmt: skip
  bad = sorted(set(args.paged_rows or ()) - set(range(len(steps))))
  if bad:
    raise SystemExit(f"--paged-rows: no row {bad} (this run's paged table has rows 0 to {len(steps) - 1})")
  rows = []
  for i, step in enumerate(steps):
    if args.paged_rows is not None and i not in args.paged_rows:
      continue
    x = paged_inputs(step, N, K, H, page, args.seed + i, contiguous=args.paged_contiguous)
    kv = combined_cache(x.k, x.v)
    ours_pages = (x.k, x.v)
    if merged_pages:  # the layout PagedKVCache.create(merged=True) stores: a token's kv heads side by side
      ours_pages = tuple(a.reshape(*a.shape[:2], K * H) for a in (x.k, x.v))
      if args.paged_kv_pages:  # merged="kv": one [P, 2, page, K * H] array, v_pages None
        ours_pages = (jnp.stack(ours_pages, axis=1), None)
    live = step.new_tokens  # rows past the sequences' are padding: not compared
    to_ours = lambda o, live=live: o[:live]
    kv_bytes = sum(step.kv_lens) * K * H * item * 2  # K and V of every cached token each sequence attends to
    total = kv_bytes + 2 * step.rows * N * H * item  # + q read, out written
    # Several --paged-blocks: one row per choice, each checked and timed against the same (compiled once) peer.
    for blocks, ours in zip(choices, ours_fns, strict=True):
      peers = {peer_name: Candidate(peer_fn, (x.q, kv, *x.meta), to_ours, timed=timed_peer is not None)}
      if timed_peer is not None and H % 128 == 0:  # it refuses other head dims, at every block size
        peers |= {name: Candidate(fn, (x.q, kv, *x.meta), to_ours) for name, fn in jax_at.items()}
      if merged_pages and (args.paged_heads_pages or H % 128):
        # ragged_paged_attention refuses head dims that are not whole lanes: ours on 4-D pages is the check there
        peers["ours [P, page, K, H]"] = Candidate(ours, (x.q, x.k, x.v, *x.meta), to_ours)
      name = f"paged {title}{step.name}, {step.rows} rows"
      if len(choices) > 1:
        name += f", ours {our_paged_blocks(x, blocks, ours_pages)}"
      got = check_and_time(report, name, Candidate(ours, (x.q, *ours_pages, *x.meta), to_ours), peers, ("out",), args)
      heads_ms = ms(got["times"], "ours [P, page, K, H]")
      t = got["times"]
      t_ours = ms(t, "ours")
      gbs = total / t_ours / 1e6 if t_ours else None
      # jax at its best: its default blocks, or the fastest of --jax-paged-blocks
      best = timed_peer and best_peer(t, "jax")
      jax_at_best = jax_paged_blocks(x) if best == "jax" else best and best.split(" ", 1)[1]
      rows.append([step.name, step.rows, len(step.q_lens), step.new_tokens, kv_bytes / 1e6, t_ours,
                   ms(t, best), ratio(t, best), gbs,
                   gbs and bw and 100 * gbs * 1e9 / bw, got["err"], our_paged_blocks(x, blocks, ours_pages),
                   jax_at_best, notes_cell(got["errors"])])  # fmt: skip
      if merged_pages and (args.paged_heads_pages or H % 128):
        rows[-1][-1] = (
          (rows[-1][-1] + "; " if rows[-1][-1] else "") + f"[P,page,K,H] pages: {heads_ms:.3f} ms"
          if heads_ms
          else "[P,page,K,H] pages: -"
        )
    del x, kv  # the 16 x 16384 step's pages and combined cache alone take 2 GiB
  peer_note = (
    "JAX's ragged_paged_attention does not run in interpret mode: checked against its ref_ragged_paged_attention "
    "(jnp) instead, not timed."
    if args.interpret
    else f"jax: ragged_paged_attention(..., sm_scale, vmem_limit_bytes={args.vmem_limit_mib} MiB), the fastest of "
    "its tuned default blocks"
    + (
      f" and of {', '.join(f'{bq}x{kv}' for bq, kv in args.jax_paged_blocks)} (q rows x kv tokens; "
      "num_queries_per_block, num_kv_pages_per_block)"
      if args.jax_paged_blocks
      else ""
    )
    + "; 'jax blocks' names the fastest."
  )
  report.table(
    f"{title}Ragged paged attention: paged_attention(implementation='pallas_tpu') vs JAX's ragged_paged_attention; "
    f"N={N} K={K} H={H} bfloat16, page {page}, {'contiguous' if args.paged_contiguous else 'shuffled'} pages"
    + (", ours on merged pages" if merged_pages and not args.paged_kv_pages else "")
    + (", ours on kv pages [P, 2, page, K * H]" if merged_pages and args.paged_kv_pages else ""),
    PAGED_HEADER,
    rows,
    formats=PAGED_FORMATS,
    notes=[
      "rows: q rows of the call (T = max_num_batched_tokens; rows past the new tokens are padding, not compared).",
      (
        "Ours: kv pages [P, 2, page, K * H] (v_pages None)"
        if merged_pages and args.paged_kv_pages
        else "Ours: k_pages / v_pages merged [P, page, K * H]"
        if merged_pages
        else "Ours: k_pages / v_pages [P, page, K, H]"
      )
      + "; jax: one cache [P, page, 2K, H] (K at even, V at odd heads) built",
      f"from the same pages before timing.  {peer_note}",
      "Pages: exactly those the batch needs, in a random permutation.  KV MB / GB/s: the K and V bytes of each",
      "sequence's kv_len (no page padding), plus q and out, over our median time; % HBM of the chip's bandwidth.",
      "blocks: q rows x kv tokens per grid step (ours: the planner's, or --paged-blocks).  jax/ours: the median",
      f"of the per-round ratios (> 1: ours is faster).  max err: max |ours - jax| (the check: <= {TOL:g} x max(1,",
      "max |jax|)).",
    ],
  )
  return rows


# ------------------------------------------------------------------------------------------


def attached_chip():
  """(generation, the package's hardware figures) of the attached TPU, v5e's figures where the package does not
  know it; (None, None) off a TPU."""
  if jax.default_backend() != "tpu":
    return None, None
  try:
    from flax_ringattn._src.backends.pallas_tpu import planners

    gen = planners.current_generation()
  except Exception:
    gen = None
  if gen in hardware.TPU_GENERATIONS:
    return gen, hardware.tpu(gen)
  return gen, V5E


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
  )
  add = parser.add_argument
  add("--quick", action="store_true", help="small shapes (T=1024 block rows, small paged batches)")
  add("--interpret", action="store_true", help="kernels in Pallas TPU interpret mode, tiny shapes (default off a TPU)")
  add("--tables", default="block,paged", help="comma-separated, of block,paged")
  add("--repeats", type=int, default=None, help="timed rounds per row (default 20; 2 in interpret mode)")
  add("--warmup", type=int, default=2, help="untimed rounds before them (after the check's first call)")
  add(
    "--calls-per-round",
    type=int,
    default=None,
    help="calls per candidate and round, dispatched back to back with one wait at the end; the time is per call "
    "(default 10 on a TPU: device time, without a host round trip per call; 1 in interpret mode)",
  )
  add("--seq-lens", default="8192,32768", help="block table: T of the forward+backward rows")
  add("--fwd-seq-lens", default="8192", help="block table: T of the forward-only rows")
  add("--masks", default="causal,full", help="block table: comma-separated, of causal,full,window,segments")
  add("--window", type=int, default=1024, help="block table, window rows: tokens a query sees, itself included")
  add("--segments", type=int, default=4, help="block table, segments rows: equal documents per sequence")
  add(
    "--block-layouts",
    default=None,
    metavar="B/N/K/H[,...]",
    help="block table: one table per layout (batch / q heads / kv heads / head dim); 'models': the real models' "
    "training layouts (all heads on one chip)",
  )
  add("--batch", type=int, default=1, help="block table: B")
  add("--num-heads", type=int, default=8, help="block table: N (= K)")
  add("--head-dim", type=int, default=128, help="block table: H")
  add("--no-flash", action="store_true", help="block table: leave out JAX's flash_attention")
  add(
    "--peer-blocks",
    default=str(PEER_BLOCK),
    help="block table: splash's and flash_attention's block sizes to try, comma-separated; each row reports each "
    "peer's fastest (e.g. 256,512,1024)",
  )
  add(
    "--with-output",
    action="store_true",
    help="block table: fwd+bwd rows time the output and the gradients as two results (default: the gradients "
    "alone, as a training step keeps them; timing both runs splash's forward twice)",
  )
  add(
    "--splash-fused-bwd",
    action="store_true",
    help="block table: fwd+bwd rows also try splash's fused dq/dk/dv backward kernel at each block size",
  )
  add(
    "--no-splash-layout",
    action="store_true",
    help="block table: leave out 'splash BTNH' (splash called on [B, T, N, H], the layout work timed)",
  )
  add(
    "--ours-variants",
    default="",
    metavar="V[,V...]",
    help="block table: also time our op with these kernel variants (KernelDebug fields, '+'-joined: heads_major, "
    "natural_exp, whole_partial_tiles, fused_backward, split_backward, e.g. heads_major+natural_exp), each checked against ours and given its ms "
    "and variant/ours columns",
  )
  add(
    "--block-sizes",
    nargs="+",
    default=None,
    metavar="BQ,BK[,BQB,BKB]",
    help="block table: our tiles, forward (and backward) q,kv (default: the planner); several: a sweep, one row per "
    "choice and shape, each timed against the same compiled peers",
  )
  add("--page-size", type=int, default=16, help="paged table: tokens per page")
  add(
    "--paged-layouts",
    default=None,
    metavar="N/K/H[/PAGE][,...]",
    help="paged table: q heads / kv heads / head dim (/ page size) per chip, one table each (default 32/8/128; "
    "'models': the real layouts of MODEL_LAYOUTS); our pages are merged [P, page, K * H]",
  )
  add(
    "--paged-steps",
    default=None,
    help="paged table: which batches, comma-separated names of LAYOUT_STEPS (default: the classic five; with "
    "--paged-layouts, 'decode,random,mixed,prefill')",
  )
  add(
    "--paged-fwd-slots",
    type=int,
    default=None,
    metavar="N",
    help="paged table: the paged forward's kv slots, N - 1 kv blocks in flight while one is computed (default: the "
    "library's, tiling.PAGED_FWD_SLOTS)",
  )
  add(
    "--paged-contiguous",
    action="store_true",
    help="paged table: each sequence's pages in one run of consecutive ids (default: shuffled)",
  )
  add("--paged-heads-pages", action="store_true", help="paged table: also time ours on [P, page, K, H] pages")
  add(
    "--paged-kv-pages",
    action="store_true",
    help="paged table with --paged-layouts: ours on kv pages [P, 2, page, K * H] (merged='kv': a page's K and V "
    "in one array, one copy each) instead of merged K and V pages",
  )
  add(
    "--layout-timeout",
    type=float,
    default=None,
    metavar="S",
    help="paged table with --paged-layouts: run each layout in a child process and stop it after S seconds (a "
    "row that hangs in compile then costs S, not the run)",
  )
  add(
    "--paged-blocks",
    nargs="+",
    default=None,
    metavar="BQ,BKV",
    help="paged table: our BlockSizes as block_q,block_kv (default: the planner); several: a sweep, one row per "
    "choice and batch, each timed against the same compiled jax kernel",
  )
  add(
    "--jax-paged-blocks",
    default="32x1024,32x4096,64x2048,16x2048,128x1024",
    metavar="BQxKV[,...]",
    help="paged table: ragged_paged_attention's blocks to try beside its tuned defaults, q rows x kv tokens "
    "(num_queries_per_block x num_kv_pages_per_block * page; '' for its defaults alone); each row reports its fastest",
  )
  add("--paged-rows", default=None, help="paged table: comma-separated row numbers to run, from 0 (default: all)")
  add("--vmem-limit-mib", type=int, default=64, help="paged table: ragged_paged_attention's vmem_limit_bytes")
  add("--seed", type=int, default=0)
  bench.add_compilation_cache_args(parser)
  # --json as the other scripts take it (the JSON document on stdout), or --json PATH: Markdown on stdout and the
  # same document written to PATH, so one TPU run leaves both.
  add("--json", nargs="?", const="-", default=None, metavar="PATH", help="the report as JSON: on stdout, or to PATH")
  args = parser.parse_args(argv)
  args.argv = list(sys.argv[1:] if argv is None else argv)
  ints = lambda text: [int(s) for s in text.split(",") if s.strip()]
  names = lambda text: [s.strip() for s in text.split(",") if s.strip()]
  args.seq_lens, args.fwd_seq_lens = ints(args.seq_lens), ints(args.fwd_seq_lens)
  args.masks, args.tables = names(args.masks), names(args.tables)
  args.ours_variants = names(args.ours_variants)
  try:
    args.peer_blocks = ints(args.peer_blocks)
  except ValueError:
    parser.error(f"--peer-blocks takes block sizes, got {args.peer_blocks!r}")
  for variant in args.ours_variants:
    try:
      variant_debug(variant)
    except ValueError as e:
      parser.error(f"--ours-variants: {e}")
  try:
    args.paged_layouts = parse_layouts(args.paged_layouts)
  except ValueError as e:
    parser.error(f"--paged-layouts: {e}")
  args.paged_steps = None if args.paged_steps is None else names(args.paged_steps)
  try:
    pairs = [tuple(int(n) for n in b.split("x")) for b in names(args.jax_paged_blocks)]
    assert all(len(b) == 2 and min(b) > 0 for b in pairs)
    args.jax_paged_blocks = pairs
  except (ValueError, AssertionError):
    parser.error(f"--jax-paged-blocks takes BQxKV pairs such as 32x1024, got {args.jax_paged_blocks!r}")
  try:
    args.paged_rows = None if args.paged_rows is None else ints(args.paged_rows)
  except ValueError:
    parser.error(f"--paged-rows takes row numbers, got {args.paged_rows!r}")
  if args.block_sizes is not None:
    try:
      tiles = [ints(text) for text in args.block_sizes]
    except ValueError:
      tiles = [()]
    if any(len(t) not in (2, 4) for t in tiles):
      parser.error(f"--block-sizes takes BQ,BK or BQ,BK,BQB,BKB, got {' '.join(args.block_sizes)}")
    names = ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd")
    args.block_sizes = [fr.BlockSizes(**dict(zip(names, t, strict=False))) for t in tiles]
  if args.paged_blocks is not None:
    try:
      pairs = [ints(text) for text in args.paged_blocks]
    except ValueError:
      pairs = [()]
    if any(len(p) != 2 for p in pairs):
      parser.error(f"--paged-blocks takes block_q,block_kv pairs, got {' '.join(args.paged_blocks)}")
    args.paged_blocks = [fr.BlockSizes(block_q=bq, block_kv=bkv) for bq, bkv in pairs]
  for m in args.masks:
    if m not in ("causal", "full", "window", "segments"):
      parser.error(f"unknown mask {m!r}; known: causal, full, window, segments")
  try:
    args.block_layouts = parse_block_layouts(args.block_layouts)
  except ValueError as e:
    parser.error(f"--block-layouts: {e}")
  for t in args.tables:
    if t not in ("block", "paged"):
      parser.error(f"unknown table {t!r}; known: block, paged")
  if jax.default_backend() != "tpu":
    args.interpret = True  # no TPU: only interpret mode can run the kernels
  if args.interpret:
    args.quick = True
  if args.repeats is None:
    args.repeats = 2 if args.interpret else 20
  if args.calls_per_round is None:
    args.calls_per_round = 1 if args.interpret else 10
  if args.calls_per_round < 1:
    parser.error(f"--calls-per-round must be >= 1, got {args.calls_per_round}")
  if args.interpret:
    args.warmup = min(args.warmup, 1)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  start = time.perf_counter()
  args = parse_args(argv)
  cache = bench.compilation_cache_from_args(args)  # a second start reads the compiled kernels and peers back
  if args.paged_fwd_slots is not None:  # an A/B of the paged forward's kv slots (this process only)
    from flax_ringattn._src.backends.pallas_tpu import tiling

    tiling.PAGED_FWD_SLOTS = args.paged_fwd_slots
  cfg = config(args)
  gen, chip = attached_chip()
  dev = jax.devices()[0]
  if args.interpret:
    mode = f"Pallas TPU interpret mode on {jax.default_backend()} (tiny shapes; the timings mean nothing)"
  else:
    mode = f"compiled for the TPU; figures of {chip.label} from benchmarking.hardware"
    if gen not in hardware.TPU_GENERATIONS:
      mode += f" (generation {gen!r} is not in the table: v5e's figures)"
  meta = {
    "chip": f"{dev.device_kind} ({dev.platform}, generation {gen or '-'})",
    "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    "jax": f"{jax.__version__}, jaxlib {jax.lib.__version__}",
    "machine": bench.machine(),
    "mode": mode,
    "timing": f"median of {args.repeats} interleaved rounds after {args.warmup} warm-up rounds; every call jitted; "
    + (
      "each call block_until_ready'd"
      if args.calls_per_round == 1
      else f"{args.calls_per_round} calls back to back per candidate and round, the last block_until_ready'd, "
      "time per call"
    ),
  }
  if chip:
    meta["chip figures"] = f"bf16 peak {chip.peak_flops('bfloat16') / 1e12:.0f} TFLOP/s, HBM "
    meta["chip figures"] += f"{chip.memory_bandwidth / 1e9:.0f} GB/s"
  report = bench.Report(
    "tpu_kernels: this project's Pallas TPU kernels vs JAX's (splash, flash_attention, ragged_paged_attention)",
    json=args.json == "-",
    meta=meta,
  )
  try:
    if "block" in args.tables:
      block_table(report, cfg, args, chip)
    if "paged" in args.tables:
      paged_table(report, cfg, args, chip)
  except SystemExit:  # a wrong result (Report.require): the JSON file still gets the failed check
    write_json(report, args.json)
    raise
  load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  where = (
    "The kernels share the host's cores with everything else."
    if args.interpret
    else "The chip runs this process alone; host load can only delay dispatch, which the interleaved rounds "
    "spread over every candidate alike."
  )
  report.note(f"\nHost load average at the end: {load} (the machine line has the start).  {where}")
  report.note(f"Host round trip, timed after the rows: {round_trip(args)}.")
  if cache is not None:
    report.note(cache.summary())
  report.progress(f"ran {time.perf_counter() - start:.0f} s")
  code = report.finish()
  write_json(report, args.json)
  return code


def round_trip(args) -> str:
  """What the host adds to a call that is waited for: a tiny jitted call timed once per round, and back to back
  as the rows are (`--calls-per-round`)."""
  x = jnp.zeros((8, 128), jnp.float32)
  tiny = jax.jit(lambda x: x + 1.0)
  jax.block_until_ready(tiny(x))
  one = median(time_interleaved({"tiny": lambda: tiny(x)}, 20, warmup=2)["tiny"]) * 1e3
  text = f"a tiny jitted call waited for each time: {one:.3f} ms"
  if args.calls_per_round > 1:
    n = args.calls_per_round
    many = median(time_interleaved({"tiny": lambda: tiny(x)}, 20, warmup=2, calls_per_round=n)["tiny"]) * 1e3
    text += f"; {n} back to back: {many:.3f} ms per call"
  return text


def write_json(report: bench.Report, path: str | None) -> None:
  """--json PATH: the finished report once more, as its JSON document, into PATH (`finish` prints the document
  where `stream` points when `json` is set, and prints nothing else a second time)."""
  if path in (None, "-"):
    return
  with open(path, "w") as f:
    report.json, report.stream = True, f
    report.finish()
  report.progress(f"JSON report written to {path}")


if __name__ == "__main__":
  sys.exit(main())

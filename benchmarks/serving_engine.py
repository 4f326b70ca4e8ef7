"""The serving engine against the model's own dense-cache decode: tokens/s and KV-cache bytes, on CPU.

What it measures
----------------
One decoder (``--layers`` (2) blocks of ``nnx.MultiHeadAttention``, 4 q heads :
2 kv heads, head_dim 32, learned positions, float32, random weights) serves
``--prompts`` (8) prompts of skewed lengths (``--min-len`` 32 to ``--max-len``
512 tokens) and generates ``--new-tokens`` (32) greedy tokens for each, three
ways, in the same run:

* **dense cache (flax decode=True)**: the model's own cache path.  Every
  attention layer's ``init_cache`` holds ``[prompts, max_len + new, kv heads,
  head_dim]``; the batch is right-padded and fed one token per step (prompt
  tokens, then each row's own last token), ``max(len + new) - 1`` steps of one
  jitted call.  This is how an NNX model decodes from flax's cache: one
  cache index for the whole batch, so every row pays for the longest.
* **ServingEngine**: ``convert(model, to="paged")``, then
  ``ServingEngine.generate``: chunked prefill in ragged steps of at most
  ``--max-batched-tokens`` (256) rows, decodes beside them, pages of
  ``--page-size`` (16) tokens, as many pages as the sequences need.
* **ServingEngine + NGramDraft**: the same engine with prompt-lookup
  speculative decoding (``NGramDraft(n=2, k=4)``).

Before timing, the three runs' tokens are checked equal (greedy, so the engine
must reproduce the dense decode token for token); a difference exits 1 and
nothing is timed.  Then ``--repeats`` (3) interleaved rounds of each whole
``generate`` (compiled beforehand: one warm-up round), medians and paired
ratios.  Cache bytes are the arrays each way allocates (every layer's K and
V), and, for the engine, the pages the sequences held at their longest.  The
load average is printed: the machine's other work moves the times, the
ratios less.

Run it::

  python benchmarks/serving_engine.py --quick     # smoke size, < 1 min
  python benchmarks/serving_engine.py             # 8 prompts of 32-512 tokens, 32 new tokens each
  python benchmarks/serving_engine.py --json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
  import flax_ringattn  # noqa: F401 -- installed, or this checkout (below)
except ImportError:  # running from a checkout that is not installed
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import flax_ringattn as fr
from flax_ringattn import benchmarking as bench
from flax_ringattn.benchmarking import median, paired_ratio, time_interleaved

EXIT_WRONG_RESULT = bench.EXIT_WRONG_RESULT
VOCAB, D, HEADS, KV_HEADS = 256, 128, 4, 2


class Block(nnx.Module):
  def __init__(self, rngs):
    self.norm1, self.norm2 = nnx.RMSNorm(D, rngs=rngs), nnx.RMSNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(HEADS, D, num_kv_heads=KV_HEADS, decode=False, rngs=rngs)
    self.up, self.down = nnx.Linear(D, 4 * D, rngs=rngs), nnx.Linear(4 * D, D, rngs=rngs)

  def __call__(self, x, mask, decode):
    x = x + self.attn(self.norm1(x), mask=mask, decode=decode)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class Decoder(nnx.Module):
  """model(tokens [B, T], positions [B, T]) -> logits [B, T, VOCAB]; decode=True: one token per row from flax's
  cache (`init_cache` first)."""

  def __init__(self, layers: int, max_len: int, *, rngs):
    self.embed, self.pos = nnx.Embed(VOCAB, D, rngs=rngs), nnx.Embed(max_len, D, rngs=rngs)
    self.blocks = nnx.List([Block(rngs) for _ in range(layers)])

  def __call__(self, tokens, positions, *, decode=False):
    T = tokens.shape[1]
    mask = None if decode else nnx.make_causal_mask(jnp.ones((1, T)))  # decode: flax masks by its cache index
    x = self.embed(tokens) + self.pos(positions)
    for block in self.blocks:
      x = block(x, mask, decode)
    return self.embed.attend(x)


def engine_call(model, tokens, positions):
  return model(tokens, positions)


def make_prompts(args) -> list[list[int]]:
  rng = np.random.default_rng(args.seed)
  lens = np.geomspace(args.min_len, args.max_len, args.prompts).round().astype(int)
  rng.shuffle(lens)
  return [list(map(int, rng.integers(1, VOCAB, n))) for n in lens]


class DenseDecode:
  """Greedy decoding of a right-padded batch from the model's own cache (`decode=True`), one jitted step."""

  def __init__(self, model: Decoder, prompts, new_tokens: int):
    self.prompts, self.new = prompts, new_tokens
    self.length = max(len(p) + new_tokens for p in prompts)
    for block in model.blocks:
      block.attn.init_cache((len(prompts), self.length, D))
    self.graphdef, self.params, self.fresh = nnx.split(model, nnx.Param, nnx.Cache)

    def step(params, cache, tokens, position):
      model = nnx.merge(self.graphdef, params, cache)
      logits = model(tokens[:, None], jnp.full_like(tokens, position)[:, None], decode=True)
      return jnp.argmax(logits[:, 0], -1).astype(jnp.int32), nnx.state(model, nnx.Cache)

    self.step = jax.jit(step, donate_argnums=(1,))

  @property
  def cache_bytes(self) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(self.fresh) if x.ndim == 4)

  def __call__(self) -> list[list[int]]:
    B = len(self.prompts)
    lens = np.array([len(p) for p in self.prompts])
    padded = np.zeros((B, self.length), np.int32)
    for b, p in enumerate(self.prompts):
      padded[b, : len(p)] = p
    cache = jax.tree.map(jnp.copy, self.fresh)  # the step donates it
    out = [[] for _ in range(B)]
    tokens = padded[:, 0]
    for t in range(self.length - 1):
      chosen, cache = self.step(self.params, cache, jnp.asarray(tokens), t)
      chosen = np.asarray(chosen)
      nxt = padded[:, t + 1].copy()
      for b in range(B):
        if t >= lens[b] - 1 and len(out[b]) < self.new:  # past the prompt: the row's own greedy token
          out[b].append(int(chosen[b]))
          nxt[b] = chosen[b]
      tokens = nxt
    return out


def make_engine(model, prompts, args) -> tuple[fr.ServingEngine, int]:
  """(engine, the pages its sequences need at their longest): one slot per prompt, as many pages as that."""
  need = sum(-(-(len(p) + args.new_tokens - 1) // args.page_size) for p in prompts)
  pages_per_seq = -(-(max(map(len, prompts)) + args.new_tokens) // args.page_size)
  fr.convert(model, to="paged")
  engine = fr.ServingEngine(
    model,
    call=engine_call,
    num_pages=need,
    page_size=args.page_size,
    max_num_seqs=len(prompts),
    pages_per_seq=pages_per_seq,
    max_num_batched_tokens=args.max_batched_tokens,
  )
  return engine, need


def engine_cache_bytes(engine) -> int:
  caches = nnx.state(engine.model, nnx.Cache)
  leaves = jax.tree.leaves(caches, is_leaf=lambda x: isinstance(x, fr.PagedKVCache))
  pages = lambda c: c.k_pages.nbytes + (0 if c.v_pages is None else c.v_pages.nbytes)  # noqa: E731 (kv pages)
  return sum(pages(c) for c in leaves if isinstance(c, fr.PagedKVCache))


def check(runs: dict[str, list[list[int]]], reference: str) -> list[bench.Check]:
  want = np.array(runs[reference])
  return [
    bench.compare(f"{name}: tokens vs {reference}", np.array(got), want, tol=0.5)
    for name, got in runs.items()
    if name != reference
  ]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  parser.add_argument("--prompts", type=int, default=8, help="prompts served together")
  parser.add_argument("--min-len", type=int, default=32, help="shortest prompt (tokens)")
  parser.add_argument("--max-len", type=int, default=512, help="longest prompt (tokens)")
  parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens generated per prompt")
  parser.add_argument("--layers", type=int, default=2, help="decoder blocks")
  parser.add_argument("--page-size", type=int, default=16, help="tokens per page")
  parser.add_argument("--max-batched-tokens", type=int, default=256, help="rows of one ragged engine step")
  parser.add_argument("--repeats", type=int, default=3, help="interleaved timed rounds (median)")
  parser.add_argument("--seed", type=int, default=0, help="weights and prompts")
  parser.add_argument("--quick", action="store_true", help="smoke size (< 1 min)")
  bench.add_report_args(parser)
  args = parser.parse_args(argv)
  if args.quick:
    args.prompts, args.max_len, args.new_tokens = min(args.prompts, 4), min(args.max_len, 96), min(args.new_tokens, 8)
    args.max_batched_tokens, args.repeats = min(args.max_batched_tokens, 64), min(args.repeats, 2)
  return args


def main(argv: Sequence[str] | None = None) -> int:
  start = time.perf_counter()
  args = parse_args(argv)
  load = os.getloadavg()
  prompts = make_prompts(args)
  lens = sorted(map(len, prompts))
  report = bench.Report(
    "serving_engine: ServingEngine (paged cache, ragged steps) vs the model's own dense-cache decode",
    json=args.json,
    meta={
      "machine": bench.machine(),
      "load average at start (1, 5, 15 min)": ", ".join(f"{x:.1f}" for x in load),
      "workload": (
        f"{args.prompts} prompts of {lens} tokens, {args.new_tokens} greedy tokens each; decoder of {args.layers} "
        f"nnx.MultiHeadAttention blocks, d_model {D}, heads {HEADS}:{KV_HEADS}, vocab {VOCAB}, float32; page "
        f"{args.page_size}, <= {args.max_batched_tokens} rows per engine step; {args.repeats} repeats"
      ),
    },
  )
  max_len = max(lens) + args.new_tokens
  dense_model = Decoder(args.layers, max_len, rngs=nnx.Rngs(args.seed))
  dense = DenseDecode(dense_model, prompts, args.new_tokens)
  engine, pages_needed = make_engine(Decoder(args.layers, max_len, rngs=nnx.Rngs(args.seed)), prompts, args)
  draft = fr.NGramDraft(n=2, k=4)
  names = ("dense cache (flax decode=True)", "ServingEngine", "ServingEngine + NGramDraft")
  calls = {
    names[0]: dense,
    names[1]: lambda: engine.generate(prompts, max_new_tokens=args.new_tokens),
    names[2]: lambda: engine.generate(prompts, max_new_tokens=args.new_tokens, draft=draft),
  }
  t0 = time.perf_counter()
  runs = {name: call() for name, call in calls.items()}  # also compiles each
  report.progress(f"checked (and compiled) in {time.perf_counter() - t0:.1f} s")
  report.require(check(runs, names[0]))

  generated = args.prompts * args.new_tokens
  steps0, drafts0 = engine.stats.steps, (engine.stats.draft_proposed, engine.stats.draft_accepted)
  times = time_interleaved(calls, args.repeats, warmup=0)
  rounds = args.repeats
  engine_steps = (engine.stats.steps - steps0) / (2 * rounds)  # both engine rows, averaged
  proposed = engine.stats.draft_proposed - drafts0[0]
  accepted = engine.stats.draft_accepted - drafts0[1]
  notes = []
  for name in names[1:]:
    pr = paired_ratio(times[names[0]], times[name])
    notes.append(
      f"dense / {name} (paired median of {len(pr.ratios)} interleaved rounds): {pr.ratio:.2f}x; it was the "
      f"slower one in {pr.losses}/{len(pr.ratios)} rounds."
    )
  report.table(
    f"Greedy generation of {args.prompts} x {args.new_tokens} tokens (whole generate call)",
    ["way", "median s", "tokens/s"],
    [[name, median(t), generated / median(t)] for name, t in times.items()],
    formats={"median s": ".3f", "tokens/s": ",.0f"},
    notes=notes,
  )
  dense_bytes, paged_bytes = dense.cache_bytes, engine_cache_bytes(engine)
  page_bytes = paged_bytes // engine.num_pages
  report.table(
    "KV-cache bytes (every layer's K and V)",
    ["way", "allocated MiB", "held by the sequences MiB"],
    [
      [names[0], dense_bytes / 2**20, dense_bytes / 2**20],
      ["ServingEngine", paged_bytes / 2**20, pages_needed * page_bytes / 2**20],
    ],
    formats={"allocated MiB": ".2f", "held by the sequences MiB": ".2f"},
    notes=[
      f"dense: {args.prompts} rows x {dense.length} positions (the longest prompt + new tokens, for every row); "
      f"engine: {engine.num_pages} pages of {args.page_size} tokens, what the sequences need "
      f"({dense_bytes / paged_bytes:.2f}x less)."
    ],
  )
  dense_steps = dense.length - 1
  end_load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
  report.note(
    "\nNotes:\n"
    f"- Steps per generate: dense {dense_steps} (one token per row per step, every row for the longest); engine "
    f"{engine_steps:.0f} on average over its two rows (chunked prefill of up to {args.max_batched_tokens} rows, "
    f"then one decode step per token, or fewer with the draft: {accepted}/{proposed} proposed tokens accepted in "
    "the timed rounds).\n"
    f"- Each engine step runs the model on all {args.max_batched_tokens} rows of its fixed shape, padding "
    "included, so a decode step costs like a prefill chunk on CPU; on an accelerator the ragged kernel skips the "
    "padding's attention, the MLPs do not.\n"
    f"- {os.cpu_count()} cores, load average {end_load} at the end."
  )
  if args.quick:
    report.note("\n(--quick: smoke size; the timings are meant for the default size)")
  report.progress(f"{bench.machine()}; ran {time.perf_counter() - start:.0f} s")
  return report.finish()


if __name__ == "__main__":
  sys.exit(main())

"""Serve the model trained by `train_long_context.py` with `flax_ringattn.ServingEngine`.

What it shows
-------------
* The checkpoint loads into the Transformer as trained (`_model.py`, plain
  `nnx.MultiHeadAttention`), one call converts it, `fr.convert(model,
  to="paged")`, and `fr.ServingEngine` serves it through its own `__call__`:
  continuous batching, chunked prefill beside decodes in one ragged batch,
  admission when slots and pages free up, eviction rather than overflow, and
  prefix reuse.  No forward pass, scheduler or cache code here.
* Retrieval requests with long contexts (2k to 8k tokens: a key -> value
  table, then questions).  Each of a request's last questions is its own
  prompt (the context, the earlier (key, value) pairs, the asked key) and the
  engine generates its value.  The questions of a request share the context:
  its pages are computed once and shared (`shared` in the stats line).  It
  prints each request's answers against the truth, the retrieval accuracy and
  the engine's stats.
* Token shift: the model adds an embedding of each token's predecessor
  (`_model.previous_tokens`), but the engine's `call(model, tokens,
  positions)` sees a flat ragged batch in which a sequence's first row of a
  step has no predecessor.  So each engine token here is the pair (previous
  token, token), encoded `prev * V + token`, and `call` returns logits over
  the pairs in which only those starting with the row's own token are
  possible: the engine's greedy pair is (token, the model's greedy next).
* `--context-parallel N`: the caches' pages spread over N devices
  (`convert(..., mesh=, seq_axis="sp")`, the engine given the same), and
  contexts of at least `--max-batched-tokens` tokens prefilled by the ring,
  sequence-parallel.  The same prompts are served on one device first, and
  the answers must be equal (exit status 1 if not).  On a CPU the script asks
  for N host devices itself (unless XLA_FLAGS already sets a count).

Run it after training (`make demo` runs both)::

  python examples/train_long_context.py
  python examples/serve_paged.py [--run-dir runs/train_long_context] [--requests 6] [--context-parallel 8]
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--run-dir", default="runs/train_long_context", help="what train_long_context.py wrote")
  p.add_argument("--requests", type=int, default=6, help="requests (contexts)")
  p.add_argument("--queries", type=int, default=6, help="questions per request (a prompt each)")
  p.add_argument("--prompt-lens", default="2048,4096,6144,8192", help="context lengths cycled over the requests")
  p.add_argument("--max-seqs", type=int, default=3, help="concurrent sequences (cache slots)")
  p.add_argument("--max-batched-tokens", type=int, default=1024, help="rows of one ragged step")
  p.add_argument("--page-size", type=int, default=16, help="tokens per cache page")
  p.add_argument("--num-pages", type=int, default=None, help="pages of the cache; None: every slot full")
  p.add_argument(
    "--context-parallel",
    type=int,
    default=1,
    metavar="N",
    help="spread the KV cache over N devices; also serves on one device and checks the answers are equal",
  )
  p.add_argument("--seed", type=int, default=1, help="requests (contexts and questions)")
  # benchmarking.add_compilation_cache_args's flags, spelled here: parsing runs before JAX may be imported
  p.add_argument("--compilation-cache", default="~/.cache/flax_ringattn/jax-compilation-cache", metavar="DIR",
                 help="JAX's persistent compilation cache: a second start reads compiled programs back")  # fmt: skip
  p.add_argument("--no-compilation-cache", action="store_true", help="compile everything anew, cache nothing")
  args = p.parse_args(argv)
  if args.context_parallel < 1:
    p.error(f"--context-parallel must be >= 1, got {args.context_parallel}")
  return args


def request_host_devices(n: int) -> None:
  """N simulated CPU devices for --context-parallel N; must run before jax is imported.  Skipped when
  XLA_FLAGS already sets a device count or JAX_PLATFORMS asks for another platform."""
  flags, platforms = os.environ.get("XLA_FLAGS", ""), os.environ.get("JAX_PLATFORMS", "")
  if n <= 1 or "xla_force_host_platform_device_count" in flags:
    return
  if platforms and "cpu" not in platforms.lower().split(","):
    return
  os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


if __name__ == "__main__":
  ARGS = parse_args()
  request_host_devices(ARGS.context_parallel)

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType

try:
  import flax_ringattn as fr
except ImportError:  # running from a source checkout without `pip install -e .`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import flax_ringattn as fr
from flax_ringattn import benchmarking

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _model
from train_long_context import KVRetrievalTask


def make_requests(args, vocab_size: int):
  """[(tokens, at)]: a request's sequence (context, then its last questions as (key, value) pairs) and the
  indices of the asked keys; question i's prompt is tokens[: at[i] + 1], its answer tokens[at[i] + 1]."""
  rng = np.random.default_rng(args.seed)
  lens = [int(x) for x in args.prompt_lens.split(",")]
  requests = []
  for r in range(args.requests):
    task = KVRetrievalTask(lens[r % len(lens)], num_queries=args.queries, num_pairs=128)
    if task.vocab_size != vocab_size:
      raise SystemExit(f"the checkpoint's vocabulary ({vocab_size}) does not match the retrieval task's")
    sample = task.sample(rng, 1)
    tokens = np.concatenate([sample["tokens"][0], sample["targets"][0, -1:]])
    requests.append((tokens, np.nonzero(sample["mask"][0])[0]))
  return requests


def as_pairs(tokens, V: int) -> list[int]:
  """Engine tokens: each token with its predecessor, prev * V + token (BOS before the first)."""
  tokens = np.asarray(tokens)
  return [int(p) * V + int(t) for p, t in zip(_model.previous_tokens(tokens), tokens, strict=True)]


def pair_call(V: int):
  """call(model, pairs, positions): the model's own forward, its logits spread over the V * V pairs."""

  def call(model, pairs, positions):
    tokens = pairs % V
    logits = model(tokens, positions, pairs // V)  # [1, T, V]
    this = jnp.arange(V) == tokens[..., None]  # the next pair starts with this row's token
    return jnp.where(this[..., None], logits[..., None, :], -jnp.inf).reshape(*tokens.shape, V * V)

  return call


def serve(args, requests, mesh=None):
  """The generated answer of every question (request-major), served on one device or spread over `mesh`."""
  model = _model.load_model(args.run_dir)
  spread = {} if mesh is None else dict(mesh=mesh, seq_axis="sp")
  print(fr.convert(model, to="paged", **spread))  # the blocks' attn(x, is_causal=True) calls stay as written
  V = model.config.vocab_size
  prompts = [as_pairs(tokens[: a + 1], V) for tokens, at in requests for a in at]
  n = 1 if mesh is None else mesh.shape["sp"]
  new_tokens = 2  # the answer and one more (see generate below)
  pages_per_seq = -(-(max(map(len, prompts)) + new_tokens - 1) // args.page_size)  # the last token is not cached
  num_pages = args.num_pages or n * args.max_seqs * -(-pages_per_seq // n)  # a multiple of n when spread
  engine = fr.ServingEngine(
    model,
    call=pair_call(V),
    num_pages=num_pages,
    page_size=args.page_size,
    max_num_seqs=args.max_seqs,
    pages_per_seq=pages_per_seq,
    max_num_batched_tokens=args.max_batched_tokens,
    **spread,
  )
  where = "one device" if mesh is None else f"{n} devices (each holds {num_pages // n} of the pages)"
  print(
    f"serving {len(prompts)} prompts ({len(requests)} contexts of {sorted({len(t) for t, _ in requests})} tokens, "
    f"{args.queries} questions each) with {args.max_seqs} slots x {pages_per_seq} pages of {args.page_size} "
    f"tokens ({num_pages} pages) on {where}, <= {args.max_batched_tokens} tokens per step"
  )
  # Two tokens, the answer and one more: with one, a question would leave in the step that computes the
  # context's pages, before the others share them (see the report).
  answers = [out[0] % V for out in engine.generate(prompts, max_new_tokens=new_tokens)]
  stats = engine.stats

  correct = 0
  for r, (tokens, at) in enumerate(requests):
    got, want = answers[r * len(at) : (r + 1) * len(at)], tokens[at + 1]
    correct += sum(int(g == w) for g, w in zip(got, want, strict=True))
    shown = " ".join(f"{g}" if g == w else f"{g}(want {w})" for g, w in zip(got, want, strict=True))
    print(f"request {r}: context {at[0]:5d} tokens -> answers {shown}")
  computed = stats.prefill_tokens_computed
  print(
    f"accuracy {correct}/{len(answers)} = {correct / len(answers):.2f} (chance {1 / 64:.3f}); "
    f"{stats.prompt_tokens} prompt tokens ({computed} computed, {stats.shared_prefix_tokens} shared) in "
    f"{stats.steps} steps ({stats.ring_prefills} ring prefills, {stats.compiles} compiles), {stats.seconds:.1f} s "
    f"({stats.compile_seconds:.1f} s in the calls that compiled) = {computed / stats.seconds:,.0f} prefill tokens/s; "
    f"page-cache utilisation mean {stats.cache_utilization:.1%}; "
    f"{stats.evictions} evictions"
  )
  return answers


def main(args):
  cache = benchmarking.compilation_cache_from_args(args)  # a second start reads the compiled programs back
  try:
    return _serve_all(args)
  finally:
    if cache is not None:
      print(cache.summary())


def _serve_all(args):
  run_dir = pathlib.Path(args.run_dir)
  if not (run_dir / _model.CONFIG_NAME).exists():
    raise SystemExit(f"no trained model in {run_dir}: run examples/train_long_context.py first")
  requests = make_requests(args, _model.ModelConfig.load(run_dir / _model.CONFIG_NAME).vocab_size)
  n = args.context_parallel
  if n == 1:
    return serve(args, requests)
  if len(jax.devices()) < n:
    raise SystemExit(f"--context-parallel {n} needs {n} devices, JAX sees {len(jax.devices())}")
  print("single device (the reference answers):")
  want = serve(args, requests)
  mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
  print(f"context parallel: the KV cache spread over {n} devices:")
  got = serve(args, requests, mesh)
  if got != want:
    raise SystemExit(f"context parallel over {n} devices changed the answers: {got} != {want}")
  print(f"context parallel over {n} devices: the {len(got)} answers equal the single-device run's")
  return got


if __name__ == "__main__":
  main(ARGS)

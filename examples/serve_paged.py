"""Serve the model trained by `train_long_context.py` with a paged KV cache and continuous batching.

What it shows
-------------
* The checkpoint of the ring-attention model loads unchanged into the same
  Transformer built with `flax_ringattn.PagedMultiHeadAttention` layers (same
  parameter tree); no kernel code, no shard_map.
* Continuous batching: a stream of retrieval requests with prompts of
  different lengths (2k to 8k tokens).  Every step packs, into one ragged batch
  of at most `--max-batched-tokens` rows, a chunk of the prompt of each request
  still prefilling and two tokens (last answer, next query key) of each request
  that is answering; finished requests free their slot and pages and a waiting
  request takes them.  So almost every step mixes prefill and decode.
* A full cache is handled, never ignored: a waiting request is admitted only
  when the pages its whole sequence needs are not promised to running ones
  (refuse), and after every step the layers' `overflowed()` flags are read:
  a slot whose tokens did not fit is freed and its request re-queued from its
  start (evict).  `--num-pages` below `--max-seqs` x pages per sequence makes
  admission wait for pages.
* It prints each request's answers (generated value vs. the truth), the
  retrieval accuracy, tokens/s and the page-cache utilisation.
* `--context-parallel N`: every layer's KV cache is spread over N devices
  (mesh axis 'sp', `PagedMultiHeadAttention(mesh=, seq_axis=)`): each device
  holds about 1/N of every sequence's pages and the attention partials merge
  exactly.  The same stream is served on one device first, and the answers
  must be equal token for token (exit status 1 if not).  On a CPU the script
  asks for N host devices itself (unless XLA_FLAGS already sets a count).
* `--ring-prefill` (with `--context-parallel N`): the spread run prefills each
  admitted prompt in one sequence-parallel step (`layer.prefill`: the prompt
  padded and laid out with `zigzag_order`, sharded over the N devices, so the
  embedding, every MLP and the attention hold 1/N of its rows; sinusoidal
  positions from `zigzag_positions`), then decodes as before.  Its answers,
  and each answer's logit, must equal the single-device run's.

Run it after training (`make demo` runs both)::

  python examples/train_long_context.py
  python examples/serve_paged.py [--run-dir runs/train_long_context] [--requests 6] [--context-parallel 8]
  python examples/serve_paged.py --context-parallel 8 --ring-prefill
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import argparse
import os
import sys


def parse_args(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--run-dir", default="runs/train_long_context", help="what train_long_context.py wrote")
  p.add_argument("--requests", type=int, default=6, help="requests in the stream")
  p.add_argument("--queries", type=int, default=6, help="answers generated per request")
  p.add_argument("--prompt-lens", default="2048,4096,6144,8192", help="context lengths cycled over the requests")
  p.add_argument("--max-seqs", type=int, default=3, help="concurrent sequences (cache slots)")
  p.add_argument("--max-batched-tokens", type=int, default=1024, help="rows of one ragged batch")
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--num-pages", type=int, default=None, help="pages of the cache (default: every slot full)")
  p.add_argument(
    "--context-parallel",
    type=int,
    default=1,
    metavar="N",
    help="spread the KV cache over N devices; also serves on one device and checks the answers are equal",
  )
  p.add_argument(
    "--ring-prefill",
    action="store_true",
    help="with --context-parallel N: prefill each prompt sequence-parallel in one step (layer.prefill)",
  )
  p.add_argument("--seed", type=int, default=1)
  args = p.parse_args(argv)
  if args.context_parallel < 1:
    p.error(f"--context-parallel must be >= 1, got {args.context_parallel}")
  if args.ring_prefill and args.context_parallel < 2:
    p.error("--ring-prefill needs --context-parallel N >= 2 (the prompt is sharded over the N devices)")
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

import dataclasses
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

try:
  import flax_ringattn
except ImportError:  # running from a source checkout without `pip install -e .`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import flax_ringattn

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _model  # noqa: E402
from train_long_context import KVRetrievalTask  # noqa: E402


def paged_attention_factory(mesh=None):
  """The Transformer's attention layer: paged, its cache spread over the mesh's 'sp' axis when given one."""
  spread = {} if mesh is None else dict(mesh=mesh, seq_axis="sp")

  def factory(config, rngs):
    return flax_ringattn.PagedMultiHeadAttention(
      config.num_heads, config.d_model, num_kv_heads=config.num_kv_heads, rngs=rngs, **spread
    )

  return factory


def forward(model: _model.Transformer, tokens, positions, prev_tokens, cu_q_lens, num_seqs):
  """The Transformer's forward pass on a ragged batch [T] (same modules, paged attention)."""
  x = model.embed(tokens) + _model.sinusoidal_encoding(positions, model.config.d_model)
  if model.shift is not None:
    x = x + model.shift(model.embed(prev_tokens))
  for block in model.blocks:
    x = x + block.attn(block.norm1(x), cu_q_lens=cu_q_lens, num_seqs=num_seqs)
    x = x + block.mlp_out(jax.nn.gelu(block.mlp_in(block.norm2(x))))
  return model.head(model.norm(x))


@nnx.jit
def ring_prefill_step(model, tokens, positions, prev_tokens, slot, num_tokens):
  """One prompt through the Transformer sequence-parallel: tokens [Tp] in the ring prefill layout, sharded over
  'sp' (so is every activation); each layer's `prefill` writes the prompt's K/V into its spread cache."""
  x = model.embed(tokens) + _model.sinusoidal_encoding(positions, model.config.d_model)
  if model.shift is not None:
    x = x + model.shift(model.embed(prev_tokens))
  for block in model.blocks:
    x = x + block.attn.prefill(block.norm1(x), slot=slot, num_tokens=num_tokens)
    x = x + block.mlp_out(jax.nn.gelu(block.mlp_in(block.norm2(x))))
  logits = model.head(model.norm(x))
  return jnp.argmax(logits, axis=-1), jnp.max(logits, axis=-1)


def ring_prefill(model, req, slot: int, mesh):
  """Prefills `req`'s whole prompt into `slot` by the ring; returns (prediction, its logit) after its last token."""
  n, T = mesh.shape["sp"], len(req.prompt)
  Tp = model.blocks[0].attn.kv_cache.get_value().ring_prefill_len(T)
  pad = lambda x: np.concatenate([x, np.zeros(Tp - T, np.int32)])  # noqa: E731
  prompt = np.asarray(req.prompt, np.int32)
  rows = NamedSharding(mesh, P("sp"))
  tokens, prev = (
    jax.device_put(flax_ringattn.zigzag_order(pad(x), n, axis=0), rows)
    for x in (prompt, _model.previous_tokens(prompt))
  )
  positions = jax.device_put(flax_ringattn.zigzag_positions(Tp, n), rows)
  out, top = ring_prefill_step(model, tokens, positions, prev, jnp.int32(slot), jnp.int32(T))
  out, top = (flax_ringattn.zigzag_inverse(np.asarray(x), n, axis=0)[:T] for x in (out, top))
  return int(out[T - 1]), float(top[T - 1])


@nnx.jit
def serve_step(model, tokens, positions, prev_tokens, cu_q_lens, num_seqs):
  """The predicted next token of every row and its logit (the logit lets two runs be compared numerically)."""
  logits = forward(model, tokens, positions, prev_tokens, cu_q_lens, num_seqs)
  return jnp.argmax(logits, axis=-1), jnp.max(logits, axis=-1)


@nnx.jit
def free_slots(model, slots):
  for block in model.blocks:
    block.attn.free(slots)


def cache_utilization(model):
  return float(model.blocks[0].attn.kv_cache.get_value().utilization())


@dataclasses.dataclass
class Request:
  """One retrieval request: a prompt ending in the first asked key, then answers to k1..kq."""

  rid: int
  prompt: np.ndarray  # natural-order tokens up to and including the first query key
  keys: list  # query keys, in order
  values: list  # their true values
  fed: int = 0  # tokens of the sequence already in the cache
  last: int = 0  # the last token fed (BOS before the first)
  answers: list = dataclasses.field(default_factory=list)
  logits: list = dataclasses.field(default_factory=list)  # each answer's logit (to compare two runs)
  tail: list = dataclasses.field(default_factory=list)  # tokens to feed next while answering

  @property
  def prefilling(self):
    return self.fed < len(self.prompt)

  @property
  def done(self):
    return len(self.answers) == len(self.keys)


def make_requests(args, vocab_size, rng):
  requests = []
  lens = [int(x) for x in args.prompt_lens.split(",")]
  for r in range(args.requests):
    task = KVRetrievalTask(lens[r % len(lens)], num_queries=args.queries, num_pairs=128)
    if task.vocab_size != vocab_size:
      raise SystemExit(
        f"the checkpoint's vocabulary ({vocab_size}) does not match the retrieval task ({task.vocab_size})"
      )
    sample = task.sample(rng, 1)
    seq = np.concatenate([sample["tokens"][0], sample["targets"][0, -1:]])
    at = np.nonzero(sample["mask"][0])[0]  # positions of the query keys
    requests.append(Request(r, seq[: at[0] + 1], list(seq[at]), list(seq[at + 1])))
  return requests


def plan_pages(args, queue, n: int):
  """(pages_per_seq, num_pages, pages_of).  Spread over n devices, the default gives every device room for its
  share of every slot full (page j of slot s lives on device (s + j) % n: at most ceil(pages_per_seq / n) of a
  slot's pages per device), so the pool is a multiple of n and the same one serves both runs."""
  longest = max(len(r.prompt) + 2 * len(r.keys) for r in queue)
  pages_per_seq = -(-longest // args.page_size)
  num_pages = args.num_pages or n * args.max_seqs * -(-pages_per_seq // n)
  if num_pages % n:
    raise SystemExit(f"--num-pages={num_pages} must be a multiple of --context-parallel={n} (pages per device)")
  pages_of = lambda req: -(-(len(req.prompt) + 2 * len(req.keys)) // args.page_size)  # noqa: E731
  if max(pages_of(r) for r in queue) > num_pages:
    raise SystemExit(f"--num-pages={num_pages} cannot hold the longest request ({max(map(pages_of, queue))} pages)")
  return pages_per_seq, num_pages, pages_of


def serve(args, queue, mesh=None):
  """Serves the requests of `queue` (consumed) on one device, or with the caches spread over `mesh`'s 'sp' axis;
  returns the finished requests (by id), every step's (predictions, their logits) over its real rows, and the
  run's numbers."""
  n = 1 if mesh is None else mesh.shape["sp"]
  pages_per_seq, num_pages, pages_of = plan_pages(args, queue, args.context_parallel)
  # Spread: every parameter restored replicated on the mesh (the cache's pages go over 'sp' in init_cache).
  placement = None if mesh is None else NamedSharding(mesh, P())
  model = _model.load_model(pathlib.Path(args.run_dir), paged_attention_factory(mesh), sharding=placement)
  for block in model.blocks:
    block.attn.init_cache(
      num_pages=num_pages,
      page_size=args.page_size,
      max_num_seqs=args.max_seqs,
      pages_per_seq=pages_per_seq,
    )
  where = "one device" if mesh is None else f"{n} devices (each holds {num_pages // n} of the pages)"
  print(
    f"serving {len(queue)} requests (prompts {sorted({len(r.prompt) for r in queue})} tokens, {args.queries} answers each) "
    f"with {args.max_seqs} slots x {pages_per_seq} pages of {args.page_size} tokens ({num_pages} pages) on {where}, "
    f"<= {args.max_batched_tokens} tokens per step"
  )

  T, S = args.max_batched_tokens, args.max_seqs
  slots: list[Request | None] = [None] * S
  finished, steps, tokens_done, utils = [], 0, 0, []
  trace = []  # every step's predictions and their logits over its real rows
  mixed_steps = evictions = 0
  # Compile the step on its shapes (they never change) with an empty batch, which stores nothing; then the clock.
  empty = (np.zeros(T, np.int32),) * 3 + (np.zeros(S + 1, np.int32), np.array([S], np.int32))
  jax.block_until_ready(serve_step(model, *map(jnp.asarray, empty)))
  start = time.perf_counter()
  ring = args.ring_prefill and mesh is not None
  while queue or any(slots):
    for i in range(S):  # continuous batching: waiting requests take free slots
      promised = sum(pages_of(r) for r in slots if r is not None)
      if slots[i] is None and queue and promised + pages_of(queue[0]) <= num_pages:  # else refuse for now
        slots[i] = queue.pop(0)
        if ring:  # the whole prompt in one sequence-parallel step; the request then answers
          req = slots[i]
          answer, logit = ring_prefill(model, req, i, mesh)
          if model.blocks[0].attn.overflowed()[i]:
            raise SystemExit(f"request {req.rid}: its prompt did not fit the cache (see plan_pages)")
          tokens_done += len(req.prompt)
          req.fed, req.last = len(req.prompt), int(req.prompt[-1])
          req.answers.append(answer)
          req.logits.append(logit)
          if req.done:
            free_slots(model, jnp.arange(S) == i)
            finished.append(req)
            slots[i] = None
          else:
            req.tail = [answer, req.keys[1]]
    budget = T
    rows = {}
    for i, req in enumerate(slots):
      if req is None:
        continue
      if req.prefilling:
        # Leave room for the decodes of this step: chunked prefill.
        n = min(len(req.prompt) - req.fed, max(budget - 2 * S, 0))
        feed = list(req.prompt[req.fed : req.fed + n])
      else:
        feed = req.tail
      if feed:
        rows[i] = feed
        budget -= len(feed)
    tokens = np.zeros(T, np.int32)
    positions = np.zeros(T, np.int32)
    prev = np.zeros(T, np.int32)
    cu = np.zeros(S + 1, np.int32)
    for i in range(S):
      feed = rows.get(i, [])
      a = cu[i]
      cu[i + 1] = a + len(feed)
      if feed:
        req = slots[i]
        tokens[a : a + len(feed)] = feed
        positions[a : a + len(feed)] = req.fed + np.arange(len(feed))  # natural positions
        prev[a : a + len(feed)] = [req.last, *feed[:-1]]  # token before each one (BOS=0 first)
    kinds = {("prefill" if slots[i].prefilling else "decode") for i in rows}
    mixed_steps += kinds == {"prefill", "decode"}
    out, top = serve_step(model, *map(jnp.asarray, (tokens, positions, prev, cu, np.array([S], np.int32))))
    out, top = np.asarray(out), np.asarray(top)
    trace.append((out[: cu[-1]], top[: cu[-1]]))
    steps += 1
    tokens_done += int(cu[-1])
    utils.append(cache_utilization(model))
    # Slots whose tokens did not fit stored none of them (and flag it until freed): evict and re-queue.
    overflowed = np.asarray(model.blocks[0].attn.overflowed())
    if overflowed.any():
      free_slots(model, jnp.asarray(overflowed))
      for i in np.nonzero(overflowed)[0]:
        req = slots[i]
        queue.insert(0, dataclasses.replace(req, fed=0, last=0, answers=[], tail=[]))
        slots[i] = None
        rows.pop(i, None)
        evictions += 1
    done_mask = np.zeros(S, bool)
    for i, feed in rows.items():
      req = slots[i]
      req.fed += len(feed)
      req.last = feed[-1]
      if req.prefilling:
        continue
      answer = int(out[cu[i + 1] - 1])  # prediction after the last fed token: a query key
      req.answers.append(answer)
      req.logits.append(float(top[cu[i + 1] - 1]))
      if req.done:
        done_mask[i] = True
      else:
        req.tail = [answer, req.keys[len(req.answers)]]
    if done_mask.any():
      free_slots(model, jnp.asarray(done_mask))
      for i in np.nonzero(done_mask)[0]:
        finished.append(slots[i])
        slots[i] = None
  elapsed = time.perf_counter() - start

  correct = total = 0
  finished = sorted(finished, key=lambda r: r.rid)
  for req in finished:
    ok = [int(a) == int(v) for a, v in zip(req.answers, req.values, strict=True)]
    correct, total = correct + sum(ok), total + len(ok)
    shown = " ".join(
      f"{int(a)}{'' if o else '(want ' + str(int(v)) + ')'}"
      for a, v, o in zip(req.answers, req.values, ok, strict=True)
    )
    print(f"request {req.rid}: prompt {len(req.prompt):5d} tokens -> answers {shown}")
  print(
    f"accuracy {correct}/{total} = {correct / max(total, 1):.2f} (chance {1 / 64:.3f}); "
    f"{steps} steps ({mixed_steps} mixed prefill+decode), {tokens_done} tokens in {elapsed:.1f} s = "
    f"{tokens_done / elapsed:,.0f} tokens/s; page-cache utilisation mean {np.mean(utils):.1%}, "
    f"min {np.min(utils):.1%}; {evictions} evictions"
  )
  stats = {"accuracy": correct / max(total, 1), "steps": steps, "tokens_per_second": tokens_done / elapsed}
  return finished, trace, stats


def main(args):
  run_dir = pathlib.Path(args.run_dir)
  if not (run_dir / _model.CONFIG_NAME).exists():
    raise SystemExit(f"no trained model in {run_dir}: run examples/train_long_context.py first")
  config = _model.ModelConfig.load(run_dir / _model.CONFIG_NAME)
  requests = lambda: make_requests(args, config.vocab_size, np.random.default_rng(args.seed))  # noqa: E731
  n = args.context_parallel
  if n == 1:
    return serve(args, requests())[2]
  if len(jax.devices()) < n:
    raise SystemExit(f"--context-parallel {n} needs {n} devices, JAX sees {len(jax.devices())}")
  print("single device (the reference answers):")
  want, want_trace, _ = serve(args, requests())
  mesh = jax.make_mesh((n,), ("sp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])
  print(f"context parallel: the KV cache spread over {n} devices:")
  got, trace, stats = serve(args, requests(), mesh)
  answers = lambda reqs: [[int(a) for a in r.answers] for r in reqs]  # noqa: E731
  if answers(got) != answers(want):
    raise SystemExit(f"context parallel over {n} devices changed the answers: {answers(got)} != {answers(want)}")
  err = max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g.logits, w.logits, strict=True))
  if args.ring_prefill:
    # Its steps differ (one ring step per prompt): compare every answer and its logit.
    print(
      f"ring prefill over {n} devices: the {sum(map(len, answers(got)))} answers equal the single-device run's; "
      f"max |answer logit - single device| = {err:.2e}"
    )
    if not err <= 1e-4:
      raise SystemExit(f"ring prefill over {n} devices: answer logits differ by {err:.2e} > 1e-4")
    return stats
  # Not only the answers: every step's prediction at every fed token, and its logit.
  if len(trace) != len(want_trace):
    raise SystemExit(f"context parallel over {n} devices took {len(trace)} steps, one device {len(want_trace)}")
  rows = sum(len(t) for t, _ in trace)
  same = sum(int((t == w).sum()) for (t, _), (w, _) in zip(trace, want_trace, strict=True))
  err = max(float(np.abs(v - w).max(initial=0.0)) for (_, v), (_, w) in zip(trace, want_trace, strict=True))
  print(
    f"context parallel over {n} devices: the {sum(map(len, answers(got)))} answers equal the single-device run's; "
    f"{same}/{rows} predictions equal, max |top logit - single device| = {err:.2e}"
  )
  if same != rows or not err <= 1e-4:
    raise SystemExit(f"context parallel over {n} devices: {rows - same} predictions differ or {err=:.2e} > 1e-4")
  return stats


if __name__ == "__main__":
  main(ARGS)

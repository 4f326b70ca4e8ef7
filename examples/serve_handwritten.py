"""Serve a decoder whose attention is written by hand, unedited, from a paged KV cache: one `convert`, one engine.

What it shows
-------------
* A small Llama-style decoder written the way public NNX models write it: no
  `nnx.MultiHeadAttention`, RoPE on q and k, grouped-query einsums, the
  `[B, T, S]` causal mask the model builds itself, a float32 softmax.
* `fr.convert(model, to="paged")` watches its attention; `fr.ServingEngine`
  runs the model's own `__call__` on flat ragged batches.  Each attention
  block keeps its own paged cache: the k and v the block computes (after its
  RoPE) are written there, and each sequence attends causally over its own
  cached tokens (the model's mask is not what decides, as the report says).
* More prompts than slots (continuous batching), chunked prefill, and a
  shared system prompt whose whole pages are computed once and shared
  (copy on write).
* The answers are checked against greedy decoding by full recompute on an
  unconverted copy of the model, token for token, with and without
  speculative decoding (`fr.NGramDraft`: prompt lookup; the engine verifies
  the proposals in one step and rolls rejected tokens back out of the
  cache).  Exit status 1 if any token differs.

Run it (CPU is enough)::

  python examples/serve_handwritten.py [--prompts 6] [--max-new-tokens 24] [--max-seqs 3]
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

try:
  import flax_ringattn as fr
except ImportError:  # running from a source checkout without `pip install -e .`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import flax_ringattn as fr
from flax_ringattn import benchmarking

VOCAB, D, HEADS, KV_HEADS, HEAD_DIM = 64, 64, 4, 2, 16


def rope(x, positions, base=10_000.0):
  """Rotary embedding of x [B, T, ..., H] at positions [B, T] (halves rotated, as Llama does)."""
  half = x.shape[-1] // 2
  angle = positions[..., None].astype(jnp.float32) * base ** (-jnp.arange(half) / half)
  angle = angle.reshape(*angle.shape[:2], *(1,) * (x.ndim - 3), half)
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  a, b = x[..., :half], x[..., half:]
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, *, rngs):
    self.wq = nnx.Linear(D, HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
    self.wk = nnx.Linear(D, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
    self.wv = nnx.Linear(D, KV_HEADS * HEAD_DIM, use_bias=False, rngs=rngs)
    self.wo = nnx.Linear(HEADS * HEAD_DIM, D, use_bias=False, rngs=rngs)

  def __call__(self, x, positions, mask):
    B, T, _ = x.shape
    q = rope(self.wq(x).reshape(B, T, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), positions)
    k = rope(self.wk(x).reshape(B, T, KV_HEADS, HEAD_DIM), positions)
    v = self.wv(x).reshape(B, T, KV_HEADS, HEAD_DIM)
    scores = jnp.einsum("BTHGD,BSHD->BHGTS", q, k) * HEAD_DIM**-0.5
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    return self.wo(jnp.einsum("BHGTS,BSHD->BTHGD", probs, v).reshape(B, T, -1))


class Decoder(nnx.Module):
  def __init__(self, layers=2, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.attn = nnx.List([Attention(rngs=rngs) for _ in range(layers)])
    self.norms = nnx.List([nnx.RMSNorm(D, rngs=rngs) for _ in range(2 * layers)])
    self.mlps = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(layers)])

  def __call__(self, tokens, positions):
    T = tokens.shape[1]
    mask = jnp.tril(jnp.ones((1, T, T), bool))  # the model's own causal mask
    x = self.embed(tokens)
    for i, (attn, mlp) in enumerate(zip(self.attn, self.mlps, strict=True)):
      x = x + attn(self.norms[2 * i](x), positions, mask)
      x = x + jax.nn.gelu(mlp(self.norms[2 * i + 1](x)))
    return self.embed.attend(x)


def call(model, tokens, positions):
  """What the engine runs: the model's own forward on its flat ragged batch (tokens, positions [1, T])."""
  return model(tokens, positions)


def greedy(model, prompt, max_new: int, length: int):
  """The model's greedy continuation of `prompt` by full recompute (no cache), padded to `length` tokens (one
  compile; the model is causal, so the padding after the last token changes nothing)."""
  forward = nnx.jit(lambda m, t: m(t, jnp.arange(length)[None])[0])
  tokens = list(prompt)
  for _ in range(max_new):
    padded = np.zeros((1, length), np.int32)
    padded[0, : len(tokens)] = tokens
    tokens.append(int(np.argmax(forward(model, jnp.asarray(padded))[len(tokens) - 1])))
  return tokens[len(prompt) :]


def make_prompts(args):
  """A shared system prompt (whole pages) and a short user turn per prompt, of different lengths."""
  rng = np.random.default_rng(args.seed)
  system = list(rng.integers(1, VOCAB, 2 * args.page_size))
  return [system + list(rng.integers(1, VOCAB, 3 + 2 * i)) for i in range(args.prompts)]


def parse_args(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--prompts", type=int, default=6, help="prompts served (more than --max-seqs queue)")
  p.add_argument("--max-new-tokens", type=int, default=24, help="tokens generated per prompt")
  p.add_argument("--max-seqs", type=int, default=3, help="concurrent sequences (cache slots)")
  p.add_argument("--page-size", type=int, default=8, help="tokens per cache page")
  p.add_argument("--max-batched-tokens", type=int, default=32, help="rows of one ragged step (chunked prefill)")
  p.add_argument("--seed", type=int, default=0, help="weights and prompts")
  benchmarking.add_compilation_cache_args(p)
  return p.parse_args(argv)


def main(argv=None):
  args = parse_args(argv)
  cache = benchmarking.compilation_cache_from_args(args)  # a second start reads the compiled programs back
  prompts = make_prompts(args)
  longest = max(map(len, prompts)) + args.max_new_tokens
  pages_per_seq = -(-longest // args.page_size)
  original = Decoder(rngs=nnx.Rngs(args.seed))
  want = [greedy(original, p, args.max_new_tokens, length=pages_per_seq * args.page_size) for p in prompts]

  model = Decoder(rngs=nnx.Rngs(args.seed))  # the same weights, converted in place
  example = jnp.zeros((1, 8), jnp.int32)  # runs the model once (abstractly) so the report lists its sites
  print(fr.convert(model, to="paged", example=lambda m: call(m, example, example)))  # the one change
  engine = fr.ServingEngine(
    model,
    call=call,
    num_pages=args.max_seqs * pages_per_seq,
    page_size=args.page_size,
    max_num_seqs=args.max_seqs,
    pages_per_seq=pages_per_seq,
    max_num_batched_tokens=args.max_batched_tokens,
  )
  print(
    f"serving {len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens (a shared "
    f"system prompt of {2 * args.page_size}) on {args.max_seqs} slots, <= {args.max_batched_tokens} tokens per step"
  )
  failed = False
  for name, draft in (("plain", None), ("ngram draft", fr.NGramDraft(n=2, k=4))):
    before = dict(engine.stats.as_dict())
    got = engine.generate(prompts, max_new_tokens=args.max_new_tokens, draft=draft)
    now = engine.stats.as_dict()
    delta = {key: now[key] - before[key] for key in now if key not in ("cache_utilization", "tokens_per_s")}
    same = got == want
    failed |= not same
    print(
      f"{name}: {'equal to' if same else 'DIFFERENT from'} full recompute; {delta['steps']} steps, "
      f"{delta['generated_tokens']} tokens at {delta['generated_tokens'] / delta['seconds']:,.0f} tokens/s; "
      f"{delta['prompt_tokens']} prompt tokens ({delta['prefill_tokens_computed']} computed, "
      f"{delta['shared_prefix_tokens']} shared); draft {delta['draft_accepted']}/{delta['draft_proposed']} accepted"
    )
  print(
    f"compiles over both runs: {engine.stats.compiles}, {engine.stats.compile_seconds:.1f} s in the calls that "
    "compiled (the first run's tokens/s includes them)"
  )
  if cache is not None:
    print(cache.summary())
  if failed:
    raise SystemExit("the engine's tokens differ from greedy decoding by full recompute")
  return engine.stats


if __name__ == "__main__":
  main()

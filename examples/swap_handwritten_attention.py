"""Swap ring attention into decoders that write attention by hand, with one `convert` call each.

What it shows
-------------
* Two small decoders written the way public NNX language models write
  attention (no `nnx.MultiHeadAttention` anywhere):
  - Gemma style: grouped einsums (`BTKGH,BSKH->BTKGS`), queries pre-scaled,
    a tanh soft cap, a sliding window built in the module with `triu`/`tril`,
    `jnp.where(mask, logits, big_negative)`, `jax.nn.softmax`;
  - Llama style: `BTHGD,BSHD->BHGTS` times a scale, a float32 softmax.
  Both take the `[B, T, S]` key mask such models build (padding hides keys
  only).
* `flax_ringattn.convert(model, mesh=mesh, example=...)` finds each attention
  block, reports what it recognised (heads and groups, scale, cap, window,
  mask kind), and from then on the block runs as ring attention over the
  sequence axis: the model's code is not edited.
* The converted models' logits match the originals on every real token (a
  padding query that sees no key gets 0 from the ring and the mean of v from
  a softmax over only masked logits), the compiled training step contains the ring's collective-permute, and
  the Llama-style model trains (optax AdamW).

Run it (8 CPU devices are simulated when there is no accelerator)::

  python examples/swap_handwritten_attention.py [--seq-len 256] [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

try:
  import flax_ringattn as fr
except ImportError:  # running from a source checkout without `pip install -e .`
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
  import flax_ringattn as fr

VOCAB, D = 64, 64


class GemmaStyleAttention(nnx.Module):
  def __init__(self, heads=4, kv_heads=2, head_dim=16, cap=30.0, window=None, *, rngs):
    init = nnx.initializers.lecun_normal(in_axis=1, out_axis=(0, 2))
    self.q = nnx.Param(init(rngs.params(), (heads, D, head_dim)))
    self.kv = nnx.Param(nnx.initializers.normal(0.05)(rngs.params(), (2, kv_heads, D, head_dim)))
    self.o = nnx.Param(nnx.initializers.normal(0.05)(rngs.params(), (heads, head_dim, D)))
    self.kv_heads, self.head_dim, self.cap, self.window = kv_heads, head_dim, cap, window

  def __call__(self, x, mask):
    q = jnp.einsum("BTD,NDH->BTNH", x, self.q[...]) * self.head_dim**-0.5
    k, v = jnp.einsum("BSD,CKDH->CBSKH", x, self.kv[...])
    B, T, N, H = q.shape
    G = N // self.kv_heads
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, self.kv_heads, G, H), k).reshape(B, T, N, T)
    logits = jnp.tanh(logits / self.cap) * self.cap
    if self.window is not None:
      everything = jnp.ones_like(mask)
      mask = mask * jnp.triu(everything, -self.window + 1) * jnp.tril(everything, self.window - 1)
    probs = jax.nn.softmax(jnp.where(mask[:, :, None, :], logits, -2.3819763e38), axis=-1)
    out = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(B, T, self.kv_heads, G, T), v)
    return jnp.einsum("BTNH,NHD->BTD", out.reshape(B, T, N, H), self.o[...])


class LlamaStyleAttention(nnx.Module):
  def __init__(self, heads=4, kv_heads=2, head_dim=16, *, rngs):
    self.wq = nnx.Linear(D, heads * head_dim, use_bias=False, rngs=rngs)
    self.wk = nnx.Linear(D, kv_heads * head_dim, use_bias=False, rngs=rngs)
    self.wv = nnx.Linear(D, kv_heads * head_dim, use_bias=False, rngs=rngs)
    self.wo = nnx.Linear(heads * head_dim, D, use_bias=False, rngs=rngs)
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim

  def __call__(self, x, mask):
    B, T, _ = x.shape
    K, G, H = self.kv_heads, self.heads // self.kv_heads, self.head_dim
    q = self.wq(x).reshape(B, T, K, G, H)
    k, v = self.wk(x).reshape(B, T, K, H), self.wv(x).reshape(B, T, K, H)
    scores = jnp.einsum("BTHGD,BSHD->BHGTS", q, k) * H**-0.5
    scores = jnp.where(mask[:, None, None], scores, jnp.finfo(scores.dtype).min)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    return self.wo(jnp.einsum("BHGTS,BSHD->BTHGD", probs, v).reshape(B, T, -1))


class Decoder(nnx.Module):
  def __init__(self, attention, layers=2, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.attn = nnx.List([attention(rngs) for _ in range(layers)])
    self.norms = nnx.List([nnx.RMSNorm(D, rngs=rngs) for _ in range(2 * layers)])
    self.mlps = nnx.List([nnx.Linear(D, D, rngs=rngs) for _ in range(layers)])

  def __call__(self, tokens, mask):
    x = self.embed(tokens)
    for i, (attn, mlp) in enumerate(zip(self.attn, self.mlps, strict=True)):
      x = x + attn(self.norms[2 * i](x), mask)
      x = x + jax.nn.gelu(mlp(self.norms[2 * i + 1](x)))
    return self.embed.attend(x)


def batch(seq_len, rng):
  """Next-token data with one right-padded and one left-padded row; the key mask hand-written models build."""
  tokens = rng.integers(1, VOCAB, size=(2, seq_len))
  tokens[:, 1::2] = (tokens[:, 0::2] * 7 + 3) % VOCAB  # every second token follows from the one before
  valid = np.ones((2, seq_len), bool)
  valid[0, -seq_len // 4 :] = False
  valid[1, : seq_len // 8] = False
  causal = np.tril(np.ones((seq_len, seq_len), bool))
  return jnp.asarray(np.where(valid, tokens, 0)), jnp.asarray(valid), jnp.asarray(causal[None] & valid[:, None, :])


def loss_fn(model, tokens, valid, mask):
  logp = jax.nn.log_softmax(model(tokens, mask).astype(jnp.float32), -1)
  nll = -jnp.sum(logp * jax.nn.one_hot(jnp.roll(tokens, -1, axis=1), VOCAB), -1)
  w = (valid & jnp.roll(valid, -1, axis=1) & (jnp.arange(tokens.shape[1]) < tokens.shape[1] - 1)).astype(jnp.float32)
  return jnp.sum(nll * w) / jnp.sum(w)


def main(argv=None):
  p = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
  )
  p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (the Gemma-style window: a quarter)")
  p.add_argument("--steps", type=int, default=3, help="training steps of the Llama-style model")
  args = p.parse_args(argv)
  mesh = jax.make_mesh((jax.device_count(),), ("sp",))
  print(f"mesh {dict(mesh.shape)}, seq_len {args.seq_len}")
  tokens, valid, mask = batch(args.seq_len, np.random.default_rng(0))
  real = np.asarray(valid)
  styles = {
    "gemma": lambda rngs: GemmaStyleAttention(window=args.seq_len // 4, rngs=rngs),
    "llama": lambda rngs: LlamaStyleAttention(rngs=rngs),
  }
  models = {}
  for name, attention in styles.items():
    original, model = Decoder(attention, rngs=nnx.Rngs(0)), Decoder(attention, rngs=nnx.Rngs(0))
    report = fr.convert(model, mesh=mesh, seq_axis="sp", example=lambda m: m(tokens, mask))  # the one change
    print(f"{name}: {report}")
    ring = np.asarray(nnx.jit(lambda m, t, k: m(t, k))(model, tokens, mask))
    err = float(np.max(np.abs(ring - np.asarray(original(tokens, mask)))[real]))
    print(f"{name}: max |ring - original| over real tokens = {err:.2e}")
    models[name] = model

  model = models["llama"]
  optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
  fr.place_on_mesh(optimizer, mesh)  # its step counter on the mesh too: train_step compiles once

  @nnx.jit
  def train_step(model, optimizer, tokens, valid, mask):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, valid, mask)
    optimizer.update(model, grads)
    return loss

  hlo = train_step.lower(model, optimizer, tokens, valid, mask).compile().as_text()
  print(f"collective-permute in the compiled train step: {'collective-permute' in hlo}")
  losses = [float(train_step(model, optimizer, tokens, valid, mask)) for _ in range(args.steps)]
  print("llama train losses (ring attention):", " ".join(f"{x:.4f}" for x in losses))
  return losses


if __name__ == "__main__":
  main()

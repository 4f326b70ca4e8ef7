"""Swap ring attention into an existing Flax NNX model with one call, then train it.

The model below is written the way flax's own NNX lm1b example is: token and
position embeddings, pre-norm blocks with the stock `nnx.MultiHeadAttention`
(attention dropout 0.1) fed the dense padding + causal + packed-segment mask
the model builds itself, and logits tied to the embedding.  Nothing in it
knows about ring attention.  The only change is one line:

    report = flax_ringattn.convert(model, mesh=mesh)

after which every attention layer runs ring attention with the activations
sharded over the sequence on an Explicit mesh (`jax.make_mesh`'s default), the
dense mask is recovered as causal + segment ids (never handed to a kernel),
and attention dropout runs inside the ring.  The script checks that the
converted model computes the same logits in eval mode, then trains it with
dropout for a few steps.

    python examples/swap_into_existing_model.py [--seq-len 1024] [--devices 8] [--steps 5]
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import argparse
import os
import sys


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
  """Every option's default in --help; the description keeps its line breaks."""


def _parse():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=_HelpFormatter)
  p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator is present")
  p.add_argument("--d-model", type=int, default=64, help="model width (features per token)")
  p.add_argument("--steps", type=int, default=5, help="training steps")
  return p.parse_args()


args = _parse()
if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and "xla_force_host_platform_device_count" not in os.environ.get(
  "XLA_FLAGS", ""
):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
  ).strip()

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import flax_ringattn as fr

# ---- the existing model, as written for flax (unchanged) ---------------------------------------


class Block(nnx.Module):
  def __init__(self, d, heads, rngs):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(heads, d, dropout_rate=0.1, decode=False, rngs=rngs)
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, 4 * d, rngs=rngs)
    self.mlp_out = nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))


class LM(nnx.Module):
  def __init__(self, vocab, d, heads, layers, max_len, rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos_embed = nnx.Embed(max_len, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
    self.ln_f = nnx.LayerNorm(d, rngs=rngs)

  def __call__(self, tokens, segmentation, positions):
    valid = tokens > 0
    mask = nnx.combine_masks(
      nnx.make_attention_mask(valid, valid),
      nnx.make_causal_mask(tokens),
      nnx.make_attention_mask(segmentation, segmentation, jnp.equal),
    )
    x = self.embed(tokens) + self.pos_embed(positions)
    for block in self.blocks:
      x = block(x, mask)
    return self.embed.attend(self.ln_f(x))


def loss_fn(model, batch):
  logits = model(batch["tokens"], batch["segmentation"], batch["positions"])
  weights = (batch["tokens"] > 0) & (batch["targets"] > 0)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
  return jnp.sum(ce * weights) / jnp.sum(weights)


# ---- data: packed documents with padding, as lm1b feeds them -----------------------------------


def packed_batch(rng, B, T, vocab):
  tokens, seg, pos = (np.zeros((B, T), np.int32) for _ in range(3))
  for b in range(B):
    t, s = 0, 1
    while t < T - T // 8:  # the last eighth stays padding
      n = min(int(rng.integers(T // 8, T // 2)), T - T // 8 - t)
      tokens[b, t : t + n] = rng.integers(1, vocab, n)
      seg[b, t : t + n], pos[b, t : t + n] = s, np.arange(n)
      t, s = t + n, s + 1
  targets = np.where(np.roll(seg, -1, axis=1) == seg, np.roll(tokens, -1, axis=1), 0)
  return {"tokens": tokens, "segmentation": seg, "positions": pos, "targets": targets}


def main():
  vocab, T, d = 256, args.seq_len, args.d_model
  model = LM(vocab, d, heads=4, layers=2, max_len=T, rngs=nnx.Rngs(0))
  original = nnx.clone(model)  # kept only to compare against

  # ---- the swap: one call -------------------------------------------------------------------
  mesh = jax.make_mesh((jax.device_count(),), ("sp",))  # Explicit axes, JAX's default
  report = fr.convert(model, mesh=mesh)
  print(report)

  # The batch goes on the mesh.  (With Explicit axes the model's own dense mask cannot be built
  # from sequence-sharded tokens -- flax's make_attention_mask would shard both T axes of
  # [B, 1, T, T] over "sp" -- so the token arrays are replicated and the ring layers shard the
  # activations over the sequence.  Code that can change passes fr.padded_segment_ids instead.)
  rng = np.random.default_rng(0)
  put = lambda b: jax.device_put(b, jax.sharding.NamedSharding(mesh, jax.P()))  # noqa: E731
  batch = put(packed_batch(rng, 2, T, vocab))

  model.eval()
  original.eval()
  got = nnx.jit(lambda m, b: m(b["tokens"], b["segmentation"], b["positions"]))(model, batch)
  host = jax.device_get(batch)
  want = original(host["tokens"], host["segmentation"], host["positions"])
  real = host["tokens"] > 0
  err = float(np.max(np.abs(np.asarray(got)[real] - np.asarray(want)[real])))
  print(
    f"devices: {jax.device_count()}  sequence: {T} tokens -> {T // jax.device_count()} per device; "
    f"logits sharding: {got.sharding.spec}"
  )
  print(f"max |ring - original| = {err:.2e} (eval mode, logits at real tokens)")
  if not np.isfinite(err) or err > 1e-4:
    sys.exit("outputs disagree")

  # ---- train with attention dropout, inside the ring --------------------------------------------
  model.train()
  optimizer = nnx.Optimizer(model, optax.adamw(3e-3), wrt=nnx.Param)
  # The optimizer's step counter starts on one device; on the mesh (like the params) the first step's outputs
  # have its inputs' shardings, and train_step compiles once instead of twice.
  fr.place_on_mesh(optimizer, mesh)

  @nnx.jit
  def train_step(model, optimizer, batch):
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return loss

  losses = [float(train_step(model, optimizer, put(packed_batch(rng, 2, T, vocab)))) for _ in range(args.steps)]
  print("train losses (dropout 0.1 in the ring): " + " ".join(f"{x:.3f}" for x in losses))
  if not all(np.isfinite(losses)):
    sys.exit("training diverged")


if __name__ == "__main__":
  main()

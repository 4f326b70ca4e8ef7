"""Swap ring attention into an existing Flax NNX model without retraining.

Builds a small model written with the stock `nnx.MultiHeadAttention` (think:
a checkpoint you already have), then replaces every attention layer by a
`flax_ringattn.RingMultiHeadAttention` over a sequence-sharded mesh, carrying
the weights over with `nnx.update`.  The outputs agree with the original model
while activations are now sharded along the sequence.

    python examples/swap_into_existing_model.py [--seq-len 4096] [--devices 8]
"""

# ruff: noqa: E402 -- XLA_FLAGS must be set before jax is imported.
from __future__ import annotations

import argparse
import os
import sys


def _parse():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--seq-len", type=int, default=4096)
  p.add_argument("--devices", type=int, default=8, help="simulated CPU devices when no accelerator is present")
  p.add_argument("--d-model", type=int, default=64)
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
from flax import nnx

import flax_ringattn as fr


class Block(nnx.Module):
  def __init__(self, d, attention, rngs):
    self.norm = nnx.LayerNorm(d, rngs=rngs)
    self.attn = attention(rngs)
    self.mlp = nnx.Linear(d, d, rngs=rngs)

  def __call__(self, x):
    x = x + self.attn(self.norm(x), is_causal=True)
    return x + jax.nn.gelu(self.mlp(x))


class Model(nnx.Module):
  def __init__(self, d, attention, rngs, num_layers=2):
    self.blocks = nnx.List([Block(d, attention, rngs) for _ in range(num_layers)])

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return x


def main():
  d, heads, kv_heads = args.d_model, 4, 2
  # The existing model, as it was written and trained: stock flax attention.
  existing = Model(
    d, lambda r: nnx.MultiHeadAttention(heads, d, num_kv_heads=kv_heads, decode=False, rngs=r), nnx.Rngs(0)
  )

  # The swap: one line per attention layer, then load the existing weights.
  mesh = jax.make_mesh((jax.device_count(),), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  swapped = Model(
    d, lambda r: fr.RingMultiHeadAttention(heads, d, num_kv_heads=kv_heads, mesh=mesh, rngs=r), nnx.Rngs(1)
  )
  nnx.update(swapped, nnx.state(existing))

  x = jax.random.normal(jax.random.PRNGKey(0), (1, args.seq_len, d))
  want = nnx.jit(lambda m, x: m(x))(existing, x)
  got = nnx.jit(lambda m, x: m(x))(swapped, x)
  err = float(jnp.max(jnp.abs(got - want)))
  print(
    f"devices: {jax.device_count()}  sequence: {args.seq_len} tokens -> {args.seq_len // jax.device_count()} per device"
  )
  print(f"output sharding of the swapped model: {got.sharding.spec}")
  print(f"max |ring - original| = {err:.2e}")
  if not np.isfinite(err) or err > 1e-4:
    sys.exit("outputs disagree")
  print("outputs agree: the swapped model computes the same function with the sequence sharded")


if __name__ == "__main__":
  main()

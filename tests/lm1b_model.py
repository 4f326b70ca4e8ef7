"""A small decoder-only language model written the way flax's NNX lm1b example is (tests only).

Token and learned position embeddings, pre-norm blocks whose stock
`nnx.MultiHeadAttention(dropout_rate > 0)` is fed the dense mask the model
builds itself (padding + causal + packed segments, `nnx.combine_masks`), and
logits tied to the token embedding.  Nothing in it knows about ring attention.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class Block(nnx.Module):
  def __init__(self, d, heads, dropout_rate, rngs):
    self.ln1 = nnx.LayerNorm(d, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      heads, d, dropout_rate=dropout_rate, broadcast_dropout=False, decode=False, rngs=rngs
    )
    self.ln2 = nnx.LayerNorm(d, rngs=rngs)
    self.mlp_in = nnx.Linear(d, 2 * d, rngs=rngs)
    self.mlp_out = nnx.Linear(2 * d, d, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.ln1(x), mask=mask)
    return x + self.mlp_out(jax.nn.gelu(self.mlp_in(self.ln2(x))))


class LM(nnx.Module):
  def __init__(self, *, vocab=50, d=32, heads=4, layers=2, max_len=256, dropout_rate=0.1, rngs):
    self.embed = nnx.Embed(vocab, d, rngs=rngs)
    self.pos_embed = nnx.Embed(max_len, d, rngs=rngs)
    self.blocks = nnx.List([Block(d, heads, dropout_rate, rngs) for _ in range(layers)])
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
    return self.embed.attend(self.ln_f(x))  # tied logits


def packed_batch(B=2, T=64, vocab=50, seed=0):
  """Packed, padded inputs as lm1b feeds them: (tokens, segmentation, positions), 0 = padding."""
  rng = np.random.RandomState(seed)
  tokens = np.zeros((B, T), np.int32)
  seg = np.zeros((B, T), np.int32)
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    t, s = 0, 1
    while True:
      n = int(rng.randint(5, T // 2))
      if t + n > T - 7:  # leave some padding at the end of every row
        break
      tokens[b, t : t + n] = rng.randint(1, vocab, n)
      seg[b, t : t + n] = s
      pos[b, t : t + n] = np.arange(n)
      t, s = t + n, s + 1
  return jnp.asarray(tokens), jnp.asarray(seg), jnp.asarray(pos)

"""Decoders for the serving engine's tests, written for them in the styles of public NNX models, and their own
greedy decoding by full recompute (the oracle the engine must equal).

* `gemma_style`: hand-written attention (`GemmaAttention` of `handwritten_models`): grouped einsums, q
  pre-scaled, a tanh soft cap, RMS qk-norm and a sliding window the module builds from constant `triu` / `tril`
  bands.
* `llama_style`: hand-written `BTHGD,BSHD->BHGTS` logits, a float32 softmax, the model's `[B, T, S]` mask (Llama,
  Qwen).
* `mha_style`: `nnx.MultiHeadAttention` blocks with learned positions, called with the model's mask and its own
  `decode=False` (the engine's step decides, not the flag).

Every model is called as `model(tokens [B, T], positions [B, T], mask [B, T, T])` and returns logits
`[B, T, VOCAB]`.
"""

from __future__ import annotations

import handwritten_models as hm
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

VOCAB, D = hm.VOCAB, hm.D


def causal(T: int):
  return jnp.tril(jnp.ones((1, T, T), bool))


def engine_call(model, tokens, positions):
  """What the engine runs: the model's own forward with the causal mask it would build (not used by paged
  attention, which is causal over each sequence's cache)."""
  return model(tokens, positions, causal(tokens.shape[1]))


class MhaBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm1, self.norm2 = hm.RMS(D), hm.RMS(D)
    self.attn = nnx.MultiHeadAttention(4, D, num_kv_heads=2, decode=False, rngs=rngs)
    self.mlp = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.attn(self.norm1(x), mask=mask[:, None], decode=False)  # its own flag: full forward
    return x + jax.nn.gelu(self.mlp(self.norm2(x)))


class MhaDecoder(nnx.Module):
  def __init__(self, layers=2, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.pos = nnx.Embed(64, D, rngs=rngs)
    self.blocks = nnx.List([MhaBlock(rngs) for _ in range(layers)])

  def __call__(self, tokens, positions, mask):
    x = self.embed(tokens) + self.pos(positions)
    for block in self.blocks:
      x = block(x, mask)
    return self.embed.attend(x)


def gemma_style(seed=0):
  make = hm.gemma(cap=5.0, window=6, qk_norm=True)
  return hm.Decoder(make, rngs=nnx.Rngs(seed))


def llama_style(seed=0):
  return hm.Decoder(hm.llama(), rngs=nnx.Rngs(seed))


def mha_style(seed=0):
  return MhaDecoder(rngs=nnx.Rngs(seed))


FAMILIES = {"gemma": gemma_style, "llama": llama_style, "mha": mha_style}


def greedy(model, prompt, max_new: int, *, stop=(), length: int = 48):
  """(tokens, margins): the model's greedy continuation of `prompt` by full recompute, and each step's gap
  between the best and second-best logit (a test asserts it is not a near tie).  The sequence is padded to
  `length` (one compile; causal, so the padding after the last token changes nothing)."""
  forward = _forward(length)
  tokens, out, margins = list(prompt), [], []
  for _ in range(max_new):
    padded = np.zeros((1, length), np.int32)
    padded[0, : len(tokens)] = tokens
    logits = np.asarray(forward(model, jnp.asarray(padded))[len(tokens) - 1], np.float64)
    top2 = np.sort(logits)[-2:]
    out.append(int(np.argmax(logits)))
    margins.append(float(top2[1] - top2[0]))
    tokens.append(out[-1])
    if out[-1] in stop:
      break
  return out, margins


_FORWARDS: dict = {}


def _forward(length: int):
  if length not in _FORWARDS:
    _FORWARDS[length] = nnx.jit(lambda m, t: m(t, jnp.arange(length)[None], causal(length))[0])
  return _FORWARDS[length]

"""Decoder-only language models at real sizes, with attention written by hand as public NNX models write it.

Two shapes that people train and serve (random weights, bf16 by default, a 32,768-token vocabulary; the real
models' vocabularies are larger):

* `QWEN2_5_0_5B`: 24 blocks, d_model 896, 14 q heads and 2 kv heads of 64, SwiGLU 4864, q/k/v biases, tied
  embeddings;
* `LLAMA3_2_1B`: 16 blocks, d_model 2048, 32 q heads and 8 kv heads of 64, SwiGLU 8192, tied embeddings.

Each block is RMSNorm, attention (RoPE on q and k, grouped-query einsums, the causal `[B, T, S]` mask the model
builds itself, a float32 softmax), RMSNorm, SwiGLU.  Nothing here knows about flax_ringattn:
`fr.convert(model, example=lambda m: call(m, tokens, positions))` swaps the attention, as a user would.  The
benchmarks and examples share these models; `tiny(config)` keeps a config's head layout at a size CPU tests run.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
  name: str
  layers: int
  d_model: int
  heads: int
  kv_heads: int
  head_dim: int
  mlp: int
  vocab: int = 32768
  rope_base: float = 10_000.0
  qkv_bias: bool = False
  dtype: str = "bfloat16"

  def params(self) -> int:
    """Parameters (embedding tied with the output projection)."""
    attn = self.d_model * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
    attn += self.head_dim * (self.heads + 2 * self.kv_heads) if self.qkv_bias else 0
    block = attn + 3 * self.d_model * self.mlp + 2 * self.d_model
    return self.layers * block + self.vocab * self.d_model + self.d_model

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token: 6 x the matmul parameters (embedding lookup excluded, the tied output
    projection included), plus causal attention counted as half (3 x 2 x 2 x T / 2 x N x H per block)."""
    matmul = self.params() - self.d_model * (2 * self.layers + 1)
    return 6 * matmul + 6 * self.layers * seq_len * self.heads * self.head_dim


QWEN2_5_0_5B = DecoderConfig(
  "Qwen2.5-0.5B", layers=24, d_model=896, heads=14, kv_heads=2, head_dim=64, mlp=4864, rope_base=1e6, qkv_bias=True
)
LLAMA3_2_1B = DecoderConfig(
  "Llama-3.2-1B", layers=16, d_model=2048, heads=32, kv_heads=8, head_dim=64, mlp=8192, rope_base=5e5
)
CONFIGS = {c.name: c for c in (QWEN2_5_0_5B, LLAMA3_2_1B)}


def tiny(config: DecoderConfig, *, layers: int = 2, head_dim: int = 16, dtype: str = "float32") -> DecoderConfig:
  """`config`'s head layout (q heads, kv heads) at a size a CPU test runs."""
  d = config.heads * head_dim // 2
  return dataclasses.replace(
    config, name=f"tiny {config.name}", layers=layers, d_model=d, head_dim=head_dim, mlp=2 * d, vocab=256, dtype=dtype
  )


def rope(x, positions, base: float):
  """Rotary embedding of x [B, T, ..., H] at positions [B, T] (halves rotated)."""
  half = x.shape[-1] // 2
  angle = positions[..., None].astype(jnp.float32) * base ** (-jnp.arange(half) / half)
  angle = angle.reshape(*angle.shape[:2], *(1,) * (x.ndim - 3), half)
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  a, b = x[..., :half].astype(jnp.float32), x[..., half:].astype(jnp.float32)
  return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(x.dtype)


class Attention(nnx.Module):
  def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs):
    self.c = c
    dt = jnp.dtype(c.dtype)
    lin = lambda n, out, bias: nnx.Linear(n, out, use_bias=bias, dtype=dt, param_dtype=dt, rngs=rngs)  # noqa: E731
    self.q = lin(c.d_model, c.heads * c.head_dim, c.qkv_bias)
    self.k = lin(c.d_model, c.kv_heads * c.head_dim, c.qkv_bias)
    self.v = lin(c.d_model, c.kv_heads * c.head_dim, c.qkv_bias)
    self.o = lin(c.heads * c.head_dim, c.d_model, False)

  def __call__(self, x, positions, mask):
    c = self.c
    B, T, _ = x.shape
    q = rope(self.q(x).reshape(B, T, c.kv_heads, c.heads // c.kv_heads, c.head_dim), positions, c.rope_base)
    k = rope(self.k(x).reshape(B, T, c.kv_heads, c.head_dim), positions, c.rope_base)
    v = self.v(x).reshape(B, T, c.kv_heads, c.head_dim)
    logits = jnp.einsum("BTKGH,BSKH->BKGTS", q, k) * c.head_dim**-0.5
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
    return self.o(jnp.einsum("BKGTS,BSKH->BTKGH", probs, v).reshape(B, T, -1))


class MLP(nnx.Module):
  def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(c.dtype)
    lin = lambda n, out: nnx.Linear(n, out, use_bias=False, dtype=dt, param_dtype=dt, rngs=rngs)  # noqa: E731
    self.gate, self.up, self.down = lin(c.d_model, c.mlp), lin(c.d_model, c.mlp), lin(c.mlp, c.d_model)

  def __call__(self, x):
    return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
  def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(c.dtype)
    self.attn_norm = nnx.RMSNorm(c.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
    self.attn = Attention(c, rngs=rngs)
    self.mlp_norm = nnx.RMSNorm(c.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
    self.mlp = MLP(c, rngs=rngs)

  def __call__(self, x, positions, mask):
    x = x + self.attn(self.attn_norm(x), positions, mask)
    return x + self.mlp(self.mlp_norm(x))


class Decoder(nnx.Module):
  def __init__(self, c: DecoderConfig, *, rngs: nnx.Rngs):
    dt = jnp.dtype(c.dtype)
    self.config = c
    self.embed = nnx.Embed(c.vocab, c.d_model, dtype=dt, param_dtype=dt, rngs=rngs)
    self.blocks = nnx.List([Block(c, rngs=rngs) for _ in range(c.layers)])
    self.norm = nnx.RMSNorm(c.d_model, dtype=dt, param_dtype=dt, rngs=rngs)

  def __call__(self, tokens, positions):
    T = tokens.shape[1]
    mask = jnp.tril(jnp.ones((1, T, T), bool))  # the model's own causal mask
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, positions, mask)
    return self.embed.attend(self.norm(x))  # tied output projection


def call(model: Decoder, tokens, positions):
  """The model's forward on tokens and positions [B, T]: logits [B, T, vocab] (what `ServingEngine(call=...)` and
  `convert(example=...)` take)."""
  return model(tokens, positions)

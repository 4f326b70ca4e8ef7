"""Small decoders that write attention by hand, in the styles of public NNX models (written for these tests).

* `GemmaStyle`: grouped einsums (`BTKGH,BSKH->BTKGS`), q pre-scaled, optional tanh soft cap, optional
  sliding window built in the module from `triu` / `tril` bands, `jnp.where` against a large negative
  constant, logits merged to `[B, T, N, S]` for the mask and split back, RMS qk-norm, MHA / MQA / GQA, and a
  KV-cache dict path for sampling.
* `LlamaStyle`: `BTHGD,BSHD->BHGTS * scale`, float32 softmax, `jnp.where`, the model's `[B, T, S]` mask.
* `BiasStyle`: MHA with kv heads repeated by `jnp.repeat`, logits by `jnp.matmul`, an additive 0 / -inf bias,
  and a softmax written out with exp and sum.
* `SegmentStyle`: builds its mask inside from segment ids and positions.

Every model takes `(tokens [B, T] int, positions [B, T] int, mask-ish input)` and returns logits
`[B, T, vocab]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

VOCAB, D = 32, 32
NEG = -2.3819763e38  # a large negative constant, as such models name one


class RMS(nnx.Module):
  def __init__(self, dim):
    self.scale = nnx.Param(jnp.ones((dim,)))

  def __call__(self, x):
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-6) * self.scale


def rope(x, positions, base=10_000.0):
  """Rotary embedding of x [B, T, heads, H] at integer positions [B, T]."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half) / half)
  ang = positions[..., None, None].astype(jnp.float32) * freq
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)


class GemmaAttention(nnx.Module):
  def __init__(
    self, heads, kv_heads, head_dim, *, cap=None, window=None, window_from_positions=False, qk_norm=False, rngs
  ):
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
    init = nnx.initializers.normal(0.3)
    self.w_q = nnx.Param(init(rngs.params(), (heads, D, head_dim)))
    self.w_kv = nnx.Param(init(rngs.params(), (2, kv_heads, D, head_dim)))
    self.w_o = nnx.Param(init(rngs.params(), (heads, head_dim, D)))
    self.cap, self.window, self.window_from_positions = cap, window, window_from_positions
    self.q_norm = RMS(head_dim) if qk_norm else None
    self.k_norm = RMS(head_dim) if qk_norm else None

  def __call__(self, x, positions, mask, cache=None):
    q = jnp.einsum("BTD,NDH->BTNH", x, self.w_q[...])
    k, v = jnp.einsum("BSD,CKDH->CBSKH", x, self.w_kv[...])
    if self.q_norm is not None:
      q, k = self.q_norm(q), self.k_norm(k)
    q, k = rope(q, positions), rope(k, positions)
    q = q * self.head_dim**-0.5  # pre-scaled queries
    if cache is not None:  # sampling: write the new keys at the cache index, attend to the whole cache
      end = cache["end"]
      k = jax.lax.dynamic_update_slice(cache["k"], k, (0, end, 0, 0))
      v = jax.lax.dynamic_update_slice(cache["v"], v, (0, end, 0, 0))
      cache = {"k": k, "v": v, "end": end + x.shape[1]}
    B, T, N, H = q.shape
    K = self.kv_heads
    if K != N:
      logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, K, N // K, H), k).reshape(B, T, N, -1)
    else:
      logits = jnp.einsum("BTNH,BSNH->BTNS", q, k)
    if self.cap is not None:
      logits = jnp.tanh(logits / self.cap) * self.cap
    if self.window is not None and self.window_from_positions:  # built from data, as flax's examples/gemma does
      near = jnp.abs(positions[:, :, None] - positions[:, None, :]) < self.window
      mask = mask * near
    elif self.window is not None:
      ones = jnp.ones_like(mask)
      band = jnp.triu(ones, -self.window + 1) * jnp.tril(ones, self.window - 1)
      mask = mask * band
    logits = jnp.where(jnp.expand_dims(mask, -2), logits, NEG)
    probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
    if K != N:
      enc = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(B, T, K, N // K, -1), v).reshape(B, T, N, H)
    else:
      enc = jnp.einsum("BTNS,BSNH->BTNH", probs, v)
    out = jnp.einsum("BTNH,NHD->BTD", enc, self.w_o[...])
    return out if cache is None else (out, cache)


class LlamaAttention(nnx.Module):
  def __init__(self, heads, kv_heads, head_dim, *, rngs):
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
    self.q_proj = nnx.Linear(D, heads * head_dim, use_bias=False, rngs=rngs)
    self.k_proj = nnx.Linear(D, kv_heads * head_dim, use_bias=False, rngs=rngs)
    self.v_proj = nnx.Linear(D, kv_heads * head_dim, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(heads * head_dim, D, use_bias=False, rngs=rngs)

  def __call__(self, x, positions, mask):
    B, T, _ = x.shape
    K, G, H = self.kv_heads, self.heads // self.kv_heads, self.head_dim
    q = rope(self.q_proj(x).reshape(B, T, self.heads, H), positions).reshape(B, T, K, G, H)
    k = rope(self.k_proj(x).reshape(B, T, K, H), positions)
    v = self.v_proj(x).reshape(B, T, K, H)
    logits = jnp.einsum("BTHGD,BSHD->BHGTS", q, k) * H**-0.5
    logits = jnp.where(mask[:, None, None], logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("BHGTS,BSHD->BTHGD", probs, v).reshape(B, T, -1)
    return self.o_proj(out)


class BiasAttention(nnx.Module):
  """MHA over kv heads repeated with jnp.repeat, matmul logits, an additive bias, a written-out softmax."""

  def __init__(self, heads, kv_heads, head_dim, *, rngs):
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
    self.qkv = nnx.Linear(D, (heads + 2 * kv_heads) * head_dim, rngs=rngs)
    self.out = nnx.Linear(heads * head_dim, D, rngs=rngs)

  def __call__(self, x, positions, bias):
    del positions
    B, T, _ = x.shape
    N, K, H = self.heads, self.kv_heads, self.head_dim
    qkv = self.qkv(x)
    q = qkv[..., : N * H].reshape(B, T, N, H).transpose(0, 2, 1, 3)  # [B, N, T, H]
    k = qkv[..., N * H : (N + K) * H].reshape(B, T, K, H)
    v = qkv[..., (N + K) * H :].reshape(B, T, K, H)
    k = jnp.repeat(k, N // K, axis=2).transpose(0, 2, 3, 1)  # [B, N, H, S]
    v = jnp.repeat(v, N // K, axis=2).transpose(0, 2, 1, 3)  # [B, N, S, H]
    logits = jnp.matmul(q, k) / jnp.sqrt(jnp.float32(H)) + bias[:, None]
    e = jnp.exp(logits - jax.lax.stop_gradient(jnp.max(logits, axis=-1, keepdims=True)))
    probs = e / jnp.sum(e, axis=-1, keepdims=True)
    out = jnp.matmul(probs, v).transpose(0, 2, 1, 3).reshape(B, T, N * H)
    return self.out(out)


class SegmentAttention(nnx.Module):
  """Builds its mask inside from packed-document segment ids and positions."""

  def __init__(self, heads, head_dim, *, rngs):
    self.inner = LlamaAttention(heads, heads, head_dim, rngs=rngs)

  def __call__(self, x, positions, segments):
    same = segments[:, :, None] == segments[:, None, :]
    causal = positions[:, None, :] <= positions[:, :, None]
    mask = same & causal & (segments[:, None, :] > 0)  # segment 0 is padding (keys only)
    return self.inner(x, positions, mask)


class Block(nnx.Module):
  def __init__(self, attn, rngs):
    self.norm1, self.norm2 = RMS(D), RMS(D)
    self.attn = attn
    self.mlp = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x, positions, mask):
    x = x + self.attn(self.norm1(x), positions, mask)
    return x + jax.nn.gelu(self.mlp(self.norm2(x)))


class Decoder(nnx.Module):
  """Embedding, a python loop over blocks (optionally under nnx.remat), a tied read-out."""

  def __init__(self, make_attn, layers=2, *, remat=False, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([Block(make_attn(rngs), rngs) for _ in range(layers)])
    self.remat = remat

  def __call__(self, tokens, positions, mask):
    x = self.embed(tokens)
    for block in self.blocks:
      if self.remat:
        x = nnx.remat(lambda b, x, p, m: b(x, p, m))(block, x, positions, mask)
      else:
        x = block(x, positions, mask)
    return self.embed.attend(x)


def gemma(heads=4, kv_heads=2, head_dim=8, **kw):
  return lambda rngs: GemmaAttention(heads, kv_heads, head_dim, rngs=rngs, **kw)


def llama(heads=4, kv_heads=2, head_dim=8):
  return lambda rngs: LlamaAttention(heads, kv_heads, head_dim, rngs=rngs)


def bias(heads=4, kv_heads=2, head_dim=8):
  return lambda rngs: BiasAttention(heads, kv_heads, head_dim, rngs=rngs)


def segments(heads=4, head_dim=8):
  return lambda rngs: SegmentAttention(heads, head_dim, rngs=rngs)


class ScanDecoder(nnx.Module):
  """The blocks stacked (`nnx.vmap` at construction) and applied with `nnx.scan`."""

  def __init__(self, make_attn, layers=2, *, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Block(make_attn(rngs), rngs)

    self.blocks = create(rngs)

  def __call__(self, tokens, positions, mask):
    @nnx.scan(in_axes=(0, nnx.Carry, None, None), out_axes=nnx.Carry)
    def body(block, x, positions, mask):
      return block(x, positions, mask)

    return self.embed.attend(body(self.blocks, self.embed(tokens), positions, mask))

"""Small decoders that write attention by hand, in the styles of public NNX models (written for these tests).

* `GemmaStyle`: grouped einsums (`BTKGH,BSKH->BTKGS`), q pre-scaled, optional tanh soft cap, optional
  sliding window built in the module from `triu` / `tril` bands, `jnp.where` against a large negative
  constant, logits merged to `[B, T, N, S]` for the mask and split back, RMS qk-norm, MHA / MQA / GQA, and a
  KV-cache dict path for sampling.
* `LlamaStyle`: `BTHGD,BSHD->BHGTS * scale`, float32 softmax, `jnp.where`, the model's `[B, T, S]` mask.
* `BiasStyle`: MHA with kv heads repeated by `jnp.repeat`, logits by `jnp.matmul`, an additive 0 / -inf bias,
  and a softmax written out with exp and sum.
* `SegmentStyle`: builds its mask inside from segment ids and positions.
* `GptOssAttention`: GQA with attention sinks written out (a learned logit column per head joined to the
  logits, a float32 softmax, the column dropped), fused qkv with biases, an optional sliding window built in
  the module from a constant band; `GptOssDecoder` alternates windowed and full layers.
* `MlaAttention`: DeepSeek-style multi-head latent attention with small dims: q and k of 16 + 8 rope dims
  (q = concat(q_nope, q_rope), the rope part of k shared by every head), v of 16, keys and values from a
  normalised low-rank latent, logits `[B, T, N, S]` with the key axis last.

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

  def project(self, x, positions):
    """q [B, T, K, G, H] and k, v [B, T, K, H], rope applied."""
    B, T, _ = x.shape
    K, G, H = self.kv_heads, self.heads // self.kv_heads, self.head_dim
    q = rope(self.q_proj(x).reshape(B, T, self.heads, H), positions).reshape(B, T, K, G, H)
    k = rope(self.k_proj(x).reshape(B, T, K, H), positions)
    return q, k, self.v_proj(x).reshape(B, T, K, H)

  def __call__(self, x, positions, mask):
    B, T, _ = x.shape
    H = self.head_dim
    q, k, v = self.project(x, positions)
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


class GptOssAttention(nnx.Module):
  """GQA with per-head sink logits joined to the scores before the softmax and dropped after it."""

  def __init__(self, heads, kv_heads, head_dim, *, window=None, sink_column="last", rngs):
    self.heads, self.kv_heads, self.head_dim, self.window = heads, kv_heads, head_dim, window
    self.sink_column = sink_column  # "last" or "first"; the tests' broken variants use others
    self.qkv = nnx.Linear(D, (heads + 2 * kv_heads) * head_dim, rngs=rngs)
    self.out = nnx.Linear(heads * head_dim, D, rngs=rngs)
    self.sinks = nnx.Param(nnx.initializers.normal(1.0)(rngs.params(), (heads,)))

  def __call__(self, x, positions, mask):
    B, T, _ = x.shape
    N, K, H = self.heads, self.kv_heads, self.head_dim
    G = N // K
    q, k, v = jnp.split(self.qkv(x), [N * H, (N + K) * H], axis=-1)
    q = rope(q.reshape(B, T, N, H), positions).reshape(B, T, K, G, H)
    k = rope(k.reshape(B, T, K, H), positions)
    v = v.reshape(B, T, K, H)
    scores = jnp.einsum("btkgh,bskh->bkgts", q, k) * H**-0.5
    if self.window is not None:  # the last `window` tokens, the token itself included
      near = jnp.tril(jnp.ones((T, T), bool)) & ~jnp.tril(jnp.ones((T, T), bool), -self.window)
      mask = mask & near
    scores = jnp.where(mask[:, None, None], scores, NEG)
    column = jnp.broadcast_to(self.sinks[...].reshape(K, G, 1, 1), (B, K, G, T, 1)).astype(scores.dtype)
    first = self.sink_column in ("first", "first_dropped_last")
    scores = jnp.concatenate([column, scores] if first else [scores, column], axis=-1)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1)
    if self.sink_column in ("last", "first_dropped_last"):
      probs = probs[..., :-1]
    elif self.sink_column in ("first", "last_dropped_first"):
      probs = probs[..., 1:]
    else:  # "kept": the column is never dropped; the sink meets a zero value row instead (the same maths)
      v = jnp.concatenate([v, jnp.zeros_like(v[:, :1])], axis=1)
    enc = jnp.einsum("bkgts,bskh->btkgh", probs.astype(x.dtype), v)
    return self.out(enc.reshape(B, T, N * H))


class GptOssDecoder(Decoder):
  """Sliding-window layers (even) alternating with full ones (odd), as gpt-oss stacks them."""

  def __init__(self, layers=2, *, window=8, heads=4, kv_heads=2, head_dim=8, sink_column="last", rngs):
    super().__init__(
      lambda r: GptOssAttention(heads, kv_heads, head_dim, sink_column=sink_column, rngs=r), layers, rngs=rngs
    )
    for n, block in enumerate(self.blocks):
      block.attn.window = window if n % 2 == 0 else None


class MlaAttention(nnx.Module):
  """DeepSeek-style MLA: q/k head dim nope + rope, v head dim v_dim, k and v from a low-rank latent."""

  def __init__(self, heads, *, nope=16, rope_dim=8, v_dim=16, rank=16, rngs):
    self.heads, self.nope, self.rope_dim, self.v_dim, self.rank = heads, nope, rope_dim, v_dim, rank
    self.wq = nnx.Linear(D, heads * (nope + rope_dim), use_bias=False, rngs=rngs)
    self.wkv_a = nnx.Linear(D, rank + rope_dim, use_bias=False, rngs=rngs)
    self.kv_norm = RMS(rank)
    self.wkv_b = nnx.Linear(rank, heads * (nope + v_dim), use_bias=False, rngs=rngs)
    self.wo = nnx.Linear(heads * v_dim, D, use_bias=False, rngs=rngs)

  def __call__(self, x, positions, mask):
    B, T, _ = x.shape
    N = self.heads
    q = self.wq(x).reshape(B, T, N, self.nope + self.rope_dim)
    q_nope, q_rope = jnp.split(q, [self.nope], axis=-1)
    latent, k_rope = jnp.split(self.wkv_a(x), [self.rank], axis=-1)
    kv = self.wkv_b(self.kv_norm(latent)).reshape(B, T, N, self.nope + self.v_dim)
    k_nope, v = jnp.split(kv, [self.nope], axis=-1)
    k_rope = rope(k_rope[:, :, None, :], positions)  # one rope key shared by every head
    q = jnp.concatenate([q_nope, rope(q_rope, positions)], axis=-1)
    k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (B, T, N, self.rope_dim))], axis=-1)
    scores = jnp.einsum("bthd,bshd->bths", q, k) * (self.nope + self.rope_dim) ** -0.5
    scores = jnp.where(mask[:, :, None, :], scores, NEG)
    probs = jax.nn.softmax(scores.astype(jnp.float32), axis=-1).astype(x.dtype)
    out = jnp.einsum("bths,bshd->bthd", probs, v)
    return self.wo(out.reshape(B, T, N * self.v_dim))


def mla(heads=4, **kw):
  return lambda rngs: MlaAttention(heads, rngs=rngs, **kw)


class RematGemmaAttention(GemmaAttention):
  """Gemma-3-style attention that puts its own call under `nnx.remat` (google-tunix's `RematConfig.BLOCK` style):
  the whole attention, logits to output projection, is inside a `jax.checkpoint` body of the module's call."""

  def __init__(self, *args, policy: str | None = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.policy = policy  # a name in jax.checkpoint_policies, or None (save nothing)

  def __call__(self, x, positions, mask, cache=None):
    if cache is not None:
      return super().__call__(x, positions, mask, cache)
    policy = None if self.policy is None else getattr(jax.checkpoint_policies, self.policy)
    body = nnx.remat(lambda m, x, p, mask: GemmaAttention.__call__(m, x, p, mask), policy=policy)
    return body(self, x, positions, mask)


class RematLlamaAttention(LlamaAttention):
  """Llama-style attention whose logits-to-output core is a `jax.checkpoint`-ed function inside the call."""

  def __call__(self, x, positions, mask):
    B, T, _ = x.shape
    H = self.head_dim
    q, k, v = self.project(x, positions)

    @jax.checkpoint
    def core(q, k, v, mask):
      logits = jnp.einsum("BTHGD,BSHD->BHGTS", q, k) * H**-0.5
      logits = jnp.where(mask[:, None, None], logits, jnp.finfo(logits.dtype).min)
      probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(x.dtype)
      return jnp.einsum("BHGTS,BSHD->BTHGD", probs, v).reshape(B, T, -1)

    return self.o_proj(core(q, k, v, mask))

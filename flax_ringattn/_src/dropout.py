"""Attention dropout: the keep mask as a counter-based hash of the key and global indices.

The keep decision of one attention probability is a pure function of the
dropout key and the *global* indices (batch row, q head, q position, kv
position), so it does not depend on the ring size, the zigzag layout, the tile
sizes or the hop order, and a backward pass regenerates exactly the forward's
mask.  It is computed in one place, here, with int32 arithmetic only (wrapping
multiplies, xor, logical shifts) so that the reference, the XLA backend and
the Pallas TPU kernels evaluate the very same function.

Hash: murmur3's 32-bit finaliser (`_fmix`) over
    h_bh  = fmix(seed0 ^ (b * C1 + head))           one per (batch, head)
    h_q   = fmix(seed1 ^ (q_pos * C2))              one per query row
    h     = fmix(fmix((h_bh ^ h_q) + kv_pos * C3))  one per probability
and a probability is kept when the top 24 bits of h are >= rate * 2**24.
With `broadcast` (flax's `broadcast_dropout=True`, its default) batch and
head are 0: one mask shared by every batch row and head, as in flax.

Dropout is applied to the normalised probabilities, so the log-sum-exp and the
online-softmax merge across hops are unchanged; the backward masks dP and uses
delta = rowsum(dO * O) of the dropped output.

The dropout operand every backend receives is int32[4]:
(seed0, seed1, batch offset, head offset), where the offsets turn a shard's
local batch / head indices into global ones.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_C1 = 0x9E3779B1
_C2 = 0x85EBCA77
_C3 = 0xC2B2AE3D
_M1 = 0x85EBCA6B
_M2 = 0xC2B2AE35
BITS = 24


def _i32(c: int):
  """A 32-bit constant as a (wrapping) int32."""
  return jnp.int32(c - (1 << 32) if c >= (1 << 31) else c)


def _shr(x, n: int):
  return jax.lax.shift_right_logical(x, jnp.int32(n))


def _fmix(x):
  x = x ^ _shr(x, 16)
  x = x * _i32(_M1)
  x = x ^ _shr(x, 13)
  x = x * _i32(_M2)
  return x ^ _shr(x, 16)


def threshold(rate: float) -> int:
  return int(round(rate * (1 << BITS)))


def check_rate(dropout_rate) -> float:
  if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float)):
    raise TypeError(
      f"dropout_rate must be a Python float, got {type(dropout_rate).__name__} {dropout_rate!r} (a probability in "
      "[0, 1))"
    )
  if not 0.0 <= dropout_rate < 1.0:
    raise ValueError(f"{dropout_rate=} must be in [0, 1) (the probability of dropping an attention weight)")
  return float(dropout_rate)


def require_operand(rate: float, operand) -> bool:
  """Whether a backend drops: rate > 0, which needs the int32[4] dropout operand (backends/base.py).

  Every backend calls this, so a missing operand is an error everywhere instead
  of dropout being skipped silently in some backend.
  """
  if not rate:
    return False
  if operand is None:
    raise ValueError(
      f"dropout_rate={rate} needs the int32[4] dropout= operand of the block contract (backends/base.py)"
    )
  return True


def keep_scale(kept, rate: float):
  """f32 factor of each probability: 1 / (1 - rate) where `kept`, 0 where dropped (inverted dropout)."""
  return jnp.where(kept, jnp.float32(1.0 / (1.0 - rate)), jnp.float32(0.0))


@functools.cache
def _raw_key_shape() -> tuple[int, ...]:
  """The shape of a legacy uint32 key (`jax.random.PRNGKey`) of the default PRNG implementation: (2,) for
  threefry."""
  return tuple(jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))).shape)


def check_rng(rng):
  """`dropout_rng` must be one JAX PRNG key: a typed key array of shape () (`jax.random.key(seed)`) or a legacy
  uint32 key (`jax.random.PRNGKey(seed)`, uint32[2] for threefry).  Anything else (an int seed, a float array, a
  batch of keys) is a TypeError here instead of JAX's "invalid PRNG key data" deep in the call."""
  if rng is None:
    raise ValueError("dropout_rate > 0 needs dropout_rng=... (a jax.random key: pass jax.random.key(seed))")
  shape, dtype = getattr(rng, "shape", None), getattr(rng, "dtype", None)
  if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
    if tuple(shape) == ():
      return rng
  elif dtype == jnp.uint32 and tuple(shape) == _raw_key_shape():
    return rng
  what = f"{type(rng).__name__} {rng!r}" if shape is None else f"an array of shape {tuple(shape)} and dtype {dtype}"
  raise TypeError(
    f"dropout_rng must be one jax.random key, got {what}: pass jax.random.key(seed) (or a legacy "
    f"jax.random.PRNGKey(seed), uint32{list(_raw_key_shape())})"
  )


def seed_operand(rng):
  """int32[4] (seed0, seed1, 0, 0) from a JAX PRNG key (typed or raw uint32)."""
  rng = check_rng(rng)
  bits = jax.random.bits(rng, (2,), jnp.uint32)
  seed = jax.lax.bitcast_convert_type(bits, jnp.int32)
  return jnp.concatenate([seed, jnp.zeros((2,), jnp.int32)])


def with_offsets(operand, batch_offset, head_offset):
  return jnp.stack([operand[0], operand[1], jnp.int32(batch_offset), jnp.int32(head_offset)]).astype(jnp.int32)


def keep(seed0, seed1, b, head, q_pos, kv_pos, *, rate: float):
  """bool keep mask of mutually broadcastable int32 index arrays (all global)."""
  i32 = jnp.int32
  h_bh = _fmix(seed0 ^ (jnp.asarray(b, i32) * _i32(_C1) + jnp.asarray(head, i32)))
  h_q = _fmix(seed1 ^ (jnp.asarray(q_pos, i32) * _i32(_C2)))
  h = _fmix(_fmix((h_bh ^ h_q) + jnp.asarray(kv_pos, i32) * _i32(_C3)))
  return _shr(h, 32 - BITS) >= i32(threshold(rate))


def keep_grouped(operand, q_pos, kv_pos, *, rate: float, broadcast: bool, B: int, K: int, G: int):
  """Keep mask of a [B, K, G, T, S] block (q heads grouped by kv head: head = k * G + g).

  `operand` is the int32[4] dropout operand; q_pos [T] or [B, T] / kv_pos [S] or [B, S] are the tokens'
  positions.  With `broadcast` and positions shared by every row the result is [1, 1, 1, T, S].
  """
  qp, kp = (jnp.asarray(p, jnp.int32) for p in (q_pos, kv_pos))
  qp = (qp if qp.ndim == 2 else qp[None])[:, None, None, :, None]
  kp = (kp if kp.ndim == 2 else kp[None])[:, None, None, None, :]
  if broadcast:
    return keep(operand[0], operand[1], 0, 0, qp, kp, rate=rate)
  b = operand[2] + jnp.arange(B, dtype=jnp.int32)[:, None, None, None, None]
  head = operand[3] + (jnp.arange(K, dtype=jnp.int32)[:, None] * G + jnp.arange(G, dtype=jnp.int32)[None, :])
  return keep(operand[0], operand[1], b, head[None, :, :, None, None], qp, kp, rate=rate)

"""Sequence layouts of the ring: contiguous shards and zigzag (load-balanced).

With a causal mask and contiguous shards, device r of a ring of n only sees keys
from devices 0..r, so device n-1 does n times the work of device 0.  The zigzag
layout ("dual chunk swap", MaxText / TransformerEngine) cuts the sequence into
2n chunks and gives device r chunks r and 2n-1-r: every device then holds one
early and one late chunk and does the same causal work.

Worked example, n = 2, 8 tokens, chunk = 2 tokens:
  natural order   0 1 | 2 3 | 4 5 | 6 7      (chunks c0 c1 c2 c3)
  zigzag order    0 1 6 7 | 2 3 4 5          (device 0: c0 c3, device 1: c1 c2)

A data pipeline reorders once with `zigzag_order`, feeds RoPE the positions from
`zigzag_positions`, and calls the ring with `load_balance=True`; outputs come
back in the same zigzag order (`zigzag_inverse` restores the natural order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _zigzag_permutation(seq_len: int, num_shards: int) -> np.ndarray:
  """perm[i] = natural position of the token at zigzag index i."""
  if num_shards < 1:
    raise ValueError(f"{num_shards=} must be >= 1")
  if seq_len % (2 * num_shards):
    raise ValueError(
      f"{seq_len=} must be a multiple of 2 * {num_shards=} for the zigzag layout "
      f"(each device holds two chunks of seq_len / (2 * num_shards) tokens)"
    )
  chunk = seq_len // (2 * num_shards)
  chunks = np.arange(seq_len).reshape(2 * num_shards, chunk)
  order = []
  for r in range(num_shards):
    order += [chunks[r], chunks[2 * num_shards - 1 - r]]
  return np.concatenate(order)


def zigzag_positions(seq_len: int, num_shards: int) -> np.ndarray:
  """Natural (global) positions of the tokens of a zigzag-ordered sequence.

  Feed these to RoPE (or any positional encoding) when the sequence was
  reordered with `zigzag_order`: `[seq_len]` int32.
  """
  return _zigzag_permutation(seq_len, num_shards).astype(np.int32)


def zigzag_order(x, num_shards: int, axis: int = 1):
  """Reorders `x` along `axis` (the sequence) into the zigzag layout.

  `x.shape[axis]` must be a multiple of `2 * num_shards`.  Works on jax and numpy
  arrays; pair with `ring_attention(..., load_balance=True)`.
  """
  return _permute(x, _zigzag_permutation(x.shape[axis], num_shards), axis)


def zigzag_inverse(x, num_shards: int, axis: int = 1):
  """Undoes `zigzag_order`: back to the natural token order along `axis`."""
  return _permute(x, np.argsort(_zigzag_permutation(x.shape[axis], num_shards)), axis)


def _permute(x, perm, axis: int):
  if isinstance(x, np.ndarray):
    return np.take(x, perm, axis=axis)
  axis = axis % x.ndim
  index = (slice(None),) * axis + (perm,)
  # With Explicit mesh axes the output sharding of a gather is ambiguous; the
  # permuted array keeps the sharding of the input.
  out_sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(out_sharding, "spec", None)
  if spec is not None and any(e is not None for e in spec) and _is_explicit(out_sharding):
    return jnp.asarray(x).at[index].get(out_sharding=out_sharding)
  return jnp.take(x, perm, axis=axis)


def _is_explicit(sharding) -> bool:
  mesh = getattr(sharding, "mesh", None)
  types = getattr(mesh, "axis_types", ())
  return any(t == jax.sharding.AxisType.Explicit for t in types)


def shard_positions(shard, num_shards, shard_len: int, load_balance: bool):
  """Global positions of the tokens held by ring member `shard` (may be traced).

  Contiguous: shard * L + [0, L).  Zigzag: the first half holds chunk `shard`,
  the second half chunk `2 * num_shards - 1 - shard`, each L / 2 tokens long.
  Positions increase monotonically within a shard in both layouts.
  """
  if not load_balance:
    return shard * shard_len + jnp.arange(shard_len, dtype=jnp.int32)
  half = shard_len // 2
  lo = shard * half + jnp.arange(half, dtype=jnp.int32)
  hi = (2 * num_shards - 1 - shard) * half + jnp.arange(half, dtype=jnp.int32)
  return jnp.concatenate([lo, hi])


def gathered_positions(first_shard, count: int, num_shards: int, shard_len: int, load_balance: bool):
  """Global positions of `count` consecutive shards, first_shard .. first_shard + count - 1, concatenated.

  After an all-to-all (Ulysses) or an all-gather over the sequence axis, a device
  holds the shards of several ring members side by side in member order; their
  positions are those of each member's shard (`shard_positions`), so the zigzag
  layout carries over.  Worked example, 4 shards of 4 tokens, zigzag, all
  gathered: [0 1 14 15 | 2 3 12 13 | 4 5 10 11 | 6 7 8 9].
  """
  if count == 1:
    return shard_positions(first_shard, num_shards, shard_len, load_balance)
  return jnp.concatenate([shard_positions(first_shard + j, num_shards, shard_len, load_balance) for j in range(count)])

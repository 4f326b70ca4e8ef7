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
  return token_positions(shard, num_shards, shard_len, load_balance, jnp.arange(shard_len, dtype=jnp.int32))


def token_positions(shard, num_shards, shard_len: int, load_balance: bool, index):
  """Global positions of the tokens at local indices `index` (any int array) of shard `shard`.

  The elementwise form of `shard_positions`, for kernels that build one tile's positions from an iota.
  A static shard (int) and a numpy `index` give numpy positions.
  """
  if not load_balance:
    return shard * shard_len + index
  half = shard_len // 2
  where = np.where if isinstance(shard, int) and isinstance(index, np.ndarray) else jnp.where
  return where(index < half, shard * half + index, (2 * num_shards - 1 - shard) * half + (index - half))


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


def snake_coords(member, sizes):
  """Mesh coordinates of ring member `member` (may be traced) on a ring over axes of `sizes`.

  A boustrophedon (snake) walk: the last axis runs forward on even rows of the
  one before it and backward on odd rows, recursively, so consecutive members
  are grid neighbours; the wrap from the last member to the first is a torus
  neighbour when the leading axis has even size.  Worked example, sizes (2, 3):
  members 0..5 sit at (0,0) (0,1) (0,2) (1,2) (1,1) (1,0).
  """
  coords = []
  rest = member
  for i in range(len(sizes)):
    stride = 1
    for s in sizes[i + 1 :]:
      stride *= s
    d = rest // stride
    rest = rest % stride
    coords.append(d)
    if i + 1 < len(sizes):
      rest = _select(d % 2 == 1, stride - 1 - rest, rest)
  return tuple(coords)


def _select(cond, a, b):
  """a if cond else b: plain Python on static ints (for ppermute tables), jnp.where on traced ones."""
  return (a if cond else b) if isinstance(cond, bool) else jnp.where(cond, a, b)


def linear_index(coords, sizes):
  """Row-major index of mesh coordinates over axes of `sizes` (the shard index `lax.axis_index` of the tuple gives)."""
  idx = 0
  for c, s in zip(coords, sizes, strict=True):
    idx = idx * s + c
  return idx


def snake_member(coords, sizes):
  """Inverse of `snake_coords`: the ring member at mesh `coords`."""
  if not coords:
    return 0
  stride = 1
  for s in sizes[1:]:
    stride *= s
  sub = snake_member(coords[1:], sizes[1:])
  d = coords[0]
  return d * stride + _select(d % 2 == 1, stride - 1 - sub, sub)


def ring_shard(member, sizes):
  """Shard index (row-major over the ring's mesh axes) held by ring member `member`."""
  return linear_index(snake_coords(member, sizes), sizes)


def ring_axes(axis_name) -> tuple:
  """The ring's mesh axes as a tuple: () for no ring, (name,) for one axis, or the tuple itself."""
  if axis_name is None:
    return ()
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def ring_geometry(axis_name):
  """(n, sizes, shard, member) of this device inside shard_map: ring size, axis sizes, the index of the
  shard it holds (row-major over the axes) and its place on the snake ring.  (1, (), 0, 0) without a ring."""
  axes = ring_axes(axis_name)
  if not axes:
    return 1, (), jnp.int32(0), jnp.int32(0)
  sizes = tuple(jax.lax.axis_size(a) for a in axes)
  coords = tuple(jax.lax.axis_index(a) for a in axes)
  n = 1
  for s in sizes:
    n *= s
  return n, sizes, linear_index(coords, sizes), snake_member(coords, sizes)


def rotate(tree, axis_name, n: int):
  """Ring member m's values to member m + 1 (ppermute indices are row-major shard indices over the axes)."""
  sizes = tuple(jax.lax.axis_size(a) for a in ring_axes(axis_name))
  perm = [(ring_shard(m, sizes), ring_shard((m + 1) % n, sizes)) for m in range(n)]
  return jax.tree.map(lambda x: jax.lax.ppermute(x, axis_name, perm), tree)

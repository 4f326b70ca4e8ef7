"""Tile sizes of the block kernels (`BlockSizes`)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockSizes:
  """Tile sizes, in tokens, for one (q shard, kv shard) block computation.

  `block_q` x `block_kv` is the largest score tile a backend materialises per
  head.  The backward pass uses `block_q_bwd` / `block_kv_bwd` when given and
  the forward sizes otherwise.  A tile larger than the shard is clamped to the
  shard; a shard that is not a multiple of the tile uses the largest divisor of
  the shard length below the tile (see `effective_tile`).

  `fused_bwd` (Pallas TPU block kernels; other backends ignore it): True
  computes dq inside the dk/dv kernel from the probabilities and dS it already
  has (one kernel; each kv tile writes its own dq partial, S / block_kv_bwd
  partials of dq's size in HBM, summed after), False runs a dq kernel and a
  dk/dv kernel; None lets the backend choose (the fused kernel wherever its
  partials fit `planners.FUSED_DQ_MAX_BYTES`).
  """

  block_q: int = 512
  block_kv: int = 512
  block_q_bwd: int | None = None
  block_kv_bwd: int | None = None
  fused_bwd: bool | None = None

  def __post_init__(self):
    if self.fused_bwd is not None and not isinstance(self.fused_bwd, bool):
      raise TypeError(f"BlockSizes.fused_bwd must be a bool or None, got {self.fused_bwd!r}")
    for name in ("block_q", "block_kv", "block_q_bwd", "block_kv_bwd"):
      value = getattr(self, name)
      if value is None and name.endswith("_bwd"):
        continue
      if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"BlockSizes.{name} must be an int, got {value!r} ({type(value).__name__})")
      if value < 1:
        raise ValueError(f"BlockSizes.{name} must be >= 1, got {name}={value}")

  @property
  def bwd(self) -> tuple[int, int]:
    """(block_q, block_kv) used by the backward pass."""
    return (self.block_q_bwd or self.block_q, self.block_kv_bwd or self.block_kv)


def effective_tile(length: int, requested: int) -> int:
  """Largest divisor of `length` that is <= `requested` (so tiles cover it exactly)."""
  if length <= requested:
    return length
  for t in range(requested, 0, -1):
    if length % t == 0:
      return t
  return 1

"""The options object: everything static about one attention call, built once by a public entry point.

`ring_attention`, `paged_attention` and the layers above them validate their keyword arguments once and build
one `AttentionSpec`; from there the same frozen, hashable object (a jit static argument and part of the `flash`
kernel) travels unchanged to the backends and their kernels.  A new static option is one field here, set in the
entry point that accepts it and read by the kernels that implement it.

Mask rules live in `masks.MaskSpec` (the window is jax.nn's `local_window_size`, `(left, right)`, in both
ops; paged attention is causal).  Test hooks travel in `debug` (`_src/debug.py`), never in module globals.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flax_ringattn._src.block_sizes import BlockSizes
from flax_ringattn._src.debug import KernelDebug
from flax_ringattn._src.masks import MaskSpec


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec:
  """Everything static about one attention call; hashable (a jit static arg)."""

  mask: MaskSpec
  scale: float
  logits_soft_cap: float | None = None
  # Ring: the caller's tiles, or None for the backend's own choice.  Paged: the resolved blocks, block_q rows
  # per chunk and block_kv a whole number of pages.
  block_sizes: BlockSizes | None = None
  precision: object = None  # jax.lax.Precision for the XLA matmuls, or None
  dropout_rate: float = 0.0  # attention dropout on the normalised probabilities (see `_src/dropout.py`)
  dropout_broadcast: bool = True  # one dropout mask for every batch row and head (flax's broadcast_dropout)
  debug: KernelDebug | None = None  # test hooks of the kernels (`_src/debug.py`); None in production

  @property
  def window_left(self) -> int | None:
    """How many earlier tokens a query sees besides itself (`local_window_size`'s left), or None."""
    return None if self.mask.window is None else self.mask.window[0]


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProblemShape:
  """The per-device shape of one attention problem, as the planners, the advisor and the cost model see it.

  For the planners q_len / kv_len are the lengths one kernel sees (a ring's shard lengths) and the three flags
  name the features that add buffers or temporaries to a kernel; the advisor hands the cost model the whole
  call's shape.  Built once per call (`of`) and handed down whole.
  """

  q_len: int
  kv_len: int
  num_heads: int
  num_kv_heads: int
  head_dim: int  # q and k's
  dtype: object
  has_segments: bool = False
  # The mask's other per-row data (`MaskSpec.data_fields` but segment ids: positions given per row, bidirectional
  # ids): one more q column and kv row each in the kernels that take them.
  extra_fields: tuple[str, ...] = ()
  soft_cap: bool = False
  dropout: bool = False
  v_head_dim: int | None = None  # v's (and the output's) when it differs from head_dim (MLA); None: the same

  @classmethod
  def of(cls, q_shape, k_shape, dtype, spec: AttentionSpec, *, split: int = 1, v_shape=None) -> ProblemShape:
    """From q [B, T, N, H], k [B, S, K, H] and v [B, S, K, Hv] shapes (None: like k), each length split `split`
    ways, and the call's options."""
    _, T, N, H = q_shape
    _, S, K, _ = k_shape
    Hv = H if v_shape is None else v_shape[3]
    return cls(
      q_len=T // split,
      kv_len=S // split,
      num_heads=N,
      num_kv_heads=K,
      head_dim=H,
      dtype=dtype,
      has_segments=spec.mask.has_segments,
      extra_fields=tuple(f for f in spec.mask.data_fields if f != "seg"),
      soft_cap=spec.logits_soft_cap is not None,
      dropout=bool(spec.dropout_rate),
      v_head_dim=None if Hv == H else Hv,
    )

  @property
  def head_dim_v(self) -> int:
    """v's head dim (the output's): `v_head_dim`, or `head_dim` when they are equal."""
    return self.head_dim if self.v_head_dim is None else self.v_head_dim

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def heads(self) -> dict:
    heads = dict(num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim)
    return heads if self.v_head_dim is None else dict(heads, v_head_dim=self.v_head_dim)

  @property
  def features(self) -> dict:
    features = dict(has_segments=self.has_segments, soft_cap=self.soft_cap, dropout=self.dropout)
    return features | ({"extra_fields": self.extra_fields} if self.extra_fields else {})

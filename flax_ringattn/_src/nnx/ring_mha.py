"""`RingMultiHeadAttention` and `make_ring_attention_fn`: ring attention for Flax NNX.

Both are drop-ins for `flax.nnx.MultiHeadAttention`: the layer has the same
constructor and parameter tree (so `nnx.update(ring_layer,
nnx.state(mha_layer))` loads existing weights), and the function plugs into
`nnx.MultiHeadAttention(attention_fn=...)`.  Neither touches kernels: they
project, constrain shardings and call the `ring_attention` op.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from flax import nnx
from jax.sharding import PartitionSpec as P

from flax_ringattn._src import sharding
from flax_ringattn._src.nnx.common import head_sharding_metadata
from flax_ringattn._src.ring.op import ring_attention

_MASK_ALTERNATIVES = (
  "ring attention never builds a dense [B, N, T, S] mask (it would cost O(T * S) memory on every device); "
  "express the mask with is_causal=True, segment_ids=... (packed documents / padding: give padding its own id), "
  "local_window_size=... (sliding window), or a combination"
)


def _unsupported_call_options(*, mask, sow_weights, dropout_rate, deterministic, bias=None, decode=False):
  if mask is not None:
    raise NotImplementedError(f"mask=... is not supported: {_MASK_ALTERNATIVES}")
  if bias is not None:
    raise NotImplementedError("an additive attention bias is not supported by ring attention")
  if sow_weights:
    raise NotImplementedError(
      "sow_weights=True is not supported: ring attention never materialises the [T, S] attention weights"
    )
  if dropout_rate and not deterministic:
    raise NotImplementedError(
      f"attention dropout is not supported ({dropout_rate=}); set dropout_rate=0.0 or deterministic=True"
    )
  if decode:
    raise NotImplementedError(
      "decode=True (autoregressive KV cache) is not supported by RingMultiHeadAttention; "
      "ring attention is for training and prefill over sharded sequences"
    )


class RingMultiHeadAttention(nnx.MultiHeadAttention):
  """`nnx.MultiHeadAttention` whose attention is ring attention over a mesh axis.

  Takes every argument of `nnx.MultiHeadAttention` (same parameter tree), plus
  the keyword-only:

  Args:
    mesh: `jax.sharding.Mesh` to run on; None runs on one device, or inside your
      own `shard_map` when `seq_axis` is bound there.
    seq_axis: mesh axis the sequence is sharded over (default: the mesh's only
      axis).
    head_axis: mesh axis for heads (tensor parallelism): parameters carry it
      as sharding metadata and activations are constrained to it.
    batch_axis: mesh axis for the batch (data parallelism).
    load_balance: inputs are in zigzag order (see `zigzag_order`).
    strategy: "ring" (default), "ulysses", "all_gather" or "ulysses_ring"
      (then seq_axis=(ring_axis, ulysses_axis)); see `ring_attention`.
    implementation, block_sizes, interpret: passed to `ring_attention`
      (`interpret=True` runs the pallas_tpu kernels in TPU interpret mode on CPU).
    local_window_size, logits_soft_cap: mask / logit options of `ring_attention`
      applied on every call.

  `__call__` takes the arguments of `nnx.MultiHeadAttention.__call__` plus
  `segment_ids` ([B, T] or a (q_ids, kv_ids) pair).  A dense `mask`, dropout,
  `sow_weights` and `decode` raise `NotImplementedError` with the alternatives.
  """

  def __init__(
    self,
    num_heads: int,
    in_features: int,
    qkv_features: int | None = None,
    out_features: int | None = None,
    num_kv_heads: int | None = None,
    in_kv_features: int | None = None,
    *,
    mesh=None,
    seq_axis=None,
    head_axis=None,
    batch_axis=None,
    load_balance: bool = False,
    strategy: str = "ring",
    implementation: str | None = None,
    block_sizes=None,
    interpret=None,
    local_window_size=None,
    logits_soft_cap: float | None = None,
    dropout_rate: float = 0.0,
    kernel_metadata: Mapping = MappingProxyType({}),
    out_kernel_metadata: Mapping = MappingProxyType({}),
    bias_metadata: Mapping = MappingProxyType({}),
    out_bias_metadata: Mapping = MappingProxyType({}),
    **kwargs,
  ):
    if dropout_rate:
      raise NotImplementedError(
        f"RingMultiHeadAttention does not implement attention dropout ({dropout_rate=}); use dropout_rate=0.0"
      )
    seq_axis = sharding.sequence_axis(mesh, seq_axis, arg="seq_axis")
    metadata = head_sharding_metadata(
      head_axis,
      mesh,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
      out_kernel_metadata=out_kernel_metadata,
      out_bias_metadata=out_bias_metadata,
    )
    super().__init__(
      num_heads,
      in_features,
      qkv_features,
      out_features,
      num_kv_heads,
      in_kv_features,
      dropout_rate=0.0,
      **metadata,
      **kwargs,
    )
    self.mesh = mesh
    self.seq_axis = seq_axis
    self.head_axis = head_axis
    self.batch_axis = batch_axis
    self.load_balance = load_balance
    self.strategy = strategy
    self.implementation = implementation
    self.block_sizes = block_sizes
    self.interpret = interpret
    self.local_window_size = local_window_size
    self.logits_soft_cap = logits_soft_cap

  def __call__(
    self,
    inputs_q,
    inputs_k=None,
    inputs_v=None,
    *,
    mask=None,
    deterministic: bool | None = None,
    rngs=None,
    sow_weights: bool = False,
    decode: bool | None = None,
    is_causal: bool = False,
    out_sharding=None,
    qkv_sharding=None,
    segment_ids=None,
  ):
    del rngs  # no dropout
    _unsupported_call_options(
      mask=mask,
      sow_weights=sow_weights,
      dropout_rate=0.0,
      deterministic=deterministic,
      decode=decode if decode is not None else bool(self.decode),
    )
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None when inputs_v is given (pass inputs_k to use it for both)")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(
        f"inputs_q has {inputs_q.shape[-1]} features but the layer expects in_features={self.in_features}"
      )

    mesh = self.mesh
    seq = P(self.batch_axis, self.seq_axis, None)
    heads = P(self.batch_axis, self.seq_axis, self.head_axis, None)
    inputs_q, inputs_k, inputs_v = (sharding.constrain(x, mesh, seq) for x in (inputs_q, inputs_k, inputs_v))
    query = sharding.constrain(self.query(inputs_q, out_sharding=qkv_sharding), mesh, heads)
    key = sharding.constrain(self.key(inputs_k, out_sharding=qkv_sharding), mesh, heads)
    value = sharding.constrain(self.value(inputs_v, out_sharding=qkv_sharding), mesh, heads)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)

    x = ring_attention(
      query,
      key,
      value,
      axis_name=self.seq_axis,
      mesh=mesh,
      is_causal=is_causal,
      segment_ids=segment_ids,
      local_window_size=self.local_window_size,
      logits_soft_cap=self.logits_soft_cap,
      load_balance=self.load_balance,
      strategy=self.strategy,
      implementation=self.implementation,
      block_sizes=self.block_sizes,
      interpret=self.interpret,
      batch_axis=self.batch_axis if mesh is not None else None,
      head_axis=self.head_axis if mesh is not None else None,
      precision=self.precision,
    )
    if out_sharding is None and mesh is not None and sharding.has_explicit_axes(mesh, seq):
      # Explicit axes: the out projection contracts the (possibly sharded)
      # heads, so say where the result lives.
      out_sharding = sharding.named(mesh, seq)
    return sharding.constrain(self.out(x, out_sharding=out_sharding), mesh, seq)


def make_ring_attention_fn(
  *,
  mesh=None,
  seq_axis=None,
  head_axis=None,
  batch_axis=None,
  is_causal: bool = False,
  load_balance: bool = False,
  local_window_size=None,
  logits_soft_cap: float | None = None,
  implementation: str | None = None,
  block_sizes=None,
  interpret=None,
  strategy: str = "ring",
):
  """An `attention_fn` for `nnx.MultiHeadAttention` that runs ring attention.

  Usage: `nnx.MultiHeadAttention(..., attention_fn=make_ring_attention_fn(mesh=mesh, is_causal=True))`.
  The returned function accepts every keyword flax passes (mask, dropout_rng,
  dropout_rate, broadcast_dropout, deterministic, dtype, precision, module,
  is_causal, ...); `is_causal` is on when either this factory or the call asks
  for it.  `strategy` picks the sequence-parallel strategy (see `ring_attention`;
  "ulysses_ring" takes seq_axis=(ring_axis, ulysses_axis)).  A dense mask, bias, dropout and sow_weights (module=...) raise
  `NotImplementedError` naming the alternatives.
  """
  seq_axis = sharding.sequence_axis(mesh, seq_axis, arg="seq_axis")

  def ring_attention_fn(
    query,
    key,
    value,
    bias=None,
    mask=None,
    broadcast_dropout: bool = True,
    dropout_rng=None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype=None,
    precision=None,
    module=None,
    promote_dtype=None,
    is_causal: bool = False,
    segment_ids=None,
  ):
    del broadcast_dropout, dropout_rng
    _unsupported_call_options(
      mask=mask, bias=bias, sow_weights=module is not None, dropout_rate=dropout_rate, deterministic=deterministic
    )
    if promote_dtype is not None:
      query, key, value = promote_dtype((query, key, value), dtype=dtype)
    elif dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    return ring_attention(
      query,
      key,
      value,
      axis_name=seq_axis,
      mesh=mesh,
      is_causal=bool(is_causal or is_causal_default),
      segment_ids=segment_ids,
      local_window_size=local_window_size,
      logits_soft_cap=logits_soft_cap,
      load_balance=load_balance,
      strategy=strategy,
      implementation=implementation,
      block_sizes=block_sizes,
      interpret=interpret,
      batch_axis=batch_axis if mesh is not None else None,
      head_axis=head_axis if mesh is not None else None,
      precision=precision,
    )

  is_causal_default = is_causal
  return ring_attention_fn

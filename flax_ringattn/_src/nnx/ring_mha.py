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

from flax_ringattn._src import sharding, validation
from flax_ringattn._src.dropout import check_rate
from flax_ringattn._src.nnx.common import (
  build_head_options,
  check_keywords,
  check_layer_arguments,
  head_sharding_metadata,
  place_params,
  warn_if_ring_of_one,
)
from flax_ringattn._src.ring import strategies
from flax_ringattn._src.ring.dense import masked_ring_attention
from flax_ringattn._src.ring.op import check_mesh_lengths, check_static_options
from flax_ringattn._src.ring.options import RingOptions

_NO_DECODE = (
  "decode=True (autoregressive KV cache) is not supported by RingMultiHeadAttention; "
  "ring attention is for training and prefill over sharded sequences (PagedMultiHeadAttention, or "
  "convert(model, to='paged'), gives layers for sampling with a paged cache)"
)


def _unsupported_call_options(*, sow_weights, bias=None, decode=False):
  if bias is not None:
    raise NotImplementedError("an additive attention bias is not supported by ring attention")
  if sow_weights:
    raise NotImplementedError(
      "sow_weights=True is not supported: ring attention never materialises the [T, S] attention weights"
    )
  if decode:
    raise NotImplementedError(_NO_DECODE)


def _on_mesh(options: RingOptions) -> RingOptions:
  """Batch and head axes apply only with a mesh: inside the caller's own shard_map the inputs are already the
  local shards."""
  if options.mesh is not None:
    return options
  return options.replace(batch_axis=None, head_axis=None)


def call_positions(positions, load_balance: bool) -> dict:
  """The op's position keywords of a layer call's `positions=` ([B, T], or a (q, kv) pair); warns once when the
  zigzag order of `load_balance=True` is taken on trust."""
  if positions is None:
    if load_balance:
      validation.warn_once(
        "load_balance_on_trust",
        "load_balance=True without positions=: the inputs are taken to be in zigzag order (zigzag_order), and a "
        "different order gives wrong results with no error; pass positions=zigzag_positions(T, n) (or the "
        "tokens' own positions, for any order) to have the mask evaluated on them",
        UserWarning,
      )
    return {}
  if isinstance(positions, (tuple, list)):
    if len(positions) != 2:
      raise ValueError(f"positions must be an array or a (q_positions, kv_positions) pair, got {len(positions)} items")
    return dict(q_positions=positions[0], kv_positions=positions[1])
  return dict(q_positions=positions)


def _option(field: str, doc: str):
  return property(lambda self: getattr(self.ring_options, field), doc=doc)


def _check_layout_options(cls_name, mesh, seq_axis, head_axis, batch_axis, strategy):
  """What the layers and `make_ring_attention_fn` can check before any call: strategy, and axes on the mesh."""
  strategy = strategies.check_strategy(strategy)
  if seq_axis is not None:
    strategies.check_axes(strategy, seq_axis)
  sharding.check_mesh_axes(mesh, where=cls_name, seq_axis=seq_axis, head_axis=head_axis, batch_axis=batch_axis)


class RingMultiHeadAttention(nnx.MultiHeadAttention):
  """`nnx.MultiHeadAttention` whose attention is ring attention over a mesh axis.

  Takes every argument of `nnx.MultiHeadAttention` (same parameter tree,
  `dropout_rate`, `broadcast_dropout`, `deterministic`, `rngs`), plus the
  keyword-only:

  Args:
    mesh: `jax.sharding.Mesh` to run on; None runs on one device, or inside your
      own `shard_map` when `seq_axis` is bound there.  Parameters are typed on
      it (replicated, or sharded over `head_axis`) at construction and again at
      every call, so weights loaded with `nnx.update` land on the mesh too.
    seq_axis: mesh axis the sequence is sharded over (default: the mesh's only
      axis).
    head_axis: mesh axis for heads (tensor parallelism): parameters carry it
      as sharding metadata and activations are constrained to it.
    batch_axis: mesh axis for the batch (data parallelism).
    load_balance: inputs are in zigzag order (see `zigzag_order`).  Without
      `positions=` in the call this order is taken on trust (a warning says so
      once); with them any order is exact.
    strategy: "ring" (default), "ulysses", "all_gather" or "ulysses_ring"
      (then seq_axis=(ring_axis, ulysses_axis)); see `ring_attention`.
    implementation, block_sizes, interpret: passed to `ring_attention`
      (`implementation="pallas_tpu", interpret=True` runs the TPU kernels in
      TPU interpret mode on CPU).
    local_window_size, chunk_size, logits_soft_cap, scale: mask / logit
      options of `ring_attention` applied on every call (scale: default H ** -0.5; 1.0
      for a model that pre-scales q).
    check_mask: verify, under jit, that a dense `mask=` was recovered exactly
      (True: the output is NaN where not; "report": a host callback per call
      also says why on stderr, and keeps the program out of JAX's persistent
      compilation cache; False: no check).  A concrete mask is always checked
      and raises.
    use_sinks: add a learnable `sinks` parameter [N] (attention sinks, as in
      gpt-oss): exp(sinks[h]) joins the softmax denominator of every row of
      head h and carries no value.  Zeros at first (load trained values with
      `nnx.update`), in `param_dtype`, sharded over `head_axis` like the
      kernels' head dimension, and trained like any other parameter.
    v_head_dim: the value head dim Hv when it differs from the q/k head dim
      H = qkv_features // num_heads (MLA, e.g. DeepSeek's H = 192, Hv = 128):
      the value kernel is then [in_kv_features, K, Hv] and the out kernel
      [N, Hv, out_features].  None: Hv = H (the parameter tree of
      `nnx.MultiHeadAttention`).

  `__call__` takes the arguments of `nnx.MultiHeadAttention.__call__` plus
  `is_causal`, `segment_ids` ([B, T] or a (q_ids, kv_ids) pair), `positions`
  (the tokens' positions, [B, T], or a (q_positions, kv_positions) pair: the
  mask is evaluated on them, so the tokens may come in any order) and
  `bidirectional_ids` (see `ring_attention`).  `mask` is a `flax_ringattn.Mask`
  (those terms as one object), or a dense mask (any shape
  nnx.MultiHeadAttention takes: broadcastable to [B, N, T, T], e.g.
  `nnx.make_attention_mask`'s [B, 1, T, T] or a [T, T] causal mask, bool or any
  dtype with nonzero visible, as flax reads it), turned into is_causal +
  segment ids (+ bidirectional spans; see `padded_segment_ids`); masks
  outside that family raise.  Attention dropout follows `nnx.MultiHeadAttention`
  (`deterministic`, `model.train()` / `model.eval()`, `rngs`); its mask is a
  function of the key and the global (batch, head, q, kv) indices only.
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
    chunk_size: int | None = None,
    logits_soft_cap: float | None = None,
    scale: float | None = None,
    check_mask: bool | str = True,
    use_sinks: bool = False,
    v_head_dim: int | None = None,
    kernel_metadata: Mapping = MappingProxyType({}),
    out_kernel_metadata: Mapping = MappingProxyType({}),
    bias_metadata: Mapping = MappingProxyType({}),
    out_bias_metadata: Mapping = MappingProxyType({}),
    **kwargs,
  ):
    check_keywords(type(self), kwargs)
    if kwargs.get("decode"):
      raise NotImplementedError(_NO_DECODE)
    check_layer_arguments(
      type(self).__name__,
      num_heads=num_heads,
      in_features=in_features,
      qkv_features=qkv_features,
      out_features=out_features,
      num_kv_heads=num_kv_heads,
      in_kv_features=in_kv_features,
    )
    check_rate(kwargs.get("dropout_rate", 0.0))
    seq_axis = sharding.sequence_axis(mesh, seq_axis, arg="seq_axis")
    _check_layout_options(type(self).__name__, mesh, seq_axis, head_axis, batch_axis, strategy)
    if mesh is not None:
      warn_if_ring_of_one(mesh, seq_axis, where=type(self).__name__)
    # Everything the layer hands the op, checked now and kept once (the attributes `mesh`, `seq_axis`, ... read
    # it); precision and dropout join per call.
    ring_options = RingOptions(
      mesh=mesh,
      axis_name=seq_axis,
      head_axis=head_axis,
      batch_axis=batch_axis,
      load_balance=load_balance,
      strategy=strategy,
      implementation=implementation,
      block_sizes=block_sizes,
      interpret=interpret,
      local_window_size=local_window_size,
      chunk_size=chunk_size,
      logits_soft_cap=logits_soft_cap,
      scale=scale,
      check_mask=check_mask,
    )
    check_static_options(ring_options)
    metadata = head_sharding_metadata(
      head_axis,
      mesh,
      kernel_metadata=kernel_metadata,
      bias_metadata=bias_metadata,
      out_kernel_metadata=out_kernel_metadata,
      out_bias_metadata=out_bias_metadata,
    )
    super().__init__(
      num_heads, in_features, qkv_features, out_features, num_kv_heads, in_kv_features, **metadata, **kwargs
    )
    # Sinks are a parameter, not an option: they stay out of `ring_options` and join each call as an operand.
    build_head_options(
      self, use_sinks=use_sinks, v_head_dim=v_head_dim, kwargs=kwargs, metadata=metadata, mesh=mesh, head_axis=head_axis
    )
    self.ring_options = ring_options

  # The constructor's options, read-only: `ring_options` is where the layer keeps them.
  mesh = _option("mesh", "the mesh the layer runs on, or None")
  seq_axis = _option("axis_name", "the sequence axis (or axes)")
  head_axis = _option("head_axis", "the mesh axis of the heads, or None")
  batch_axis = _option("batch_axis", "the mesh axis of the batch, or None")
  load_balance = _option("load_balance", "inputs in zigzag order")
  strategy = _option("strategy", "the sequence-parallel strategy")
  implementation = _option("implementation", "the implementation name, or None")
  block_sizes = _option("block_sizes", "the kernels' tiles, or None")
  interpret = _option("interpret", "Pallas interpret mode, or None")
  local_window_size = _option("local_window_size", "the window, as given")
  chunk_size = _option("chunk_size", "the attention chunk, or None")
  logits_soft_cap = _option("logits_soft_cap", "the soft cap, or None")
  scale = _option("scale", "the logit scale, or None for H ** -0.5")
  check_mask = _option("check_mask", "verify dense masks under jit")

  def _dropout_rng(self, deterministic, rngs):
    """The dropout key of this call, or None (the rules of nnx.MultiHeadAttention)."""
    if not self.dropout_rate:
      return None
    deterministic = deterministic if deterministic is not None else self.deterministic
    if deterministic is None:
      raise ValueError(
        f"dropout_rate={self.dropout_rate} needs deterministic=... in the call or the constructor "
        "(or model.train() / model.eval())"
      )
    if deterministic:
      return None
    if rngs is None:
      rngs = self.rngs
    elif isinstance(rngs, nnx.Rngs):
      rngs = rngs.dropout
    if rngs is None:
      raise ValueError("rngs=... must be given to __call__ when the layer was built with keep_rngs=False")
    return rngs()

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
    positions=None,
    bidirectional_ids=None,
  ):
    _unsupported_call_options(sow_weights=sow_weights, decode=decode if decode is not None else bool(self.decode))
    if inputs_k is None:
      if inputs_v is not None:
        raise ValueError("inputs_k cannot be None when inputs_v is given (pass inputs_k to use it for both)")
      inputs_k = inputs_q
    if inputs_v is None:
      inputs_v = inputs_k
    for name, x in (("inputs_q", inputs_q), ("inputs_k", inputs_k), ("inputs_v", inputs_v)):
      if getattr(x, "ndim", 0) < 2:
        raise ValueError(
          f"{name} must be [..., T, features] (as for nnx.MultiHeadAttention: a length and a feature axis, usually "
          f"[B, T, features]), got {name}.shape={tuple(getattr(x, 'shape', ()))}"
        )
    if inputs_q.shape[-1] != self.in_features:
      raise ValueError(
        f"inputs_q has {inputs_q.shape[-1]} features but the layer expects in_features={self.in_features}"
      )
    check_mesh_lengths(
      self.mesh,
      self.seq_axis,
      inputs_q.shape[-2],
      inputs_k.shape[-2],
      load_balance=self.load_balance,
      strategy=self.strategy,
      shapes=(
        f"got inputs_q.shape={tuple(inputs_q.shape)}, inputs_k.shape={tuple(inputs_k.shape)}: the layer's inputs "
        "are [B, T, features]"
      ),
    )
    dropout_rng = self._dropout_rng(deterministic, rngs)

    mesh = self.mesh
    if mesh is None:  # inside the caller's shard_map: its axis size is known now
      warn_if_ring_of_one(None, self.seq_axis, where=type(self).__name__)
    place_params(self, mesh, self.head_axis)
    seq = P(self.batch_axis, self.seq_axis, None)
    heads = P(self.batch_axis, self.seq_axis, self.head_axis, None)
    inputs_q, inputs_k, inputs_v = (sharding.constrain(x, mesh, seq) for x in (inputs_q, inputs_k, inputs_v))
    query = sharding.constrain(self.query(inputs_q, out_sharding=qkv_sharding), mesh, heads)
    key = sharding.constrain(self.key(inputs_k, out_sharding=qkv_sharding), mesh, heads)
    value = sharding.constrain(self.value(inputs_v, out_sharding=qkv_sharding), mesh, heads)
    if self.normalize_qk:
      query, key = self.query_ln(query), self.key_ln(key)

    options = _on_mesh(self.ring_options).replace(
      is_causal=is_causal,
      precision=self.precision,
      dropout_rate=self.dropout_rate if dropout_rng is not None else 0.0,
      broadcast_dropout=self.broadcast_dropout,
    )
    sinks = None if self.sinks is None else self.sinks[...]
    x = masked_ring_attention(
      query,
      key,
      value,
      options,
      mask=mask,
      segment_ids=segment_ids,
      dropout_rng=dropout_rng,
      sinks=sinks,
      # Positions inside a `Mask` count as given: the order is then not taken on trust.
      **call_positions(positions, self.load_balance and getattr(mask, "q_positions", None) is None),
      bidirectional_ids=bidirectional_ids,
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
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
  scale: float | None = None,
  implementation: str | None = None,
  block_sizes=None,
  interpret=None,
  strategy: str = "ring",
  check_mask: bool | str = True,
):
  """An `attention_fn` for `nnx.MultiHeadAttention` that runs ring attention.

  Usage: `nnx.MultiHeadAttention(..., attention_fn=make_ring_attention_fn(mesh=mesh, is_causal=True))`.
  The returned function accepts every keyword flax passes (mask, dropout_rng,
  dropout_rate, broadcast_dropout, deterministic, dtype, precision, module,
  is_causal, ...); `is_causal` is on when either this factory or the call asks
  for it; `scale` is the logit scale (default H ** -0.5).  `strategy` picks the sequence-parallel strategy (see `ring_attention`;
  "ulysses_ring" takes seq_axis=(ring_axis, ulysses_axis)).  A dense mask is
  recovered as in `RingMultiHeadAttention`; dropout runs in the ring.  A bias
  and sow_weights (module=...) raise
  `NotImplementedError` naming the alternatives.
  """
  seq_axis = sharding.sequence_axis(mesh, seq_axis, arg="seq_axis")
  _check_layout_options("make_ring_attention_fn", mesh, seq_axis, head_axis, batch_axis, strategy)
  if mesh is not None:
    warn_if_ring_of_one(mesh, seq_axis, where="make_ring_attention_fn")
  factory = _on_mesh(
    RingOptions(
      mesh=mesh,
      axis_name=seq_axis,
      head_axis=head_axis,
      batch_axis=batch_axis,
      is_causal=is_causal,
      load_balance=load_balance,
      strategy=strategy,
      implementation=implementation,
      block_sizes=block_sizes,
      interpret=interpret,
      local_window_size=local_window_size,
      chunk_size=chunk_size,
      logits_soft_cap=logits_soft_cap,
      scale=scale,
      check_mask=check_mask,
    )
  )
  check_static_options(factory)

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
    _unsupported_call_options(bias=bias, sow_weights=module is not None)
    if promote_dtype is not None:
      query, key, value = promote_dtype((query, key, value), dtype=dtype)
    elif dtype is not None:
      query, key, value = (x.astype(dtype) for x in (query, key, value))
    if mesh is None:  # inside the caller's shard_map: its axis size is known now
      warn_if_ring_of_one(None, seq_axis, where="make_ring_attention_fn")
    use_dropout = bool(dropout_rate) and not deterministic
    if use_dropout and dropout_rng is None:
      raise ValueError(f"{dropout_rate=} with deterministic=False needs a dropout_rng")

    options = factory.replace(
      is_causal=bool(is_causal or factory.is_causal),
      precision=precision,
      dropout_rate=dropout_rate if use_dropout else 0.0,
      broadcast_dropout=broadcast_dropout,
    )
    rng = dropout_rng if use_dropout else None
    return masked_ring_attention(query, key, value, options, mask=mask, segment_ids=segment_ids, dropout_rng=rng)

  return ring_attention_fn

"""`ring_attention`: the public, validating front end of the ring.

Validates arguments (naming operands and values), picks a block backend, and
either runs the ring on an already bound mesh axis (inside the caller's
`jax.shard_map`) or wraps `jax.shard_map` itself over `mesh`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax.sharding import PartitionSpec as P

from flax_ringattn._src import debug as debug_lib
from flax_ringattn._src import dropout as dropout_lib
from flax_ringattn._src import flash, layout, masks, sharding, validation
from flax_ringattn._src.block_sizes import BlockSizes
from flax_ringattn._src.options import AttentionSpec, ProblemShape
from flax_ringattn._src.ring import implementations, strategies
from flax_ringattn._src.ring.ring_loop import RingConfig, ring_attention_local


def ring_attention(
  q,
  k,
  v,
  *,
  axis_name=None,
  mesh=None,
  is_causal: bool = False,
  segment_ids=None,
  local_window_size=None,
  logits_soft_cap: float | None = None,
  scale: float | None = None,
  load_balance: bool = False,
  implementation: str | None = None,
  block_sizes: BlockSizes | None = None,
  batch_axis=None,
  head_axis=None,
  precision=None,
  interpret=None,
  strategy: str = "ring",
  dropout_rate: float = 0.0,
  dropout_rng=None,
  broadcast_dropout: bool = True,
  sinks=None,
  q_positions=None,
  kv_positions=None,
  chunk_size: int | None = None,
  bidirectional_ids=None,
  mask=None,
):
  """Ring attention with the semantics of `jax.nn.dot_product_attention`.

  The sequence is sharded over a ring of devices; each device keeps its q shard
  and sees every K/V shard once as they rotate around the ring.  Memory per
  device is O(T / n), and only the K kv heads travel.

  Args:
    q: [B, T, N, H] queries.  k: [B, S, K, H] keys, v: [B, S, K, Hv] values,
      N % K == 0; v's head dim Hv may differ from H (MLA: qk 192, v 128).
      Inside `jax.shard_map` these are the local shards; with `mesh` they are
      global arrays.
    axis_name: the mesh axis the sequence is sharded over, or a tuple of mesh
      axes (the sequence is sharded over their product, row-major, as
      `P(None, ("x", "y"))`; the ring then snakes through the device grid so
      every hop is between neighbours).  Inside shard_map it must be bound;
      with `mesh` it names mesh axes (default: the mesh's only axis).  With
      neither `axis_name` nor `mesh`, runs on one device.
    mesh: a `jax.sharding.Mesh`: wrap `jax.shard_map` over it (sequence on
      `axis_name`, batch on `batch_axis`, heads on `head_axis`).
    is_causal: query i attends to keys j <= i (global positions).
    segment_ids: [B, T] int ids of packed documents (self attention), or a
      (q_ids [B, T], kv_ids [B, S]) pair; tokens attend within equal ids.
    local_window_size: int w or (left, right): query i sees keys in
      [i - left, i + right].  A side of 2**30 or more is no limit: it is
      clamped to 2**30, which covers every sequence the library takes.
    logits_soft_cap: c > 0: logits become c * tanh(logits / c).
    scale: logit scale, default H ** -0.5.
    load_balance: the sequence is in zigzag order (see `zigzag_order`); every
      device then does the same causal work.  Taken on trust: pass the
      tokens' positions instead to have any order evaluated exactly.
    implementation: "pallas_tpu", "pallas_gpu", "xla", the alias
      "pallas_tpu_ring" (pallas_tpu running the ring strategy as its fused
      in-kernel ring), or None: the first of "pallas_tpu", "pallas_gpu" and
      "xla" that supports the call (on a TPU, with strategy="ring", the fused
      ring where its planner fits the shards).
    block_sizes: `BlockSizes` tiles for the block kernels; None lets the
      backend choose (XLA: 512 q x 128 kv, tuned on CPU).
    batch_axis, head_axis: mesh axes the batch and heads are sharded over (only
      with `mesh`; None means replicated).
    precision: matmul precision of the block matmuls (`jax.lax.Precision`).
    interpret: run the `pallas_tpu` or `pallas_tpu_ring` kernels in Pallas TPU
      interpret mode (on CPU): True, or a
      `jax.experimental.pallas.tpu.InterpretParams`; with
      implementation="pallas_gpu", True runs the GPU kernels in Pallas's
      generic interpreter (on CPU).  Pass the implementation with it: without
      one it still picks "pallas_tpu" and warns once (deprecated).
    strategy: how the sequence shards meet (see "choosing a strategy" in the
      README): "ring" (K/V rotate, memory O(T / n)), "ulysses" (all-to-all
      to head shards, needs N % n == 0), "all_gather" (K/V gathered, q stays
      sharded) or "ulysses_ring" (axis_name=(ring_axis, ulysses_axis): Ulysses
      within, ring across).  Results do not depend on the strategy.
    dropout_rate: attention dropout on the probabilities (0 = none; every
      implementation and strategy).  The keep mask is a hash of
      `dropout_rng` and the global (batch, head, q position, kv position), so
      it is the same on any ring size, layout, strategy and backend, and the
      backward regenerates it.
    dropout_rng: a `jax.random` key, needed when dropout_rate > 0.
    broadcast_dropout: one mask for every batch row and head (flax's default),
      else one per (batch, head).
    sinks: optional [N] float attention-sink logits (gpt-oss), one per q head,
      differentiable: exp(sinks[h]) joins the softmax denominator of every row
      of head h and carries no value.  Applied once, to the finished softmax
      (every implementation and strategy; with `mesh` and `head_axis` each
      device takes its heads' slice, as Ulysses does after its all-to-all).
    q_positions, kv_positions: [B, T] / [B, S] (or [T] / [S]) int positions of
      the tokens, on which causal, window and chunk are evaluated (default:
      the index in the sequence, or the zigzag layout's with load_balance).
      The tokens may then come in any order along the sequence (zigzag,
      striped, a permutation, per-document layouts), exactly.  q_positions
      alone serves self attention.
    chunk_size: C: query and key only meet in the same chunk of C positions,
      q_pos // C == kv_pos // C (Llama 4's chunked attention); combines with
      causal, window and segments.
    bidirectional_ids: [B, T] int (self attention; or a (q_ids, kv_ids) pair):
      tokens with the same nonzero id see each other whatever causal, window
      and chunk say, still within their segment (Gemma 3's image spans;
      prefix-LM: id 1 on the prefix).
    mask: every term above as one `flax_ringattn.Mask` (is_causal,
      local_window_size, chunk_size, segment_ids, bidirectional_ids,
      q_positions, kv_positions), instead of or with the keywords (a term
      given both ways must agree).

  Returns:
    [B, T, N, Hv] in q.dtype, laid out like q.  Rows with no visible key are 0.
    Empty inputs (B, T or N = 0) give an empty output and S = 0 an all-zero
    one, as `jax.nn.dot_product_attention` does; their gradients are zeros.
  """
  B, T, S, N, K, H = validation.check_qkv(q, k, v)
  mask, q_tok, kv_tok = masks.build(
    B,
    T,
    S,
    mask=mask,
    is_causal=is_causal,
    local_window_size=local_window_size,
    chunk_size=chunk_size,
    segment_ids=segment_ids,
    bidirectional_ids=bidirectional_ids,
    q_positions=q_positions,
    kv_positions=kv_positions,
  )
  cap = validation.check_soft_cap(logits_soft_cap)
  scale = validation.check_scale(scale, H)
  sinks = validation.check_sinks(sinks, N)
  _check_block_sizes(block_sizes)
  validation.check_bool("load_balance", load_balance)
  strategy = strategies.check_strategy(strategy)
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)  # a hashable static argument
  rate = dropout_lib.check_rate(dropout_rate)
  validation.check_bool("broadcast_dropout", broadcast_dropout)
  drop = dropout_lib.seed_operand(dropout_rng) if rate else None
  spec = AttentionSpec(
    mask=mask,
    scale=scale,
    logits_soft_cap=cap,
    block_sizes=block_sizes,
    precision=precision,
    dropout_rate=rate,
    dropout_broadcast=broadcast_dropout,
    debug=debug_lib.current(),
  )
  # Resolve the backend now so that a bad name fails here, not deep in tracing.  A call without q heads runs no
  # kernel: the backend is asked about one q head per kv head instead of none.
  q_shape = q.shape if N else (B, T, K, H)
  choice = implementations.select(
    implementation, dtype=q.dtype, spec=spec, shapes=(q_shape, k.shape), interpret=interpret
  )

  if mesh is not None:
    return _ring_on_mesh(
      q,
      k,
      v,
      q_tok,
      kv_tok,
      drop,
      sinks,
      mesh,
      axis_name,
      batch_axis,
      head_axis,
      load_balance,
      spec,
      choice,
      strategy,
    )

  if batch_axis is not None or head_axis is not None:
    raise ValueError(
      f"batch_axis={batch_axis!r} / head_axis={head_axis!r} only apply with mesh=...; "
      "inside your own shard_map the inputs are already the local shards"
    )
  axes = strategies.check_axes(strategy, axis_name) if strategy != "ring" else layout.ring_axes(axis_name)
  if axis_name is not None:
    unbound = [a for a in axes if not sharding.axis_is_bound(a)]
    if unbound or not axes:
      which = f" (unbound: {unbound})" if isinstance(axis_name, (tuple, list)) else ""
      raise ValueError(
        f"axis_name={axis_name!r} is not bound: call ring_attention inside jax.shard_map over a mesh "
        f"with that axis, or pass mesh=... to let ring_attention shard the global arrays itself{which}"
      )
    n = jax.lax.axis_size(axes)
    strategies.check_heads(strategy, axis_name, jax.lax.axis_size(axes[-1]), N, K, shapes=_shapes(q, k))
  else:
    n = 1
  _check_shard_lengths(T, S, n, load_balance, local=True, axis_name=axis_name, strategy=strategy, shapes=_shapes(q, k))
  if validation.is_empty(q, k):
    return _empty_output(q, v)  # the same static shapes on every device: none of them enters a collective
  # q, k are the local shards here: split by 1, on a ring of n
  fused = use_fused_ring(choice, spec, q, k, 1, strategy, ring_size=n, v=v)
  # Inside the caller's shard_map only the ring axis is known: batch and heads count as global here (shard
  # them yourself and dropout masks repeat).
  fn = _local_fn(axis_name, load_balance, spec, choice.backend, strategy, fused)
  return fn(q, k, v, q_tok, kv_tok, drop, sinks)


def _check_block_sizes(block_sizes):
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a flax_ringattn.BlockSizes, got {type(block_sizes).__name__}")


def check_static_options(options) -> None:
  """What `ring_attention` checks of `options` (a `RingOptions`) before it sees an array, with its messages: the
  layers and `make_ring_attention_fn` call it when they are built, so a bad option fails there and not at the
  first call.  (The scale is checked for its type here; the head dim it defaults from comes with the arrays.)"""
  implementations.check_name(options.implementation)
  strategies.check_strategy(options.strategy)
  validation.normalize_window(options.local_window_size)
  validation.check_chunk_size(options.chunk_size)
  validation.check_soft_cap(options.logits_soft_cap)
  if options.scale is not None:
    validation.check_scale(options.scale, 1)
  _check_block_sizes(options.block_sizes)
  validation.check_bool("load_balance", options.load_balance)
  validation.check_bool("is_causal", options.is_causal)


def use_fused_ring(choice, spec, q, k, n, strategy="ring", *, ring_size=None, v=None) -> bool:
  """Whether the ring strategy runs as the backend's fused in-kernel ring: always when the call asked for it
  (`implementation="pallas_tpu_ring"`), and with implementation=None where the backend has one, compiles for its
  chip (never in interpret mode), the ring has more than one member (a ring of one has nothing to overlap: the
  block kernels, tuned against splash and writing the output in q's dtype, run it) and its planner finds slots
  and tiles for shards of q [B, T / n, ...] and k [B, S / n, ...] (VMEM slots, or HBM slots with only tiles in
  VMEM)."""
  if choice.option("fused"):
    if strategy != "ring":
      raise NotImplementedError(
        f"implementation={choice.requested!r} is the ring strategy inside one kernel; strategy={strategy!r} needs "
        "block kernels: use implementation='pallas_tpu' (or None)"
      )
    return True
  backend = choice.backend
  if choice.requested is not None or strategy != "ring" or not hasattr(backend, "fused_ring"):
    return False
  ring = n if ring_size is None else ring_size
  if backend.interpret is not None or ring == 1:
    return False
  shape = ProblemShape.of(q.shape, k.shape, q.dtype, spec, split=n, v_shape=None if v is None else v.shape)
  return backend.fused_ring_fits(shape, n=ring)


def _local_fn(axis_name, load_balance, spec, backend, strategy, fused):
  """The per-device attention: the backend's fused in-kernel ring, or the strategy on the block contract (the
  portable ring loop for strategy="ring"); every one of them differentiated by the one `flash` custom_vjp, which
  also applies the attention sinks (`sinks`: the local heads' [N] logits, or None)."""
  if fused:
    kernel = backend.fused_ring(axis_name=axis_name, load_balance=load_balance, spec=spec)
    return lambda q, k, v, qs, ks, drop, sinks: flash.flash(kernel, sinks, q, k, v, qs, ks, drop)
  cfg = RingConfig(axis_name=axis_name, load_balance=load_balance, spec=spec, backend=backend)
  if strategy == "ring":
    return lambda q, k, v, qs, ks, drop, sinks: ring_attention_local(q, k, v, qs, ks, cfg, drop, sinks)
  return lambda q, k, v, qs, ks, drop, sinks: strategies.attention_local(
    q, k, v, qs, ks, drop, sinks, strategy=strategy, cfg=cfg
  )


def check_mesh_lengths(mesh, axis_name, T, S, *, load_balance=False, strategy="ring", shapes=None):
  """The op's check of global q/kv lengths against the ring size of `axis_name` on `mesh`, for callers (the
  layers) that shard their inputs before calling `ring_attention`: they fail with the op's message, not JAX's
  sharding error.  Axis names are checked by the caller; `shapes` (a line on the caller's shapes and layout)
  ends the message."""
  if mesh is None or axis_name is None:
    return
  n = sharding.axes_size(mesh, axis_name)
  _check_shard_lengths(T, S, n, load_balance, local=False, axis_name=axis_name, strategy=strategy, shapes=shapes)


def _shapes(q, k):
  """The layout reminder of a length or head-count error: the shapes the op got and the layout it reads."""
  return (
    f"got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}: q is [B, T, N, H] and k/v [B, S, K, H] "
    "(if your arrays are [B, N, T, H], swap axes 1 and 2)"
  )


def _empty_output(q, v):
  """The output of a call with no row or no key (`validation.is_empty`): [B, T, N, Hv] zeros in q.dtype.  A
  constant, so the gradient of every input is zeros of its shape."""
  return jax.numpy.zeros((*q.shape[:3], v.shape[3]), q.dtype)


def _check_shard_lengths(T, S, n, load_balance, *, local, axis_name, strategy="ring", shapes=None):
  """`shapes`: the op's `_shapes(q, k)` (a layer passes None: its inputs are [B, T, features])."""
  per = 2 if load_balance else 1
  what = "local shard" if local else "global"
  for name, L in (("q_len", T), ("kv_len", S)):
    need = per if local else per * n
    if L % need:
      why = (
        "the zigzag layout splits each shard into two chunks"
        if load_balance
        else "q and k/v are split evenly over the ring"
      )
      raise ValueError(
        f"{what} {name}={L} must be a multiple of {need} (ring_size={n} over axis {axis_name!r}, "
        f"load_balance={load_balance}): {why}"
        + (f" (strategy={strategy!r})" if strategy != "ring" else "")
        + (f"; {shapes}" if shapes else "")
      )


def _ring_on_mesh(
  q,
  k,
  v,
  q_tok,
  kv_tok,
  drop,
  sinks,
  mesh,
  axis_name,
  batch_axis,
  head_axis,
  load_balance,
  spec,
  choice,
  strategy,
):
  if not isinstance(mesh, (jax.sharding.Mesh, jax.sharding.AbstractMesh)):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  names = tuple(mesh.axis_names)
  axis_name = sharding.sequence_axis(mesh, axis_name, arg="axis_name")
  if isinstance(axis_name, list):
    axis_name = tuple(axis_name)
  if isinstance(axis_name, tuple) and not axis_name:
    raise ValueError("axis_name=() names no mesh axis: pass one axis or a non-empty tuple of axes")
  seq_axes = strategies.check_axes(strategy, axis_name) if strategy != "ring" else layout.ring_axes(axis_name)
  sharding.check_mesh_axes(mesh, axis_name=axis_name, batch_axis=batch_axis, head_axis=head_axis)
  used = [a for a in (*seq_axes, batch_axis, head_axis) if a is not None]
  if len(set(used)) != len(used):
    raise ValueError(f"axis_name, batch_axis and head_axis must be different mesh axes, got {used}")
  sizes = dict(zip(names, mesh.axis_sizes, strict=True))
  n = sharding.axes_size(mesh, seq_axes)
  B, T, N, _ = q.shape
  S, K = k.shape[1], k.shape[2]
  shapes = _shapes(q, k)
  _check_shard_lengths(T, S, n, load_balance, local=False, axis_name=axis_name, strategy=strategy, shapes=shapes)
  if batch_axis is not None and B % sizes[batch_axis]:
    raise ValueError(f"batch size B={B} must be a multiple of the {batch_axis!r} mesh axis size {sizes[batch_axis]}")
  if head_axis is not None and K % sizes[head_axis]:
    raise ValueError(
      f"kv heads K={K} (and q heads N={N}) must be a multiple of the {head_axis!r} mesh axis size "
      f"{sizes[head_axis]}: heads are split so every device keeps whole GQA groups"
    )
  tp = sizes[head_axis] if head_axis is not None else 1
  strategies.check_heads(strategy, axis_name, sizes[seq_axes[-1]], N // tp, K // tp, head_axis=head_axis, shapes=shapes)

  x_spec = P(batch_axis, axis_name, head_axis, None)
  if validation.is_empty(q, k):
    out = _empty_output(q, v)
    if validation.all_concrete(q, k, v) and isinstance(mesh, jax.sharding.Mesh):
      # device_put, not jax.reshard: a program whose output is a zero-size sharded array hands every device a
      # buffer of the whole (wrong) shape, which cannot be read back.
      return jax.device_put(out, sharding.named(mesh, x_spec))
    return sharding.constrain(out, mesh, x_spec)
  seg_spec = P(batch_axis, axis_name)
  fused = use_fused_ring(choice, spec, q, k, n, strategy, v=v)
  q, k, v = (sharding.constrain(x, mesh, x_spec) for x in (q, k, v))
  q_tok, kv_tok = jax.tree.map(lambda x: sharding.constrain(x, mesh, seg_spec), (q_tok, kv_tok))
  if drop is not None:
    drop = sharding.constrain(drop, mesh, P())
  if sinks is not None:
    sinks = sharding.constrain(sinks, mesh, P(head_axis))
  config = _MeshCall(
    mesh=mesh,
    axis_name=axis_name,
    batch_axis=batch_axis,
    head_axis=head_axis,
    load_balance=load_balance,
    spec=spec,
    choice=choice,
    strategy=strategy,
    fused=fused,
    operands=(drop is not None, sinks is not None),
  )
  # Called eagerly: run one compiled program per configuration and shapes (about 25 s op by op for a small ring
  # of 4 on CPU; and a fresh jit per call would compile again each time).  Under a trace (the caller's jit or
  # grad) the shard_map is traced into the caller's program as is.
  eager = validation.all_concrete(q, k, v)
  fn = _mesh_fn(config, jit=eager) if validation.is_hashable(config) else _build_mesh_fn(config, jit=eager)
  return fn(q, k, v, q_tok, kv_tok, drop, sinks)


@dataclasses.dataclass(frozen=True)
class _MeshCall:
  """Everything static about one `ring_attention(mesh=...)` call: the key of its `jax.shard_map` (and its `jax.jit`
  when called eagerly).  `operands`: whether the dropout operand and the sinks are present (the mask's `Tokens`
  fields follow from `spec.mask`)."""

  mesh: object
  axis_name: object
  batch_axis: object
  head_axis: object
  load_balance: bool
  spec: AttentionSpec
  choice: object
  strategy: str
  fused: bool
  operands: tuple


@functools.lru_cache(maxsize=64)
def _mesh_fn(config: _MeshCall, *, jit: bool):
  return _build_mesh_fn(config, jit=jit)


def _build_mesh_fn(config: _MeshCall, *, jit: bool):
  batch_axis, head_axis = config.batch_axis, config.head_axis
  local_fn = _local_fn(
    config.axis_name, config.load_balance, config.spec, config.choice.backend, config.strategy, config.fused
  )
  x_spec = P(batch_axis, config.axis_name, head_axis, None)
  seg_spec = P(batch_axis, config.axis_name)
  has_drop, has_sinks = config.operands

  def local(q, k, v, qs, ks, drop, sinks):
    if drop is not None:
      # Global batch row / q head of this shard's first: the dropout mask is a
      # function of global indices.
      b0 = jax.lax.axis_index(batch_axis) * q.shape[0] if batch_axis is not None else 0
      h0 = jax.lax.axis_index(head_axis) * q.shape[2] if head_axis is not None else 0
      drop = dropout_lib.with_offsets(drop, b0, h0)
    return local_fn(q, k, v, qs, ks, drop, sinks)

  fn = jax.shard_map(
    local,
    mesh=config.mesh,
    in_specs=(
      x_spec,
      x_spec,
      x_spec,
      seg_spec,  # every field of the q and kv `masks.Tokens` is [B, L]
      seg_spec,
      P() if has_drop else None,
      P(head_axis) if has_sinks else None,
    ),
    out_specs=x_spec,
  )
  return jax.jit(fn) if jit else fn

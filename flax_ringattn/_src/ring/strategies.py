"""Sequence-parallel strategies: how the shards of one attention call meet.

Every strategy runs per device on the local shards inside `jax.shard_map` and
calls the block backend through the contract of `backends/base.py`; the mask
rules come from `masks` through global token positions (`layout`), so results
do not depend on the strategy.  q/k/v arrive sharded over the sequence axis
(contiguous or zigzag) and the output leaves the same way.

    "ring"         K/V rotate around the axis (`ring_loop`): n - 1 hops of the
                   K kv heads, memory O(T / n), causal hops skipped.
    "ulysses"      an all-to-all turns sequence shards into head shards (each
                   device: the whole sequence, N / n q heads), one local block
                   call, an all-to-all back.  Two all-to-alls of q/k/v/o, no
                   hops; kv heads are repeated just enough when n > K.
    "all_gather"   K/V (kv heads only) are all-gathered, q stays sharded, one
                   block call against the gathered K/V (the backend skips its
                   masked tiles, so causal skipping keeps working).  The
                   backward re-gathers K/V and reduce-scatters dK/dV.
    "ulysses_ring" axis_name=(ring_axis, ulysses_axis), the sequence sharded
                   over both, major first (USP): an all-to-all over the
                   Ulysses axis, then a ring over the ring axis in which each
                   member holds its Ulysses group's shards side by side.

Ulysses is the ring of one after the all-to-all: both Ulysses strategies run
`ring_loop` on the head-sharded tensors (its custom_vjp keeps residuals at the
head-sharded inputs, the same size as the local shards), and autodiff
transposes the all-to-alls (an all-to-all back) and the kv-head repeat (a sum).

Attention dropout: its mask is a function of the key and the global (batch,
head, q position, kv position), so every strategy gives the same result.  The
block calls get global positions already; the global head needs care: after
the Ulysses all-to-all, member u of the Ulysses axis holds q heads
[u * N / U, (u + 1) * N / U) of the N heads of its input shard, so `_ulysses`
adds `axis_index(ulysses_axis) * N / U` to the operand's head offset (which
already carries the head_axis offset); all_gather and the ring keep every
head.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from flax_ringattn._src import dropout as dropout_lib
from flax_ringattn._src import flash, masks
from flax_ringattn._src.layout import gathered_positions, shard_positions
from flax_ringattn._src.ring.ring_loop import RingConfig, block_kwargs, direct, out_dtype, ring_attention_local

STRATEGIES = ("ring", "ulysses", "all_gather", "ulysses_ring")
_NO_HEAD_LIMIT = "strategy='ring' or 'all_gather' (no head-count limit)"


def check_strategy(strategy) -> str:
  if not isinstance(strategy, str):
    raise TypeError(f"strategy must be a string, one of {STRATEGIES}, got {strategy!r}")
  if strategy not in STRATEGIES:
    raise ValueError(f"unknown {strategy=}; choose one of {STRATEGIES}")
  return strategy


def check_axes(strategy: str, axis_name):
  """Validates the shape of `axis_name` for `strategy`; returns the tuple of mesh axes it names.

  "ulysses_ring" needs a (ring_axis, ulysses_axis) pair of different axes; the
  other strategies take one axis (a tuple for the plain ring is the in-kernel
  ring's business and passes through untouched).
  """
  if axis_name is None:
    return ()  # one device: every strategy is attention on the local arrays
  if strategy == "ulysses_ring":
    if not (isinstance(axis_name, (tuple, list)) and len(axis_name) == 2):
      raise ValueError(
        f"strategy='ulysses_ring' needs axis_name=(ring_axis, ulysses_axis), two mesh axes with the sequence "
        f"sharded over both (major first), got {axis_name=!r}"
      )
    ring_axis, ulysses_axis = axis_name
    if ring_axis == ulysses_axis:
      raise ValueError(
        f"axis_name={tuple(axis_name)!r} repeats the axis {ring_axis!r}: strategy='ulysses_ring' needs two "
        "different mesh axes (ring_axis, ulysses_axis); for a single axis use strategy='ulysses' or 'ring'"
      )
    return tuple(axis_name)
  if strategy in ("ulysses", "all_gather") and isinstance(axis_name, (tuple, list)):
    if len(set(axis_name)) != len(axis_name):
      raise ValueError(f"axis_name={tuple(axis_name)!r} repeats an axis: each mesh axis may appear once")
    raise NotImplementedError(
      f"strategy={strategy!r} takes one mesh axis, got {axis_name=!r}; for two axes use "
      "strategy='ulysses_ring' with axis_name=(ring_axis, ulysses_axis)"
    )
  return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def ulysses_kv_repeat(K: int, u: int) -> int:
  """How many times each kv head is repeated so that the K * rep kv heads split evenly over u devices."""
  return u // math.gcd(K, u)


def check_heads(strategy: str, axis_name, u: int, N: int, K: int, *, head_axis=None, shapes=None):
  """q heads must split over the Ulysses axis of size u (kv heads are repeated as needed).  `shapes`: the op's
  reminder of the shapes it got and the layout it reads, appended to the message (None: nothing)."""
  if strategy not in ("ulysses", "ulysses_ring") or N % u == 0:
    return
  ulysses_axis = axis_name[1] if strategy == "ulysses_ring" else axis_name
  per = f" per device of head_axis={head_axis!r}" if head_axis is not None else ""
  fits = [d for d in range(1, N + 1) if N % d == 0]
  alt = (
    f"a Ulysses axis whose size divides {N} (one of {fits}), {_NO_HEAD_LIMIT}, or strategy='ulysses_ring' "
    f"with a Ulysses axis of size in {fits} and the rest of the devices on the ring axis"
  )
  if strategy == "ulysses_ring":
    alt = f"a Ulysses axis of size in {fits} (put the other devices on the ring axis), or {_NO_HEAD_LIMIT}"
  raise ValueError(
    f"strategy={strategy!r} shards the q heads over ulysses axis {ulysses_axis!r} of size {u}: the number of q "
    f"heads N={N}{per} must be a multiple of {u} (kv heads K={K} are repeated as needed); what would work: {alt}"
    + (f"; {shapes}" if shapes else "")
  )


# --------------------------------------------------------------------------------------------
# Ulysses (and its ring): all-to-all, ring_loop over the head-sharded tensors, all-to-all back
# --------------------------------------------------------------------------------------------


def _seq_to_heads(x, axis):
  """[B, L, h, H] sequence-sharded -> [B, u * L, h / u, H] head-sharded (sequence in member order)."""
  return jax.lax.all_to_all(x, axis, split_axis=2, concat_axis=1, tiled=True)


def _heads_to_seq(x, axis):
  return jax.lax.all_to_all(x, axis, split_axis=1, concat_axis=2, tiled=True)


def _gather_seq(tokens, axis):
  """Every [B, L] field of a `masks.Tokens`, gathered over the sequence axis (member order)."""
  return jax.tree.map(lambda a: jax.lax.all_gather(a, axis, axis=1, tiled=True), tokens)


def _ulysses(q, k, v, q_tok, kv_tok, drop, sinks, cfg: RingConfig, ring_axis, ulysses_axis):
  u = jax.lax.axis_size(ulysses_axis)
  if sinks is not None:
    # This member's q heads after the all-to-all (see the dropout offset below): their slice of the sinks.
    sinks = jax.lax.dynamic_slice_in_dim(sinks, jax.lax.axis_index(ulysses_axis) * (q.shape[2] // u), q.shape[2] // u)
  if drop is not None:
    # After the all-to-all this member holds q heads [m * N / u, (m + 1) * N / u) of the shard's N.
    head0 = drop[3] + jax.lax.axis_index(ulysses_axis) * (q.shape[2] // u)
    drop = dropout_lib.with_offsets(drop, drop[2], head0)
  rep = ulysses_kv_repeat(k.shape[2], u)
  if rep > 1:
    # Consecutive copies keep GQA's grouping: q head i still reads kv head i // (N / (K * rep)).
    k, v = jnp.repeat(k, rep, axis=2), jnp.repeat(v, rep, axis=2)
  q, k, v = (_seq_to_heads(x, ulysses_axis) for x in (q, k, v))
  q_tok, kv_tok = _gather_seq(q_tok, ulysses_axis), _gather_seq(kv_tok, ulysses_axis)
  inner = dataclasses.replace(cfg, axis_name=ring_axis, sub_shards=u)
  o = ring_attention_local(q, k, v, q_tok, kv_tok, inner, drop, sinks)
  return _heads_to_seq(o, ulysses_axis)


# --------------------------------------------------------------------------------------------
# All-gather of K/V through the `flash` custom_vjp (residuals: the local shards, never the gathered K/V)
# --------------------------------------------------------------------------------------------


def _gathered(q, k, v, q_tok, kv_tok, cfg: RingConfig):
  """K/V and their tokens gathered over the axis, and both sides' tokens with the layout's positions filled in."""
  n, r = jax.lax.axis_size(cfg.axis_name), jax.lax.axis_index(cfg.axis_name)
  k_all, v_all = (jax.lax.all_gather(x, cfg.axis_name, axis=1, tiled=True) for x in (k, v))
  kv_all = masks.with_positions(
    _gather_seq(kv_tok, cfg.axis_name), gathered_positions(0, n, n, k.shape[1], cfg.load_balance)
  )
  q_tok = masks.with_positions(q_tok, shard_positions(r, n, q.shape[1], cfg.load_balance))
  return k_all, v_all, q_tok, kv_all


def _ag_forward(q, k, v, q_tok, kv_tok, drop, cfg: RingConfig):
  k_all, v_all, q_tok, kv_all = _gathered(q, k, v, q_tok, kv_tok, cfg)
  dtype = out_dtype(cfg, q)
  return cfg.backend.fwd(q, k_all, v_all, q_tok, kv_all, spec=cfg.spec, out_dtype=dtype, **block_kwargs(drop))


def _ag_backward(operands, lse, do, delta, cfg: RingConfig):
  q, k, v, q_tok, kv_tok, drop = operands
  # Gathering again costs one all-gather and keeps the residuals at the local shards.
  k_all, v_all, q_tok, kv_all = _gathered(q, k, v, q_tok, kv_tok, cfg)
  dq, dk_all, dv_all = cfg.backend.bwd(
    q, k_all, v_all, do, lse, delta, q_tok, kv_all, spec=cfg.spec, **block_kwargs(drop)
  )
  # Every device holds a partial dK/dV for every shard: sum them and hand each owner its shard.
  dk, dv = (jax.lax.psum_scatter(x, cfg.axis_name, scatter_dimension=1, tiled=True) for x in (dk_all, dv_all))
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def attention_local(q, k, v, q_tok, kv_tok, drop=None, sinks=None, *, strategy: str, cfg: RingConfig):
  """Per-device entry point of every strategy (inside shard_map; axis_name=None means one device).

  `drop`: the int32[4] dropout operand with this shard's global batch / head offsets, or None.  `sinks`: the [N]
  sink logits of the local q heads, or None.
  """
  if cfg.axis_name is None or strategy == "ring":
    return ring_attention_local(q, k, v, q_tok, kv_tok, cfg, drop, sinks)
  if strategy == "ulysses":
    return _ulysses(q, k, v, q_tok, kv_tok, drop, sinks, cfg, None, cfg.axis_name)
  if strategy == "ulysses_ring":
    ring_axis, ulysses_axis = cfg.axis_name
    return _ulysses(q, k, v, q_tok, kv_tok, drop, sinks, cfg, ring_axis, ulysses_axis)
  if strategy == "all_gather":
    kernel = flash.RingKernel(_ag_forward, _ag_backward, direct(cfg, sinks))
    return flash.flash(kernel, sinks, q, k, v, q_tok, kv_tok, drop)
  raise AssertionError(strategy)

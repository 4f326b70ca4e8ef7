"""The ring: hops, K/V rotation and the online-softmax merge (differentiated by the one `flash` custom_vjp).

Runs per device inside `jax.shard_map` (or on one device with axis_name=None).
It is written once for every block backend: a hop hands one (q shard, kv shard)
pair and the global positions of both to `backend.fwd` / `backend.bwd` (the
block contract of `backends/base.py`) and never looks inside.

Hop schedule of ring member r in a ring of n (data flows r -> r + 1).  On one
mesh axis member r is the device at index r; on a tuple of axes the members
follow a snake through the device grid (`layout.snake_coords`), so every hop
is between grid neighbours, and member r holds the shard at its row-major
index over the axes (`layout.ring_shard`).

    hop t holds the K/V shard of member src = (r - t) mod n
    forward : start the send of the held K/V to r + 1, compute hop t, merge.
              The last hop sends nothing: K/V move n - 1 times.
    backward: the same K/V rotation, plus one dK/dV accumulator per shard that
              follows its shard around the ring.  The accumulator of shard src
              leaves member r at hop t + 1 (its send overlaps hop t + 1's
              compute) and, after the n-th send, is back on its owner.

Only the K kv heads travel (GQA is resolved inside the block), the keys'
`masks.Tokens` travel with them (their positions too when the caller gave
them; the layout's are recomputed from `src`), and hops whose whole block is
masked (`masks.classify` on shard extents) skip the backend call.  Partial results are merged in float32.  Attention dropout needs no
ring logic: its mask is a function of global indices (`_src/dropout.py`), so a
backend regenerates it from the positions it is handed, and the dropout
operand (seed and global batch / head offsets) stays on its device.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flax_ringattn._src import flash, layout, masks, vma
from flax_ringattn._src.backends.base import AttentionSpec, BlockBackend
from flax_ringattn._src.layout import gathered_positions

F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class RingConfig:
  """Static configuration of one ring call (hashable: part of the `flash` custom_vjp's nondiff kernel)."""

  axis_name: object  # bound mesh axis of the ring, or None for a ring of one
  load_balance: bool
  spec: AttentionSpec
  backend: BlockBackend  # a hashable backend instance (it may carry options such as `interpret`)
  # How many sequence shards of the original layout each ring member holds side
  # by side (1 for the plain ring; the Ulysses axis size for "ulysses_ring",
  # whose all-to-all hands every member the shards of its whole Ulysses group).
  sub_shards: int = 1
  # True where the flash wrapper applies no sinks: a block whose o is the call's output as it is (a ring of one,
  # the all-gather strategy) is asked for it in q's dtype (the block contract's `out_dtype`), so no float32
  # output is written and cast.  Set by the entry points (`direct`).
  direct_output: bool = False


def direct(cfg: RingConfig, sinks) -> RingConfig:
  """`cfg` for a call with these sinks: `direct_output` where there are none (sinks rescale the finished rows in
  float32, so with them the blocks keep float32 outputs)."""
  return dataclasses.replace(cfg, direct_output=sinks is None)


def out_dtype(cfg: RingConfig, q):
  """The block contract's `out_dtype` of a block whose output is the call's: q's dtype, or None (float32)."""
  return q.dtype if cfg.direct_output else None


def _member_positions(cfg: RingConfig, shard, n, length: int):
  """Global positions of the `length` tokens of ring shard `shard` (row-major over the ring's axes)."""
  sub = cfg.sub_shards
  return gathered_positions(shard * sub, sub, n * sub, length // sub, cfg.load_balance)


def _ring_geometry(axis_name):
  """(n, r, shard_of): ring size, this device's ring member and member -> shard index."""
  n, sizes, _, member = layout.ring_geometry(axis_name)
  return n, member, lambda m: layout.ring_shard(m, sizes)


class _HopKind:
  """EMPTY / PARTIAL / FULL for a whole (q shard, kv shard) pair (one tile each), when called.  Traced tokens go
  through one jit per (mask, shapes), so a model's layers trace the classification once; concrete ones are
  classified eagerly, as before (a concrete EMPTY hop is then skipped without a cond).  `concrete`: whether the
  kind is known before the program runs."""

  def __init__(self, spec: AttentionSpec, q_tok, kv_tok):
    self.spec, self.q_tok, self.kv_tok = spec, q_tok, kv_tok
    self.concrete = not any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves((q_tok, kv_tok)))

  def __call__(self):
    T, S = self.q_tok.pos.shape[-1], self.kv_tok.pos.shape[-1]
    if not self.concrete:
      return _whole_block_kind(self.spec.mask, self.q_tok, self.kv_tok, T, S)
    return masks.tile_kinds(self.spec.mask, self.q_tok, self.kv_tok, T, S)[0, 0]


@functools.partial(jax.jit, static_argnums=(0, 3, 4))
def _whole_block_kind(mask, q_tok, kv_tok, T: int, S: int):
  return masks.tile_kinds(mask, q_tok, kv_tok, T, S)[0, 0]


def _diagonal(t, T: int, S: int) -> bool:
  """Hop t is a self-attention shard against itself: hop 0 (a static int) with as many keys as queries."""
  return isinstance(t, int) and t == 0 and T == S


def _unless_empty(backend, kind, compute, skip, *, diagonal: bool = False):
  """compute() for a hop with visible pairs, skip() for an EMPTY one.

  A backend whose kernels every ring member must call equally often (Pallas
  TPU interpret mode runs each kernel as a barrier-synchronised program over
  all simulated devices) always computes; its kernel then skips every tile.
  So does a `diagonal` hop (hop 0 with as many keys as queries: in
  self-attention each query's own key) whose kind would be traced: in
  self-attention it is EMPTY only where every query of the shard is padding,
  and whenever it is EMPTY the kernels skip every tile to the skip branch's
  result, while a cond costs every call (its operands materialised, the
  kernel fenced off from the work around it: a converted decoder's traced
  mask made one per layer and pass).  A concrete kind still skips an EMPTY
  hop.  `kind` is a function: the diagonal's traced one is never built.
  """
  if backend.calls_must_be_uniform:
    return compute()
  if diagonal and not kind.concrete:
    return compute()
  return jax.lax.cond(kind() != masks.EMPTY, compute, skip)


def _merge(o, lse, o_b, lse_b):
  """Online-softmax merge of two normalised partials (lse [B, N, T]); rows empty in both stay 0 / -inf."""
  o, rows = flash.merge_rows(o, jnp.swapaxes(lse, 1, 2), o_b, jnp.swapaxes(lse_b, 1, 2))
  return o, jnp.swapaxes(rows, 1, 2)


def block_kwargs(drop):
  """The block contract's dropout keyword: passed only with dropout."""
  return {} if drop is None else {"dropout": drop}


def _ring_forward(q, k, v, q_tok, kv_tok, drop, cfg: RingConfig):
  n, r, shard_of = _ring_geometry(cfg.axis_name)
  spec = cfg.spec
  backend = cfg.backend
  B, T, N, _ = q.shape
  S = k.shape[1]
  q_tok = masks.with_positions(q_tok, _member_positions(cfg, shard_of(r), n, T))

  def part(t, kv, dtype=None):
    """(o, lse) of hop t's block, or (0, -inf) when the whole block is masked; o in `dtype` (None: float32)."""
    k_t, v_t, tok_t = kv
    tok_t = masks.with_positions(tok_t, _member_positions(cfg, shard_of((r - t) % n), n, S))

    def compute():
      return backend.fwd(q, k_t, v_t, q_tok, tok_t, spec=spec, out_dtype=dtype, **block_kwargs(drop))

    def skip():
      return (
        vma.like(jnp.zeros((B, T, N, v.shape[3]), dtype or F32), q),
        vma.like(jnp.full((B, N, T), -jnp.inf, F32), q),
      )

    return _unless_empty(backend, _HopKind(spec, q_tok, tok_t), compute, skip, diagonal=_diagonal(t, T, S))

  def hop(t, kv, acc):
    return _merge(*acc, *part(t, kv))

  kv = (k, v, kv_tok)
  # Hop 0's partial is the first accumulator (merging it into an empty one is
  # the identity), so no zero accumulator is ever materialised.
  if n == 1:
    return part(0, kv, out_dtype(cfg, q))
  # Hop 0 works on the local shard while it is already on its way to r + 1;
  # hops 1 .. n-2 do the same with what arrived; hop n-1 sends nothing.
  kv_next = layout.rotate(kv, cfg.axis_name, n)
  acc = part(0, kv)

  def body(t, carry):
    kv, acc = carry
    kv_next = layout.rotate(kv, cfg.axis_name, n)
    return kv_next, hop(t, kv, acc)

  kv, acc = jax.lax.fori_loop(1, n - 1, body, (kv_next, acc))
  return hop(n - 1, kv, acc)


def _ring_backward(operands, lse, do, delta, cfg: RingConfig):
  q, k, v, q_tok, kv_tok, drop = operands
  n, r, shard_of = _ring_geometry(cfg.axis_name)
  spec = cfg.spec
  backend = cfg.backend
  S = k.shape[1]
  q_tok = masks.with_positions(q_tok, _member_positions(cfg, shard_of(r), n, q.shape[1]))

  def part(t, kv):
    """(dq, dk, dv) of hop t's block, or zeros when the whole block is masked."""
    k_t, v_t, tok_t = kv
    tok_t = masks.with_positions(tok_t, _member_positions(cfg, shard_of((r - t) % n), n, S))

    def compute():
      return backend.bwd(q, k_t, v_t, do, lse, delta, q_tok, tok_t, spec=spec, **block_kwargs(drop))

    def skip():
      zq = vma.like(jnp.zeros(q.shape, F32), q)
      zk = vma.like(jnp.zeros(k.shape, F32), k)
      zv = zk if v.shape == k.shape else vma.like(jnp.zeros(v.shape, F32), k)
      return zq, zk, zv

    return _unless_empty(backend, _HopKind(spec, q_tok, tok_t), compute, skip, diagonal=_diagonal(t, q.shape[1], S))

  def hop(t, kv, dq, dkv_in):
    dq_b, dk_b, dv_b = part(t, kv)
    return dq + dq_b, (dkv_in[0] + dk_b, dkv_in[1] + dv_b)

  # Hop 0's gradients start the dq accumulator and the accumulators of the
  # local shard (no zero accumulators).
  kv = (k, v, kv_tok)
  if n == 1:
    dq, dk, dv = part(0, kv)
  else:
    kv_next = layout.rotate(kv, cfg.axis_name, n)
    dq, dk, dv = part(0, kv)
    pending = (dk, dv)

    # At hop t, member r receives the accumulator of shard (r - t) mod n from
    # r - 1 (which finished adding to it at hop t - 1) while computing its own
    # contribution for that same shard, then adds the two.
    def body(t, carry):
      kv, dq, pending = carry
      kv_next = layout.rotate(kv, cfg.axis_name, n)
      arrived = layout.rotate(pending, cfg.axis_name, n)
      dq, pending = hop(t, kv, dq, arrived)
      return kv_next, dq, pending

    kv, dq, pending = jax.lax.fori_loop(1, n - 1, body, (kv_next, dq, pending))
    dq, pending = hop(n - 1, kv, dq, layout.rotate(pending, cfg.axis_name, n))
    # The n-th send brings every accumulator home.
    dk, dv = layout.rotate(pending, cfg.axis_name, n)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


def ring_attention_local(q, k, v, q_tok, kv_tok, cfg: RingConfig, drop=None, sinks=None):
  """Per-device entry point (inside shard_map, or a ring of one); `q_tok` / `kv_tok`: the shards' `masks.Tokens`
  (positions None: the layout's); `drop`: the int32[4] dropout operand or None; `sinks`: the [N] sink logits of
  q's heads or None (applied once, by `flash`, to the whole ring's result)."""
  kernel = flash.RingKernel(_ring_forward, _ring_backward, direct(cfg, sinks))
  return flash.flash(kernel, sinks, q, k, v, q_tok, kv_tok, drop)

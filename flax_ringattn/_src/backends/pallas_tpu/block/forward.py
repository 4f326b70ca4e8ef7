"""Pallas TPU block forward: flash attention over one (q shard, kv shard) pair.

Grid (B, K, T / bq, S / bk), kv tiles innermost.  One kernel instance owns the
G = N / K q heads of one kv head for one q tile: the kv tile is fetched once
and the group's heads share one (G * bq, H) x (H, bk) matmul, so GQA repeats
nothing.  A scalar-prefetched table of tile classes (`masks.tile_kinds`) lets
the kernel skip the matmuls of EMPTY tiles and the mask arithmetic of FULL
ones, and a second table (`common.fetch_index`) points the K/V BlockSpecs of
an EMPTY tile at the tile already in VMEM, so its DMA is skipped too.
m / l / acc live in VMEM scratch across the kv axis (online softmax, f32).
q and k tiles are (tokens, H), v, o and acc (tokens, Hv): v's head dim may
differ from q/k's (MLA), and the kernel never assumes they match.
With attention dropout the int32[4] dropout operand sits in SMEM and each
tile's keep mask is hashed from its global indices (`common.dropout_scale`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flax_ringattn._src.backends.pallas_tpu import common as c


def fwd_plan(
  *,
  B,
  T,
  S,
  N,
  K,
  H,
  dtype,
  bq,
  bk,
  mask,
  has_dropout=False,
  Hv=None,
) -> c.CallPlan:
  G, Hv = N // K, H if Hv is None else Hv
  q_map = lambda b, h, i, j, kinds, fetch: (b, i)  # noqa: E731
  kv_map = lambda b, h, i, j, kinds, fetch: (b, fetch[i, j])  # noqa: E731
  drop_specs, drop_dtypes = c.dropout_specs(has_dropout)
  in_specs = [
    pl.BlockSpec((None, G, bq, H), lambda b, h, i, j, kinds, fetch: (b, h, i, 0)),
    pl.BlockSpec((None, None, bk, H), lambda b, h, i, j, kinds, fetch: (b, h, fetch[i, j], 0)),
    pl.BlockSpec((None, None, bk, Hv), lambda b, h, i, j, kinds, fetch: (b, h, fetch[i, j], 0)),
    *c.mask_specs(mask, bq, bk, q_map, kv_map),
    *drop_specs,
  ]
  in_dtypes = (dtype, dtype, dtype) + c.mask_dtypes(mask) + drop_dtypes
  row = lambda b, h, i, j, kinds, fetch: (b, h, i, 0)  # noqa: E731
  return c.CallPlan(
    grid=(B, K, T // bq, S // bk),
    in_specs=tuple(in_specs),
    in_dtypes=in_dtypes,
    out_specs=(pl.BlockSpec((None, G, bq, Hv), row), pl.BlockSpec((None, G, bq, 1), row)),
    out_shapes=(jax.ShapeDtypeStruct((B, N, T, Hv), c.F32), jax.ShapeDtypeStruct((B, N, T, 1), c.F32)),
    scratch=(((G, bq, c.LANES), c.F32), ((G, bq, c.LANES), c.F32), ((G, bq, Hv), c.F32)),
  )


def _kernel(kinds_ref, fetch_ref, q_ref, k_ref, v_ref, *refs, spec, num_mask_refs):
  del fetch_ref  # used by the BlockSpecs only
  mask_refs = refs[:num_mask_refs]
  drop_ref, refs = c.split_dropout_ref(spec, refs[num_mask_refs:])
  o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
  b, h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, c.F32)
    l_sc[...] = jnp.zeros(l_sc.shape, c.F32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, c.F32)

  def update(masked):
    drop = c.tile_dropout(spec, drop_ref, b, h, q_ref, mask_refs)
    online_softmax_step(
      q_ref, k_ref, v_ref, mask_refs if masked else None, m_sc, l_sc, acc_sc, spec=spec, masked=masked, drop=drop
    )

  c.by_tile_kind(kinds_ref[i, j], update)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    finish(m_sc, l_sc, acc_sc, o_ref, lse_ref)


def online_softmax_step(q_ref, k_ref, v_ref, mask_refs, m_ref, l_ref, acc_ref, *, spec, masked, drop=None):
  """One (q tile, kv tile) step of the online softmax, shared with the in-kernel ring.

  q_ref (G, bq, H), k_ref (bk, H), v_ref (bk, Hv); m / l lane-replicated
  (G, bq, 128) and acc (G, bq, Hv) f32, updated in place.  `drop`: the tile's dropout scale
  (`common.dropout_scale`) or None.  Dropout drops normalised probabilities,
  so l sums every p and only the p @ v product is dropped.
  """
  s, _ = c.scores(q_ref, k_ref, mask_refs, spec=spec, masked=masked)  # [G, bq, bk]
  G, bq, Hv = acc_ref.shape
  m_prev = m_ref[...][..., :1]
  m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
  # A row with nothing visible so far keeps m = -inf: shift by 0 instead, so
  # exp() gives 0 rather than exp(-inf + inf) = NaN.
  m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
  alpha = jnp.exp(m_prev - m_safe)
  p = jnp.exp(s - m_safe)
  l_new = alpha * l_ref[...][..., :1] + p.sum(axis=-1, keepdims=True)
  if drop is not None:
    p = p * drop
  v = v_ref[...]
  pv = jax.lax.dot_general(
    p.reshape(G * bq, -1).astype(v.dtype),
    v,
    (((1,), (0,)), ((), ())),
    preferred_element_type=c.F32,
    precision=spec.precision,
  )
  acc_ref[...] = alpha * acc_ref[...] + pv.reshape(G, bq, Hv)
  m_ref[...] = jnp.broadcast_to(m_new, m_ref.shape)
  l_ref[...] = jnp.broadcast_to(l_new, l_ref.shape)


def finish(m_ref, l_ref, acc_ref, o_ref, lse_ref):
  """o = acc / l and lse = m + log l; a row with no visible key gets o = 0, lse = -inf."""
  l = l_ref[...][..., :1]
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = acc_ref[...] / l_safe
  lse_ref[...] = jnp.where(empty, -jnp.inf, m_ref[...][..., :1] + jnp.log(l_safe))


def block_fwd(q, k, v, q_tok, kv_tok, *, spec, interpret, dropout=None):
  """See `backends/base.py` for the contract."""
  dims, kinds, mask_ops = c.block_setup(spec, q, k, v, q_tok, kv_tok, backward=False)
  plan = fwd_plan(**dims)
  kernel = functools.partial(_kernel, spec=spec, num_mask_refs=len(mask_ops))
  o, lse = c.call(kernel, plan, 2, interpret=interpret, name="ring_block_fwd")(
    kinds,
    c.fetch_index(kinds),
    c.heads_major(q),
    c.heads_major(k),
    c.heads_major(v),
    *mask_ops,
    *c.dropout_operands(spec, dropout),
  )
  return c.heads_major(o), lse[..., 0]

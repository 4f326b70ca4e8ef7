"""Pallas TPU block backward: probabilities recomputed from the final lse.

Two kernels, each accumulating one gradient in VMEM over its innermost grid
axis so that nothing is written twice:

* dq:    grid (B, K, T / bq, S / bk), kv tiles innermost, dq of the q tile in
         scratch;
* dk/dv: grid (B, K, S / bk, T / bq), q tiles innermost, dk and dv of the kv
         tile in scratch, summed over the G q heads of the group inside the
         matmul (the group's rows are stacked, (G * bq, bk)).

Fused (`BlockSizes.fused_bwd`, the default, `common.fused_backward`): the
dk/dv kernel alone, also writing each tile's dq contribution dS k from the
probabilities it already has, one partial per kv tile ([S / bk, B, N, T, H] in
q's dtype, zeros on EMPTY tiles), summed in float32 after: two matmuls and a
softmax recompute fewer per tile, for (S / bk) x dq of extra HBM, bounded by
running the kernel over kv chunks where the whole would pass
`planners.FUSED_DQ_MAX_BYTES`.  As splash's fused backward does; on a v5e
(2026-12-07) it ran 15-20% faster than the two kernels (planners/block.py).

Both use the same tile-class and fetch-index tables as the forward (the dk/dv
kernel on their transpose), so EMPTY tiles cost neither matmuls nor DMAs.
q, k, dq and dk tiles are (tokens, H); v, dO and dv tiles (tokens, Hv), v's
head dim, which may differ from q/k's (MLA).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flax_ringattn._src import masks
from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu import planners

_NN = (((1,), (0,)), ((), ()))  # [m, k] x [k, n]
_NT = (((1,), (1,)), ((), ()))  # [m, k] x [n, k]
_TN = (((0,), (0,)), ((), ()))  # [k, m] x [k, n]


def _q_side_specs(G, bq, H, Hv, row):
  """q, do, lse, delta: the G heads of a group, bq rows, block index from `row`; lse and delta (bq, 1) columns."""
  return [
    pl.BlockSpec((None, G, bq, H), row),
    pl.BlockSpec((None, G, bq, Hv), row),
    pl.BlockSpec((None, G, bq, 1), row),
    pl.BlockSpec((None, G, bq, 1), row),
  ]


def _dtypes(dtype, mask, has_dropout, *, q_first):
  q_side = (dtype, dtype, c.F32, c.F32)
  kv_side = (dtype, dtype)
  return (q_side + kv_side if q_first else kv_side + q_side) + c.mask_dtypes(mask) + c.dropout_specs(has_dropout)[1]


def dq_plan(
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
  row = lambda b, h, i, j, kinds, fetch: (b, h, i, 0)  # noqa: E731
  kv = lambda b, h, i, j, kinds, fetch: (b, h, fetch[i, j], 0)  # noqa: E731
  in_specs = [
    *_q_side_specs(G, bq, H, Hv, row),
    pl.BlockSpec((None, None, bk, H), kv),
    pl.BlockSpec((None, None, bk, Hv), kv),
    *c.mask_specs(
      mask, bq, bk, lambda b, h, i, j, kinds, fetch: (b, i), lambda b, h, i, j, kinds, fetch: (b, fetch[i, j])
    ),
    *c.dropout_specs(has_dropout)[0],
  ]
  return c.CallPlan(
    grid=(B, K, T // bq, S // bk),
    in_specs=tuple(in_specs),
    in_dtypes=_dtypes(dtype, mask, has_dropout, q_first=True),
    out_specs=(pl.BlockSpec((None, G, bq, H), row),),
    out_shapes=(jax.ShapeDtypeStruct((B, N, T, H), c.F32),),
    scratch=(((G * bq, H), c.F32),),
  )


def dkv_plan(
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
  fused=False,
) -> c.CallPlan:
  G, Hv = N // K, H if Hv is None else Hv
  row = lambda b, h, j, i, kinds, fetch: (b, h, fetch[j, i], 0)  # noqa: E731
  kv = lambda b, h, j, i, kinds, fetch: (b, h, j, 0)  # noqa: E731
  in_specs = [
    pl.BlockSpec((None, None, bk, H), kv),
    pl.BlockSpec((None, None, bk, Hv), kv),
    *_q_side_specs(G, bq, H, Hv, row),
    *c.mask_specs(
      mask, bq, bk, lambda b, h, j, i, kinds, fetch: (b, fetch[j, i]), lambda b, h, j, i, kinds, fetch: (b, j)
    ),
    *c.dropout_specs(has_dropout)[0],
  ]
  return c.CallPlan(
    grid=(B, K, S // bk, T // bq),
    in_specs=tuple(in_specs),
    in_dtypes=_dtypes(dtype, mask, has_dropout, q_first=False),
    out_specs=(pl.BlockSpec((None, None, bk, H), kv), pl.BlockSpec((None, None, bk, Hv), kv))
    + fused * (pl.BlockSpec((None, None, G, bq, H), lambda b, h, j, i, kinds, fetch: (j, b, h, i, 0)),),
    out_shapes=(jax.ShapeDtypeStruct((B, K, S, H), c.F32), jax.ShapeDtypeStruct((B, K, S, Hv), c.F32))
    + fused * (jax.ShapeDtypeStruct((S // bk, B, N, T, H), dtype),),
    scratch=(((bk, H), c.F32), ((bk, Hv), c.F32)),
  )


def _probs_and_dscores(q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_refs, *, spec, masked, drop=None):
  """p [G * bq, bk] and dS [G * bq, bk] (d loss / d scaled logits, without the scale: the callers multiply the
  [G * bq, H] and [bk, H] products by it, not every score) of one tile pair.

  The probabilities are recomputed in log2 units, as the forward computes them
  (`common.scores(log2=True)`: the scale times log2(e) in one multiply, and
  exp2, with lse times log2(e) on its column).
  With dropout (`drop`: the tile's keep / (1 - rate), `common.dropout_scale`)
  the returned p is the dropped one (what dV needs) and dP is dropped the same
  way before dS; delta already comes from the dropped output.
  """
  s, t = c.scores(q_ref, k_ref, mask_refs, spec=spec, masked=masked, log2=True)  # [G, bq, bk]
  G, bq, bk = s.shape
  lse = lse_ref[...]  # [G, bq, 1]
  # lse = -inf only for rows with no visible key anywhere; their s is -inf
  # everywhere, so shifting by 0 gives p = 0 (not NaN).
  p = jnp.exp2(s - jnp.where(jnp.isneginf(lse), 0.0, lse * c.LOG2_E))
  do = do_ref[...].reshape(G * bq, -1)
  dp = jax.lax.dot_general(do, v_ref[...], _NT, preferred_element_type=c.F32, precision=spec.precision)
  dp = dp.reshape(G, bq, bk)
  if drop is not None:
    dp = dp * drop
  ds = p * (dp - delta_ref[...])
  if t is not None:
    ds = ds * (1.0 - t * t)  # d(cap * tanh(x / cap)) / dx
  if drop is not None:
    p = p * drop
  return p.reshape(G * bq, bk), ds.reshape(G * bq, bk), do


def _dq_kernel(kinds_ref, fetch_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, *refs, spec, num_mask_refs):
  del fetch_ref
  mask_refs = refs[:num_mask_refs]
  drop_ref, refs = c.split_dropout_ref(spec, refs[num_mask_refs:])
  dq_ref, dq_sc = refs
  b, h, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(j == 0)
  def _init():
    dq_sc[...] = jnp.zeros(dq_sc.shape, c.F32)

  def update(masked):
    drop = c.tile_dropout(spec, drop_ref, b, h, q_ref, mask_refs)
    _, ds, _ = _probs_and_dscores(
      q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_refs, spec=spec, masked=masked, drop=drop
    )
    k = k_ref[...]
    dq_sc[...] += jax.lax.dot_general(
      ds.astype(k.dtype), k, _NN, preferred_element_type=c.F32, precision=spec.precision
    )

  c.by_tile_kind(kinds_ref[i, j], update)

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    dq_ref[...] = (dq_sc[...] * spec.scale).reshape(dq_ref.shape)


def _dkv_kernel(kinds_ref, fetch_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, *refs, spec, num_mask_refs):
  del fetch_ref
  mask_refs = refs[:num_mask_refs]
  drop_ref, refs = c.split_dropout_ref(spec, refs[num_mask_refs:])
  dk_ref, dv_ref, *dq_part, dk_sc, dv_sc = refs
  dq_part = dq_part[0] if dq_part else None  # this tile's dq partial, when fused
  b, h, j, i = pl.program_id(0), pl.program_id(1), pl.program_id(2), pl.program_id(3)

  @pl.when(i == 0)
  def _init():
    dk_sc[...] = jnp.zeros(dk_sc.shape, c.F32)
    dv_sc[...] = jnp.zeros(dv_sc.shape, c.F32)

  def update(masked):
    drop = c.tile_dropout(spec, drop_ref, b, h, q_ref, mask_refs)
    p, ds, do = _probs_and_dscores(
      q_ref, k_ref, v_ref, do_ref, lse_ref, delta_ref, mask_refs, spec=spec, masked=masked, drop=drop
    )
    G, bq, H = q_ref.shape
    q = q_ref[...].reshape(G * bq, H)
    dv_sc[...] += jax.lax.dot_general(
      p.astype(do.dtype), do, _TN, preferred_element_type=c.F32, precision=spec.precision
    )
    dk_sc[...] += jax.lax.dot_general(
      ds.astype(q.dtype), q, _TN, preferred_element_type=c.F32, precision=spec.precision
    )
    if dq_part is not None:
      dq = jax.lax.dot_general(
        ds.astype(q.dtype), k_ref[...], _NN, preferred_element_type=c.F32, precision=spec.precision
      )
      dq_part[...] = (dq * spec.scale).reshape(dq_part.shape).astype(dq_part.dtype)

  c.by_tile_kind(kinds_ref[j, i], update)
  if dq_part is not None:
    pl.when(kinds_ref[j, i] == masks.EMPTY)(lambda: dq_part.__setitem__(..., jnp.zeros(dq_part.shape, dq_part.dtype)))

  @pl.when(i == pl.num_programs(3) - 1)
  def _finish():
    dk_ref[...] = dk_sc[...] * spec.scale
    dv_ref[...] = dv_sc[...]


def block_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, *, spec, interpret, dropout=None):
  """See `backends/base.py` for the contract."""
  dims, kinds, mask_ops = c.block_setup(spec, q, k, v, q_tok, kv_tok, backward=True)
  q_side = (c.heads_major(q), c.heads_major(do), lse[..., None], delta[..., None])
  kv_side = (c.heads_major(k), c.heads_major(v))
  drop_ops = c.dropout_operands(spec, dropout)
  if c.fused_backward(spec, q, k, v, dims["bq"], dims["bk"]):
    dq, dk, dv = _fused(spec, dims, kinds, q_side, kv_side, mask_ops, q_tok, kv_tok, drop_ops, interpret=interpret)
    return c.heads_major(dq), c.heads_major(dk), c.heads_major(dv)
  n_mask = len(mask_ops)
  (dq,) = c.call(
    functools.partial(_dq_kernel, spec=spec, num_mask_refs=n_mask),
    dq_plan(**dims),
    2,
    interpret=interpret,
    name="ring_block_bwd_dq",
  )(kinds, c.fetch_index(kinds), *q_side, *kv_side, *mask_ops, *drop_ops)
  dk, dv = _dkv_call(spec, dims, kinds, q_side, kv_side, mask_ops, drop_ops, fused=False, interpret=interpret)
  return c.heads_major(dq), c.heads_major(dk), c.heads_major(dv)


def _dkv_call(spec, dims, kinds, q_side, kv_side, mask_ops, drop_ops, *, fused, interpret):
  """The dk/dv kernel over `kinds` ([T / bq, S / bk] of the kv span in `kv_side` and `mask_ops`): (dk, dv), and
  with `fused` the [S / bk, B, N, T, H] dq partials."""
  kinds_t = kinds.T
  return c.call(
    functools.partial(_dkv_kernel, spec=spec, num_mask_refs=len(mask_ops)),
    dkv_plan(**dims, fused=fused),
    2,
    interpret=interpret,
    name="ring_block_bwd_fused" if fused else "ring_block_bwd_dkv",
  )(kinds_t, c.fetch_index(kinds_t), *kv_side, *q_side, *mask_ops, *drop_ops)


def _fused(spec, dims, kinds, q_side, kv_side, mask_ops, q_tok, kv_tok, drop_ops, *, interpret):
  """The fused backward, over kv chunks whose dq partials fit `planners.FUSED_DQ_MAX_BYTES` each
  (`planners.fused_dq_chunks`): one kernel call when they all fit at once, else a scan over equal chunks of kv
  tiles (k, v, their token rows and the tile classes sliced; the dropout hash reads global positions, so a
  chunk drops what the whole would), dq summed across chunks in float32 and dk / dv concatenated."""
  B, T, S, N, H, bk = (dims[x] for x in ("B", "T", "S", "N", "H", "bk"))
  # None: one kv tile's partial alone passes the bound, and the fused backward was asked for (`fused_bwd=True`):
  # one kv tile a chunk, the least memory it can take
  chunks = planners.fused_dq_chunks(B=B, T=T, S=S, N=N, H=H, bk=bk, dtype=dims["dtype"]) or S // bk
  if chunks == 1:
    dk, dv, parts = _dkv_call(spec, dims, kinds, q_side, kv_side, mask_ops, drop_ops, fused=True, interpret=interpret)
    return jnp.sum(parts, axis=0, dtype=c.F32), dk, dv
  span = S // chunks  # kv tokens per chunk, whole tiles
  chunk_dims = dict(dims, S=span)

  def step(dq, n):
    lo = n * span
    kv = tuple(jax.lax.dynamic_slice_in_dim(x, lo, span, axis=2) for x in kv_side)  # [B, K, S, H]
    tiles = jax.lax.dynamic_slice_in_dim(kinds, n * (span // bk), span // bk, axis=1)
    chunk_mask = c.mask_operands(q_tok, kv_tok.slice(lo, span))
    dk, dv, parts = _dkv_call(
      spec, chunk_dims, tiles, q_side, kv, chunk_mask, drop_ops, fused=True, interpret=interpret
    )
    return dq + jnp.sum(parts, axis=0, dtype=c.F32), (dk, dv)

  # The float32 dq accumulator starts as zeros tied to do: a constant zero buffer has no inputs, so XLA may place
  # it anywhere before the scan, and in a rematerialised decoder it put every layer's there at once (32k tokens of
  # 14 heads of 64: 22 live 224 MiB accumulators, an out-of-memory compile on a v5e).
  zeros, _ = jax.lax.optimization_barrier((jnp.zeros(q_side[0].shape, c.F32), q_side[1]))
  dq, (dk, dv) = jax.lax.scan(step, zeros, jnp.arange(chunks))
  whole = lambda x: jnp.moveaxis(x, 0, 2).reshape(B, x.shape[2], S, x.shape[-1])  # noqa: E731  [C, B, K, span, H]
  return dq, whole(dk), whole(dv)

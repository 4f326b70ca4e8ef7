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
m and l are kept lane-replicated and tiled across a tile (`online_softmax_step`),
and the softmax runs in log2 units (`online_softmax_step`'s exp2).  A PARTIAL tile twice as tall as
it is wide runs as two row sub-tiles, each classified on its own
(`tiling.forward_sub_tiles`; the classes ride in the same table,
`common.with_sub_tiles`): the half of a causal diagonal tile that needs no mask
is skipped (above the diagonal) or runs unmasked (below it).

Token-major forward (`tiling.token_major_forward`: N a multiple of 8, q tiles
a multiple of 128, head dims of 128): q is read and o written in the caller's
[B, T, N, H] layout, viewed (free) as [B, T * N, H], and lse is written
lane-dense as [B, N, T], so neither q nor o is transposed outside the kernel
and lse is not padded 128-fold.  The grid is (B, T / bq, K, S / bk): the q
tile of all N heads and its o and lse blocks stay in VMEM while each kv
head's group works through it.  At a group's first kv step its G heads are
gathered from the q tile with sublane-strided loads (`common.strided_rows`;
bf16 through 32-bit words) into (G, bq, H) scratch, and at its last they are
stored back with strided stores.  The tile step between is the same.  K and
V stay heads-major (XLA transposes them): a kv head of a token-major tile
would be a strided read at every kv step.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flax_ringattn._src import masks
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
  token_major=None,
  o_dtype=c.F32,
) -> c.CallPlan:
  """`token_major`: the token-major layout (None: where `tiling.token_major_forward` allows it; the kernel
  decides by `common.forward_token_major`, which also needs it to fit VMEM).  `o_dtype`: the output's (the block
  contract's `out_dtype`)."""
  G, Hv = N // K, H if Hv is None else Hv
  if token_major is None:
    token_major = c.token_major_forward(N, bq, (H, Hv))
  drop_specs, drop_dtypes = c.dropout_specs(has_dropout)
  in_dtypes = (dtype, dtype, dtype) + c.mask_dtypes(mask) + drop_dtypes
  stats = (((G, bq, c.LANES), c.F32), ((G, bq, c.LANES), c.F32), ((G, bq, Hv), c.F32))  # m, l, acc
  if token_major:
    # Grid (b, i, h, j): the q tile of all heads and its o / lse blocks stay in VMEM while every kv head's
    # group works through it (one q DMA per tile); h is "arbitrary" because the groups share those blocks.
    q_map = lambda b, i, h, j, kinds, fetch: (b, i)  # noqa: E731
    kv_map = lambda b, i, h, j, kinds, fetch: (b, fetch[i, j])  # noqa: E731
    kv = lambda b, i, h, j, kinds, fetch: (b, h, fetch[i, j], 0)  # noqa: E731
    return c.CallPlan(
      grid=(B, T // bq, K, S // bk),
      in_specs=(
        # A leading block dim of 1, not None: Mosaic bitcasts the ref (`common.strided_rows`) with all its dims.
        pl.BlockSpec((1, bq * N, H), lambda b, i, h, j, kinds, fetch: (b, i, 0)),
        pl.BlockSpec((None, None, bk, H), kv),
        pl.BlockSpec((None, None, bk, Hv), kv),
        *c.mask_specs(mask, bq, bk, q_map, kv_map),
        *drop_specs,
      ),
      in_dtypes=in_dtypes,
      out_specs=(
        # A leading 1 as for q: a bf16 o is stored through a 32-bit view of the ref (`common.store_strided_rows`).
        pl.BlockSpec((1, bq * N, Hv), lambda b, i, h, j, kinds, fetch: (b, i, 0)),
        pl.BlockSpec((None, N, bq), lambda b, i, h, j, kinds, fetch: (b, 0, i)),
      ),
      out_shapes=(jax.ShapeDtypeStruct((B, T * N, Hv), o_dtype), jax.ShapeDtypeStruct((B, N, T), c.F32)),
      scratch=(*stats, ((G, bq, H), dtype)),  # + the group's q heads, gathered once per q tile
      semantics=("parallel", "parallel", "arbitrary", "arbitrary"),
    )
  q_map = lambda b, h, i, j, kinds, fetch: (b, i)  # noqa: E731
  kv_map = lambda b, h, i, j, kinds, fetch: (b, fetch[i, j])  # noqa: E731
  kv = lambda b, h, i, j, kinds, fetch: (b, h, fetch[i, j], 0)  # noqa: E731
  row = lambda b, h, i, j, kinds, fetch: (b, h, i, 0)  # noqa: E731
  in_specs = [
    pl.BlockSpec((None, G, bq, H), row),
    pl.BlockSpec((None, None, bk, H), kv),
    pl.BlockSpec((None, None, bk, Hv), kv),
    *c.mask_specs(mask, bq, bk, q_map, kv_map),
    *drop_specs,
  ]
  return c.CallPlan(
    grid=(B, K, T // bq, S // bk),
    in_specs=tuple(in_specs),
    in_dtypes=in_dtypes,
    out_specs=(pl.BlockSpec((None, G, bq, Hv), row), pl.BlockSpec((None, G, bq, 1), row)),
    out_shapes=(jax.ShapeDtypeStruct((B, N, T, Hv), o_dtype), jax.ShapeDtypeStruct((B, N, T, 1), c.F32)),
    scratch=stats,
  )


def _kernel(
  kinds_ref,
  fetch_ref,
  q_ref,
  k_ref,
  v_ref,
  *refs,
  spec,
  num_mask_refs,
  token_major,
  compiled,
  sub_tiles=1,
  exp2=False,
):
  """`token_major`: the token-major layout of `fwd_plan` (q_ref (1, bq * N, H), o_ref (1, bq * N, Hv), lse_ref
  (N, bq), and the group's q gathered into a last scratch); else heads-major (q_ref (G, bq, H))."""
  del fetch_ref  # used by the BlockSpecs only
  mask_refs = refs[:num_mask_refs]
  drop_ref, refs = c.split_dropout_ref(spec, refs[num_mask_refs:])
  if token_major:
    o_ref, lse_ref, m_sc, l_sc, acc_sc, q_tile = refs
    b, i, h, j = (pl.program_id(a) for a in range(4))
  else:
    o_ref, lse_ref, m_sc, l_sc, acc_sc = refs
    b, h, i, j = (pl.program_id(a) for a in range(4))
    q_tile = q_ref

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, c.F32)
    l_sc[...] = jnp.zeros(l_sc.shape, c.F32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, c.F32)
    if token_major:
      _gather_group(q_ref, q_tile, h, compiled=compiled)

  def update(masked, rows=None):
    # rows: a row sub-tile (a static pl.ds) of the q tile, its statistics and its q-side mask blocks (the
    # column of each `mask_operands` pair); None: the whole tile.
    at = (lambda ref: ref) if rows is None else (lambda ref: ref.at[:, rows, :])  # noqa: E731
    tile_masks = [r.at[rows, :] if rows is not None and n % 2 == 0 else r for n, r in enumerate(mask_refs)]
    drop = c.tile_dropout(spec, drop_ref, b, h, at(q_tile), tile_masks)
    online_softmax_step(
      at(q_tile),
      k_ref,
      v_ref,
      tile_masks if masked else None,
      at(m_sc),
      at(l_sc),
      at(acc_sc),
      spec=spec,
      masked=masked,
      drop=drop,
      exp2=exp2,
    )

  kind = kinds_ref[i, j]
  if sub_tiles == 1:
    c.by_tile_kind(kind, update)
  else:
    # A FULL tile is one unmasked step; a PARTIAL one is its row sub-tiles, each skipped, unmasked or masked.
    pl.when(c.tile_class(kind) == masks.FULL)(lambda: update(False))
    sub = q_tile.shape[1] // sub_tiles

    @pl.when(c.tile_class(kind) == masks.PARTIAL)
    def _partial():
      for r in range(sub_tiles):
        c.by_tile_kind(c.sub_tile_class(kind, r), functools.partial(update, rows=pl.ds(r * sub, sub)))

  @pl.when(j == pl.num_programs(3) - 1)
  def _finish():
    if token_major:
      _finish_rows(m_sc, l_sc, acc_sc, o_ref.at[0], lse_ref, h, exp2=exp2, compiled=compiled)
    else:
      finish(m_sc, l_sc, acc_sc, o_ref, lse_ref, exp2=exp2)


def _for_group(h, num_groups: int, body):
  """body(g0) for the group of kv head h, g0 its first q head, as a static int: one branch per group, so
  every head index inside is static (strided loads and stores at static rows)."""
  for kk in range(num_groups):
    pl.when(h == kk)(lambda kk=kk: body(kk))


def _gather_group(q_ref, q_tile, h, *, compiled):
  """q_tile[g] = head h * G + g of the token-major q tile (rows t * N + n)."""
  G, bq, _ = q_tile.shape
  N = q_ref.shape[1] // bq

  def body(kk):
    for g in range(G):
      q_tile[g] = c.strided_rows(q_ref.at[0], kk * G + g, bq, N, compiled=compiled).astype(q_tile.dtype)

  _for_group(h, N // G, body)


def _finish_rows(m_ref, l_ref, acc_ref, o_ref, lse_ref, h, *, exp2=False, compiled=True):
  """`finish` into the token-major blocks: o rows t * N + n (sublane-strided stores, `common.store_strided_rows`:
  a bf16 o through 32-bit words) and lse rows [N, bq] (lane-dense: each head's lane-replicated column,
  transposed)."""
  o, lse = finished(m_ref, l_ref, acc_ref, exp2=exp2)
  G, bq, _ = o.shape
  N = o_ref.shape[0] // bq
  lse_rows = [lse[g].T[:1] for g in range(G)]  # [1, bq] each

  def body(kk):
    for g in range(G):
      n = kk * G + g
      c.store_strided_rows(o_ref, n, N, o[g], compiled=compiled)
      lse_ref[n : n + 1, :] = lse_rows[g]

  _for_group(h, N // G, body)


def online_softmax_step(q_ref, k_ref, v_ref, mask_refs, m_ref, l_ref, acc_ref, *, spec, masked, drop=None, exp2=False):
  """One (q tile, kv tile) step of the online softmax, shared with the in-kernel ring.

  q_ref (G, bq, H), k_ref (bk, H), v_ref (bk, Hv); m / l lane-replicated
  (G, bq, 128) and acc (G, bq, Hv) f32, updated in place.  `drop`: the tile's dropout scale
  (`common.dropout_scale`) or None.  Dropout drops normalised probabilities,
  so l sums every p and only the p @ v product is dropped.

  The statistics stay lane-replicated throughout and are tiled across a
  tile's lanes (`common.tile_lanes`: whole vregs copied), as JAX's TPU flash kernels
  do.  Sliced to (G, bq, 1) columns and broadcast instead, the causal 8k
  forward took 2.329 ms instead of 1.579 at 1024 x 512 tiles on a v5e
  (2026-12-06): the per-step cost that made small tiles slow.

  `exp2`: the scores scaled into log2 units (the scale times log2(e), one
  multiply as before) and exp2 in place of exp, m in log2 units until
  `finished` converts lse back.  The block forward runs it (1-4% faster on a
  v5e, every row of the block table, 2026-12-06; `KernelDebug.natural_exp`
  times exp); the in-kernel ring, whose state resumes from a natural-log lse
  between hops, keeps exp.
  """
  s, _ = c.scores(q_ref, k_ref, mask_refs, spec=spec, masked=masked, log2=exp2)  # [G, bq, bk]
  exp = jnp.exp2 if exp2 else jnp.exp
  G, bq, Hv = acc_ref.shape
  m_prev = m_ref[...]
  m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
  # A row with nothing visible so far keeps m = -inf: shift by 0 instead, so
  # exp() gives 0 rather than exp(-inf + inf) = NaN.
  m_safe = jnp.where(jnp.isneginf(m_new), 0.0, m_new)
  alpha = exp(m_prev - m_safe)
  p = exp(s - c.tile_lanes(m_safe, s.shape[-1]))
  l_new = alpha * l_ref[...] + p.sum(axis=-1, keepdims=True)
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
  acc_ref[...] = c.tile_lanes(alpha, Hv) * acc_ref[...] + pv.reshape(G, bq, Hv)
  m_ref[...] = m_new
  l_ref[...] = l_new


def finished(m_ref, l_ref, acc_ref, *, exp2=False):
  """(o [G, bq, Hv], lse [G, bq, 128] lane-replicated) of the finished online softmax: o = acc / l and
  lse = m + log l (m * ln 2 + log l with `online_softmax_step`'s exp2, whose m is in log2 units); a row with no visible key
  gets o = 0, lse = -inf."""
  l = l_ref[...]
  empty = l == 0.0
  l_safe = jnp.where(empty, 1.0, l)
  o = acc_ref[...] / l_safe[..., :1]
  m = m_ref[...] * math.log(2.0) if exp2 else m_ref[...]
  return o, jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))


def finish(m_ref, l_ref, acc_ref, o_ref, lse_ref, *, exp2=False):
  """`finished` into heads-major blocks: o (G, bq, Hv), in o_ref's dtype, and lse (G, bq, 1)."""
  o, lse = finished(m_ref, l_ref, acc_ref, exp2=exp2)
  o_ref[...] = o.astype(o_ref.dtype)
  lse_ref[...] = lse[..., :1]


def block_fwd(q, k, v, q_tok, kv_tok, *, spec, interpret, dropout=None, out_dtype=None):
  """See `backends/base.py` for the contract (`out_dtype`: o is written in it, float32 when None)."""
  dims, kinds, mask_ops = c.block_setup(spec, q, k, v, q_tok, kv_tok, backward=False)
  B, T, N, H = q.shape
  bq, bk = dims["bq"], dims["bk"]
  token_major = c.forward_token_major(spec, q, k, v, bq, bk)
  sub_tiles = 1 if spec.debug is not None and spec.debug.whole_partial_tiles else c.forward_sub_tiles(bq, bk, q.dtype)
  plan = fwd_plan(**dims, token_major=token_major, o_dtype=jnp.dtype(out_dtype or c.F32))
  kernel = functools.partial(
    _kernel,
    spec=spec,
    num_mask_refs=len(mask_ops),
    token_major=token_major,
    compiled=interpret is None,
    sub_tiles=sub_tiles,
    exp2=not (spec.debug is not None and spec.debug.natural_exp),
  )
  o, lse = c.call(kernel, plan, 2, interpret=interpret, name="ring_block_fwd")(
    c.with_sub_tiles(spec.mask, q_tok, kv_tok, kinds, bq, bk, sub_tiles),
    c.fetch_index(kinds),
    q.reshape(B, T * N, H) if token_major else c.heads_major(q),
    c.heads_major(k),
    c.heads_major(v),
    *mask_ops,
    *c.dropout_operands(spec, dropout),
  )
  if token_major:
    return o.reshape(B, T, N, -1), lse
  return c.heads_major(o), lse[..., 0]

"""Pallas Triton block forward: flash attention over one (q shard, kv shard) pair.

Grid (B, K, T / bq): one program owns the G * bq stacked rows of one q tile
(the G q heads of one kv head, see `common`) and loops over the kv tiles with
m / l / acc carried in registers (online softmax, f32).  The tile-class table
of `masks.tile_kinds` decides per kv tile: EMPTY loads nothing, FULL skips the
mask, PARTIAL applies `masks.tile_visible`.  With dropout, l sums the
undropped probabilities and acc the dropped ones times v (see `common`).
q and k tiles are [*, H], v tiles and acc [*, Hv] (padded head dims, see
`common`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flax_ringattn._src import masks
from flax_ringattn._src.backends.pallas_gpu import common as c
from flax_ringattn._src.backends.pallas_gpu import planner


def _kernel(kinds_ref, q_ref, k_ref, v_ref, qt_ref, kt_ref, *refs, spec, bk, G, dropout):
  drop_ref, (o_ref, lse_ref) = (refs[0] if dropout else None), refs[-2:]
  i = pl.program_id(2)
  q = q_ref[...]
  qt = c.load(qt_ref)  # the rows' `masks.Tokens`
  R = q.shape[0]
  Hv = v_ref.shape[1]
  nk = k_ref.shape[0] // bk
  drop_idx = c.dropout_indices(spec, drop_ref, R, G)

  def body(j, carry):
    def update(carry, masked):
      m, l, acc = carry
      kv = pl.ds(pl.multiple_of(j * bk, bk), bk)
      k, v = k_ref[kv, :], v_ref[kv, :]
      kt = c.load(kt_ref, kv) if masked or dropout else None
      s, _ = c.scores(q, k, qt, kt, spec=spec, masked=masked)
      m_new = jnp.maximum(m, s.max(axis=1))
      # A row with nothing visible so far keeps m = -inf: shift by 0 instead,
      # so exp() gives 0 rather than exp(-inf + inf) = NaN.
      m_safe = jnp.where(m_new == -jnp.inf, 0.0, m_new)
      alpha = jnp.exp(m - m_safe)
      p = jnp.exp(s - m_safe[:, None])
      # Dropout drops normalised probabilities: the row sum l keeps them all.
      drop = c.dropout_scale(spec, drop_idx, qt.pos, None if kt is None else kt.pos)
      p_v = p if drop is None else p * drop
      acc = alpha[:, None] * acc + c.dot(p_v.astype(v.dtype), v, c.NN, spec)
      return m_new, alpha * l + p.sum(axis=1), acc

    return c.by_tile_kind(kinds_ref[i, j], carry, update)

  init = (jnp.full((R,), -jnp.inf, c.F32), jnp.zeros((R,), c.F32), jnp.zeros((R, Hv), c.F32))
  m, l, acc = jax.lax.fori_loop(0, nk, body, init)
  empty = l == 0.0  # no visible key in the whole block: o = 0, lse = -inf
  l_safe = jnp.where(empty, 1.0, l)
  o_ref[...] = acc / l_safe[:, None]
  lse_ref[...] = jnp.where(empty, -jnp.inf, m + jnp.log(l_safe))


def block_fwd(q, k, v, q_tok, kv_tok, *, spec, interpret, dropout=None):
  """See `backends/base.py` for the contract."""
  B, T, N, H = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  Hp, Hvp = planner.padded_head_dim(H), planner.padded_head_dim(Hv)  # what the kernel holds (see `common`)
  G = N // K
  bq, bk = c.tiles(spec, q, k, v, backward=False)
  R = G * bq
  kinds = masks.tile_kinds(spec.mask, q_tok, kv_tok, bq, bk)  # [T / bq, S / bk]
  qt, kt = c.row_tokens(q_tok, B, G), kv_tok.per_row(B)
  in_specs = [
    pl.BlockSpec(kinds.shape, lambda b, h, i: (0, 0)),
    pl.BlockSpec((None, None, R, Hp), lambda b, h, i: (b, h, i, 0)),
    pl.BlockSpec((None, None, S, Hp), lambda b, h, i: (b, h, 0, 0)),
    pl.BlockSpec((None, None, S, Hvp), lambda b, h, i: (b, h, 0, 0)),
    c.token_specs(qt, R, lambda b, h, i: (b, i)),
    c.token_specs(kt, S, lambda b, h, i: (b, 0)),
  ]
  args = [kinds, c.group_rows(q, K), c.group_rows(k, K), c.group_rows(v, K), qt, kt]
  drop_specs, drop_args = c.dropout_operand(spec, dropout)
  o, lse = c.call(
    functools.partial(_kernel, spec=spec, bk=bk, G=G, dropout=bool(drop_args)),
    grid=(B, K, T // bq),
    in_specs=in_specs + drop_specs,
    out_specs=[
      pl.BlockSpec((None, None, R, Hvp), lambda b, h, i: (b, h, i, 0)),
      pl.BlockSpec((None, None, R), lambda b, h, i: (b, h, i)),
    ],
    out_shapes=[jax.ShapeDtypeStruct((B, K, T * G, Hvp), c.F32), jax.ShapeDtypeStruct((B, K, T * G), c.F32)],
    kernel_name="fwd",
    rows=R,
    bk=bk,
    head_dim=H,
    v_head_dim=Hv,
    dtype=q.dtype,
    interpret=interpret,
    name="ring_block_fwd_gpu",
  )(*args, *drop_args)
  return c.ungroup_rows(o, N, Hv), c.ungroup_stats(lse, N)

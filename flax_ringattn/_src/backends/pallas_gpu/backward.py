"""Pallas Triton block backward: probabilities recomputed from the final lse.

Two kernels, each owning one gradient tile and looping over the other side's
tiles, so no gradient is written twice and no atomics are needed:

* dq:    grid (B, K, T / bq), loop over kv tiles, dq of the G * bq stacked
         rows in registers;
* dk/dv: grid (B, K, S / bk), loop over q tiles, dk and dv of the kv tile in
         registers, summed over the G q heads of the group inside the matmul
         (the group's rows are stacked, see `common`).

Both read the forward's tile-class table (the dk/dv kernel along its columns),
so EMPTY tiles load nothing and run no matmul.  With dropout (see `common`)
both regenerate the forward's keep mask: dV uses the dropped p, and dP is
dropped before dS = p * (dP - delta).  q, k, dq and dk tiles are [*, H],
v, do and dv [*, Hv] (padded head dims, see `common`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flax_ringattn._src import masks
from flax_ringattn._src.backends.pallas_gpu import common as c
from flax_ringattn._src.backends.pallas_gpu import planner


def _probs_and_dscores(q, k, v, do, lse, delta, qt, kt, *, spec, masked, drop_idx):
  """p [R, bk] (dropped, for dV) and dS [R, bk] (d loss / d scaled logits, scale included) of one tile pair;
  qt / kt: the tiles' `masks.Tokens` (None when neither the mask nor dropout reads them)."""
  s, t = c.scores(q, k, qt, kt, spec=spec, masked=masked)
  # lse = -inf only for rows with no visible key anywhere; their s is -inf
  # everywhere, so shifting by 0 gives p = 0 (not NaN).
  p = jnp.exp(s - jnp.where(lse == -jnp.inf, 0.0, lse)[:, None])
  dp = c.dot(do, v, c.NT, spec)
  # The forward's dropout mask, regenerated from the same global indices; delta already uses the dropped O.
  drop = None if drop_idx is None else c.dropout_scale(spec, drop_idx, qt.pos, kt.pos)
  if drop is not None:
    dp = dp * drop
  ds = p * (dp - delta[:, None])
  if t is not None:
    ds = ds * (1.0 - t * t)  # d(cap * tanh(x / cap)) / dx
  return (p if drop is None else p * drop), ds * spec.scale


def _split(refs, n_out, dropout):
  """(dropout ref or None, output refs) of a kernel's trailing refs."""
  return (refs[0] if dropout else None), refs[-n_out:]


def _dq_kernel(kinds_ref, q_ref, do_ref, lse_ref, delta_ref, k_ref, v_ref, qt_ref, kt_ref, *refs, spec, bk, G, dropout):
  drop_ref, (dq_ref,) = _split(refs, 1, dropout)
  i = pl.program_id(2)
  q, do, lse, delta, qt = q_ref[...], do_ref[...], lse_ref[...], delta_ref[...], c.load(qt_ref)
  nk = k_ref.shape[0] // bk
  drop_idx = c.dropout_indices(spec, drop_ref, q.shape[0], G)

  def body(j, dq):
    def update(dq, masked):
      kv = pl.ds(pl.multiple_of(j * bk, bk), bk)
      k, v = k_ref[kv, :], v_ref[kv, :]
      kt = c.load(kt_ref, kv) if masked or dropout else None
      _, ds = _probs_and_dscores(q, k, v, do, lse, delta, qt, kt, spec=spec, masked=masked, drop_idx=drop_idx)
      return dq + c.dot(ds.astype(k.dtype), k, c.NN, spec)

    return c.by_tile_kind(kinds_ref[i, j], dq, update)

  dq_ref[...] = jax.lax.fori_loop(0, nk, body, jnp.zeros(q.shape, c.F32))


def _dkv_kernel(
  kinds_ref, k_ref, v_ref, q_ref, do_ref, lse_ref, delta_ref, qt_ref, kt_ref, *refs, spec, rows, G, dropout
):
  drop_ref, (dk_ref, dv_ref) = _split(refs, 2, dropout)
  j = pl.program_id(2)
  k, v = k_ref[...], v_ref[...]
  kt = c.load(kt_ref)
  nq = q_ref.shape[0] // rows
  # Every q tile starts at a multiple of G stacked rows, so the rows' heads are the same for all of them.
  drop_idx = c.dropout_indices(spec, drop_ref, rows, G)

  def body(i, carry):
    def update(carry, masked):
      dk, dv = carry
      r = pl.ds(pl.multiple_of(i * rows, rows), rows)
      q, do, lse, delta = q_ref[r, :], do_ref[r, :], lse_ref[r], delta_ref[r]
      qt = c.load(qt_ref, r) if masked or dropout else None
      p, ds = _probs_and_dscores(q, k, v, do, lse, delta, qt, kt, spec=spec, masked=masked, drop_idx=drop_idx)
      dv = dv + c.dot(p.astype(do.dtype), do, c.TN, spec)
      dk = dk + c.dot(ds.astype(q.dtype), q, c.TN, spec)
      return dk, dv

    return c.by_tile_kind(kinds_ref[i, j], carry, update)

  dk, dv = jax.lax.fori_loop(0, nq, body, (jnp.zeros(k.shape, c.F32), jnp.zeros(v.shape, c.F32)))
  dk_ref[...] = dk
  dv_ref[...] = dv


def block_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, *, spec, interpret, dropout=None):
  """See `backends/base.py` for the contract."""
  B, T, N, H = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  Hp, Hvp = planner.padded_head_dim(H), planner.padded_head_dim(Hv)  # what the kernels hold (see `common`)
  G = N // K
  bq, bk = c.tiles(spec, q, k, v, backward=True)
  R = G * bq
  kinds = masks.tile_kinds(spec.mask, q_tok, kv_tok, bq, bk)  # [T / bq, S / bk]
  qt, kt = c.row_tokens(q_tok, B, G), kv_tok.per_row(B)
  q_side = [c.group_rows(q, K), c.group_rows(do, K), c.group_stats(lse, K), c.group_stats(delta, K)]
  kv_side = [c.group_rows(k, K), c.group_rows(v, K)]
  drop_specs, drop_args = c.dropout_operand(spec, dropout)
  has_drop = bool(drop_args)
  common = dict(rows=R, bk=bk, head_dim=H, v_head_dim=Hv, dtype=q.dtype, interpret=interpret)
  table = pl.BlockSpec(kinds.shape, lambda b, h, x: (0, 0))

  # dq: a program per q tile; kv side whole.
  tile_q = lambda b, h, i: (b, h, i, 0)  # noqa: E731
  whole = lambda b, h, x: (b, h, 0, 0)  # noqa: E731
  dq_specs = [
    table,
    pl.BlockSpec((None, None, R, Hp), tile_q),
    pl.BlockSpec((None, None, R, Hvp), tile_q),
    pl.BlockSpec((None, None, R), lambda b, h, i: (b, h, i)),
    pl.BlockSpec((None, None, R), lambda b, h, i: (b, h, i)),
    pl.BlockSpec((None, None, S, Hp), whole),
    pl.BlockSpec((None, None, S, Hvp), whole),
    c.token_specs(qt, R, lambda b, h, i: (b, i)),
    c.token_specs(kt, S, lambda b, h, i: (b, 0)),
  ]
  (dq,) = c.call(
    functools.partial(_dq_kernel, spec=spec, bk=bk, G=G, dropout=has_drop),
    grid=(B, K, T // bq),
    in_specs=dq_specs + drop_specs,
    out_specs=[pl.BlockSpec((None, None, R, Hp), tile_q)],
    out_shapes=[jax.ShapeDtypeStruct((B, K, T * G, Hp), c.F32)],
    kernel_name="dq",
    name="ring_block_bwd_dq_gpu",
    **common,
  )(kinds, *q_side, *kv_side, qt, kt, *drop_args)

  # dk/dv: a program per kv tile; q side whole.
  tile_kv = lambda b, h, j: (b, h, j, 0)  # noqa: E731
  dkv_specs = [
    table,
    pl.BlockSpec((None, None, bk, Hp), tile_kv),
    pl.BlockSpec((None, None, bk, Hvp), tile_kv),
    pl.BlockSpec((None, None, T * G, Hp), whole),
    pl.BlockSpec((None, None, T * G, Hvp), whole),
    pl.BlockSpec((None, None, T * G), lambda b, h, j: (b, h, 0)),
    pl.BlockSpec((None, None, T * G), lambda b, h, j: (b, h, 0)),
    c.token_specs(qt, T * G, lambda b, h, j: (b, 0)),
    c.token_specs(kt, bk, lambda b, h, j: (b, j)),
  ]
  dk, dv = c.call(
    functools.partial(_dkv_kernel, spec=spec, rows=R, G=G, dropout=has_drop),
    grid=(B, K, S // bk),
    in_specs=dkv_specs + drop_specs,
    out_specs=[pl.BlockSpec((None, None, bk, Hp), tile_kv), pl.BlockSpec((None, None, bk, Hvp), tile_kv)],
    out_shapes=[jax.ShapeDtypeStruct((B, K, S, Hp), c.F32), jax.ShapeDtypeStruct((B, K, S, Hvp), c.F32)],
    kernel_name="dkv",
    name="ring_block_bwd_dkv_gpu",
    **common,
  )(kinds, *kv_side, *q_side, qt, kt, *drop_args)
  return c.ungroup_rows(dq, N, H), c.ungroup_rows(dk, K, H), c.ungroup_rows(dv, K, Hv)

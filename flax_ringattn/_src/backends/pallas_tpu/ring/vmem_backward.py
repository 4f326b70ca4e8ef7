"""Backward kernel of the in-kernel ring (protocol: `ring/protocol.py`).

Per grid step (b, kv head h): q, dO, the final lse and delta of the group stay
home with the dq accumulator (the dq output block itself); K/V travel as in
the forward, and the dK/dV accumulators travel one hop behind them (two f32
slots each).  One pass per tile pair computes p and dS once and feeds all
three gradients.  A hop's contribution to the shard it holds is summed in a
local buffer while the accumulator of that shard is still arriving, and added
to it at the end of the hop.  K, dK and dq are [.., H] wide; V, dV and dO
[.., Hv], v's head dim (MLA's), so each travels at its own size.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu.block.backward import _NN, _TN, _probs_and_dscores
from flax_ringattn._src.backends.pallas_tpu.ring import protocol as rp


def bwd_plan(d: rp.RingDims) -> c.CallPlan:
  G, T, S, H, Hv = d.G, d.T, d.S, d.H, d.Hv
  grp = lambda b, h, meta, kinds: (b, h, 0, 0)  # noqa: E731
  in_specs = [
    pl.BlockSpec((None, G, T, H), grp),  # q
    pl.BlockSpec((None, G, T, Hv), grp),  # do
    pl.BlockSpec((None, G, T, 1), grp),  # lse
    pl.BlockSpec((None, G, T, 1), grp),  # delta
    rp.HBM,
    rp.HBM,
  ]
  in_dtypes = [d.dtype, d.dtype, c.F32, c.F32, d.dtype, d.dtype]
  scratch = [((2, S, H), d.dtype), ((2, S, Hv), d.dtype)]  # K and V slots
  F = len(d.fields)  # token fields: a q column each, and a kv row each that travels in slots of its own
  in_specs += [pl.BlockSpec((None, T, 1), lambda b, h, meta, kinds: (b, 0, 0))] * F + [rp.HBM] * F
  in_dtypes += [jnp.int32] * (2 * F)
  scratch += [((2, 1, S), jnp.int32)] * F
  drop_specs, drop_dtypes = c.dropout_specs(d.has_dropout)
  in_specs += drop_specs
  in_dtypes += drop_dtypes
  scratch += [((2, S, H), c.F32), ((2, S, Hv), c.F32), ((S, H), c.F32), ((S, Hv), c.F32)]  # dk/dv slots, sums
  return c.CallPlan(
    grid=(d.B, d.K),
    in_specs=tuple(in_specs),
    in_dtypes=tuple(in_dtypes),
    out_specs=(
      pl.BlockSpec((None, G, T, H), grp),
      pl.BlockSpec((None, None, S, H), grp),
      pl.BlockSpec((None, None, S, Hv), grp),
    ),
    out_shapes=(
      jax.ShapeDtypeStruct((d.B, d.N, T, H), c.F32),
      jax.ShapeDtypeStruct((d.B, d.K, S, H), c.F32),
      jax.ShapeDtypeStruct((d.B, d.K, S, Hv), c.F32),
    ),
    scratch=tuple(scratch),
  )


def _kernel(meta_ref, kinds_ref, q_ref, do_ref, lse_ref, delta_ref, k_hbm, v_hbm, *refs, spec, d: rp.RingDims):
  F = len(d.fields)
  qtok_refs, kvtok_hbm, refs = refs[:F], refs[F : 2 * F], refs[2 * F :]
  drop_ref, refs = c.split_dropout_ref(spec, refs)
  dq_ref, dk_ref, dv_ref, k_slots, v_slots, *refs = refs
  tok_slots, refs = refs[:F], refs[F:]
  dk_slots, dv_slots, dk_loc, dv_loc, load_sems, send_sems, recv_sems, credit = refs
  b, h = pl.program_id(0), pl.program_id(1)
  comms = rp.Comms(meta_ref, d, credit, name="ring_bwd")
  if d.n > 1:
    pl.when((b == 0) & (h == 0))(comms.barrier)
  pairs = [(k_hbm.at[b, h], k_slots.at[0]), (v_hbm.at[b, h], v_slots.at[0])]
  pairs += [(x.at[b], s.at[0]) for x, s in zip(kvtok_hbm, tok_slots, strict=True)]
  slots = [k_slots, v_slots, *tok_slots]
  rp.sync_copies(pairs, load_sems)
  dq_ref[...] = jnp.zeros(dq_ref.shape, c.F32)

  def compute(t):
    """Hop t on slot t % 2: one pass per tile pair computes p and dS once for all three gradients; the
    contribution to the shard held this hop is summed in dk_loc / dv_loc (added to the arriving accumulator
    by `fold`)."""
    slot, bq, bk = t % 2, d.bq, d.bk
    dk_loc[...] = jnp.zeros(dk_loc.shape, c.F32)
    dv_loc[...] = jnp.zeros(dv_loc.shape, c.F32)

    def q_tile(i, _):
      rows = pl.ds(i * bq, bq)

      def kv_tile(j, _):
        cols = pl.ds(j * bk, bk)

        def update(masked):
          toks = ([r.at[rows, :] for r in qtok_refs], [s.at[slot, :, cols] for s in tok_slots])
          mask = rp.tile_masks(d, comms, t, i, j, *toks) if masked else None
          q_t, k_t = q_ref.at[:, rows, :], k_slots.at[slot, cols, :]
          p, ds, do = _probs_and_dscores(
            q_t,
            k_t,
            v_slots.at[slot, cols, :],
            do_ref.at[:, rows, :],
            lse_ref.at[:, rows, :],
            delta_ref.at[:, rows, :],
            mask,
            spec=spec,
            masked=masked,
            drop=rp.tile_dropout(spec, d, comms, t, i, j, drop_ref, b, h, *toks),
          )
          G, _, H = q_t.shape
          k = k_t[...]
          q = q_t[...].reshape(G * bq, H)
          dq = jax.lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=c.F32, precision=spec.precision)
          dq_ref[:, rows, :] = dq_ref[:, rows, :] + dq.reshape(G, bq, H)
          dv_loc[cols, :] = dv_loc[cols, :] + jax.lax.dot_general(
            p.astype(do.dtype), do, _TN, preferred_element_type=c.F32, precision=spec.precision
          )
          dk_loc[cols, :] = dk_loc[cols, :] + jax.lax.dot_general(
            ds.astype(q.dtype), q, _TN, preferred_element_type=c.F32, precision=spec.precision
          )

        c.by_tile_kind(rp.tile_kind(kinds_ref, d, t, i, j), update)

      jax.lax.fori_loop(0, d.S // bk, kv_tile, None)

    jax.lax.fori_loop(0, d.T // bq, q_tile, None)

  def fold(t):
    if t == 0:
      dk_slots[0] = dk_loc[...]
      dv_slots[0] = dv_loc[...]
    elif t < d.live:
      dk_slots[t % 2] = dk_slots[t % 2] + dk_loc[...]
      dv_slots[t % 2] = dv_slots[t % 2] + dv_loc[...]

  kv_pairs = lambda t: [(s.at[t % 2], s.at[1 - t % 2]) for s in slots]  # noqa: E731
  home = rp.backward_hops(comms, d, kv_pairs, (dk_slots, dv_slots), send_sems, recv_sems, compute=compute, fold=fold)
  dk_ref[...] = dk_slots[home]
  dv_ref[...] = dv_slots[home]


def ring_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, *, spec, axis_name, load_balance, interpret, dropout=None):
  """(dq, dk, dv) f32 of this device's shards, given the final lse and delta = rowsum(dO * O) [B, N, T];
  `q_tok` / `kv_tok` as `vmem_forward.ring_fwd` takes them."""
  d = rp.ring_dims(spec, q, k, v, axis_name, load_balance, backward=True)
  meta, kinds = rp.ring_tables(spec, d, q_tok, kv_tok)
  args = [c.heads_major(q), c.heads_major(do), lse[..., None], delta[..., None], c.heads_major(k), c.heads_major(v)]
  args += rp.token_operands(d, q_tok, kv_tok) + c.dropout_operands(spec, dropout)
  if d.slots == "hbm":
    from flax_ringattn._src.backends.pallas_tpu.ring.hbm_backward import ring_bwd_hbm

    dq, dk, dv = ring_bwd_hbm(d, spec, meta, kinds, args, interpret=interpret)
  else:
    kernel = functools.partial(_kernel, spec=spec, d=d)
    sems = rp.sem_scratch(d, 2 + len(d.fields) + 2)  # K, V, the token rows; dK, dV
    dq, dk, dv = rp.ring_call(kernel, bwd_plan(d), sems, d, interpret=interpret, name="ring_bwd")(meta, kinds, *args)
  # The kernels accumulate dS without the softmax scale (`block.backward._probs_and_dscores`): dq and dk take it
  # here, once per element rather than once per score.
  return c.heads_major(dq * spec.scale), c.heads_major(dk * spec.scale), c.heads_major(dv)

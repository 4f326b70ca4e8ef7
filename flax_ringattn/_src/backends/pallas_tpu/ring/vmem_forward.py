"""Forward kernel of the in-kernel ring (protocol: `protocol.py`).

Per grid step (b, kv head h): q of the group [G, T, H] and the online-softmax
state m / l / acc [G, T, Hv] of the whole q shard stay in VMEM across all n hops
(the K slots hold [S, H], the V slots [S, Hv]: v's head dim, MLA's); each hop
walks its (q tile, kv tile) pairs, skipping EMPTY ones (`masks.classify`
table) and the mask arithmetic of FULL ones, on the K/V slot that hop holds.
The tile step itself is the block forward's (`forward.online_softmax_step`);
with dropout each tile's keep mask is hashed from its global indices.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu.block.forward import finish, online_softmax_step
from flax_ringattn._src.backends.pallas_tpu.ring import protocol as rp


def fwd_plan(d: rp.RingDims) -> c.CallPlan:
  G, T, S, H, Hv = d.G, d.T, d.S, d.H, d.Hv
  in_specs = [pl.BlockSpec((None, G, T, H), lambda b, h, meta, kinds: (b, h, 0, 0)), rp.HBM, rp.HBM]
  in_dtypes = [d.dtype, d.dtype, d.dtype]
  scratch = [((2, S, H), d.dtype), ((2, S, Hv), d.dtype)]  # K and V slots
  F = len(d.fields)  # token fields: a q column each, and a kv row each that travels in slots of its own
  in_specs += [pl.BlockSpec((None, T, 1), lambda b, h, meta, kinds: (b, 0, 0))] * F + [rp.HBM] * F
  in_dtypes += [jnp.int32] * (2 * F)
  scratch += [((2, 1, S), jnp.int32)] * F
  drop_specs, drop_dtypes = c.dropout_specs(d.has_dropout)
  in_specs += drop_specs
  in_dtypes += drop_dtypes
  row = lambda b, h, meta, kinds: (b, h, 0, 0)  # noqa: E731
  scratch += [((G, T, c.LANES), c.F32), ((G, T, c.LANES), c.F32), ((G, T, Hv), c.F32)]  # m, l, acc
  return c.CallPlan(
    grid=(d.B, d.K),
    in_specs=tuple(in_specs),
    in_dtypes=tuple(in_dtypes),
    out_specs=(pl.BlockSpec((None, G, T, Hv), row), pl.BlockSpec((None, G, T, 1), row)),
    out_shapes=(jax.ShapeDtypeStruct((d.B, d.N, d.T, Hv), c.F32), jax.ShapeDtypeStruct((d.B, d.N, d.T, 1), c.F32)),
    scratch=tuple(scratch),
  )


def _kernel(meta_ref, kinds_ref, q_ref, k_hbm, v_hbm, *refs, spec, d: rp.RingDims):
  F = len(d.fields)
  qtok_refs, kvtok_hbm, refs = refs[:F], refs[F : 2 * F], refs[2 * F :]
  drop_ref, refs = c.split_dropout_ref(spec, refs)
  o_ref, lse_ref, k_slots, v_slots, *refs = refs
  tok_slots, refs = refs[:F], refs[F:]
  m_sc, l_sc, acc_sc, load_sems, send_sems, recv_sems, credit = refs
  b, h = pl.program_id(0), pl.program_id(1)
  comms = rp.Comms(meta_ref, d, credit, name="ring_fwd")
  n, G, bq, bk = d.n, d.G, d.bq, d.bk

  if n > 1:
    pl.when((b == 0) & (h == 0))(comms.barrier)
  pairs = [(k_hbm.at[b, h], k_slots.at[0]), (v_hbm.at[b, h], v_slots.at[0])]
  pairs += [(x.at[b], s.at[0]) for x, s in zip(kvtok_hbm, tok_slots, strict=True)]
  slots = [k_slots, v_slots, *tok_slots]
  rp.sync_copies(pairs, load_sems)
  m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, c.F32)
  l_sc[...] = jnp.zeros(l_sc.shape, c.F32)
  acc_sc[...] = jnp.zeros(acc_sc.shape, c.F32)

  for t in range(d.live):
    rp.note(d, "ring_fwd", "hop", t)
    slot = t % 2
    pairs = [(s.at[slot], s.at[1 - slot]) for s in slots]
    sends = rp.start_kv_sends(comms, d, t, pairs, send_sems, recv_sems)

    def q_tile(i, _, t=t, slot=slot):
      rows = pl.ds(i * bq, bq)

      def kv_tile(j, _):
        cols = pl.ds(j * bk, bk)

        def update(masked):
          toks = ([r.at[rows, :] for r in qtok_refs], [s.at[slot, :, cols] for s in tok_slots])
          mask = rp.tile_masks(d, comms, t, i, j, *toks) if masked else None
          online_softmax_step(
            q_ref.at[:, rows, :],
            k_slots.at[slot, cols, :],
            v_slots.at[slot, cols, :],
            mask,
            m_sc.at[:, rows, :],
            l_sc.at[:, rows, :],
            acc_sc.at[:, rows, :],
            spec=spec,
            masked=masked,
            drop=rp.tile_dropout(spec, d, comms, t, i, j, drop_ref, b, h, *toks),
          )

        c.by_tile_kind(rp.tile_kind(kinds_ref, d, t, i, j), update)

      jax.lax.fori_loop(0, d.S // bk, kv_tile, None)

    rp.note(d, "ring_fwd", "compute", t)
    jax.lax.fori_loop(0, d.T // bq, q_tile, None)
    for s in sends:
      s.wait()

  finish(m_sc, l_sc, acc_sc, o_ref, lse_ref)  # a row with no visible key on the whole ring: o = 0, lse = -inf
  del G


def ring_fwd(q, k, v, q_tok, kv_tok, *, spec, axis_name, load_balance, interpret, dropout=None):
  """(o [B, T, N, Hv] f32, lse [B, N, T] f32) of the whole ring, on this device's q shard; `q_tok` / `kv_tok`:
  the shards' `masks.Tokens` (positions None: the layout's)."""
  d = rp.ring_dims(spec, q, k, v, axis_name, load_balance, backward=False)
  meta, kinds = rp.ring_tables(spec, d, q_tok, kv_tok)
  args = [c.heads_major(q), c.heads_major(k), c.heads_major(v), *rp.token_operands(d, q_tok, kv_tok)]
  args += c.dropout_operands(spec, dropout)
  F = len(d.fields)
  if d.slots == "hbm":
    from flax_ringattn._src.backends.pallas_tpu.ring.hbm_forward import ring_fwd_hbm

    o, lse = ring_fwd_hbm(d, spec, meta, kinds, args, interpret=interpret)
  else:
    kernel = functools.partial(_kernel, spec=spec, d=d)
    sems = rp.sem_scratch(d, 2 + F)
    o, lse = rp.ring_call(kernel, fwd_plan(d), sems, d, interpret=interpret, name="ring_fwd")(meta, kinds, *args)
  return c.heads_major(o), lse[..., 0]

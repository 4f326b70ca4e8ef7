"""Forward kernel of the in-kernel ring with HBM slots (protocol: `protocol.py`; streaming: `stream.py`).

For shards too long for VMEM (`planner.plan_ring`).  The protocol, the hop
schedule and the tile step are those of `vmem_forward.py`; what moves is the
storage.  Per grid step (b, kv head h), per hop t:

    for each q tile i (skipped, copies and all, if EMPTY for the whole hop,
    except on the first hop, which writes every row):
        copy q tile i and its state from HBM (the first hop initialises
        the state instead);
        stream the hop's kv tiles from its slot (double-buffered, EMPTY tiles
        skipped) through `forward.online_softmax_step`;
        write the state back, finished.

Between hops the state of a row is stored finished, as (o, lse) = (acc / l,
m + log l), in the o and lse outputs themselves, and resumed as m = lse,
l = 1, acc = o: the same softmax rescaled, so no m / l buffers live in HBM
and the last hop's write is the result.  The own K/V are read from the input
and sent from it on hop 0 (no copy into a slot); hop t >= 1 holds the shard
that arrived in slot t % 2.  K slots and tiles are H wide, V slots and tiles,
o and the accumulator Hv (v's head dim, MLA's).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu.block.forward import finish, online_softmax_step
from flax_ringattn._src.backends.pallas_tpu.ring import protocol as rp
from flax_ringattn._src.backends.pallas_tpu.ring import stream as st


def fwd_plan_hbm(d: rp.RingDims) -> c.CallPlan:
  G, T, S, H, Hv, bq, bk = d.G, d.T, d.S, d.H, d.Hv, d.bq, d.bk
  in_specs = [rp.HBM, rp.HBM, rp.HBM]  # q, k, v
  in_dtypes = [d.dtype, d.dtype, d.dtype]
  outs = [((d.B, d.N, T, Hv), c.F32), ((d.B, d.N, T, 1), c.F32), ((2, S, H), d.dtype), ((2, S, Hv), d.dtype)]
  scratch = [((G, bq, H), d.dtype)]  # the q tile
  F = len(d.fields)  # token fields: q columns and kv rows in HBM, kv slots of their own, tiles in VMEM
  in_specs += [rp.HBM] * (2 * F)
  in_dtypes += [jnp.int32] * (2 * F)
  outs += [((2, 1, S), jnp.int32)] * F  # kv token-row slots
  scratch += [((bq, 1), jnp.int32)] * F  # the q tile's columns
  drop_specs, drop_dtypes = c.dropout_specs(d.has_dropout)
  in_specs += drop_specs
  in_dtypes += drop_dtypes
  scratch += [((2, bk, H), d.dtype), ((2, bk, Hv), d.dtype)]  # streamed k, v tiles
  scratch += [((2, 1, bk), jnp.int32)] * F  # and their token rows
  scratch += [((G, bq, c.LANES), c.F32), ((G, bq, c.LANES), c.F32), ((G, bq, Hv), c.F32), ((G, bq, 1), c.F32)]
  return c.CallPlan(
    grid=(d.B, d.K),
    in_specs=tuple(in_specs),
    in_dtypes=tuple(in_dtypes),
    out_specs=(rp.HBM,) * len(outs),
    out_shapes=tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in outs),
    scratch=tuple(scratch),
  )


def _kernel(meta_ref, kinds_ref, q_hbm, k_hbm, v_hbm, *refs, spec, d: rp.RingDims):
  F = len(d.fields)
  qtok_hbm, kvtok_hbm, refs = refs[:F], refs[F : 2 * F], refs[2 * F :]
  drop_ref, refs = c.split_dropout_ref(spec, refs)
  o_hbm, lse_hbm, k_slots, v_slots, *refs = refs
  tok_slots, refs = refs[:F], refs[F:]
  q_buf, *refs = refs
  qtok_bufs, refs = refs[:F], refs[F:]
  k_buf, v_buf, *refs = refs
  kvtok_bufs, refs = refs[:F], refs[F:]
  m_sc, l_sc, acc_sc, lse_sc, io_sems, tile_sems, send_sems, recv_sems, credit = refs
  b, h = pl.program_id(0), pl.program_id(1)
  comms = rp.Comms(meta_ref, d, credit, name="ring_fwd")
  G, bq, bk, nq, nk = d.G, d.bq, d.bk, d.T // d.bq, d.S // d.bk
  heads = pl.ds(h * G, G)

  if d.n > 1:
    pl.when((b == 0) & (h == 0))(comms.barrier)
  own = [k_hbm.at[b, h], v_hbm.at[b, h], *(x.at[b] for x in kvtok_hbm)]
  slots = [k_slots, v_slots, *tok_slots]
  bufs = [k_buf, v_buf, *kvtok_bufs]

  for t in range(d.live):
    rp.note(d, "ring_fwd", "hop", t)
    src = own if t == 0 else [s.at[t % 2] for s in slots]
    pairs = [(a, s.at[(t + 1) % 2]) for a, s in zip(src, slots, strict=True)]
    sends = rp.start_kv_sends(comms, d, t, pairs, send_sems, recv_sems)
    first = t == 0

    def q_tile(i, _, t=t, src=src, first=first):
      rows = pl.ds(i * bq, bq)
      row_live = st.any_live(kinds_ref, d, t, row=i, count=nk)
      state = [(o_hbm.at[b, heads, rows], acc_sc), (lse_hbm.at[b, heads, rows], lse_sc)]
      if first:
        m_sc[...] = jnp.full(m_sc.shape, -jnp.inf, c.F32)
        l_sc[...] = jnp.zeros(l_sc.shape, c.F32)
        acc_sc[...] = jnp.zeros(acc_sc.shape, c.F32)
      else:

        @pl.when(row_live)
        def _load():
          rp.sync_copies(state, io_sems)
          _resume(lse_sc, m_sc, l_sc)

      @pl.when(row_live)
      def _compute():
        q_side = [(q_hbm.at[b, heads, rows], q_buf)]
        q_side += [(x.at[b, rows], buf) for x, buf in zip(qtok_hbm, qtok_bufs, strict=True)]
        rp.sync_copies(q_side, io_sems)

        def kv_tile(j, slot):
          toks = (qtok_bufs, [buf.at[slot] for buf in kvtok_bufs])

          def update(masked):
            online_softmax_step(
              q_buf,
              k_buf.at[slot],
              v_buf.at[slot],
              rp.tile_masks(d, comms, t, i, j, *toks) if masked else None,
              m_sc,
              l_sc,
              acc_sc,
              spec=spec,
              masked=masked,
              drop=rp.tile_dropout(spec, d, comms, t, i, j, drop_ref, b, h, *toks),
            )

          c.by_tile_kind(rp.tile_kind(kinds_ref, d, t, i, j), update)

        tiles = lambda j: st.kv_tiles(src, j, bk)  # noqa: E731
        st.stream(nk, lambda j: st.live_tile(kinds_ref, d, t, i, j), tiles, bufs, tile_sems, kv_tile)

      # Every hop leaves the state finished, (o, lse) = (acc / l, m + log l), in the outputs: a row with no
      # visible key so far holds (0, -inf), and the last hop's write is the result.
      @pl.when(row_live | first)
      def _store():
        finish(m_sc, l_sc, acc_sc, acc_sc, lse_sc)
        rp.sync_copies([(v, h_) for h_, v in state], io_sems)

    rp.note(d, "ring_fwd", "compute", t)
    jax.lax.fori_loop(0, nq, q_tile, None)
    for s in sends:
      s.wait()


def _resume(lse_sc, m_sc, l_sc):
  """The online-softmax state of a finished (o, lse) row: m = lse and l = 1, so acc = o (the same softmax,
  rescaled); a row with nothing visible yet (lse = -inf) resumes as m = -inf, l = 0, acc = 0."""
  lse = lse_sc[...]
  m_sc[...] = jnp.broadcast_to(lse, m_sc.shape)
  l_sc[...] = jnp.broadcast_to(jnp.where(jnp.isneginf(lse), 0.0, 1.0), l_sc.shape)


def sems(d: rp.RingDims):
  """Synchronous-copy sems, streamed-tile sems [2, arrays], send and receive sems, the credit."""
  num = 2 + len(d.fields)  # K, V and the token rows
  return [
    pltpu.SemaphoreType.DMA((st.io_sems(d),)),
    pltpu.SemaphoreType.DMA((2, num)),
    pltpu.SemaphoreType.DMA((num,)),
    pltpu.SemaphoreType.DMA((num,)),
    pltpu.SemaphoreType.REGULAR,
  ]


def ring_fwd_hbm(d: rp.RingDims, spec, meta, kinds, args, *, interpret):
  """(o [B, N, T, Hv] f32, lse [B, N, T, 1] f32) heads-major; `args` as `vmem_forward.ring_fwd` builds them."""
  kernel = functools.partial(_kernel, spec=spec, d=d)
  o, lse, *_ = rp.ring_call(kernel, fwd_plan_hbm(d), sems(d), d, interpret=interpret, name="ring_fwd")(
    meta, kinds, *args
  )
  return o, lse

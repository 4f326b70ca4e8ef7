"""Backward kernel of the in-kernel ring with HBM slots (protocol: `ring/protocol.py`; streaming: `ring/stream.py`).

The hop loop and its sends are `ring/vmem_backward.py`'s (`ring.protocol.backward_hops`):
K/V travel as in the forward, the f32 dK / dV accumulators one hop behind
them.  Slots, accumulators and dq live in HBM; each hop t runs two passes that
recompute the probabilities from the saved lse, as a flash backward does:

    dQ pass (q tiles outer): copy q, dO, lse, delta of q tile i and its dq
        from HBM (hop 0 starts dq at 0), stream the hop's kv tiles, add
        dS K, write dq back;
    dK/dV pass (kv tiles outer): copy kv tile j of the hop's shard, stream
        the q-side tiles, sum dS^T Q and P^T dO in VMEM, write the tile's
        contribution (hop 0: straight into accumulator slot 0; later hops:
        into a local HBM sum).
    fold (after the hop's receives landed): add the local sum to the
        accumulator that arrived in slot t % 2, tile by tile, in VMEM: the
        two halves of the kv tile's own dK (dV) buffer hold half a tile of
        each (`fold_in_halves`), else two partner tiles hold a whole one.

Tiles and whole rows / columns that are EMPTY at a hop are skipped, copies
included (hop 0 still writes zeros where it is the first writer).  After hop
n the accumulators of this member's own shard are home and copied out.  q, K,
dq and dK are H wide; dO, V and dV Hv (v's head dim, MLA's): slots, tiles and
accumulators alike.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu.block.backward import _NN, _TN, _probs_and_dscores
from flax_ringattn._src.backends.pallas_tpu.ring import protocol as rp
from flax_ringattn._src.backends.pallas_tpu.ring import stream as st


def bwd_plan_hbm(d: rp.RingDims) -> c.CallPlan:
  G, T, S, H, Hv, bq, bk = d.G, d.T, d.S, d.H, d.Hv, d.bq, d.bk
  in_specs = [rp.HBM] * 6  # q, do, lse, delta, k, v
  in_dtypes = [d.dtype, d.dtype, c.F32, c.F32, d.dtype, d.dtype]
  outs = [((d.B, d.N, T, H), c.F32), ((d.B, d.K, S, H), c.F32), ((d.B, d.K, S, Hv), c.F32)]  # dq, dk, dv
  outs += [((2, S, H), d.dtype), ((2, S, Hv), d.dtype)]  # K / V slots
  F = len(d.fields)  # token fields: q columns and kv rows in HBM, kv slots of their own, tiles in VMEM
  in_specs += [rp.HBM] * (2 * F)
  in_dtypes += [jnp.int32] * (2 * F)
  outs += [((2, 1, S), jnp.int32)] * F
  drop_specs, drop_dtypes = c.dropout_specs(d.has_dropout)
  in_specs += drop_specs
  in_dtypes += drop_dtypes
  outs += [((2, S, H), c.F32), ((2, S, Hv), c.F32), ((S, H), c.F32), ((S, Hv), c.F32)]  # dk/dv slots, local sums
  scratch = [((2, G, bq, H), d.dtype), ((2, G, bq, Hv), d.dtype), ((2, G, bq, 1), c.F32), ((2, G, bq, 1), c.F32)]
  scratch += [((2, bq, 1), jnp.int32)] * F
  scratch += [((2, bk, H), d.dtype), ((2, bk, Hv), d.dtype)]
  scratch += [((2, 1, bk), jnp.int32)] * F
  scratch += [((G, bq, H), c.F32), ((bk, H), c.F32), ((bk, Hv), c.F32)]  # dq of a q tile; dk, dv of a kv tile
  if not fold_in_halves(d):
    scratch += [((bk, H), c.F32), ((bk, Hv), c.F32)]  # the fold's partners of the dk, dv tiles
  return c.CallPlan(
    grid=(d.B, d.K),
    in_specs=tuple(in_specs),
    in_dtypes=tuple(in_dtypes),
    out_specs=(rp.HBM,) * len(outs),
    out_shapes=tuple(jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in outs),
    scratch=tuple(scratch),
  )


def _kernel(meta_ref, kinds_ref, q_hbm, do_hbm, lse_hbm, delta_hbm, k_hbm, v_hbm, *refs, spec, d: rp.RingDims):
  F = len(d.fields)
  qtok_hbm, kvtok_hbm, refs = refs[:F], refs[F : 2 * F], refs[2 * F :]
  drop_ref, refs = c.split_dropout_ref(spec, refs)
  dq_hbm, dk_out, dv_out, k_slots, v_slots, *refs = refs
  tok_slots, refs = refs[:F], refs[F:]
  dk_slots, dv_slots, dk_loc, dv_loc, *refs = refs
  q_buf, do_buf, lse_buf, delta_buf, *refs = refs
  qtok_bufs, refs = refs[:F], refs[F:]
  k_buf, v_buf, *refs = refs
  kvtok_bufs, refs = refs[:F], refs[F:]
  dq_sc, dk_sc, dv_sc, *refs = refs
  partners = None if fold_in_halves(d) else (refs.pop(0), refs.pop(0))  # the fold's, for dk_sc and dv_sc
  io_sems, tile_sems, send_sems, recv_sems, credit = refs
  b, h = pl.program_id(0), pl.program_id(1)
  comms = rp.Comms(meta_ref, d, credit, name="ring_bwd")
  G, bq, bk, nq, nk = d.G, d.bq, d.bk, d.T // d.bq, d.S // d.bk
  heads = pl.ds(h * G, G)

  if d.n > 1:
    pl.when((b == 0) & (h == 0))(comms.barrier)
  own = [k_hbm.at[b, h], v_hbm.at[b, h], *(x.at[b] for x in kvtok_hbm)]
  slots = [k_slots, v_slots, *tok_slots]
  kv_bufs = [k_buf, v_buf, *kvtok_bufs]
  q_bufs = [q_buf, do_buf, lse_buf, delta_buf, *qtok_bufs]

  def src_of(t):
    return own if t == 0 else [s.at[t % 2] for s in slots]

  def q_side(i):
    rows = pl.ds(i * bq, bq)
    out = [q_hbm.at[b, heads, rows], do_hbm.at[b, heads, rows], lse_hbm.at[b, heads, rows]]
    out.append(delta_hbm.at[b, heads, rows])
    return out + [x.at[b, rows] for x in qtok_hbm]

  def tile_grads(t, i, j, qs, ks, masked):
    """(p, dS, dO) of tile pair (i, j) of hop t from the q-side buffers `qs` and the kv buffers `ks`."""
    toks = (qs[4:], ks[2:])  # the token columns and rows of `d.fields`
    return _probs_and_dscores(
      qs[0],
      ks[0],
      ks[1],
      qs[1],
      qs[2],
      qs[3],
      rp.tile_masks(d, comms, t, i, j, *toks) if masked else None,
      spec=spec,
      masked=masked,
      drop=rp.tile_dropout(spec, d, comms, t, i, j, drop_ref, b, h, *toks),
    )

  def dq_pass(t):
    src = src_of(t)

    def q_tile(i, _):
      rows = pl.ds(i * bq, bq)
      row_live = st.any_live(kinds_ref, d, t, row=i, count=nk)
      dq_tile = dq_hbm.at[b, heads, rows]
      if t == 0:
        dq_sc[...] = jnp.zeros(dq_sc.shape, c.F32)

      @pl.when(row_live)
      def _compute():
        qs = [buf.at[0] for buf in q_bufs]
        rp.sync_copies(list(zip(q_side(i), qs, strict=True)) + ([] if t == 0 else [(dq_tile, dq_sc)]), io_sems)

        def kv_tile(j, slot):
          ks = [buf.at[slot] for buf in kv_bufs]

          def update(masked):
            _, ds, _ = tile_grads(t, i, j, qs, ks, masked)
            k = ks[0][...]
            dq = jax.lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=c.F32, precision=spec.precision)
            dq_sc[...] = dq_sc[...] + dq.reshape(G, bq, d.H)

          c.by_tile_kind(rp.tile_kind(kinds_ref, d, t, i, j), update)

        st.stream(
          nk,
          lambda j: st.live_tile(kinds_ref, d, t, i, j),
          lambda j: st.kv_tiles(src, j, bk),
          kv_bufs,
          tile_sems,
          kv_tile,
        )
        if t > 0:
          rp.sync_copies([(dq_sc, dq_tile)], io_sems)

      if t == 0:  # the first writer of every dq row
        rp.sync_copies([(dq_sc, dq_tile)], io_sems)

    jax.lax.fori_loop(0, nq, q_tile, None)

  def dkv_pass(t):
    src = src_of(t)
    dk_dst, dv_dst = (dk_slots.at[0], dv_slots.at[0]) if t == 0 else (dk_loc, dv_loc)

    def kv_tile(j, _):
      cols = pl.ds(j * bk, bk)
      col_live = st.any_live(kinds_ref, d, t, col=j, count=nq)
      dk_sc[...] = jnp.zeros(dk_sc.shape, c.F32)
      dv_sc[...] = jnp.zeros(dv_sc.shape, c.F32)

      @pl.when(col_live)
      def _compute():
        ks = [buf.at[0] for buf in kv_bufs]
        rp.sync_copies(list(zip(st.kv_tiles(src, j, bk), ks, strict=True)), io_sems)

        def q_tile(i, slot):
          qs = [buf.at[slot] for buf in q_bufs]

          def update(masked):
            p, ds, do = tile_grads(t, i, j, qs, ks, masked)
            q = qs[0][...].reshape(G * bq, d.H)
            dv_sc[...] = dv_sc[...] + jax.lax.dot_general(
              p.astype(do.dtype), do, _TN, preferred_element_type=c.F32, precision=spec.precision
            )
            dk_sc[...] = dk_sc[...] + jax.lax.dot_general(
              ds.astype(q.dtype), q, _TN, preferred_element_type=c.F32, precision=spec.precision
            )

          c.by_tile_kind(rp.tile_kind(kinds_ref, d, t, i, j), update)

        st.stream(nq, lambda i: st.live_tile(kinds_ref, d, t, i, j), q_side, q_bufs, tile_sems, q_tile)

      stores = [(dk_sc, dk_dst.at[cols]), (dv_sc, dv_dst.at[cols])]
      if t == 0:  # slot 0 is the accumulator itself: every tile is written, zeros where nothing is visible
        rp.sync_copies(stores, io_sems)
      else:
        rp.when(col_live, lambda: rp.sync_copies(stores, io_sems))

    jax.lax.fori_loop(0, nk, kv_tile, None)

  def compute(t):
    dq_pass(t)
    dkv_pass(t)

  def fold(t):
    if t == 0 or t >= d.live:
      return
    slot = t % 2
    if partners is None:  # (row offset, rows, the arriving accumulator's buffer, the local sum's) per add
      half = bk // 2
      parts = [[(off, half, x.at[:half], x.at[half:]) for off in (0, half)] for x in (dk_sc, dv_sc)]
    else:
      parts = [[(0, bk, x, y)] for x, y in zip((dk_sc, dv_sc), partners, strict=True)]

    def kv_tile(j, _):
      @pl.when(st.any_live(kinds_ref, d, t, col=j, count=nq))
      def _add():
        for acc, loc, adds in ((dk_slots, dk_loc, parts[0]), (dv_slots, dv_loc, parts[1])):
          for off, size, x, y in adds:
            rows = pl.ds(j * bk + off, size)
            rp.sync_copies([(acc.at[slot, rows], x), (loc.at[rows], y)], io_sems)
            x[...] = x[...] + y[...]
            rp.sync_copies([(x, acc.at[slot, rows])], io_sems)

    jax.lax.fori_loop(0, nk, kv_tile, None)

  kv_pairs = lambda t: [(a, s.at[(t + 1) % 2]) for a, s in zip(src_of(t), slots, strict=True)]  # noqa: E731
  home = rp.backward_hops(comms, d, kv_pairs, (dk_slots, dv_slots), send_sems, recv_sems, compute=compute, fold=fold)
  rp.sync_copies([(dk_slots.at[home], dk_out.at[b, h]), (dv_slots.at[home], dv_out.at[b, h])], io_sems)


def fold_in_halves(d: rp.RingDims) -> bool:
  """Whether the fold adds a kv tile's accumulator half a tile at a time inside the tile's own dK (dV) buffer,
  needing no other VMEM: when the halves are whole f32 sublane tiles (8 rows), as every kv tile of 128-lane
  multiples is; else (a whole short shard as the kv tile) it adds whole tiles with two partner buffers."""
  return d.bk % 16 == 0


def sems(d: rp.RingDims):
  """Synchronous-copy sems, streamed-tile sems [2, arrays], send and receive sems (K/V, then dK / dV), credit."""
  num_kv = 2 + len(d.fields)  # K, V and the token rows
  num_q = 4 + len(d.fields)  # q, dO, lse, delta and the token columns
  return [
    pltpu.SemaphoreType.DMA((st.io_sems(d),)),
    pltpu.SemaphoreType.DMA((2, max(num_q, num_kv))),
    pltpu.SemaphoreType.DMA((num_kv + 2,)),
    pltpu.SemaphoreType.DMA((num_kv + 2,)),
    pltpu.SemaphoreType.REGULAR,
  ]


def ring_bwd_hbm(d: rp.RingDims, spec, meta, kinds, args, *, interpret):
  """(dq [B, N, T, H], dk [B, K, S, H], dv [B, K, S, Hv]) f32 heads-major; `args` as `vmem_backward.ring_bwd`
  builds them."""
  kernel = functools.partial(_kernel, spec=spec, d=d)
  dq, dk, dv, *_ = rp.ring_call(kernel, bwd_plan_hbm(d), sems(d), d, interpret=interpret, name="ring_bwd")(
    meta, kinds, *args
  )
  return dq, dk, dv

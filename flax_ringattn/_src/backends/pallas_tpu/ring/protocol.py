"""The in-kernel ring (`implementation="pallas_tpu_ring"`): protocol and launch (host-side tables: `tables.py`).

One `pallas_call` per layer call does every hop.  Grid (B, K), both axes
"arbitrary" (every device runs the grid steps in the same order); a grid step
owns the G = N / K q heads of one kv head for one batch row and runs the whole
ring for them.  Its K/V travel in two slots per array (`slot = hop % 2`;
K's slots H wide, V's Hv: v's head dim, which differs under MLA);
every shard but the own one arrives from the upstream neighbour by
`pltpu.make_async_remote_copy`, and no device ever reads a neighbour's HBM.

Where the slots live (`RingDims.slots`, chosen by `planner.plan_ring`):
"vmem" when the whole q shard, the state and both slots fit VMEM
(`vmem_forward.py`, `vmem_backward.py`; the own shard is copied into slot 0);
else "hbm" (`hbm_forward.py`, `hbm_backward.py`): slots, state and
accumulators in HBM, tiles streamed through VMEM (`stream.py`), the own
shard read and sent straight from the input.  Both kinds run the same hop
loops (`start_kv_sends`, `backward_hops`), so the schedule below is theirs.

Hop schedule of ring member r in a ring of n (data flows r -> r + 1, members
on a snake through the device grid, `layout.snake_coords`):

    grid step (0, 0) only: barrier with both neighbours (no DMA or remote
              signal may target a device that has not entered the kernel).
    hop t   : prologue: signal one credit to r - 1 ("my slot (t + 1) % 2 is
              free": its last reader, hop t - 1's compute and send, is done;
              at hop 0 the previous grid step is done), then wait for the
              credit of r + 1 and start the sends of this hop (forward: a
              member releases only where r - 1 sends this hop and acquires
              only where it sends, by `kv_send_table`; backward: every hop,
              for the accumulators).  Each DMA
              descriptor is built once and the same object is started and
              waited on.
              compute the hop on slot t % 2 (tiles the mask table marks EMPTY
              cost no matmul).
              epilogue: wait for the sends (our slot may be overwritten from
              the next prologue on) and the receives (the next hop reads them).
    forward : hop t sends K/V (and the kv side's token rows: positions given
              per row, segment ids, bidirectional ids; `RingDims.fields`) of
              slot t % 2 to r + 1's slot (t + 1) % 2 for t < n - 1: each byte
              moves n - 1 times.
              When the hops from some h on are EMPTY for every member by
              position (`live_hops`: a causal sliding window on the
              contiguous layout), the ring ends at hop h - 1: h - 1 sends.
              (Both tables read the layout's positions only: with
              bidirectional ids or positions given per row, which are data,
              every hop and every send runs; the tile table, computed from
              the data, still skips the EMPTY tiles.)
              A send whose shard no member downstream sees on a later hop
              is skipped (`kv_send_table`: on the causal contiguous layout,
              every shard past the wrap, half the sends); the credit of that
              hop is then neither released by the receiver nor awaited by
              the sender, the receiver does not wait for the data, and its
              next hop, EMPTY for it by the same table, never reads the
              stale slot.
    backward: hops 0 .. n; K/V move as in the forward (stop as early, skip the
              same sends; the credits run every hop for the accumulators).  The dK/dV
              accumulator of shard src = r - t is finished on r at the end of
              hop t (the contribution of r added to what arrived from r - 1)
              and sent to r + 1 during hop t + 1, overlapping its compute;
              hop n only sends, bringing every accumulator home: n sends.

The credit is released at the start of the hop that no longer needs the slot,
never at the end of the previous one (a compiler may hoist a late signal above
that hop's loads).  Every credit signalled is waited for, every DMA started is
waited for: all semaphores are zero when a grid step ends.  A ring of 1 runs no
communication; in a ring of 2 both neighbours are the same device.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src import layout, masks, vma
from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu import planners as planner
from flax_ringattn._src.backends.pallas_tpu.ring.tables import (  # noqa: F401  (the kernels read these as rp.*)
  RingDims,
  pack_kinds,
  ring_dims,
  ring_tables,
  tile_kind,
)

# The one allocator of barrier-semaphore collective ids of this package's kernels.
COLLECTIVE_IDS = {"ring_fwd": 0, "ring_bwd": 1}


def _recorder(d: RingDims):
  return d.debug.recorder if d.debug is not None else None


def note(d: RingDims, name: str, event: str, detail=None):
  """Appends a protocol event to the call's `debug.Recorder`, if it has one (tests only)."""
  rec = _recorder(d)
  if rec is not None:
    rec.events.append((name, event, detail))


class Comms:
  """Neighbours, barrier, credits and remote copies of one kernel (see the module docstring)."""

  def __init__(self, meta_ref, d: RingDims, credit_sem, *, name: str):
    self.meta_ref, self.d, self.credit, self.name = meta_ref, d, credit_sem, name
    k = len(d.axes)
    self._up = 1 + d.n
    self._down = 1 + d.n + k
    self._flags = 1 + d.n + 2 * k

  def _device(self, offset):
    return {a: self.meta_ref[offset + i] for i, a in enumerate(self.d.axes)}

  def src_shard(self, t):
    return self.meta_ref[1 + t]

  def own_shard(self):
    return self.meta_ref[0]

  def sends_kv(self, t):
    """Whether this member sends its K/V at hop t: a traced bool, or None when every member always does."""
    return self.meta_ref[self._flags + t] != 0 if self.d.kv_sends else None

  def receives_kv(self, t):
    """Whether the upstream neighbour sends its K/V into our slot at hop t (None: always)."""
    return self.meta_ref[self._flags + self.d.live - 1 + t] != 0 if self.d.kv_sends else None

  def barrier(self):
    sem = pltpu.get_barrier_semaphore()
    for offset in (self._up, self._down):
      pl.semaphore_signal(sem, 1, device_id=self._device(offset), device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(sem, 2)

  def release_credit(self):
    """Tells r - 1 that it may overwrite our next slot."""
    note(self.d, self.name, "release")
    pl.semaphore_signal(self.credit, 1, device_id=self._device(self._up), device_id_type=pl.DeviceIdType.MESH)

  def acquire_credit(self):
    note(self.d, self.name, "acquire")
    pl.semaphore_wait(self.credit, 1)

  def copy_down(self, src, dst, send_sem, recv_sem, *, kv_hop=None):
    """A descriptor for src (ours) -> dst (r + 1's buffer of the same name); start and wait this object.

    `kv_hop=t` marks hop t's K/V (or kv token rows) send, which members skip
    where `d.kv_sends` says nobody downstream reads it (and then the matching
    receive is not waited for either); other sends always run.
    """
    desc = pltpu.make_async_remote_copy(
      src, dst, send_sem, recv_sem, device_id=self._device(self._down), device_id_type=pl.DeviceIdType.MESH
    )
    if kv_hop is None or not self.d.kv_sends:
      return _Send(self.d, desc, src, self.name, None, None, self.d.n)
    members = sum(row[kv_hop] for row in self.d.kv_sends)
    return _Send(self.d, desc, src, self.name, self.sends_kv(kv_hop), self.receives_kv(kv_hop), members)


class _Send:
  """One remote copy: `send` / `recv` (traced bools, or None for always) say whether this member starts it and
  whether its upstream neighbour starts the matching copy into our buffer this hop."""

  def __init__(self, d, desc, src, name, send, recv, members):
    self.d, self.desc, self.src, self.name = d, desc, src, name
    self.send, self.recv, self.members = send, recv, members

  def start(self):
    rec = _recorder(self.d)
    if rec is not None:
      size = 1
      for s in self.src.shape:
        size *= s
      rec.dmas.append((self.name, size * jnp.dtype(self.src.dtype).itemsize, self.members))
    note(self.d, self.name, "start", id(self.desc))
    when(self.send, self.desc.start)

  def wait(self):
    note(self.d, self.name, "wait", id(self.desc))
    when(self.send, self.desc.wait_send)
    when(self.recv, self.desc.wait_recv)


def when(flag, fn):
  """fn() if flag (a traced bool), always when flag is None."""
  if flag is None:
    fn()
  else:
    pl.when(flag)(fn)


def sync_copies(pairs, sems):
  """Local copies (src, dst) with DMAs: start all, then wait for all (the i-th on sems.at[i])."""
  copies = [pltpu.make_async_copy(src, dst, sems.at[i]) for i, (src, dst) in enumerate(pairs)]
  for cp in copies:
    cp.start()
  for cp in copies:
    cp.wait()


def pair_positions(d: RingDims, comms, t, i, j):
  """The layout's global positions of tile pair (i, j) of hop t: the q tile's (bq, 1) column and the kv tile's
  (1, bk) row."""
  qp = tile_positions(d, comms.own_shard(), i * d.bq, d.bq, rows=True)
  kp = tile_positions(d, comms.src_shard(t), j * d.bk, d.bk, rows=False)
  return qp, kp


def token_operands(d: RingDims, q_tok: masks.Tokens, kv_tok: masks.Tokens):
  """The kernels' token operands (int32): the q column [B, T, 1] of each field of `d.fields`, then the kv row
  [B, 1, S] of each (which travels with K/V)."""
  q = [getattr(q_tok, name).astype(jnp.int32)[:, :, None] for name in d.fields]
  return q + [getattr(kv_tok, name).astype(jnp.int32)[:, None, :] for name in d.fields]


def tile_tokens(d: RingDims, comms, t, i, j, q_cols=(), kv_rows=()):
  """(q, kv) `masks.Tokens` of tile pair (i, j) of hop t, from the tile's token operands: `q_cols` the (bq, 1)
  columns and `kv_rows` the (1, bk) rows of `d.fields`, refs or values.  Positions not given per row are the
  layout's."""
  q, kv = dict(zip(d.fields, q_cols, strict=True)), dict(zip(d.fields, kv_rows, strict=True))
  if "pos" not in q:
    q["pos"], kv["pos"] = pair_positions(d, comms, t, i, j)
  return masks.Tokens(**q), masks.Tokens(**kv)


def tile_masks(d: RingDims, comms, t, i, j, q_cols=(), kv_rows=()):
  """The mask operands of tile pair (i, j) of hop t in the order the block kernels' tile step reads them
  (`common.mask_tokens`): position column and row, then the column and row of each id field the mask has."""
  q, kv = tile_tokens(d, comms, t, i, j, q_cols, kv_rows)
  names = [f.name for f in dataclasses.fields(masks.Tokens)]  # the order of `masks.Tokens`
  return [x for name in names if getattr(q, name) is not None for x in (getattr(q, name), getattr(kv, name))]


def tile_dropout(spec, d: RingDims, comms, t, i, j, drop_ref, b, h, q_cols=(), kv_rows=()):
  """The dropout scale of tile pair (i, j) of hop t (None without dropout), hashed from the tokens' global
  positions as the mask's (the caller's when given per row)."""
  if drop_ref is None:
    return None
  q, kv = tile_tokens(d, comms, t, i, j, q_cols, kv_rows)
  return c.dropout_scale(spec, drop_ref, b, h, d.G, q.pos[...], kv.pos[...])  # (`[...]` loads a ref, keeps a value)


def start_kv_sends(comms, d: RingDims, t: int, pairs, send_sems, recv_sems):
  """Prologue of forward hop t: the credit exchange and the K/V sends (src, dst) of that hop, started.

  Credits only where K/V move this hop (`d.kv_sends`): a member frees its
  slot for the upstream neighbour if that one sends, and waits for the
  downstream neighbour's slot if it sends itself.  Returns the sends to wait
  on at the end of the hop (none on the ring's last hop).
  """
  if t >= d.live - 1:
    return []
  if d.debug is None or not d.debug.drop_credits:  # (a test's injected protocol bug drops them)
    when(comms.receives_kv(t), comms.release_credit)
    when(comms.sends_kv(t), comms.acquire_credit)
  sends = [comms.copy_down(src, dst, send_sems.at[a], recv_sems.at[a], kv_hop=t) for a, (src, dst) in enumerate(pairs)]
  for s in sends:
    s.start()
  return sends


def backward_hops(comms, d: RingDims, kv_pairs, acc_slots, send_sems, recv_sems, *, compute, fold):
  """The backward kernels' hop loop (module docstring): hops 0 .. n, credits every hop.

  kv_pairs(t): the (src, dst) K/V sends of hop t; acc_slots: the dK / dV
  accumulator slots, sent one hop behind the K/V; compute(t) runs hop t's
  tiles (t < live); fold(t) runs after the hop's sends and receives landed
  (adds the hop's contribution to the accumulator that arrived).  Returns the
  slot index that holds this member's own accumulators at the end.
  """
  n = d.n
  num_kv = len(kv_pairs(0))
  last = n if n > 1 else 0  # hop n only sends the accumulators home
  for t in range(last + 1):
    note(d, comms.name, "hop", t)
    slot = t % 2
    kv_sends, acc_sends = [], []
    if n > 1:
      comms.release_credit()
      comms.acquire_credit()
      if t < d.live - 1:
        kv_sends = [
          comms.copy_down(src, dst, send_sems.at[a], recv_sems.at[a], kv_hop=t)
          for a, (src, dst) in enumerate(kv_pairs(t))
        ]
      if t >= 1:
        acc_sends = [
          comms.copy_down(s.at[1 - slot], s.at[slot], send_sems.at[num_kv + a], recv_sems.at[num_kv + a])
          for a, s in enumerate(acc_slots)
        ]
      for s in kv_sends + acc_sends:
        s.start()
    if t < d.live:  # later hops only pass the accumulators on
      note(d, comms.name, "compute", t)
      compute(t)
    for s in kv_sends + acc_sends:
      s.wait()
    fold(t)
  return last % 2


def tile_positions(d: RingDims, shard, start, size, *, rows: bool):
  """Global positions of `size` tokens from local index `start` of `shard`: a (size, 1) column or a (1, size) row."""
  shape, dim = ((size, 1), 0) if rows else ((1, size), 1)
  idx = start + jax.lax.broadcasted_iota(jnp.int32, shape, dim)
  length = d.T if rows else d.S
  return layout.token_positions(shard, d.n, length, d.load_balance, idx)


def sem_scratch(d: RingDims, num_arrays: int):
  """Local-load DMA sems, send and receive DMA sems (one per travelling array), the credit semaphore."""
  return [
    pltpu.SemaphoreType.DMA((num_arrays,)),
    pltpu.SemaphoreType.DMA((num_arrays,)),
    pltpu.SemaphoreType.DMA((num_arrays,)),
    pltpu.SemaphoreType.REGULAR,
  ]


def ring_call(kernel, plan: c.CallPlan, sems, d: RingDims, *, interpret, name: str):
  """`pl.pallas_call` of a ring kernel from its plan (VMEM buffers) plus its semaphores."""
  kwargs = dict(dimension_semantics=("arbitrary",) * len(plan.grid))
  if d.n > 1:
    kwargs["collective_id"] = COLLECTIVE_IDS[name]
  if interpret is None:
    kwargs["vmem_limit_bytes"] = planner.vmem_limit_bytes(planner.current_generation())
  params = pltpu.CompilerParams(**kwargs)

  def run(*args):
    note(d, name, "slots", d.slots)
    args = vma.unify(*args)
    mat = vma.manual_axis_type(args[0])
    out_shapes = [jax.ShapeDtypeStruct(o.shape, o.dtype, manual_axis_type=mat) for o in plan.out_shapes]
    return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=plan.grid,
        in_specs=list(plan.in_specs),
        out_specs=list(plan.out_specs),
        scratch_shapes=[pltpu.VMEM(shape, dtype) for shape, dtype in plan.scratch] + list(sems),
      ),
      out_shape=out_shapes,
      compiler_params=params,
      interpret=interpret,
      name=name,
    )(*args)

  return run


HBM = pl.BlockSpec(memory_space=pl.ANY)

"""The in-kernel ring (`implementation="pallas_tpu_ring"`): protocol, tables and launch.

One `pallas_call` per layer call does every hop.  Grid (B, K), both axes
"arbitrary" (every device runs the grid steps in the same order); a grid step
owns the G = N / K q heads of one kv head for one batch row and runs the whole
ring for them.  Its K/V travel in two slots per array (`slot = hop % 2`);
every shard but the own one arrives from the upstream neighbour by
`pltpu.make_async_remote_copy`, and no device ever reads a neighbour's HBM.

Where the slots live (`RingDims.slots`, chosen by `planner.plan_ring`):
"vmem" when the whole q shard, the state and both slots fit VMEM
(`ring_forward.py`, `ring_backward.py`; the own shard is copied into slot 0);
else "hbm" (`ring_forward_hbm.py`, `ring_backward_hbm.py`): slots, state and
accumulators in HBM, tiles streamed through VMEM (`ring_stream.py`), the own
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
    forward : hop t sends K/V (and the kv segment ids) of slot t % 2 to r + 1's
              slot (t + 1) % 2 for t < n - 1: each byte moves n - 1 times.
              When the hops from some h on are EMPTY for every member by
              position (`live_hops`: a causal sliding window on the
              contiguous layout), the ring ends at hop h - 1: h - 1 sends.
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
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src import layout, masks, vma
from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu import planner

# The one allocator of barrier-semaphore collective ids of this package's kernels.
COLLECTIVE_IDS = {"ring_fwd": 0, "ring_bwd": 1}

# Test hook: when a list, every remote DMA the kernels start is appended as (kernel name, bytes, how many ring
# members start it) at trace time; each runs once per grid step.
DMA_LOG = None
# Test hook: when a list, the protocol's events are appended in program order at trace time, as (kernel name,
# event, detail): ("slots", "vmem" or "hbm") when a kernel is launched, then ("hop", t), ("compute", t),
# ("release", None), ("acquire", None), ("start", descriptor id), ("wait", descriptor id).  The hops are
# unrolled in Python, so trace order is program order.
EVENTS = None
# Test hook: "vmem" or "hbm" overrides the planner's choice of where the communication slots live
# (`planner.plan_ring`), so small test shapes can run the HBM-slot kernels.
FORCE_SLOTS = None


def note(name: str, event: str, detail=None):
  if EVENTS is not None:
    EVENTS.append((name, event, detail))


@dataclasses.dataclass(frozen=True)
class RingDims:
  """Static shape of one ring call (per device)."""

  axes: tuple  # the ring's mesh axes; () for a ring of one
  sizes: tuple  # their sizes
  n: int
  load_balance: bool
  B: int
  T: int
  S: int
  N: int
  K: int
  H: int
  dtype: object
  bq: int
  bk: int
  has_segments: bool
  live: int  # the ring's hops: 0 .. live - 1 hold visible keys for some member (`live_hops`), live <= n
  has_dropout: bool = False
  # kv_sends[r][t]: whether ring member r sends its K/V at hop t (t < live - 1): some member downstream sees
  # that shard on a later hop (`kv_send_table`).  () when every member sends on every hop.
  kv_sends: tuple = ()
  # Where the communication slots and the softmax state live: "vmem" (whole shards resident, `ring_forward.py`)
  # or "hbm" (tiles streamed through VMEM, `ring_forward_hbm.py`), by `planner.plan_ring`.
  slots: str = "vmem"

  @property
  def G(self) -> int:
    return self.N // self.K


def ring_dims(spec, q, k, axis_name, load_balance, *, has_segments: bool, backward: bool) -> RingDims:
  B, T, N, H = q.shape
  S, K = k.shape[1], k.shape[2]
  axes = layout.ring_axes(axis_name)
  sizes = tuple(jax.lax.axis_size(a) for a in axes)
  n = 1
  for s in sizes:
    n *= s
  plan_args = dict(
    T=T,
    S=S,
    n=n,
    num_heads=N,
    num_kv_heads=K,
    head_dim=H,
    dtype=q.dtype,
    backward=backward,
    has_segments=has_segments,
    soft_cap=spec.logits_soft_cap is not None,
    dropout=bool(spec.dropout_rate),
  )
  if spec.block_sizes is None:  # the ring's own plan: slots and tiles, the tile table within SMEM
    plan = planner.plan_ring(**plan_args)
  else:  # the caller's tiles (checked as the block kernels check them); only the slots are chosen
    plan = planner.plan_ring(**plan_args, tiles=c.block_tiles(spec, q, k, backward=backward))
  bq, bk = plan.bq, plan.bk
  table = planner.ring_table_bytes(n, T // bq, S // bk)
  if table > c.SMEM_TABLE_BYTES:
    raise ValueError(
      f"pallas_tpu_ring: the tile table of {n} hops x {T // bq} x {S // bk} tiles needs {table} bytes of SMEM, "
      f"more than {c.SMEM_TABLE_BYTES}; use larger tiles (or block_sizes=None: the ring's planner keeps it within)"
    )
  slots = FORCE_SLOTS or plan.slots
  vis = visibility(spec.mask, n, sizes, T, S, bq, bk, load_balance)
  live = live_hops(vis)
  sends = kv_send_table(vis, live)
  return RingDims(
    axes=axes,
    sizes=sizes,
    n=n,
    load_balance=load_balance,
    B=B,
    T=T,
    S=S,
    N=N,
    K=K,
    H=H,
    dtype=jnp.dtype(q.dtype),
    bq=bq,
    bk=bk,
    has_segments=has_segments,
    has_dropout=bool(spec.dropout_rate),
    live=live,
    kv_sends=() if sends.all() else tuple(tuple(bool(x) for x in row) for row in sends),
    slots=slots,
  )


def visibility(mask: masks.MaskSpec, n: int, sizes, T: int, S: int, bq: int, bk: int, load_balance: bool):
  """bool [n, n]: vis[m, s] when ring member m's q shard sees some key of ring member s's kv shard.

  Decided at trace time, in numpy, by `masks.tile_kinds` on the static
  positions of the members' shards.  Segment ids are data, so they are left
  out: a pair marked invisible is EMPTY whatever the ids, and everything built
  on this table (`live_hops`, `kv_send_table`) is conservative.
  """
  pos_only = dataclasses.replace(mask, has_segments=False)

  def positions(member, length):  # numpy: no JAX op runs here, whatever mesh context the trace is in
    return layout.token_positions(int(layout.ring_shard(member, sizes)), n, length, load_balance, np.arange(length))

  q_pos = [positions(m, T) for m in range(n)]
  kv_pos = [positions(m, S) for m in range(n)]
  return np.array(
    [
      [(masks.tile_kinds(pos_only, q_pos[m], kv_pos[s], None, None, bq, bk) != masks.EMPTY).any() for s in range(n)]
      for m in range(n)
    ]
  )


def live_hops(vis) -> int:
  """1 + the last hop on which some ring member holds a kv shard it sees (member m holds m - t's at hop t).

  Beyond it every hop is EMPTY on every member, so the ring stops there: no
  later hop is computed, and K/V are not sent past it.  A causal sliding
  window on the contiguous layout needs about window / shard length + 1 hops;
  causal zigzag needs all n.
  """
  n = len(vis)
  return 1 + max((t for t in range(n) if any(vis[m, (m - t) % n] for m in range(n))), default=0)


def kv_send_table(vis, live: int):
  """bool [n, live - 1]: member r sends at hop t when a member downstream sees that shard on a later hop.

  The shard r holds at hop t (member r - t's) reaches member r + u at hop
  t + u.  If none of them sees it before the ring ends, the send (and every
  later send of that shard) only moves data nobody reads: on the causal
  contiguous layout, every shard past the wrap from the last member to the
  first, half of all sends.  The receiver's slot then keeps stale data, and
  its hop t + 1 is EMPTY for it by the same table.
  """
  n = len(vis)
  table = np.zeros((n, max(live - 1, 0)), bool)
  for r in range(n):
    for t in range(live - 1):
      src = (r - t) % n
      table[r, t] = any(vis[(r + u) % n, src] for u in range(1, live - t))
  return table


def ring_tables(spec, d: RingDims, q_seg, kv_seg):
  """Scalar-prefetched tables, computed in XLA before the launch.

  meta int32: [own shard, src shard of hops 0 .. n-1, upstream coords..., downstream coords..., then with
  `d.kv_sends`: whether this member sends its K/V at hops 0 .. live-2, whether its upstream neighbour does].
  kinds: `masks.classify` of every tile pair of every hop, packed by `pack_kinds` (read with `tile_kind`; the
  segment-id extents of the other shards come from a small all_gather of per-tile min / max).
  """
  n, sizes, shard, member = layout.ring_geometry(d.axes or None)
  srcs = [layout.ring_shard((member - t) % n, sizes) for t in range(n)]
  up = layout.snake_coords((member - 1) % n, sizes)
  down = layout.snake_coords((member + 1) % n, sizes)
  flags = []
  if d.kv_sends:
    table = jnp.asarray(np.asarray(d.kv_sends, np.int32))
    flags = [*table[member], *table[(member - 1) % n]]
  meta = jnp.stack([jnp.asarray(x, jnp.int32) for x in (shard, *srcs, *up, *down, *flags)])
  q_pos = layout.shard_positions(shard, n, d.T, d.load_balance)
  qe = masks.tile_extent(q_pos, q_seg, d.bq)
  seg_min = seg_max = None
  if kv_seg is not None:
    ke = masks.tile_extent(jnp.zeros((d.S,), jnp.int32), kv_seg, d.bk)
    seg_min, seg_max = ke.seg_min, ke.seg_max  # [B, S / bk]
    if d.axes:
      seg_min = jax.lax.all_gather(seg_min, d.axes)  # [n, B, S / bk], by shard index
      seg_max = jax.lax.all_gather(seg_max, d.axes)
    else:
      seg_min, seg_max = seg_min[None], seg_max[None]
  col = lambda a: None if a is None else a[..., :, None]  # noqa: E731
  row = lambda a: None if a is None else a[..., None, :]  # noqa: E731
  kinds = []
  for src in srcs:
    kp = layout.shard_positions(src, n, d.S, d.load_balance).reshape(-1, d.bk)
    smin = None if seg_min is None else seg_min[src]
    smax = None if seg_max is None else seg_max[src]
    kinds.append(
      masks.classify(
        spec.mask,
        masks.Extent(col(qe.pos_min), col(qe.pos_max), col(qe.seg_min), col(qe.seg_max)),
        masks.Extent(row(kp.min(axis=1)), row(kp.max(axis=1)), row(smin), row(smax)),
      )
    )
  return meta, pack_kinds(jnp.stack(kinds).astype(jnp.int32))


def pack_kinds(kinds):
  """int32 [n, T/bq, S/bk] tile classes -> the 1-D SMEM table of `tile_kind`: each row's classes 2 bits each,
  16 to a word (`planner.RING_KINDS_PER_WORD`), padded with EMPTY.  A 1-D table has no SMEM tile padding."""
  per = planner.RING_KINDS_PER_WORD
  n, nq, nk = kinds.shape
  words = -(-nk // per)
  kinds = jnp.pad(kinds, ((0, 0), (0, 0), (0, words * per - nk))).reshape(n, nq, words, per)
  shifts = 2 * jnp.arange(per, dtype=jnp.int32)
  return jnp.sum(jnp.left_shift(kinds, shifts), axis=-1, dtype=jnp.int32).reshape(-1)


def tile_kind(kinds_ref, d: RingDims, t, i, j):
  """The class (`masks.EMPTY` / `PARTIAL` / `FULL`) of tile pair (i, j) of hop t, from the packed table."""
  per = planner.RING_KINDS_PER_WORD
  words = -(-(d.S // d.bk) // per)
  # j // per and j % per as a shift and a mask (per is a power of two; Mosaic lowers a traced `//` through
  # sign(), which needs the TPU's info; j >= 0 anyway).
  word = kinds_ref[(t * (d.T // d.bq) + i) * words + jax.lax.shift_right_logical(j, per.bit_length() - 1)]
  return jax.lax.shift_right_logical(word, 2 * (j & (per - 1))) & 3


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
    note(self.name, "release")
    pl.semaphore_signal(self.credit, 1, device_id=self._device(self._up), device_id_type=pl.DeviceIdType.MESH)

  def acquire_credit(self):
    note(self.name, "acquire")
    pl.semaphore_wait(self.credit, 1)

  def copy_down(self, src, dst, send_sem, recv_sem, *, kv_hop=None):
    """A descriptor for src (ours) -> dst (r + 1's buffer of the same name); start and wait this object.

    `kv_hop=t` marks hop t's K/V (or kv segment ids) send, which members skip
    where `d.kv_sends` says nobody downstream reads it (and then the matching
    receive is not waited for either); other sends always run.
    """
    desc = pltpu.make_async_remote_copy(
      src, dst, send_sem, recv_sem, device_id=self._device(self._down), device_id_type=pl.DeviceIdType.MESH
    )
    if kv_hop is None or not self.d.kv_sends:
      return _Send(desc, src, self.name, None, None, self.d.n)
    members = sum(row[kv_hop] for row in self.d.kv_sends)
    return _Send(desc, src, self.name, self.sends_kv(kv_hop), self.receives_kv(kv_hop), members)


class _Send:
  """One remote copy: `send` / `recv` (traced bools, or None for always) say whether this member starts it and
  whether its upstream neighbour starts the matching copy into our buffer this hop."""

  def __init__(self, desc, src, name, send, recv, members):
    self.desc, self.src, self.name = desc, src, name
    self.send, self.recv, self.members = send, recv, members

  def start(self):
    if DMA_LOG is not None:
      shape = self.src.shape
      size = 1
      for s in shape:
        size *= s
      DMA_LOG.append((self.name, size * jnp.dtype(self.src.dtype).itemsize, self.members))
    note(self.name, "start", id(self.desc))
    when(self.send, self.desc.start)

  def wait(self):
    note(self.name, "wait", id(self.desc))
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
  """Global positions of tile pair (i, j) of hop t: the q tile's (bq, 1) column and the kv tile's (1, bk) row."""
  qp = tile_positions(d, comms.own_shard(), i * d.bq, d.bq, rows=True)
  kp = tile_positions(d, comms.src_shard(t), j * d.bk, d.bk, rows=False)
  return qp, kp


def tile_masks(d: RingDims, comms, t, i, j, qseg=None, kvseg=None):
  """The mask operands of tile pair (i, j) of hop t: position column / row, then (with segment ids) the tile's
  q segment-id column (bq, 1) and kv segment-id row (1, bk), refs or values."""
  qp, kp = pair_positions(d, comms, t, i, j)
  return [qp, kp] if qseg is None else [qp, kp, qseg, kvseg]


def tile_dropout(spec, d: RingDims, comms, t, i, j, drop_ref, b, h):
  """The dropout scale of tile pair (i, j) of hop t (None without dropout): global positions, as the mask's."""
  if drop_ref is None:
    return None
  return c.dropout_scale(spec, drop_ref, b, h, d.G, *pair_positions(d, comms, t, i, j))


def start_kv_sends(comms, d: RingDims, t: int, pairs, send_sems, recv_sems, *, credits=True):
  """Prologue of forward hop t: the credit exchange and the K/V sends (src, dst) of that hop, started.

  Credits only where K/V move this hop (`d.kv_sends`): a member frees its
  slot for the upstream neighbour if that one sends, and waits for the
  downstream neighbour's slot if it sends itself.  Returns the sends to wait
  on at the end of the hop (none on the ring's last hop).
  """
  if t >= d.live - 1:
    return []
  if credits:
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
    note(comms.name, "hop", t)
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
      note(comms.name, "compute", t)
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
    note(name, "slots", d.slots)
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

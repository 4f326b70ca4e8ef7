"""The in-kernel ring (`implementation="pallas_tpu_ring"`): protocol, tables and launch.

One `pallas_call` per layer call does every hop.  Grid (B, K), both axes
"arbitrary" (every device runs the grid steps in the same order); a grid step
owns the G = N / K q heads of one kv head for one batch row and runs the whole
ring for them.  Its K/V travel in two VMEM slots per array (`slot = hop % 2`);
the own shard is copied from HBM into slot 0, every other shard arrives from
the upstream neighbour by `pltpu.make_async_remote_copy`, and no device ever
reads a neighbour's HBM.

Hop schedule of ring member r in a ring of n (data flows r -> r + 1, members
on a snake through the device grid, `layout.snake_coords`):

    grid step (0, 0) only: barrier with both neighbours (no DMA or remote
              signal may target a device that has not entered the kernel).
    hop t   : prologue: signal one credit to r - 1 ("my slot (t + 1) % 2 is
              free": its last reader, hop t - 1's compute and send, is done;
              at hop 0 the previous grid step is done), then wait for the
              credit of r + 1 and start the sends of this hop.  Each DMA
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
    backward: hops 0 .. n; K/V move as in the forward (and stop as early).  The dK/dV
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

# The one allocator of barrier-semaphore collective ids of this package's kernels.
COLLECTIVE_IDS = {"ring_fwd": 0, "ring_bwd": 1}

# Test hook: when a list, every remote DMA the kernels start is appended as (kernel name, bytes) at trace
# time; each runs once per grid step.
DMA_LOG = None
# Test hook: when a list, the protocol's events are appended in program order at trace time, as (kernel name,
# event, detail): ("hop", t), ("compute", t), ("release", None), ("acquire", None), ("start", descriptor id),
# ("wait", descriptor id).  The hops are unrolled in Python, so trace order is program order.
EVENTS = None


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
  bq, bk = c.block_tiles(spec, q, k, backward=backward)
  table = n * (T // bq) * (S // bk) * 4
  if table > c.SMEM_TABLE_BYTES:
    raise ValueError(
      f"pallas_tpu_ring: the tile table of {n} hops x {T // bq} x {S // bk} tiles needs {table} bytes of SMEM, "
      f"more than {c.SMEM_TABLE_BYTES}; use larger tiles"
    )
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
    live=live_hops(spec.mask, n, sizes, T, S, bq, bk, load_balance),
  )


def live_hops(mask: masks.MaskSpec, n: int, sizes, T: int, S: int, bq: int, bk: int, load_balance: bool) -> int:
  """1 + the last hop on which some ring member holds a kv tile that is not EMPTY for its q shard.

  Decided at trace time, in numpy, by `masks.tile_kinds` on the static
  positions of every member's shards (segment ids are data, so they are left
  out: the answer is conservative).  Beyond it every hop is EMPTY on every member, so the ring
  stops there: no later hop is computed, and K/V are not sent past it.  A
  causal sliding window on the contiguous layout needs about window / shard
  length + 1 hops; causal zigzag needs all n.
  """
  if n == 1:
    return 1
  pos_only = dataclasses.replace(mask, has_segments=False)

  def positions(member, length):  # numpy: no JAX op runs here, whatever mesh context the trace is in
    return layout.token_positions(int(layout.ring_shard(member, sizes)), n, length, load_balance, np.arange(length))

  last = 0
  for member in range(n):
    q_pos = positions(member, T)
    for t in range(n - 1, last, -1):
      kv_pos = positions((member - t) % n, S)
      if (masks.tile_kinds(pos_only, q_pos, kv_pos, None, None, bq, bk) != masks.EMPTY).any():
        last = t
        break
  return last + 1


def ring_tables(spec, d: RingDims, q_seg, kv_seg):
  """Scalar-prefetched tables, computed in XLA before the launch.

  meta int32: [own shard, src shard of hops 0 .. n-1, upstream coords..., downstream coords...].
  kinds int32 [n, T / bq, S / bk]: `masks.classify` of every tile pair of every hop (the segment-id extents
  of the other shards come from a small all_gather of per-tile min / max).
  """
  n, sizes, shard, member = layout.ring_geometry(d.axes or None)
  srcs = [layout.ring_shard((member - t) % n, sizes) for t in range(n)]
  up = layout.snake_coords((member - 1) % n, sizes)
  down = layout.snake_coords((member + 1) % n, sizes)
  meta = jnp.stack([jnp.asarray(x, jnp.int32) for x in (shard, *srcs, *up, *down)])
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
  return meta, jnp.stack(kinds).astype(jnp.int32)


class Comms:
  """Neighbours, barrier, credits and remote copies of one kernel (see the module docstring)."""

  def __init__(self, meta_ref, d: RingDims, credit_sem, *, name: str):
    self.meta_ref, self.d, self.credit, self.name = meta_ref, d, credit_sem, name
    k = len(d.axes)
    self._up = 1 + d.n
    self._down = 1 + d.n + k

  def _device(self, offset):
    return {a: self.meta_ref[offset + i] for i, a in enumerate(self.d.axes)}

  def src_shard(self, t):
    return self.meta_ref[1 + t]

  def own_shard(self):
    return self.meta_ref[0]

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

  def copy_down(self, src, dst, send_sem, recv_sem):
    """A descriptor for src (ours) -> dst (r + 1's buffer of the same name); start and wait this object."""
    return _Send(
      pltpu.make_async_remote_copy(
        src, dst, send_sem, recv_sem, device_id=self._device(self._down), device_id_type=pl.DeviceIdType.MESH
      ),
      src,
      self.name,
    )


class _Send:
  def __init__(self, desc, src, name):
    self.desc, self.src, self.name = desc, src, name

  def start(self):
    if DMA_LOG is not None:
      shape = self.src.shape
      size = 1
      for s in shape:
        size *= s
      DMA_LOG.append((self.name, size * jnp.dtype(self.src.dtype).itemsize))
    note(self.name, "start", id(self.desc))
    self.desc.start()

  def wait(self):
    note(self.name, "wait", id(self.desc))
    self.desc.wait_send()
    self.desc.wait_recv()


def load_own(pairs, sem):
  """Copies the own shard (HBM -> slot 0) with local DMAs: start all, then wait all."""
  copies = [pltpu.make_async_copy(src, dst, sem.at[i]) for i, (src, dst) in enumerate(pairs)]
  for cp in copies:
    cp.start()
  for cp in copies:
    cp.wait()


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
    from flax_ringattn._src.backends.pallas_tpu import planner

    kwargs["vmem_limit_bytes"] = planner.vmem_limit_bytes(planner.current_generation())
  params = pltpu.CompilerParams(**kwargs)

  def run(*args):
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

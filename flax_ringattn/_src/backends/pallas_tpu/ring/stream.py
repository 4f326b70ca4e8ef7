"""Tile streaming for the in-kernel ring with HBM communication slots (`ring/hbm_forward.py`, `ring/hbm_backward.py`).

When a shard does not fit VMEM (`planner.plan_ring`), the ring's K/V slots,
the dK / dV accumulator slots and the online-softmax state live in HBM, and
each hop walks its tiles through VMEM:

* the outer tile of a pass (a q tile; in the dK / dV pass, a kv tile) and the
  state it updates are copied in and out synchronously: a copy per outer tile,
  amortised over a whole row of inner tiles;
* the inner tiles are double-buffered (`stream`): tile j + 1 is copied while
  tile j is computed, and an EMPTY tile (`masks.classify` table) is neither
  copied nor computed.

HBM buffers that the kernel needs across grid steps are extra `pl.ANY` outputs
of the `pallas_call` (discarded by the caller): remote copies target the same
output buffer on the neighbour, and Pallas TPU interpret mode simulates them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src import masks
from flax_ringattn._src.backends.pallas_tpu.ring import protocol as rp


def io_sems(d: rp.RingDims) -> int:
  """The most synchronous copies (`ring.protocol.sync_copies`) one outer tile starts together: the dQ pass's q,
  dO, lse, delta, the q columns of the token fields (`RingDims.fields`) and dq."""
  return 5 + len(d.fields)


def kv_tiles(src, j: int, bk: int):
  """Tile j of the hop's K, V (and kv token rows [1, S]) slots `src`: the sources `stream` copies."""
  cols = pl.ds(j * bk, bk)
  return [src[0].at[cols], src[1].at[cols]] + [s.at[:, cols] for s in src[2:]]


def live_tile(kinds_ref, d, t, i, j):
  """Whether hop t's tile pair (i, j) is not EMPTY."""
  return rp.tile_kind(kinds_ref, d, t, i, j) != masks.EMPTY


def any_live(kinds_ref, d, t, *, row=None, col=None, count: int):
  """Whether q tile `row` (over its `count` kv tiles), or kv tile `col` (over `count` q tiles), has a tile that
  is not EMPTY at hop t: a scalar loop over the SMEM tile table."""

  def step(x, acc):
    i, j = (row, x) if row is not None else (x, col)
    return acc | live_tile(kinds_ref, d, t, i, j)

  return jax.lax.fori_loop(0, count, step, jnp.bool_(False))


def stream(count: int, live, sources, buffers, sems, body):
  """body(j, slot) for j in 0 .. count - 1 where live(j), with the tiles double-buffered.

  sources(j): the HBM tile j of each streamed array; buffers: their VMEM
  buffers [2, ...]; sems: DMA semaphores [2, len(buffers)].  Tile j lands in
  buffer slot j % 2; its copy starts during step j - 1 (step 0: before the
  loop), so it overlaps the compute of tile j - 1.  An EMPTY tile starts no
  copy and its step waits for none.  Buffer slot (j + 1) % 2 is written only
  after step j - 1, its last reader, has finished.  These are local copies
  started and waited in different loop iterations, so the wait rebuilds the
  descriptor (same source, buffer and semaphore) as Pallas TPU pipelines do;
  the protocol's build-once rule is for the remote copies.
  """

  def copies(j, slot):
    return [
      pltpu.make_async_copy(src, buf.at[slot], sems.at[slot, a])
      for a, (src, buf) in enumerate(zip(sources(j), buffers, strict=True))
    ]

  def start(j, slot):
    for cp in copies(j, slot):
      cp.start()

  pl.when(live(0))(lambda: start(0, 0))

  def step(j, carry):
    slot = j % 2
    nxt = jnp.minimum(j + 1, count - 1)
    pl.when((j + 1 < count) & live(nxt))(lambda: start(nxt, 1 - slot))

    @pl.when(live(j))
    def _():
      for cp in copies(j, slot):
        cp.wait()
      body(j, slot)

    return carry

  jax.lax.fori_loop(0, count, step, None)

"""Host-side tables of the in-kernel ring: its static dimensions and slot choice (`RingDims`), which hops and
tiles hold visible keys (`visibility`, `live_hops`), which K/V sends anyone reads (`kv_send_table`), and the
scalar-prefetched metadata and tile-kind table every kernel reads (`ring_tables`, `tile_kind`).  Everything here is
decided at trace time, in numpy where it can be; the protocol that uses it is `protocol.py`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flax_ringattn._src import layout, masks
from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu import planners as planner
from flax_ringattn._src.options import ProblemShape


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
  # The mask's other per-row data (`ProblemShape.extra_fields`: "pos" for the caller's positions, else the kernels
  # compute the layout's; "bid" for bidirectional ids): each travels with K/V, as segment ids do.
  extra_fields: tuple = ()
  # kv_sends[r][t]: whether ring member r sends its K/V at hop t (t < live - 1): some member downstream sees
  # that shard on a later hop (`kv_send_table`).  () when every member sends on every hop.
  kv_sends: tuple = ()
  # Where the communication slots and the softmax state live: "vmem" (whole shards resident, `vmem_forward.py`)
  # or "hbm" (tiles streamed through VMEM, `hbm_forward.py`), by `planner.plan_ring`.
  slots: str = "vmem"
  debug: object = None  # a `debug.KernelDebug` (tests only), or None
  v_head_dim: int | None = None  # v's (and the output's) head dim when it differs from H (MLA); None: H

  @property
  def fields(self) -> tuple[str, ...]:
    """The `masks.Tokens` fields that are kernel operands, in the order the kernels take them: positions (when
    given per row), segment ids, bidirectional ids.  Each is a q column [B, T, 1] and a kv row [B, 1, S] that
    travels in slots of its own beside K and V."""
    present = {*self.extra_fields, *(("seg",) if self.has_segments else ())}
    return tuple(f.name for f in dataclasses.fields(masks.Tokens) if f.name in present)

  @property
  def has_positions(self) -> bool:
    return "pos" in self.extra_fields

  @property
  def G(self) -> int:
    return self.N // self.K

  @property
  def Hv(self) -> int:
    """v's head dim: the width of the V and dV slots and of the output, dO and the softmax accumulator."""
    return self.H if self.v_head_dim is None else self.v_head_dim


def ring_dims(spec, q, k, v, axis_name, load_balance, *, backward: bool) -> RingDims:
  B, T, N, H = q.shape
  S, K, Hv = k.shape[1], k.shape[2], v.shape[3]
  axes = layout.ring_axes(axis_name)
  sizes = tuple(jax.lax.axis_size(a) for a in axes)
  n = 1
  for s in sizes:
    n *= s
  shape = ProblemShape.of(q.shape, k.shape, q.dtype, spec, v_shape=v.shape)
  if spec.block_sizes is None:  # the ring's own plan: slots and tiles, the tile table within SMEM
    plan = planner.plan_ring_for(shape, n=n, backward=backward)
  else:  # the caller's tiles (checked as the block kernels check them); only the slots are chosen
    tiles = c.block_tiles(spec, q, k, backward=backward, v=v)
    plan = planner.plan_ring_for(shape, n=n, backward=backward, tiles=tiles)
  bq, bk = plan.bq, plan.bk
  table = planner.ring_table_bytes(n, T // bq, S // bk)
  if table > c.SMEM_TABLE_BYTES:
    raise ValueError(
      f"pallas_tpu_ring: the tile table of {n} hops x {T // bq} x {S // bk} tiles needs {table} bytes of SMEM, "
      f"more than {c.SMEM_TABLE_BYTES}; use larger tiles (or block_sizes=None: the ring's planner keeps it within)"
    )
  debug = getattr(spec, "debug", None)
  slots = (debug.slots if debug is not None else None) or plan.slots
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
    has_segments=spec.mask.has_segments,
    has_dropout=bool(spec.dropout_rate),
    extra_fields=shape.extra_fields,
    live=live,
    kv_sends=() if sends.all() else tuple(tuple(bool(x) for x in row) for row in sends),
    slots=slots,
    debug=debug,
    v_head_dim=None if Hv == H else Hv,
  )


def visibility(mask: masks.MaskSpec, n: int, sizes, T: int, S: int, bq: int, bk: int, load_balance: bool):
  """bool [n, n]: vis[m, s] when ring member m's q shard sees some key of ring member s's kv shard.

  Decided at trace time, in numpy, by `masks.tile_kinds` on the static
  positions of the members' shards.  Segment ids are data, so they are left
  out: a pair marked invisible is EMPTY whatever the ids, and everything built
  on this table (`live_hops`, `kv_send_table`) is conservative.  Bidirectional
  ids are data that can make any pair visible, and positions given per row
  can put any token in any shard: with either, every member may see every
  shard (every hop live, every send made).
  """
  if set(mask.data_fields) - {"seg"}:
    return np.ones((n, n), bool)
  pos_only = dataclasses.replace(mask, has_segments=False)

  def positions(member, length):  # numpy: no JAX op runs here, whatever mesh context the trace is in
    return layout.token_positions(int(layout.ring_shard(member, sizes)), n, length, load_balance, np.arange(length))

  q_tok = [masks.Tokens(positions(m, T)) for m in range(n)]
  kv_tok = [masks.Tokens(positions(m, S)) for m in range(n)]
  return np.array(
    [
      [(masks.tile_kinds(pos_only, q_tok[m], kv_tok[s], bq, bk) != masks.EMPTY).any() for s in range(n)]
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


def ring_tables(spec, d: RingDims, q_tok: masks.Tokens, kv_tok: masks.Tokens):
  """Scalar-prefetched tables, computed in XLA before the launch.

  meta int32: [own shard, src shard of hops 0 .. n-1, upstream coords..., downstream coords..., then with
  `d.kv_sends`: whether this member sends its K/V at hops 0 .. live-2, whether its upstream neighbour does].
  kinds: `masks.classify` of every tile pair of every hop, packed by `pack_kinds` (read with `tile_kind`).  The
  q side's extents are this shard's own; the kv extents of the data fields (`d.fields`: positions given per row,
  segment ids, bidirectional ids) of every shard come from one small all_gather of per-tile min / max, and the
  layout's positions, when the caller gave none, are recomputed for each hop's source shard.
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
  q_tok = masks.with_positions(q_tok, layout.shard_positions(shard, n, d.T, d.load_balance))
  qe = masks.tile_extent(q_tok, d.bq).map(lambda a: a[:, :, None])  # [B | 1, T / bq, 1]
  own = masks.tile_extent(masks.with_positions(kv_tok, jnp.zeros((d.S,), jnp.int32)), d.bk)  # [B | 1, S / bk]
  if not d.has_positions:
    own = dataclasses.replace(own, pos_min=None, pos_max=None)  # the layout's: recomputed per source below
  names = [f.name for f in dataclasses.fields(own) if getattr(own, f.name) is not None]  # data: [B, S / bk] each
  if names:
    every = jnp.stack([getattr(own, name) for name in names])  # [fields, B, S / bk]
    every = jax.lax.all_gather(every, d.axes) if d.axes else every[None]  # [n, fields, B, S / bk], by shard index
  kinds = []
  for src in srcs:
    ke = dataclasses.replace(own, **{name: every[src, f] for f, name in enumerate(names)})
    if not d.has_positions:
      kp = layout.shard_positions(src, n, d.S, d.load_balance).reshape(1, -1, d.bk)
      ke = dataclasses.replace(ke, pos_min=kp.min(axis=2), pos_max=kp.max(axis=2))
    kinds.append(masks.classify(spec.mask, qe, ke.map(lambda a: a[:, None, :])))  # kv: [B | 1, 1, S / bk]
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

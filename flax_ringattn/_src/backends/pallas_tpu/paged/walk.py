"""The walk both paged kernels share: page copies into the kv slots, the masks of a block, and the
sequence-by-sequence visit of the kv blocks a q block can see (steps 1 to 3 of the package docstring)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src import masks
from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.backends.pallas_tpu.paged import plans as pp


@dataclasses.dataclass(frozen=True)
class Refs:
  """Scalar metadata, HBM pages and the VMEM kv buffers of one launch."""

  cu: object  # [S + 1] effective cu_q_lens (SMEM)
  kv_lens: object  # [S]
  table: object  # [S * ppt] page ids, -1 padded
  sched: object  # the walk's `schedule` (SMEM): [0] the live sequence count, then each q block's visits
  k_hbm: object
  v_hbm: object
  scales_hbm: tuple  # k_scale / v_scale [P, rows, K] (None when absent)
  k_buf: object  # [slots, ppb * ps * K, H] (flat, `plans.kv_buffer_shape`) or [slots, ppb * ps, K, H]
  v_buf: object  # the same with Hv
  scale_bufs: tuple  # [slots, ppb, rows, K] (None when absent)
  sem: object  # DMA semaphores; [0, slots): the kv slots (`PagedDims.slots`), [slots]: the kernel's own copies
  # [2 * slots] int32 (SMEM): [0, slots) the tokens below kv_len copied into each kv slot by its last `_start_pages`,
  # [slots, 2 * slots) the rows its copies moved (the DMA semaphore's count: more than the tokens where merged
  # pages copy whole tiles)
  tokens_sc: object = None
  q_ids: object = None  # [bq, 1] the q block's bidirectional ids (VMEM), or None
  kv_ids_hbm: object = None  # [span_rows, 1, bt] the kv id table (`plans.span_operands`)
  kv_ids_buf: object = None  # [slots, 1, bt] the kv block's ids, one per kv slot
  keys_sc: object = None  # [1, bt] int32: the current block's `block_keys`


@dataclasses.dataclass(frozen=True)
class Page:
  """Page j of a kv block: whether it holds keys of the block (a valid id, below kv_len), its clamped id, how
  many of its tokens are below kv_len (0 when not `ok`) and how many buffer rows its copy moves: tokens * K
  (flat), tokens, or for merged pages the tokens rounded up to whole sublane tiles of the page dtype (Mosaic slices
  a tiled dim only by whole tiles; the rows past kv_len are the page's own, zeroed by `block_keys`)."""

  ok: jax.Array
  pid: jax.Array
  tokens: jax.Array
  rows: jax.Array


def block_pages(d: pp.PagedDims, r: Refs, s, b, kv_len) -> list[Page]:
  """The ppb pages of kv block b of sequence s (scalar work per page: computed where a page's own data is
  needed; the walk's common path needs only the block's token count, `Refs.tokens_sc`)."""
  out = []
  for j in range(d.ppb):
    entry = b * d.ppb + j
    valid, pid = _page_id(d, r.table[s * d.ppt + entry])
    tokens = jnp.clip(kv_len - entry * d.ps, 0, d.ps)
    ok = valid & (tokens > 0)
    tokens = jnp.where(ok, tokens, 0)
    out.append(Page(ok, pid, tokens, _copy_rows(d, tokens)))
  return out


def _page_id(d: pp.PagedDims, pid):
  """(whether a page-table entry names a page, in [0, P); the entry clamped to one, safe to copy)."""
  return (pid >= 0) & (pid < d.P), jnp.clip(pid, 0, d.P - 1)


def _copy_rows(d: pp.PagedDims, tokens):
  if not d.merged:
    return tokens * d.rows_per_token
  sub = c.sublanes(d.page_dtype)
  return pl.multiple_of(jax.lax.div(tokens + sub - 1, sub) * sub, sub)


def _page_slot(d: pp.PagedDims, buf, slot, j):
  """Page j of kv slot `slot` of a K or V buffer: [ps * K, h] when flat, else [ps, K, h]."""
  rows = d.ps * d.rows_per_token
  return buf.at[slot, pl.ds(j * rows, rows)]


def _start_pages(d: pp.PagedDims, r: Refs, pages: list[Page], slot):
  """Starts the copies of a block's pages into kv slot `slot`, each exactly its `tokens` (a copy of none moves no
  bytes): no branch per page, and a block's K (V) bytes are one count for `_wait_pages`, kept in
  `Refs.tokens_sc`.  Scales (small, and per page) are copied whole, on the pages that are `ok`."""
  per = d.rows_per_token
  r.tokens_sc[slot] = sum(p.tokens for p in pages)
  r.tokens_sc[d.slots + slot] = sum(p.rows for p in pages)
  for j, page in enumerate(pages):
    if d.together:  # the page's K and V rows in one copy
      dst = r.k_buf.buf.at[slot, :, pl.ds(j * d.ps, page.rows)]
      pltpu.make_async_copy(r.k_hbm.at[page.pid, :, pl.ds(0, page.rows)], dst, r.sem.at[slot]).start()
      continue
    for hbm, buf in ((r.k_hbm, r.k_buf), (r.v_hbm, r.v_buf)):
      dst = buf.at[slot, pl.ds(j * d.ps * per, page.rows)]
      pltpu.make_async_copy(hbm.at[page.pid, pl.ds(0, page.rows)], dst, r.sem.at[slot]).start()
  _run(_scale_copies(r, pages, slot), "start")


def _scale_copies(r: Refs, pages: list[Page], slot):
  """[(ok, descriptors)] of the pages' scale rows."""
  out = []
  for j, page in enumerate(pages):
    descs = [
      pltpu.make_async_copy(src.at[page.pid], dst.at[slot, j], r.sem.at[slot])
      for src, dst in zip(r.scales_hbm, r.scale_bufs, strict=True)
      if src is not None
    ]
    if descs:
      out.append((page.ok, descs))
  return out


def _wait_pages(d: pp.PagedDims, r: Refs, s, b, kv_len, slot):
  """Waits for every copy `_start_pages` started into kv slot `slot` (block b of sequence s): one wait per K and
  V buffer for the block's byte count (the DMA semaphore counts bytes; the view waited on only supplies the
  count)."""
  rows = r.tokens_sc[d.slots + slot]
  if d.merged:
    rows = pl.multiple_of(rows, c.sublanes(d.page_dtype))

  @pl.when(rows > 0)
  def _():
    for buf in (r.k_buf, r.v_buf):
      view = buf.at[slot, pl.ds(0, rows)]
      pltpu.make_async_copy(view, view, r.sem.at[slot]).wait()

  if any(x is not None for x in r.scales_hbm):
    _run(_scale_copies(r, block_pages(d, r, s, b, kv_len), slot), "wait")


def _span_copy(d: pp.PagedDims, r: Refs, s, b, slot, first_pos, kv_len):
  """[(copy?, descriptors)] of the ids of kv block b of sequence s when it holds some of the call's new
  tokens (positions first_pos .. kv_len - 1); [] without spans."""
  if not d.spans:
    return []
  ok, row = _span_row(d, r, s, b, first_pos, kv_len)
  return [(ok, [pltpu.make_async_copy(r.kv_ids_hbm.at[row], r.kv_ids_buf.at[slot], r.sem.at[slot])])]


def _span_row(d: pp.PagedDims, r: Refs, s, b, first_pos, kv_len):
  """(whether kv block b of sequence s holds some of the call's new tokens, its row of the kv id table)
  (`plans.PagedDims.span_rows`; lax.div on values >= 0)."""
  bt = d.block_tokens
  row = jax.lax.div(r.cu[s], bt) + 2 * s + b - jax.lax.div(jnp.maximum(first_pos, 0), bt)
  ok = (b * bt < kv_len) & ((b + 1) * bt > first_pos) & (row >= 0) & (row < d.span_rows)
  return ok, jnp.clip(row, 0, d.span_rows - 1)


def span_ids(d: pp.PagedDims, r: Refs, s, b, slot, g):
  """(q ids [bq * G, 1], kv ids [1, bt]) of the q block and kv block b of sequence s (in VMEM slot `slot`), or
  (None, None) without spans.  A block with none of the call's new tokens was not copied: its keys carry 0."""
  if not d.spans:
    return None, None
  copied, _ = _span_row(d, r, s, b, g.first_pos, g.kv_len)
  kv = jnp.where(copied, r.kv_ids_buf[slot], 0)  # stale VMEM never reaches the mask
  q = r.q_ids[...]
  return fold(jnp.broadcast_to(q[:, None, :], (d.bq, d.G, 1)), d.G), kv


def _start_block(d: pp.PagedDims, r: Refs, s, b, slot, g):
  """Starts every copy of kv block b of sequence s: its pages, and its keys' ids with spans.  A block wholly
  below kv_len (every block of a long sequence but its last) takes `_start_whole_pages`."""
  if any(d.scale_rows):  # scales are copied per page that is `ok`: the general path
    _start_pages(d, r, block_pages(d, r, s, b, g.kv_len), slot)
  else:
    whole = (b + 1) * d.block_tokens <= g.kv_len
    pl.when(whole)(lambda: _start_whole_pages(d, r, s, b, slot))
    pl.when(~whole)(lambda: _start_pages(d, r, block_pages(d, r, s, b, g.kv_len), slot))
  _run(_span_copy(d, r, s, b, slot, g.first_pos, g.kv_len), "start")


def _start_whole_pages(d: pp.PagedDims, r: Refs, s, b, slot):
  """`_start_pages` for a block wholly below kv_len: each page copied whole (a static size), with a table read, a
  clamp and a range check its only scalar work per page (a decode step's time goes to the scalar core issuing
  copies).  A page id out of [0, P) (a hole in the table) still copies the clamped page, so the block's token
  count is set one short of whole: `block_keys` then takes its slow paths, which mask that page's keys and zero
  its slots."""
  base = s * d.ppt + b * d.ppb
  bad = jnp.zeros((), jnp.bool_)
  for j in range(d.ppb):
    valid, pid = _page_id(d, r.table[base + j])
    bad = bad | ~valid
    if d.together:  # one copy per page, its K and V: the scalar core issues half the copies
      dst = r.k_buf.buf.at[slot, :, pl.ds(j * d.ps, d.ps)]
      pltpu.make_async_copy(r.k_hbm.at[pid], dst, r.sem.at[slot]).start()
      continue
    for hbm, buf in ((r.k_hbm, r.k_buf), (r.v_hbm, r.v_buf)):
      pltpu.make_async_copy(hbm.at[pid], _page_slot(d, buf, slot, j), r.sem.at[slot]).start()
  r.tokens_sc[slot] = d.block_tokens - bad.astype(jnp.int32)
  r.tokens_sc[d.slots + slot] = d.block_tokens * d.rows_per_token


def _run(copies, method):
  for ok, descs in copies:
    pl.when(ok)(functools.partial(_each, descs, method))


def _each(descs, method):
  for desc in descs:
    getattr(desc, method)()


# The least key count of `key_levels`: the scores' [rows, keys] tile stays lane-dense.
MIN_KEY_LEVEL = 128


def key_levels(d: pp.PagedDims) -> tuple[int, ...]:
  """The key counts, ascending, that the forward computes a kv block on: the least that holds the block's keys
  below kv_len (`key_limit`), so a sequence's last, partly filled block costs its keys, not the whole block.  On a
  v5e (14 / 2 / 64, kv pages of 64, kv blocks of 1024 tokens, 64 decodes) a decode of 2064 tokens took 0.285 ms
  against 0.181 ms at 2048: its third block, 16 keys, cost as much as a whole one.  Merged pages without scales
  only (a prefix of a merged buffer's rows is its first keys); else the whole block."""
  bt = d.block_tokens
  if not d.merged or any(d.scale_rows) or bt < 2 * MIN_KEY_LEVEL:
    return (bt,)
  return tuple(sorted({max(MIN_KEY_LEVEL, bt // 8), max(MIN_KEY_LEVEL, bt // 2), bt}))


def key_limit(levels: tuple[int, ...], n):
  """The least of `levels` that is >= n (traced), n <= the last level."""
  limit = jnp.int32(levels[-1])
  for level in reversed(levels[:-1]):
    limit = jnp.where(n <= level, level, limit)
  return limit


def block_keys(d: pp.PagedDims, r: Refs, s, b, slot, kv_len, limit=None):
  """[1, block_tokens] bool: which key slots of kv block b (in VMEM slot `slot`) hold a key: below kv_len, on a
  page that was copied.  Every other slot of the K, V and scale buffers below `limit` (default: all; the slots
  the caller computes on) is zeroed here, so stale VMEM or NaN in a page's tail can reach no product (p is
  exactly 0 there, but 0 * NaN is not).

  A block whose pages were all copied whole (every block of a sequence but its last, in a cache without holes)
  costs a few scalar ops; pages missing from the table (-1 ids) cost a lane mask, and pages not copied whole a
  read-modify-write of those pages, on that block only.  Both are read off the block's token count: each page
  adds at most its page_size, and exactly its tokens below kv_len when it is copied.
  """
  n = jnp.clip(kv_len - b * d.block_tokens, 0, d.block_tokens)  # slots below kv_len
  copied = r.tokens_sc[slot]
  clean = copied == d.block_tokens  # every page copied whole
  good = copied == n  # every page below kv_len was copied
  lane = jax.lax.broadcasted_iota(jnp.int32, (1, d.block_tokens), 1)
  r.keys_sc[...] = (lane < n).astype(jnp.int32)

  @pl.when(~good)
  def _():
    keep = lane < n
    for j, page in enumerate(block_pages(d, r, s, b, kv_len)):
      keep = keep & ((jax.lax.div(lane, d.ps) != j) | page.ok)
    r.keys_sc[...] = keep.astype(jnp.int32)

  @pl.when(~clean)
  def _():
    for j, page in enumerate(block_pages(d, r, s, b, kv_len)):
      below = page.tokens < d.ps
      if limit is not None:
        below = below & (j * d.ps < limit)

      @pl.when(below)
      def _(j=j, keep=page.tokens):
        views = [(_page_slot(d, buf, slot, j), d.rows_per_token) for buf in (r.k_buf, r.v_buf)]
        views += [(sc.at[slot, j], 1) for sc in r.scale_bufs if sc is not None]  # [rows, K]
        for view, rows in views:
          x = view[...]
          slot_of_row = jax.lax.div(jax.lax.broadcasted_iota(jnp.int32, x.shape, 0), rows)
          view[...] = jnp.where(slot_of_row < keep, x, jnp.zeros_like(x))

  return r.keys_sc[...] != 0


def load_head(d: pp.PagedDims, buf, scale_buf, slot, k, keys=None):
  """[block_tokens, H or Hv] float32 values of kv head k (dequantised), and the scale [ppb, rows, 1] or None.
  `keys`: the block's first `keys` tokens only (merged pages without scales, `key_levels`)."""
  if d.merged:
    h = buf.shape[-1] // d.K
    rows = slice(None) if keys is None else pl.ds(0, keys)
    x = buf[slot, rows, k * h : (k + 1) * h]  # [bt, h]: a lane slice, aligned when h % 128 == 0
    if scale_buf is None:
      # In the page dtype, as the matmul takes it (`dot`): a round trip through f32 (exact, but two VPU passes
      # over the block) took 2.8x the time of a 64 x 4096 decode on a v5e (32 / 8 / 64: 2.9 against 1.02 ms).
      return x, None
    x = x.astype(c.F32)
  elif d.flat:
    x = _flat_head(d, buf, slot, k)
  else:
    x = buf[slot, :, k, :].astype(c.F32)  # [bt, h]
  sc = None
  if scale_buf is not None:
    sc = scale_buf[slot, :, :, k][..., None]  # [ppb, rows, 1]
    x = (x.reshape(d.ppb, d.ps, -1) * sc).reshape(d.block_tokens, -1)
  return x, sc


def _flat_head(d: pp.PagedDims, buf, slot, k):
  """Head k of a flat kv buffer (rows t * K + k) as float32: one sublane-strided load (`common.strided_rows`;
  compiled, bf16 pages go through 32-bit words)."""
  return c.strided_rows(buf.at[slot], k, d.block_tokens, d.K, compiled=d.compiled)


def fold(x, G):
  """[bq, G, ...] -> [bq * G, ...]: row r is token r // G, head r % G."""
  return x.reshape(x.shape[0] * G, *x.shape[2:])


def mask(
  d: pp.PagedDims,
  spec,
  q_lo,
  seq_start,
  seq_end,
  first_pos,
  b,
  valid_row,
  ids=(None, None),
  row0=0,
  rows=None,
  keys=None,
):
  """[rows, keys] visibility of kv block b for the rows of one sequence in this q block, on the folded rows
  [row0, row0 + rows) (default: all bq * G) and the block's first `keys` keys (default: all); `valid_row` and
  `ids` (the rows' and keys' bidirectional ids, `span_ids`) as wide as `keys`."""
  rows = d.bq * d.G if rows is None else rows
  keys = d.block_tokens if keys is None else keys
  t = q_lo + jax.lax.div(row0 + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0), d.G)  # global row of q
  pos = first_pos + (t - seq_start)
  kv_pos = b * d.block_tokens + jax.lax.broadcasted_iota(jnp.int32, (1, keys), 1)
  return (t >= seq_start) & (t < seq_end) & valid_row & masks.pair_visible(spec.mask, pos, kv_pos, None, None, *ids)


def row_window(d: pp.PagedDims, g, q_lo):
  """(whether sequence g's folded rows in the q block fit in `PagedDims.window_rows` rows from a multiple of 8,
  that first row); only with a window."""
  lo, hi = (g.lo_row - q_lo) * d.G, (g.hi_row - q_lo) * d.G
  narrow, row0 = pp.fits_window(lo, hi, d.window_rows, d.bq * d.G, div=jax.lax.div)
  return narrow, pl.multiple_of(row0, 8)


def dot(a, b, contract, dtype):
  precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
  return jax.lax.dot_general(
    a.astype(dtype), b.astype(dtype), (contract, ((), ())), preferred_element_type=c.F32, precision=precision
  )


@dataclasses.dataclass(frozen=True)
class _Seq:
  """Where sequence s meets the q block: its rows, positions and the kv blocks [lo, hi) they can see."""

  start: jax.Array  # first row of the sequence in q
  end: jax.Array
  kv_len: jax.Array
  first_pos: jax.Array  # position of the sequence's first new token
  lo_row: jax.Array  # its rows in this q block: [lo_row, hi_row)
  hi_row: jax.Array
  lo: jax.Array
  hi: jax.Array


def seq_in_block(d: pp.PagedDims, spec, r: Refs, s, q_lo) -> _Seq:
  return seq_bounds(d, spec, r.cu[s], r.cu[s + 1], r.kv_lens[s], q_lo)


def seq_bounds(d: pp.PagedDims, spec, seq_start, seq_end, kv_len, q_lo) -> _Seq:
  """`seq_in_block` on a sequence's cu_q_lens entries and kv_len: elementwise, so scalars in a kernel and arrays
  in `schedule` give the same blocks."""
  lo_row, hi_row = jnp.maximum(seq_start, q_lo), jnp.minimum(seq_end, q_lo + d.bq)
  first_pos = kv_len - (seq_end - seq_start)
  lo_pos, hi_pos = first_pos + (lo_row - seq_start), first_pos + (hi_row - 1 - seq_start)
  # lax.div/rem (truncating) on non-negative values: Mosaic lowers floor division through sign(), which
  # needs the TPU generation at lowering time.
  hi = jnp.where(hi_pos < 0, 0, jnp.minimum(jax.lax.div(hi_pos, d.block_tokens) + 1, d.max_blocks))
  lo = jax.lax.div(masks.first_visible_position(spec.mask, lo_pos), d.block_tokens)
  if spec.mask.has_bidirectional:
    # Any row may hold a span id (the scalar walk cannot read them): every block of the call's new tokens too.
    last = jnp.minimum(jax.lax.div(kv_len - 1, d.block_tokens) + 1, d.max_blocks)
    hi = jnp.maximum(hi, jnp.where(kv_len > 0, last, 0))
    lo = jnp.minimum(lo, jax.lax.div(jnp.maximum(first_pos, 0), d.block_tokens))
  hi = jnp.where(hi_row > lo_row, hi, 0)
  return _Seq(seq_start, seq_end, kv_len, first_pos, lo_row, hi_row, jnp.minimum(lo, hi), hi)


def first_seq(d: pp.PagedDims, r: Refs, q_lo, n):
  """The first sequence whose rows reach the q block (a scalar scan of cu_q_lens)."""
  return jax.lax.while_loop(lambda s: (s < n) & (r.cu[jnp.minimum(s + 1, d.S)] <= q_lo), lambda s: s + 1, 0)


def visit_capacity(d: pp.PagedDims) -> int:
  """The most (sequence, kv block) visits a launch's q blocks make together: a q block meets at most min(S, bq)
  sequences (each has a row there), all of them together at most S + nq - 1 (a sequence meets one q block more
  than the q block boundaries inside it), and each sees at most max_blocks kv blocks."""
  nq = d.T // d.bq
  return max(1, min(nq * min(d.S, d.bq), d.S + nq - 1) * d.max_blocks)


def schedule(d: pp.PagedDims, spec, cu, kv_lens, num_seqs):
  """The walk's visits, listed by XLA before the launch (one vectorised `seq_bounds` over every q block and
  sequence) instead of found by the kernel's scalar core between visits: [2 + nq + 2 V] int32 (V =
  `visit_capacity`), read in SMEM as `Refs.sched`: the live sequence count, then the nq + 1 offsets of each q
  block's visits, then the V visits' sequences and their V kv blocks.  Visits run q block by q block, sequence by
  sequence, block by block.  (On a v5e, 2026-12-08, against the kernel's own scalar walk, which found each next
  visit between visits: 64 decodes of 2064 tokens at 32 / 8 / 64 from 0.585 to 0.478 ms a call; 14 / 2 / 64,
  8 / 1 / 128 and 16 / 4 / 128 2-10% slower, with the schedule then built by some 20 small XLA ops, now a few.)"""
  nq, S = d.T // d.bq, d.S
  n = jnp.clip(num_seqs[0], 0, S).astype(jnp.int32)
  q_lo = (jnp.arange(nq, dtype=jnp.int32) * d.bq)[:, None]
  g = seq_bounds(d, spec, cu[None, :-1], cu[None, 1:], kv_lens[None, :].astype(jnp.int32), q_lo)  # [nq, S]
  count = jnp.where(jnp.arange(S)[None, :] < n, g.hi - g.lo, 0).reshape(-1)
  k = jnp.arange(visit_capacity(d), dtype=jnp.int32)
  lo = g.lo.reshape(-1)
  if k.size * count.size <= 1 << 22 and count.size <= 2048:
    # Small (a decode batch: 192 visits x 256 pairs): a triangular sum for the pairs' ends and each visit k against
    # every (q block, sequence) pair, a fusion each.  A cumsum, a searchsorted and gathers were some 20 small ops,
    # each a launch on a TPU: about 20 us added to every call.
    pair = jnp.arange(nq * S, dtype=jnp.int32)
    ends = jnp.where(pair[None, :] <= pair[:, None], count[None, :], 0).sum(axis=1)
    starts = ends - count
    hit = (starts[None, :] <= k[:, None]) & (k[:, None] < ends[None, :])  # [V, nq * S]: one pair per visit used
    seqs = jnp.where(hit, pair[None, :] % S, 0).sum(axis=1)
    blocks = jnp.where(hit, lo[None, :] + k[:, None] - starts[None, :], 0).sum(axis=1)
  else:
    ends = jnp.cumsum(count)
    starts = ends - count
    pair = jnp.minimum(jnp.searchsorted(ends, k, side="right", method="sort"), nq * S - 1)  # visit k's pair
    used = k < ends[-1]
    seqs = jnp.where(used, pair % S, 0)
    blocks = jnp.where(used, lo[pair] + k - starts[pair], 0)
  offsets = jnp.concatenate([jnp.zeros((1,), ends.dtype), ends.reshape(nq, S)[:, -1]])
  return jnp.concatenate([n[None], offsets, seqs, blocks]).astype(jnp.int32)


def scheduled(d: pp.PagedDims, spec, prefetch):
  """`plans.operands`' scalar prefetch (cu, kv_lens, table, num_seqs) with num_seqs replaced by the `schedule`."""
  cu, kv_lens, table, num_seqs = prefetch
  sched = schedule(d, spec, cu, kv_lens, num_seqs)
  words = cu.size + kv_lens.size + table.size + sched.size
  if 4 * words > c.SMEM_BYTES:
    raise ValueError(
      f"pallas_tpu paged attention: its scalar operands need {4 * words} bytes of SMEM, more than the "
      f"{c.SMEM_BYTES} a core has: the page table holds {table.size} entries ({d.S} sequences x {d.ppt}) and "
      f"the visit schedule {sched.size} ({d.T // d.bq} q blocks of {d.bq} rows); use fewer sequences or pages "
      "per sequence in one call, or larger block_q / block_kv"
    )
  return cu, kv_lens, table, sched


def walk(d: pp.PagedDims, spec, r: Refs, q_lo, visit, levels=None):
  """Calls visit(s, b, slot, seq, keys, limit) for every (sequence, kv block) that the rows [q_lo, q_lo + bq)
  can see, with block b's pages in VMEM slot `slot`, `keys` its `block_keys` and `limit` the least of `levels`
  (default: the whole block) that holds its keys below kv_len: the visit computes on the first `limit` keys.

  The visits are the q block's entries of `schedule`, in order; `PagedDims.slots` - 1 blocks are always in flight
  ahead of the compute, whichever sequences they belong to (a decode batch is mostly sequences of a few blocks).
  Visit k uses slot k % slots; at its start the copies of visit k + slots - 1 go into the slot visit k - 1 has just
  freed.  With two slots one block's copies run while one is computed.
  """
  nq, V = d.T // d.bq, visit_capacity(d)
  qb = jax.lax.div(q_lo, d.bq)
  v0, v1 = r.sched[1 + qb], r.sched[2 + qb]
  levels = (d.block_tokens,) if levels is None else levels
  seq = lambda s: seq_in_block(d, spec, r, s, q_lo)  # noqa: E731
  at = lambda k: (r.sched[2 + nq + k], r.sched[2 + nq + V + k])  # noqa: E731  visit k's (sequence, kv block)
  slot_of = lambda k: jax.lax.rem(k - v0, d.slots)  # noqa: E731
  ahead = d.slots - 1

  def start(k):
    @pl.when(k < v1)
    def _():
      s, b = at(k)
      _start_block(d, r, s, b, slot_of(k), seq(s))

  for i in range(ahead):
    start(v0 + i)

  def step(k, carry):
    start(k + ahead)
    (s, b), slot = at(k), slot_of(k)
    g = seq(s)
    _wait_pages(d, r, s, b, g.kv_len, slot)
    _run(_span_copy(d, r, s, b, slot, g.first_pos, g.kv_len), "wait")
    limit = key_limit(levels, jnp.clip(g.kv_len - b * d.block_tokens, 0, d.block_tokens))
    visit(s, b, slot, g, block_keys(d, r, s, b, slot, g.kv_len, limit), limit)
    return carry

  jax.lax.fori_loop(v0, v1, step, 0)


def split_refs(d: pp.PagedDims, refs):
  """Peels the optional scale refs off a kernel's ref list."""
  refs = list(refs)
  scales = []
  for rows in d.scale_rows:
    scales.append(refs.pop(0) if rows else None)
  return tuple(scales), refs


def split_spans(d: pp.PagedDims, refs):
  """Peels the span refs (the q block's ids, the kv id table) off a kernel's ref list: (None, None) without."""
  refs = list(refs)
  if not d.spans:
    return (None, None), refs
  return (refs.pop(0), refs.pop(0)), refs


class Half:
  """K (i = 0) or V (i = 1) of kv pages' VMEM buffer [2 slots, 2, rows, lanes] (`PagedDims.together`), indexed as
  a [2 slots, rows, lanes] buffer of its own: `half[slot, ...]` and `half.at[slot, ...]` are the buffer's
  [slot, i, ...].  The walk's copies fill both halves of a page at once through `buf`."""

  def __init__(self, buf, i: int):
    self.buf, self.i = buf, i

  @property
  def shape(self) -> tuple:
    return (self.buf.shape[0], *self.buf.shape[2:])

  @property
  def dtype(self):
    return self.buf.dtype

  @property
  def at(self):
    return _HalfAt(self)

  def index(self, idx) -> tuple:
    idx = idx if isinstance(idx, tuple) else (idx,)
    return (idx[0], self.i, *idx[1:])

  def __getitem__(self, idx):
    return self.buf[self.index(idx)]

  def __setitem__(self, idx, value):
    self.buf[self.index(idx)] = value


class _HalfAt:
  def __init__(self, half: Half):
    self.half = half

  def __getitem__(self, idx):
    return self.half.buf.at[self.half.index(idx)]


def split_scratch(d: pp.PagedDims, refs):
  """(k_buf, v_buf, scale_bufs, kv_ids_buf or None, keys_sc, the rest); kv pages' one buffer as its two `Half`s."""
  refs = list(refs)
  if d.together:
    buf = refs.pop(0)
    k_buf, v_buf = Half(buf, 0), Half(buf, 1)
  else:
    k_buf, v_buf = refs.pop(0), refs.pop(0)
  scale_bufs = tuple(refs.pop(0) if rows else None for rows in d.scale_rows)
  ids_buf = refs.pop(0) if d.spans else None
  return k_buf, v_buf, scale_bufs, ids_buf, refs.pop(0), refs


# -- forward ------------------------------------------------------------------------------

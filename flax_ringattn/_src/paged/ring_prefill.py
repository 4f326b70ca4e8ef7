"""`paged_ring_prefill`: one long prompt prefilled sequence-parallel into a paged cache spread over a mesh axis.

Layout (the ring prefill layout).  The prompt's T tokens, padded to Tp (a multiple of 2 n page_size:
`PagedKVCache.ring_prefill_len`), are cut into 2n chunks of c = Tp / (2n) tokens, whole pages, and dealt in the
zigzag order of `zigzag_order`: shard d holds chunks d and 2n - 1 - d.  `PagedKVCache.reserve_prefill` puts the
pages of chunk c on the device that holds it, so each device writes its prompt rows into its own pages and no
prefilled K/V crosses a link.  Rows past the T real tokens are padding: stored nowhere, output 0.

Worked example, n = 2, page_size 4, a 13-token prompt into an empty slot: Tp = 16, four chunks of one page each

    positions     0-3 | 4-7 | 8-11 | 12-15            chunks c0 c1 c2 c3
    shard 0       c0 c3: positions 0-3, 12 (13-15 padding), in pages of device 0
    shard 1       c1 c2: positions 4-11,                    in pages of device 1

Schedules, inside `jax.shard_map` over the axis, on device e of n (both start by writing e's rows of K/V into
e's own pages, the prompt's chunks e and 2n - 1 - e):

    pass-KV (a fresh slot: the prompt is the whole context; schedule "auto")
             the ring of `ring_attention` on the zigzag layout over the prompt's K/V shards, as the pages store
             them (quantized values dequantized): each hop moves K/V [Tp / n, K, H + Hv]
    pass-Q  (a cached prefix, or schedule "pass_q")
      hop h  : the q shard of device e - h attends over e's pages: its two chunks are two sequences of the paged
               kernel over a *compacted* page table (e's pages before the chunk, in order, then the chunk's own
               pages if e holds it), so the kernel reads and computes over 1/n of the context and the causal
               mask stays exact; (o, lse) merges into the accumulator travelling with that q
      rotate : q to e + 1 (n - 1 times) and the accumulator with it (n times: it comes home)

"auto" picks at run time (`lax.cond` on the slot's start, a replicated value, so every device takes the same
branch).  Compaction relies on every earlier token being visible to a prompt row, which a causal mask without a
window or chunk gives; with `local_window_size` or `chunk_size` the tables keep global columns (pages not on e masked), exact but with
compute over the whole context on every device.  Each device holds Tp / n rows of q, k, v and the output, so
activations are O(T / n) and the model's MLP runs on its shard.  A pass-Q hop moves q [Tp / n, N, H] and the
accumulator [Tp / n, N, Hv + 1] in f32: independent of the cached context, so a prompt extending a long context
(chunked prefill) costs the same per hop as a fresh one, where pass-KV would move the cache; for a fresh GQA
prompt pass-KV moves fewer bytes.  The sinks, applied to the merged rows, enter once.  Serving only: not
differentiable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify
from jax.sharding import PartitionSpec

from flax_ringattn._src import flash, layout, ragged, sharding, validation
from flax_ringattn._src.paged import allocator, checks, contracts, storage
from flax_ringattn._src.paged import op as paged_op
from flax_ringattn._src.paged.context_parallel import compact as compact_pages
from flax_ringattn._src.paged.context_parallel import owned_page_ids
from flax_ringattn._src.ring.op import ring_attention

F32 = jnp.float32


def paged_ring_prefill(
  q,
  k,
  v,
  k_pages,
  v_pages,
  kv_lens,
  page_indices,
  *,
  slot,
  num_tokens,
  k_scale=None,
  v_scale=None,
  local_window_size=None,
  chunk_size: int | None = None,
  logits_soft_cap: float | None = None,
  scale: float | None = None,
  sinks=None,
  implementation: str | None = None,
  block_sizes=None,
  interpret=None,
  checked: bool = False,
  schedule: str = "auto",
  mesh=None,
  seq_axis=None,
  axis_name=None,
  head_axis=None,
):
  """Prefills one prompt of slot `slot` sequence-parallel: its K/V into the cache, its attention out.

  Args:
    q: [Tp, N, H] the prompt's queries in the ring prefill layout (`zigzag_order(x, n, axis=0)` of the prompt
      padded to Tp = `cache.ring_prefill_len(T)` tokens), sharded over `seq_axis`; RoPE positions are
      `start + zigzag_positions(Tp, n)` with start = the slot's length before the prompt.
    k, v: [Tp, K, H] / [Tp, K, Hv] the prompt's keys and values, same layout (stored as the pages store them).
    k_pages, v_pages, k_scale, v_scale, kv_lens, page_indices: the cache after
      `PagedKVCache.reserve_prefill(slot, num_tokens, padded_len=Tp)` (its `attention_view()` lengths and
      table), pages spread over `seq_axis`; scales per token ([P, page_size, K]) as the cache keeps them.
    slot, num_tokens: the slot and the prompt's real tokens (<= Tp; the rest of the Tp rows is padding).
    local_window_size, chunk_size, logits_soft_cap, scale, sinks, implementation, block_sizes, interpret, checked:
      as for `paged_attention` (block_sizes for the paged kernel; the ring of pass-KV plans its own tiles).
    schedule: "auto" (default): pass-KV for a fresh slot (nothing cached before the prompt: the K/V shards
      travel the ring of `ring_attention`, fewer bytes than q and its accumulator for GQA), pass-Q otherwise
      (q travels, each device attends its own pages, cached prefix included); "pass_q": always pass-Q.
    mesh, seq_axis, head_axis: the mesh, its axis the pages and the prompt are spread over, and optionally an
      axis the kv heads are split over; or `axis_name` inside your own `jax.shard_map` (q, k, v then this
      device's Tp / n rows, the pages its shard).

  Returns:
    (out [Tp, N, Hv] in q.dtype and in the prompt's layout (padding rows 0), k_pages, v_pages, k_scale,
    v_scale) with the prompt's K/V stored in its pages.
  """
  if schedule not in ("auto", "pass_q"):
    raise ValueError(f"schedule={schedule!r} must be 'auto' or 'pass_q'")
  if axis_name is None and mesh is None:
    raise ValueError("paged_ring_prefill needs mesh=... with seq_axis=..., or axis_name=... inside your shard_map")
  if any(x is not None and getattr(x, "ndim", 0) != 3 for x in (k_scale, v_scale)):
    raise NotImplementedError(
      "paged_ring_prefill stores the prompt with per-token scales [P, page_size, K], as PagedKVCache keeps them; "
      f"got k_scale.shape={getattr(k_scale, 'shape', None)}, v_scale.shape={getattr(v_scale, 'shape', None)}"
    )
  if k_pages.ndim != 4:
    raise NotImplementedError(
      f"paged_ring_prefill writes pages [P, page_size, K, H]; got merged pages k_pages.shape={tuple(k_pages.shape)} "
      "(create the cache with merged=False for context-parallel serving)"
    )
  seq_axis, n = paged_op.context_parallel_axis(mesh, seq_axis, axis_name, k_pages.shape[0], head_axis, k_pages.shape[2])
  axis = axis_name if axis_name is not None else seq_axis
  rows = q.shape[0] // n if axis_name is None else q.shape[0]  # this device's rows
  _check_prompt(q, k, v, k_pages, v_pages, rows * n, n)
  pps = page_indices.shape[1]
  i32 = jnp.int32
  # The paged call each hop makes on a device: its q rows as two sequences over its pages.
  heads = 1 if head_axis is None else sharding.axes_size(mesh, head_axis)
  local_q = jax.ShapeDtypeStruct((rows, q.shape[1] // heads, q.shape[2]), q.dtype)
  call = paged_op.plan_call(
    local_q,
    k_pages,
    v_pages,
    jnp.zeros((2,), i32),
    jnp.zeros((2, pps), i32),
    jnp.zeros((3,), i32),
    jnp.ones((1,), i32),
    k_scale=k_scale,
    v_scale=v_scale,
    local_window_size=local_window_size,
    chunk_size=chunk_size,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    implementation=implementation,
    block_sizes=block_sizes,
    interpret=interpret,
  )
  sinks = validation.check_sinks(sinks, q.shape[1])
  validation.check_bool("checked", checked)
  kv_lens, page_indices = jnp.asarray(kv_lens, i32), jnp.asarray(page_indices, i32)
  Tp, S = rows * n, page_indices.shape[0]
  slot, num_tokens, valid = _check_request(slot, num_tokens, S, Tp, checked)
  num_pages = k_pages.shape[0] * (n if axis_name is not None else 1)
  # A refused request (traced slot out of range, num_tokens out of [0, Tp]) has no page to check.
  _check_placement(
    kv_lens,
    page_indices,
    jnp.clip(slot, 0, S - 1),
    jnp.where(valid, num_tokens, 0),
    Tp,
    n,
    k_pages.shape[1],
    num_pages,
    checked,
  )
  if q.shape[0] == 0:  # an empty prompt: empty out, the pages as they are
    return paged_op.empty_out(q, v_pages), k_pages, v_pages, call.k_scale, call.v_scale
  kernel = paged_op.PagedKernel(spec=call.spec, backend=call.backend)
  # Compacted tables put a row at a local position: exact only when every earlier token is visible anyway.
  compact = call.spec.mask.window is None and call.spec.mask.chunk_size is None
  ring = functools.partial(
    ring_attention,
    is_causal=True,
    load_balance=True,
    local_window_size=local_window_size,
    chunk_size=chunk_size,
    logits_soft_cap=logits_soft_cap,
    scale=call.spec.scale,
    implementation=implementation,
    interpret=interpret,
  )

  def prefill(sinks, q, k, v, k_pages, v_pages, kv_lens, table, slot, num_tokens, k_scale, v_scale):
    ring_n, sizes, shard, member = layout.ring_geometry(axis)
    # A request `_check_request` refuses is no slot's: start < 0 as for a refused (overflowed) one.
    valid = (slot >= 0) & (slot < S) & (num_tokens >= 0) & (num_tokens <= Tp)
    slot = jnp.clip(slot, 0, S - 1)
    row = owned_page_ids(table[slot], axis, k_pages.shape[0])  # [pps] this device's local ids, -1 elsewhere
    # < 0: the slot was refused (overflowed): nothing stored, nothing seen
    start = jnp.where(valid, kv_lens[slot] - num_tokens, -1)
    ps, c = k_pages.shape[1], q.shape[0] // 2
    chunks = _chunks(start, num_tokens, c, ring_n)
    own = chunks(shard)
    # The prompt's K/V as the pages store them (quantized once: written here, read back by pass-KV).
    k_st, v_st = (
      storage.quantize(p.dtype, sc is not None, x) for p, sc, x in ((k_pages, k_scale, k), (v_pages, v_scale, v))
    )
    k_pages, v_pages, k_scale, v_scale = _write(k_st, v_st, k_pages, v_pages, k_scale, v_scale, row, own, ps)

    def pass_q():
      o = jnp.zeros((*q.shape[:2], v_pages.shape[3]), F32)
      lse = jnp.full(q.shape[:2], -jnp.inf, F32)
      q_visit = q
      for h in range(ring_n):
        st, ql = chunks(layout.ring_shard((member - h) % ring_n, sizes))
        lens, tables = zip(*(_view(row, st[i], ql[i], c // ps, ps, compact) for i in range(2)), strict=True)
        meta = (
          jnp.stack(lens),
          jnp.stack(tables),
          jnp.stack([0, ql[0], ql[0] + ql[1]]).astype(i32),
          jnp.full((1,), 2, i32),
        )
        o_h, lse_h = call.backend.fwd(q_visit, k_pages, v_pages, *meta, k_scale, v_scale, spec=call.spec)
        o, lse = flash.merge_rows(o, lse, o_h.astype(F32), lse_h)
        if h + 1 < ring_n:
          q_visit = layout.rotate(q_visit, axis, ring_n)
        o, lse = layout.rotate((o, lse), axis, ring_n)
      return flash.apply_sinks(kernel, o, lse, sinks)[0].astype(q.dtype)

    def pass_kv():
      # A fresh slot: the prompt is the whole context, so the K/V shards travel the ring instead (the ring of
      # `ring_attention` on the zigzag layout), as the pages store them (quantized values dequantized).
      kd, vd = (ragged.dequantize(*x).astype(q.dtype)[None] for x in (k_st, v_st))
      out = ring(q[None], kd, vd, sinks=sinks, axis_name=axis)[0]
      rows = jnp.arange(q.shape[0])
      return jnp.where((rows % c < own[1][rows // c])[:, None, None], out, 0).astype(q.dtype)

    out = jax.lax.cond(start == 0, pass_kv, pass_q) if schedule == "auto" else pass_q()
    return out, k_pages, v_pages, k_scale, v_scale

  args = (sinks, q, k, v, k_pages, v_pages, kv_lens, page_indices, slot, num_tokens, call.k_scale, call.v_scale)
  if axis_name is not None:
    return prefill(*args)
  h, rep = head_axis, PartitionSpec()
  pages, heads = PartitionSpec(seq_axis, None, h, None), PartitionSpec(seq_axis, h, None)
  scales = tuple(paged_op.scale_spec(x, seq_axis, h) for x in (call.k_scale, call.v_scale))
  specs = (None if sinks is None else PartitionSpec(h), heads, heads, heads, pages, pages, rep, rep, rep, rep, *scales)
  result, placed = paged_op.shard_mapped(prefill, mesh, args, specs, (heads, pages, pages, *scales))
  out, *cache = result
  before = (*placed[4:6], *placed[10:12])  # the pages and scales typed exactly as they came in
  return (out, *(x if x is None else allocator.placed_like(x, y) for x, y in zip(cache, before, strict=True)))


def _chunks(start, num_tokens, c: int, n: int):
  """chunks(shard) -> (first positions [2], real rows [2]) of a shard's two zigzag chunks of c tokens."""

  def of(shard):
    first = start + jnp.stack([shard, 2 * n - 1 - shard]) * c
    real = jnp.where(start >= 0, jnp.clip(start + num_tokens - first, 0, c), 0)
    return first.astype(jnp.int32), real.astype(jnp.int32)

  return of


def _view(row, first, real, chunk_pages: int, ps: int, compact: bool):
  """(kv_len, table [pps]) of one q chunk (positions first .. first + real - 1) over this device's pages `row`.

  Compacted: the device's pages before the chunk in order (all full, all visible), then the chunk's own pages
  when the device holds it (else nothing: -1), so the chunk's row i sits at local position kv_len - real + i
  exactly as the paged kernel's causal mask expects.  Not compacted (windows): global columns, global positions.
  """
  pps = row.shape[0]
  j = jnp.arange(pps)
  col = first // ps
  if not compact:
    return first + real, jnp.where(j < col + chunk_pages, row, -1)
  earlier, cb = (x[0] for x in compact_pages(row[None], ((row >= 0) & (j < col))[None]))
  own = row[jnp.clip(col + j - cb, 0, pps - 1)]
  table = jnp.where(j < cb, earlier, jnp.where(j - cb < chunk_pages, own, -1))
  return cb * ps + real, table


def _write(k_st, v_st, k_pages, v_pages, k_scale, v_scale, row, chunk, ps: int):
  """This device's prompt rows (its two chunks; k_st, v_st as `storage.quantize` gives them) into its own pages;
  padding and refused rows go nowhere."""
  first, real = chunk
  c = k_st[0].shape[0] // 2
  i = jnp.arange(2 * c)
  half = i // c
  pos = first[half] + i % c
  ok = (i % c < real[half]) & (pos >= 0)
  page = row[jnp.clip(pos // ps, 0, row.shape[0] - 1)]
  page = jnp.where(ok & (page >= 0), page, k_pages.shape[0])
  k_pages, k_scale = storage.write(k_pages, k_scale, page, pos % ps, *k_st)
  v_pages, v_scale = storage.write(v_pages, v_scale, page, pos % ps, *v_st)
  return k_pages, v_pages, k_scale, v_scale


def _check_prompt(q, k, v, k_pages, v_pages, Tp: int, n: int):
  """Static shapes: q [Tp, N, H], k [Tp, K, H], v [Tp, K, Hv] as the pages store them, Tp whole zigzag pages."""
  _, ps, K, H = k_pages.shape
  Hv = v_pages.shape[3]
  if q.ndim != 3 or q.shape[2] != H:
    raise ValueError(f"q must be [Tp, N, H] with H={H} as k_pages stores it, got q.shape={tuple(q.shape)}")
  for name, x, want in (("k", k, (q.shape[0], K, H)), ("v", v, (q.shape[0], K, Hv))):
    if tuple(x.shape) != want:
      raise ValueError(
        f"{name} must be [Tp, K, {'H' if name == 'k' else 'Hv'}] = {list(want)} like q and the pages, got "
        f"{name}.shape={tuple(x.shape)}"
      )
  if Tp % (2 * n * ps):
    raise ValueError(
      f"the prompt's padded length Tp={Tp} must be a multiple of 2 * n * page_size = 2 * {n} * {ps} = {2 * n * ps} "
      "(2n zigzag chunks of whole pages; pad it to PagedKVCache.ring_prefill_len(num_tokens))"
    )


def _check_request(slot, num_tokens, S: int, Tp: int, checked: bool):
  """(slot, num_tokens, valid): a slot in [0, S) and 0 <= num_tokens <= Tp, raised eagerly on concrete values (a
  negative slot would wrap to the last one); traced, `valid` says whether the request stands (else the prefill
  stores and sees nothing), and `checked` adds checkify checks."""
  where = "paged_ring_prefill"
  slot, _, in_range = contracts.slot("slot", slot, S, where)
  num_tokens = contracts.scalar_int("num_tokens", num_tokens, where)

  def problems():
    bad = (num_tokens < 0) | (num_tokens > Tp)
    message = "num_tokens={t} must be in [0, Tp={Tp}] (the prompt's real tokens; the rest of its rows is padding)"
    return [*contracts.slot_problems("slot", slot, S), (bad, message, dict(t=num_tokens, Tp=jnp.int32(Tp)))]

  checks.enforce(problems, (slot, num_tokens), where=where, checked=checked)
  return slot, num_tokens, in_range & (num_tokens >= 0) & (num_tokens <= Tp)


def _check_placement(kv_lens, table, slot, num_tokens, Tp: int, n: int, ps: int, num_pages: int, checked: bool):
  """Every page of the prompt's real tokens must lie on the device whose shard holds its chunk (as
  `PagedKVCache.reserve_prefill` places them): otherwise its K/V could not be stored.  Raises on concrete
  arrays, adds a `checkify` check under jit with `checked`."""
  concrete = validation.all_concrete(kv_lens, table, slot, num_tokens)
  if not concrete and not checked:
    return
  if concrete:  # on the host: arrays typed on a mesh need no mesh context there
    kv_lens, table, slot, num_tokens = (np.asarray(x) for x in (kv_lens, table, slot, num_tokens))
  start = kv_lens[slot] - num_tokens
  # The owner reserve_prefill gives each column (the prompt's from `start` on), and where its page lies.
  want = allocator.prefill_owners(jnp.asarray(kv_lens).at[slot].set(start), slot, Tp, ps, table.shape[1], n)[slot]
  j = jnp.arange(table.shape[1])
  used = (start >= 0) & (j * ps >= start) & (j * ps < start + num_tokens)
  ids = jnp.asarray(table)[slot]
  bad = used & ((ids < 0) | (ids // (num_pages // n) != want))
  col = jnp.argmax(bad)
  message = (
    "paged_ring_prefill: page column {col} of slot {s} (page id {pid}) must lie on device {want} of n={n}, whose "
    "prompt shard holds its tokens: reserve the prompt's pages with PagedKVCache.reserve_prefill(slot, num_tokens, "
    "padded_len=Tp) (the ring prefill layout), which places them so"
  )
  values = dict(col=col, s=slot, pid=ids[col], want=want[col], n=n)
  if concrete:
    if bool(jnp.any(bad)):
      raise ValueError(message.format(**{k: int(x) for k, x in values.items()}))
  else:
    checkify.check(~jnp.any(bad), message, **{k: jnp.asarray(x, jnp.int32) for k, x in values.items()})

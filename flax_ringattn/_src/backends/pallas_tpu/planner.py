"""VMEM-aware tile planner for the Pallas TPU block kernels.

The footprint model lives here and only here: `footprint()` counts every
buffer the forward, dq and dk/dv kernels allocate (pipelined input and output
tiles twice, for double buffering; VMEM scratch once) plus the f32
score-sized temporaries the kernel body keeps live.  `tests/test_planner.py`
checks the buffer part against `common.plan_vmem_bytes` of the kernels' own
`CallPlan`s, so a kernel change that adds a buffer fails a test until the model
learns it.

Per-generation VMEM capacities are per TensorCore, from JAX's own hardware
table (`jax/_src/pallas/mosaic/tpu_info.py`, JAX 0.10.2, which cites each
number); a test checks this table against `pltpu.get_tpu_info_for_chip`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src.backends.pallas_tpu import common as c
from flax_ringattn._src.block_sizes import BlockSizes

MiB = 1024 * 1024

# generation -> VMEM bytes per TensorCore (source: JAX 0.10.2 tpu_info.py).
VMEM_BYTES = {
  "v4": 16 * MiB,
  "v5e": 128 * MiB,
  "v5p": 64 * MiB,
  "v6e": 128 * MiB,
  "v7x": 64 * MiB,
}
# The fraction of VMEM a plan may use: Mosaic keeps internal scratch and
# spills matmul operands, and a plan that fills VMEM exactly fails to compile.
SAFETY_MARGIN = 0.75
# Off TPU (interpret mode, or planning ahead) plan for the smallest VMEM.
DEFAULT_GENERATION = "v4"
# Larger tiles stop paying: a 1024-row q tile already feeds the MXU for many
# cycles per DMA, while causal and window skipping get coarser with tile size.
MAX_TILE = 2048


@dataclasses.dataclass(frozen=True)
class Footprint:
  """VMEM bytes of one kernel: `buffers` (BlockSpec tiles and scratch) + `temporaries`."""

  buffers: int
  temporaries: int

  @property
  def total(self) -> int:
    return self.buffers + self.temporaries


def _tile(rows: int, cols: int, dtype, lead: int = 1) -> int:
  """Bytes of a [lead, rows, cols] VMEM buffer padded to (sublane, lane) tiles."""
  return c.padded_bytes((lead, rows, cols), dtype)


def footprint(
  kernel: str, *, bq, bk, num_heads, num_kv_heads, head_dim, dtype, has_segments=False, soft_cap=False, dropout=False
):
  """Footprint of kernel 'fwd', 'dq' or 'dkv' at tiles (bq, bk)."""
  G, H, f32, i32 = num_heads // num_kv_heads, head_dim, jnp.float32, jnp.int32
  q_tile = _tile(bq, H, dtype, G)  # q or do: the G heads of a group
  kv_tile = _tile(bk, H, dtype)
  row_stat = _tile(bq, 1, f32, G)  # lse / delta, [G, bq, 1]
  mask = _tile(bq, 1, i32) + _tile(1, bk, i32)  # positions
  if has_segments:
    mask *= 2
  score = G * bq * bk * 4  # one f32 [G * bq, bk] tile
  if kernel == "fwd":
    inputs = q_tile + 2 * kv_tile + mask
    outputs = _tile(bq, H, f32, G) + row_stat
    scratch = 2 * _tile(bq, c.LANES, f32, G) + _tile(bq, H, f32, G)  # m, l, acc
    temporaries = 3 * score  # s, its masked copy, p (and p cast to the input dtype)
  elif kernel == "dq":
    inputs = 2 * q_tile + 2 * row_stat + 2 * kv_tile + mask
    outputs = _tile(bq, H, f32, G)
    scratch = _tile(G * bq, H, f32)
    temporaries = 5 * score  # s (masked), p, dp, ds, ds * scale cast for the matmul
  elif kernel == "dkv":
    inputs = 2 * kv_tile + 2 * q_tile + 2 * row_stat + mask
    outputs = 2 * _tile(bk, H, f32)
    scratch = 2 * _tile(bk, H, f32)
    temporaries = 5 * score  # as dq, plus p cast for dV sharing the same live range
  else:
    raise ValueError(f"kernel must be 'fwd', 'dq' or 'dkv', got {kernel!r}")
  if soft_cap:
    temporaries += 2 * score  # raw / cap and tanh(raw / cap), kept for the gradient
  if dropout:
    temporaries += 2 * score  # the int32 hash of the keep mask and the f32 keep / (1 - rate) scale
  return Footprint(buffers=2 * (inputs + outputs) + scratch, temporaries=temporaries)


def candidates(length: int, align: int) -> list[int]:
  """Legal tiles for an axis of `length` tokens, ascending: aligned divisors, and the whole axis."""
  out = {length} if length <= MAX_TILE else set()
  out |= {t for t in range(align, min(length, MAX_TILE) + 1, align) if length % t == 0}
  return sorted(out)


def q_candidates(q_len: int, dtype, *, grouped: bool) -> list[int]:
  """Legal q tiles; grouped heads (N > K) need sublane-aligned ones (see common.block_tiles)."""
  sub = c.sublanes(dtype)
  return [t for t in candidates(q_len, sub) if not grouped or t % sub == 0]


def budget_bytes(generation: str) -> int:
  return int(vmem_bytes(generation) * SAFETY_MARGIN)


def hbm_bytes(kernel: str, *, bq, bk, q_len, kv_len, num_heads, num_kv_heads, head_dim, dtype) -> int:
  """HBM bytes one block's kernel moves when every tile is live.

  The forward and dq kernels stream all of K/V once per q tile, the dk/dv kernel
  streams q, dO, lse and delta once per kv tile; the other operands move once.
  This is what the planner minimises: within the VMEM budget, taller q tiles
  (forward, dq) and wider kv tiles (dk/dv) cut the re-streaming.
  """
  b = jnp.dtype(dtype).itemsize
  q_side = q_len * num_heads * head_dim * b  # q (or do)
  kv_side = kv_len * num_kv_heads * head_dim * b  # k (or v)
  stats = q_len * num_heads * 4  # lse or delta
  out_q = q_len * num_heads * head_dim * 4  # f32 o or dq
  if kernel == "fwd":
    return q_side + (q_len // bq) * 2 * kv_side + out_q + stats  # + lse
  if kernel == "dq":
    return 2 * q_side + 2 * stats + (q_len // bq) * 2 * kv_side + out_q
  if kernel == "dkv":
    return 2 * kv_side + (kv_len // bk) * (2 * q_side + 2 * stats) + 2 * kv_len * num_kv_heads * head_dim * 4
  raise ValueError(f"kernel must be 'fwd', 'dq' or 'dkv', got {kernel!r}")


def _traffic(kernels, bq, bk, **shape) -> int:
  """`hbm_bytes` summed over `kernels` ('fwd', 'dq', 'dkv') at tiles (bq, bk)."""
  return sum(hbm_bytes(k, bq=bq, bk=bk, **shape) for k in kernels)


def _best(kernels, q_len, kv_len, dtype, budget, **dims):
  """The fitting (bq, bk) with the least HBM traffic, then the largest area.

  HBM bytes never grow with either tile, so a tile one step larger than the
  choice in either dimension does not fit (else it would have been chosen).
  """
  best, best_key = None, None
  grouped = dims["num_heads"] > dims["num_kv_heads"]
  heads = {k: dims[k] for k in ("num_heads", "num_kv_heads", "head_dim")}
  for bq in q_candidates(q_len, dtype, grouped=grouped):
    for bk in candidates(kv_len, c.LANES):
      need = max(footprint(k, bq=bq, bk=bk, dtype=dtype, **dims).total for k in kernels)
      if need > budget:
        continue
      traffic = _traffic(kernels, bq, bk, q_len=q_len, kv_len=kv_len, dtype=dtype, **heads)
      key = (traffic, -bq * bk, -bq)
      if best_key is None or key < best_key:
        best, best_key = (bq, bk), key
  return best


def current_generation() -> str:
  """The attached TPU's generation name ('v5e', ...), or DEFAULT_GENERATION off TPU.

  A chip missing from VMEM_BYTES (v2, v3, v4i, 7, 8i, ...) is named by JAX's
  chip version; `vmem_bytes` then asks JAX for its capacity.
  """
  if jax.default_backend() != "tpu":
    return DEFAULT_GENERATION
  version = str(pltpu.get_tpu_info().chip_version.value).lower()
  version = {"7x": "v7x", "tpu7x": "v7x"}.get(version, version)
  return version if version.startswith("v") or version in VMEM_BYTES else f"v{version}"


def vmem_bytes(generation: str) -> int:
  """VMEM per TensorCore: the table for known generations, else JAX's own number for the attached chip."""
  if generation in VMEM_BYTES:
    return VMEM_BYTES[generation]
  if jax.default_backend() == "tpu" and generation == current_generation():
    return int(pltpu.get_tpu_info().vmem_capacity_bytes)
  raise ValueError(f"unknown TPU {generation=}; known generations: {tuple(VMEM_BYTES)}")


def plan_block_sizes(
  q_len: int,
  kv_len: int,
  num_heads: int,
  num_kv_heads: int,
  head_dim: int,
  dtype,
  *,
  generation: str | None = None,
  has_segments: bool = False,
  soft_cap: bool = False,
  dropout: bool = False,
) -> BlockSizes:
  """The largest tiles whose VMEM footprint fits `generation`'s budget.

  Args:
    q_len, kv_len: the lengths one block sees: the per-device shard lengths
      of the ring (T / ring size and S / ring size).
    num_heads, num_kv_heads, head_dim: N, K and H of the local shard.
    dtype: the input dtype (float32 or bfloat16).
    generation: 'v4', 'v5e', 'v5p', 'v6e' or 'v7x'; None: the attached TPU's,
      or the smallest-VMEM generation off TPU.
    has_segments, soft_cap, dropout: whether the call uses segment ids / a
      soft cap / attention dropout (each adds buffers or temporaries).

  Returns:
    `BlockSizes` with forward and backward tiles: of the legal tiles (at most
    MAX_TILE) whose footprint fits, those with the least HBM traffic
    (`hbm_bytes`), then the largest.
  """
  generation = current_generation() if generation is None else generation
  budget = budget_bytes(generation)
  for name, value in (
    ("q_len", q_len),
    ("kv_len", kv_len),
    ("num_heads", num_heads),
    ("num_kv_heads", num_kv_heads),
    ("head_dim", head_dim),
  ):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"plan_block_sizes: {name} must be a positive int, got {name}={value!r}")
  if num_heads % num_kv_heads:
    raise ValueError(f"plan_block_sizes: num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}")
  dims = dict(
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    has_segments=has_segments,
    soft_cap=soft_cap,
    dropout=dropout,
  )
  fwd = _best(("fwd",), q_len, kv_len, dtype, budget, **dims)
  bwd = _best(("dq", "dkv"), q_len, kv_len, dtype, budget, **dims)
  if fwd is None or bwd is None:
    qs = q_candidates(q_len, dtype, grouped=num_heads > num_kv_heads)
    ks = candidates(kv_len, c.LANES)
    if not qs or not ks:
      whole = " (with grouped heads it must be aligned too)" if num_heads > num_kv_heads else ""
      raise ValueError(
        f"plan_block_sizes: no legal TPU tile for q_len={q_len} (multiples of {c.sublanes(dtype)} up to {MAX_TILE}, "
        f"or the whole axis up to {MAX_TILE}{whole}) or kv_len={kv_len} (multiples of {c.LANES}, same rule)"
      )
    smallest = footprint("dq", bq=qs[0], bk=ks[0], dtype=dtype, **dims).total
    raise ValueError(
      f"plan_block_sizes: no legal tiles for q_len={q_len}, kv_len={kv_len} fit the {generation} VMEM budget "
      f"of {budget / MiB:.1f} MiB (smallest tiles need {smallest / MiB:.1f} MiB with {num_heads // num_kv_heads} "
      f"q heads per kv head and head_dim={head_dim})"
    )
  return BlockSizes(block_q=fwd[0], block_kv=fwd[1], block_q_bwd=bwd[0], block_kv_bwd=bwd[1])


def vmem_limit_bytes(generation: str) -> int:
  """The scoped VMEM limit a kernel asks Mosaic for: nearly all of VMEM (the
  planner keeps footprints within SAFETY_MARGIN; Mosaic's default scoped limit
  is far lower on most chips)."""
  return int(vmem_bytes(generation) * 0.9)


# -- the ragged paged kernel (`paged.py`) ---------------------------------------------------

# Pages per kv block stop paying past this many tokens: the copies of one block
# already amortise their issue cost, and a larger block wastes more of a
# sequence's last, partial block.
PAGED_MAX_BLOCK_TOKENS = 512
PAGED_MAX_BLOCK_Q = 256


def paged_footprint(
  kernel: str,
  *,
  bq,
  pages_per_block,
  page_size,
  num_heads,
  num_kv_heads,
  head_dim,
  dtype,
  page_dtype,
  scale_rows=(0, 0),
  soft_cap=False,
) -> Footprint:
  """VMEM of the paged kernel 'paged_fwd' or 'paged_bwd' at `bq` rows and `pages_per_block` pages per kv block.

  `scale_rows`: per-page rows of (k_scale, v_scale): 0 without a scale, 1 per page (and for a scalar scale),
  page_size per token.  Pages stay in HBM; the kernel copies them into a two-slot buffer itself.
  """
  N, K, H, ps, ppb = num_heads, num_kv_heads, head_dim, page_size, pages_per_block
  G, L, f32 = N // K, pages_per_block * page_size, jnp.float32
  q_block = c.padded_bytes((bq, N, H), dtype)
  kv_slots = 2 * c.padded_bytes((2, ppb, ps, K, H), page_dtype)
  kv_slots += sum(c.padded_bytes((2, ppb, r, K), f32) for r in scale_rows if r)
  score = G * bq * L * 4  # one f32 [bq * G, L] tile
  head_kv = 2 * L * H * 4  # one kv head's K and V block, dequantised to f32
  if kernel == "paged_fwd":
    pipelined = q_block + c.padded_bytes((bq, N, H), dtype) + c.padded_bytes((bq, N), f32)  # q; o, lse
    scratch = kv_slots + 2 * c.padded_bytes((K, bq * G, c.LANES), f32) + c.padded_bytes((bq, N, H), f32)
    temporaries = 3 * score + head_kv
  elif kernel == "paged_bwd":
    pipelined = (
      2 * q_block + 2 * c.padded_bytes((bq, N), f32) + c.padded_bytes((bq, N, H), f32)
    )  # q, do, lse, delta; dq
    scratch = kv_slots + c.padded_bytes((bq, N, H), f32) + 2 * c.padded_bytes((ppb, ps, K, H), f32)
    scratch += c.padded_bytes((ps, K, H), f32)
    temporaries = 5 * score + head_kv
  else:
    raise ValueError(f"kernel must be 'paged_fwd' or 'paged_bwd', got {kernel!r}")
  if soft_cap:
    temporaries += score
  return Footprint(buffers=2 * pipelined + scratch, temporaries=temporaries)


def plan_paged_block_sizes(
  max_num_batched_tokens: int,
  page_size: int,
  pages_per_seq: int,
  num_heads: int,
  num_kv_heads: int,
  head_dim: int,
  dtype,
  page_dtype=None,
  *,
  scale_rows=(0, 0),
  soft_cap=False,
  generation: str | None = None,
) -> BlockSizes:
  """`BlockSizes(block_q=rows per grid step, block_kv=tokens per kv block)` for the paged kernel.

  The largest kv block up to PAGED_MAX_BLOCK_TOKENS tokens (whole pages, at most a sequence's pages), then the
  tallest q block up to PAGED_MAX_BLOCK_Q rows (a prefill spanning several q blocks reads its pages once per
  block), such that both the forward and the backward kernels fit `generation`'s VMEM budget.
  """
  generation = current_generation() if generation is None else generation
  budget = budget_bytes(generation)
  page_dtype = dtype if page_dtype is None else page_dtype
  sub = c.sublanes(dtype)
  qs = [t for t in candidates(max_num_batched_tokens, sub) if t <= PAGED_MAX_BLOCK_Q and t % sub == 0]
  if not qs:
    qs = [max_num_batched_tokens] if max_num_batched_tokens <= PAGED_MAX_BLOCK_Q else []
  pbs = [p for p in range(1, pages_per_seq + 1) if p * page_size <= max(PAGED_MAX_BLOCK_TOKENS, page_size)]
  dims = dict(
    page_size=page_size,
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    dtype=dtype,
    page_dtype=page_dtype,
    scale_rows=scale_rows,
    soft_cap=soft_cap,
  )
  for ppb in sorted(pbs, reverse=True):
    for bq in sorted(qs, reverse=True):
      need = max(paged_footprint(k, bq=bq, pages_per_block=ppb, **dims).total for k in ("paged_fwd", "paged_bwd"))
      if need <= budget:
        return BlockSizes(block_q=bq, block_kv=ppb * page_size)
  raise ValueError(
    f"plan_paged_block_sizes: no q block of {max_num_batched_tokens=} (multiples of {sub} up to "
    f"{PAGED_MAX_BLOCK_Q}) with whole pages of {page_size=} fits the {generation} VMEM budget of "
    f"{budget / MiB:.1f} MiB ({num_heads=}, {num_kv_heads=}, {head_dim=})"
  )


def ring_footprint(
  kernel: str,
  *,
  T,
  S,
  bq,
  bk,
  num_heads,
  num_kv_heads,
  head_dim,
  dtype,
  has_segments=False,
  soft_cap=False,
  dropout=False,
) -> Footprint:
  """VMEM of an in-kernel ring kernel: 'ring_fwd' / 'ring_bwd' (VMEM slots, `ring_forward.py`,
  `ring_backward.py`) or 'ring_fwd_hbm' / 'ring_bwd_hbm' (HBM slots, `ring_forward_hbm.py`, `ring_backward_hbm.py`).

  With VMEM slots a grid step holds the whole q shard of one kv head's group
  (T rows) and two communication slots of the kv shard (S rows) for each
  travelling array: K, V (and the kv segment ids); the backward adds two f32
  slots each for the dK / dV accumulators and one f32 local sum each.
  With HBM slots only tiles are in VMEM, whatever T and S: the outer tile of
  a pass and its state once, the streamed inner tiles twice (double buffers).
  Temporaries are those of one (bq, bk) tile pair, as in `footprint`.
  """
  G, H, f32, i32 = num_heads // num_kv_heads, head_dim, jnp.float32, jnp.int32
  score = G * bq * bk * 4
  if kernel in ("ring_fwd", "ring_bwd"):
    q_blk = _tile(T, H, dtype, G)
    stat = _tile(T, 1, f32, G)
    slots = 2 * _tile(S, H, dtype, 2)  # K and V, two slots each
    seg_in = _tile(T, 1, i32) if has_segments else 0  # the q segment ids column
    if has_segments:
      slots += _tile(1, S, i32, 2)
  if kernel == "ring_fwd":
    inputs = q_blk + seg_in
    outputs = _tile(T, H, f32, G) + stat
    scratch = slots + 2 * _tile(T, c.LANES, f32, G) + _tile(T, H, f32, G)  # m, l, acc
    temporaries = 3 * score
  elif kernel == "ring_bwd":
    inputs = 2 * q_blk + 2 * stat + seg_in
    outputs = _tile(T, H, f32, G) + 2 * _tile(S, H, f32)
    scratch = slots + 2 * _tile(S, H, f32, 2) + 2 * _tile(S, H, f32)
    temporaries = 5 * score
  elif kernel in ("ring_fwd_hbm", "ring_bwd_hbm"):
    inputs = outputs = 0  # everything pipelined by hand: scratch only
    kv_tiles = 2 * _tile(bk, H, dtype, 2) + (_tile(1, bk, i32, 2) if has_segments else 0)  # [2] x (k, v, seg)
    if kernel == "ring_fwd_hbm":
      q_tile = _tile(bq, H, dtype, G) + (_tile(bq, 1, i32) if has_segments else 0)
      state = 2 * _tile(bq, c.LANES, f32, G) + _tile(bq, H, f32, G) + _tile(bq, 1, f32, G)  # m, l, acc, lse
      scratch = q_tile + kv_tiles + state
      temporaries = 3 * score
    else:
      q_side = 2 * _tile(bq, H, dtype, G) + 2 * _tile(bq, 1, f32, G) + (_tile(bq, 1, i32) if has_segments else 0)
      scratch = 2 * q_side + kv_tiles + _tile(bq, H, f32, G) + 2 * _tile(bk, H, f32)  # dq; dk, dv of a kv tile
      temporaries = 5 * score
  else:
    raise ValueError(f"kernel must be 'ring_fwd', 'ring_bwd', 'ring_fwd_hbm' or 'ring_bwd_hbm', got {kernel!r}")
  if soft_cap:
    temporaries += 2 * score
  if dropout:
    temporaries += 2 * score  # as in `footprint`
  return Footprint(buffers=2 * (inputs + outputs) + scratch, temporaries=temporaries)


RING_KINDS_PER_WORD = 16  # the ring's tile table packs 2-bit tile classes, 16 to an int32 word (a power of two:
# `ring_protocol.tile_kind` unpacks with shifts and masks)


def ring_table_bytes(n: int, q_tiles: int, kv_tiles: int) -> int:
  """SMEM bytes of the ring's tile table: n hops x q_tiles rows of ceil(kv_tiles / 16) int32 words, 1-D."""
  return n * q_tiles * -(-kv_tiles // RING_KINDS_PER_WORD) * 4


@dataclasses.dataclass(frozen=True)
class RingPlan:
  """Where the in-kernel ring keeps its slots ("vmem" or "hbm") and its tiles, for one direction."""

  slots: str
  bq: int
  bk: int


def plan_ring(
  *,
  T,
  S,
  n,
  num_heads,
  num_kv_heads,
  head_dim,
  dtype,
  backward: bool,
  has_segments=False,
  soft_cap=False,
  dropout=False,
  tiles=None,
  generation=None,
) -> RingPlan:
  """Slots and tiles of the in-kernel ring's forward (or backward) kernel on (T, S) shards of a ring of n.

  VMEM slots when some legal tiles fit `generation`'s budget with the whole
  shards resident (no HBM traffic inside a hop), at the largest such tiles;
  else HBM slots (only tiles in VMEM, any shard length), at the tiles with the
  least HBM traffic (`hbm_bytes` of the block kernels the passes mirror), then
  the largest.  Either way the ring's tile table (`ring_table_bytes`) must
  fit its SMEM share.  `tiles=(bq, bk)` (the caller's BlockSizes) is kept and
  only the slots are chosen.
  """
  generation = current_generation() if generation is None else generation
  budget = budget_bytes(generation)
  if tiles is not None:
    pairs = [tuple(tiles)]
  else:
    qs = q_candidates(T, dtype, grouped=num_heads > num_kv_heads)
    pairs = [(bq, bk) for bq in qs for bk in candidates(S, c.LANES)]
    if not pairs:
      raise ValueError(
        f"plan_ring: no legal TPU tile for q_len={T} (multiples of {c.sublanes(dtype)} up to {MAX_TILE}, or the "
        f"whole axis up to {MAX_TILE}) or kv_len={S} (multiples of {c.LANES}, same rule)"
      )
    pairs = [(bq, bk) for bq, bk in pairs if ring_table_bytes(n, T // bq, S // bk) <= c.SMEM_TABLE_BYTES]
  dims = dict(
    T=T,
    S=S,
    num_heads=num_heads,
    num_kv_heads=num_kv_heads,
    head_dim=head_dim,
    dtype=dtype,
    has_segments=has_segments,
    soft_cap=soft_cap,
    dropout=dropout,
  )
  name = "ring_bwd" if backward else "ring_fwd"
  resident = [(bq, bk) for bq, bk in pairs if ring_footprint(name, bq=bq, bk=bk, **dims).total <= budget]
  if resident:
    bq, bk = max(resident, key=lambda t: (t[0] * t[1], t[0]))
    return RingPlan("vmem", bq, bk)
  streamed = [(bq, bk) for bq, bk in pairs if ring_footprint(name + "_hbm", bq=bq, bk=bk, **dims).total <= budget]
  if tiles is not None and not streamed:
    streamed = pairs  # the caller's tiles: run them as asked (Mosaic reports what does not fit)
  if not streamed:
    raise ValueError(
      f"plan_ring: no legal tiles of the q_len={T}, kv_len={S} shards fit the {generation} VMEM budget of "
      f"{budget / MiB:.1f} MiB with HBM slots ({num_heads // num_kv_heads} q heads per kv head, "
      f"head_dim={head_dim}), with a tile table for a ring of {n} within {c.SMEM_TABLE_BYTES} bytes of SMEM"
    )
  passes = ("dq", "dkv") if backward else ("fwd",)

  def key(t):
    bq, bk = t
    traffic = _traffic(
      passes, bq, bk, q_len=T, kv_len=S, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype
    )
    if backward:
      # `hbm_bytes` counts lse and delta at 4 bytes a row; the dK/dV pass copies their [G, bq, 1] f32 tiles,
      # which TPU HBM tiling pads to 128 lanes, once per kv tile.
      traffic += (S // bk) * 2 * T * num_heads * (c.LANES - 1) * 4
    return (traffic, -bq * bk, -bq)

  bq, bk = min(streamed, key=key)
  return RingPlan("hbm", bq, bk)


def ring_fits(
  *,
  T,
  S,
  n=1,
  num_heads,
  num_kv_heads,
  head_dim,
  dtype,
  has_segments=False,
  soft_cap=False,
  dropout=False,
  generation=None,
) -> bool:
  """Whether `plan_ring` finds slots and tiles for both directions on (T, S) shards of a ring of n."""
  try:
    for backward in (False, True):
      plan_ring(
        T=T,
        S=S,
        n=n,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        backward=backward,
        has_segments=has_segments,
        soft_cap=soft_cap,
        dropout=dropout,
        generation=generation,
      )
  except ValueError:
    return False
  return True

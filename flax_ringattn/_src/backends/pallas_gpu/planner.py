"""GPU tile rules and launch planner of the Pallas Triton kernels.

Triton tensors have power-of-two sizes and `tl.dot` wants every matmul
dimension >= 16, so a tile here is a power of two: q tiles hold `bq` tokens of
the G = N / K q heads of one kv head, stacked into R = G * bq rows (R >= 16);
kv tiles hold bk >= 16 tokens.  The q/k head dim H and the v head dim Hv
(v, o, do, dv; MLA has Hv != H) are each zero-padded to their own
`padded_head_dim`, a power of two >= 16 (see `common`); below, H and Hv are
the padded dims the kernels hold.

Shared memory model (per thread block; what Triton's software pipeliner keeps
in shared memory, the rest, the f32 accumulators o [R, Hv], dq [R, H],
dk [bk, H] and dv [bk, Hv] included, lives in registers)::

    fwd  : R*H (q)             + stages * bk*(H + Hv) (k, v)   + R*bk (p, relayout for p @ v)
    dq   : R*(H + Hv) (q, do)  + stages * bk*(H + Hv) (k, v)   + 2*R*bk (p, ds)
    dkv  : bk*(H + Hv) (k, v)  + stages * (R*(H + Hv) + 2*R*4) (q, do, lse, delta) + 2*R*bk (p, ds)

in bytes of the input dtype (statistics in f32).  It is a model, checked
against nothing on a GPU yet (no GPU was available when it was written): it
errs on the generous side and keeps a safety margin below each GPU's opt-in
shared memory per block (`SMEM_PER_BLOCK`).  `launch_config` picks the deepest
pipeline (num_stages 3, 2, then 1) that fits and raises a ValueError naming
the tile, the GPU and the bytes when even one stage does not.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_ringattn._src.block_sizes import BlockSizes
from flax_ringattn._src.perf import hardware

KiB = 1024
MIN_DOT = 16  # tl.dot: every matmul dimension >= 16
SAFETY_MARGIN = 0.9

# arch -> opt-in shared memory per thread block, from the package's hardware table (`_src/perf/hardware.py`,
# which cites the CUDA programming guide, "Compute capabilities", table 21).
SMEM_PER_BLOCK = hardware.smem_per_block_by_arch()
DEFAULT_ARCH = "sm_80"  # off GPU (interpret mode, tests): the A100's limits


def current_arch() -> str:
  """'sm_XY' of the first attached GPU, or DEFAULT_ARCH off GPU.  A GPU the table does not know is planned as
  the known arch with the least shared memory among those from sm_80 up to it (consumer and datacenter parts
  of one generation differ: sm_86 has 99 KiB, sm_80 163 KiB)."""
  if jax.default_backend() != "gpu":
    return DEFAULT_ARCH
  cc = getattr(jax.devices()[0], "compute_capability", None)
  if not cc:
    return DEFAULT_ARCH
  arch = "sm_" + str(cc).replace(".", "")
  if arch in SMEM_PER_BLOCK:
    return arch
  cc = int(arch[3:])
  known = [a for a in SMEM_PER_BLOCK if 80 <= int(a[3:]) <= cc] or list(SMEM_PER_BLOCK)
  return min(known, key=SMEM_PER_BLOCK.get)


def padded_head_dim(h: int) -> int:
  """The head dim a kernel holds for a logical one of h: the next power of two, at least MIN_DOT (Triton tensor
  sizes and `tl.dot` dimensions); 24 -> 32, 128 -> 128, 192 -> 256."""
  return max(MIN_DOT, 1 << (h - 1).bit_length())


def smem_bytes(arch: str) -> int:
  if arch not in SMEM_PER_BLOCK:
    raise ValueError(f"unknown GPU {arch=}; known: {tuple(SMEM_PER_BLOCK)}")
  return SMEM_PER_BLOCK[arch]


def smem_model(
  kernel: str, *, rows: int, bk: int, head_dim: int, dtype, stages: int, v_head_dim: int | None = None
) -> int:
  """Shared memory bytes of one thread block (see the module docstring) for the logical q/k head dim `head_dim`
  and v head dim `v_head_dim` (None: the same), each counted at its padded size."""
  b = jnp.dtype(dtype).itemsize
  R, H = rows, padded_head_dim(head_dim)
  Hv = padded_head_dim(head_dim if v_head_dim is None else v_head_dim)
  if kernel == "fwd":
    return R * H * b + stages * bk * (H + Hv) * b + R * bk * b
  if kernel == "dq":
    return R * (H + Hv) * b + stages * bk * (H + Hv) * b + 2 * R * bk * b
  if kernel == "dkv":
    return bk * (H + Hv) * b + stages * (R * (H + Hv) * b + 2 * R * 4) + 2 * R * bk * b
  raise ValueError(f"kernel must be 'fwd', 'dq' or 'dkv', got {kernel!r}")


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
  num_warps: int
  num_stages: int
  smem_bytes: int  # the model's estimate for that many stages


def launch_config(
  kernel: str, *, rows: int, bk: int, head_dim: int, dtype, arch: str | None = None, v_head_dim: int | None = None
) -> LaunchConfig:
  """Warps and pipeline stages for one kernel's tile (q/k head dim `head_dim`, v head dim `v_head_dim`, None: the
  same); ValueError when the tile cannot fit shared memory."""
  arch = current_arch() if arch is None else arch
  budget = int(smem_bytes(arch) * SAFETY_MARGIN)
  dims = dict(head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype)
  widest = padded_head_dim(max(head_dim, v_head_dim or head_dim))
  # 4 warps (128 threads) per 64-row tile, 8 for the big 128 x 128 ones: the f32 accumulators of
  # rows x head_dim then stay within ~128 registers per thread.
  warps = 8 if rows * max(bk, widest) >= 128 * 128 else 4
  for stages in (3, 2, 1):
    need = smem_model(kernel, rows=rows, bk=bk, stages=stages, **dims)
    if need <= budget:
      return LaunchConfig(warps, stages, need)
  need = smem_model(kernel, rows=rows, bk=bk, stages=1, **dims)
  v_dims = "" if v_head_dim in (None, head_dim) else f", v_head_dim={v_head_dim}"
  raise ValueError(
    f"pallas_gpu: the {kernel} tile of {rows} q rows x {bk} kv tokens with head_dim={head_dim}{v_dims} "
    f"({jnp.dtype(dtype).name}) needs about {need} bytes of shared memory, more than the {budget} bytes usable on "
    f"{arch} ({smem_bytes(arch)} per block, {SAFETY_MARGIN:.0%} margin); use smaller BlockSizes "
    "(or block_sizes=None to let the planner choose)"
  )


def pow2_tile(length: int, requested: int, minimum: int, *, what: str) -> int:
  """The largest power of two <= requested that divides `length` and is >= minimum.

  ValueError for a request below the minimum, NotImplementedError for a shard length without such a factor
  (valid input this backend cannot tile).
  """
  t = 1
  while t * 2 <= min(requested, length):
    t *= 2
  while t >= minimum:
    if length % t == 0:
      return t
    t //= 2
  if requested < minimum:
    raise ValueError(
      f"pallas_gpu: BlockSizes {what}={requested} is below the smallest GPU tile here, {minimum} tokens "
      f"(Triton matmul dimensions are >= {MIN_DOT})"
    )
  raise NotImplementedError(
    f"pallas_gpu: no power-of-two {what} tile in [{minimum}, {requested}] divides the shard length {length} "
    f"(Triton tiles are powers of two and matmul dimensions >= {MIN_DOT}); use a shard length with a power-of-two "
    f"factor >= {minimum}, or implementation='xla'"
  )


def q_tile_minimum(group: int) -> int:
  """Fewest q tokens per tile: the tile's G * bq stacked rows are a matmul dimension (>= 16)."""
  return max(1, MIN_DOT // group)


def block_tiles(
  block_sizes: BlockSizes | None, *, T: int, S: int, N: int, K: int, H: int, Hv: int, dtype, backward: bool
):
  """(bq, bk) in tokens for one block: the requested `BlockSizes`, or the planner's choice."""
  G = N // K
  blocks = block_sizes or plan_block_sizes(T, S, N, K, H, dtype, v_head_dim=Hv)
  req_q, req_kv = blocks.bwd if backward else (blocks.block_q, blocks.block_kv)
  suffix = "_bwd" if backward else ""
  bq = pow2_tile(T, req_q, q_tile_minimum(G), what=f"block_q{suffix}")
  bk = pow2_tile(S, req_kv, MIN_DOT, what=f"block_kv{suffix}")
  return bq, bk


def plan_block_sizes(
  q_len: int, kv_len: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, *, arch=None, v_head_dim=None
):
  """Tiles for the GPU kernels: 128 stacked q rows x 64 kv tokens forward, 64 x 64 backward (shrunk to fit).

  `head_dim` is q/k's, `v_head_dim` v's (None: the same; MLA: DeepSeek-V3's 192 and 128).

  Targets the tile shapes of flash-attention kernels in Triton (a 128-row forward tile, smaller backward tiles
  because each keeps two gradients in registers); tiles shrink to divide the shard and to fit shared memory.
  """
  G = num_heads // num_kv_heads
  out = []
  for rows_target, bk_target, kernels in ((128, 64, ("fwd",)), (64, 64, ("dq", "dkv"))):
    bq = pow2_tile(q_len, max(1, rows_target // G), q_tile_minimum(G), what="block_q")
    bk = pow2_tile(kv_len, bk_target, MIN_DOT, what="block_kv")
    # Shrink the larger of the two until every kernel fits (launch_config raises if even 16 x 16 does not).
    while True:
      try:
        for k in kernels:
          launch_config(k, rows=G * bq, bk=bk, head_dim=head_dim, v_head_dim=v_head_dim, dtype=dtype, arch=arch)
        break
      except ValueError:
        if G * bq >= bk and G * bq > MIN_DOT and bq > 1:
          bq //= 2
        elif bk > MIN_DOT:
          bk //= 2
        else:
          raise
    out.append((bq, bk))
  (fq, fk), (bq, bk) = out
  return BlockSizes(block_q=fq, block_kv=fk, block_q_bwd=bq, block_kv_bwd=bk)

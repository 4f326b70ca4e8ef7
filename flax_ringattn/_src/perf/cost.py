"""The one cost model of attention: FLOPs, bytes moved, and a ring hop's compute against its transfer.

Conventions (B batch, T q length, S kv length, N q heads, K kv heads, H q/k head dim, Hv v head dim):

* A matmul of [M, C] by [C, P] costs 2 * M * C * P FLOPs.  Per visible (q, k)
  pair and q head the forward runs 2 matmuls over H (s = q k^T, o += p v): 4 H
  FLOPs; the backward 5 (s recomputed, dp = do v^T, dv += p^T do, dq += ds k,
  dk += ds^T q): 10 H.  Forward + backward: 14 H, 3.5x the forward
  (`MATMULS`).  These are the useful FLOPs every implementation is credited
  with.
* Kernels that split the backward into a dq kernel and a dk/dv kernel
  recompute s and dp in each: 2 + 3 + 4 matmuls run per pair
  (`KERNEL_MATMULS`), which is what counts of *executed* tile FLOPs use.
* Masks scale the pairs by `visible_fraction`: the area of the visible band
  of the T x S score matrix (the large-T limit, so causal is exactly 1/2, the
  usual convention: causal FLOPs are counted once).
* GQA: FLOPs follow the N q heads, K/V bytes and ring traffic the K kv heads.
* MLA (v's head dim Hv != H, DeepSeek's qk 192 / v 128): the matmuls that
  contract or produce q/k's dim (s = q k^T, dq, dk) run over H, the rest
  (o += p v, dp = do v^T, dv) over Hv (`QK_MATMULS`, `head_width`); v, o, dO,
  dV and their accumulators are Hv wide.  Every `Hv=None` means Hv = H.
* A ring of n devices moves K and V (forward) and also the f32 dK/dV
  accumulators (backward) one hop per step; a hop hides its send when its
  compute at the chip's peak takes at least as long (`ring_min_shard`).

Users: `suggest_strategy` (`advisor.py`) and every script in `benchmarks/`.
"""

from __future__ import annotations

import math

import numpy as np

DIRECTIONS = ("fwd", "bwd", "fwd+bwd")
MATMULS = {"fwd": 2, "bwd": 5, "fwd+bwd": 7}  # per visible (q, k) pair and q head, each 2 * H FLOPs
KERNEL_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}  # per tile pair, as the block kernels run them
# Of those, the matmuls over q/k's head dim H (s = q k^T, dq += ds k, dk += ds^T q); the others run over v's Hv.
QK_MATMULS = {"fwd": 1, "bwd": 3, "fwd+bwd": 4, "dq": 2, "dkv": 2}
F32 = 4  # bytes of the f32 statistics and accumulators


def _direction(direction: str) -> str:
  if direction not in MATMULS:
    raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
  return direction


def itemsize(dtype) -> int:
  """Bytes of one element of `dtype` (bfloat16 too, without JAX)."""
  if str(dtype) == "bfloat16" or getattr(dtype, "__name__", "") == "bfloat16":
    return 2
  return int(np.dtype(dtype).itemsize)


def _window(local_window_size) -> tuple[float, float]:
  if local_window_size is None:
    return math.inf, math.inf
  if isinstance(local_window_size, int):
    return local_window_size, local_window_size
  left, right = local_window_size
  return (math.inf if left is None else left), (math.inf if right is None else right)


def visible_pairs(T: int, S: int | None = None, *, is_causal: bool = False, local_window_size=None) -> float:
  """Area of the visible (q, k) band of the T x S score matrix: q at i sees k at j when
  i - left <= j <= i + right (`local_window_size` (left, right) as in `jax.nn.dot_product_attention`, an int w
  meaning (w, w)), and j <= i when causal.  Causal alone: T^2 / 2 for T = S."""
  S = T if S is None else S
  left, right = _window(local_window_size)
  if is_causal:
    right = min(right, 0)
  left, right = min(left, T + S), min(right, T + S)

  # The visible length of row x, max(0, min(S, x + right) - max(0, x - left)), is piecewise linear in x: the
  # trapezoid rule over its breakpoints integrates it exactly.
  def row(x):
    return max(0.0, min(S, x + right) - max(0.0, x - left))

  xs = sorted({0.0, float(T), *(min(max(b, 0.0), T) for b in (S - right, left, -right, S + left))})
  return sum((b - a) * (row(a) + row(b)) / 2 for a, b in zip(xs, xs[1:], strict=False))


def visible_fraction(T: int, S: int | None = None, *, is_causal: bool = False, local_window_size=None) -> float:
  """`visible_pairs` over T * S: 1 for full attention, 1/2 causal."""
  S = T if S is None else S
  return visible_pairs(T, S, is_causal=is_causal, local_window_size=local_window_size) / (T * S)


def head_width(kind: str, H: int, Hv: int | None = None) -> float:
  """The summed head dims of the matmuls of `kind` (a `MATMULS` direction or a `KERNEL_MATMULS` kernel) per
  (q, k) pair and q head: `QK_MATMULS[kind]` over H, the rest over Hv.  H = Hv: matmuls * H."""
  total = {**MATMULS, **KERNEL_MATMULS}[kind]
  qk = QK_MATMULS[kind]
  return qk * H + (total - qk) * (H if Hv is None else Hv)


def pair_flops(pairs: float, *, B: int = 1, N: int, H: int, matmuls: int | str, Hv: int | None = None) -> float:
  """FLOPs on `pairs` (q, k) pairs of each of B x N rows and heads of `matmuls`: a count of matmuls over H, or a
  kind (a `MATMULS` direction or a `KERNEL_MATMULS` kernel) whose matmuls run over H or Hv (`head_width`)."""
  if isinstance(matmuls, str):
    return 2.0 * pairs * B * N * head_width(matmuls, H, Hv)
  if Hv is not None and Hv != H:
    raise ValueError(f"pair_flops: with Hv={Hv} != H={H} pass matmuls as a kind ({sorted(QK_MATMULS)})")
  return 2.0 * matmuls * pairs * B * N * H


def attention_flops(
  *,
  B: int = 1,
  T: int,
  S: int | None = None,
  N: int,
  H: int,
  is_causal=False,
  local_window_size=None,
  direction="fwd+bwd",
  Hv: int | None = None,
) -> float:
  """Useful FLOPs of one attention call (the convention every implementation is credited with)."""
  pairs = visible_pairs(T, S, is_causal=is_causal, local_window_size=local_window_size)
  return pair_flops(pairs, B=B, N=N, H=H, matmuls=_direction(direction), Hv=Hv)


def attention_bytes(
  *,
  B: int = 1,
  T: int,
  S: int | None = None,
  N: int,
  K: int,
  H: int,
  itemsize: int,
  direction="fwd",
  Hv: int | None = None,
):
  """HBM bytes an ideal kernel moves: every operand once (q, k, v in, o and the f32 lse out; the backward reads
  q, k, v, o, do and lse and writes dq, dk, dv).  The floor a roofline's memory bound divides by."""
  S = T if S is None else S
  Hv = H if Hv is None else Hv
  q, o, lse = B * T * N * H * itemsize, B * T * N * Hv * itemsize, B * T * N * F32
  k, v = B * S * K * H * itemsize, B * S * K * Hv * itemsize
  fwd = q + k + v + o + lse
  bwd = (q + k + v + o + o + lse) + (q + k + v)  # reads q, k, v, o, dO, lse; writes dq, dk, dv
  return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[_direction(direction)]


# ------------------------------------------------------------------------------------------
# The ring: per hop, one shard's compute against one K/V shard's transfer.


def _kv_width(H: int, Hv: int | None) -> int:
  """K's and V's head dims together (2 H without MLA)."""
  return H + (H if Hv is None else Hv)


def ring_hop_bytes(*, B: int = 1, S: int, K: int, H: int, itemsize: int, direction="fwd", Hv=None) -> float:
  """Bytes one device sends per hop of a ring whose kv shards hold S tokens: K and V forward (each at its own
  head dim); the backward adds the f32 dK and dV accumulators travelling with them."""
  per_elem = {"fwd": itemsize, "bwd": itemsize + F32, "fwd+bwd": 2 * itemsize + F32}[_direction(direction)]
  return 1.0 * B * S * K * _kv_width(H, Hv) * per_elem


def ring_sent_bytes(
  n: int, *, B: int = 1, S: int, K: int, H: int, itemsize: int, direction="fwd+bwd", Hv=None
) -> float:
  """Bytes one device sends over a whole ring of n (S: the shard length): the forward passes K and V on n - 1
  times ((n - 1) / n of the global K and V); the backward passes them n - 1 times again and the f32 dK/dV
  accumulators n times (a full circle back to their owner)."""
  kv = 1.0 * B * S * K * _kv_width(H, Hv)
  fwd = (n - 1) * kv * itemsize
  bwd = (n - 1) * kv * itemsize + n * kv * F32
  return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[_direction(direction)]


def ring_merge_bytes(*, B: int = 1, T: int, S: int, N: int, K: int, H: int, Hv=None) -> float:
  """Memory bytes of one hop's merge (T, S: the shard lengths): the forward reads and writes the f32 o / lse
  accumulators of its q shard, the backward the f32 dK / dV accumulators of the visiting kv shard; memory-bound
  work that single-call strategies do not have."""
  return 3.0 * B * T * N * (H if Hv is None else Hv) * F32 + 2 * (1.0 * B * S * K * _kv_width(H, Hv)) * F32


def ring_pass_time(n: int, hop_compute_s: float, hop_bytes: float, *, bandwidth, latency, merge_s=0.0) -> float:
  """Seconds of one pass (forward or backward) of a ring of n: n - 1 hops overlap their compute with one
  transfer (plus `latency`) and then merge, and the last hop computes alone."""
  return (n - 1) * max(hop_compute_s, hop_bytes / bandwidth + latency) + hop_compute_s + (n - 1) * merge_s


def ring_min_shard(
  *, peak: float, link: float, B: int = 1, N: int, K: int, H: int, itemsize: int, direction="fwd", Hv=None
):
  """Shard length L below which one full-mask hop cannot hide its send: compute 2 * matmuls * B * L^2 * N * H
  FLOPs at `peak` against `ring_hop_bytes` (linear in L) over `link` bytes/s, so they break even at
  L = bytes_per_token * peak / (flops_per_token^2 * link)."""
  flops_per_l2 = pair_flops(1, B=B, N=N, H=H, matmuls=_direction(direction), Hv=Hv)
  bytes_per_l = ring_hop_bytes(B=B, S=1, K=K, H=H, itemsize=itemsize, direction=direction, Hv=Hv)
  return bytes_per_l * peak / (flops_per_l2 * link)

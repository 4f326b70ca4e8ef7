"""Validation of paged attention's inputs and options (the window, the page dtypes), for the op and the cache."""

from __future__ import annotations

import numbers

import jax.numpy as jnp

from flax_ringattn._src import validation
from flax_ringattn._src.block_sizes import BlockSizes

# Quantized page dtypes and the largest value each stores (for absmax scaling).
QUANTIZED_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
QUANTIZED_DTYPES = tuple(QUANTIZED_MAX)


def check_sliding_window(sliding_window):
  if sliding_window is None:
    return None
  if not isinstance(sliding_window, numbers.Integral) or isinstance(sliding_window, bool):
    raise TypeError(f"sliding_window must be an int or None, got {sliding_window!r}")
  if sliding_window < 1:
    raise ValueError(f"sliding_window must be >= 1 (tokens visible, including the token itself), got {sliding_window=}")
  return int(sliding_window)


def paged_window(local_window_size, sliding_window):
  """The window as `masks.MaskSpec.window`, (left, right), from jax.nn's `local_window_size` or the deprecated
  `sliding_window` (a count that includes the token itself: sliding_window=w is exactly (w - 1, 0))."""
  if sliding_window is None:
    return validation.normalize_window(local_window_size)
  if local_window_size is not None:
    raise ValueError(
      f"pass local_window_size={local_window_size!r} or the deprecated sliding_window={sliding_window!r}, not both"
    )
  w = check_sliding_window(sliding_window)
  window = validation.normalize_window((w - 1, 0))  # clamped to validation.MAX_WINDOW like any window
  validation.warn_once(
    ("paged", "sliding_window"),
    f"sliding_window={w} is deprecated: pass local_window_size=({w - 1}, 0), jax.nn's meaning (a token sees the "
    f"{w - 1} tokens before it and itself), which every op and layer of flax_ringattn uses",
  )
  return window


def is_page_dtype(dtype) -> bool:
  """Whether pages of `dtype` store K/V faithfully: floating point, or quantized (`QUANTIZED_DTYPES`, with scales)."""
  dtype = jnp.dtype(dtype)
  return dtype.name in QUANTIZED_MAX or jnp.issubdtype(dtype, jnp.floating)


def check_block_sizes(block_sizes):
  """block_sizes: None or a `BlockSizes` (the op's and the paged layer's contract)."""
  if block_sizes is not None and not isinstance(block_sizes, BlockSizes):
    raise TypeError(f"block_sizes must be a flax_ringattn.BlockSizes, got {type(block_sizes).__name__}")
  return block_sizes


def check_ragged_shapes(cu_q_lens, num_seqs, S: int, *, where: str = ""):
  """cu_q_lens [S + 1] and num_seqs [1] must be integer arrays (static checks of a ragged batch's layout)."""
  prefix = f"{where}: " if where else ""
  for name, x in (("cu_q_lens", cu_q_lens), ("num_seqs", num_seqs)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{prefix}{name} must be an int32 array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{prefix}{name} must be an integer array, got {name}.dtype={x.dtype}")
  if tuple(cu_q_lens.shape) != (S + 1,):
    raise ValueError(f"{prefix}cu_q_lens must be [max_num_seqs + 1]=({S + 1},), got {tuple(cu_q_lens.shape)}")
  if tuple(num_seqs.shape) != (1,):
    raise ValueError(f"{prefix}num_seqs must have shape (1,), got {tuple(num_seqs.shape)}")


def check_bidirectional_ids(bidirectional_ids, T: int):
  """None, or [T] integer ids, one per row of q [T, N, H] -> int32 (0: no span)."""
  if bidirectional_ids is None:
    return None
  x = bidirectional_ids
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"bidirectional_ids must be an int32 array [T] (one id per row of q), got {type(x).__name__}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"bidirectional_ids must be an integer array, got bidirectional_ids.dtype={x.dtype}")
  if tuple(x.shape) != (T,):
    raise ValueError(
      f"bidirectional_ids must be [T]=({T},), one id per row of q [T, N, H] (the ragged batch's rows), got "
      f"bidirectional_ids.shape={tuple(x.shape)}"
    )
  return jnp.asarray(x, jnp.int32)


def normalize_scales(k_scale, v_scale):
  """Python floats (as JAX's ragged paged attention takes them) become float32 arrays of shape ().

  A float is a compile-time constant of the caller's jit: a new value retraces.  An array does not.
  """
  out = []
  for sc in (k_scale, v_scale):
    if isinstance(sc, numbers.Real) and not isinstance(sc, (bool, numbers.Integral)):
      sc = jnp.asarray(sc, jnp.float32)
    out.append(sc)
  return tuple(out)


def page_dims(q, k_pages, v_pages) -> tuple[int, int, int, int, int]:
  """(P, page_size, K, H, Hv) of pages [P, page_size, K, H] / [P, page_size, K, Hv], of merged pages
  [P, page_size, K * H] / [P, page_size, K * Hv] (a token's kv heads side by side, H = q.shape[2]: the layout the
  Pallas TPU kernel reads densely for any K and head dim; see `PagedKVCache.create(merged=...)`), or of kv pages
  [P, 2, page_size, K * H] given as k_pages with v_pages None (`kv_pages`: a page's K and V in one array)."""
  if v_pages is None:
    return _kv_page_dims(q, k_pages)
  for name, x in (("k_pages", k_pages), ("v_pages", v_pages)):
    if not hasattr(x, "ndim") or x.ndim not in (3, 4):
      raise ValueError(
        f"{name} must be [P, page_size, K, H] (rank 4) or merged [P, page_size, K * H] (rank 3), got "
        f"{name}.shape={tuple(getattr(x, 'shape', ()))}"
      )
  four = k_pages.ndim == 4
  if k_pages.ndim != v_pages.ndim or k_pages.shape[: 2 + four] != v_pages.shape[: 2 + four]:
    raise ValueError(
      f"k_pages and v_pages must have the same [P, page_size, K] and rank (v's head dim may differ, as in MLA), "
      f"got k_pages.shape={tuple(k_pages.shape)} and v_pages.shape={tuple(v_pages.shape)}"
    )
  if k_pages.dtype != v_pages.dtype:
    raise TypeError(f"k_pages and v_pages must share a dtype, got {k_pages.dtype} and {v_pages.dtype}")
  if four:
    return (*k_pages.shape, v_pages.shape[3])
  H = q.shape[-1]
  P, page_size, KH = k_pages.shape
  _check_merged_width("merged k_pages [P, page_size, K * H]", k_pages, H)
  K = KH // H
  if v_pages.shape[2] % K:
    raise ValueError(
      f"merged v_pages [P, page_size, K * Hv] must have a last dim that is a multiple of K={K} (k_pages.shape[2]="
      f"{KH} / H={H}), got v_pages.shape={tuple(v_pages.shape)}"
    )
  return P, page_size, K, H, v_pages.shape[2] // K


def _check_merged_width(what: str, pages, H: int) -> None:
  KH = pages.shape[-1]
  if H < 1 or KH % H or KH == 0:
    raise ValueError(
      f"{what} must have a last dim that is a positive multiple of q's head dim H=q.shape[2]={H}, got "
      f"k_pages.shape={tuple(pages.shape)}"
    )


def _kv_page_dims(q, kv_pages) -> tuple[int, int, int, int, int]:
  shape = tuple(getattr(kv_pages, "shape", ()))
  if len(shape) != 4 or shape[1] != 2:
    raise ValueError(
      "with v_pages=None, k_pages must be kv pages [P, 2, page_size, K * H] (a page's K, then its V: "
      f"`PagedKVCache.create(merged='kv')`), got k_pages.shape={shape}"
    )
  H = q.shape[-1]
  _check_merged_width("kv pages k_pages [P, 2, page_size, K * H]", kv_pages, H)
  P, _, page_size, KH = shape
  return P, page_size, KH // H, H, H


def kv_together(v_pages) -> bool:
  """Whether the call's pages are kv pages [P, 2, page_size, K * H] (given as k_pages, v_pages None)."""
  return v_pages is None


def page_size_of(k_pages, v_pages) -> int:
  return k_pages.shape[2] if kv_together(v_pages) else k_pages.shape[1]


def kv_apart(k_pages, v_pages):
  """(k_pages, v_pages) with kv pages [P, 2, page_size, K * H] split into merged K and V pages (slices: the
  portable backends read them so; the Pallas TPU kernel copies a page's K and V together)."""
  if kv_together(v_pages):
    return k_pages[:, 0], k_pages[:, 1]
  return k_pages, v_pages


def unmerge_pages(pages, K: int):
  """Merged pages [P, page_size, K * h] as [P, page_size, K, h]; 4-D pages as they are.  (A TPU relayout, not
  free: the portable backends pay it, the Pallas TPU kernel reads merged pages as they are.)"""
  return pages if pages.ndim == 4 else pages.reshape(*pages.shape[:2], K, -1)


def check_paged_inputs(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, num_seqs, k_scale, v_scale):
  """Static checks; returns (T, N, H, P, page_size, K, S, pages_per_seq)."""
  for name, x in (("q", q), ("k_pages", k_pages), ("v_pages", v_pages)):
    if x is None and name == "v_pages":
      continue  # kv pages: k_pages holds both (`page_dims`)
    if not hasattr(x, "shape"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
  if q.ndim != 3:
    raise ValueError(f"q must be [max_num_batched_tokens, N, H] (rank 3), got q.shape={tuple(q.shape)}")
  if not jnp.issubdtype(q.dtype, jnp.floating):
    raise TypeError(f"q must be floating point, got q.dtype={q.dtype}")
  T, N, H = q.shape
  P, page_size, K, Hk, Hv = page_dims(q, k_pages, v_pages)
  if Hk != H:
    raise ValueError(f"head_dim differs: q.shape[2]={H} but k_pages.shape[3]={Hk} (q and k share a head dim)")
  if H < 1 or Hv < 1:
    v_dim = "v_pages.shape[3]" if v_pages is not None and v_pages.ndim == 4 else "v_pages.shape[-1] / K"
    raise ValueError(f"head dims must be positive, got q.shape[2]={H} (head_dim) and {v_dim}={Hv} (v_head_dim)")
  if K == 0 or N % K:
    raise ValueError(f"the number of q heads N={N} must be a multiple of the number of kv heads K={K}")
  quantized = jnp.dtype(k_pages.dtype).name in QUANTIZED_DTYPES
  if not is_page_dtype(k_pages.dtype):
    raise TypeError(f"k_pages/v_pages must be floating point or one of {QUANTIZED_DTYPES}, got {k_pages.dtype}")
  for name, x in (("kv_lens", kv_lens), ("page_indices", page_indices)):
    if not hasattr(x, "shape"):
      raise TypeError(f"{name} must be an int32 array, got {type(x).__name__}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise TypeError(f"{name} must be an integer array, got {name}.dtype={x.dtype}")
  if page_indices.ndim != 2:
    raise ValueError(f"page_indices must be [max_num_seqs, pages_per_seq], got shape {tuple(page_indices.shape)}")
  S, pages_per_seq = page_indices.shape
  if tuple(kv_lens.shape) != (S,):
    raise ValueError(f"kv_lens must be [max_num_seqs]=({S},) like page_indices.shape[0], got {tuple(kv_lens.shape)}")
  check_ragged_shapes(cu_q_lens, num_seqs, S)
  for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
    if sc is None:
      if quantized:
        raise ValueError(f"{name} is required for quantized pages (dtype {k_pages.dtype})")
      continue
    if not hasattr(sc, "shape") or not jnp.issubdtype(sc.dtype, jnp.floating):
      raise TypeError(
        f"{name} must be a Python float or a floating-point array (an array avoids recompiling when the value "
        f"changes), got {sc!r}"
      )
    if tuple(sc.shape) not in ((), (P, K), (P, page_size, K)):
      raise ValueError(
        f"{name} must have shape () (one scale), [P, K]=({P}, {K}) (per page and kv head) or "
        f"[P, page_size, K]=({P}, {page_size}, {K}) (per token and kv head), got {tuple(sc.shape)}"
      )
  return T, N, H, P, page_size, K, S, pages_per_seq

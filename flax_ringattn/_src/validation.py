"""Argument checks shared by the ops and the reference.

Every message names the operands, shows the values and says what was expected
(STYLE.md).  Dimension letters: B batch, T q length, S kv length, N q heads,
K kv heads, H head dim.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import numbers
import os
import pathlib
import sys
import sysconfig
import warnings

import jax
import jax.numpy as jnp


def is_hashable(value) -> bool:
  """Whether `value` can key a cache of compiled programs (an unhashable option, e.g. an `interpret=` setting,
  means: build the program afresh)."""
  try:
    hash(value)
  except TypeError:
    return False
  return True


def all_concrete(*xs) -> bool:
  """True when no argument is a tracer: the values can be read now (eager checks cost jitted calls nothing)."""
  return not any(isinstance(x, jax.core.Tracer) for x in xs)


def check_qkv(q, k, v):
  """Validates the [B, T, N, H] / [B, S, K, H] / [B, S, K, Hv] layout; returns (B, T, S, N, K, H).

  H is the q/k head dim; v's head dim Hv (`v.shape[3]`) may differ (MLA) and is the output's."""
  for name, x in (("q", q), ("k", k), ("v", v)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != 4:
      raise ValueError(
        f"{name} must have rank 4 ([B, T, N, H] for q, [B, S, K, H] for k/v), got {name}.shape={tuple(x.shape)}"
      )
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"{name} must be a floating-point array, got {name}.dtype={x.dtype}")
  if not (q.dtype == k.dtype == v.dtype):
    raise TypeError(f"q, k and v must share a dtype, got q.dtype={q.dtype}, k.dtype={k.dtype}, v.dtype={v.dtype}")
  if k.shape[:3] != v.shape[:3]:
    raise ValueError(
      f"k and v must have the same [B, S, K] (v's head dim may differ, as in MLA), got k.shape={tuple(k.shape)}, "
      f"v.shape={tuple(v.shape)}"
    )
  B, T, N, H = q.shape
  Bk, S, K, Hk = k.shape
  if Bk != B:
    raise ValueError(f"batch sizes differ: q.shape[0]={B} but k.shape[0]={Bk}")
  if Hk != H:
    raise ValueError(f"head_dim differs: q.shape[3]={H} but k.shape[3]={Hk} (q and k share a head dim)")
  if H == 0:
    raise ValueError(f"q and k's head dim H must be positive, got q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)}")
  if v.shape[3] == 0:
    raise ValueError(f"v's head dim must be positive, got v.shape={tuple(v.shape)}")
  if max(T, S) > MAX_WINDOW:
    raise NotImplementedError(
      f"sequences of more than 2**30 = {MAX_WINDOW} tokens are not supported (token positions are int32 and a "
      f"window side is at most 2**30), got q_len T={T}, kv_len S={S}"
    )
  if K == 0 or N % K:
    raise ValueError(
      f"the number of q heads N={N} must be a multiple of the number of kv heads K={K} "
      f"(GQA/MQA: q.shape={tuple(q.shape)}, k.shape={tuple(k.shape)})"
    )
  return B, T, S, N, K, H


def is_empty(q, k) -> bool:
  """Whether the attention output is all zeros by shape alone: q [B, T, N, H] holds no row (B, T or N is 0), or k
  [B, S, K, H] no key (S = 0: every row sees no key, and such rows are 0).  The ops then return
  `jnp.zeros((B, T, N, Hv))` after their checks (as `jax.nn.dot_product_attention` returns its empty output), and
  its gradients are zeros of the inputs' shapes."""
  B, T, N, _ = q.shape
  return 0 in (B, T, N, k.shape[1])


def check_sinks(sinks, N: int, *, what: str = "q heads N"):
  """Optional attention sinks: a floating-point array of shape [N], one logit per q head; returns it or None."""
  if sinks is None:
    return None
  if not hasattr(sinks, "shape") or not hasattr(sinks, "dtype"):
    raise TypeError(f"sinks must be a float array of shape [N]=({N},) (one logit per q head), got {sinks!r}")
  if not jnp.issubdtype(sinks.dtype, jnp.floating):
    raise TypeError(f"sinks must be a floating-point array, got sinks.dtype={sinks.dtype}")
  if tuple(sinks.shape) != (N,):
    raise ValueError(f"sinks must have shape [N]=({N},), one logit per q head ({what}={N}), got {tuple(sinks.shape)}")
  return sinks


# The widest window side the library hands down.  Positions are int32 and every sequence the library can address
# has at most 2**30 tokens (`check_qkv`), so a side of 2**30 or more already covers the whole sequence; clamping
# keeps `pos + right` and `pos - left` (positions < 2**30) inside int32 in every kernel, strategy and reference.
MAX_WINDOW = 2**30


def normalize_window(local_window_size):
  """int w -> (w, w); (left, right) -> itself; None -> None (jax.nn semantics).

  Each side is clamped to `MAX_WINDOW`: a wider one sees the same keys (there are fewer than 2**30 positions),
  and the clamp keeps the int32 mask arithmetic from overflowing.  Every entry point that takes a window calls
  this, so every kernel, strategy, the reference and the dense-mask recovery see the clamped value."""
  if local_window_size is None:
    return None
  if isinstance(local_window_size, numbers.Integral) and not isinstance(local_window_size, bool):
    left = right = int(local_window_size)
  elif (
    isinstance(local_window_size, (tuple, list))
    and len(local_window_size) == 2
    and all(isinstance(w, numbers.Integral) and not isinstance(w, bool) for w in local_window_size)
  ):
    left, right = (int(w) for w in local_window_size)
  else:
    raise TypeError(f"local_window_size must be an int or a (left, right) pair of ints, got {local_window_size!r}")
  if left < 0 or right < 0:
    raise ValueError(f"local_window_size must be non-negative, got {local_window_size=}")
  return (min(left, MAX_WINDOW), min(right, MAX_WINDOW))


def normalize_segment_ids(segment_ids, B: int, T: int, S: int, *, name: str = "segment_ids"):
  """None, [B, T] (self attention, needs T == S) or (q_ids [B, T], kv_ids [B, S]) -> (q_ids, kv_ids) int32.

  `name`: the argument's name in messages (bidirectional ids take the same forms)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(f"{name} must be an array or a (q_{name}, kv_{name}) pair, got {len(segment_ids)} items")
    q_ids, kv_ids = segment_ids
  else:
    if T != S:
      raise ValueError(
        f"a single {name} array needs T == S (self attention), got T={T}, S={S}; "
        f"pass (q_{name} [B, T], kv_{name} [B, S]) for cross attention"
      )
    q_ids = kv_ids = segment_ids
  for side, ids, L, letter in (("q", q_ids, T, "T"), ("kv", kv_ids, S, "S")):
    what = f"{side} {name}"
    if not hasattr(ids, "shape"):
      raise TypeError(f"{what} must be an array, got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
      raise TypeError(f"{what} must be an integer array, got dtype={ids.dtype}")
    if tuple(ids.shape) != (B, L):
      raise ValueError(f"{what} must have shape [B, {letter}]=({B}, {L}), got {tuple(ids.shape)}")
  return jnp.asarray(q_ids, jnp.int32), jnp.asarray(kv_ids, jnp.int32)


def check_soft_cap(logits_soft_cap):
  if logits_soft_cap is None:
    return None
  if not isinstance(logits_soft_cap, numbers.Real) or isinstance(logits_soft_cap, bool):
    raise TypeError(f"logits_soft_cap must be a positive float, got {logits_soft_cap!r}")
  if not (logits_soft_cap > 0 and math.isfinite(logits_soft_cap)):
    raise ValueError(f"logits_soft_cap must be > 0 and finite (None means no cap), got {logits_soft_cap=}")
  return float(logits_soft_cap)


def check_scale(scale, H: int) -> float:
  if scale is None:
    return H**-0.5
  if isinstance(scale, jax.Array) or not isinstance(scale, numbers.Real) or isinstance(scale, bool):
    raise TypeError(f"scale must be a Python float (it is baked into the kernel), got {scale!r}")
  if not math.isfinite(scale):
    raise ValueError(f"scale must be finite, got {scale=}")
  return float(scale)


def check_bool(name: str, value) -> bool:
  if not isinstance(value, bool):
    raise TypeError(f"{name} must be a bool, got {value!r}")
  return value


def check_positions(name: str, positions, B: int, length: int, letter: str):
  """Optional token positions: None, or an integer array of shape [B, length] or [length] (the same for every
  row) -> None or [B, length] int32."""
  if positions is None:
    return None
  if not hasattr(positions, "shape"):
    positions = jnp.asarray(positions)
  if tuple(positions.shape) not in ((length,), (B, length)) or not jnp.issubdtype(positions.dtype, jnp.integer):
    raise ValueError(
      f"{name} must be an integer array of shape [B, {letter}]=({B}, {length}) or [{letter}]=({length},), got "
      f"shape={tuple(positions.shape)}, dtype={positions.dtype}"
    )
  return jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (B, length))


def check_chunk_size(chunk_size):
  """None or a positive int (Llama 4's `attention_chunk_size`)."""
  if chunk_size is None:
    return None
  if not isinstance(chunk_size, numbers.Integral) or isinstance(chunk_size, bool):
    raise TypeError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
  if chunk_size < 1:
    raise ValueError(f"chunk_size must be >= 1 (None means no chunks), got {chunk_size=}")
  return int(chunk_size)


_warned: set = set()


@functools.cache
def _internal_prefixes() -> tuple[str, ...]:
  """Where this package, JAX, Flax and the standard library live (found without importing anything)."""
  roots = [pathlib.Path(__file__).resolve().parents[1]]
  for name in ("jax", "flax"):
    spec = importlib.util.find_spec(name)
    if spec is not None and spec.origin:
      roots.append(pathlib.Path(spec.origin).parent)
  return (*(str(r) + os.sep for r in roots), sysconfig.get_paths()["stdlib"] + os.sep, "<frozen ")


def _user_stacklevel() -> int:
  """The `stacklevel` that attributes a warning raised in `warn_once` to the user's code: the first frame outside
  this package, JAX, Flax and the standard library (so Python's default filters show a DeprecationWarning from a
  user's script, whichever entry point, layer or `jit` it came through)."""
  prefixes = _internal_prefixes()
  frame, level = sys._getframe(2), 2  # the caller of warn_once is stacklevel 2
  while frame is not None and frame.f_code.co_filename.startswith(prefixes):
    frame, level = frame.f_back, level + 1
  return level if frame is not None else 2


def warn_once(key, message: str, category=DeprecationWarning):
  """`warnings.warn` once per process and key, attributed to the user's code: a deprecated spelling keeps working
  and says so once."""
  if key in _warned:
    return
  _warned.add(key)
  warnings.warn(message, category, stacklevel=_user_stacklevel())

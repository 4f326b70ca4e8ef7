"""The argument contracts of `PagedKVCache`'s methods (`cache.py`) and of the ring prefill's slot.

A method checks its arguments before it computes anything, so one that raises leaves the cache as it was (the
caller keeps the old pytree).  Types and shapes are static: they are checked under jit too (`TypeError`,
`ValueError`).  Values are checked when they are concrete (`ValueError` naming the argument and its value, via
`checks.enforce`); under jit a call whose values break the contract changes nothing it must not (each method
says what), and `checked=True` adds the same checks as `checkify` checks.
"""

from __future__ import annotations

import numbers

import jax
import jax.numpy as jnp
import numpy as np

from flax_ringattn._src import sharding
from flax_ringattn._src.backends.pallas_tpu import tiling
from flax_ringattn._src.paged import common

_INT32_MAX = 2**31 - 1


def _shown(x) -> str:
  """A value for a message: the list of a small concrete array, else its shape and dtype."""
  if isinstance(x, jax.core.Tracer):
    return f"a traced array of shape {tuple(x.shape)}"
  try:
    a = np.asarray(x)
  except Exception:  # noqa: BLE001 (not addressable here: say what is known statically)
    return f"an array of shape {tuple(x.shape)}"
  return repr(a.tolist()) if a.size <= 16 else f"an array of shape {a.shape}"


def _as_array(value):
  """A list or tuple as an array (numpy when its items are values, so its dtype is theirs); anything else as is."""
  if isinstance(value, (list, tuple)):
    if any(isinstance(x, jax.core.Tracer) for x in value):
      return jnp.asarray(value)
    try:
      return np.asarray(value)
    except ValueError:
      return value  # ragged: refused below as a non-array
  return value


def page_dtype(dtype):
  """`create`'s dtype: pages must store K/V faithfully (an integer dtype would truncate 2.04 to 2)."""
  dtype = jnp.dtype(dtype)
  if not common.is_page_dtype(dtype):
    raise TypeError(
      f"PagedKVCache.create: dtype={dtype.name} cannot store keys and values faithfully: pass a floating dtype "
      f"(float32, bfloat16, float16, ...) or a quantized one of {common.QUANTIZED_DTYPES} (stored with per-token "
      "scales)"
    )
  return dtype


def slot_mask(slots, S: int, where: str):
  """`free`'s [S] bool mask (a bool array, or a list / tuple of bools); returns it as a jax array.

  An int would broadcast (free(jnp.array([1])) meant as "slot 1" frees every slot) and ints read as truthy:
  both are refused, under jit too (dtype and shape are static)."""
  want = f"a bool mask of shape [max_num_seqs]=({S},) (True frees the slot)"
  hint = f"to free slot i pass jnp.arange({S}) == i"
  x = _as_array(slots)
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{where}: slots must be {want}, got slots={slots!r}; {hint}")
  if x.dtype != jnp.bool_:
    raise TypeError(f"{where}: slots must be {want}, got slots={_shown(x)} of dtype {x.dtype}; {hint}")
  if tuple(x.shape) != (S,):
    raise ValueError(f"{where}: slots.shape={tuple(x.shape)} must be [max_num_seqs]=({S},), got slots={_shown(x)}")
  return jnp.asarray(x)


def new_lens(value, S: int, where: str):
  """[S] integer new-token counts per slot (an array, or a list / tuple of ints); returns them as int32.

  A scalar would broadcast to every slot: refused."""
  x = _as_array(value)
  want = f"an integer array of shape [max_num_seqs]=({S},) (new tokens per slot)"
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{where}: new_lens must be {want}, got new_lens={value!r}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise TypeError(f"{where}: new_lens must be {want}, got new_lens={_shown(x)} of dtype {x.dtype}")
  if tuple(x.shape) != (S,):
    raise ValueError(f"{where}: new_lens.shape={tuple(x.shape)} must be [max_num_seqs]=({S},) (new tokens per slot)")
  return jnp.asarray(x, jnp.int32)


def new_lens_problems(lens):
  """[(bad, message, values)]: every count must be >= 0."""
  negative = lens < 0
  i = jnp.argmax(negative).astype(jnp.int32)
  return [(jnp.any(negative), "new_lens[{i}]={n} must be >= 0 (new tokens per slot)", dict(i=i, n=lens[i]))]


def scalar_int(name: str, value, where: str):
  """An int scalar (a Python int, or an integer array of shape ()) as an int32 array; bools, floats and arrays of
  another shape are refused (a float would be truncated, an array of slots broadcast)."""
  if isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{where}: {name} must be an int, got {name}={value!r} (a bool)")
  if isinstance(value, numbers.Integral):
    if not -_INT32_MAX - 1 <= int(value) <= _INT32_MAX:
      raise ValueError(f"{where}: {name}={int(value)} does not fit int32")
    return jnp.asarray(int(value), jnp.int32)
  if not hasattr(value, "dtype") or not hasattr(value, "shape"):
    raise TypeError(f"{where}: {name} must be an int (a Python int or an integer array of shape ()), got {value!r}")
  if not jnp.issubdtype(value.dtype, jnp.integer) or tuple(value.shape) != ():
    raise TypeError(
      f"{where}: {name} must be an int (a Python int or an integer array of shape ()), got {name}={_shown(value)} "
      f"of dtype {value.dtype}"
    )
  return jnp.asarray(value, jnp.int32)


def slot(name: str, value, S: int, where: str):
  """A slot index in [0, S): (index, clipped, in_range), int32 arrays and a bool.  A concrete index (a Python int,
  or an array that is no tracer, also inside jit) out of range raises `ValueError` (a negative one would wrap to
  the last slots); for a traced one `clipped` is safe to index with and in_range a bool scalar, for the caller to
  make the call a no-op (True when concrete)."""
  index = scalar_int(name, value, where)
  if not isinstance(value, jax.core.Tracer):
    if not 0 <= int(value) < S:
      raise ValueError(f"{where}: {name}={int(value)} must be a slot in [0, max_num_seqs={S})")
    return index, index, True
  return index, jnp.clip(index, 0, S - 1), (index >= 0) & (index < S)


def slot_problems(name: str, index, S: int):
  """[(bad, message, values)] of a slot index out of [0, S) (traced: `slot` raised for a concrete one)."""
  bad = (index < 0) | (index >= S)
  return [(bad, f"{name}={{i}} must be a slot in [0, max_num_seqs={S})", dict(i=index))]


def pages(merged, page_size: int, dtype, head_dim: int, v_head_dim: int, mesh) -> tuple:
  """(merged, kv_together) of `PagedKVCache.create(merged=...)`, "auto" resolved: kv pages where a Pallas TPU kernel
  reads them densely (a page a whole number of the dtype's sublane tiles, v_head_dim == head_dim), merged pages
  for MLA, 4-D pages [P, page_size, K, H] when the cache is spread over a mesh (the ring prefill writes them) or
  a page is a partial tile.  On a v5e, kv pages decode at 0.97-2.2x `ragged_paged_attention` where 4-D pages
  ran at 0.13-0.17x with 1, 2 or 4 kv heads, and a serving step writes them without relaying the cache out."""
  if merged == "auto":
    if mesh is not None or page_size % tiling.sublanes(dtype):
      merged = False
    else:
      merged = "kv" if v_head_dim == head_dim else True
  return merged, kv_together(merged, head_dim, v_head_dim)


def kv_together(merged, head_dim: int, v_head_dim: int) -> bool:
  """`PagedKVCache.create`'s `merged`: a bool, or "kv" (kv pages [P, 2, page_size, K * H]: True), which holds K and V
  in one array and so needs v_head_dim == head_dim."""
  if not isinstance(merged, bool) and merged != "kv":
    raise TypeError(f"PagedKVCache.create: merged must be a bool, 'kv' or 'auto', got merged={merged!r}")
  if merged == "kv" and v_head_dim != head_dim:
    raise ValueError(
      f"PagedKVCache.create: merged='kv' keeps a page's K and V in one array, so v_head_dim must equal head_dim, "
      f"got head_dim={head_dim}, v_head_dim={v_head_dim}; use merged=True"
    )
  return merged == "kv"


def seq_axis(num_pages: int, mesh, seq_axis):
  """(seq_axis, n): the mesh axis (or tuple of axes) the pages are spread over, by default the mesh's only axis,
  and the devices along it; (None, 1) without a mesh."""
  if mesh is None:
    if seq_axis is not None:
      raise ValueError(f"PagedKVCache.create: seq_axis={seq_axis!r} needs mesh=... (the mesh that has the axis)")
    return None, 1
  seq_axis = sharding.sequence_axis(mesh, seq_axis, arg="seq_axis")
  seq_axis = tuple(seq_axis) if isinstance(seq_axis, list) else seq_axis
  sharding.check_mesh_axes(mesh, where="PagedKVCache.create", seq_axis=seq_axis)
  n = sharding.axes_size(mesh, seq_axis)
  if num_pages % n:
    raise ValueError(
      f"PagedKVCache.create: num_pages={num_pages} must be a multiple of the {n} devices along "
      f"seq_axis={seq_axis!r} (each device owns num_pages / n pages)"
    )
  return seq_axis, n

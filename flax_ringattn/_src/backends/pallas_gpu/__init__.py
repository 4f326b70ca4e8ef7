"""Pallas Triton (GPU) backend of the block contract; `interpret=True` runs it on CPU in Pallas's generic interpreter."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax_ringattn._src.backends.pallas_gpu import planner
from flax_ringattn._src.backends.pallas_gpu.backward import block_bwd
from flax_ringattn._src.backends.pallas_gpu.forward import block_fwd

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def normalize_interpret(interpret) -> bool:
  """None/False: compile with Triton for the GPU; True: Pallas's generic interpreter (any backend, e.g. CPU)."""
  if interpret is None or isinstance(interpret, bool):
    return bool(interpret)
  raise TypeError(
    "implementation='pallas_gpu' runs in Pallas's generic interpreter: interpret must be True, False or None, "
    f"got {interpret!r} (TPU InterpretParams apply to implementation='pallas_tpu' only)"
  )


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def _is_pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class PallasGpuBackend:
  """Flash-attention block kernels for NVIDIA GPUs (Triton lowering); `interpret=True` runs them on CPU."""

  interpret: bool = False
  name = "pallas_gpu"
  # Pallas's generic interpreter lowers a kernel to ordinary XLA ops (no cross-device barriers as in TPU
  # interpret mode), so the ring may skip masked hops with lax.cond in both modes.
  calls_must_be_uniform = False

  def check_supported(self, *, dtype, spec, shapes) -> None:
    if not self.interpret and not on_gpu():
      raise NotImplementedError(
        f"pallas_gpu needs an NVIDIA GPU (default backend is {jax.default_backend()!r}); pass interpret=True to run "
        "the kernels in Pallas's generic interpreter on CPU, or implementation='xla'"
      )
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
      raise NotImplementedError(
        f"pallas_gpu supports float32, bfloat16 and float16 inputs, got dtype={jnp.dtype(dtype)}"
      )
    # Any q/k head dim H and v head dim Hv (MLA): the kernels pad each to its own power of two >= 16 (see
    # `common`), so only the head grouping, a row count of the stacked tiles, must be a power of two.
    (_, _, N, _), (_, _, K, _) = shapes
    if not _is_pow2(N // K):
      raise NotImplementedError(
        f"pallas_gpu needs a power-of-two number of q heads per kv head (Triton tensor sizes), got N={N}, K={K} "
        f"({N // K} per kv head)"
      )
    # Global shapes: the shard lengths are checked against the tiles when the block is traced.

  def with_interpret(self, interpret):
    """This backend in Pallas's generic interpreter (interpret=True) or compiled (False)."""
    return dataclasses.replace(self, interpret=normalize_interpret(interpret))

  def fwd(self, q, k, v, q_tok, kv_tok, *, spec, dropout=None, out_dtype=None):
    o, lse = block_fwd(q, k, v, q_tok, kv_tok, spec=spec, interpret=self.interpret, dropout=dropout)
    return o.astype(out_dtype or o.dtype), lse

  def bwd(self, q, k, v, do, lse, delta, q_tok, kv_tok, *, spec, dropout=None):
    return block_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, spec=spec, interpret=self.interpret, dropout=dropout)


__all__ = ["PallasGpuBackend", "normalize_interpret", "on_gpu", "planner"]

"""Pallas Mosaic TPU backend of the block contract (runs on CPU in TPU interpret mode)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src.backends.pallas_tpu import common
from flax_ringattn._src.backends.pallas_tpu.backward import block_bwd
from flax_ringattn._src.backends.pallas_tpu.forward import block_fwd

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def normalize_interpret(interpret):
  """None/False: compile for TPU; True: TPU interpret mode with default params; or InterpretParams."""
  if interpret is None or interpret is False:
    return None
  if interpret is True:
    return pltpu.InterpretParams()
  if isinstance(interpret, pltpu.InterpretParams):
    return interpret
  raise TypeError(f"interpret must be a bool, None or a jax.experimental.pallas.tpu.InterpretParams, got {interpret!r}")


def on_tpu() -> bool:
  return jax.default_backend() == "tpu"


@dataclasses.dataclass(frozen=True)
class PallasTpuBackend:
  """Flash-attention block kernels for TPU; `interpret` runs them on CPU (see `normalize_interpret`)."""

  interpret: object = None
  name = "pallas_tpu"

  @property
  def calls_must_be_uniform(self) -> bool:
    # TPU interpret mode joins all simulated devices in barriers at the start
    # and end of every pallas_call, so a hop skipped on one device deadlocks
    # the others.  On a TPU, skipped hops launch nothing.
    return self.interpret is not None

  def check_supported(self, *, dtype, spec, shapes) -> None:
    if self.interpret is None and not on_tpu():
      raise NotImplementedError(
        f"pallas_tpu needs a TPU (default backend is {jax.default_backend()!r}); pass interpret=True to run the "
        "kernels in Pallas TPU interpret mode on CPU, or implementation='xla'"
      )
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
      raise NotImplementedError(f"pallas_tpu supports float32 and bfloat16 inputs, got dtype={jnp.dtype(dtype)}")
    del shapes  # global shapes: the shard lengths are checked against the tiles when the block is traced

  def fwd(self, q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, spec, dropout=None):
    return block_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, spec=spec, dropout=dropout, interpret=self.interpret)

  def bwd(self, q, k, v, do, lse, delta, q_pos, kv_pos, q_seg, kv_seg, *, spec, dropout=None):
    return block_bwd(
      q, k, v, do, lse, delta, q_pos, kv_pos, q_seg, kv_seg, spec=spec, dropout=dropout, interpret=self.interpret
    )


__all__ = ["PallasTpuBackend", "common", "normalize_interpret", "on_tpu"]

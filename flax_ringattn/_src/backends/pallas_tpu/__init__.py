"""Pallas Mosaic TPU backend (runs on CPU in TPU interpret mode).

Three kernel families, one folder each, over the tile rules and call plans of `tiling.py` and the VMEM
planners of `planners/`: the block kernels of the block contract (`block/`), the whole ring in one kernel per
direction (`ring/`, offered to the ring strategy by `fused_ring`) and ragged paged attention (`paged/`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu

from flax_ringattn._src.backends.pallas_tpu import common, planners
from flax_ringattn._src.backends.pallas_tpu.block.backward import block_bwd
from flax_ringattn._src.backends.pallas_tpu.block.forward import block_fwd
from flax_ringattn._src.backends.pallas_tpu.ring import KernelRing
from flax_ringattn._src.options import ProblemShape

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


# The block kernels behind one jit each, `spec` and the mode static: a model's layers with the same shapes and options
# share one trace of the kernels (and of their tile tables) and one lowering, instead of one per layer.  On CPU,
# lowering a 4-block Qwen2.5-0.5B-shaped train step for TPU traced the kernels 12 times, 145 ms each, and lowered
# each to Mosaic in about 90 ms; cached, that work is done once per distinct kernel.  `plans`: the tuned tables'
# version (`planners.tuned.version`), so a table registered after a first trace plans anew.
@functools.partial(jax.jit, static_argnames=("spec", "interpret", "out_dtype", "plans"))
def _block_fwd(q, k, v, q_tok, kv_tok, dropout, *, spec, interpret, out_dtype, plans):
  del plans
  return block_fwd(q, k, v, q_tok, kv_tok, spec=spec, dropout=dropout, interpret=interpret, out_dtype=out_dtype)


@functools.partial(jax.jit, static_argnames=("spec", "interpret", "plans"))
def _block_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, dropout, *, spec, interpret, plans):
  del plans
  return block_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, spec=spec, dropout=dropout, interpret=interpret)


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
  # The name errors report: "pallas_tpu", or the alias a call asked for ("pallas_tpu_ring").
  label: str = dataclasses.field(default="pallas_tpu", compare=False)
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
        f"{self.label} needs a TPU (default backend is {jax.default_backend()!r}); pass interpret=True to run the "
        "kernels in Pallas TPU interpret mode on CPU, or implementation='xla'"
      )
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
      raise NotImplementedError(f"{self.label} supports float32 and bfloat16 inputs, got dtype={jnp.dtype(dtype)}")
    del spec, shapes  # global shapes: the shard lengths are checked against the tiles when the block is traced

  def with_interpret(self, interpret):
    """This backend in Pallas TPU interpret mode (True or a `pltpu.InterpretParams`)."""
    return dataclasses.replace(self, interpret=normalize_interpret(interpret))

  def fused_ring(self, *, axis_name, load_balance, spec):
    """The in-kernel ring (`ring/`): the whole per-device ring strategy as one `flash.FlashKernel`."""
    return KernelRing(axis_name=axis_name, load_balance=load_balance, spec=spec, interpret=self.interpret)

  def fused_ring_fits(self, shape: ProblemShape, *, n=1) -> bool:
    """Whether the in-kernel ring runs shards of `shape`: with VMEM slots, or HBM slots and tiles (`plan_ring`;
    every mask term is supported, its per-row data counted from `shape.extra_fields`)."""
    return planners.ring_fits_for(shape, n=n)

  def fwd(self, q, k, v, q_tok, kv_tok, *, spec, dropout=None, out_dtype=None):
    out_dtype = None if out_dtype is None else jnp.dtype(out_dtype)
    plans = planners.tuned.version()
    return _block_fwd(
      q, k, v, q_tok, kv_tok, dropout, spec=spec, interpret=self.interpret, out_dtype=out_dtype, plans=plans
    )

  def bwd(self, q, k, v, do, lse, delta, q_tok, kv_tok, *, spec, dropout=None):
    plans = planners.tuned.version()
    return _block_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, dropout, spec=spec, interpret=self.interpret, plans=plans)


__all__ = ["PallasTpuBackend", "common", "normalize_interpret", "on_tpu"]

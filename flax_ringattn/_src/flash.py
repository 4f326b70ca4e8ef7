"""The one flash-attention `custom_vjp` of the library.

Every attention path computes, in its forward, the output o and the *final*
log-sum-exp of each row, and its backward needs only the inputs, the output,
that lse, dO and delta = rowsum(dO * O).  That is the block contract of
`backends/base.py`, lifted to whole calls: the portable ring loop, the
all-gather strategy, the in-kernel TPU ring and paged attention each supply a
`FlashKernel` (their forward and backward halves) and run through `flash`.
The Ulysses strategies are the ring loop after an all-to-all, so they run
through it too.

    out = flash(kernel, *operands)

    forward : o, lse = kernel.forward(*operands); out = o.astype(operands[0].dtype)
              residuals (operands, out, lse): O(local shard), never a rotated copy
    backward: delta = kernel.rows_to_lse(rowsum(dO * out))  (in lse's layout)
              cotangents = kernel.backward(operands, lse, do, delta)

A feature that only rescales the softmax of finished rows (an attention sink:
lse' = logaddexp(lse, s), o' = o * exp(lse - lse')) can live here, between the
kernel's forward and the cast, with the backward run on lse' and delta(o'):
no kernel has to change.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp

F32 = jnp.float32


class FlashKernel(Protocol):
  """The two halves of one attention path; hashable (a `custom_vjp` nondiff argument)."""

  def forward(self, *operands):
    """(o, lse): o shaped like the output (any float dtype), lse float32 in the kernel's row layout."""

  def rows_to_lse(self, rows):
    """A per-row statistic in the output's row layout (o.shape[:-1]) -> lse's layout."""

  def backward(self, operands, lse, do, delta) -> tuple:
    """One cotangent per operand (None for integer operands), in the operands' dtypes."""


def _forward(kernel, operands):
  o, lse = kernel.forward(*operands)
  return o.astype(operands[0].dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash(kernel: FlashKernel, *operands):
  """Differentiable attention of `operands` (q first: the output takes its dtype) by `kernel`."""
  return _forward(kernel, operands)[0]


def _flash_fwd(kernel, *operands):
  out, lse = _forward(kernel, operands)
  # With dropout, `out` is the dropped output, so delta below is the one the dropped backward needs.
  return out, (operands, out, lse)


def _flash_bwd(kernel, res, do):
  operands, out, lse = res
  delta = kernel.rows_to_lse(jnp.sum(do.astype(F32) * out.astype(F32), axis=-1))
  return tuple(kernel.backward(operands, lse, do, delta))


flash.defvjp(_flash_fwd, _flash_bwd)


def heads_before_rows(rows):
  """[B, T, N] -> [B, N, T]: the ring's lse layout (`backends/base.py`)."""
  return jnp.swapaxes(rows, 1, 2)


@dataclasses.dataclass(frozen=True)
class RingKernel:
  """A `FlashKernel` of the ring's layout (o [B, T, N, H], lse [B, N, T]) from a forward `fwd(*operands, cfg)` and
  a backward `bwd(operands, lse, do, delta, cfg)` of one hashable configuration: the portable ring loop and the
  all-gather strategy are two of these."""

  fwd: Callable
  bwd: Callable
  cfg: object
  rows_to_lse = staticmethod(heads_before_rows)

  def forward(self, *operands):
    return self.fwd(*operands, self.cfg)

  def backward(self, operands, lse, do, delta):
    return self.bwd(operands, lse, do, delta, self.cfg)

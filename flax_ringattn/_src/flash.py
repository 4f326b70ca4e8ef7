"""The one flash-attention `custom_vjp` of the library.

Every attention path computes, in its forward, the output o and the *final*
log-sum-exp of each row, and its backward needs only the inputs, the output,
that lse, dO and delta = rowsum(dO * O).  That is the block contract of
`backends/base.py`, lifted to whole calls: the portable ring loop, the
all-gather strategy, the in-kernel TPU ring and paged attention each supply a
`FlashKernel` (their forward and backward halves) and run through `flash`.
The Ulysses strategies are the ring loop after an all-to-all, so they run
through it too.

    out = flash(kernel, sinks, *operands)

    forward : o, lse = kernel.forward(*operands)
              with sinks: lse' = logaddexp(lse, s_h), o' = o * exp(lse - lse')
              out = o'.astype(operands[0].dtype)
              residuals (operands, sinks, out, lse'): O(local shard), never a rotated copy
    backward: delta = kernel.rows_to_lse(rowsum(dO * out))  (in lse's layout)
              cotangents = kernel.backward(operands, lse', do, delta)
              dsinks[h] = -sum over rows of head h of exp(s_h - lse') * rowsum(dO * out)

Attention sinks (gpt-oss): one learned logit s_h per q head joins every row's
softmax denominator and carries no value.  They only rescale finished rows, so
they live here, once per call, after the whole ring's softmax state is final
(never once per hop): the kernel's backward, run on the sink-inclusive lse',
computes exactly the probabilities exp(l_ij - lse') of the sinks' softmax, and
delta of the rescaled output is the one its backward needs.  No kernel changes
for them.  A row with no visible key keeps o = 0 and puts all its mass in the
sink (lse' = s_h); a sink of -inf is no sink.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from flax_ringattn._src import vma

F32 = jnp.float32


class FlashKernel(Protocol):
  """The two halves of one attention path; hashable (a `custom_vjp` nondiff argument)."""

  def forward(self, *operands):
    """(o, lse): o shaped like the output (any float dtype), lse float32 in the kernel's row layout."""

  def rows_to_lse(self, rows):
    """A per-row statistic in the output's row layout (o.shape[:-1], q heads last) -> lse's layout."""

  def lse_to_rows(self, lse):
    """The inverse of `rows_to_lse`."""

  def backward(self, operands, lse, do, delta) -> tuple:
    """One cotangent per operand (None for integer operands), in the operands' dtypes."""


def _sink_rows(sinks, rows):
  """The [N] sinks as float32, broadcast against per-row statistics `rows` (q heads last)."""
  return vma.like(jnp.broadcast_to(sinks.astype(F32), rows.shape), rows)


def merge_rows(o, rows, o_b, rows_b):
  """The online-softmax merge of two normalised partials o [..., Hv] with their lse `rows` (o.shape[:-1]):
  (o, lse) of the union of their keys.  A row empty in both (lse -inf) stays 0 / -inf, never NaN."""
  m = jnp.maximum(rows, rows_b)
  m_safe = jnp.where(jnp.isneginf(m), 0.0, m)
  w, w_b = jnp.exp(rows - m_safe), jnp.exp(rows_b - m_safe)
  total = w + w_b
  empty = total == 0.0
  total = jnp.where(empty, 1.0, total)
  merged = jnp.where(empty, -jnp.inf, m_safe + jnp.log(total))
  return o * (w / total)[..., None] + o_b * (w_b / total)[..., None], merged


def apply_sinks(kernel, o, lse, sinks):
  """(o', lse') of finished rows (o, lse in `kernel`'s layouts) with the [N] sinks in their softmax:
  lse' = logaddexp(lse, s_h), o' = o * exp(lse - lse').  Also for serving paths outside `flash` (the paged
  fused cache write)."""
  if sinks is None:
    return o, lse
  rows = kernel.lse_to_rows(lse)
  with_sink = jnp.logaddexp(rows, _sink_rows(sinks, rows))
  # A sink of -inf on an empty row leaves lse' = -inf: keep that row's zero output (no exp(-inf + inf)).
  kept = jnp.where(jnp.isneginf(with_sink), 0.0, jnp.exp(rows - with_sink))
  return o * kept[..., None], kernel.rows_to_lse(with_sink)


def _forward(kernel, sinks, operands):
  o, lse = apply_sinks(kernel, *kernel.forward(*operands), sinks)
  return o.astype(operands[0].dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def flash(kernel: FlashKernel, sinks, *operands):
  """Differentiable attention of `operands` (q first: the output takes its dtype) by `kernel`; `sinks`: None or
  the [N] attention-sink logits of the q heads the output holds (differentiable)."""
  return _forward(kernel, sinks, operands)[0]


# The names of the forward's own residuals (`jax.ad_checkpoint.checkpoint_name`): a remat policy that saves them
# keeps the backward from running the forward kernel again (`save_attention_residuals`).
RESIDUAL_NAMES = ("flax_ringattn.attention_out", "flax_ringattn.attention_lse")


def save_attention_residuals(prim, *args, **params) -> bool:
  """A `jax.checkpoint` / `nnx.remat` policy: save this library's attention output and its log-sum-exp (per layer
  O(T * N * Hv), the size of the output), and the structure recovered from a traced dense mask (O(T)); recompute
  everything else.  Under a plain remat a block's backward reruns its attention forward kernel to rebuild them,
  and reads the model's [T, T] mask again; with this policy it does neither: one kernel fewer per layer to run and
  to compile.  Join it with a policy of your own through `jax.checkpoint_policies.save_from_both_policies`.

      run = nnx.remat(block, policy=flax_ringattn.save_attention_residuals)
  """
  return _SAVE_NAMED(prim, *args, **params)


# A traced dense mask's recovered structure (segment ids, spans, verdict: O(T) per row), named where the mask is read
# (`ring/dense.py`): saved with the residuals, a rematerialised block's backward neither reads the [T, T] mask again
# nor keeps it alive for the backward.
MASK_STRUCTURE_NAME = "flax_ringattn.mask_structure"

_SAVE_NAMED = jax.checkpoint_policies.save_only_these_names(*RESIDUAL_NAMES, MASK_STRUCTURE_NAME)
_SAVE_MASK = jax.checkpoint_policies.save_only_these_names(MASK_STRUCTURE_NAME)


def save_mask_structure(prim, *args, **params) -> bool:
  """A `jax.checkpoint` / `nnx.remat` policy for long sequences: save only the structure recovered from a traced
  dense mask (segment ids, spans and verdict, O(T) per layer) and recompute everything else, the attention forward
  included.  Under a plain remat each block's backward checks the model's [T, T] mask again, so the mask stays
  alive through the whole backward (1 GiB of bool at 32k tokens); with this policy it is read once, in the forward.
  Compiled for a v5e, a remat'd Qwen2.5-0.5B-shaped decoder (24 blocks) at 32k tokens needed 16.0 GiB of
  temporaries under a plain remat (it does not fit), 10.8 GiB with this policy, and 17.6 GiB with
  `save_attention_residuals` (which also keeps each block's attention output), against 10.6 GiB with splash
  swapped in by hand (which reads no mask).

      run = nnx.remat(block, policy=flax_ringattn.save_mask_structure)
  """
  return _SAVE_MASK(prim, *args, **params)


def _flash_fwd(kernel, sinks, *operands):
  out, lse = _forward(kernel, sinks, operands)
  out, lse = (checkpoint_name(x, name) for x, name in zip((out, lse), RESIDUAL_NAMES, strict=True))
  # With dropout, `out` is the dropped output, so delta below is the one the dropped backward needs.
  return out, (operands, sinks, out, lse)


def _flash_bwd(kernel, res, do):
  operands, sinks, out, lse = res
  rows_delta = jnp.sum(do.astype(F32) * out.astype(F32), axis=-1)
  grads = tuple(kernel.backward(operands, lse, do, kernel.rows_to_lse(rows_delta)))
  if sinks is None:
    return (None, *grads)
  rows = kernel.lse_to_rows(lse)
  s = _sink_rows(sinks, rows)
  # d p_ij / d s_h = -p_ij * p_sink for every key of a row of head h (dropped or not), so d out / d s_h =
  # -p_sink * out and d loss / d s_h = -sum over the rows of head h of p_sink * rowsum(dO * out).
  p_sink = jnp.where(jnp.isneginf(rows), 0.0, jnp.exp(s - rows))
  dsinks = -jnp.sum((p_sink * rows_delta).reshape(-1, sinks.shape[0]), axis=0)
  # Rows are this device's: sum over the manual axes they vary over and the (replicated) sinks do not.
  dsinks = vma.sum_to(dsinks, sinks)
  return (dsinks.astype(sinks.dtype), *grads)


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
  lse_to_rows = staticmethod(heads_before_rows)

  def forward(self, *operands):
    return self.fwd(*operands, self.cfg)

  def backward(self, operands, lse, do, delta):
    return self.bwd(operands, lse, do, delta, self.cfg)

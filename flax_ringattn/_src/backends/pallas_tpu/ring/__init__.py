"""The in-kernel ring (`implementation="pallas_tpu_ring"`): the whole ring in one kernel per direction, run through
the `flash` custom_vjp as a `FlashKernel` (`PallasTpuBackend.fused_ring` offers it to the ring strategy).

The protocol: `ring/protocol.py`.  The kernels: `ring/vmem_forward.py` / `ring/vmem_backward.py` with VMEM slots (whole
shards resident), `ring/hbm_forward.py` / `ring/hbm_backward.py` with HBM slots (tiles streamed: any shard
length), chosen per call by `planner.plan_ring`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from flax_ringattn._src import flash
from flax_ringattn._src.backends.base import AttentionSpec
from flax_ringattn._src.backends.pallas_tpu.ring.vmem_backward import ring_bwd
from flax_ringattn._src.backends.pallas_tpu.ring.vmem_forward import ring_fwd

F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelRing:
  """The in-kernel ring as a `flash.FlashKernel` (hashable): operands (q, k, v, q_seg, kv_seg, drop)."""

  axis_name: object  # a bound mesh axis, a tuple of them, or None (a ring of one)
  load_balance: bool
  spec: AttentionSpec
  interpret: object  # None (compile for TPU) or a pltpu.InterpretParams
  rows_to_lse = staticmethod(flash.heads_before_rows)

  def _where(self):
    return dict(spec=self.spec, axis_name=self.axis_name, load_balance=self.load_balance, interpret=self.interpret)

  def forward(self, q, k, v, q_seg, kv_seg, drop):
    return ring_fwd(q, k, v, q_seg, kv_seg, dropout=drop, **self._where())

  def backward(self, operands, lse, do, delta):
    q, k, v, q_seg, kv_seg, drop = operands
    dq, dk, dv = ring_bwd(q, k, v, do, lse, delta, q_seg, kv_seg, dropout=drop, **self._where())
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


def kernel_ring_attention_local(q, k, v, q_seg, kv_seg, drop=None, *, axis_name, load_balance, spec, interpret):
  """Per-device entry point (inside shard_map, or a ring of one): [B, T, N, H] in q.dtype.

  `drop`: the int32[4] dropout operand of this shard (`_src/dropout.py`), or None without dropout.
  """
  kernel = KernelRing(axis_name=axis_name, load_balance=load_balance, spec=spec, interpret=interpret)
  return flash.flash(kernel, q, k, v, q_seg, kv_seg, drop)

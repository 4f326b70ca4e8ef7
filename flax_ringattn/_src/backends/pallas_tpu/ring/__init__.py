"""The in-kernel ring (`implementation="pallas_tpu_ring"`): the whole ring in one kernel per direction, run through
the `flash` custom_vjp as a `FlashKernel` (`PallasTpuBackend.fused_ring` offers it to the ring strategy).

The protocol: `ring/protocol.py`.  The kernels: `ring/vmem_forward.py` / `ring/vmem_backward.py` with VMEM slots (whole
shards resident), `ring/hbm_forward.py` / `ring/hbm_backward.py` with HBM slots (tiles streamed: any shard
length), chosen per call by `planner.plan_ring`.
"""

from __future__ import annotations

import dataclasses

from flax_ringattn._src import flash
from flax_ringattn._src.backends.base import AttentionSpec
from flax_ringattn._src.backends.pallas_tpu.ring.vmem_backward import ring_bwd
from flax_ringattn._src.backends.pallas_tpu.ring.vmem_forward import ring_fwd


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelRing:
  """The in-kernel ring as a `flash.FlashKernel` (hashable): operands (q, k, v, q_tok, kv_tok, drop)
  with the shards' `masks.Tokens` (positions None unless given per row: the kernels compute the layout's)."""

  axis_name: object  # a bound mesh axis, a tuple of them, or None (a ring of one)
  load_balance: bool
  spec: AttentionSpec
  interpret: object  # None (compile for TPU) or a pltpu.InterpretParams
  rows_to_lse = staticmethod(flash.heads_before_rows)
  lse_to_rows = staticmethod(flash.heads_before_rows)

  def _where(self):
    return dict(spec=self.spec, axis_name=self.axis_name, load_balance=self.load_balance, interpret=self.interpret)

  def forward(self, q, k, v, q_tok, kv_tok, drop):
    return ring_fwd(q, k, v, q_tok, kv_tok, dropout=drop, **self._where())

  def backward(self, operands, lse, do, delta):
    q, k, v, q_tok, kv_tok, drop = operands
    dq, dk, dv = ring_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, dropout=drop, **self._where())
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None

"""Portable XLA backend of the block contract (runs on CPU, GPU and TPU)."""

from __future__ import annotations

from flax_ringattn._src.backends.xla.backward import block_bwd
from flax_ringattn._src.backends.xla.forward import block_fwd


class XlaBackend:
  name = "xla"
  calls_must_be_uniform = False

  def check_supported(self, *, dtype, spec, shapes) -> None:
    del dtype, spec, shapes  # every valid input is supported

  def fwd(self, q, k, v, q_tok, kv_tok, *, spec, dropout=None, out_dtype=None):
    o, lse = block_fwd(q, k, v, q_tok, kv_tok, spec=spec, dropout=dropout)
    return o.astype(out_dtype or o.dtype), lse

  def bwd(self, q, k, v, do, lse, delta, q_tok, kv_tok, *, spec, dropout=None):
    return block_bwd(q, k, v, do, lse, delta, q_tok, kv_tok, spec=spec, dropout=dropout)

"""`implementation="pallas_tpu_ring"`: the whole ring in one kernel per direction, with its custom_vjp.

The protocol: `ring_protocol.py`.  The kernels: `ring_forward.py` / `ring_backward.py` with VMEM slots (whole
shards resident), `ring_forward_hbm.py` / `ring_backward_hbm.py` with HBM slots (tiles streamed: any shard
length), chosen per call by `planner.plan_ring`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flax_ringattn._src.backends.base import AttentionSpec
from flax_ringattn._src.backends.pallas_tpu.ring_backward import ring_bwd
from flax_ringattn._src.backends.pallas_tpu.ring_forward import ring_fwd

F32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelRingConfig:
  """Static configuration of one in-kernel ring call (hashable: a custom_vjp nondiff arg)."""

  axis_name: object  # a bound mesh axis, a tuple of them, or None (a ring of one)
  load_balance: bool
  spec: AttentionSpec
  interpret: object  # None (compile for TPU) or a pltpu.InterpretParams


def _fwd(q, k, v, q_seg, kv_seg, drop, cfg: KernelRingConfig):
  return ring_fwd(
    q,
    k,
    v,
    q_seg,
    kv_seg,
    spec=cfg.spec,
    axis_name=cfg.axis_name,
    load_balance=cfg.load_balance,
    interpret=cfg.interpret,
    dropout=drop,
  )


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _kernel_ring_attention(q, k, v, q_seg, kv_seg, drop, cfg: KernelRingConfig):
  o, _ = _fwd(q, k, v, q_seg, kv_seg, drop, cfg)
  return o.astype(q.dtype)


def _kernel_ring_attention_fwd(q, k, v, q_seg, kv_seg, drop, cfg: KernelRingConfig):
  o, lse = _fwd(q, k, v, q_seg, kv_seg, drop, cfg)
  out = o.astype(q.dtype)
  return out, (q, k, v, q_seg, kv_seg, drop, out, lse)  # O(local shard): never rotated copies


def _kernel_ring_attention_bwd(cfg: KernelRingConfig, res, do):
  q, k, v, q_seg, kv_seg, drop, out, lse = res
  # With dropout `out` is the dropped output, so delta below is the one the contract asks for.
  delta = jnp.swapaxes(jnp.sum(do.astype(F32) * out.astype(F32), axis=-1), 1, 2)  # [B, N, T]
  dq, dk, dv = ring_bwd(
    q,
    k,
    v,
    do,
    lse,
    delta,
    q_seg,
    kv_seg,
    spec=cfg.spec,
    axis_name=cfg.axis_name,
    load_balance=cfg.load_balance,
    interpret=cfg.interpret,
    dropout=drop,
  )
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None


_kernel_ring_attention.defvjp(_kernel_ring_attention_fwd, _kernel_ring_attention_bwd)


def kernel_ring_attention_local(q, k, v, q_seg, kv_seg, drop=None, *, axis_name, load_balance, spec, interpret):
  """Per-device entry point (inside shard_map, or a ring of one): [B, T, N, H] in q.dtype.

  `drop`: the int32[4] dropout operand of this shard (`_src/dropout.py`), or None without dropout.
  """
  cfg = KernelRingConfig(axis_name=axis_name, load_balance=load_balance, spec=spec, interpret=interpret)
  return _kernel_ring_attention(q, k, v, q_seg, kv_seg, drop, cfg)


@dataclasses.dataclass(frozen=True)
class PallasTpuRingBackend:
  """The in-kernel ring: not a block backend, the op hands it the whole per-device ring (`ring_local`)."""

  interpret: object = None
  name = "pallas_tpu_ring"
  calls_must_be_uniform = True  # (unused: the ring loop never calls this backend)

  def check_supported(self, *, dtype, spec, shapes) -> None:
    from flax_ringattn._src.backends.pallas_tpu import SUPPORTED_DTYPES, on_tpu

    if self.interpret is None and not on_tpu():
      raise NotImplementedError(
        f"pallas_tpu_ring needs a TPU (default backend is {jax.default_backend()!r}); pass interpret=True to run "
        "the kernel in Pallas TPU interpret mode on CPU, or implementation='xla'"
      )
    if jnp.dtype(dtype) not in SUPPORTED_DTYPES:
      raise NotImplementedError(f"pallas_tpu_ring supports float32 and bfloat16 inputs, got dtype={jnp.dtype(dtype)}")
    del spec, shapes  # shard shapes are checked against VMEM by `fits` and when the kernel is traced

  def ring_local(self, q, k, v, q_seg, kv_seg, drop=None, *, axis_name, load_balance, spec):
    return kernel_ring_attention_local(
      q, k, v, q_seg, kv_seg, drop, axis_name=axis_name, load_balance=load_balance, spec=spec, interpret=self.interpret
    )

  def fits(self, *, T, S, N, K, H, dtype, spec, n=1) -> bool:
    """Whether the kernels run a (T, S) shard pair: with VMEM slots, or HBM slots and tiles (`planner.ring_fits`)."""
    from flax_ringattn._src.backends.pallas_tpu import planner

    return planner.ring_fits(
      T=T,
      S=S,
      n=n,
      num_heads=N,
      num_kv_heads=K,
      head_dim=H,
      dtype=dtype,
      has_segments=spec.mask.has_segments,
      soft_cap=spec.logits_soft_cap is not None,
      dropout=bool(spec.dropout_rate),
    )

"""The paged op's registry: the ragged paged Pallas TPU kernel, then the portable XLA backend.

The selection rules are the ring's (`backends/registry.py`).  An implementation also says which blocks it runs
a call with (`blocks`): the XLA backend `DEFAULT_PAGED_BLOCKS` unless the call names some; the TPU kernel the
VMEM planner's choice (`plan_paged_block_sizes`), so a call whose blocks cannot fit VMEM is "not supported here"
and `implementation=None` falls through to XLA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from flax_ringattn._src.backends import pallas_tpu
from flax_ringattn._src.backends.pallas_tpu import paged as pallas_paged
from flax_ringattn._src.backends.pallas_tpu import planners
from flax_ringattn._src.backends.registry import Registry
from flax_ringattn._src.backends.xla import paged as xla_paged
from flax_ringattn._src.block_sizes import BlockSizes
from flax_ringattn._src.paged import common

DEFAULT_PAGED_BLOCKS = BlockSizes(block_q=16, block_kv=128)
LIKE_K = "like k_pages"  # `PagedPallasTpu.blocks` without v_pages: v's head dim is k's


@dataclasses.dataclass(frozen=True)
class PagedXla:
  """Portable paged attention (`backends/xla/paged.py`)."""

  name = "xla"

  def check_supported(self, **call) -> None:
    del call  # every valid input is supported

  def blocks(self, *, block_sizes, **call) -> BlockSizes:
    del call
    return DEFAULT_PAGED_BLOCKS if block_sizes is None else block_sizes

  def fwd(self, q, k_pages, v_pages, *args, spec):
    return xla_paged.paged_fwd(q, *_heads_apart(q, k_pages, v_pages), *args, spec=spec)

  def bwd(self, q, k_pages, v_pages, *args, spec, bidirectional_ids=None):
    k4, v4 = _heads_apart(q, k_pages, v_pages)
    dq, dk, dv = xla_paged.paged_bwd(q, k4, v4, *args, spec=spec, bidirectional_ids=bidirectional_ids)
    return (dq, *_as_pages(dk, dv, k_pages, v_pages))


def _heads_apart(q, k_pages, v_pages):
  """The pages as [P, page_size, K, h] (merged ones reshaped, kv pages split: the XLA backend indexes kv heads)."""
  K = common.page_dims(q, k_pages, v_pages)[2]
  k_pages, v_pages = common.kv_apart(k_pages, v_pages)
  return common.unmerge_pages(k_pages, K), common.unmerge_pages(v_pages, K)


def _as_pages(dk, dv, k_pages, v_pages):
  """Page cotangents dk / dv [P, page_size, K, h] in the layout of the pages they belong to: (dkv, None) for kv
  pages [P, 2, page_size, K * H]."""
  if common.kv_together(v_pages):
    P, _, ps, _ = k_pages.shape
    return jnp.stack([dk.reshape(P, ps, -1), dv.reshape(P, ps, -1)], axis=1), None
  return dk.reshape(k_pages.shape), dv.reshape(v_pages.shape)


@dataclasses.dataclass(frozen=True)
class PagedPallasTpu:
  """The ragged paged Pallas TPU kernel (`backends/pallas_tpu/paged/`); `interpret` runs it on CPU."""

  interpret: object = None
  name = "pallas_tpu"
  fused_cache_write = True  # `paged_fwd_write`: the new tokens' K/V written in the same launch

  def with_interpret(self, interpret):
    return dataclasses.replace(self, interpret=pallas_tpu.normalize_interpret(interpret))

  def check_supported(self, *, q, k_pages, block_sizes, v_pages=LIKE_K, **call) -> None:
    if self.interpret is None and not pallas_tpu.on_tpu():
      raise NotImplementedError(
        f"pallas_tpu needs a TPU (default backend is {jax.default_backend()!r}); pass interpret=True to run the "
        "kernels in Pallas TPU interpret mode on CPU, or implementation='xla'"
      )
    if jnp.dtype(q.dtype) not in pallas_tpu.SUPPORTED_DTYPES:
      raise NotImplementedError(f"pallas_tpu supports float32 and bfloat16 inputs, got dtype={jnp.dtype(q.dtype)}")
    v_pages = k_pages if v_pages is LIKE_K else v_pages
    blocks = self.blocks(q=q, k_pages=k_pages, v_pages=v_pages, block_sizes=block_sizes, **call)
    ps = common.page_size_of(k_pages, v_pages)
    pallas_paged.check_supported(
      q, k_pages, v_pages, block_q=blocks.block_q, pages_per_block=max(1, blocks.block_kv // ps)
    )

  def blocks(
    self,
    *,
    q,
    k_pages,
    block_sizes,
    k_scale,
    v_scale,
    pages_per_seq,
    logits_soft_cap,
    v_pages=LIKE_K,
    bidirectional=False,
  ) -> BlockSizes:
    """The call's blocks, or the planner's for its shapes (v_pages: its head dim Hv may differ from H, as in
    MLA; None: k_pages are kv pages; left out: like k_pages; `bidirectional`: the call has span ids, whose
    buffers the planner counts)."""
    if block_sizes is not None:
      return block_sizes
    T, N, H = q.shape
    v_pages = k_pages if v_pages is LIKE_K else v_pages
    _, ps, K, _, Hv = common.page_dims(q, k_pages, v_pages)
    f, _ = pallas_paged.lane_groups(q, k_pages, v_pages, k_scale, v_scale)
    K, H, Hv = K // f, H * f, Hv * f  # heads narrower than the lanes run f to a 128-lane group
    rows = tuple(0 if x is None else (1 if x.ndim < 3 else ps) for x in (k_scale, v_scale))
    try:
      cap = logits_soft_cap is not None
      merged = k_pages.ndim == 3 or common.kv_together(v_pages)  # kv pages buffer as merged ones do
      args = (T, ps, pages_per_seq, N, K, H, Hv, q.dtype, k_pages.dtype, rows, cap, bidirectional, merged)
      return _planned(*args, planners.tuned.version())
    except ValueError as e:
      raise NotImplementedError(str(e)) from None

  def fwd(self, *args, spec):
    return _paged_fwd(*args, spec=spec, interpret=self.interpret)

  def fwd_write(self, *args, spec):
    return _paged_fwd_write(*args, spec=spec, interpret=self.interpret)

  def bwd(self, *args, spec, bidirectional_ids=None):
    return _paged_bwd(*args, spec=spec, interpret=self.interpret, bidirectional_ids=bidirectional_ids)


# The kernels behind one jit each (as the block kernels, `backends/pallas_tpu/__init__.py`): a decoder's layers,
# which call them with the same shapes, lower to one Mosaic kernel that each calls, compiled once per program
# rather than once per layer.  Compiled for a v5e on CPU, 8 layers' paged kernels took 21.4 s apart and 8.6 s behind
# one jit; a serving step program of a 24-block model holds 24.
_paged_fwd = jax.jit(pallas_paged.paged_fwd, static_argnames=("spec", "interpret"))
_paged_fwd_write = jax.jit(pallas_paged.paged_fwd_write, static_argnames=("spec", "interpret"))
_paged_bwd = jax.jit(pallas_paged.paged_bwd, static_argnames=("spec", "interpret"))


@functools.lru_cache(maxsize=256)
def _planned(T, ps, pages_per_seq, N, K, H, Hv, q_dtype, page_dtype, scale_rows, soft_cap, spans, merged, tables):
  """`plan_paged_block_sizes`, once per shape and set of tuned tables (`tables`: `tuned.version()`): a call
  consults it to check support and again for its blocks, and a serving step asks twice (does the fused write
  run, then the write itself)."""
  del tables
  return planners.plan_paged_block_sizes(
    T,
    ps,
    pages_per_seq,
    N,
    K,
    H,
    q_dtype,
    page_dtype,
    scale_rows=scale_rows,
    soft_cap=soft_cap,
    v_head_dim=Hv,
    bidirectional=spans,
    merged=merged,
  )


PAGED = Registry(
  "paged_attention",
  (PagedPallasTpu(), PagedXla()),
  preference=("pallas_tpu", "xla"),
  interpret_default="pallas_tpu",
  interpret_error="interpret=... applies to implementation='pallas_tpu' only, got implementation={implementation!r}",
)


def check_implementation(implementation):
  """An `implementation=` the paged registry knows (or None), with the error `paged_attention` gives for it, for
  a caller that keeps the name for later (the paged layer checks it at construction).  Whether the named
  implementation supports a call is the call's business."""
  return PAGED.check_name(implementation)

"""Bidirectional spans (`bidirectional_ids`) in the paged op, its implementations and the paged layer (issue 32).

A call's new tokens of one sequence with the same nonzero id see each other in both directions (Gemma 3's image
tokens, a prefix-LM prefix), later rows of the call included, whatever causal, window and chunk say; keys cached
by earlier calls carry id 0.  Checked against the float64 paged oracle (tests/paged_oracle.py), forward and
gradients, on one ragged batch whose spans cross a page boundary, a kv-block boundary and a q-block boundary.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import export
from paged_cases import make_batch, paged_vjp
from paged_oracle import paged_oracle
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src.backends.pallas_tpu import paged as pallas_paged
from flax_ringattn._src.masks import MaskSpec
from flax_ringattn._src.options import AttentionSpec
from flax_ringattn._src.paged import op as paged_ops
from flax_ringattn._src.testing.interpret import interpret_params, no_races

# Pages of 8 tokens (the Pallas TPU kernel's f32 minimum), kv blocks of 2 pages, q blocks of 8 rows.
BLOCKS = fr.BlockSizes(block_q=8, block_kv=16)
# (q_len, kv_len) and the spans (first new token, end, id) of each live sequence; rows are back to back.
SEQS = [
  ((20, 20), [(0, 18, 1)]),  # a prefix-LM prefix of 18 tokens: crosses pages, the kv block at 16, q blocks
  # 14 cached; positions 15..24 cross the page / kv block at 16 and two q blocks (rows 14..25 of q); id 9 on
  # positions 14 and 25, apart: the last rows' window and chunk start in kv block 1, their spans in block 0.
  ((12, 26), [(1, 11, 7), (0, 1, 9), (11, 12, 9)]),
  ((1, 9), [(0, 1, 3)]),  # a decode row with an id: itself only
  ((4, 4), [(0, 4, 7)]),  # id 7 again: another sequence's span never meets the first's
]
MASKS = {"causal": {}, "chunk5_window3": dict(chunk_size=5, local_window_size=(3, 0))}
IMPLEMENTATIONS = {
  "xla": dict(implementation="xla"),
  "pallas_tpu": dict(implementation="pallas_tpu", interpret=None),  # interpret params added per test
}
# XLA under both masks; the Pallas kernel under the one that needs both ends of its kv walk extended.
RUNS = [("xla", "causal"), ("xla", "chunk5_window3")]
RUNS += [pytest.param("pallas_tpu", "chunk5_window3", marks=pytest.mark.interpret, id="pallas_tpu-chunk5_window3")]


def span_batch(seed=0):
  rng = np.random.default_rng(seed)
  b = make_batch(rng, [s for s, _ in SEQS], page_size=8, pages_per_seq=4, num_tokens=40)
  ids = np.zeros(b.q.shape[0], np.int32)
  cu = np.asarray(b.cu_q_lens)
  for i, (_, spans) in enumerate(SEQS):
    for lo, hi, span in spans:
      ids[cu[i] + lo : cu[i] + hi] = span
  return b, jnp.asarray(ids), rng


@pytest.mark.parametrize("implementation,mask", RUNS)
def test_spans_match_the_oracle(implementation, mask):
  b, ids, rng = span_batch()
  do = jnp.asarray(rng.normal(size=b.out_shape), jnp.float32)
  kw = dict(IMPLEMENTATIONS[implementation], block_sizes=BLOCKS, bidirectional_ids=ids, **MASKS[mask])
  tpu = implementation == "pallas_tpu"
  if tpu:
    kw["interpret"] = interpret_params()
  with no_races() if tpu else contextlib.nullcontext():
    out, grads = jax.jit(lambda args, do: paged_vjp(fr.paged_attention, args, do, **kw))(b.args, do)
    jax.block_until_ready((out, grads))
  want, want_grads = paged_oracle(*b.args, do=do, bidirectional_ids=ids, **MASKS[mask])
  assert_close(out, want, jnp.float32)
  assert_close(grads, want_grads, jnp.float32, "grad")
  # The spans matter here: without them the answer is different.
  plain, _ = paged_oracle(*b.args, **MASKS[mask])
  assert float(np.abs(np.asarray(out) - plain).max()) > 1e-3
  ref = fr.paged_reference_attention(*b.args, bidirectional_ids=ids, **MASKS[mask])
  assert_close(ref, want, jnp.float32)


def test_the_fused_cache_write_steps_aside():
  """The fused write stores the new rows q block by q block: with spans the call has no fused write (its
  `attend_and_write` says so; the layer appends, then attends), and the kernel itself refuses them."""
  b, ids, _ = span_batch()
  kw = dict(implementation="pallas_tpu", interpret=True, block_sizes=BLOCKS)
  assert paged_ops.plan_call(*b.args, **kw).fuses_cache_write
  call = paged_ops.plan_call(*b.args, bidirectional_ids=ids, **kw)
  assert not call.fuses_cache_write
  k_new = jnp.zeros((b.q.shape[0], *b.k_pages.shape[2:]), b.k_pages.dtype)
  with pytest.raises(NotImplementedError, match=r"no fused cache write .* bidirectional ids True"):
    call.attend_and_write(b.q, k_new, k_new, b.k_pages, b.v_pages)
  with pytest.raises(NotImplementedError, match="the fused cache write writes q block by q block"):
    call.backend.fwd_write(b.q, k_new, k_new, *b.args[1:], None, None, None, None, spec=call.spec)


def test_bidirectional_ids_are_checked():
  b, ids, _ = span_batch()
  T = b.q.shape[0]
  with pytest.raises(
    ValueError, match=rf"bidirectional_ids must be \[T\]=\({T},\), .* got bidirectional_ids.shape=\(1, {T}\)"
  ):
    fr.paged_attention(*b.args, bidirectional_ids=ids[None])
  with pytest.raises(
    TypeError, match=r"bidirectional_ids must be an integer array, got bidirectional_ids.dtype=float32"
  ):
    fr.paged_reference_attention(*b.args, bidirectional_ids=ids.astype(jnp.float32))
  with pytest.raises(TypeError, match=r"bidirectional_ids must be an int32 array \[T\] .* got list"):
    fr.paged_attention(*b.args, bidirectional_ids=[0] * T)


def test_paged_layer_takes_bidirectional_ids():
  """A prompt with an image span (crossing a page), then one decode, equals the ring layer with the same ids on
  the whole sequence (same parameters)."""
  D, T = 16, 11
  paged = fr.PagedMultiHeadAttention(2, D, num_kv_heads=1, implementation="xla", rngs=nnx.Rngs(0))
  ring = fr.RingMultiHeadAttention(2, D, num_kv_heads=1, implementation="xla", rngs=nnx.Rngs(1))
  nnx.update(ring, nnx.state(paged, nnx.Param))
  paged.init_cache(num_pages=8, page_size=4, max_num_seqs=1, pages_per_seq=4)
  x = jax.random.normal(jax.random.key(2), (T, D))
  ids = jnp.asarray([0, 0, 0, 5, 5, 5, 5, 5, 0, 0, 0], jnp.int32)  # the span: positions 3..7 (pages 0 and 1)
  one = jnp.asarray([1], jnp.int32)
  run = nnx.jit(lambda m, x, cu, ids: m(x, cu_q_lens=cu, num_seqs=one, bidirectional_ids=ids))
  step = lambda lo, hi: run(paged, x[lo:hi], jnp.asarray([0, hi - lo], jnp.int32), ids[lo:hi])  # noqa: E731
  got = jnp.concatenate([step(0, 10), step(10, 11)])
  want = ring(x[None], is_causal=True, bidirectional_ids=ids[None])[0]
  assert_close(got, want, jnp.float32)
  causal = ring(x[None], is_causal=True)[0]
  assert float(jnp.abs(got - causal).max()) > 1e-3


def test_span_kernels_lower_for_tpu():
  """jax.export runs the Pallas -> Mosaic lowering of the forward and backward kernels with spans (the q block's
  ids, the kv id table's copies) for TPU on CPU."""
  sds = jax.ShapeDtypeStruct
  T, N, K, H, P, ps, S = 64, 8, 2, 128, 32, 16, 4
  spec = AttentionSpec(
    mask=MaskSpec(is_causal=True, has_bidirectional=True), scale=0.1, block_sizes=fr.BlockSizes(block_q=16, block_kv=32)
  )
  meta = (sds((S,), jnp.int32), sds((S, 8), jnp.int32), sds((S + 1,), jnp.int32), sds((1,), jnp.int32))
  q, pages = sds((T, N, H), jnp.bfloat16), sds((P, ps, K, H), jnp.bfloat16)
  ids, lse = sds((T,), jnp.int32), sds((T, N), jnp.float32)
  fwd = jax.jit(lambda *a: pallas_paged.paged_fwd(*a, spec=spec, interpret=None))
  text = export.export(fwd, platforms=("tpu",))(q, pages, pages, *meta, None, None, ids).mlir_module()
  bwd = jax.jit(lambda *a, ids: pallas_paged.paged_bwd(*a, spec=spec, interpret=None, bidirectional_ids=ids))
  text += export.export(bwd, platforms=("tpu",))(q, pages, pages, *meta, None, None, lse, q, lse, ids=ids).mlir_module()
  assert text.count("tpu_custom_call") >= 2

"""Chunked attention (`chunk_size`) in the paged op, its implementations and the paged layer (issue 32).

Each sequence's rows see only the keys of their own chunk of positions (q_pos // C == kv_pos // C), causal and
windowed as usual; checked against the float64 paged oracle (tests/paged_oracle.py), forward and gradients.
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from paged_cases import make_batch, paged_vjp, scenario
from paged_oracle import paged_oracle
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src.testing.interpret import interpret_params, no_races

# Pages of 8 tokens (the Pallas TPU kernel's f32 minimum), kv blocks of 2 pages and q chunks of 8 rows: chunks of
# 5 positions cut across them, so kv blocks are skipped and kept in part; (5, 3) adds a window inside the chunk.
BLOCKS = fr.BlockSizes(block_q=8, block_kv=16)
MASKS = {"chunk5": dict(chunk_size=5), "chunk5_window3": dict(chunk_size=5, local_window_size=(3, 0))}
IMPLEMENTATIONS = {
  "xla": dict(implementation="xla"),
  "pallas_tpu": dict(implementation="pallas_tpu", interpret=None),  # interpret params added per test
}


@pytest.mark.parametrize("mask", list(MASKS))
@pytest.mark.parametrize(
  "implementation",
  # The Pallas runs are interpret mode: the marker gives them the harness's timeout (a protocol bug may hang).
  [pytest.param(name, marks=(pytest.mark.interpret,) if name == "pallas_tpu" else ()) for name in IMPLEMENTATIONS],
)
def test_chunked_matches_the_oracle(implementation, mask):
  rng = np.random.default_rng([5, len(mask)])
  b = make_batch(rng, scenario("mixed", rng), page_size=8, pages_per_seq=3)
  do = jnp.asarray(rng.normal(size=b.out_shape), jnp.float32)
  kw = dict(IMPLEMENTATIONS[implementation], block_sizes=BLOCKS, **MASKS[mask])
  tpu = implementation == "pallas_tpu"
  if tpu:
    kw["interpret"] = interpret_params()
  with no_races() if tpu else contextlib.nullcontext():
    out, grads = jax.jit(lambda args, do: paged_vjp(fr.paged_attention, args, do, **kw))(b.args, do)
    jax.block_until_ready((out, grads))
  want, want_grads = paged_oracle(*b.args, do=do, **MASKS[mask])
  assert_close(out, want, jnp.float32)
  assert_close(grads, want_grads, jnp.float32, "grad")
  # The chunk matters here: without it the answer is different.
  plain, _ = paged_oracle(*b.args, **{k: v for k, v in MASKS[mask].items() if k != "chunk_size"})
  assert float(np.abs(np.asarray(out) - plain).max()) > 1e-3
  ref = fr.paged_reference_attention(*b.args, **MASKS[mask])
  assert_close(ref, want, jnp.float32)


def test_paged_layer_takes_chunk_size():
  """A prompt prefilled in two steps into the paged layer, then one decode, equals the ring layer with the same
  chunk on the whole sequence (same parameters)."""
  C, D, T = 4, 16, 11
  paged = fr.PagedMultiHeadAttention(2, D, num_kv_heads=1, chunk_size=C, implementation="xla", rngs=nnx.Rngs(0))
  ring = fr.RingMultiHeadAttention(2, D, num_kv_heads=1, chunk_size=C, implementation="xla", rngs=nnx.Rngs(1))
  nnx.update(ring, nnx.state(paged, nnx.Param))
  assert paged.chunk_size == C
  paged.init_cache(num_pages=8, page_size=4, max_num_seqs=1, pages_per_seq=4)
  x = jax.random.normal(jax.random.key(2), (T, D))
  one = jnp.asarray([1], jnp.int32)
  parts = [paged(x[:6], cu_q_lens=jnp.asarray([0, 6], jnp.int32), num_seqs=one)]
  parts.append(paged(x[6:10], cu_q_lens=jnp.asarray([0, 4], jnp.int32), num_seqs=one))
  parts.append(paged(x[10:], cu_q_lens=jnp.asarray([0, 1], jnp.int32), num_seqs=one))
  want = ring(x[None], is_causal=True)[0]
  assert_close(jnp.concatenate(parts), want, jnp.float32)


def test_paged_layer_ring_prefill_takes_chunk_size():
  """The ring prefill of a prompt over a cache spread on 2 devices (pass-KV: the ring with the chunk on the zigzag
  layout), then two decode steps over the spread pages (never compacted to local positions: the chunk reads
  global ones), equal the ring layer with the same chunk on the whole sequence."""
  C, D, T, n = 4, 16, 13, 2
  mesh = make_mesh((n,), ("sp",))
  kw = dict(num_kv_heads=1, chunk_size=C, implementation="xla")
  paged = fr.PagedMultiHeadAttention(2, D, **kw, mesh=mesh, seq_axis="sp", rngs=nnx.Rngs(0))
  ring = fr.RingMultiHeadAttention(2, D, **kw, rngs=nnx.Rngs(1))
  nnx.update(ring, jax.tree.map(np.asarray, nnx.state(paged, nnx.Param)))  # the ring on one device
  x = jax.random.normal(jax.random.key(3), (T + 2, D))
  want = ring(x[None], is_causal=True)[0]
  paged.init_cache(num_pages=16, page_size=4, max_num_seqs=1, pages_per_seq=8)
  Tp = paged.kv_cache.get_value().ring_prefill_len(T)
  xp = fr.zigzag_order(jnp.concatenate([x[:T], jnp.zeros((Tp - T, D))]), n, axis=0)
  prefill = nnx.jit(lambda m, x: m.prefill(x, slot=0, num_tokens=T))
  step = nnx.jit(lambda m, x: m(x, cu_q_lens=jnp.asarray([0, 1], jnp.int32), num_seqs=jnp.asarray([1], jnp.int32)))
  parts = [jnp.asarray(fr.zigzag_inverse(np.asarray(prefill(paged, xp)), n, axis=0))[:T]]
  parts += [step(paged, x[t : t + 1]) for t in (T, T + 1)]
  assert_close(jnp.concatenate(parts), want, jnp.float32)


def test_chunk_size_is_checked():
  rng = np.random.default_rng(0)
  b = make_batch(rng, scenario("mixed", rng))
  with pytest.raises(ValueError, match=r"chunk_size must be >= 1 \(None means no chunks\), got chunk_size=0"):
    fr.paged_attention(*b.args, chunk_size=0)
  with pytest.raises(ValueError, match=r"chunk_size must be >= 1"):
    fr.PagedMultiHeadAttention(2, 8, chunk_size=-1, rngs=nnx.Rngs(0))

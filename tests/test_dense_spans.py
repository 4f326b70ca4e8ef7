"""Dense masks beyond causal + segments: Gemma 3's image spans, prefix-LM prefixes and Llama 4's chunks.

The masks are built here as such models build them (look-alikes in this file's words), on packed rows with key-only
padding.  Each must come back exactly (causal, segment ids, bidirectional ids), run as ring attention to the
float64 oracle's answer for the structure the test knows (not the recovered one), and convert unedited in a
hand-written decoder.  Masks outside the family are still refused.
"""

from __future__ import annotations

import handwritten_models as hm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from dense_oracle import dense_oracle
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_handwritten import F32, _loss
from tolerances import assert_close

import flax_ringattn as fr

T = 32  # 8 tokens per device on the ring of 4, 4 on the ring of 8: every span below crosses a shard boundary
CHUNK = 6


def _rows():
  """doc [3, T] (0: padding), valid, positions (restarting per document), image ids, prefix flags.

  Row 0: two documents and padding, an image in each document; row 1: one document with two adjacent images
  and a one-token image; row 2: a document, padding in the middle as its own document, a second document.
  """
  doc = np.zeros((3, T), np.int32)
  doc[0, :19], doc[0, 19:29] = 1, 2
  doc[1, :] = 1
  doc[2, :12], doc[2, 12:14], doc[2, 14:] = 1, 0, 2
  valid = doc > 0
  pos = np.zeros((3, T), np.int32)
  for b in range(3):
    for d in np.unique(doc[b]):
      where = np.flatnonzero(doc[b] == d)
      pos[b, where] = np.arange(where.size)
  image = np.zeros((3, T), np.int32)  # Gemma 3: token types, one group per image (cumsum of image starts)
  image[0, 3:10], image[0, 21:26] = 1, 2
  image[1, 6:13], image[1, 13:17], image[1, 20] = 1, 2, 3
  image[2, 15:23] = 1
  prefix = np.zeros((3, T), bool)  # prefix-LM: each document's first tokens
  prefix[0, :5], prefix[0, 19:24] = True, True
  prefix[1, :11] = True
  prefix[2, :9], prefix[2, 14:17] = True, True
  return doc, valid, pos, image, prefix


def _mask(kind):
  """[3, T, T] bool, as the model builds it, and the structure the oracle takes (independent of the recovery)."""
  doc, valid, pos, image, prefix = _rows()
  i, j = np.indices((T, T))
  same = (doc[:, :, None] == doc[:, None, :]) & valid[:, None, :]  # key-only padding, as decoders mask
  causal = (j <= i)[None]
  ids = (doc, np.where(valid, doc, -1))
  if kind == "gemma3_images":
    both = (image[:, :, None] > 0) & (image[:, :, None] == image[:, None, :])
    return (causal | both) & same, dict(is_causal=True, segment_ids=ids, bidirectional_ids=image)
  if kind == "prefix_lm":
    both = prefix[:, :, None] & prefix[:, None, :]
    return (causal | both) & same, dict(is_causal=True, segment_ids=ids, bidirectional_ids=prefix.astype(np.int32))
  if kind == "llama4_chunks":  # chunks of each document's own positions
    chunked = (pos[:, :, None] // CHUNK) == (pos[:, None, :] // CHUNK)
    return causal & chunked & same, dict(is_causal=True, segment_ids=ids, q_positions=pos, chunk_size=CHUNK)
  raise ValueError(kind)


KINDS = ["gemma3_images", "prefix_lm", "llama4_chunks"]


def test_one_id_on_several_pieces():
  """Equal ids see each other wherever they are: pieces of one span (and interleaved spans) are in the family."""
  i, j = np.indices((T, T))
  a, b = np.isin(np.arange(T), [4, 5, 9, 10, 11]), np.isin(np.arange(T), [6, 7, 8, 14, 15])
  mask = (j <= i) | (a[:, None] & a[None, :]) | (b[:, None] & b[None, :])
  got = fr.structure_from_dense_mask(jnp.asarray(mask)[None])
  assert bool(got.exact)
  bid = np.asarray(got.bidirectional_ids)[0]
  assert len(set(bid[a])) == len(set(bid[b])) == 1 and bid[a][0] != bid[b][0] and not bid[~(a | b)].any()


@pytest.mark.parametrize("kind", KINDS)
def test_recovered_exactly_and_rebuilt(kind):
  mask, truth = _mask(kind)
  got = fr.structure_from_dense_mask(jnp.asarray(mask))
  assert bool(got.exact) and bool(got.is_causal)
  rebuilt = fr.dense_mask_from_structure(got.is_causal, got.q_ids, got.kv_ids, bidirectional_ids=got.bidirectional_ids)
  np.testing.assert_array_equal(np.asarray(rebuilt)[:, 0], mask)
  bid = np.asarray(got.bidirectional_ids)
  if kind == "llama4_chunks":  # read on the index, chunks are blocks: segment ids say them exactly
    assert not bid.any()
    return
  # Every token of a span of two or more carries one nonzero id per span, the others 0 (a one-token span is the
  # causal mask's own diagonal).
  want = np.asarray(truth["bidirectional_ids"])
  for b in range(3):
    for d in np.unique(np.asarray(truth["segment_ids"][0])[b]):
      for s in np.unique(want[b][want[b] != 0]):
        span = (want[b] == s) & (truth["segment_ids"][0][b] == d)
        if span.sum() >= 2:
          assert len(set(bid[b, span])) == 1 and bid[b, span][0] != 0
          assert not np.isin(bid[b, ~span], bid[b, span]).any()
        elif span.sum() == 1:
          assert bid[b, span][0] == 0 or not np.isin(bid[b, ~span], bid[b, span]).any()


def _outside():
  i, j = np.indices((T, T))
  a, b = np.isin(np.arange(T), [4, 5, 8]), np.isin(np.arange(T), [6, 7])
  return {
    # Two interleaved spans, the first one's last token right after the second: read by rows only, that token
    # looks like no span's (refused, not guessed).
    "span_ends_after_another": (j <= i) | (a[:, None] & a[None, :]) | (b[:, None] & b[None, :]),
    # Every row sees the next token: a lookahead, not a span.
    "lookahead_by_one": j <= i + 1,
    # Row 6 sees token 8 but not token 7: a view with a gap, not a span.
    "gap_in_the_view": (j <= i) | ((i == 6) & (j == 8)),
  }


@pytest.mark.parametrize("name", list(_outside()))
def test_masks_outside_the_family_are_refused(name):
  mask = jnp.asarray(_outside()[name])[None]
  assert not bool(fr.structure_from_dense_mask(mask).exact)
  q = jnp.ones((1, T, 2, 8), F32)
  with pytest.raises(ValueError, match="not of the family"):
    fr.dot_product_attention(q, q, q, mask=mask, implementation="xla")


def test_without_spans_the_mask_is_outside_the_family():
  mask, _ = _mask("gemma3_images")
  assert not bool(fr.structure_from_dense_mask(jnp.asarray(mask), spans=False).exact)


def _qkv(dtype=F32):
  keys = jax.random.split(jax.random.PRNGKey(7), 4)
  q = jax.random.normal(keys[0], (3, T, 4, 8), dtype)
  k, v = (jax.random.normal(key, (3, T, 2, 8), dtype) for key in keys[1:3])
  return q, k, v, jax.random.normal(keys[3], q.shape, dtype)


@pytest.mark.parametrize(("kind", "jit"), [(kind, True) for kind in KINDS] + [("gemma3_images", False)])
def test_ring_runs_the_mask_to_the_oracle(kind, jit):
  mask, truth = _mask(kind)
  q, k, v, do = _qkv()
  mesh = make_mesh((4,), ("sp",))

  def f(q, k, v, mask):
    return fr.dot_product_attention(q, k, v, mask=mask[:, None], mesh=mesh, implementation="xla")

  # Closed over, the mask is a constant of the program (its structure is read at trace time); as an argument it
  # is traced (recovered on the device).  Under jit either way: the cotangent then follows the output's sharding.
  # The traced mask comes sequence-sharded, as a data pipeline on the mesh hands it over (Explicit axes).
  run = jax.jit(f) if jit else jax.jit(lambda q, k, v, _: f(q, k, v, mask))
  sharded = jax.device_put(jnp.asarray(mask), NamedSharding(mesh, P(None, "sp", None)))
  out, pull = jax.vjp(lambda q, k, v: run(q, k, v, sharded), q, k, v)
  want, grads = dense_oracle(q, k, v, do=do, **truth)
  assert_close(out, want, F32)
  assert_close(pull(do), grads, F32, "grad")


def test_layer_with_a_gemma3_mask_matches_mha_at_real_tokens():
  mask, _ = _mask("gemma3_images")
  mask = jnp.asarray(mask)[:, None]
  _, valid, *_ = _rows()
  mha = nnx.MultiHeadAttention(4, 16, decode=False, rngs=nnx.Rngs(0))
  ring = fr.RingMultiHeadAttention(4, 16, decode=False, rngs=nnx.Rngs(1))
  nnx.update(ring, nnx.state(mha, nnx.Param))
  x = jax.random.normal(jax.random.PRNGKey(0), (3, T, 16))
  want = np.asarray(mha(x, mask=mask))[valid]
  assert_close(np.asarray(ring(x, mask=mask))[valid], want, F32)
  jitted = nnx.jit(lambda m, x, mask: m(x, mask=mask))(ring, x, mask)
  assert_close(np.asarray(jitted)[valid], want, F32)


# The prefix-LM mask is the image spans' mechanism (one span per document): the ring tests above run it.
CONVERT = {
  "gemma3_images": hm.gemma(qk_norm=True, cap=5.0),
  "llama4_chunks": hm.llama(),
}


@pytest.mark.parametrize("kind", list(CONVERT))
def test_convert_a_decoder_with_the_mask(kind):
  """The mask is the decoder's argument, traced under jit: spans are recovered on the device and verified."""
  mask, _ = _mask(kind)
  doc, valid, pos, *_ = _rows()
  tokens = jnp.asarray(np.random.default_rng(1).integers(1, hm.VOCAB, size=(3, T)))
  pos, mask = jnp.asarray(pos), jnp.asarray(mask)
  ref = hm.Decoder(CONVERT[kind], 1, rngs=nnx.Rngs(0))
  model = hm.Decoder(CONVERT[kind], 1, rngs=nnx.Rngs(0))
  report = fr.convert(model, mesh=make_mesh((8,), ("sp",)), seq_axis="sp", example=lambda m: m(tokens, pos, mask))
  assert [s.path for s in report.converted] == ["blocks.0.attn"] and not report.left_alone, str(report)
  call = nnx.jit(lambda m, *a: m(*a))
  got, want = call(model, tokens, pos, mask), call(ref, tokens, pos, mask)
  assert_close(np.asarray(got)[valid], np.asarray(want)[valid], F32)

  def grads(m):
    graphdef, params, rest = nnx.split(m, nnx.Param, ...)
    return jax.jit(jax.grad(lambda p: _loss(nnx.merge(graphdef, p, rest), tokens, pos, mask, jnp.asarray(valid))))(
      params
    )

  assert_close(grads(model), grads(ref), F32, "grad")


def test_the_fused_recovery_finds_the_same_structure(monkeypatch):
  """`fused=True` (a TPU's choice: gather-free passes, spans looked for unconditionally and selected after) and the
  default recover the same structure from a traced mask, field by field, for masks of the family (spans, chunks,
  plain causal) and outside it; through `dot_product_attention` under jit (`dense.FUSED_RECOVERY`) the output
  is the same, an outside mask's NaN included."""
  from flax_ringattn._src.ring import dense

  i, j = np.indices((T, T))
  cases = {kind: _mask(kind)[0] for kind in KINDS} | {name: m[None] for name, m in _outside().items()}
  cases["causal"] = (j <= i)[None]
  recover = jax.jit(fr.structure_from_dense_mask, static_argnames=("fused",))
  q, k, v, _ = _qkv()
  for name, mask in cases.items():
    mask = jnp.asarray(mask)
    want, got = recover(mask, fused=False), recover(mask, fused=True)
    for field, a, b in zip(want._fields, want, got, strict=True):
      np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=f"{name}: {field}")
    outs = {}
    for fused in (False, True):
      monkeypatch.setattr(dense, "FUSED_RECOVERY", fused)
      attend = jax.jit(lambda q, k, v, m: fr.dot_product_attention(q, k, v, mask=m[:, None], implementation="xla"))
      outs[fused] = np.asarray(attend(q[: mask.shape[0]], k[: mask.shape[0]], v[: mask.shape[0]], mask))
    np.testing.assert_array_equal(outs[True], outs[False], err_msg=name)
    assert np.isnan(outs[True]).all() == (name in _outside()), name

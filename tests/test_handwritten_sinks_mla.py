"""`convert` on hand-written attention with sinks (gpt-oss style) and MLA head dims (DeepSeek style).

The models are look-alikes in `handwritten_models.py`; the batch, masks, loss and gradient helpers are those of
`test_handwritten.py`.  Each converted model is compared with the unconverted one: logits on every token that
sees a key, the loss and every parameter's gradient (the sinks' included), f32.  Sink columns that are not
joined and dropped in the form convert runs exactly are left alone, with the reason.
"""

from __future__ import annotations

import contextlib

import handwritten_models as hm
import jax
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from test_handwritten import F32, _batch, _grads, _inputs, _key_mask
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src.testing.interpret import interpret_params, no_races

WINDOW = 8


def _check_converted_matches(make, *, expected, sees):
  tokens, pos, third, _, valid = _inputs("mask")
  ref, model = make(), make()
  report = fr.convert(model, mesh=make_mesh((8,), ("sp",)), seq_axis="sp", example=lambda m: m(tokens, pos, third))
  assert [s.path for s in report.converted] == ["blocks.0.attn", "blocks.1.attn"], str(report)
  assert not report.left_alone, str(report)
  for site, want in zip(report.converted, expected, strict=True):
    for key, value in want.items():
      assert site.details[key] == (pytest.approx(value) if isinstance(value, float) else value), (key, str(report))
  step, params = _grads(model, tokens, pos, third, valid)  # logits, loss and gradients from one compiled step
  ref_step, ref_params = _grads(ref, tokens, pos, third, valid)
  ((loss, got), grads), ((ref_loss, want), ref_grads) = step(params), ref_step(ref_params)
  assert_close(np.asarray(got)[sees], np.asarray(want)[sees], F32)
  assert_close(loss, ref_loss, F32)
  assert_close(grads, ref_grads, F32, "grad")
  assert "collective_permute" in step.lower(params).as_text()  # the ring runs (read without a second compile)
  return report, grads


@pytest.mark.parametrize("sink_column", ["last", "first"])
def test_gpt_oss_sinks_windowed_and_full_layers(sink_column):
  """GQA with sinks, a sliding-window layer then a full one: forward, loss and gradients (sinks' too) match."""
  sees = np.asarray(_key_mask(*_batch()[2:], window=WINDOW)).any(-1)
  expected = [
    dict(q_heads=4, kv_heads=2, groups=2, sinks=True, window=(WINDOW - 1, 0), scale=8**-0.5),
    dict(q_heads=4, kv_heads=2, groups=2, sinks=True, window=None),
  ]
  report, grads = _check_converted_matches(
    lambda: hm.GptOssDecoder(window=WINDOW, sink_column=sink_column, rngs=nnx.Rngs(0)), expected=expected, sees=sees
  )
  assert "sinks" in str(report) and "window (7, 0)" in str(report), str(report)
  for n in range(2):  # the sinks learn: their gradient is there and not zero
    assert np.abs(np.asarray(grads["blocks"][n]["attn"]["sinks"][...])).max() > 1e-4


def test_deepseek_mla_head_dims():
  """q/k of 16 + 8 rope dims, v of 16: recognised with its own v head dim; forward and gradients match."""
  sees = np.asarray(_key_mask(*_batch()[2:])).any(-1)
  expected = [dict(q_heads=4, kv_heads=4, groups=1, head_dim=24, v_head_dim=16, sinks=False, scale=24**-0.5)] * 2
  report, _ = _check_converted_matches(lambda: hm.Decoder(hm.mla(), rngs=nnx.Rngs(0)), expected=expected, sees=sees)
  assert "head dims q/k 24, v 16" in str(report), str(report)


@pytest.mark.parametrize(
  "sink_column,reason",
  [
    ("kept", "the probabilities meet v with the sink column still in them"),
    ("last_dropped_first", "keeps 1:33 of the 33 columns"),
    ("first_dropped_last", "keeps 0:32 of the 33 columns"),
  ],
)
def test_sink_column_not_dropped_exactly_is_left_alone(sink_column, reason):
  """A sink column kept (it meets a zero value row instead) or the wrong column dropped: not converted, the
  reason reported, and the model's own code runs (outputs equal)."""
  tokens, pos, third, _, _ = _inputs("mask")
  ref = hm.GptOssDecoder(window=None, sink_column=sink_column, rngs=nnx.Rngs(0))
  model = hm.GptOssDecoder(window=None, sink_column=sink_column, rngs=nnx.Rngs(0))
  report = fr.convert(model, mesh=make_mesh((8,), ("sp",), explicit=False), example=lambda m: m(tokens, pos, third))
  assert not report.converted, str(report)
  assert [s.path for s in report.left_alone] == ["blocks.0.attn", "blocks.1.attn"], str(report)
  for site in report.left_alone:
    assert site.reason.startswith("attention sinks: ") and reason in site.reason, str(report)
  np.testing.assert_array_equal(np.asarray(model(tokens, pos, third)), np.asarray(ref(tokens, pos, third)))


def test_a_dropped_sink_fails_the_comparison(monkeypatch):
  """The comparison can fail: convert the gpt-oss model with its sinks forgotten and the logits differ."""
  from flax_ringattn._src.matcher import sinks

  real = sinks.find_sites
  monkeypatch.setattr(sinks, "find_sites", lambda prog: (*real(prog)[:2], {}))
  tokens, pos, third, sees, _ = _inputs("mask")
  ref, model = (hm.GptOssDecoder(window=None, rngs=nnx.Rngs(0)) for _ in range(2))
  report = fr.convert(model, mesh=make_mesh((8,), ("sp",)))
  got = np.asarray(nnx.jit(lambda m, *a: m(*a))(model, tokens, pos, third))
  assert len(report.converted) == 2
  with pytest.raises(AssertionError):
    assert_close(got[sees], np.asarray(ref(tokens, pos, third))[sees], F32)


REJECTED = {  # sink columns joined in ways that are not the op's sinks
  "scaled_after_join": "mul on the logits after the sink column was joined",
  "masked_after_join": "select_n on the logits after the sink column was joined",
  "probabilities_returned": "returned",
  "per_query_sinks": "varies over more than the heads",
  "sliced_before_normalised": "the softmax must be finished before the column is dropped",
}


def _sink_attention(case):
  T = 16

  def fn(q, k, v, sinks, mask):
    s = jax.numpy.einsum("btnh,bsnh->bnts", q, k) * 8**-0.5
    s = jax.numpy.where(mask, s, -1e9)
    if case == "per_query_sinks":
      col = sinks[None, :, :, None]  # [1, N, T, 1]: a sink per head and query
    else:
      col = jax.numpy.broadcast_to(sinks[None, :, None, None], (1, 2, T, 1))
    s = jax.numpy.concatenate([s, col], -1)
    if case == "scaled_after_join":
      s = s * 0.5
    if case == "masked_after_join":
      s = jax.numpy.where(jax.numpy.arange(T + 1) < T, s, -1e9)
    if case == "sliced_before_normalised":  # the same maths, in a form convert does not follow
      p = jax.numpy.exp(s - jax.lax.stop_gradient(s.max(-1, keepdims=True)))
      keys = p[..., :-1] / p.sum(-1, keepdims=True)
    else:
      p = jax.nn.softmax(s, -1)
      keys = p[..., :-1]
    out = jax.numpy.einsum("bnts,bsnh->btnh", keys, v)
    return (out, p) if case == "probabilities_returned" else out

  x = jax.numpy.zeros((1, T, 2, 8))
  sinks = jax.numpy.zeros((2, T) if case == "per_query_sinks" else (2,))
  return jax.make_jaxpr(fn)(x, x, x, sinks, jax.numpy.ones((1, 1, T, T), bool))


@pytest.mark.parametrize("case", list(REJECTED))
def test_sink_patterns_that_are_not_the_ops_sinks_are_rejected(case):
  from flax_ringattn._src import matcher

  sites, rejected, sinks = matcher.find_sites(matcher.Program.flatten(_sink_attention(case)))
  assert not sites and not sinks
  assert len(rejected) == 1 and rejected[0].reason.startswith("attention sinks: "), rejected
  assert REJECTED[case] in rejected[0].reason, rejected


# -- the converted gpt-oss and DeepSeek look-alikes on every strategy and implementation --------------------------

_TPU = dict(interpret=interpret_params(), block_sizes=fr.BlockSizes(block_q=16, block_kv=16))
EVERYWHERE = {  # (strategy, mesh shape, mesh axes, seq_axis, convert's options); T = 32: 16-token shards on 2
  "ulysses-xla": ("ulysses", (4,), ("sp",), "sp", dict(implementation="xla")),
  "all_gather-xla": ("all_gather", (4,), ("sp",), "sp", dict(implementation="xla")),
  "ulysses_ring-xla": ("ulysses_ring", (2, 2), ("ring", "uly"), ("ring", "uly"), dict(implementation="xla")),
  "ring-pallas_tpu": ("ring", (2,), ("sp",), "sp", dict(implementation="pallas_tpu", **_TPU)),
  "ring-pallas_tpu_ring": ("ring", (2,), ("sp",), "sp", dict(implementation="pallas_tpu_ring", **_TPU)),
  "ring-pallas_gpu": (
    "ring", (2,), ("sp",), "sp",
    dict(implementation="pallas_gpu", interpret=True, block_sizes=fr.BlockSizes(block_q=16, block_kv=16)),
  ),
}  # fmt: skip


def _marks(where):
  if "pallas_gpu" in where:
    return (pytest.mark.interpret, pytest.mark.races_not_read("Triton interpret mode: no race detector, no DMAs"))
  return (pytest.mark.interpret,) if "pallas" in where else ()


MODELS = {
  "gpt_oss": lambda: hm.GptOssDecoder(window=WINDOW, rngs=nnx.Rngs(0)),  # sinks, window then full layer, GQA
  "deepseek_mla": lambda: hm.Decoder(hm.mla(), rngs=nnx.Rngs(0)),  # q/k 24 = 16 + 8 rope, v 16
}


# Both models on every XLA strategy, and one interpret-mode run through the in-kernel ring (its own FlashKernel).
# Each kernel runs sinks and MLA head dims against the reference in test_ring_attention.py; what this adds is
# convert's wiring of the sinks and of v's head dim into the implementation, which does not depend on the block
# kernel (the pallas_tpu and pallas_gpu runs, 60 and 32 s here, were cut for suite time).
PAIRS = [(w, m) for w in EVERYWHERE for m in MODELS if "pallas" not in w]
PAIRS += [("ring-pallas_tpu_ring", "deepseek_mla")]


@pytest.mark.parametrize("where,model", [pytest.param(w, m, marks=_marks(w), id=f"{w}-{m}") for w, m in PAIRS])
def test_converted_models_on_every_strategy_and_implementation(where, model):
  """The gpt-oss-style decoder (sinks, a windowed layer then a full one, GQA) and the DeepSeek-style MLA decoder,
  converted onto each strategy and each implementation (Pallas kernels in interpret mode, TPU ones with the race
  detector): logits, loss and every gradient, the sinks' included, match the unconverted model."""
  strategy, shape, names, seq_axis, options = EVERYWHERE[where]
  tokens, pos, third, _, valid = _inputs("mask")
  sees = np.asarray(_key_mask(*_batch()[2:], window=WINDOW if model == "gpt_oss" else None)).any(-1)
  ref, converted = MODELS[model](), MODELS[model]()
  report = fr.convert(
    converted, mesh=make_mesh(shape, names), seq_axis=seq_axis, strategy=strategy,
    example=lambda m: m(tokens, pos, third), **options,
  )  # fmt: skip
  assert len(report.converted) == 2 and not report.left_alone, str(report)
  step, params = _grads(converted, tokens, pos, third, valid)
  ref_step, ref_params = _grads(ref, tokens, pos, third, valid)
  checks = no_races() if where in ("ring-pallas_tpu", "ring-pallas_tpu_ring") else contextlib.nullcontext()
  with checks:
    (loss, got), grads = jax.block_until_ready(step(params))
  (ref_loss, want), ref_grads = ref_step(ref_params)
  assert_close(np.asarray(got)[sees], np.asarray(want)[sees], F32)
  assert_close(loss, ref_loss, F32)
  assert_close(grads, ref_grads, F32, "grad")

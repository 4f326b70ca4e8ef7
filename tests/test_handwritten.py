"""`convert` on decoders that write attention by hand (look-alikes in `handwritten_models.py`).

Each style is converted with one call and compared with the unconverted model on one batch holding a
right-padded row, a left-padded row and a packed row (documents and padding): logits on every token that sees
a key, and the gradients of a masked next-token loss with respect to every parameter (f32, 2e-5).
"""

from __future__ import annotations

import handwritten_models as hm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from tolerances import assert_close

import flax_ringattn as fr

T = 32  # 4 tokens per device on the ring of 8
F32 = jnp.float32


def _batch():
  """tokens, positions, document ids, valid [3, T]: right-padded, left-padded and packed rows.

  The padding of the first two rows carries the row's document id, so its queries still see the valid keys
  (key-only padding, as hand-written decoders mask); the packed row's padding is a document of its own (0).
  """
  tokens = np.random.default_rng(0).integers(1, hm.VOCAB, size=(3, T))
  doc = np.ones((3, T), np.int32)
  valid = np.ones((3, T), bool)
  valid[0, 24:] = False  # right padding
  valid[1, :6] = False  # left padding
  doc[2, 12:26] = 2  # two documents, then padding
  doc[2, 26:] = 0
  valid[2, 26:] = False
  pos = np.tile(np.arange(T), (3, 1))
  pos[1] = np.clip(np.arange(T) - 6, 0, None)
  pos[2, 12:] = np.arange(T - 12)
  return jnp.asarray(tokens), jnp.asarray(pos), jnp.asarray(doc), jnp.asarray(valid)


def _key_mask(doc, valid, window=None):
  """[B, T, T] as hand-written decoders build it: causal, same document, valid keys (queries not masked)."""
  i, j = np.indices((T, T))
  visible = (j <= i) if window is None else (j <= i) & (j > i - window)
  same = np.asarray(doc)[:, :, None] == np.asarray(doc)[:, None, :]
  return jnp.asarray(visible[None] & same & np.asarray(valid)[:, None, :])


def _inputs(style, window=None):
  tokens, pos, doc, valid = _batch()
  mask = _key_mask(doc, valid)
  # A finite large negative: with -inf the unconverted model itself turns fully masked rows into NaN.
  # The segment style gets ids with padding as document 0, which it masks as keys.
  third = {
    "mask": mask,
    "bias": jnp.where(mask, 0.0, -1e9),
    "bias_inf": jnp.where(mask, 0.0, -jnp.inf),  # one layer only: its fully masked rows are NaN in the model
    "segments": jnp.where(valid, doc, 0),
  }[style]
  # Rows that see a key through the model's whole mask (its window too); fully masked rows differ by design.
  if style == "segments":  # its own mask: padding is document 0, hidden as keys and seeing nothing as queries
    sees = np.asarray(valid)
  else:
    sees = np.asarray(_key_mask(doc, valid, window)).any(-1)
    assert (sees & ~np.asarray(valid)).any()  # padding queries that see keys are compared too
  return tokens, pos, third, sees, valid


STYLES = {
  "gemma_gqa_cap_window": (hm.gemma(cap=5.0, window=8, qk_norm=True), "mask", 8),
  "gemma_mqa": (hm.gemma(kv_heads=1), "mask", None),
  "gemma_mha": (hm.gemma(kv_heads=4), "mask", None),
  "llama": (hm.llama(), "mask", None),
  "bias_repeat": (hm.bias(), "bias", None),
  "bias_inf_one_layer": (hm.bias(), "bias_inf", None),
  "segments_inside": (hm.segments(), "segments", None),
}

EXPECTED = {  # what the report must say was recognised
  "gemma_gqa_cap_window": dict(q_heads=4, kv_heads=2, groups=2, scale=1.0, soft_cap=5.0, window=(7, 7)),
  "gemma_mqa": dict(q_heads=4, kv_heads=1, groups=4, scale=1.0, soft_cap=None, window=None),
  "gemma_mha": dict(q_heads=4, kv_heads=4, groups=1, scale=1.0, soft_cap=None, window=None),
  "llama": dict(q_heads=4, kv_heads=2, groups=2, scale=8**-0.5, soft_cap=None, window=None),
  "bias_repeat": dict(q_heads=4, kv_heads=2, groups=2, scale=8**-0.5, soft_cap=None, kv_repeated=True, mask="bias"),
  "bias_inf_one_layer": dict(q_heads=4, kv_heads=2, groups=2, kv_repeated=True, mask="bias"),
  "segments_inside": dict(q_heads=4, kv_heads=4, groups=1, scale=8**-0.5, soft_cap=None, window=None),
}


def _loss(model, tokens, pos, third, valid, *, with_logits=False):
  logits = model(tokens, pos, third)  # sequence-sharded when converted: no slicing, only elementwise ops
  logp = jax.nn.log_softmax(logits.astype(F32), -1)
  targets = jnp.roll(tokens, -1, axis=1)
  nll = -jnp.sum(logp * jax.nn.one_hot(targets, hm.VOCAB), -1)
  w = (valid & jnp.roll(valid, -1, axis=1) & (jnp.arange(T) < T - 1)).astype(F32)
  loss = jnp.sum(nll * w) / jnp.sum(w)
  return (loss, logits) if with_logits else loss


def _grads(model, *args):
  """A jitted step params -> ((loss, logits), grads): one compile gives the forward and the backward."""
  graphdef, state = nnx.split(model, nnx.Param)
  rest = nnx.state(model, nnx.Not(nnx.Param))

  def f(params):
    return _loss(nnx.merge(graphdef, params, rest), *args, with_logits=True)

  return jax.jit(jax.value_and_grad(f, has_aux=True)), state


@pytest.mark.parametrize("style", list(STYLES))
def test_converted_style_matches_unconverted(style):
  make, kind, window = STYLES[style]
  tokens, pos, third, sees, valid = _inputs(kind, window)
  # Two layers (one site each, the second traced after the first was swapped) for one style; the others' matcher
  # paths are per site, and one layer shows them at half the compile time.
  layers = 2 if style == "llama" else 1
  ref = hm.Decoder(make, layers, rngs=nnx.Rngs(0))
  model = hm.Decoder(make, layers, rngs=nnx.Rngs(0))
  mesh = make_mesh((8,), ("sp",))
  report = fr.convert(model, mesh=mesh, seq_axis="sp", example=lambda m: m(tokens, pos, third))
  # One site per layer, in the attention module itself, with what was recognised.
  inner = ".inner" if style == "segments_inside" else ""
  assert [s.path for s in report.converted] == [f"blocks.{n}.attn{inner}" for n in range(layers)], str(report)
  assert not report.left_alone, str(report)
  for site in report.converted:
    for key, want in EXPECTED[style].items():
      got = site.details[key]
      assert got == pytest.approx(want) if isinstance(want, float) else got == want, (key, got, want, str(report))
  # Logits on every row that sees a key, the loss and every parameter gradient, from one compiled step each; the
  # ring really runs (a collective permute in the lowered step: reading the lowering costs no second compile).
  step, params = _grads(model, tokens, pos, third, valid)
  ref_step, ref_params = _grads(ref, tokens, pos, third, valid)
  ((loss, got), grads), ((ref_loss, want), ref_grads) = step(params), ref_step(ref_params)
  assert_close(np.asarray(got)[sees], np.asarray(want)[sees], F32)
  if kind == "bias_inf":  # the unconverted model's fully masked rows are NaN, and so are its gradients
    assert np.isfinite(np.asarray(loss)) and all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))
    return
  assert_close(loss, ref_loss, F32)
  assert_close(grads, ref_grads, F32, "grad")
  assert "collective_permute" in step.lower(params).as_text()


def test_report_before_the_first_call_and_after():
  tokens, pos, third, _, _ = _inputs("mask")
  model = hm.Decoder(hm.llama(), rngs=nnx.Rngs(0))
  report = fr.convert(model, mesh=make_mesh((8,), ("sp",), explicit=False))
  assert not report.sites and "found at the first call" in str(report)
  assert {"<root>", "blocks.0.attn", "blocks.1"} <= set(report.watched)
  model(tokens, pos, third)  # eager, Auto mesh
  assert [s.path for s in report.converted] == ["blocks.0.attn", "blocks.1.attn"], str(report)
  assert "converted blocks.0.attn (LlamaAttention): heads 4/2 (groups 2), scale 0.353553, mask where" in str(report)


def test_remat_and_scan():
  """Layers under nnx.remat (a python loop) and nnx.scan (stacked layers) convert and match."""
  tokens, pos, third, sees, valid = _inputs("mask")
  # Auto axes: on Explicit ones the scan carry would change type (the ring returns it sequence-sharded) unless
  # the embedding's output already is, and an embedding lookup of sharded tokens needs an explicit out_sharding.
  mesh = make_mesh((8,), ("sp",), explicit=False)
  for build in (
    lambda: hm.Decoder(hm.gemma(), remat=True, rngs=nnx.Rngs(0)),
    lambda: hm.ScanDecoder(hm.gemma(), rngs=nnx.Rngs(0)),
  ):
    ref, model = build(), build()
    report = fr.convert(model, mesh=mesh)

    @nnx.jit
    def step(m, tokens, pos, third):
      return nnx.value_and_grad(lambda m: _loss(m, tokens, pos, third, valid))(m)

    (loss, grads), (ref_loss, ref_grads) = step(model, tokens, pos, third), step(ref, tokens, pos, third)
    assert report.converted, str(report)
    assert_close(loss, ref_loss, F32)
    assert_close(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), F32, "grad")


def test_kv_cache_path_runs_the_models_own_code():
  """Called with a cache (sampling), the converted module runs the model's code: outputs and cache equal."""
  attn, ref = (hm.GemmaAttention(4, 2, 8, rngs=nnx.Rngs(0)) for _ in range(2))
  holder = nnx.Dict(attn=attn)
  fr.convert(holder, mesh=make_mesh((8,), ("sp",), explicit=False))
  x = jnp.asarray(np.random.default_rng(1).normal(size=(1, 1, hm.D)), F32)
  cache = {"k": jnp.ones((1, 16, 2, 8)), "v": jnp.ones((1, 16, 2, 8)), "end": 3}
  mask = jnp.ones((1, 1, 16), bool)
  got, got_cache = holder["attn"](x, jnp.full((1, 1), 3), mask, cache=cache)
  want, want_cache = ref(x, jnp.full((1, 1), 3), mask, cache=cache)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got_cache, want_cache)
  assert not type(holder["attn"])._fr_plans  # no trace was taken


class _DropoutOnProbs(nnx.Module):
  """Attention with dropout on the probabilities: not the pattern; reported, never converted."""

  def __init__(self, rngs):
    self.inner = hm.LlamaAttention(4, 4, 8, rngs=rngs)

  def __call__(self, x, positions, mask):
    a = self.inner
    B = x.shape[0]
    q = a.q_proj(x).reshape(B, T, 4, 8)
    k = a.k_proj(x).reshape(B, T, 4, 8)
    v = a.v_proj(x).reshape(B, T, 4, 8)
    logits = jnp.where(mask[:, None], jnp.einsum("BTNH,BSNH->BNTS", q, k), -1e9)
    probs = jax.nn.softmax(logits, -1) * (jnp.arange(T) % 2 == 0)  # a fixed "dropout" pattern
    return a.o_proj(jnp.einsum("BNTS,BSNH->BTNH", probs, v).reshape(B, T, -1))


def test_unrecognised_attention_is_reported_and_left_alone():
  tokens, pos, third, _, _ = _inputs("mask")
  x = jnp.asarray(np.random.default_rng(2).normal(size=(3, T, hm.D)), F32)
  ref = _DropoutOnProbs(nnx.Rngs(0))
  holder = nnx.Dict(attn=_DropoutOnProbs(nnx.Rngs(0)))
  report = fr.convert(holder, mesh=make_mesh((8,), ("sp",), explicit=False), example=lambda m: m["attn"](x, pos, third))
  assert not report.converted
  (site,) = report.left_alone
  assert site.path == "attn" and "mul on the attention probs" in site.reason, str(report)
  np.testing.assert_array_equal(np.asarray(holder["attn"](x, pos, third)), np.asarray(ref(x, pos, third)))


@pytest.mark.parametrize("mutation", ["cap", "window"])
def test_a_dropped_cap_or_window_fails_the_comparison(mutation, monkeypatch):
  """The equivalence check can fail: drop the recognised cap (or window) and the converted model differs."""
  from flax_ringattn._src.matcher import attention

  real = attention.find_sites

  def mutant(prog):
    sites, rejected = real(prog)
    for s in sites:
      if mutation == "cap":
        s.cap = None
      else:
        for m in s.masks:
          m.window = None
    return sites, rejected

  monkeypatch.setattr(attention, "find_sites", mutant)
  tokens, pos, third, sees, _ = _inputs("mask", 8)
  make = hm.gemma(cap=2.0, window=8)
  ref, model = hm.Decoder(make, rngs=nnx.Rngs(0)), hm.Decoder(make, rngs=nnx.Rngs(0))
  fr.convert(model, mesh=make_mesh((8,), ("sp",)))
  got = np.asarray(nnx.jit(lambda m, *a: m(*a))(model, tokens, pos, third))
  with pytest.raises(AssertionError):
    assert_close(got[sees], np.asarray(ref(tokens, pos, third))[sees], F32)


@pytest.mark.slow
def test_memory_of_a_converted_train_step_grows_linearly():
  """Compile only: temp memory of a Llama-style train step on 8 devices, converted and not, at T = 2k and 4k.

  The unconverted step holds [B, N, T, S] f32 logits and probabilities (quadratic); the converted one holds
  O(T / n) per device (the model's [B, T, S] bool mask is an argument, read by row-wise reductions only)."""
  mesh = make_mesh((8,), ("sp",), explicit=False)

  def temp_bytes(model, seq):
    graphdef, params = nnx.split(model, nnx.Param)
    rest = nnx.state(model, nnx.Not(nnx.Param))

    def loss(params, tokens, pos, mask):
      return jnp.mean(nnx.merge(graphdef, params, rest)(tokens, pos, mask).astype(F32) ** 2)

    sds = jax.ShapeDtypeStruct
    args = (sds((1, seq), jnp.int32), sds((1, seq), jnp.int32), sds((1, seq, seq), jnp.bool_))
    return jax.jit(jax.grad(loss)).lower(params, *args).compile().memory_analysis().temp_size_in_bytes

  sizes = {}
  for seq in (2048, 4096):
    ref = hm.Decoder(hm.llama(), rngs=nnx.Rngs(0))
    conv = hm.Decoder(hm.llama(), rngs=nnx.Rngs(0))
    fr.convert(conv, mesh=mesh)
    sizes[seq] = (temp_bytes(ref, seq), temp_bytes(conv, seq))
  (ref2, conv2), (ref4, conv4) = sizes[2048], sizes[4096]
  print(
    f"temp MiB: unconverted {ref2 / 2**20:.1f} -> {ref4 / 2**20:.1f}, converted {conv2 / 2**20:.2f} -> {conv4 / 2**20:.2f}"
  )
  assert ref4 / ref2 > 3.5  # quadratic
  assert conv4 / conv2 < 2.3  # near-linear
  assert conv4 < ref4 / 100


class _HostRead(nnx.Module):
  """A module whose call reads a value on the host: it cannot be traced abstractly, and must keep working."""

  def __init__(self, rngs):
    self.inner = hm.LlamaAttention(4, 2, 8, rngs=rngs)

  def __call__(self, x, positions, mask):
    scale = 2.0 if float(jnp.max(x)) > 0 else 1.0
    return self.inner(x, positions, mask) * scale


def test_a_module_that_only_runs_eagerly_keeps_working():
  tokens, pos, third, _, _ = _inputs("mask")
  x = jnp.asarray(np.random.default_rng(3).normal(size=(3, T, hm.D)), F32)
  ref = _HostRead(nnx.Rngs(0))
  holder = nnx.Dict(m=_HostRead(nnx.Rngs(0)))
  report = fr.convert(holder, mesh=make_mesh((8,), ("sp",), explicit=False))
  got = holder["m"](x, pos, third)
  assert report.untraceable and report.untraceable[0].startswith("m: ConcretizationTypeError")
  # Its inner attention module is traceable and converted; the eager outer code ran as written.
  assert [s.path for s in report.converted] == ["m.inner"], str(report)
  assert_close(
    np.asarray(got)[np.asarray(valid_rows(third))], np.asarray(ref(x, pos, third))[np.asarray(valid_rows(third))], F32
  )


def valid_rows(mask):
  return np.asarray(mask).any(-1)


def test_window_built_from_data_is_declared_per_module(capfd, caplog):
  """A window built from positions is not visible statically: declared by a function of the module, it
  converts exactly, local and global layers alike; undeclared, the output is NaN (and stderr says why with
  check_mask="report")."""
  tokens, pos, third, _, valid = _inputs("mask")
  sees = np.asarray(_key_mask(*_batch()[2:], window=8)).any(-1)

  class LocalGlobal(hm.Decoder):
    def __init__(self, rngs):
      super().__init__(hm.gemma(), rngs=rngs)
      self.blocks[0].attn = hm.GemmaAttention(4, 2, 8, window=8, window_from_positions=True, rngs=rngs)

  ref, model, undeclared = (LocalGlobal(nnx.Rngs(0)) for _ in range(3))
  mesh = make_mesh((8,), ("sp",))
  report = fr.convert(
    model,
    mesh=mesh,
    local_window_size=lambda m: (7, 7) if m.window_from_positions else None,
    example=lambda m: m(tokens, pos, third),
  )
  assert [s.details["window"] for s in report.converted] == ["(7, 7) (declared)", None], str(report)
  got = np.asarray(nnx.jit(lambda m, *a: m(*a))(model, tokens, pos, third))
  assert_close(got[sees], np.asarray(ref(tokens, pos, third))[sees], F32)
  fr.convert(undeclared, mesh=mesh, check_mask="report")
  bad = np.asarray(nnx.jit(lambda m, *a: m(*a))(undeclared, tokens, pos, third))
  assert np.isnan(bad).all()
  said = capfd.readouterr().err + caplog.text
  assert said.count("attention output set to NaN") == 1, said  # once, for the one site outside the family


def _logits(q, k):
  return jnp.einsum("btnh,bsnh->bnts", q, k)


def _attend(p, v):
  return jnp.einsum("bnts,bsnh->btnh", p, v)


_I = jnp.arange(16)
REJECTED = {  # attention-like computations the matcher must leave alone, with the reason it gives
  "alibi_bias": (
    lambda q, k, v: _attend(jax.nn.softmax(_logits(q, k) + -0.5 * jnp.abs(_I[:, None] - _I[None]), -1), v),
    "a position bias",
  ),
  "scale_after_mask": (
    lambda q, k, v: _attend(jax.nn.softmax(jnp.where(_I[:, None] >= _I[None], _logits(q, k), -1e9) * 0.3, -1), v),
    "scaled after the mask",
  ),
  "mask_value_not_large": (
    lambda q, k, v: _attend(jax.nn.softmax(jnp.where(_I[:, None] >= _I[None], _logits(q, k), -5.0), -1), v),
    "not a mask value <= -1e6",
  ),
  "learned_temperature": (
    lambda q, k, v: _attend(jax.nn.softmax(_logits(q, k) * q[0, 0, 0, 0], -1), v),
    "non-constant",
  ),
  "softmax_over_queries": (lambda q, k, v: jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(_logits(q, k), -2), v), ""),
  "weights_returned": (lambda q, k, v: (_attend(p := jax.nn.softmax(_logits(q, k), -1), v), p), "used outside"),
}


@pytest.mark.parametrize("case", list(REJECTED))
def test_matcher_rejects_what_it_cannot_run_exactly(case):
  from flax_ringattn._src import matcher

  fn, reason = REJECTED[case]
  x = jnp.zeros((1, 16, 2, 8))
  sites, rejected, _ = matcher.find_sites(matcher.Program.flatten(jax.make_jaxpr(fn)(x, x, x)))
  assert not sites
  assert len(rejected) == 1 and reason in rejected[0].reason, rejected


# From a review: branches of the logits that differ, a softmax mask, multi-axis reductions.
_CAUSAL = _I[:, None] >= _I[None]
REJECTED_BRANCHES = {
  "scale_on_two_branches": lambda q, k, v: _attend(
    (e := jnp.exp(_logits(q, k) * 0.5 - jnp.max(_logits(q, k) * 0.5, -1, keepdims=True)))
    / jnp.sum(e, -1, keepdims=True),
    v,
  ),
  "mask_only_in_the_max": lambda q, k, v: _attend(
    (e := jnp.exp((s := _logits(q, k)) - jnp.max(jnp.where(_CAUSAL, s, -1e9), -1, keepdims=True)))
    / jnp.sum(e, -1, keepdims=True),
    v,
  ),
  "softmax_where": lambda q, k, v: _attend(jax.nn.softmax(_logits(q, k), -1, where=_CAUSAL), v),
}


@pytest.mark.parametrize("custom_jvp", [False, True], ids=["inlined", "custom_jvp"])
@pytest.mark.parametrize("case", list(REJECTED_BRANCHES))
def test_matcher_never_folds_what_one_branch_does_into_another(case, custom_jvp):
  from flax_ringattn._src import matcher

  x = jnp.zeros((1, 16, 2, 8))
  with jax.softmax_custom_jvp(custom_jvp) if hasattr(jax, "softmax_custom_jvp") else _flag(custom_jvp):
    closed = jax.make_jaxpr(REJECTED_BRANCHES[case])(x, x, x)
  sites, rejected, _ = matcher.find_sites(matcher.Program.flatten(closed))
  assert not sites and rejected, (case, rejected)


class _flag:
  def __init__(self, value):
    self.value = value

  def __enter__(self):
    self.old = jax.config.jax_softmax_custom_jvp
    jax.config.update("jax_softmax_custom_jvp", self.value)

  def __exit__(self, *exc):
    jax.config.update("jax_softmax_custom_jvp", self.old)


def test_matcher_survives_multi_axis_reductions():
  from flax_ringattn._src import matcher

  fn = lambda x, w: jnp.max(jnp.einsum("btd,de->bte", x, w), axis=(1, 2))  # noqa: E731
  closed = jax.make_jaxpr(fn)(jnp.zeros((2, 8, 4)), jnp.zeros((4, 4)))
  assert matcher.find_sites(matcher.Program.flatten(closed)) == ([], [], {})


class _KeyPaddingEncoder(nnx.Module):
  """Bidirectional attention with a BERT-style [B, 1, 1, S] key mask, a relu MLP child, attention inline."""

  def __init__(self, rngs):
    self.qkv = nnx.Linear(hm.D, 3 * 32, rngs=rngs)
    self.mlp = _ReluMLP(rngs)

  def __call__(self, x, keys, bias_form=False):
    B = x.shape[0]
    q, k, v = (t.reshape(B, T, 4, 8) for t in jnp.split(self.qkv(x), 3, -1))
    s = jnp.einsum("BTNH,BSNH->BNTS", q, k) * 8**-0.5
    m = keys[:, None, None, :]  # [B, 1, 1, S]
    s = s + (1.0 - m) * -1e9 if bias_form else jnp.where(m > 0, s, -1e9)
    out = jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(s, -1), v).reshape(B, T, 32)
    return self.mlp(out)


class _ReluMLP(nnx.Module):
  def __init__(self, rngs):
    self.lin = nnx.Linear(32, hm.D, rngs=rngs)

  def __call__(self, x):
    return jax.nn.relu(self.lin(x))


@pytest.mark.parametrize("bias_form", [False, True], ids=["where", "same_rank_bias"])
def test_key_padding_mask_and_inline_attention_beside_a_child(bias_form):
  x = jnp.asarray(np.random.default_rng(4).normal(size=(2, T, hm.D)), F32)
  keys = jnp.asarray(np.arange(T)[None] < np.array([[T], [T - 7]]), F32)
  ref = _KeyPaddingEncoder(nnx.Rngs(0))
  holder = nnx.Dict(enc=_KeyPaddingEncoder(nnx.Rngs(0)))
  report = fr.convert(holder, mesh=make_mesh((8,), ("sp",), explicit=False))
  got = nnx.jit(lambda h, x, k: h["enc"](x, k, bias_form))(holder, x, keys)
  assert [s.path for s in report.converted] == ["enc"], str(report)
  assert_close(got, ref(x, keys, bias_form), F32)


class _WithRngs(nnx.Module):
  def __init__(self, rngs):
    self.attn = hm.LlamaAttention(4, 2, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5)

  def __call__(self, x, positions, mask, rngs):
    return self.drop(self.attn(x, positions, mask), rngs=rngs)


def test_nnx_object_arguments_keep_their_updates():
  """A module called with rngs runs its own code (its rngs advance as before); its attention child converts."""
  _, pos, third, _, _ = _inputs("mask")
  x = jnp.asarray(np.random.default_rng(5).normal(size=(3, T, hm.D)), F32)
  holder = nnx.Dict(m=_WithRngs(nnx.Rngs(0)))
  report = fr.convert(holder, mesh=make_mesh((8,), ("sp",), explicit=False))
  rngs = nnx.Rngs(dropout=1)
  a = holder["m"](x, pos, third, rngs)
  b = holder["m"](x, pos, third, rngs)
  assert int(rngs.dropout.count[...]) == 2 and not np.array_equal(np.asarray(a) != 0, np.asarray(b) != 0)
  assert report.own_code == [
    ("m", "writes to the NNX object passed as argument (argument 0: dropout.count): runs its own code")
  ], report.own_code
  assert "own code m: writes to the NNX object passed as argument" in str(report), str(report)
  assert [s.path for s in report.converted] == ["m.attn"], str(report)

"""`convert` on an lm1b-style model: dense masks, dropout, Explicit meshes, the report."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from lm1b_model import LM, packed_batch
from tolerances import assert_close

import flax_ringattn as fr


def _loss(model, tokens, seg, pos):
  """(loss, logits)."""
  logits = model(tokens, seg, pos)
  targets = jnp.roll(tokens, -1, axis=1)
  weights = (tokens > 0) & (targets > 0)
  nll = -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1)[..., 0]
  return jnp.sum(nll * weights) / jnp.sum(weights), logits


def _logits_and_grads(model, *batch):
  """The logits and the parameter gradients, from one program when jitted."""
  (_, logits), grads = nnx.value_and_grad(_loss, has_aux=True)(model, *batch)
  return logits, nnx.to_pure_dict(nnx.state(grads, nnx.Param))


def _grads(model, *batch):
  return _logits_and_grads(model, *batch)[1]


@pytest.mark.slow
def test_convert_lm_matches_unconverted_in_eval_mode():
  """Converted on 8 devices (Explicit axes), logits at real tokens and parameter grads match."""
  mesh = make_mesh((8,), ("sp",))
  model = LM(rngs=nnx.Rngs(0))
  model.eval()
  original = nnx.clone(model)
  projection = model.blocks[1].attn.query
  report = fr.convert(model, mesh=mesh)
  assert report.replaced == ["blocks.0.attn", "blocks.1.attn"] and report.skipped == []
  assert str(report).startswith(
    "convert(to='ring'): 2 converted (2 nnx.MultiHeadAttention replaced, 0 hand-written), 0 left alone\n"
  ), str(report)
  assert isinstance(model.blocks[0].attn, fr.RingMultiHeadAttention)
  # Weights, options and metadata carried over; parameters now live on the mesh.
  attn, old = model.blocks[1].attn, original.blocks[1].attn
  np.testing.assert_array_equal(attn.query.kernel[...], old.query.kernel[...])
  assert attn.dropout_rate == 0.1 and attn.broadcast_dropout is False and attn.num_heads == 4
  assert attn.query is projection  # the projections are taken over as they are (inits, dot_general, metadata)
  assert attn.out.kernel[...].sharding == NamedSharding(mesh, P(None, None, None))

  batch = packed_batch()
  tokens = batch[0]
  valid = np.asarray(tokens > 0)
  want, want_grads = nnx.jit(_logits_and_grads)(original, *batch)
  got, grads = nnx.jit(_logits_and_grads)(model, *batch)
  assert got.sharding.spec[1] == "sp"  # activations really are sequence-sharded
  assert_close(np.asarray(got)[valid], np.asarray(want)[valid], jnp.float32)
  assert_close(grads, want_grads, jnp.float32, "grad")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::flax_ringattn._src.nnx.common.RingOfOneWarning")  # a ring of one on purpose
def test_train_mode_dropout_same_on_1_and_8_devices():
  """The same dropout key gives the same logits whatever the ring size, and the mask is really applied."""
  base = LM(rngs=nnx.Rngs(0), dropout_rate=0.3)
  one, eight = nnx.clone(base), nnx.clone(base)
  fr.convert(one, mesh=make_mesh((1,), ("sp",)))
  fr.convert(eight, mesh=make_mesh((8,), ("sp",)))
  batch = packed_batch(seed=1)
  valid = np.asarray(batch[0] > 0)
  run = nnx.jit(lambda m, *b: m(*b))
  for m in (one, eight):
    m.train()
  got1, got8 = run(one, *batch), run(eight, *batch)
  assert_close(np.asarray(got8)[valid], np.asarray(got1)[valid], jnp.float32)
  one.eval()
  eval1 = run(one, *batch)
  assert np.abs(np.asarray(eval1)[valid] - np.asarray(got1)[valid]).max() > 1e-2  # dropout did something
  # The rng stream advanced: the next training step draws another mask.
  eight.train()
  assert np.abs(np.asarray(run(eight, *batch))[valid] - np.asarray(got8)[valid]).max() > 1e-2


def test_converted_model_trains_from_its_first_call():
  """The one-line swap, then straight into a jitted training step (no forward first): the model's other
  parameters (embeddings, norms, MLP) are on the mesh too, so their gradients, contracted over the
  sequence-sharded activations, are typed (Explicit axes) and match the unconverted model's."""
  mesh = make_mesh((4,), ("sp",))
  model = LM(rngs=nnx.Rngs(0), dropout_rate=0.0, layers=1)
  ref = nnx.clone(model)
  fr.convert(model, mesh=mesh)
  for path, var in nnx.iter_graph(model):
    if isinstance(var, nnx.Variable) and isinstance(var.get_value(), jax.Array):
      assert var.get_value().sharding.mesh.shape_tuple == mesh.shape_tuple, path
  batch = packed_batch(T=32, seed=2)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P()))  # noqa: E731
  grads = nnx.jit(_grads)(model, *map(put, batch))
  assert_close(grads, nnx.jit(_grads)(ref, *batch), jnp.float32, "grad")


class _OneMHA(nnx.Module):
  def __init__(self, rngs):
    self.attn = nnx.MultiHeadAttention(2, 16, decode=False, rngs=rngs)

  def __call__(self, x):
    return self.attn(x)


class _HandWritten(nnx.Module):
  """One attention written by hand; `kind` is the mask it builds (constants, or the `valid` it is given)."""

  def __init__(self, kind, rngs):
    self.kind = kind
    self.qkv = nnx.Linear(16, 48, rngs=rngs)

  def __call__(self, x, valid):
    B, T, _ = x.shape
    q, k, v = jnp.split(self.qkv(x).reshape(B, T, 6, 8), 3, axis=2)
    logits = jnp.einsum("BTNH,BSNH->BNTS", q, k) * 8**-0.5
    causal = jnp.tril(jnp.ones((T, T), bool))
    mask = {
      "none": None,
      "causal": causal,
      "window": causal & ~jnp.tril(jnp.ones((T, T), bool), -4),  # the last 4 keys
      "band": jnp.triu(jnp.ones((T, T), bool), -2) & jnp.tril(jnp.ones((T, T), bool), 2),
      "data": valid[:, None, None, :],
      "causal+data": causal & valid[:, None, None, :],
    }[self.kind]
    if mask is not None:
      logits = jnp.where(mask, logits, -1e30)
    return jnp.einsum("BNTS,BSNH->BTNH", jax.nn.softmax(logits, axis=-1), v).reshape(B, T, 16)


def _example(model):
  return model(jnp.ones((2, 32, 16)), jnp.ones((2, 32), bool))


@pytest.mark.parametrize("to", ["ring", "paged"])
def test_report_first_line_counts_every_conversion(to):
  mesh = make_mesh((8,), ("sp",))
  report = fr.convert(_OneMHA(nnx.Rngs(0)), to=to, mesh=mesh)
  first = str(report).splitlines()[0]
  assert first == f"convert(to={to!r}): 1 converted (1 nnx.MultiHeadAttention replaced, 0 hand-written), 0 left alone"
  report = fr.convert(_HandWritten("causal", nnx.Rngs(0)), to=to, mesh=mesh, example=_example)
  lines = str(report).splitlines()
  assert (
    lines[0] == f"convert(to={to!r}): 1 converted (0 nnx.MultiHeadAttention replaced, 1 hand-written), 0 left alone"
  )
  assert "  hand-written attention: 1 converted, 0 left alone" in lines  # the detailed lines follow
  # A layer and a site left alone count in "left alone".
  skipped = nnx.Dict(
    a=nnx.MultiHeadAttention(2, 16, decode=False, attention_fn=lambda *a, **k: None, rngs=nnx.Rngs(0)),
    b=_OneMHA(nnx.Rngs(1)),
  )
  first = str(fr.convert(skipped, to=to, mesh=mesh)).splitlines()[0]
  assert first == f"convert(to={to!r}): 1 converted (1 nnx.MultiHeadAttention replaced, 0 hand-written), 1 left alone"


@pytest.mark.parametrize(
  "kind, words",
  [
    ("causal", "mask where: causal, softmax"),
    ("window", "mask where: causal, window (3, 0), softmax"),
    ("band", "mask where: window (2, 2), softmax"),
    ("none", "mask none: bidirectional (every query sees every key), softmax"),
    (
      "data",
      "mask where: recovered from the model's mask at each call (causal or not, segments, padding, spans), softmax",
    ),
    (
      "causal+data",
      "mask where: causal, the rest recovered from the model's mask at each call (segments, padding, spans), softmax",
    ),
  ],
)
def test_report_site_line_names_the_mask_structure(kind, words):
  report = fr.convert(_HandWritten(kind, nnx.Rngs(0)), mesh=make_mesh((8,), ("sp",)), example=_example)
  (site,) = report.converted
  assert str(site).startswith("<root> (_HandWritten): heads 2/2 (groups 1), scale 0.353553, ") and words in str(site)
  assert f"  converted {site}" in str(report).splitlines()


def test_report_site_line_names_a_declared_window_and_the_paged_structure():
  mesh = make_mesh((8,), ("sp",))
  report = fr.convert(_HandWritten("data", nnx.Rngs(0)), mesh=mesh, example=_example, local_window_size=(5, 0))
  assert "mask where: window (5, 0) (declared), the rest recovered from the model's mask" in str(report.converted[0])
  report = fr.convert(_HandWritten("window", nnx.Rngs(0)), to="paged", mesh=mesh, example=_example)
  assert (
    "window (3, 0) (its causal side in serving), the model's mask (where) not used: each sequence causal over its "
    "own paged cache" in str(report.converted[0])
  )


def test_convert_report_skips_with_reasons_and_paged_target():
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.plain = nnx.MultiHeadAttention(4, 32, decode=False, rngs=rngs)
      self.custom = nnx.MultiHeadAttention(4, 32, decode=False, attention_fn=lambda *a, **k: None, rngs=rngs)
      self.sampler = nnx.MultiHeadAttention(4, 32, decode=True, rngs=rngs)

  model = Model(nnx.Rngs(0))
  report = fr.convert(model)
  assert report.replaced == ["plain"]
  reasons = dict(report.skipped)
  assert "custom attention_fn" in reasons["custom"]
  assert "decode=True" in reasons["sampler"] and "to='paged'" in reasons["sampler"]
  again = fr.convert(model)
  assert dict(again.skipped)["plain"] == "already a RingMultiHeadAttention"

  paged_model = Model(nnx.Rngs(0))
  ref = nnx.clone(paged_model.sampler)
  report = fr.convert(paged_model, to="paged")
  assert "sampler" in report.replaced and "plain" in report.replaced
  paged = paged_model.sampler
  assert isinstance(paged, fr.PagedMultiHeadAttention)
  paged.init_cache(num_pages=8, page_size=8, max_num_seqs=1, pages_per_seq=4)
  x = jax.random.normal(jax.random.PRNGKey(0), (16, 32))
  y = paged(x, cu_q_lens=jnp.array([0, 16], jnp.int32), num_seqs=jnp.array([1], jnp.int32))
  ref_layer = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(1))
  nnx.update(ref_layer, nnx.state(ref, nnx.Param))
  assert_close(y, ref_layer(x[None], mask=nnx.make_causal_mask(jnp.ones((1, 16))))[0], jnp.float32)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(to="flash"), ValueError, "to='flash' must be 'ring' or 'paged'"),
    (dict(to="paged", seq_axis="sp"), ValueError, r"convert\(to='paged'\): seq_axis='sp' needs mesh=\.\.\."),
    (dict(bogus_option=1), TypeError, "does not take these options"),
    (
      dict(example=(jnp.zeros((1, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32))),
      TypeError,
      r"example must be a function of the model, called as example\(model\).*got a tuple",
    ),
  ],
  ids=["to", "paged-seq-axis-without-mesh", "unknown-option", "example-not-a-function"],
)
def test_convert_errors(kwargs, error, match):
  model = LM(rngs=nnx.Rngs(0), layers=1)
  with pytest.raises(error, match=match):
    fr.convert(model, **kwargs)


@pytest.mark.parametrize(
  "shape,names,axes",
  [((8,), ("sp",), dict(seq_axis="sp")), ((4, 2), ("sp", "tp"), dict(seq_axis="sp", head_axis="tp"))],
  ids=["sp8", "sp4-tp2"],
)
def test_convert_to_paged_spreads_the_cache_over_seq_axis(shape, names, axes):
  """convert(to="paged", mesh=, seq_axis=): the layers' caches spread their pages over the axis, and one ragged
  prefill step of two sequences gives the unconverted layer's causal outputs."""

  class Model(nnx.Module):
    def __init__(self, rngs):
      self.attn = nnx.MultiHeadAttention(4, 32, num_kv_heads=2, decode=False, rngs=rngs)

  mesh = make_mesh(shape, names)
  model = Model(nnx.Rngs(0))
  ref = nnx.clone(model.attn)
  report = fr.convert(model, to="paged", mesh=mesh, **axes)
  assert report.replaced == ["attn"], report
  layer = model.attn
  assert isinstance(layer, fr.PagedMultiHeadAttention)
  assert layer.seq_axis == "sp" and layer.head_axis == axes.get("head_axis")
  page_size, lengths = 4, (13, 7)
  layer.init_cache(num_pages=16, page_size=page_size, max_num_seqs=2, pages_per_seq=4)
  cache = layer.kv_cache.get_value()
  assert cache.num_shards == shape[0]
  assert tuple(cache.k_pages.sharding.spec)[:3] == ("sp", None, axes.get("head_axis"))

  x = jax.random.normal(jax.random.PRNGKey(1), (len(lengths), max(lengths), 32))
  rows = jnp.concatenate([x[b, :n] for b, n in enumerate(lengths)])
  cu_q_lens = jnp.array(np.cumsum((0, *lengths)), jnp.int32)
  y = nnx.jit(lambda m, x: m(x, cu_q_lens=cu_q_lens, num_seqs=jnp.array([2], jnp.int32)))(layer, rows)
  want = ref(x, mask=nnx.make_causal_mask(jnp.ones(x.shape[:2])))
  assert_close(y, jnp.concatenate([want[b, :n] for b, n in enumerate(lengths)]), jnp.float32)
  # No more pages per sequence than devices here: each of its pages sits on a device of its own.
  cache = layer.kv_cache.get_value()
  table, owners_per_device = np.asarray(cache.page_indices), cache.pages_per_owner
  for s, n in enumerate(lengths):
    owners = np.bincount(table[s, : -(-n // page_size)] // owners_per_device, minlength=cache.num_shards)
    assert owners.max() - owners.min() <= 1 and owners.max() == 1, (s, owners)


def test_convert_needs_a_module():
  with pytest.raises(TypeError, match="model must be a flax.nnx.Module, got dict"):
    fr.convert({})


def _layer_and_batch(mesh, **kw):
  layer = fr.RingMultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(0), mesh=mesh, **kw)
  x = jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (2, 64, 32)), NamedSharding(mesh, P(None, "sp")))
  return layer, x


def _grad_step(m, x):
  return nnx.to_pure_dict(nnx.state(nnx.grad(lambda m: jnp.mean(m(x, is_causal=True) ** 2))(m), nnx.Param))


@pytest.mark.parametrize(
  "order",
  ["grad-first", "forward-then-grad", "under-set-mesh", "after-update", "after-update-under-set-mesh"],
)
def test_explicit_mesh_param_grads_in_any_call_order(order):
  mesh = make_mesh((8,), ("sp",))
  layer, x = _layer_and_batch(mesh)
  assert layer.query.kernel[...].sharding == NamedSharding(mesh, P(None, None, None))  # typed at construction
  ref = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(3))
  if order.startswith("after-update"):
    nnx.update(layer, nnx.state(ref, nnx.Param))  # single-device weights from elsewhere
  else:
    nnx.update(ref, jax.device_get(nnx.state(layer, nnx.Param)))
  step = nnx.jit(_grad_step)
  if order == "forward-then-grad":
    nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x)
  if order.endswith("under-set-mesh"):
    with jax.set_mesh(mesh):
      grads = step(layer, x)
  else:
    grads = step(layer, x)
  want = _grad_step(ref, jnp.asarray(np.asarray(x)))
  assert_close(grads, want, jnp.float32, "grad")
  assert layer.query.kernel[...].sharding.mesh.shape_tuple == mesh.shape_tuple  # on the mesh afterwards


def test_explicit_mesh_head_axis_params_sharded_after_update():
  mesh = make_mesh((4, 2), ("sp", "tp"))
  layer, x = _layer_and_batch(mesh, seq_axis="sp", head_axis="tp")
  ref = nnx.MultiHeadAttention(4, 32, decode=False, rngs=nnx.Rngs(3))
  nnx.update(layer, nnx.state(ref, nnx.Param))
  grads = nnx.jit(_grad_step)(layer, x)
  assert_close(grads, _grad_step(ref, jnp.asarray(np.asarray(x))), jnp.float32, "grad")
  assert layer.query.kernel[...].sharding.spec == P(None, "tp", None)

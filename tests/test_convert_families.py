"""`convert` on the model families that broke it (look-alikes written for these tests, in the project's words).

* attention under `nnx.remat` / `jax.checkpoint` inside the attention module's own call (google-tunix's
  `RematConfig.BLOCK`): converted, the remat body and its policy kept around the ring;
* the JAX AI stack tutorial's miniGPT style: `nnx.MultiHeadAttention` with `NamedSharding` partitioning
  metadata and a 2-D float `[T, T]` causal mask;
* a failed `convert` (bad metadata, a failing `example=`) leaves the model exactly as it was;
* attention weights an inner function returns and its caller drops (dead code) are no use of the weights;
* an NNX object passed as an argument and only read (a table of constants), under `jax.jit` of split / merge;
* every module left to run its own code says why in `print(report)`.

Each conversion is checked against the unconverted model: logits on every row that sees a key, loss and every
gradient (f32), and the ring's collective permutes in the converted step's HLO, absent from the unconverted one's.
"""

from __future__ import annotations

import handwritten_models as hm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_handwritten import F32, T, _inputs, _loss, _WithRngs
from tolerances import assert_close

import flax_ringattn as fr


def _grads(model, *args):
  """jax.jit of value_and_grad over the parameters, the model merged from its split inside (the rest of its state,
  rngs and constants, passed to the jit as an argument)."""
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def step(params, rest):
    f = lambda p: _loss(nnx.merge(graphdef, p, rest), *args, with_logits=True)
    return jax.value_and_grad(f, has_aux=True)(params)  # ((loss, logits), grads)

  return jax.jit(lambda p: step(p, rest)), params


def _check_matches(model, ref, sees, loss_args):
  """Logits on the rows that see a key, loss and every gradient; the ring's permutes only in the converted step."""
  step, params = _grads(model, *loss_args)  # logits, loss and gradients from one compiled step
  ref_step, ref_params = _grads(ref, *loss_args)
  ((loss, got), grads), ((ref_loss, want), ref_grads) = step(params), ref_step(ref_params)
  assert_close(np.asarray(got)[sees], np.asarray(want)[sees], F32)
  assert_close(loss, ref_loss, F32)
  # Leaves: convert rewrites the swapped layers' partitioning metadata (a tuple on its mesh), not the tree's paths.
  assert jax.tree.structure(nnx.to_pure_dict(grads)) == jax.tree.structure(nnx.to_pure_dict(ref_grads))
  assert_close(jax.tree.leaves(grads), jax.tree.leaves(ref_grads), F32, "grad")
  assert "collective_permute" in step.lower(params).as_text()
  assert "collective_permute" not in ref_step.lower(ref_params).as_text()


# -- remat inside the attention module ---------------------------------------------------------------------------

REMAT = {
  "gemma3_nnx_remat": (
    lambda rngs: hm.RematGemmaAttention(4, 2, 8, qk_norm=True, cap=5.0, policy="dots_saveable", rngs=rngs),
    "dots_saveable",
  ),
  "llama_jax_checkpoint": (lambda rngs: hm.RematLlamaAttention(4, 2, 8, rngs=rngs), None),
}


def _remat_bodies(jaxpr, found):
  for e in jaxpr.eqns:
    if e.primitive.name in ("remat2", "checkpoint"):
      found.append(e)
    for value in e.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(sub, "jaxpr", sub)
        if hasattr(inner, "eqns"):
          _remat_bodies(inner, found)
  return found


@pytest.mark.parametrize("name", list(REMAT))
def test_attention_under_remat_inside_the_module_converts_and_keeps_the_remat(name):
  make, policy = REMAT[name]
  tokens, pos, mask, sees, valid = _inputs("mask")
  ref, model = hm.Decoder(make, 1, rngs=nnx.Rngs(0)), hm.Decoder(make, 1, rngs=nnx.Rngs(0))  # one layer: compiles
  report = fr.convert(model, mesh=make_mesh((8,), ("sp",)), example=lambda m: m(tokens, pos, mask))
  assert [s.path for s in report.converted] == ["blocks.0.attn"], str(report)
  assert not report.left_alone and not report.own_code, str(report)
  _check_matches(model, ref, sees, (tokens, pos, mask, valid))
  # The converted call still runs each layer's attention inside a jax.checkpoint body, with the model's policy,
  # and the ring (a shard_map) is inside it.
  graphdef, state = nnx.split(model)
  closed = jax.make_jaxpr(lambda s: nnx.merge(graphdef, s)(tokens, pos, mask))(state)
  bodies = _remat_bodies(closed.jaxpr, [])
  assert len(bodies) == 1
  for body in bodies:
    want = None if policy is None else getattr(jax.checkpoint_policies, policy)
    assert body.params["policy"] is want
    assert "shard_map" in str(body.params["jaxpr"])


# -- the JAX AI stack tutorial's miniGPT style ----------------------------------------------------------------------


class TutorialBlock(nnx.Module):
  """A miniGPT-style block: flax's MultiHeadAttention with NamedSharding partitioning, a 2-D float causal mask."""

  def __init__(self, mesh, rngs, *, bad_axis=False):
    part = lambda init, *spec, mesh=mesh: nnx.with_partitioning(init, NamedSharding(mesh, P(*spec)))  # noqa: E731
    # bad_axis: the attention partitioned for another mesh, whose head axis convert's mesh lacks.
    heads, on = ("nowhere", make_mesh((2, 4), ("nowhere", "sp"), explicit=False)) if bad_axis else ("model", mesh)
    self.mha = nnx.MultiHeadAttention(
      num_heads=4,
      in_features=hm.D,
      kernel_init=part(nnx.initializers.xavier_uniform(), None, heads, mesh=on),
      bias_init=part(nnx.initializers.zeros_init(), heads, mesh=on),
      decode=False,
      rngs=rngs,
    )
    self.norm = nnx.LayerNorm(hm.D, scale_init=part(nnx.initializers.ones_init(), "model"), rngs=rngs)
    self.ffn = nnx.Linear(hm.D, hm.D, kernel_init=part(nnx.initializers.xavier_uniform(), None, "model"), rngs=rngs)

  def __call__(self, x):
    mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1])))  # [T, T] float, as the tutorial builds it
    x = self.norm(x + self.mha(x, mask=mask))
    return x + jax.nn.gelu(self.ffn(x))


class MiniGPT(nnx.Module):
  def __init__(self, mesh, rngs, *, layers=1, bad_second=False):
    self.embed = nnx.Embed(hm.VOCAB, hm.D, rngs=rngs)
    self.blocks = nnx.List([TutorialBlock(mesh, rngs, bad_axis=bad_second and n == 1) for n in range(layers)])

  def __call__(self, tokens, positions, mask):
    del positions, mask  # the tutorial's model takes tokens only; the test helpers pass three inputs
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(x)


def test_tutorial_model_with_named_sharding_and_a_2d_mask():
  tokens, pos, mask, _, valid = _inputs("mask")
  mesh = make_mesh((2, 4), ("model", "sp"), explicit=False)  # the tutorial's mesh types: Auto
  ref, model = MiniGPT(mesh, nnx.Rngs(0)), MiniGPT(mesh, nnx.Rngs(0))
  report = fr.convert(model, mesh=mesh, seq_axis="sp", example=lambda m: m(tokens, pos, mask))
  assert report.replaced == ["blocks.0.mha"], str(report)
  kernel = model.blocks[0].mha.query.kernel
  assert kernel.get_metadata()["out_sharding"] == (None, "model")  # read from the NamedSharding
  assert kernel[...].sharding.spec == P(None, "model")
  _check_matches(model, ref, np.ones((3, T), bool), (tokens, pos, mask, valid))


def _snapshot(model):
  return [
    (".".join(map(str, path)), type(node), np.asarray(node[...]), dict(node.get_metadata()))
    if isinstance(node, nnx.Variable)
    else (".".join(map(str, path)), type(node), None, None)
    for path, node in nnx.iter_graph(model)
  ]


def _assert_same(before, after):
  assert [(p, t) for p, t, _, _ in before] == [(p, t) for p, t, _, _ in after]
  for (p, _, v0, m0), (_, _, v1, m1) in zip(before, after, strict=True):
    if v0 is not None:
      np.testing.assert_array_equal(v0, v1, err_msg=p)
      assert m0 == m1, p


def test_a_failed_convert_leaves_the_model_exactly_as_it_was():
  mesh = make_mesh((2, 4), ("model", "sp"), explicit=False)
  tokens, pos, mask, _, _ = _inputs("mask")
  # 1. The second layer's metadata names an axis the mesh lacks: the first layer was already swapped.
  model = MiniGPT(mesh, nnx.Rngs(0), layers=2, bad_second=True)
  before = _snapshot(model)
  with pytest.raises(ValueError, match=r"blocks\.1\.mha|query\.kernel") as err:
    fr.convert(model, mesh=mesh, seq_axis="sp")
  assert "names mesh axes ['nowhere']" in str(err.value)
  assert any("failed while replacing blocks.1.mha; the model is as it was" in n for n in err.value.__notes__)
  _assert_same(before, _snapshot(model))
  # 2. example= fails after every layer was swapped and watched: everything is put back, classes included.
  model = hm.Decoder(hm.llama(), rngs=nnx.Rngs(0))
  before = _snapshot(model)
  with pytest.raises(TypeError) as err:
    fr.convert(model, mesh=make_mesh((8,), ("sp",)), example=lambda m: m(tokens, pos))  # a missing argument
  assert any("failed while running example=" in n for n in err.value.__notes__)
  _assert_same(before, _snapshot(model))
  assert type(model.blocks[0].attn) is hm.LlamaAttention and not hasattr(model.blocks[0].attn, "_fr_path")


# -- dead code, NNX object arguments ---------------------------------------------------------------------------------


class WeightsDroppedAttention(hm.LlamaAttention):
  """An inner function returns the output and the (cast) weights; the caller keeps the output only."""

  def __call__(self, x, positions, mask):
    B, T_, _ = x.shape
    H = self.head_dim
    q, k, v = self.project(x, positions)

    def attend(q, k, v):
      logits = jnp.einsum("BTHGD,BSHD->BHGTS", q, k) * H**-0.5
      probs = jax.nn.softmax(jnp.where(mask[:, None, None], logits, -1e9), axis=-1)
      return jnp.einsum("BHGTS,BSHD->BTHGD", probs, v).reshape(B, T_, -1), probs.astype(jnp.bfloat16)

    out, _weights = attend(q, k, v)
    return self.o_proj(out)


class RopeTable(nnx.Module):
  """Constants a model keeps in an NNX object and passes to its attention (EasyDeL's frequency cache)."""

  def __init__(self, head_dim):
    half = head_dim // 2
    self.freq = nnx.Variable(10_000.0 ** (-jnp.arange(half) / half))


class TableAttention(hm.LlamaAttention):
  """Reads its rope frequencies from an NNX object argument; keeps state the call only reads (rngs it does not
  draw from in eval mode, a variable still None, a variable holding a tuple); its core is `jax.checkpoint`-ed
  with the mask broadcast before the body (the broadcast is pruned: the site reads the mask itself)."""

  def __init__(self, *args, rngs, **kwargs):
    super().__init__(*args, rngs=rngs, **kwargs)
    self.rngs = rngs
    self.table = RopeTable(self.head_dim)
    self.lazy = nnx.Variable(None)  # a cache filled later
    self.pair = nnx.Variable((jnp.ones(()), jnp.zeros(())))

  def __call__(self, x, positions, mask, table=None):
    table = self.table if table is None else table
    B, T_, _ = x.shape
    K, G, H = self.kv_heads, self.heads // self.kv_heads, self.head_dim

    def rope(x):
      ang = positions[..., None, None].astype(F32) * table.freq[...]
      x1, x2 = x[..., : H // 2], x[..., H // 2 :]
      return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x2 * jnp.cos(ang) + x1 * jnp.sin(ang)], -1)

    q = rope(self.q_proj(x).reshape(B, T_, self.heads, H)).reshape(B, T_, K, G, H) * self.pair.get_value()[0]
    k = rope(self.k_proj(x).reshape(B, T_, K, H))
    v = self.v_proj(x).reshape(B, T_, K, H)

    @jax.checkpoint
    def core(q, k, v, mask5):
      logits = jnp.where(mask5, jnp.einsum("BTHGD,BSHD->BHGTS", q, k) * H**-0.5, -1e9)
      return jnp.einsum("BHGTS,BSHD->BTHGD", jax.nn.softmax(logits, axis=-1), v)

    return self.o_proj(core(q, k, v, mask[:, None, None]).reshape(B, T_, -1))


class TableBlock(hm.Block):
  def __call__(self, x, positions, mask):
    x = x + self.attn(self.norm1(x), positions, mask, self.attn.table)  # the object passed as an argument
    return x + jax.nn.gelu(self.mlp(self.norm2(x)))


class TableDecoder(hm.Decoder):
  def __init__(self, rngs):
    super().__init__(lambda r: TableAttention(4, 2, 8, rngs=r), 1, rngs=rngs)
    self.blocks = nnx.List([TableBlock(b.attn, rngs) for b in self.blocks])


@pytest.mark.parametrize("name", ["weights_dropped", "nnx_object_argument"])
def test_dead_weights_and_read_only_nnx_arguments_convert(name):
  """Under jax.jit(value_and_grad) of a function that merges the split model (`_grads`): the converted call
  writes back only what it changed, so the rngs the module keeps but does not draw from are never written."""
  tokens, pos, mask, sees, valid = _inputs("mask")
  if name == "weights_dropped":
    make = lambda: hm.Decoder(lambda r: WeightsDroppedAttention(4, 2, 8, rngs=r), 1, rngs=nnx.Rngs(0))  # noqa: E731
  else:
    make = lambda: TableDecoder(nnx.Rngs(0))  # noqa: E731
  ref, model = make(), make()
  report = fr.convert(model, mesh=make_mesh((8,), ("sp",)), example=lambda m: m(tokens, pos, mask))
  assert [s.path for s in report.converted] == ["blocks.0.attn"], str(report)
  assert not report.left_alone and not report.own_code, str(report)
  _check_matches(model, ref, sees, (tokens, pos, mask, valid))
  # The model closed over by a plain jax.jit: any write to its variables would raise a trace-level error.
  got = jax.jit(lambda *a: model(*a))(tokens, pos, mask)
  assert_close(np.asarray(got)[sees], np.asarray(ref(tokens, pos, mask))[sees], F32)


# -- every skip explained ---------------------------------------------------------------------------------------------


class _ScanHeads(nnx.Module):
  """Attention per head in a lax.scan over heads, all in one module: convert does not look into the body."""

  def __init__(self, rngs):
    self.inner = hm.LlamaAttention(4, 4, 8, rngs=rngs)

  def __call__(self, x, positions, mask):
    a = self.inner
    B, T_, _ = x.shape
    q = a.q_proj(x).reshape(B, T_, 4, 8).transpose(2, 0, 1, 3)
    k = a.k_proj(x).reshape(B, T_, 4, 8).transpose(2, 0, 1, 3)
    v = a.v_proj(x).reshape(B, T_, 4, 8).transpose(2, 0, 1, 3)

    def head(_, qkv):
      q, k, v = qkv
      logits = jnp.where(mask, jnp.einsum("BTH,BSH->BTS", q, k), -1e9)
      return None, jnp.einsum("BTS,BSH->BTH", jax.nn.softmax(logits, -1), v)

    _, out = jax.lax.scan(head, None, (q, k, v))
    return a.o_proj(out.transpose(1, 2, 0, 3).reshape(B, T_, -1))


class _Skips(nnx.Module):
  """One module per kind of skip."""

  def __init__(self, rngs):
    self.sampler = hm.GemmaAttention(4, 2, 8, rngs=rngs)
    self.scan_heads = _ScanHeads(rngs)
    self.with_rngs = _WithRngs(rngs)

  def __call__(self, x, positions, mask):
    cache = {"k": jnp.zeros((x.shape[0], T, 2, 8)), "v": jnp.zeros((x.shape[0], T, 2, 8)), "end": 0}
    y, _ = self.sampler(x, positions, mask[:, :, :T], cache=cache)
    return y + self.scan_heads(x, positions, mask) + self.with_rngs(x, positions, mask, nnx.Rngs(dropout=0))


def test_every_module_left_to_its_own_code_says_why():
  _, pos, mask, _, _ = _inputs("mask")
  x = jnp.asarray(np.random.default_rng(7).normal(size=(3, T, hm.D)), F32)
  holder = nnx.Dict(m=_Skips(nnx.Rngs(0)))
  report = fr.convert(holder, mesh=make_mesh((8,), ("sp",), explicit=False))
  assert "(found at the first call; " in str(report)
  holder["m"](x, pos, mask)
  text = str(report)
  assert "found at the first call" not in text, text
  assert "own code m.sampler: called with a cache argument" in text, text
  assert "own code m.scan_heads: a contraction and an exp (attention?) inside a lax.scan body" in text, text
  assert "own code m.with_rngs: writes to the NNX object passed as argument (argument 0: dropout" in text, text
  assert [s.path for s in report.converted] == ["m.with_rngs.attn"], text
  # example= that finds nothing: the report no longer promises a first call.
  holder = nnx.Dict(m=hm.RMS(hm.D))
  report = fr.convert(holder, mesh=make_mesh((8,), ("sp",)), example=lambda h: h["m"](x))
  assert "found at the first call" not in str(report) and "0 converted, 0 left alone" in str(report), str(report)

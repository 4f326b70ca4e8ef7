"""Dense masks as flax models build them: recovered exactly as causal + segments + padding, or refused."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tolerances import assert_close

import flax_ringattn as fr

B, T, F, HEADS = 2, 32, 16, 4


def _inputs():
  valid = np.ones((B, T), bool)
  valid[0, 27:] = False
  valid[1, 30:] = False
  seg = np.ones((B, T), np.int32)
  seg[0, 10:] = 2
  seg[1, 5:19] = 3
  seg[1, 19:] = 4
  return jnp.asarray(valid), jnp.asarray(seg)


def _masks():
  valid, seg = _inputs()
  tokens = valid.astype(jnp.int32)
  pad = nnx.make_attention_mask(valid, valid)
  segs = nnx.make_attention_mask(seg, seg, jnp.equal)
  causal = nnx.make_causal_mask(tokens)
  return {
    "causal+segments+padding": (nnx.combine_masks(pad, causal, segs), True),
    "segments+padding": (nnx.combine_masks(pad, segs), False),
    "causal": (causal, True),
    "padding": (pad, False),
    "all-visible, one batch row for all": (jnp.ones((1, 1, T, T)), False),
  }


@pytest.mark.parametrize("name", list(_masks()))
def test_structure_recovered_exactly(name):
  mask, causal = _masks()[name]
  is_causal, q_ids, kv_ids, exact, bid = fr.structure_from_dense_mask(mask)
  assert not np.asarray(bid).any()  # causal + segments rebuild it: no span
  assert bool(exact) and bool(is_causal) == causal
  rebuilt = fr.dense_mask_from_structure(is_causal, q_ids, kv_ids)
  np.testing.assert_array_equal(np.broadcast_to(rebuilt, mask.shape), np.asarray(mask) != 0)


def test_helpers_build_the_same_structure_without_the_mask():
  valid, seg = _inputs()
  mask, _ = _masks()["causal+segments+padding"]
  q_ids, kv_ids = fr.padded_segment_ids(valid, seg)
  np.testing.assert_array_equal(fr.dense_mask_from_structure(True, q_ids, kv_ids), np.asarray(mask) != 0)
  # Negative user ids never collide with the padding ids.
  q_ids, kv_ids = fr.padded_segment_ids(valid, -seg)
  np.testing.assert_array_equal(fr.dense_mask_from_structure(True, q_ids, kv_ids), np.asarray(mask) != 0)


@pytest.mark.parametrize("name", ["causal+segments+padding", "segments+padding"])
def test_layer_with_dense_mask_matches_mha_at_real_tokens(name):
  mask, _ = _masks()[name]
  valid, _ = _inputs()
  mha = nnx.MultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(0))
  ring = fr.RingMultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(1))
  nnx.update(ring, nnx.state(mha, nnx.Param))
  x = jax.random.normal(jax.random.PRNGKey(0), (B, T, F))
  keep = np.asarray(valid)
  want = mha(x, mask=mask)
  eager = ring(x, mask=mask)  # concrete mask: structure known at trace time
  jitted = nnx.jit(lambda m, x, mask: m(x, mask=mask))(ring, x, mask)  # traced: lax.cond + checked
  assert_close(np.asarray(eager)[keep], np.asarray(want)[keep], jnp.float32)
  assert_close(np.asarray(jitted)[keep], np.asarray(want)[keep], jnp.float32)
  # Through attention_fn too.
  swapped = nnx.MultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(2), attention_fn=fr.make_ring_attention_fn())
  nnx.update(swapped, nnx.state(mha, nnx.Param))
  assert_close(np.asarray(swapped(x, mask=mask))[keep], np.asarray(want)[keep], jnp.float32)


def _flax_mask_forms():
  """Masks nnx.MultiHeadAttention takes besides make_attention_mask's [B, 1, T, S]: they broadcast to
  [B, N, T, S], and any dtype reads nonzero as visible."""
  valid, _ = _inputs()
  tril = jnp.tril(jnp.ones((T, T)))  # float, [T, T]: the JAX AI stack tutorial's causal mask
  return {
    "2d-float-causal": tril,
    "3d-one-head-bool": tril[None] != 0,
    "key-padding-b11s": valid[:, None, None, :],
    "2d-int": tril.astype(jnp.int32),
  }


@pytest.mark.parametrize("name", list(_flax_mask_forms()))
def test_layer_takes_every_mask_shape_flax_takes(name):
  mask = _flax_mask_forms()[name]
  mha = nnx.MultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(0))
  ring = fr.RingMultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(1))
  nnx.update(ring, nnx.state(mha, nnx.Param))
  x = jax.random.normal(jax.random.PRNGKey(3), (B, T, F))
  want = mha(x, mask=mask)
  assert_close(ring(x, mask=mask), want, jnp.float32)
  assert_close(nnx.jit(lambda m, x, mask: m(x, mask=mask))(ring, x, mask), want, jnp.float32)


def _window_mask():
  i = jnp.arange(T)
  return ((i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4))[None, None]


def test_mask_outside_the_family_raises_naming_alternatives(capfd, caplog):
  ring = fr.RingMultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(1))
  x = jnp.zeros((B, T, F))
  with pytest.raises(ValueError, match=r"not of the family .*padded_segment_ids.* local_window_size="):
    ring(x, mask=_window_mask())
  # Under jit the check runs on device and the output is NaN (raising there would hang the other devices in the
  # ring's collectives).  By default nothing more: no host callback, which would keep the program out of JAX's
  # persistent compilation cache.  check_mask="report" also says why on stderr, once.
  call = nnx.jit(lambda m, x, mask: m(x, mask=mask))
  assert np.isnan(np.asarray(call(ring, x, _window_mask()))).all()
  assert "callback" not in jax.jit(lambda x, mask: ring(x, mask=mask)).lower(x, _window_mask()).as_text()
  assert "attention output set to NaN" not in capfd.readouterr().err + caplog.text
  reporting = fr.RingMultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(1), check_mask="report")
  out = jax.block_until_ready(call(reporting, x, _window_mask()))
  assert np.isnan(np.asarray(out)).all()
  # Once: through logging where it has handlers (pytest's here), else on stderr.
  said = capfd.readouterr().err + caplog.text
  assert said.count("attention output set to NaN: the dense mask=... is not of the family") == 1, said
  # Declared, the window is part of the family.
  windowed = fr.RingMultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(1), local_window_size=(3, 0))
  assert np.isfinite(np.asarray(nnx.jit(lambda m, x, mask: m(x, mask=mask))(windowed, x, _window_mask()))).all()
  # A per-head mask is outside the family too.
  causal = nnx.make_causal_mask(jnp.ones((B, T)))
  per_head = jnp.concatenate([causal, jnp.ones((B, HEADS - 1, T, T))], axis=1)
  with pytest.raises(ValueError, match="not of the family"):
    ring(x, mask=per_head)


def test_check_mask_false_skips_the_jit_check():
  ring = fr.RingMultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(1), check_mask=False)
  out = nnx.jit(lambda m, x, mask: m(x, mask=mask))(ring, jnp.zeros((B, T, F)), _window_mask())
  assert out.shape == (B, T, F)
  # A misspelt value is refused on every path, the one-call port's too (it checks no other op option up front).
  q = jnp.zeros((1, T, 2, 8))
  with pytest.raises(TypeError, match=r"check_mask must be a bool or 'report', got 'Report'"):
    fr.dot_product_attention(q, q, q, mask=_window_mask(), check_mask="Report")


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(mask=jnp.ones((1, B, 1, T, T))), ValueError, r"mask must broadcast to \[B, N, T, S\] = \[2, 4, 32, 32\]"),
    (dict(mask=jnp.ones((3, 1, T, T))), ValueError, r"got mask.shape=\(3, 1, 32, 32\)"),
    (dict(mask=jnp.ones((B, T, T))), ValueError, r"got mask.shape=\(2, 32, 32\)"),  # 3-D is [N | 1, T, S]
    (dict(mask=jnp.ones((B, 1, T, T)), segment_ids=jnp.zeros((B, T), jnp.int32)), ValueError, "not both"),
    (
      dict(mask=jnp.ones((B, 1, T, 16)), inputs_k=jnp.zeros((B, 16, F))),
      NotImplementedError,
      r"self attention only \(T == S\), got T=32, S=16",
    ),
  ],
  ids=["rank", "batch", "3d-is-heads", "with-segment-ids", "cross-attention"],
)
def test_dense_mask_errors(kwargs, error, match):
  ring = fr.RingMultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(1))
  with pytest.raises(error, match=match):
    ring(jnp.zeros((B, T, F)), **kwargs)


def test_padded_segment_ids_shape_error():
  with pytest.raises(ValueError, match=r"segment_ids must have the shape of valid \(2, 32\), got \(2, 31\)"):
    fr.padded_segment_ids(jnp.ones((2, 32), bool), jnp.ones((2, 31), jnp.int32))


def test_dot_product_attention_with_sinks_and_mla_matches_reference():
  """The one-call port of a gpt-oss / DeepSeek-style block: the model's causal key mask, its [N] sinks and v at its
  own head dim; forward and every gradient (dsinks included) against the reference on a ring of 4."""
  from conftest import make_mesh

  ks = jax.random.split(jax.random.key(7), 5)
  q = jax.random.normal(ks[0], (2, 32, 4, 12))
  k = jax.random.normal(ks[1], (2, 32, 2, 12))
  v = jax.random.normal(ks[2], (2, 32, 2, 8))
  sinks = 2.0 + jax.random.normal(ks[3], (4,))
  do = jax.random.normal(ks[4], (2, 32, 4, 8))
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((32, 32), bool)), (2, 32, 32))
  mesh = make_mesh((4,), ("sp",))
  port = lambda q, k, v, s: fr.dot_product_attention(q, k, v, mask=mask, mesh=mesh, sinks=s)  # noqa: E731
  ref = lambda q, k, v, s: fr.reference_attention(q, k, v, is_causal=True, sinks=s)  # noqa: E731
  out, vjp = jax.vjp(jax.jit(port), q, k, v, sinks)
  ref_out, ref_vjp = jax.vjp(ref, q, k, v, sinks)
  assert out.shape == (2, 32, 4, 8)
  assert_close(out, ref_out, jnp.float32)
  assert_close(vjp(do), ref_vjp(do), jnp.float32, "grad")


@pytest.mark.parametrize("name", ["mask", "bias"])
def test_dot_product_attention_refuses_a_3d_mask_it_could_misread(name):
  """With B == N, a 3-D mask is [B, T, S] here and [N, T, S] in jax.nn: refused, with both 4-D spellings."""
  q = jnp.zeros((4, 8, 4, 8))
  kv = jnp.zeros((4, 8, 2, 8))
  tril = jnp.tril(jnp.ones((8, 8), bool))
  value = jnp.broadcast_to(tril if name == "mask" else jnp.where(tril, 0.0, -1e9), (4, 8, 8))
  with pytest.raises(ValueError, match=rf"{name}.shape=\(4, 8, 8\) is ambiguous .* {name}\[:, None\]"):
    fr.dot_product_attention(q, kv, kv, **{name: value}, implementation="xla")
  # 4-D, either reading is accepted.
  fr.dot_product_attention(q, kv, kv, **{name: value[:, None]}, implementation="xla")


def test_a_traced_causal_mask_is_told_apart_in_one_pass():
  """Under jit a dense mask that is exactly causal (within the declared window) skips its recovery
  (`dense.plain_causal` true: one compare and reduction), with zero ids; any other mask takes the recovery."""
  from flax_ringattn._src.ring import dense

  tril = jnp.tril(jnp.ones((T, T), bool))
  plain = jax.jit(
    lambda m, **kw: dense.plain_causal(m, B=B, N=HEADS, T=T, **kw), static_argnames=("is_causal", "window")
  )
  assert bool(plain(jnp.broadcast_to(tril, (B, 1, T, T))))
  assert bool(plain(jnp.ones((B, 1, T, T)), is_causal=True))  # is_causal=True ANDs the mask with causal
  assert not bool(plain(jnp.ones((B, 1, T, T))))
  padded = tril.at[:, T - 3 :].set(False)  # keys of padding
  assert not bool(plain(jnp.broadcast_to(padded, (B, 1, T, T))))
  band = tril & ~jnp.tril(jnp.ones((T, T), bool), -3)  # a query sees itself and the 2 keys before it
  assert bool(plain(jnp.broadcast_to(band, (B, 1, T, T)), window=(2, 0)))
  assert not bool(plain(jnp.broadcast_to(band, (B, 1, T, T))))
  assert not bool(plain(jnp.broadcast_to(tril, (B, 1, T, T)), window=(2, 0)))
  # The layer gives the same output both ways: the causal mask traced, and is_causal=True.
  ring = fr.RingMultiHeadAttention(HEADS, F, decode=False, rngs=nnx.Rngs(1))
  x = jax.random.normal(jax.random.key(0), (B, T, F))
  got = nnx.jit(lambda m, x, mask: m(x, mask=mask))(ring, x, jnp.broadcast_to(tril, (B, 1, T, T)))
  want = ring(x, is_causal=True)
  assert_close(got, want, dtype=jnp.float32)


@pytest.mark.interpret
@pytest.mark.parametrize("name", ["segments+padding", "causal window"])
def test_a_traced_mask_runs_one_kernel_set_non_causal_ones_as_causal_with_spans(name):
  """Under jit a traced mask's causal question is data, yet the kernels are traced once (not once per branch of a
  cond on it: each converted layer's kernels would compile twice).  Without a window a non-causal structure runs
  as causal with the segments as bidirectional spans (`dense._as_causal`); a window ending at the query is causal
  already.  Forward and every gradient still match the reference on the real tokens, on the Pallas TPU kernels
  and a ring of 2."""
  from conftest import make_mesh

  from flax_ringattn._src.testing.interpret import no_races

  window = {"local_window_size": (3, 0)} if name == "causal window" else {}
  mask = jnp.broadcast_to(_window_mask(), (B, 1, T, T)) if window else _masks()[name][0]
  valid, _ = _inputs()
  ks = jax.random.split(jax.random.key(11), 4)
  q = jax.random.normal(ks[0], (B, T, 2, 8))
  k, v = (jax.random.normal(kk, (B, T, 1, 8)) for kk in ks[1:3])
  do = jax.random.normal(ks[3], (B, T, 2, 8)) * valid[:, :, None, None]  # padding queries' rows carry no loss
  mesh = make_mesh((2,), ("sp",))
  port = lambda q, k, v, mask: fr.dot_product_attention(  # noqa: E731
    q, k, v, mask=mask, mesh=mesh, implementation="pallas_tpu", interpret=True, **window
  )
  ref = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask != 0)  # noqa: E731
  kernels = lambda f: str(jax.make_jaxpr(f)(q, k, v, mask)).count("ring_block_fwd")  # noqa: E731
  causal = lambda q, k, v, mask: fr.dot_product_attention(  # noqa: E731 (is_causal=True: causal is static)
    q, k, v, mask=mask, is_causal=True, mesh=mesh, implementation="pallas_tpu", interpret=True, **window
  )
  assert kernels(port) == kernels(causal), "as many kernels as with causal static, not one set per branch"
  with no_races():
    out, vjp = jax.vjp(lambda q, k, v: jax.jit(port)(q, k, v, mask), q, k, v)
    grads = vjp(do)
  ref_out, ref_vjp = jax.vjp(ref, q, k, v)
  keep = np.asarray(valid)
  assert_close(np.asarray(out)[keep], np.asarray(ref_out)[keep], jnp.float32)
  assert_close(grads, ref_vjp(do), jnp.float32, "grad")


def test_a_traced_two_sided_window_given_as_an_int():
  """local_window_size=w (an int: w keys either side) with a traced band mask: the kernels' causal question stays
  data (a two-sided window is not causal), and the output is jax.nn's."""
  i = jnp.arange(T)
  band = ((i[None, :] >= i[:, None] - 3) & (i[None, :] <= i[:, None] + 3))[None, None]
  q = jax.random.normal(jax.random.key(0), (1, T, 2, 8))
  k, v = (jax.random.normal(key, (1, T, 1, 8)) for key in jax.random.split(jax.random.key(1)))
  port = jax.jit(lambda q, k, v, m: fr.dot_product_attention(q, k, v, mask=m, local_window_size=3))
  assert_close(port(q, k, v, band), jax.nn.dot_product_attention(q, k, v, mask=band), jnp.float32)


def test_a_traced_mask_puts_no_cond_around_the_diagonal_kernels():
  """A decoder's traced causal mask makes the tokens' ids data, so whether the whole (q, kv) block is EMPTY is too.
  Hop 0 of self-attention (the only hop on one device) is its own diagonal: it is computed without a cond around
  its kernels, forward and backward (a cond per layer and pass costs every call).  The result is unchanged."""
  i = jnp.arange(T)
  mask = (i[None, :] <= i[:, None])[None, None]
  ks = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(ks[0], (1, T, 2, 8))
  k, v = (jax.random.normal(kk, (1, T, 1, 8)) for kk in ks[1:])
  port = lambda q, k, v, m: fr.dot_product_attention(q, k, v, mask=m, implementation="xla")  # noqa: E731
  loss = lambda q, k, v, m: port(q, k, v, m).sum()  # noqa: E731
  jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v, mask)

  def conds(eqns):  # every cond, in any sub-jaxpr (custom_vjp, pjit, remat, shard_map bodies alike)
    for e in eqns:
      if e.primitive.name == "cond":
        yield e
      for p in e.params.values():
        for j in p if isinstance(p, (tuple, list)) else (p,):
          inner = j if hasattr(j, "eqns") else getattr(j, "jaxpr", None)  # a Jaxpr or a ClosedJaxpr
          if inner is not None and hasattr(inner, "eqns"):
            yield from conds(inner.eqns)

  # The mask's recovery keeps its cond (plain causal or not); no two-way cond (compute or skip) holds a dot: no
  # block sits behind one.  (The XLA backend's own per-tile conds have three branches: EMPTY, PARTIAL, FULL.)
  two_way = [c for c in conds(jaxpr.jaxpr.eqns) if len(c.params["branches"]) == 2]
  with_dots = [c for c in two_way if "dot_general" in str(c.params["branches"])]
  assert not with_dots, [str(c)[:200] for c in with_dots]
  assert len(list(conds(jaxpr.jaxpr.eqns))) >= 1  # the recovery's
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v, mask)
  want = jax.value_and_grad(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True).sum(), (0, 1, 2))
  assert_close(got, want(q, k, v), jnp.float32)


def test_the_remat_policy_saves_the_recovered_mask_structure():
  """`save_attention_residuals` (and `save_mask_structure`, which saves that alone) also saves what a traced mask's
  recovery found (O(T)), so a rematerialised block's
  backward does not compare the [T, T] mask again (nor keep it for that): the gradient's program compares the
  mask as often as the forward does (a plain remat's, twice as often), and the gradients are the same."""

  def block(q, k, v, mask):
    return fr.dot_product_attention(q, k, v, mask=mask, implementation="xla")

  def loss(policy):
    def f(q, k, v):
      i = jnp.arange(T)
      mask = (i[None, :] <= i[:, None])[None, None]
      return jax.checkpoint(block, policy=policy)(q, k, v, mask).sum()

    return f

  ks = jax.random.split(jax.random.key(5), 3)
  q = jax.random.normal(ks[0], (1, T, 2, 8))
  k, v = (jax.random.normal(kk, (1, T, 1, 8)) for kk in ks[1:])

  def square_compares(eqns):
    n = 0
    for e in eqns:
      # The mask check compares the mask itself (bool); the attention's own [T, T] compares are of int ids.
      bools = all(getattr(x.aval, "dtype", None) == jnp.bool_ for x in e.invars if hasattr(x, "aval"))
      n += e.primitive.name == "eq" and bools and any(getattr(o.aval, "shape", ())[-2:] == (T, T) for o in e.outvars)
      for p in e.params.values():
        for j in p if isinstance(p, (tuple, list)) else (p,):
          inner = j if hasattr(j, "eqns") else getattr(j, "jaxpr", None)
          if inner is not None and hasattr(inner, "eqns"):
            n += square_compares(inner.eqns)
    return n

  policies = (fr.save_attention_residuals, fr.save_mask_structure)
  grad = {p: jax.grad(loss(p), argnums=(0, 1, 2)) for p in (None, *policies)}
  counts = {p: square_compares(jax.make_jaxpr(g)(q, k, v).jaxpr.eqns) for p, g in grad.items()}
  forward = square_compares(jax.make_jaxpr(loss(None))(q, k, v).jaxpr.eqns)
  # A plain remat's backward compares the mask once more, as the forward did; the policies' backward, never.
  assert counts[None] == 2 * forward > 0, (counts, forward)
  for policy in policies:
    assert counts[policy] == forward, (policy.__name__, counts, forward)
    assert_close(jax.jit(grad[policy])(q, k, v), jax.jit(grad[None])(q, k, v), jnp.float32)

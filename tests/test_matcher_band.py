"""Constant masks read at points (`matcher/band.py`) instead of built whole.

The point evaluator `const_at` against `const_value` (the whole array) on small constants; sliding-window bands
found at sizes `const_value` gives up on (B * T * T > 2**24, traced on abstract shapes: nothing that size is
built), with the same answers as at a small size, non-bands refused as before; a large constant bias checked at a
sample; and a decoder that builds its window as google-tunix does, converted and compared at T = 32, then traced
at T = 3072 where its window is still found.
"""

from __future__ import annotations

import handwritten_models as hm
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from flax import nnx
from test_convert_families import _check_matches
from test_handwritten import F32, _batch, _inputs, _key_mask

import flax_ringattn as fr
from flax_ringattn._src import matcher
from flax_ringattn._src.matcher import band as band_reader
from flax_ringattn._src.matcher import site
from flax_ringattn._src.matcher.program import MAX_CONST_ELEMENTS, const_value

SDS = jax.ShapeDtypeStruct
N = 12
BIG_B, BIG_T = 2, 4200  # 35M elements in a [B, T, T] band, 17.6M in a [T, T] one: more than const_value builds
assert BIG_T * BIG_T > MAX_CONST_ELEMENTS


def _program(fn, *args):
  prog = matcher.Program.flatten(jax.make_jaxpr(fn)(*args))
  return prog, prog.producers()


def _ij(n=N):
  return jnp.arange(n)[:, None], jnp.arange(n)[None]


# -- the point evaluator --------------------------------------------------------------------------------------------

CONSTANTS = {
  "triu_positive": lambda: jnp.triu(jnp.ones((N, N), jnp.int32), 3),
  "triu_negative": lambda: jnp.triu(jnp.ones((N, N), bool), -4),
  "tril_positive": lambda: jnp.tril(jnp.ones((N, N), F32), 2),
  "tril_negative": lambda: jnp.tril(jnp.ones((N, N), bool), -1),
  "band_and": lambda: jnp.triu(jnp.ones((N, N), bool), -3) & jnp.tril(jnp.ones((N, N), bool), 5),
  "band_like_a_batched_mask": lambda: (lambda o: jnp.triu(o, -2) * jnp.tril(o, 2))(jnp.ones((3, N, N), jnp.int32)),
  "broadcast": lambda: jnp.broadcast_to(jnp.tril(jnp.ones((N, N), bool))[None, :, None], (2, N, 3, N)),
  "reshape": lambda: jnp.tril(jnp.ones((N, N), jnp.int32), 1).reshape(4, 3, 2, 6),
  "transpose": lambda: jnp.triu(jnp.ones((2, N, N), F32), -1).transpose(2, 0, 1),
  "squeeze_expand_dims": lambda: jnp.squeeze(jnp.expand_dims(jnp.tri(N, N, -2), (0, 2)), 0),
  "bias_from_distance": lambda: jnp.where(jnp.abs(_ij()[0] - _ij()[1]) <= 3, 0.0, -1e9),
  "transcendental": lambda: jnp.exp(-jnp.sqrt(jnp.arange(N * N, dtype=F32).reshape(N, N))) / 3.0,
  "float_to_int": lambda: (jnp.arange(N * N, dtype=F32).reshape(N, N) * -0.7).astype(jnp.int32),
  "closed_over": lambda: jnp.asarray(np.arange(N * N).reshape(N, N) % 5) * jnp.arange(N)[None],
  "select_n_of_three": lambda: jax.lax.select_n(
    jnp.minimum(_ij()[0] + 0 * _ij()[1], 2), jnp.full((N, N), 1.5), jnp.full((N, N), -2.0), jnp.zeros((N, N))
  ),
}


@pytest.mark.parametrize("case", list(CONSTANTS))
def test_const_at_matches_the_whole_constant(case):
  prog, producers = _program(CONSTANTS[case])
  (out,) = prog.outvars
  whole = const_value(prog, out, producers)
  np.testing.assert_array_equal(whole, np.asarray(CONSTANTS[case]()))
  every = np.indices(whole.shape).reshape(whole.ndim, -1).T
  shuffled = np.random.default_rng(1).permutation(np.concatenate([every, every[::7]]))  # any order, repeats
  for points in (every, shuffled):
    got = band_reader.const_at(prog, out, producers, points)
    want = whole[tuple(points.T)]
    assert got is not None and got.dtype == want.dtype, (got, want.dtype)
    if want.dtype.kind == "f":
      np.testing.assert_allclose(got, want, rtol=1e-6)
    else:
      np.testing.assert_array_equal(got, want)


def test_const_at_reads_no_inputs_or_reductions():
  x = SDS((N, N), jnp.int32)
  for fn, args in (
    (lambda x: x + _ij()[0], (x,)),  # an input
    (lambda: jnp.sum(jnp.tril(jnp.ones((N, N))), 0), ()),  # a reduction
    (lambda x: jnp.where(x > 0, jnp.tril(jnp.ones((N, N))), 0.0), (x,)),  # a select on an input
  ):
    prog, producers = _program(fn, *args)
    (out,) = prog.outvars
    points = np.zeros((1, len(out.aval.shape)), np.int64)
    assert band_reader.const_at(prog, out, producers, points) is None
  prog, producers = _program(lambda: jnp.tril(jnp.ones((N, N))))
  with pytest.raises(IndexError):
    band_reader.const_at(prog, prog.outvars[0], producers, np.array([[0, N]]))


# -- windows at any size --------------------------------------------------------------------------------------------


def _band_attention(band):
  """Hand-written attention whose [B, T, T] mask is multiplied by `band(mask)` (a constant built from the mask)."""

  def attend(q, k, v, mask):
    mask = mask * band(mask)
    logits = jnp.where(mask[:, :, None, :], jnp.einsum("btnh,bsnh->btns", q, k), -1e9)
    return jnp.einsum("btns,bsnh->btnh", jax.nn.softmax(logits, -1), v)

  return attend


def _triu_tril(left, right):  # google-tunix's sliding band: triu / tril of ones_like(mask)
  return lambda m: jnp.triu(jnp.ones_like(m), -left) * jnp.tril(jnp.ones_like(m), right)


def _diagonal_hole(m):
  i, j = _ij(m.shape[-1])
  return _triu_tril(4, 4)(m) * (i - j != 2)


def _per_row_bands(m):  # a different band in each batch row: not one window (left out, as at small sizes)
  rows = jnp.arange(m.shape[0])[:, None, None] == 0
  return jnp.where(rows, _triu_tril(3, 3)(m), _triu_tril(5, 5)(m))


def _global_first_key(m):  # a band, and every query sees the first key: not a band
  return jnp.where(_ij(m.shape[-1])[1] == 0, jnp.ones_like(m), _triu_tril(3, 3)(m))


def _checker(m):
  i, j = _ij(m.shape[-1])
  return jnp.broadcast_to(((i * 7 + j * 3) & 3) == 0, m.shape)


BANDS = {  # band(mask) -> the window found, at a small size and at a large one alike
  "symmetric": (_triu_tril(7, 7), (7, 7)),
  "left_only": (lambda m: jnp.triu(jnp.ones_like(m), -5) * jnp.tril(jnp.ones_like(m)), (5, 0)),
  "right_only": (_triu_tril(0, 3), (0, 3)),
  "gpt_oss_two_dims": (
    lambda m: (lambda o: jnp.tril(o) & ~jnp.tril(o, -8))(jnp.ones(m.shape[-2:], bool)),
    (7, 0),
  ),
  "causal_triangle": (lambda m: jnp.tril(jnp.ones_like(m)), None),
  "all_ones": (jnp.ones_like, None),
  "diagonal_hole": (_diagonal_hole, None),
  "per_row_bands": (_per_row_bands, None),
  "global_first_key": (_global_first_key, None),
  "checker": (_checker, None),
}


@pytest.mark.parametrize("mask_dtype", [jnp.bool_, jnp.int32, F32, jnp.bfloat16], ids=["bool", "int", "f32", "bf16"])
@pytest.mark.parametrize("case", list(BANDS))
def test_window_found_at_any_size(case, mask_dtype, monkeypatch):
  band, want = BANDS[case]
  read_at_points = []
  real = site.band_extent
  monkeypatch.setattr(site, "band_extent", lambda *a: read_at_points.append(a) or real(*a))
  for b, t in ((2, 16), (BIG_B, BIG_T)):
    x = SDS((b, t, 1, 8), F32)
    prog, _ = _program(_band_attention(band), x, x, x, SDS((b, t, t), mask_dtype))
    sites, rejected, _ = matcher.find_sites(prog)
    assert len(sites) == 1 and not rejected, (case, t, rejected)
    assert sites[0].window == want, (case, t, sites[0].window)
    assert len(read_at_points) == (t == BIG_T)  # built whole when small, read at points when large


def test_a_large_band_is_what_const_value_gives_up_on():
  prog, producers = _program(_triu_tril(7, 7), SDS((BIG_B, BIG_T, BIG_T), jnp.bool_))
  (band,) = prog.outvars
  assert const_value(prog, band, producers) is None
  assert band_reader.is_large_constant(prog, band, producers)
  # A band 15 tokens wide over 35M elements: read at its edges, along each diagonal and at random points.
  got = band_reader.band_extent(prog, producers, [], [band])
  assert got == (7, 7, BIG_T)


BIASES = {  # a constant added to the logits [B, N, T, S]: a mask (0 / -1e9) or a position bias
  "causal_bias": (lambda i, j: jnp.where(j <= i, 0.0, -1e9), None),
  "alibi": (lambda i, j: -0.5 * jnp.abs(i - j).astype(F32), "a position bias"),
  "near_diagonal_bonus": (lambda i, j: jnp.where(j == i - 1, 0.5, jnp.where(j <= i, 0.0, -1e9)), "a position bias"),
}


@pytest.mark.parametrize("case", list(BIASES))
def test_large_constant_bias_is_checked_at_a_sample(case):
  bias, reason = BIASES[case]

  def attend(q, k, v):
    logits = jnp.einsum("btnh,bsnh->bnts", q, k)
    logits = logits + jnp.broadcast_to(bias(*_ij(q.shape[1])), logits.shape)
    return jnp.einsum("bnts,bsnh->btnh", jax.nn.softmax(logits, -1), v)

  for b, t in ((2, 16), (BIG_B, BIG_T)):
    x = SDS((b, t, 1, 8), F32)
    prog, _ = _program(attend, x, x, x)
    sites, rejected, _ = matcher.find_sites(prog)
    if reason is None:
      assert len(sites) == 1 and not rejected and sites[0].masks[0].kind == "bias", (t, rejected)
    else:
      assert not sites and len(rejected) == 1 and reason in rejected[0].reason, (t, rejected)


# -- a google-tunix style decoder -----------------------------------------------------------------------------------

WINDOW = 8
K_MASK = -2.3819763e38


class _TunixLocalAttention(nnx.Module):
  """Gemma-3 local attention written as google-tunix does: GQA einsums on [B, T, K, G, H], the sliding window a
  `triu * tril` band of `ones_like(attn_mask)` multiplied into the [B, T, S] mask, `where` against K_MASK."""

  def __init__(self, rngs, heads=4, kv_heads=2, head_dim=8):
    self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
    self.q_proj = nnx.Linear(hm.D, heads * head_dim, use_bias=False, rngs=rngs)
    self.kv_proj = nnx.Linear(hm.D, 2 * kv_heads * head_dim, use_bias=False, rngs=rngs)
    self.o_proj = nnx.Linear(heads * head_dim, hm.D, use_bias=False, rngs=rngs)

  def __call__(self, x, positions, attn_mask):
    B, T, _ = x.shape
    N, K, H = self.heads, self.kv_heads, self.head_dim
    q = hm.rope(self.q_proj(x).reshape(B, T, N, H), positions) * H**-0.5
    k, v = jnp.split(self.kv_proj(x).reshape(B, T, 2 * K, H), 2, axis=2)
    k = hm.rope(k, positions)
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q.reshape(B, T, K, N // K, H), k).reshape(B, T, N, T)
    all_ones = jnp.ones_like(attn_mask)
    sliding_mask = jnp.triu(all_ones, -1 * WINDOW + 1) * jnp.tril(all_ones, WINDOW - 1)
    attn_mask = sliding_mask * attn_mask
    logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
    probs = jax.nn.softmax(logits, axis=-1).astype(k.dtype)
    enc = jnp.einsum("BTKGS,BSKH->BTKGH", probs.reshape(B, T, K, N // K, T), v)
    return self.o_proj(enc.reshape(B, T, N * H))


def _decoder():
  return hm.Decoder(_TunixLocalAttention, layers=1, rngs=nnx.Rngs(0))


def test_tunix_style_window_converts_and_is_found_at_large_sizes():
  tokens, pos, mask, _, valid = _inputs("mask")
  sees = np.asarray(_key_mask(*_batch()[2:], window=WINDOW)).any(-1)
  ref, model = _decoder(), _decoder()
  mesh = make_mesh((8,), ("sp",))
  report = fr.convert(model, mesh=mesh, example=lambda m: m(tokens, pos, mask))
  assert [s.path for s in report.converted] == ["blocks.0.attn"] and not report.left_alone, str(report)
  assert report.converted[0].details["window"] == (WINDOW - 1, WINDOW - 1), str(report)
  _check_matches(model, ref, sees, (tokens, pos, mask, valid))
  # The same model traced (example= runs abstractly: nothing is built) at B = 2, T = 3072: a band of 18.9M elements.
  b, t = 2, 3072
  assert b * t * t > MAX_CONST_ELEMENTS
  ids = lambda: jnp.zeros((b, t), jnp.int32)  # noqa: E731
  big = fr.convert(_decoder(), mesh=mesh, example=lambda m: m(ids(), ids(), jnp.ones((b, t, t), bool)))
  assert [s.details["window"] for s in big.converted] == [(WINDOW - 1, WINDOW - 1)], str(big)
  assert big.converted[0].details["seq_len"] == t


@pytest.mark.parametrize("band", ["strictly_earlier", "two_ahead"])
def test_a_band_without_the_diagonal_is_left_alone_with_the_reason(band):
  """`tril(ones, -1)` (strictly earlier keys) or `triu(ones, 2)`: no window of non-negative sides; the site is left
  alone at trace time, at any size, instead of failing at the first call."""
  make = {
    "strictly_earlier": lambda m: jnp.tril(jnp.ones_like(m), -1),
    "two_ahead": lambda m: jnp.triu(jnp.ones_like(m), 2),
  }
  for b, t in ((2, 16), (BIG_B, BIG_T)):
    x = SDS((b, t, 1, 8), F32)
    prog, _ = _program(_band_attention(make[band]), x, x, x, SDS((b, t, t), jnp.bool_))
    sites, rejected, _ = matcher.find_sites(prog)
    assert not sites and len(rejected) == 1, (band, t)
    assert "a constant band without the diagonal" in rejected[0].reason, rejected[0].reason

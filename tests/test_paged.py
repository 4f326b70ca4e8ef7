"""`paged_attention` against `paged_reference_attention` on random ragged batches.

Batches, batch mixes, the jitted entry points and the feature cases come from
tests/paged_cases.py (built on the registry of tests/cases.py): random q_lens /
kv_lens per sequence, pages drawn from a shuffled pool, padding rows, often
fewer live sequences than max_num_seqs.
"""

from __future__ import annotations

import functools
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import kv_heads, pick
from conftest import make_mesh
from flax import nnx
from jax.experimental import checkify
from jax.sharding import NamedSharding, PartitionSpec
from paged_cases import (
  BF16,
  CAP,
  F32,
  FEATURE_KEYWORDS,
  PS,
  SCENARIOS,
  SMALL,
  WINDOW_CAP,
  Batch,
  K,
  N,
  P,
  S,
  case_batch,
  features,
  make_batch,
  numpy_oracle,
  op_fn,
  op_vjp,
  poison,
  random_seq,
  ref_fn,
  ref_vjp,
  scenario,
)
from paged_oracle import paged_oracle
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import validation


def _check_fwd(b: Batch, dtype=F32, **kw):
  out = op_fn(*b.args, **b.scales, **kw)
  expected = ref_fn(*b.args, **b.scales, **{k: v for k, v in kw.items() if k in FEATURE_KEYWORDS})
  assert out.shape == b.q.shape and out.dtype == b.q.dtype
  assert_close(out, expected, dtype)
  # Padding rows (past cu_q_lens[num_seqs]) are exactly 0.
  np.testing.assert_array_equal(np.asarray(out[b.total :], F32), 0.0)
  return out


# -- forward --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", SCENARIOS)
def test_forward_matches_reference(name, seed):
  rng = np.random.default_rng([seed, SCENARIOS.index(name)])
  _check_fwd(make_batch(rng, scenario(name, rng)))


def test_shared_prefix_pages():
  """Two sequences reading the same pages (prefix sharing) are independent reads."""
  rng = np.random.default_rng(7)
  b = make_batch(rng, [(2, 21), (1, 17), (3, 9)], share_prefix=True)
  assert int(b.page_indices[0, 0]) == int(b.page_indices[1, 0])
  _check_fwd(b)


def test_reference_matches_numpy_oracle():
  rng = np.random.default_rng(11)
  b = make_batch(rng, scenario("mixed", rng))
  for kw in ({}, features(WINDOW_CAP)):
    np.testing.assert_allclose(np.asarray(ref_fn(*b.args, **kw)), numpy_oracle(b, **kw), atol=1e-5, rtol=1e-5)


def test_bfloat16():
  rng = np.random.default_rng(3)
  _check_fwd(make_batch(rng, scenario("mixed", rng), dtype=BF16), BF16)


def test_default_block_sizes():
  rng = np.random.default_rng(4)
  b = make_batch(rng, scenario("mixed", rng))
  out = _check_fwd(b, block_sizes=None)
  # Same numbers as the small blocks (a different loop nest over the same data).
  assert_close(out, op_fn(*b.args), F32)


def test_block_kv_smaller_than_page():
  rng = np.random.default_rng(5)
  _check_fwd(make_batch(rng, scenario("chunked", rng)), block_sizes=fr.BlockSizes(block_q=3, block_kv=2))


@pytest.mark.parametrize("layout", ["mqa", "mha"], ids=["mqa_8to1", "mha_8to8"])
def test_kv_head_groups(layout):
  num_kv_heads = kv_heads(layout, N)  # the registry's head layouts at N = 8 q heads (GQA 8:2 runs everywhere)
  rng = np.random.default_rng(num_kv_heads)
  _check_fwd(make_batch(rng, scenario("mixed", rng), num_kv_heads=num_kv_heads))


# A window of w tokens (the token and the w - 1 before it), i.e. local_window_size=(w - 1, 0); ids are w.
@pytest.mark.parametrize("window", [(0, 0), (4, 0)], ids=["1", "5"])
def test_sliding_window(window):
  rng = np.random.default_rng(window[0] + 1)
  for name in ("mixed", "edge"):
    _check_fwd(make_batch(rng, scenario(name, rng)), local_window_size=window)


def test_logits_soft_cap():
  rng = np.random.default_rng(8)
  b = make_batch(rng, scenario("mixed", rng))
  _check_fwd(b, **features(pick("soft_cap")[0]))  # cap 2 at scale 1: large logits, the cap matters
  _check_fwd(b, logits_soft_cap=5.0, local_window_size=(5, 0))


# -- the window's deprecated spelling ---------------------------------------------------------------------------

_ALIAS_KEY = ("paged", "sliding_window")  # validation.warn_once's key: the warning is once per process
_ALIAS_MESSAGE = r"sliding_window=5 is deprecated: pass local_window_size=\(4, 0\)"


def _alias_warnings(record):
  return [w for w in record if issubclass(w.category, DeprecationWarning) and "sliding_window=" in str(w.message)]


def test_sliding_window_alias_warns_once_and_equals_local_window_size():
  """The deprecated `sliding_window=w` is exactly local_window_size=(w - 1, 0): one DeprecationWarning per process
  (its key is discarded first: another test may have spent it), and bit-identical results from `paged_attention`,
  `paged_reference_attention` and `PagedMultiHeadAttention`."""
  w = 5
  rng = np.random.default_rng(14)
  b = make_batch(rng, scenario("mixed", rng))
  ops = {
    "paged_attention": functools.partial(fr.paged_attention, block_sizes=SMALL, implementation="xla"),
    "paged_reference_attention": fr.paged_reference_attention,
  }
  for name, op in ops.items():
    validation._warned.discard(_ALIAS_KEY)
    with pytest.warns(DeprecationWarning, match=_ALIAS_MESSAGE) as record:
      alias = jax.jit(functools.partial(op, sliding_window=w))(*b.args)
      jax.eval_shape(functools.partial(op, sliding_window=w), *b.args)  # traced anew: no second warning
    assert len(_alias_warnings(record)) == 1, (name, [str(r.message) for r in record])
    window = jax.jit(functools.partial(op, local_window_size=(w - 1, 0)))(*b.args)
    np.testing.assert_array_equal(np.asarray(alias), np.asarray(window), err_msg=name)

  kw = dict(num_kv_heads=2, implementation="xla", block_sizes=SMALL)
  validation._warned.discard(_ALIAS_KEY)
  with pytest.warns(DeprecationWarning, match=_ALIAS_MESSAGE) as record:
    alias = fr.PagedMultiHeadAttention(8, 16, 64, sliding_window=w, rngs=nnx.Rngs(0), **kw)
  assert len(_alias_warnings(record)) == 1
  window = fr.PagedMultiHeadAttention(8, 16, 64, local_window_size=(w - 1, 0), rngs=nnx.Rngs(0), **kw)
  assert alias.local_window_size == window.local_window_size == (w - 1, 0)
  step = nnx.jit(lambda layer, x, cu, n: layer(x, cu_q_lens=cu, num_seqs=n))
  x = jnp.asarray(rng.normal(size=(16, 16)), F32)
  cu, n = jnp.asarray([0, 9, 12, 12, 12], jnp.int32), jnp.asarray([2], jnp.int32)  # prefills of 9 and 3 tokens
  ys = []
  for layer in (alias, window):
    layer.init_cache(num_pages=24, page_size=4, max_num_seqs=4, pages_per_seq=4)
    ys.append(np.asarray(step(layer, x, cu, n)))
  np.testing.assert_array_equal(ys[0], ys[1])


def test_local_window_size_and_sliding_window_together_raise():
  """Both spellings at once are an error (before any deprecation warning), in the op, the reference and the layer."""
  both = dict(local_window_size=(4, 0), sliding_window=5)
  match = r"pass local_window_size=\(4, 0\) or the deprecated sliding_window=5, not both"
  for op in (fr.paged_attention, fr.paged_reference_attention):
    with warnings.catch_warnings():
      warnings.simplefilter("error", DeprecationWarning)
      with pytest.raises(ValueError, match=match):
        _call(op, **both)
  with pytest.raises(ValueError, match=match):
    fr.PagedMultiHeadAttention(8, 16, 64, num_kv_heads=2, rngs=nnx.Rngs(0), **both)


SCALE_SHAPES = {"scalar": (), "page": (P, K), "token": (P, PS, K)}


# Each scale shape appears for k and for v; a k/v pair may mix shapes.
@pytest.mark.parametrize(
  "page_dtype, scales",
  [
    ("int8", ("scalar", "page")),
    ("int8", ("page", "token")),
    ("int8", ("token", "scalar")),
    ("float8_e4m3fn", ("scalar", "token")),
    ("float8_e4m3fn", ("token", "page")),
    ("float8_e4m3fn", ("page", "scalar")),
  ],
)
def test_quantized_pages(page_dtype, scales):
  rng = np.random.default_rng([9, len(scales[0]), len(scales[1])])
  b = make_batch(rng, scenario("mixed", rng), page_dtype=jnp.dtype(page_dtype), scale_shape=scales)
  assert b.k_pages.dtype == jnp.dtype(page_dtype)
  assert (b.k_scale.shape, b.v_scale.shape) == (SCALE_SHAPES[scales[0]], SCALE_SHAPES[scales[1]])
  _check_fwd(b)


def _junk_tail(b: Batch):
  """The batch with cu_q_lens entries past num_seqs overwritten by smaller (junk) values."""
  cu = np.asarray(b.cu_q_lens).copy()
  n = len(b.seqs)
  cu[n + 1 :] = np.arange(len(cu) - n - 1)[::-1] % 3
  return b.replace(cu_q_lens=jnp.asarray(cu, jnp.int32))


def test_cu_q_lens_past_num_seqs_are_ignored():
  """Only the first num_seqs + 1 entries of cu_q_lens matter (checked mode validates only those)."""
  rng = np.random.default_rng(12)
  b = make_batch(rng, [(3, 9), (2, 2), (4, 13)])
  junk = _junk_tail(b)
  assert not (np.diff(np.asarray(junk.cu_q_lens)) >= 0).all()
  np.testing.assert_array_equal(np.asarray(op_fn(*junk.args)), np.asarray(op_fn(*b.args)))
  assert _checked(*junk.args)[0].get() is None


def test_reference_ignores_cu_q_lens_past_num_seqs():
  rng = np.random.default_rng(12)
  b = make_batch(rng, [(3, 9), (2, 2), (4, 13)])
  assert_close(ref_fn(*_junk_tail(b).args), ref_fn(*b.args), F32)


def test_replicated_inputs_on_explicit_mesh():
  rng = np.random.default_rng(13)
  b = make_batch(rng, [(3, 9), (1, 5)])
  rep = NamedSharding(make_mesh((2,), ("sp",)), PartitionSpec())
  placed = b.replace(
    q=jax.device_put(b.q, rep), k_pages=jax.device_put(b.k_pages, rep), v_pages=jax.device_put(b.v_pages, rep)
  )
  assert_close(ref_fn(*placed.args), ref_fn(*b.args), F32)
  assert_close(op_fn(*placed.args), ref_fn(*b.args), F32)


# -- gradients ------------------------------------------------------------------------


def _check_grads(b: Batch, dtype=F32, **kw):
  rng = np.random.default_rng(100)
  do = jnp.asarray(rng.normal(size=b.q.shape), dtype)
  out, grads = op_vjp(b.args, do, **b.scales, **kw)
  ref_out, ref_grads = ref_vjp(b.args, do, **b.scales, **{k: v for k, v in kw.items() if k in FEATURE_KEYWORDS})
  assert_close(out, ref_out, dtype)
  for g, x in zip(grads, b.args[:3], strict=True):
    assert g.shape == x.shape and g.dtype == x.dtype
  assert_close(grads, ref_grads, dtype, "grad")
  np.testing.assert_array_equal(np.asarray(grads[0][b.total :], F32), 0.0)  # padding rows get no gradient
  return out, grads


@pytest.mark.parametrize("name", ["mixed", "edge", "prefill"])
def test_grads_match_reference(name):
  rng = np.random.default_rng([21, SCENARIOS.index(name)])
  _check_grads(make_batch(rng, scenario(name, rng)))


def test_grads_shared_pages_accumulate():
  rng = np.random.default_rng(22)
  _check_grads(make_batch(rng, [(3, 13), (2, 19), (1, 6)], share_prefix=True))


def test_grads_window_soft_cap_gqa():
  rng = np.random.default_rng(23)
  _check_grads(make_batch(rng, scenario("mixed", rng)), local_window_size=(5, 0), logits_soft_cap=3.0, scale=0.5)


def test_grads_mqa():
  rng = np.random.default_rng(24)
  _check_grads(make_batch(rng, scenario("chunked", rng), num_kv_heads=1))


def test_grads_bfloat16():
  rng = np.random.default_rng(25)
  _check_grads(make_batch(rng, scenario("mixed", rng), dtype=BF16), BF16)


def test_grads_scaled_float_pages():
  """Float pages with k_scale [P, K] / v_scale [P, page_size, K]: gradients with respect to the stored values."""
  rng = np.random.default_rng(26)
  _check_grads(make_batch(rng, scenario("mixed", rng), scale_shape=("page", "token")))


# -- isolation ------------------------------------------------------------------------


@pytest.mark.parametrize("name, case", [("mixed", None), ("edge", None), ("edge", "mla_sinks")])
def test_isolation_from_unread_pages(name, case):
  """NaN / huge values in the slots no live sequence reads change no output or gradient (dsinks included, with
  sinks and v pages at Hv != H: `mla_sinks`)."""
  rng = np.random.default_rng([31, SCENARIOS.index(name)])
  b = make_batch(rng, scenario(name, rng)) if case is None else case_batch(pick(case)[0], rng, scenario(name, rng))
  kw = {} if case is None else features(pick(case)[0])
  assert (~b.read_mask()).any()
  do = jnp.asarray(rng.normal(size=b.out_shape), F32)
  out, grads = op_vjp(b.args, do, sinks=b.sinks, **kw)
  read = b.read_mask()[:, :, None, None]
  for value in (np.nan, 1e30, -1e30):
    bad = poison(b, value)
    out_bad, grads_bad = op_vjp(bad.args, do, sinks=b.sinks, **kw)
    np.testing.assert_array_equal(np.asarray(out_bad), np.asarray(out))
    for g_bad, g in zip(grads_bad, grads, strict=True):  # dq, dk, dv (and dsinks)
      np.testing.assert_array_equal(np.asarray(g_bad), np.asarray(g))
    assert np.isfinite(np.asarray(out_bad)).all() and np.isfinite(np.asarray(grads_bad[0])).all()
    # Unread slots receive no gradient.
    dk_bad, dv_bad = grads_bad[1:3]
    assert not np.asarray(jnp.where(read, 0.0, jnp.abs(dk_bad))).any()
    assert not np.asarray(jnp.where(read, 0.0, jnp.abs(dv_bad))).any()
    # The reference is just as isolated.
    ref_bad, ref_good = (ref_fn(*x.args, sinks=b.sinks, **kw) for x in (bad, b))
    np.testing.assert_array_equal(np.asarray(ref_bad), np.asarray(ref_good))


def test_isolation_quantized_scales():
  """NaN in the pages and scales of unread slots of an int8 cache does not leak."""
  rng = np.random.default_rng(32)
  b = make_batch(rng, scenario("mixed", rng), page_dtype=jnp.int8, scale_shape="token")
  out = op_fn(*b.args, **b.scales)
  unread = ~b.read_mask()[:, :, None]
  poisoned = b.replace(
    k_pages=jnp.where(unread[..., None], jnp.int8(-128), b.k_pages),
    k_scale=jnp.where(unread, jnp.nan, b.k_scale),
    v_scale=jnp.where(unread, jnp.inf, b.v_scale),
  )
  np.testing.assert_array_equal(np.asarray(op_fn(*poisoned.args, **poisoned.scales)), np.asarray(out))


def test_sinks_rows_without_keys_and_padding_get_zero():
  """With sinks, a row that sees no key (an empty page table, q_len 0 neighbours, padding rows) has the finite lse'
  = s_h: its output and dq are exactly 0, and it adds nothing to dsinks (its rowsum(dO * O) is 0)."""
  (c,) = pick("mla_sinks")
  rng = np.random.default_rng(34)
  b = case_batch(c, rng, [(1, 17), (2, 2), (0, 5), (3, 9)])
  table = np.asarray(b.page_indices).copy()
  table[1, :] = -1  # sequence 1 (rows 1, 2) sees nothing
  b = poison(b.replace(page_indices=jnp.asarray(table, jnp.int32)), np.nan)
  do = jnp.asarray(rng.normal(size=b.out_shape), F32)
  out, (dq, dk, dv, dsinks) = op_vjp(b.args, do, sinks=b.sinks, **features(c))
  empty = np.r_[1:3, b.total : b.q.shape[0]]
  np.testing.assert_array_equal(np.asarray(out)[empty], 0.0)
  np.testing.assert_array_equal(np.asarray(dq)[empty], 0.0)
  # Zeroing dO on those rows changes no gradient: they contribute nothing, dsinks included.
  do_live = do.at[empty].set(0.0)
  _, grads_live = op_vjp(b.args, do_live, sinks=b.sinks, **features(c))
  assert_close(grads_live, (dq, dk, dv, dsinks), F32, "grad")
  for g in (dq, dk, dv, dsinks):
    assert np.isfinite(np.asarray(g)).all()
  # Against the float64 oracle.
  _, oracle_grads = paged_oracle(*b.args, **b.operands, do=do, **features(c))
  assert_close((dq, dk, dv, dsinks), oracle_grads, F32, "grad")


def _dead_slot_batch():
  """Two live sequences; the dead last slot (padding rows map to it) owns 6 pages nobody reads, NaN-poisoned."""
  b = make_batch(np.random.default_rng(35), [(1, 17), (2, 2)], exclude_pages=range(6))
  table = np.asarray(b.page_indices).copy()
  table[S - 1] = np.arange(6)
  b = b.replace(page_indices=jnp.asarray(table, jnp.int32), kv_lens=b.kv_lens.at[S - 1].set(CAP))
  bad = poison(b, np.nan)
  assert np.isnan(np.asarray(bad.v_pages[:6])).all()
  return b, bad


def test_op_padding_rows_ignore_dead_slots():
  b, bad = _dead_slot_batch()
  out = op_fn(*bad.args)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(op_fn(*b.args)))
  np.testing.assert_array_equal(np.asarray(out[b.total :]), 0.0)


def test_reference_padding_rows_ignore_dead_slots():
  """Padding rows map to the last slot; when it is dead (num_seqs < max_num_seqs) its page table and kv_lens are
  garbage, and NaN in those pages must not reach the padding rows' zero output."""
  b, bad = _dead_slot_batch()
  np.testing.assert_array_equal(np.asarray(ref_fn(*bad.args)), np.asarray(ref_fn(*b.args)))


@pytest.mark.parametrize("bad_id", [-1, P, P + 7, -P])
def test_out_of_range_page_ids_are_masked(bad_id):
  """Without checks, an invalid page id in a used slot acts as an empty (masked) page."""
  rng = np.random.default_rng(33)
  # Pages 0 and P - 1 (where a clipped id would land) belong to nobody and hold NaN.
  b = make_batch(rng, [(1, 17), (3, 11), (2, 2), (4, 9), (1, 5)], exclude_pages=(0, P - 1))
  table = np.asarray(b.page_indices).copy()
  table[0, 2] = bad_id  # the middle page of a decode
  table[1, 0] = bad_id  # the first page of a chunked prefill
  table[2, 0] = bad_id  # every page of a sequence: its rows see nothing and return 0
  b = poison(b.replace(page_indices=jnp.asarray(table, jnp.int32)), np.nan)
  do = jnp.asarray(rng.normal(size=b.q.shape), F32)
  out, (dq, dk, dv) = op_vjp(b.args, do)
  np.testing.assert_allclose(np.asarray(out), numpy_oracle(b), atol=1e-5, rtol=1e-5)
  assert_close(out, ref_fn(*b.args), F32)
  cu = np.asarray(b.cu_q_lens)
  np.testing.assert_array_equal(np.asarray(out[cu[2] : cu[3]]), 0.0)
  for g in (dq, dk, dv):
    assert np.isfinite(np.asarray(g)).all()
  _, ref_grads = ref_vjp(b.args, do)
  assert_close((dq, dk, dv), ref_grads, F32, "grad")


# -- compilation ----------------------------------------------------------------------


def test_compiles_once_over_changing_batches():
  """200 steps of changing batch mix, page tables and int8 scale values: one trace, one compile."""
  traces = []

  @jax.jit
  def step(q, kp, vp, kv_lens, pi, cu, ns, k_scale, v_scale):
    traces.append(1)
    return fr.paged_attention(q, kp, vp, kv_lens, pi, cu, ns, k_scale=k_scale, v_scale=v_scale, block_sizes=SMALL)

  rng = np.random.default_rng(41)
  base = make_batch(rng, [(1, 3)], page_dtype=jnp.int8, scale_shape="page")
  kinds = ["decode", "prefill", "chunked"]
  for i in range(200):
    n = int(rng.integers(0, S + 1))
    seqs = [random_seq(rng, k) for k in rng.choice(kinds, size=n)]
    b = make_batch(rng, seqs)  # new q, kv_lens, page table, cu_q_lens, num_seqs
    k_scale = jnp.asarray(rng.uniform(0.001, 0.1, size=(P, K)), F32)
    args = (b.q, base.k_pages, base.v_pages, *b.args[3:], k_scale, k_scale * 2)
    out = step(*args)
    if i % 40 == 0:
      assert_close(out, ref_fn(*args), F32)
  assert len(traces) == 1
  assert step._cache_size() == 1


# -- checked mode ---------------------------------------------------------------------


@jax.jit
def _checked(q, kp, vp, kv_lens, pi, cu, ns):
  f = functools.partial(fr.paged_attention, checked=True, block_sizes=SMALL)
  return checkify.checkify(f, errors=checkify.user_checks)(q, kp, vp, kv_lens, pi, cu, ns)


def _good_checked_batch():
  rng = np.random.default_rng(51)
  return make_batch(rng, [(3, 3), (1, 9), (2, 12), (0, 4)])


def _with(b: Batch, name, index, value):
  x = np.asarray(getattr(b, name)).copy()
  x[index] = value
  return b.replace(**{name: jnp.asarray(x, jnp.int32)})


# Each message names the operand, the slot or position, and the bad value.
CHECKED_PROBLEMS = {
  "page_id_negative": (
    lambda b: _with(b, "page_indices", (1, 2), -1),
    "page_indices[1, 2]=-1 is out of range [0, 40) (k_pages.shape[0]); slot 1 uses its first 3 pages "
    "(kv_lens[1]=9, page_size=4)",
  ),
  "page_id_too_large": (lambda b: _with(b, "page_indices", (2, 0), P), "page_indices[2, 0]=40 is out of range [0, 40)"),
  "kv_lens_past_pages": (
    lambda b: _with(b, "kv_lens", 3, CAP + 1),
    "kv_lens[3]=25 exceeds the slot's pages: pages_per_seq * page_size = 6 * 4 = 24",
  ),
  "kv_lens_negative": (lambda b: _with(b, "kv_lens", 3, -1), "kv_lens[3]=-1 must be >= 0"),
  "decreasing_cu_q_lens": (
    lambda b: _with(b, "cu_q_lens", 2, 2),
    "cu_q_lens must be non-decreasing over its first num_seqs + 1 entries: cu_q_lens[1]=3 > cu_q_lens[2]=2",
  ),
  "cu_q_lens_not_from_zero": (lambda b: _with(b, "cu_q_lens", 0, 1), "cu_q_lens[0]=1 must be 0"),
  "too_many_tokens": (  # 43 new tokens (each within its kv_lens) for T = 32 rows
    lambda b: b.replace(
      kv_lens=jnp.asarray([10, 9, 12, 24, 0, 0], jnp.int32),
      cu_q_lens=jnp.asarray([0, 10, 11, 23, 43, 43, 43], jnp.int32),
    ),
    "the batch has 43 new tokens (cu_q_lens[num_seqs=4]), more than max_num_batched_tokens=32 (q.shape[0])",
  ),
  "q_len_over_kv_len": (
    lambda b: _with(b, "kv_lens", 0, 2),
    "slot 0 has 3 new tokens (cu_q_lens[1] - cu_q_lens[0]) but kv_lens[0]=2: kv_lens must count the new tokens",
  ),
  "num_seqs_too_large": (lambda b: _with(b, "num_seqs", 0, S + 1), "num_seqs=7 must be in [0, max_num_seqs=6]"),
}


def test_checked_good_batch_has_no_error():
  b = _good_checked_batch()
  err, out = _checked(*b.args)
  assert err.get() is None
  assert_close(out, ref_fn(*b.args), F32)
  # Unused page-table entries and dead slots may hold anything.
  table = np.asarray(b.page_indices).copy()
  table[0, 1:] = -5
  table[4:] = P + 100
  err, _ = _checked(*b.replace(page_indices=jnp.asarray(table, jnp.int32)).args)
  assert err.get() is None


@pytest.mark.parametrize("problem", list(CHECKED_PROBLEMS))
def test_checked_reports_dynamic_problems(problem):
  corrupt, message = CHECKED_PROBLEMS[problem]
  err, _ = _checked(*corrupt(_good_checked_batch()).args)
  assert err.get() is not None and message in err.get(), err.get()


@pytest.mark.parametrize("problem", list(CHECKED_PROBLEMS))
def test_concrete_metadata_is_validated_eagerly(problem):
  """On concrete arrays the same checks raise at once, without checked=True."""
  corrupt, message = CHECKED_PROBLEMS[problem]
  b = corrupt(_good_checked_batch())
  with pytest.raises(ValueError, match=re.escape("paged_attention: " + message)):
    fr.paged_attention(*b.args, block_sizes=SMALL)


def test_concrete_good_batch_runs_eagerly():
  b = _good_checked_batch()
  assert_close(fr.paged_attention(*b.args, block_sizes=SMALL), ref_fn(*b.args), F32)


def test_checked_requires_checkify():
  b = _good_checked_batch()
  with pytest.raises(ValueError, match="checkify"):
    jax.jit(lambda *a: fr.paged_attention(*a, checked=True))(*b.args)


# -- static errors --------------------------------------------------------------------


def _static_args(page_dtype=F32):
  """Small valid arguments as a dict (shapes only matter)."""
  return dict(
    q=jnp.zeros((8, 4, 8), F32),
    k_pages=jnp.zeros((6, 4, 2, 8), page_dtype),
    v_pages=jnp.zeros((6, 4, 2, 8), page_dtype),
    kv_lens=jnp.zeros((3,), jnp.int32),
    page_indices=jnp.zeros((3, 2), jnp.int32),
    cu_q_lens=jnp.zeros((4,), jnp.int32),
    num_seqs=jnp.zeros((1,), jnp.int32),
  )


_POSITIONAL = ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs")


def _call(op, page_dtype=F32, **changes):
  a = _static_args(page_dtype)
  kw = {k: v for k, v in changes.items() if k not in _POSITIONAL}
  a.update({k: v for k, v in changes.items() if k in _POSITIONAL})
  return op(*(a[k] for k in _POSITIONAL), **kw)


STATIC_ERRORS = {
  # paged_common.py: check_paged_inputs
  "q_not_array": (dict(q=np.zeros((8, 4, 8)).tolist()), TypeError, "q must be an array"),
  "pages_not_array": (dict(k_pages=1.0), TypeError, "k_pages must be an array"),
  "q_rank": (dict(q=jnp.zeros((1, 8, 4, 8))), ValueError, r"q must be \[max_num_batched_tokens, N, H\] \(rank 3\)"),
  "q_int": (dict(q=jnp.zeros((8, 4, 8), jnp.int32)), TypeError, "q must be floating point"),
  "pages_rank": (dict(k_pages=jnp.zeros((6, 4, 2, 8, 1))), ValueError, r"k_pages must be \[P, page_size, K, H\]"),
  "merged_rank_mismatch": (
    dict(k_pages=jnp.zeros((6, 4, 16))),
    ValueError,
    r"k_pages and v_pages must have the same \[P, page_size, K\] and rank",
  ),
  "merged_not_whole_heads": (
    dict(k_pages=jnp.zeros((6, 4, 12)), v_pages=jnp.zeros((6, 4, 12))),
    ValueError,
    r"merged k_pages \[P, page_size, K \* H\] must have a last dim that is a positive multiple of q's head dim",
  ),
  "v_pages_rank": (dict(v_pages=jnp.zeros((6, 4, 2, 8, 1))), ValueError, r"v_pages must be \[P, page_size, K, H\]"),
  "kv_pages_not_two": (
    dict(k_pages=jnp.zeros((6, 4, 2, 8)), v_pages=None),
    ValueError,
    r"with v_pages=None, k_pages must be kv pages \[P, 2, page_size, K \* H\] .* got k_pages.shape=\(6, 4, 2, 8\)",
  ),
  "kv_pages_not_whole_heads": (
    dict(k_pages=jnp.zeros((6, 2, 4, 12)), v_pages=None),
    ValueError,
    r"kv pages k_pages \[P, 2, page_size, K \* H\] must have a last dim that is a positive multiple of q's head dim",
  ),
  "kv_shape_mismatch": (
    dict(v_pages=jnp.zeros((7, 4, 2, 8))),
    ValueError,
    r"k_pages and v_pages must have the same \[P, page_size, K\]",
  ),
  "kv_dtype_mismatch": (dict(v_pages=jnp.zeros((6, 4, 2, 8), BF16)), TypeError, "must share a dtype"),
  "head_dim": (
    dict(k_pages=jnp.zeros((6, 4, 2, 4)), v_pages=jnp.zeros((6, 4, 2, 4))),
    ValueError,
    "head_dim differs",
  ),
  "heads_not_multiple": (
    dict(k_pages=jnp.zeros((6, 4, 3, 8)), v_pages=jnp.zeros((6, 4, 3, 8))),
    ValueError,
    "must be a multiple of the number of kv heads",
  ),
  "zero_kv_heads": (
    dict(k_pages=jnp.zeros((6, 4, 0, 8)), v_pages=jnp.zeros((6, 4, 0, 8))),
    ValueError,
    "multiple of the number of kv heads K=0",
  ),
  "int_pages": (
    dict(k_pages=jnp.zeros((6, 4, 2, 8), jnp.int32), v_pages=jnp.zeros((6, 4, 2, 8), jnp.int32)),
    TypeError,
    "k_pages/v_pages must be floating point or one of",
  ),
  "kv_lens_list": (dict(kv_lens=[0, 0, 0]), TypeError, "kv_lens must be an int32 array"),
  "kv_lens_float": (dict(kv_lens=jnp.zeros((3,), F32)), TypeError, "kv_lens must be an integer array"),
  "num_seqs_float": (dict(num_seqs=jnp.zeros((1,), F32)), TypeError, "num_seqs must be an integer array"),
  "page_indices_rank": (
    dict(page_indices=jnp.zeros((6,), jnp.int32)),
    ValueError,
    r"page_indices must be \[max_num_seqs, pages_per_seq\]",
  ),
  "kv_lens_shape": (dict(kv_lens=jnp.zeros((4,), jnp.int32)), ValueError, r"kv_lens must be \[max_num_seqs\]=\(3,\)"),
  "cu_q_lens_shape": (
    dict(cu_q_lens=jnp.zeros((3,), jnp.int32)),
    ValueError,
    r"cu_q_lens must be \[max_num_seqs \+ 1\]=\(4,\)",
  ),
  "num_seqs_scalar": (dict(num_seqs=jnp.zeros((), jnp.int32)), ValueError, r"num_seqs must have shape \(1,\)"),
  "scale_str": (dict(k_scale="0.5"), TypeError, "k_scale must be a Python float or a floating-point array"),
  "scale_int_array": (dict(v_scale=jnp.ones((), jnp.int32)), TypeError, "v_scale must be a Python float or a"),
  "scale_shape": (dict(k_scale=jnp.ones((6,), F32)), ValueError, r"k_scale must have shape \(\) \(one scale\)"),
  "scale_shape_heads": (dict(v_scale=jnp.ones((6, 3), F32)), ValueError, r"\[P, K\]=\(6, 2\)"),
  "scale_shape_tokens": (dict(k_scale=jnp.ones((6, 2, 2), F32)), ValueError, r"\[P, page_size, K\]=\(6, 4, 2\)"),
  # validation.py: normalize_window (local_window_size, as in jax.nn and ring_attention)
  "local_window_float": (
    dict(local_window_size=2.5),
    TypeError,
    r"local_window_size must be an int or a \(left, right\) pair",
  ),
  "local_window_triple": (
    dict(local_window_size=(4, 0, 1)),
    TypeError,
    r"local_window_size must be an int or a \(left, right\) pair",
  ),
  "local_window_bool": (dict(local_window_size=True), TypeError, r"local_window_size must be an int or a \(left, "),
  "local_window_negative": (dict(local_window_size=(-1, 0)), ValueError, "local_window_size must be non-negative"),
  "local_window_negative_int": (dict(local_window_size=-3), ValueError, "local_window_size must be non-negative"),
  # paged/common.py: the deprecated alias sliding_window (check_sliding_window); both spellings at once: below
  "window_float": (dict(sliding_window=2.5), TypeError, "sliding_window must be an int or None"),
  "window_bool": (dict(sliding_window=True), TypeError, "sliding_window must be an int or None"),
  "window_zero": (dict(sliding_window=0), ValueError, "sliding_window must be >= 1"),
  "window_negative": (dict(sliding_window=-3), ValueError, "sliding_window must be >= 1"),
  # validation.py checks reached through the paged front ends
  "scale_array": (dict(scale=jnp.float32(0.5)), TypeError, "scale must be a Python float"),
  "scale_inf": (dict(scale=float("inf")), ValueError, "scale must be finite"),
  "soft_cap_str": (dict(logits_soft_cap="1"), TypeError, "logits_soft_cap must be a positive float"),
  "soft_cap_zero": (dict(logits_soft_cap=0.0), ValueError, "logits_soft_cap must be > 0"),
}

OP_ONLY_ERRORS = {
  # paged/op.py
  "unknown_implementation": (dict(implementation="pallas"), ValueError, "unknown implementation='pallas'"),
  "block_sizes_type": (dict(block_sizes=(16, 128)), TypeError, "block_sizes must be a flax_ringattn.BlockSizes"),
  "block_kv_not_multiple": (
    dict(block_sizes=fr.BlockSizes(block_q=4, block_kv=6)),
    ValueError,
    "block_sizes.block_kv=6 must be a multiple of page_size=4",
  ),
  "checked_not_bool": (dict(checked=1), TypeError, "checked must be a bool"),
}


@pytest.mark.parametrize("case", list(STATIC_ERRORS))
@pytest.mark.parametrize("op", ["op", "reference"])
def test_static_errors(op, case):
  changes, exc, match = STATIC_ERRORS[case]
  fn = fr.paged_attention if op == "op" else fr.paged_reference_attention
  with pytest.raises(exc, match=match):
    _call(fn, **changes)


@pytest.mark.parametrize("case", list(OP_ONLY_ERRORS))
def test_static_errors_op_only(case):
  changes, exc, match = OP_ONLY_ERRORS[case]
  with pytest.raises(exc, match=match):
    _call(fr.paged_attention, **changes)


@pytest.mark.parametrize("page_dtype", ["int8", "float8_e4m3fn", "float8_e5m2"])
@pytest.mark.parametrize("missing", ["k_scale", "v_scale"])
def test_quantized_pages_require_scales(page_dtype, missing):
  scales = {"k_scale": jnp.ones((), F32), "v_scale": jnp.ones((), F32)}
  del scales[missing]
  for fn in (fr.paged_attention, fr.paged_reference_attention):
    with pytest.raises(ValueError, match=f"{missing} is required for quantized pages"):
      _call(fn, page_dtype=jnp.dtype(page_dtype), **scales)


def test_valid_static_arguments_pass():
  """The baseline of the error cases is itself valid (so each case tests one problem); traced only."""
  valid = [
    {},
    dict(block_sizes=fr.BlockSizes(block_q=4, block_kv=2), local_window_size=(2, 0), implementation="xla"),
    dict(k_scale=jnp.ones((), F32), v_scale=jnp.ones((6, 4, 2), F32), logits_soft_cap=1.0, scale=1.0, checked=False),
  ]
  for op in (fr.paged_attention, fr.paged_reference_attention):
    for kw in valid:
      if op is fr.paged_reference_attention:
        kw = {k: v for k, v in kw.items() if k not in ("block_sizes", "implementation", "checked")}
      out = jax.eval_shape(lambda kw=kw, op=op: _call(op, **kw))
      assert out.shape == (8, 4, 8) and out.dtype == F32
  for page_dtype in ("int8", "float8_e4m3fn", "float8_e5m2"):
    scales = dict(k_scale=jnp.ones((6, 2), F32), v_scale=jnp.ones((), BF16))
    jax.eval_shape(lambda d=page_dtype, s=scales: _call(fr.paged_attention, page_dtype=jnp.dtype(d), **s))

"""`paged_attention` against the independent float64 oracle (`paged_oracle.py`), forward and gradients.

`test_paged.py` compares the op with `paged_reference_attention`, which shares
code with it (dequantisation, q-length metadata).  Here every paged scenario and
every quantized case is also checked against numpy code written apart from the
library, and a mutation test proves that a wrong dequantisation inside the
library fails these checks.  Attention sinks and MLA head shapes (v's head dim
Hv != H) are checked the same way, dsinks included, on the registry's sinks and
MLA cases (tests/cases.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import pick
from paged_cases import (
  BF16,
  F32,
  SCENARIOS,
  SMALL,
  WINDOW_CAP,
  Batch,
  case_batch,
  features,
  make_batch,
  op_fn,
  op_vjp,
  ref_fn,
  ref_vjp,
  scenario,
)
from paged_oracle import paged_oracle
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import ragged


def oracle(b: Batch, do=None, **kw):
  return paged_oracle(*b.args, **b.operands, do=do, **kw)


def _do(b: Batch, dtype=F32, seed=100):
  return jnp.asarray(np.random.default_rng(seed).normal(size=b.out_shape), dtype)


def check_against_oracle(b: Batch, dtype=F32, *, grads=True, page_grads=True, fn=op_vjp, **kw):
  """The op's output (and dq, dk, dv, and dsinks with sinks) equal the oracle's at the dtype's tolerance.  `fn`:
  `op_vjp` or `ref_vjp` (the reference; it takes no op keywords)."""
  if not grads:
    out = op_fn(*b.args, **b.operands, **kw)
    assert_close(out, oracle(b, **kw)[0], dtype)
    return
  do = _do(b, dtype)
  out, (dq, dk, dv, *dsinks) = fn(b.args, do, **b.operands, **kw)
  ref_out, (ref_dq, ref_dk, ref_dv, *ref_dsinks) = oracle(b, do, **kw)
  assert out.shape == b.out_shape and out.dtype == b.q.dtype
  assert len(dsinks) == len(ref_dsinks) == (b.sinks is not None)
  assert_close(out, ref_out, dtype)
  assert_close((dq, dsinks), (ref_dq, ref_dsinks), dtype, "grad")
  if page_grads:
    assert dv.shape == b.v_pages.shape
    assert_close((dk, dv), (ref_dk, ref_dv), dtype, "grad")


# -- the oracle itself --------------------------------------------------------------------


def test_oracle_on_a_hand_computed_batch():
  """One sequence, one head, H=1: the answer is written out by hand."""
  q = np.zeros((4, 1, 1), np.float32)
  q[:2, 0, 0] = [1.0, 2.0]
  k_pages = np.zeros((3, 2, 1, 1), np.float32)
  v_pages = np.zeros((3, 2, 1, 1), np.float32)
  # kv tokens 0, 1, 2 live in page 2 slot 0, page 2 slot 1, page 0 slot 0.
  k_pages[2, :, 0, 0], k_pages[0, 0, 0, 0] = [0.0, 1.0], 2.0
  v_pages[2, :, 0, 0], v_pages[0, 0, 0, 0] = [1.0, 3.0], 5.0
  args = (q, k_pages, v_pages, np.array([3]), np.array([[2, 0]]), np.array([0, 2]), np.array([1]))
  k_scale = np.array([[0.5], [9.0], [2.0]])  # [P, K]: page 0 -> 0.5, page 2 -> 2
  out, _ = paged_oracle(*args, k_scale=k_scale)
  # Row 0 (position 1) sees keys 0, 1 = 0, 2 (scaled by 2): softmax(0, 2) over v = 1, 3.
  w = np.exp([0.0, 2.0]) / np.exp([0.0, 2.0]).sum()
  np.testing.assert_allclose(out[0, 0, 0], w @ [1.0, 3.0])
  # Row 1 (position 2, q = 2) sees k = 0, 2, 1 (page 0 scaled by 0.5): logits 0, 4, 2.
  w = np.exp([0.0, 4.0, 2.0]) / np.exp([0.0, 4.0, 2.0]).sum()
  np.testing.assert_allclose(out[1, 0, 0], w @ [1.0, 3.0, 5.0])
  np.testing.assert_array_equal(out[2:], 0.0)  # padding rows
  # local_window_size=(1, 0) (jax.nn's meaning: the token and 1 before it): row 1 sees keys 1, 2 only (logits 4, 2);
  # row 0 sees keys 0, 1 as before.  An int 1 is (1, 1): the same under the causal mask.
  for window in ((1, 0), 1):
    out_w, _ = paged_oracle(*args, k_scale=k_scale, local_window_size=window)
    w = np.exp([4.0, 2.0]) / np.exp([4.0, 2.0]).sum()
    np.testing.assert_allclose(out_w[1, 0, 0], w @ [3.0, 5.0])
    np.testing.assert_allclose(out_w[0, 0, 0], out[0, 0, 0])


@pytest.mark.parametrize("shape", ["scalar", "page", "token"])
def test_oracle_scale_shapes_by_hand(shape):
  """Each scale shape multiplies exactly the stored values it names (page 1, slot 0, kv head 1 -> 3.0)."""
  from paged_oracle import scale_factors

  P_, ps, K_ = 2, 2, 2
  sc = {"scalar": np.float32(3.0), "page": np.array([[1.0, 2.0], [5.0, 3.0]]), "token": np.ones((P_, ps, K_))}[shape]
  if shape == "token":
    sc[1, 0, 1] = 3.0
  f = scale_factors(sc, P_, ps, K_)
  assert f.shape == (P_, ps, K_) and f[1, 0, 1] == 3.0
  expected = {"scalar": np.full((P_, ps, K_), 3.0), "page": np.array([[[1.0, 2.0]] * 2, [[5.0, 3.0]] * 2])}
  if shape != "token":
    np.testing.assert_array_equal(f, expected[shape])
  else:
    assert (f == 1.0).sum() == P_ * ps * K_ - 1


def _sinks_mla_example():
  """Two sequences, one q head and kv head, H = 1, Hv = 2, page_size 2, scale 1.

  Sequence 0 decodes 1 token (row 0, q = 1) over 2 keys in page 1: k = 0, ln 2; v = (4, 0), (0, 8).
  Sequence 1 decodes 1 token (row 1) whose only page id is -1: it sees no key.  Row 2 is padding.
  """
  q = np.array([[[1.0]], [[5.0]], [[7.0]]])  # [T=3, N=1, H=1]
  k_pages = np.zeros((2, 2, 1, 1))
  v_pages = np.zeros((2, 2, 1, 2))
  k_pages[1, :, 0, 0] = [0.0, np.log(2.0)]
  v_pages[1, :, 0] = [[4.0, 0.0], [0.0, 8.0]]
  args = (q, k_pages, v_pages, np.array([2, 1]), np.array([[1], [-1]]), np.array([0, 1, 2]), np.array([2]))
  return args, np.ones((3, 1, 2))  # dO = (1, 1) on every row


def test_oracle_sinks_and_mla_by_hand():
  """Sinks and Hv != H, forward and every gradient, worked out by hand.

  Row 0: logits q . k = 0, ln 2, and the sink s = 0, so the softmax numerators are 1, 2, 1 (sum 4):
  p = 1/4, 1/2 and p_sink = 1/4.  out = 1/4 (4, 0) + 1/2 (0, 8) = (1, 4).
  Backward with dO = (1, 1): D = dO . out = 5; dp_j = v_j . dO = 4, 8; ds_j = p_j (dp_j - D) = -1/4, 3/2
  (with the sink's -p_sink D = -5/4 they sum to 0, as softmax gradients must).  dq = sum_j ds_j k_j = 3/2 ln 2;
  dk_j = ds_j q = -1/4, 3/2; dv_j = p_j dO = (1/4, 1/4), (1/2, 1/2); dsinks = -p_sink D = -5/4.
  Row 1 sees no key: out 0, all its mass in the sink, D = 0, so it adds nothing (dsinks included).  Row 2 is
  padding: 0.  Without the sink, row 0 would be softmax(0, ln 2) = 1/3, 2/3: out (4/3, 16/3); a sink of -inf is
  no sink.
  """
  args, do = _sinks_mla_example()
  out, (dq, dk, dv, dsinks) = paged_oracle(*args, do=do, scale=1.0, sinks=np.array([0.0]))
  np.testing.assert_allclose(out[:, 0], [[1.0, 4.0], [0.0, 0.0], [0.0, 0.0]], atol=1e-12)
  np.testing.assert_allclose(dq[:, 0, 0], [1.5 * np.log(2.0), 0.0, 0.0], atol=1e-12)
  np.testing.assert_allclose(dk[1, :, 0, 0], [-0.25, 1.5], atol=1e-12)
  np.testing.assert_allclose(dv[1, :, 0], [[0.25, 0.25], [0.5, 0.5]], atol=1e-12)
  assert not dk[0].any() and not dv[0].any()  # page 0 is nobody's
  np.testing.assert_allclose(dsinks, [-1.25], atol=1e-12)
  for no_sink in (None, np.array([-np.inf])):
    out, grads = paged_oracle(*args, do=do, scale=1.0, sinks=no_sink)
    np.testing.assert_allclose(out[0, 0], [4.0 / 3.0, 16.0 / 3.0], atol=1e-12)
    assert len(grads) == (3 if no_sink is None else 4)


@pytest.mark.parametrize("fn", [op_vjp, ref_vjp], ids=["op", "reference"])
def test_library_on_the_hand_computed_sinks_and_mla_batch(fn):
  """The op (XLA) and the reference reproduce the hand-computed numbers above (float32)."""
  args, do = _sinks_mla_example()
  args = tuple(jnp.asarray(x, F32 if x.dtype.kind == "f" else jnp.int32) for x in args)
  kw = dict(block_sizes=fr.BlockSizes(block_q=1, block_kv=2)) if fn is op_vjp else {}
  out, (dq, dk, dv, dsinks) = fn(args, jnp.asarray(do, F32), scale=1.0, sinks=jnp.zeros((1,), F32), **kw)
  np.testing.assert_allclose(np.asarray(out[:, 0]), [[1.0, 4.0], [0.0, 0.0], [0.0, 0.0]], atol=1e-6)
  np.testing.assert_allclose(np.asarray(dq[:, 0, 0]), [1.5 * np.log(2.0), 0.0, 0.0], atol=1e-6)
  np.testing.assert_allclose(np.asarray(dk[1, :, 0, 0]), [-0.25, 1.5], atol=1e-6)
  np.testing.assert_allclose(np.asarray(dv[1, :, 0]), [[0.25, 0.25], [0.5, 0.5]], atol=1e-6)
  np.testing.assert_allclose(np.asarray(dsinks), [-1.25], atol=1e-6)


# -- every scenario, forward and gradients -------------------------------------------------


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_matches_oracle(name):
  rng = np.random.default_rng([61, SCENARIOS.index(name)])
  b = make_batch(rng, scenario(name, rng))
  check_against_oracle(b)
  # The reference the other tests trust agrees with the oracle too.
  assert_close(ref_fn(*b.args), oracle(b)[0], F32)


@pytest.mark.parametrize("name", ["mixed", "edge"])
def test_window_soft_cap_match_oracle(name):
  rng = np.random.default_rng([62, SCENARIOS.index(name)])
  b = make_batch(rng, scenario(name, rng))
  check_against_oracle(b, **features(WINDOW_CAP))


def test_mqa_shared_prefix_bf16_match_oracle():
  rng = np.random.default_rng(63)
  check_against_oracle(make_batch(rng, [(3, 13), (2, 19), (1, 6)], num_kv_heads=1, share_prefix=True))
  b = make_batch(rng, scenario("mixed", rng), dtype=BF16)
  check_against_oracle(b, BF16)


# -- quantized and scaled pages ---------------------------------------------------------------

# Every (page dtype, k scale shape, v scale shape) of test_paged.test_quantized_pages, plus each shape on both.
QUANTIZED = [
  ("int8", ("scalar", "page")),
  ("int8", ("page", "token")),
  ("int8", ("token", "scalar")),
  ("int8", ("page", "page")),
  ("float8_e4m3fn", ("scalar", "token")),
  ("float8_e4m3fn", ("token", "page")),
  ("float8_e4m3fn", ("page", "scalar")),
  ("float8_e5m2", ("token", "token")),
]


@pytest.mark.parametrize("page_dtype, scales", QUANTIZED, ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_quantized_pages_match_oracle(page_dtype, scales):
  """Output and dq against the oracle (quantized pages have no float gradient of their own)."""
  rng = np.random.default_rng([64, len(scales[0]), len(scales[1])])
  b = make_batch(rng, scenario("mixed", rng), page_dtype=jnp.dtype(page_dtype), scale_shape=scales)
  # Half the cases with window and soft cap (each extra configuration is another compile).
  extra = dict(local_window_size=(5, 0), logits_soft_cap=4.0) if QUANTIZED.index((page_dtype, scales)) % 2 else {}
  check_against_oracle(b, page_grads=False, **extra)


@pytest.mark.parametrize("scales", [("scalar", "page"), ("page", "token"), ("token", "scalar")], ids="-".join)
def test_scaled_float_page_grads_match_oracle(scales):
  """Float pages with scales: dk/dv with respect to the stored values, for every scale shape."""
  rng = np.random.default_rng([65, len(scales[0])])
  check_against_oracle(make_batch(rng, scenario("mixed", rng), scale_shape=scales))


# -- attention sinks and MLA head shapes (registry cases: tests/cases.py) ---------------------------------------

# (registry case, batch mix, dtype): decode, chunked prefill, mixed and edge batches; window with sinks (mla_sinks),
# window + soft cap with sinks (sinks_window_cap, MHA 4:4), GQA 4:1 with sinks (sinks_gqa) and MLA (qk 24, v 16).
SINKS_MLA = [
  ("sinks_gqa", "decode", F32),
  ("mla_gqa", "chunked", F32),
  ("mla_sinks", "mixed", F32),
  ("sinks_window_cap", "edge", F32),
  ("mla_sinks", "mixed", BF16),
]


@pytest.mark.parametrize("case, name, dtype", SINKS_MLA, ids=[f"{c}-{n}-{jnp.dtype(d).name}" for c, n, d in SINKS_MLA])
def test_sinks_mla_match_oracle(case, name, dtype):
  """Forward, dq, dk_pages, dv_pages [P, page_size, K, Hv] and dsinks of the XLA op against the oracle."""
  (c,) = pick(case)
  rng = np.random.default_rng([67, SINKS_MLA.index((case, name, dtype))])
  b = case_batch(c, rng, scenario(name, rng), dtype=dtype)
  check_against_oracle(b, dtype, **features(c))


def test_sinks_mla_shared_prefix_match_oracle():
  """Two sequences read the same prefix pages: their dK / dV [.., Hv] add up in the shared slots."""
  (c,) = pick("mla_sinks")
  rng = np.random.default_rng(68)
  b = case_batch(c, rng, [(3, 13), (2, 19), (1, 6)], share_prefix=True)
  assert int(b.page_indices[0, 0]) == int(b.page_indices[1, 0])
  check_against_oracle(b, **features(c))


@pytest.mark.parametrize(
  "case, page_dtype, scales",
  [("mla_sinks", "int8", ("page", "token")), ("sinks_gqa", "float8_e4m3fn", ("token", "scalar"))],
  ids=["int8-mla_sinks", "fp8-sinks_gqa"],
)
def test_sinks_mla_quantized_pages_match_oracle(case, page_dtype, scales):
  """Quantized pages with scales: output, dq and dsinks (quantized pages have no float gradient)."""
  (c,) = pick(case)
  rng = np.random.default_rng([69, len(page_dtype)])
  b = case_batch(c, rng, scenario("mixed", rng), page_dtype=jnp.dtype(page_dtype), scale_shape=scales)
  assert b.v_pages.shape[3] == c.v_dim
  check_against_oracle(b, page_grads=False, **features(c))


# -- mutations: a wrong dequantisation must fail the oracle checks --------------------------------


def _double_every_scale(pages, scale, page_ids=None):
  return _REAL_DEQUANTIZE(pages, None if scale is None else 2.0 * scale, page_ids)


def _head0_scale_for_every_head(pages, scale, page_ids=None):
  if scale is not None and scale.ndim == 2:  # [P, K]: use kv head 0's scale everywhere
    scale = jnp.broadcast_to(scale[:, :1], scale.shape)
  return _REAL_DEQUANTIZE(pages, scale, page_ids)


_REAL_DEQUANTIZE = ragged.dequantize
MUTATIONS = {"double_every_scale": _double_every_scale, "head0_scale_for_every_head": _head0_scale_for_every_head}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("page_dtype", ["int8", "float32"])
def test_oracle_catches_wrong_dequantization(monkeypatch, mutation, page_dtype):
  """With the library's dequantisation deliberately broken, the forward oracle check fails."""
  rng = np.random.default_rng(66)
  b = make_batch(rng, scenario("mixed", rng), page_dtype=jnp.dtype(page_dtype), scale_shape="page")
  monkeypatch.setattr(ragged, "dequantize", MUTATIONS[mutation])
  mutated = _fresh_op(b)
  monkeypatch.undo()
  with pytest.raises(AssertionError):
    assert_close(mutated, oracle(b)[0], F32)
  # Unmutated, the same batch passes: the failure above is the mutation's.
  assert_close(_fresh_op(b), oracle(b)[0], F32)


def _fresh_op(b: Batch):
  """The op traced anew: a new jitted function, so no cached trace of the other dequantisation is reused."""
  return jax.jit(lambda *a: fr.paged_attention(*a, **b.scales, block_sizes=SMALL))(*b.args)

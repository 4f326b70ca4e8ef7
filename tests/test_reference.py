"""`reference_attention`: hand-computed cases, jax.nn.dot_product_attention and an independent numpy oracle."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tolerances import assert_close

from flax_ringattn import reference_attention, zigzag_order, zigzag_positions

F32 = jnp.float32
LN2, LN3 = math.log(2.0), math.log(3.0)


def _arr(x):
  return jnp.asarray(np.asarray(x, np.float32))


def _bthd(rows):
  """[T] or [T, H] python numbers -> [1, T, 1, H] (B = N = 1)."""
  a = np.asarray(rows, np.float32)
  if a.ndim == 1:
    a = a[:, None]
  return jnp.asarray(a[None, :, None, :])


def _rngs(seed, n):
  """n handles on one numpy generator (numpy, not jax.random: no compile per shape)."""
  return (np.random.default_rng(seed),) * n


def _rand(rng, shape, dtype=F32):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)


# --------------------------------------------------------------------------------------------
# Independent numpy oracle (float64), forward and hand-derived backward.
# --------------------------------------------------------------------------------------------


def np_visible(T, S, B, *, is_causal=False, window=None, q_seg=None, kv_seg=None, q_pos=None, kv_pos=None):
  """[B, T, S] bool, by explicit loops (no vectorised mask logic shared with the library)."""
  q_pos = list(range(T)) if q_pos is None else [int(p) for p in q_pos]
  kv_pos = list(range(S)) if kv_pos is None else [int(p) for p in kv_pos]
  if isinstance(window, int):
    window = (window, window)
  vis = np.ones((B, T, S), bool)
  for b in range(B):
    for i in range(T):
      for j in range(S):
        qi, kj = q_pos[i], kv_pos[j]
        ok = True
        if is_causal and kj > qi:
          ok = False
        if window is not None and not (qi - window[0] <= kj <= qi + window[1]):
          ok = False
        if q_seg is not None and q_seg[b][i] != kv_seg[b][j]:
          ok = False
        vis[b, i, j] = ok
  return vis


def np_attention(q, k, v, vis, *, scale=None, cap=None, do=None):
  """Numpy float64 attention; with `do`, also returns (dq, dk, dv) from a hand-written backward."""
  q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
  B, T, N, H = q.shape
  K = k.shape[2]
  G = N // K
  scale = H**-0.5 if scale is None else scale
  o = np.zeros((B, T, N, H))
  dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
  for b in range(B):
    for n in range(N):
      kh = n // G  # q head n uses kv head n // G
      raw = scale * q[b, :, n] @ k[b, :, kh].T  # [T, S]
      s = cap * np.tanh(raw / cap) if cap is not None else raw
      m = vis[b]
      s_masked = np.where(m, s, -np.inf)
      row_max = np.where(m.any(-1, keepdims=True), s_masked.max(-1, keepdims=True), 0.0)
      e = np.where(m, np.exp(s_masked - row_max), 0.0)
      denom = e.sum(-1, keepdims=True)
      p = e / np.where(denom == 0, 1.0, denom)
      o[b, :, n] = p @ v[b, :, kh]
      if do is not None:
        g = np.asarray(do, np.float64)[b, :, n]  # [T, H]
        dv[b, :, kh] += p.T @ g
        dp = g @ v[b, :, kh].T
        ds = p * (dp - (dp * p).sum(-1, keepdims=True))
        if cap is not None:
          ds = ds * (1.0 - np.tanh(raw / cap) ** 2)
        dq[b, :, n] = scale * ds @ k[b, :, kh]
        dk[b, :, kh] += scale * ds.T @ q[b, :, n]
  if do is None:
    return o
  return o, (dq, dk, dv)


def _close(actual, expected, kind="fwd"):
  """assert_close in f32 for hand-computed expectations given as python lists."""
  if isinstance(expected, list | tuple) and not isinstance(actual, tuple):
    expected = np.asarray(expected, np.float32)
  assert_close(actual, expected, F32, kind)


def _vjp(fn, q, k, v, do):
  """(fn(q, k, v), vjp of do), jitted as one program (eager autodiff compiles op by op: slow)."""

  def run(q, k, v, do):
    out, pullback = jax.vjp(fn, q, k, v)
    return out, pullback(do)

  return jax.jit(run)(q, k, v, do)


# --------------------------------------------------------------------------------------------
# Hand-computed cases (scale 1 via H = 1 unless stated; weights written out explicitly).
# --------------------------------------------------------------------------------------------


def test_plain_hand_computed():
  # q = [1, 2], k = [0, ln 3]: row 0 logits [0, ln 3] -> weights [1/4, 3/4];
  # row 1 logits [0, 2 ln 3] -> weights [1/10, 9/10].
  q, k, v = _bthd([1.0, 2.0]), _bthd([0.0, LN3]), _bthd([10.0, 20.0])
  out = reference_attention(q, k, v)
  chex.assert_shape(out, (1, 2, 1, 1))
  expected = [[0.25 * 10 + 0.75 * 20], [0.1 * 10 + 0.9 * 20]]  # 17.5, 19
  _close(out[0, :, 0], expected)


def test_causal_hand_computed():
  q, k, v = _bthd([1.0, 2.0]), _bthd([0.0, LN3]), _bthd([10.0, 20.0])
  out = reference_attention(q, k, v, is_causal=True)
  # Row 0 sees only key 0; row 1 sees both (weights 1/10, 9/10).
  _close(out[0, :, 0], [[10.0], [0.1 * 10 + 0.9 * 20]])


# q = 1 everywhere, k = [0, ln 2, ln 3] -> unnormalised weights 1, 2, 3; v = [1, 10, 100].
_W_Q, _W_K, _W_V = [1.0, 1.0, 1.0], [0.0, LN2, LN3], [1.0, 10.0, 100.0]
_ALL = (1 + 2 * 10 + 3 * 100) / 6  # 53.5
_01 = (1 + 2 * 10) / 3  # keys {0, 1}: 7
_12 = (2 * 10 + 3 * 100) / 5  # keys {1, 2}: 64


@pytest.mark.parametrize(
  "window,expected",
  [
    (None, [_ALL, _ALL, _ALL]),
    (0, [1.0, 10.0, 100.0]),  # the diagonal only
    (1, [_01, _ALL, _12]),  # symmetric (1, 1)
    ((1, 0), [1.0, _01, _12]),  # i - 1 <= j <= i
    ((0, 1), [_01, _12, 100.0]),  # i <= j <= i + 1
    ((2, 0), [1.0, _01, _ALL]),
    ([0, 2], [_ALL, _12, 100.0]),  # a list pair works like a tuple
  ],
)
def test_window_hand_computed(window, expected):
  out = reference_attention(_bthd(_W_Q), _bthd(_W_K), _bthd(_W_V), local_window_size=window)
  _close(out[0, :, 0, 0], expected)


def test_window_with_causal_hand_computed():
  # causal & window (0, 1) leave only the diagonal; causal & window (1, 1) -> keys {i-1, i}.
  q, k, v = _bthd(_W_Q), _bthd(_W_K), _bthd(_W_V)
  _close(reference_attention(q, k, v, is_causal=True, local_window_size=(0, 1))[0, :, 0, 0], _W_V)
  _close(reference_attention(q, k, v, is_causal=True, local_window_size=1)[0, :, 0, 0], [1.0, _01, _12])


def test_segment_ids_hand_computed():
  q = jnp.concatenate([_bthd(_W_Q)] * 2)
  k = jnp.concatenate([_bthd(_W_K)] * 2)
  v = jnp.concatenate([_bthd(_W_V)] * 2)
  seg = jnp.array([[0, 0, 1], [3, 7, 7]], jnp.int32)
  out = reference_attention(q, k, v, segment_ids=seg)
  # Batch 0: tokens {0, 1} | {2}; batch 1: {0} | {1, 2}.
  _close(out[:, :, 0, 0], [[_01, _01, 100.0], [1.0, _12, _12]])
  # The (q_ids, kv_ids) pair form with the same ids agrees.
  _close(reference_attention(q, k, v, segment_ids=(seg, seg)), out)
  # With causal: batch 0 row 1 sees keys {0, 1}, row 2 only itself.
  out_c = reference_attention(q, k, v, segment_ids=seg, is_causal=True)
  _close(out_c[:, :, 0, 0], [[1.0, _01, 100.0], [1.0, 10.0, _12]])


def test_cross_attention_segment_pair_hand_computed():
  # T = 2 queries, S = 3 keys; q ids [1, 2], kv ids [1, 1, 2].
  q, k, v = _bthd([1.0, 1.0]), _bthd(_W_K), _bthd(_W_V)
  out = reference_attention(q, k, v, segment_ids=(jnp.array([[1, 2]]), jnp.array([[1, 1, 2]])))
  _close(out[0, :, 0, 0], [_01, 100.0])


def test_soft_cap_hand_computed():
  # cap = 1: the logit atanh(ln 2) is capped to tanh(atanh(ln 2)) = ln 2 -> weights [1/3, 2/3].
  q, v = _bthd([1.0]), _bthd([3.0, 6.0])
  k = _bthd([0.0, math.atanh(LN2)])
  out = reference_attention(q, k, v, logits_soft_cap=1.0)
  _close(out[0, 0, 0, 0], 3.0 / 3 + 2 * 6.0 / 3)
  # Without the cap the weights are 1 : exp(atanh(ln 2)) instead.
  w = math.exp(math.atanh(LN2))
  _close(reference_attention(q, k, v)[0, 0, 0, 0], (3.0 + w * 6.0) / (1 + w))
  # A huge logit saturates at the cap: cap = ln 3, logits [0, 100] -> [0, ln 3] -> [1/4, 3/4].
  k_big = _bthd([0.0, 100.0])
  out_big = reference_attention(q, k_big, v, logits_soft_cap=LN3)
  _close(out_big[0, 0, 0, 0], 0.25 * 3.0 + 0.75 * 6.0)


def test_custom_scale_hand_computed():
  # H = 2: q = [1, 1], k0 = [0, 0], k1 = [1, 1] -> dots [0, 2]; scale ln(3)/2 -> logits [0, ln 3].
  q = _bthd([[1.0, 1.0]])
  k = _bthd([[0.0, 0.0], [1.0, 1.0]])
  v = _bthd([[10.0, 0.0], [20.0, 4.0]])
  out = reference_attention(q, k, v, scale=LN3 / 2)
  _close(out[0, 0, 0], [0.25 * 10 + 0.75 * 20, 0.75 * 4])
  # The default scale is 1 / sqrt(H): logits [0, sqrt 2].
  w = math.exp(2 / math.sqrt(2))
  _close(reference_attention(q, k, v)[0, 0, 0], [(10 + 20 * w) / (1 + w), 4 * w / (1 + w)])
  # An int scale is accepted and means the same as the float.
  _close(reference_attention(q, k, v, scale=1), reference_attention(q, k, v, scale=1.0))


def test_gqa_hand_computed():
  # N = 4 q heads, K = 2 kv heads: q heads {0, 1} use kv head 0, {2, 3} use kv head 1.
  q = _arr(np.array([1.0, 2.0, 1.0, 2.0]).reshape(1, 1, 4, 1).repeat(2, axis=1))  # [1, 2, 4, 1]
  k = _arr(np.array([[0.0, LN3], [LN3, 0.0]]).reshape(1, 2, 2, 1))  # key j, kv head h: k[0, j, h]
  v = _arr(np.array([[10.0, 10.0], [20.0, 20.0]]).reshape(1, 2, 2, 1))
  out = reference_attention(q, k, v)
  # head 0: logits [0, ln3] -> 17.5; head 1: [0, 2 ln3] -> 19;
  # head 2: [ln3, 0] -> 12.5; head 3: [2 ln3, 0] -> 11.
  _close(out[0, 0, :, 0], [17.5, 19.0, 12.5, 11.0])
  _close(out[0, 1], out[0, 0])
  # Heads of a group with equal queries give equal outputs; different groups differ.
  q_same = jnp.ones_like(q)
  o = reference_attention(q_same, k, v)[0, 0, :, 0]
  assert float(o[0]) == float(o[1]) and float(o[2]) == float(o[3]) and float(o[0]) != float(o[2])
  # Equivalent to repeating each kv head G = 2 times (MHA).
  k_mha, v_mha = jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2)
  _close(out, reference_attention(q, k_mha, v_mha))


def test_row_with_no_visible_key_is_zero_with_zero_finite_grads():
  kq, kk, kv, kd = _rngs(0, 4)
  q, k, v = _rand(kq, (1, 2, 2, 2)), _rand(kk, (1, 3, 1, 2)), _rand(kv, (1, 3, 1, 2))
  do = _rand(kd, (1, 2, 2, 2))
  # Query 1 is in segment 5, which has no key.
  seg = (jnp.array([[0, 5]], jnp.int32), jnp.array([[0, 0, 0]], jnp.int32))
  fn = lambda q, k, v: reference_attention(q, k, v, segment_ids=seg)
  out, (dq, dk, dv) = _vjp(fn, q, k, v, do)
  assert np.all(np.asarray(out[0, 1]) == 0.0)  # exactly 0, not NaN
  chex.assert_tree_all_finite((out, dq, dk, dv))
  assert np.all(np.asarray(dq[0, 1]) == 0.0)
  # dk / dv only get the contribution of the visible row 0.
  fn0 = lambda q, k, v: reference_attention(q, k, v)
  out0, (dq0, dk0, dv0) = _vjp(fn0, q[:, :1], k, v, do[:, :1])
  _close(out[:, :1], out0)
  _close((dq[:, :1], dk, dv), (dq0, dk0, dv0), "grad")

  # Every row empty (positions put all keys in the future of a causal query): output and grads all 0.
  fn_empty = lambda q, k, v: reference_attention(
    q, k, v, is_causal=True, q_positions=jnp.array([0, 1]), kv_positions=jnp.array([5, 6, 7])
  )
  out_e, grads_e = _vjp(fn_empty, q, k, v, do)
  chex.assert_tree_all_finite((out_e, grads_e))
  for x in (out_e, *grads_e):
    assert np.all(np.asarray(x) == 0.0)

  # A window that leaves a query of a cross attention with no key (T > S + right).
  fn_w = lambda q, k, v: reference_attention(q, k, v, local_window_size=(0, 0))
  q4 = _rand(kq, (1, 5, 2, 2))
  out_w, grads_w = _vjp(fn_w, q4, k, v, _rand(kd, (1, 5, 2, 2)))
  chex.assert_tree_all_finite((out_w, grads_w))
  assert np.all(np.asarray(out_w[0, 3:]) == 0.0)
  assert np.all(np.asarray(grads_w[0][0, 3:]) == 0.0)


# --------------------------------------------------------------------------------------------
# Against jax.nn.dot_product_attention (f32, xla).
# --------------------------------------------------------------------------------------------


JAX_NN_CASES = [
  # (B, T, S, N, K, H, is_causal, window, scale)
  (2, 16, 16, 4, 4, 8, False, None, None),
  (2, 16, 16, 4, 4, 8, True, None, 0.3),
  (2, 8, 24, 2, 2, 8, False, None, None),  # cross attention T < S
  (2, 8, 24, 2, 2, 8, True, None, None),
  (2, 24, 8, 2, 2, 4, False, None, 1.5),  # cross attention T > S
  (2, 24, 8, 2, 2, 4, True, None, None),
  (2, 16, 16, 8, 2, 8, True, None, None),  # GQA 8:2
  (2, 16, 32, 8, 2, 8, False, None, 0.3),
  (2, 16, 16, 8, 1, 8, True, None, None),  # MQA 8:1
  (2, 16, 16, 8, 1, 8, False, 3, None),
  (2, 16, 16, 4, 2, 8, False, 2, None),  # window ints
  (2, 16, 16, 4, 2, 8, False, 0, 0.3),
  (2, 16, 16, 4, 2, 8, True, 4, None),
  (2, 16, 16, 4, 4, 8, False, (3, 1), None),  # window tuples
  (2, 16, 16, 4, 4, 8, False, (0, 5), 0.3),
  (2, 16, 16, 8, 2, 8, True, (2, 0), None),
  (2, 8, 32, 4, 2, 8, False, (2, 3), None),  # cross attention with a window (every row keeps a key)
  (2, 8, 32, 8, 1, 16, True, (5, 5), 0.3),
]


@pytest.mark.parametrize("B,T,S,N,K,H,is_causal,window,scale", JAX_NN_CASES)
def test_matches_jax_nn(B, T, S, N, K, H, is_causal, window, scale):
  kq, kk, kv, kd = _rngs(T * 1000 + S * 10 + N + K, 4)
  q, k, v = _rand(kq, (B, T, N, H)), _rand(kk, (B, S, K, H)), _rand(kv, (B, S, K, H))
  do = _rand(kd, (B, T, N, H))
  ours = lambda q, k, v: reference_attention(q, k, v, is_causal=is_causal, local_window_size=window, scale=scale)
  theirs = lambda q, k, v: jax.nn.dot_product_attention(
    q, k, v, is_causal=is_causal, local_window_size=window, scale=scale, implementation="xla"
  )
  out, grads = _vjp(ours, q, k, v, do)
  out_ref, grads_ref = _vjp(theirs, q, k, v, do)
  chex.assert_shape(out, (B, T, N, H))
  chex.assert_type(out, jnp.float32)
  assert_close(out, out_ref, F32, "fwd")
  assert_close(grads, grads_ref, F32, "grad")


@pytest.mark.parametrize("pair", [False, True])
def test_segment_ids_match_jax_nn_mask_and_numpy(pair):
  B, T, N, K, H = 2, 16, 4, 2, 8
  kq, kk, kv, kd = _rngs(7, 4)
  q, k, v = _rand(kq, (B, T, N, H)), _rand(kk, (B, T, K, H)), _rand(kv, (B, T, K, H))
  do = _rand(kd, (B, T, N, H))
  seg = jnp.array([[0] * 5 + [1] * 7 + [2] * 4, [4] * 9 + [2] * 7], jnp.int32)
  seg_arg = (seg, seg) if pair else seg
  fn = lambda q, k, v: reference_attention(q, k, v, segment_ids=seg_arg, is_causal=True)
  out, grads = _vjp(fn, q, k, v, do)
  mask = (seg[:, :, None] == seg[:, None, :])[:, None]  # [B, 1, T, S]
  theirs = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, implementation="xla")
  out_ref, grads_ref = _vjp(theirs, q, k, v, do)
  assert_close(out, out_ref, F32)
  assert_close(grads, grads_ref, F32, "grad")
  vis = np_visible(T, T, B, is_causal=True, q_seg=np.asarray(seg), kv_seg=np.asarray(seg))
  out_np, grads_np = np_attention(q, k, v, vis, do=do)
  assert_close(out, out_np, F32)
  assert_close(grads, grads_np, F32, "grad")


def test_cross_attention_segment_pair_matches_numpy():
  B, T, S, N, K, H = 2, 8, 12, 4, 1, 4
  kq, kk, kv, kd = _rngs(11, 4)
  q, k, v = _rand(kq, (B, T, N, H)), _rand(kk, (B, S, K, H)), _rand(kv, (B, S, K, H))
  do = _rand(kd, (B, T, N, H))
  q_seg = np.array([[0, 0, 1, 1, 1, 2, 2, 9], [1] * 8], np.int32)  # id 9 has no key: an empty row
  kv_seg = np.array([[0] * 3 + [1] * 4 + [2] * 5, [1] * 6 + [3] * 6], np.int32)
  fn = lambda q, k, v: reference_attention(q, k, v, segment_ids=(jnp.asarray(q_seg), jnp.asarray(kv_seg)))
  out, grads = _vjp(fn, q, k, v, do)
  vis = np_visible(T, S, B, q_seg=q_seg, kv_seg=kv_seg)
  out_np, grads_np = np_attention(q, k, v, vis, do=do)
  assert_close(out, out_np, F32)
  assert_close(grads, grads_np, F32, "grad")


@pytest.mark.parametrize("cap", [0.5, 2.0, 30.0])
@pytest.mark.parametrize("is_causal", [False, True])
def test_soft_cap_matches_numpy(cap, is_causal):
  B, T, S, N, K, H = 2, 12, 12, 4, 2, 8
  kq, kk, kv, kd = _rngs(int(cap * 10), 4)
  q, k, v = 3 * _rand(kq, (B, T, N, H)), _rand(kk, (B, S, K, H)), _rand(kv, (B, S, K, H))
  do = _rand(kd, (B, T, N, H))
  fn = lambda q, k, v: reference_attention(q, k, v, logits_soft_cap=cap, is_causal=is_causal)
  out, grads = _vjp(fn, q, k, v, do)
  vis = np_visible(T, S, B, is_causal=is_causal)
  out_np, grads_np = np_attention(q, k, v, vis, cap=cap, do=do)
  assert_close(out, out_np, F32)
  assert_close(grads, grads_np, F32, "grad")
  # A cap changes the result (the logits here reach well past 0.5 and 2).
  if cap < 10:
    assert not np.allclose(np.asarray(out), np.asarray(reference_attention(q, k, v, is_causal=is_causal)), atol=1e-3)


def test_bf16_inputs_return_bf16_close_to_f32():
  kq, kk, kv = _rngs(3, 3)
  q, k, v = _rand(kq, (2, 16, 4, 8)), _rand(kk, (2, 16, 2, 8)), _rand(kv, (2, 16, 2, 8))
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  out = reference_attention(qb, kb, vb, is_causal=True)
  chex.assert_type(out, jnp.bfloat16)
  expected = reference_attention(*(x.astype(F32) for x in (qb, kb, vb)), is_causal=True)
  assert_close(out, expected, jnp.bfloat16)


# --------------------------------------------------------------------------------------------
# q_positions / kv_positions with the zigzag layout.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("extra", ["none", "window", "segments"])
def test_zigzag_positions_equal_zigzag_of_natural_result(n, extra):
  B, T, N, K, H = 2, 16, 4, 2, 8
  kq, kk, kv, kd = _rngs(n, 4)
  q, k, v = _rand(kq, (B, T, N, H)), _rand(kk, (B, T, K, H)), _rand(kv, (B, T, K, H))
  do = _rand(kd, (B, T, N, H))
  kwargs = {"is_causal": True}
  seg = jnp.array([[0] * 6 + [1] * 10, [0] * 11 + [1] * 5], jnp.int32)
  if extra == "window":
    kwargs["local_window_size"] = (3, 2)
  natural = lambda q, k, v: reference_attention(q, k, v, segment_ids=seg if extra == "segments" else None, **kwargs)
  out, grads = _vjp(natural, q, k, v, do)

  pos = zigzag_positions(T, n)
  zz = lambda x: zigzag_order(np.asarray(x), n)  # numpy path: layout itself is tested in test_layout.py
  seg_zz = zz(seg) if extra == "segments" else None
  zigzag = lambda q, k, v: reference_attention(q, k, v, segment_ids=seg_zz, q_positions=pos, kv_positions=pos, **kwargs)
  out_zz, grads_zz = _vjp(zigzag, zz(q), zz(k), zz(v), zz(do))
  assert_close(out_zz, zz(out), F32)
  assert_close(grads_zz, jax.tree.map(zz, grads), F32, "grad")
  # Without the positions the zigzag-ordered causal result is different (wrong mask).
  wrong = reference_attention(zz(q), zz(k), zz(v), segment_ids=seg_zz, **kwargs)
  assert not np.allclose(np.asarray(wrong), np.asarray(zz(out)), atol=1e-3)


def test_positions_default_to_arange():
  kq, kk, kv = _rngs(5, 3)
  q, k, v = _rand(kq, (2, 8, 2, 4)), _rand(kk, (2, 12, 2, 4)), _rand(kv, (2, 12, 2, 4))
  a = reference_attention(q, k, v, is_causal=True, local_window_size=(2, 1))
  b = reference_attention(
    q, k, v, is_causal=True, local_window_size=(2, 1), q_positions=np.arange(8), kv_positions=jnp.arange(12)
  )
  assert_close(a, b, F32)
  # Shifting both position vectors by the same offset changes nothing.
  c = reference_attention(
    q, k, v, is_causal=True, local_window_size=(2, 1), q_positions=np.arange(8) + 100, kv_positions=np.arange(12) + 100
  )
  assert_close(a, c, F32)
  # Arbitrary (non-monotonic) positions follow the numpy oracle.
  q_pos, kv_pos = np.array([5, 0, 7, 3, 3, 1, 9, 2]), np.arange(12)[::-1]
  d = reference_attention(q, k, v, is_causal=True, q_positions=q_pos, kv_positions=kv_pos)
  vis = np_visible(8, 12, 2, is_causal=True, q_pos=q_pos, kv_pos=kv_pos)
  assert_close(d, np_attention(q, k, v, vis), F32)


# --------------------------------------------------------------------------------------------
# Property test against the numpy oracle.
# --------------------------------------------------------------------------------------------


@st.composite
def attention_cases(draw):
  B = draw(st.integers(1, 2))
  T = draw(st.integers(1, 10))
  S = draw(st.integers(1, 10))
  K = draw(st.sampled_from([1, 2]))
  G = draw(st.sampled_from([1, 2, 4]))
  H = draw(st.sampled_from([1, 2, 4, 8]))
  is_causal = draw(st.booleans())
  window = draw(st.one_of(st.none(), st.integers(0, 4), st.tuples(st.integers(0, 4), st.integers(0, 4))))
  cap = draw(st.one_of(st.none(), st.floats(0.5, 20.0)))
  scale = draw(st.one_of(st.none(), st.floats(0.1, 1.0)))
  if draw(st.booleans()):
    q_seg = draw(st.lists(st.lists(st.integers(0, 2), min_size=T, max_size=T), min_size=B, max_size=B))
    kv_seg = draw(st.lists(st.lists(st.integers(0, 2), min_size=S, max_size=S), min_size=B, max_size=B))
    if T == S and draw(st.booleans()):
      kv_seg = None  # the single-array (self attention) form
  else:
    q_seg = kv_seg = None
  seed = draw(st.integers(0, 2**31 - 1))
  return B, T, S, K * G, K, H, is_causal, window, cap, scale, q_seg, kv_seg, seed


@settings(max_examples=10, deadline=None)
@given(attention_cases())
def test_property_matches_numpy(case):
  B, T, S, N, K, H, is_causal, window, cap, scale, q_seg, kv_seg, seed = case
  rng = np.random.default_rng(seed)
  q = rng.standard_normal((B, T, N, H)).astype(np.float32)
  k = rng.standard_normal((B, S, K, H)).astype(np.float32)
  v = rng.standard_normal((B, S, K, H)).astype(np.float32)
  do = rng.standard_normal((B, T, N, H)).astype(np.float32)
  if q_seg is None:
    seg_arg = None
  elif kv_seg is None:
    seg_arg = jnp.array(q_seg, jnp.int32)
    kv_seg = q_seg
  else:
    seg_arg = (jnp.array(q_seg, jnp.int32), jnp.array(kv_seg, jnp.int32))
  fn = lambda q, k, v: reference_attention(
    q, k, v, is_causal=is_causal, segment_ids=seg_arg, local_window_size=window, logits_soft_cap=cap, scale=scale
  )
  out, grads = _vjp(fn, jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(do))
  vis = np_visible(T, S, B, is_causal=is_causal, window=window, q_seg=q_seg, kv_seg=kv_seg)
  out_np, grads_np = np_attention(q, k, v, vis, scale=scale, cap=cap, do=do)
  chex.assert_shape(out, (B, T, N, H))
  assert_close(out, out_np, F32)
  assert_close(grads, grads_np, F32, "grad")
  # Rows with no visible key are exactly 0.
  empty = ~vis.any(-1)  # [B, T]
  assert np.all(np.asarray(out)[empty] == 0.0)


# -- attention sinks and MLA head shapes: a worked example, then every registry case against the float64 oracle --


def test_sinks_and_mla_worked_example():
  """One query, two keys, scale 1: logits 0 and ln 2, a sink of logit 0, v of head dim 2 against q/k's 1.

  Denominator e^0 + e^ln2 + e^0 = 4, so p = (1/4, 1/2) and p_sink = 1/4; out = 4/4 + 8/2 = 5 in the first dim,
  0/4 + 2/2 = 1 in the second.  With dO = (1, 0): D = 5 and dsink = -p_sink * D = -1.25; dv = p * dO.
  d q: ds = p * (dP - D) with dP = v . dO = (4, 8) -> ds = (1/4 * -1, 1/2 * 3) = (-0.25, 1.5), dq = ds . k = 1.5 ln 2.
  """
  from dense_oracle import dense_oracle

  q, k = _bthd([1.0]), _bthd([0.0, LN2])
  v = _bthd([[4.0, 0.0], [8.0, 2.0]])
  do = _bthd([[1.0, 0.0]])
  sinks = jnp.zeros((1,), F32)
  expected = dict(out=[5.0, 1.0], dsink=-1.25, dq=1.5 * LN2, dv=[[0.25, 0.0], [0.5, 0.0]])
  out, (dq, dk, dv, ds) = dense_oracle(q, k, v, do=do, scale=1.0, sinks=sinks)
  np.testing.assert_allclose(out[0, 0, 0], expected["out"], rtol=1e-7)  # ln 2 is rounded to float32 on the way in
  np.testing.assert_allclose(ds, [expected["dsink"]], rtol=1e-7)  # ln 2 is rounded to float32 on the way in
  np.testing.assert_allclose(dq[0, 0, 0, 0], expected["dq"], rtol=1e-7)  # ln 2 is rounded to float32 on the way in
  np.testing.assert_allclose(dv[0, :, 0], expected["dv"], rtol=1e-7)  # ln 2 is rounded to float32 on the way in
  f = lambda q, k, v, s: reference_attention(q, k, v, scale=1.0, sinks=s)  # noqa: E731
  got, vjp = jax.vjp(f, q, k, v, sinks)
  g = vjp(do)
  np.testing.assert_allclose(np.asarray(got)[0, 0, 0], expected["out"], rtol=1e-6)
  np.testing.assert_allclose(np.asarray(g[3]), [expected["dsink"]], rtol=1e-6)
  for a, b in zip(g[:3], (dq, dk, dv), strict=True):
    np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6, atol=1e-7)


def test_sink_of_minus_infinity_is_no_sink():
  rng = np.random.default_rng(4)
  q, k, v = _rand(rng, (1, 8, 2, 4)), _rand(rng, (1, 8, 2, 4)), _rand(rng, (1, 8, 2, 4))
  got = reference_attention(q, k, v, is_causal=True, sinks=jnp.full((2,), -jnp.inf))
  assert_close(got, reference_attention(q, k, v, is_causal=True), F32)


@pytest.mark.parametrize("name", [*__import__("cases").SINKS, *__import__("cases").MLA])
def test_sinks_and_mla_cases_match_float64_oracle(name):
  """`reference_attention` (the suites' reference) against the independent float64 oracle on every sinks and MLA
  case of the registry: forward and every gradient, dsinks included, in f32 to 1e-5."""
  from cases import make_inputs, make_sinks, oracle_with_grads, pick, reference_with_grads

  (case,) = pick(name)
  q, k, v, do, seg = make_inputs(case, F32)
  sinks = make_sinks(case)
  out, grads = reference_with_grads(case, q, k, v, do, seg, sinks)
  o_out, o_grads = oracle_with_grads(case, q, k, v, do, seg, sinks)
  assert out.shape == (case.B, case.T, case.N, case.v_dim)
  assert_close(out, o_out, F32, "fwd")
  assert len(grads) == len(o_grads)
  for g, og in zip(grads, o_grads, strict=True):
    assert_close(g, og, F32, "grad")
  if name == "sinks_empty_rows":  # every empty row's mass is in its sink: output exactly 0, no NaN
    empty = np.asarray(seg[0] == 3)
    assert empty.any() and np.all(np.asarray(out)[empty] == 0.0) and np.isfinite(np.asarray(grads[3])).all()

"""Property-based fuzzing of the public ops and layers against the float64 oracles (issue 30, item 7).

* valid draws (shapes, causal, windows up to 2**31 - 1 and 10**12, soft cap, segments, sinks, scale, MLA head dims)
  of `ring_attention` (XLA; no mesh, or a mesh of 1, 2 or 4 devices with the ring, all_gather and ulysses
  strategies, zigzag or not), `dot_product_attention` (dense masks and biases), `paged_attention`,
  `RingMultiHeadAttention`, `PagedMultiHeadAttention` and `convert` match tests/dense_oracle.py and
  tests/paged_oracle.py (convert: the unconverted model) at the float32 tolerance; gradients for a subset;
* invalid draws raise the library's error naming the argument (`fuzz_strategies.expect_library_error`), and
  leave a paged layer's cache as it was;
* empty inputs (B = 0, T = 0, no query rows) give empty outputs of the right shape.

Programs are jitted with the options static, so each example compiles once; shapes come from small sets.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from dense_oracle import dense_oracle
from flax import nnx
from fuzz_strategies import (
  BAD_SOFT_CAPS,
  BAD_WINDOWS,
  HEAD_LAYOUTS,
  PAGED_GEOMETRIES,
  DenseDraw,
  PagedDraw,
  assert_unchanged,
  bounded_shrinking,
  dense_draws,
  dense_expected,
  expect_library_error,
  fuzz_settings,
  paged_draws,
  paged_seqs,
  seeds,
  snapshot,
  soft_caps,
  windows,
)
from hypothesis import example, given
from hypothesis import strategies as st
from paged_oracle import paged_oracle
from tolerances import assert_close

import flax_ringattn as fr

F32 = jnp.float32
HUGE = (2**31 - 1, 10**12)


@pytest.fixture(autouse=True)
def _bounded_shrinking():
  with bounded_shrinking():
    yield


_MESHES: dict = {}


def _mesh(n: int):
  if n not in _MESHES:
    _MESHES[n] = make_mesh((n,), ("sp",))
  return _MESHES[n]


# -- jitted entry points (options static: one compile per example) ---------------------------------------------------

_RING_STATIC = ("is_causal", "local_window_size", "logits_soft_cap", "scale", "mesh", "strategy", "load_balance")


def _ring(q, k, v, seg, sinks, is_causal, local_window_size, logits_soft_cap, scale, mesh, strategy, load_balance):
  return fr.ring_attention(
    q,
    k,
    v,
    segment_ids=seg,
    sinks=sinks,
    is_causal=is_causal,
    local_window_size=local_window_size,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    mesh=mesh,
    strategy=strategy,
    load_balance=load_balance,
    implementation="xla",
  )


@functools.partial(jax.jit, static_argnames=_RING_STATIC)
def ring_fwd(
  q,
  k,
  v,
  seg,
  sinks,
  *,
  is_causal,
  local_window_size,
  logits_soft_cap,
  scale,
  mesh=None,
  strategy="ring",
  load_balance=False,
):
  return _ring(q, k, v, seg, sinks, is_causal, local_window_size, logits_soft_cap, scale, mesh, strategy, load_balance)


@functools.partial(jax.jit, static_argnames=_RING_STATIC)
def ring_vjp(
  q,
  k,
  v,
  seg,
  sinks,
  do,
  *,
  is_causal,
  local_window_size,
  logits_soft_cap,
  scale,
  mesh=None,
  strategy="ring",
  load_balance=False,
):
  static = (is_causal, local_window_size, logits_soft_cap, scale, mesh, strategy, load_balance)
  if sinks is None:
    out, pullback = jax.vjp(lambda q, k, v: _ring(q, k, v, seg, None, *static), q, k, v)
  else:
    out, pullback = jax.vjp(lambda q, k, v, s: _ring(q, k, v, seg, s, *static), q, k, v, sinks)
  return out, pullback(do)


_PAGED_STATIC = ("local_window_size", "logits_soft_cap", "scale", "block_sizes")


def _paged(args, sinks, local_window_size, logits_soft_cap, scale, block_sizes):
  return fr.paged_attention(
    *args,
    sinks=sinks,
    local_window_size=local_window_size,
    logits_soft_cap=logits_soft_cap,
    scale=scale,
    block_sizes=block_sizes,
    implementation="xla",
  )


@functools.partial(jax.jit, static_argnames=_PAGED_STATIC)
def paged_fwd(args, sinks, *, local_window_size, logits_soft_cap, scale, block_sizes):
  return _paged(args, sinks, local_window_size, logits_soft_cap, scale, block_sizes)


@functools.partial(jax.jit, static_argnames=_PAGED_STATIC)
def paged_vjp(args, sinks, do, *, local_window_size, logits_soft_cap, scale, block_sizes):
  static = (local_window_size, logits_soft_cap, scale, block_sizes)
  rest = args[3:]
  if sinks is None:
    out, pullback = jax.vjp(lambda q, kp, vp: _paged((q, kp, vp, *rest), None, *static), *args[:3])
  else:
    out, pullback = jax.vjp(lambda q, kp, vp, s: _paged((q, kp, vp, *rest), s, *static), *args[:3], sinks)
  return out, pullback(do)


def _assert_dense(d: DenseDraw, got, want, kind="fwd"):
  assert tuple(got.shape) == tuple(want.shape), (got.shape, want.shape)
  assert got.dtype == F32, got.dtype
  assert_close(got, want, F32, kind)


# -- ring_attention ---------------------------------------------------------------------------------------------------

# Huge windows, each side alone and both, causal and not, with the other features on.
HUGE_EXAMPLES = (
  DenseDraw(B=1, T=4, S=4, window=HUGE, is_causal=True, segments="self", sinks=True, seed=1),
  DenseDraw(B=2, T=3, S=8, N=4, K=2, window=(10**12, 0), soft_cap=2.0, segments="pair", seed=2),
  DenseDraw(B=1, T=8, S=3, window=2**31 - 1, scale=0.5, Hv=5, seed=3),
  DenseDraw(B=1, T=4, S=4, window=(0, 10**12), is_causal=True, soft_cap=30.0, seed=4),
)


@fuzz_settings(5)
@given(dense_draws())
@example(HUGE_EXAMPLES[0])
@example(HUGE_EXAMPLES[1])
@example(HUGE_EXAMPLES[2])
def test_ring_attention_matches_oracle(d):
  # Two draws of the values (and segment ids) per compile.
  for seed in (d.seed, d.seed + 100):
    q, k, v, seg, sinks = dataclasses.replace(d, seed=seed).arrays()
    got = ring_fwd(q, k, v, seg, sinks, **d.options)
    want, _ = dense_expected(d, q, k, v, seg, sinks)
    _assert_dense(d, got, want)


@fuzz_settings(2)
@given(dense_draws(lengths=(3, 4), batch=(1,)))
@example(HUGE_EXAMPLES[3])
def test_ring_attention_grads_match_oracle(d):
  q, k, v, seg, sinks = d.arrays()
  do = d.cotangent()
  out, grads = ring_vjp(q, k, v, seg, sinks, do, **d.options)
  want, want_grads = dense_expected(d, q, k, v, seg, sinks, do=do)
  _assert_dense(d, out, want)
  assert len(grads) == len(want_grads)
  for name, g, w in zip(("dq", "dk", "dv", "dsinks"), grads, want_grads, strict=False):
    assert tuple(g.shape) == tuple(w.shape), (name, g.shape, w.shape)
    assert_close(g, w, F32, "grad")


@dataclasses.dataclass(frozen=True)
class MeshDraw:
  problem: DenseDraw
  devices: int = 2
  strategy: str = "ring"
  load_balance: bool = False
  grads: bool = False


@st.composite
def mesh_draws(draw):
  n = draw(st.sampled_from([1, 2, 4]))
  strategy = draw(st.sampled_from(["ring", "all_gather", "ulysses"]))
  load_balance = draw(st.booleans())
  per = 2 * n if load_balance else n
  heads = [(N, K) for N, K in HEAD_LAYOUTS if strategy != "ulysses" or N % n == 0]
  d = draw(dense_draws(lengths=(4, 8), multiple=per, heads=heads, batch=(1, 2)))
  return MeshDraw(problem=d, devices=n, strategy=strategy, load_balance=load_balance, grads=draw(st.booleans()))


@fuzz_settings(2)
@given(mesh_draws())
@example(MeshDraw(problem=dataclasses.replace(HUGE_EXAMPLES[0], T=8, S=8), devices=4, load_balance=True, grads=True))
def test_ring_attention_on_mesh_matches_oracle(m):
  d, n = m.problem, m.devices
  q, k, v, seg, sinks = d.arrays()
  do = d.cotangent()
  want, want_grads = dense_expected(d, q, k, v, seg, sinks, do=do if m.grads else None)
  if m.load_balance:
    z = lambda x: None if x is None else np.asarray(fr.zigzag_order(x, n, axis=1))  # noqa: E731
    zq, zk, zv = z(q), z(k), z(v)
    zseg = tuple(z(s) for s in seg) if isinstance(seg, tuple) else z(seg)
    zdo = z(do)
  else:
    zq, zk, zv, zseg, zdo = q, k, v, seg, do
  static = dict(d.options, mesh=_mesh(n), strategy=m.strategy, load_balance=m.load_balance)
  unzip = (lambda x: np.asarray(fr.zigzag_inverse(np.asarray(x), n, axis=1))) if m.load_balance else np.asarray
  if not m.grads:
    _assert_dense(d, unzip(ring_fwd(zq, zk, zv, zseg, sinks, **static)), want)
    return
  out, grads = ring_vjp(zq, zk, zv, zseg, sinks, zdo, **static)
  _assert_dense(d, unzip(out), want)
  for i, (g, w) in enumerate(zip(grads, want_grads, strict=True)):
    g = unzip(g) if i < 3 else np.asarray(g)  # dq, dk, dv in the zigzag layout; dsinks [N]
    assert_close(g, w, F32, "grad")


# -- dot_product_attention: the model's own dense mask or bias -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MaskDraw:
  problem: DenseDraw
  mask: str = "none"  # "none", "causal_2d", "segments_3d", "padding_4d"
  causal_in_mask: bool = False
  as_bias: float | None = None  # the hidden value of an additive bias (None: a boolean mask)
  jit: bool = False


@st.composite
def mask_draws(draw):
  T = draw(st.sampled_from([3, 4, 8]))
  base = draw(dense_draws(lengths=(T,), batch=(1, 2)))
  d = dataclasses.replace(base, segments="none")
  mask = draw(st.sampled_from(["none", "causal_2d", "segments_3d", "padding_4d"]))
  bias = draw(st.one_of(st.none(), st.sampled_from([-np.inf, -1e9, -1e6]))) if mask != "none" else None
  return MaskDraw(problem=d, mask=mask, causal_in_mask=draw(st.booleans()), as_bias=bias, jit=draw(st.booleans()))


def _window_mask(T, window):
  if window is None:
    return np.ones((T, T), bool)
  left, right = (window, window) if isinstance(window, int) else window
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  return (j >= i - min(left, T)) & (j <= i + min(right, T))


def _mask_and_structure(m: MaskDraw, rng):
  """(the dense mask or bias handed to the op, the oracle's (is_causal, segment_ids))."""
  d = m.problem
  B, T = d.B, d.T
  causal = m.causal_in_mask and m.mask != "none"
  tril = np.tril(np.ones((T, T), bool)) if causal else np.ones((T, T), bool)
  win = _window_mask(T, d.window)
  seg = None
  if m.mask == "none":
    return None, (d.is_causal, None)
  if m.mask == "causal_2d":
    dense = np.tril(np.ones((T, T), bool)) & win
    causal = True
  elif m.mask == "segments_3d":
    ids = rng.integers(0, 3, (B, T)).astype(np.int32)
    seg = ids
    dense = (ids[:, :, None] == ids[:, None, :]) & tril & win
    if B == d.N > 1:  # 3-D with B == N is refused as ambiguous (test_dense_masks.py): the [B, 1, T, S] spelling
      dense = dense[:, None]
  else:  # key padding: query rows see the valid keys
    valid = rng.random((B, T)) < 0.7
    seg = (np.ones((B, T), np.int32), valid.astype(np.int32))
    dense = valid[:, None, None, :] & tril & win
  if m.as_bias is not None:
    dense = np.where(dense, 0.0, m.as_bias).astype(np.float32)
  return dense, (d.is_causal or causal, seg)


@fuzz_settings(4)
@given(mask_draws())
@example(MaskDraw(problem=dataclasses.replace(HUGE_EXAMPLES[0], segments="none"), mask="segments_3d", jit=True))
def test_dot_product_attention_matches_oracle(m):
  d = m.problem
  q, k, v, _, sinks = d.arrays()
  dense, (causal, seg) = _mask_and_structure(m, np.random.default_rng(d.seed + 7))
  kind = "bias" if m.as_bias is not None else "mask"

  def call(q, k, v, sinks, dense):
    extra = {} if dense is None else {kind: dense}
    return fr.dot_product_attention(q, k, v, sinks=sinks, implementation="xla", **d.options, **extra)

  got = jax.jit(call)(q, k, v, sinks, dense) if m.jit else call(q, k, v, sinks, dense)
  want, _ = dense_oracle(
    q,
    k,
    v,
    is_causal=causal,
    local_window_size=d.window,
    segment_ids=seg,
    logits_soft_cap=d.soft_cap,
    scale=d.scale,
    sinks=sinks,
  )
  _assert_dense(d, got, want)


# -- paged_attention --------------------------------------------------------------------------------------------------

PAGED_EXAMPLES = (
  PagedDraw(
    batches=(((2, 5), (0, 3), (3, 3)), ()),  # the second: num_seqs = 0, every row is padding
    window=HUGE,
    soft_cap=2.0,
    sinks=True,
    seed=1,
  ),
  PagedDraw(
    geometry=PAGED_GEOMETRIES[1],
    batches=(((4, 9),), ((1, 12), (2, 2))),
    N=4,
    K=2,
    Hv=5,
    window=(10**12, 0),
    block=(1, 1),
    garbage=True,
    seed=2,
  ),
)


def _paged_expected(d: PagedDraw, b, do=None):
  return paged_oracle(*b.args, sinks=b.sinks, do=do, **d.options)


@fuzz_settings(3)
@given(paged_draws())
@example(PAGED_EXAMPLES[0])
@example(PAGED_EXAMPLES[1])
def test_paged_attention_matches_oracle(d):
  # Every batch of the draw runs through the one compiled program: the metadata is data.
  for i in range(len(d.batches)):
    b = d.batch(i)
    got = paged_fwd(b.args, b.sinks, block_sizes=d.block_sizes, **d.options)
    want, _ = _paged_expected(d, b)
    assert tuple(got.shape) == want.shape
    assert_close(got, want, F32)


@fuzz_settings(1)
@given(paged_draws(geometries=PAGED_GEOMETRIES[:1], batches=1, nonempty=True))
def test_paged_attention_accepts_numpy_inputs(d):
  """Called eagerly on numpy arrays (as JAX functions take them), the op matches the oracle."""
  b = d.batch()
  args = tuple(np.asarray(x) for x in b.args)
  sinks = None if b.sinks is None else np.asarray(b.sinks)
  got = fr.paged_attention(*args, sinks=sinks, block_sizes=d.block_sizes, implementation="xla", **d.options)
  want, _ = _paged_expected(d, b)
  assert_close(got, want, F32)


@fuzz_settings(1)
@given(paged_draws(geometries=PAGED_GEOMETRIES[:1], batches=2, nonempty=True))
@example(PAGED_EXAMPLES[0])
def test_paged_attention_grads_match_oracle(d):
  do = d.cotangent()
  for i in range(len(d.batches)):
    b = d.batch(i)
    out, grads = paged_vjp(b.args, b.sinks, do, block_sizes=d.block_sizes, **d.options)
    want, want_grads = _paged_expected(d, b, do=do)
    assert_close(out, want, F32)
    assert len(grads) == len(want_grads)
    for g, w in zip(grads, want_grads, strict=True):
      assert tuple(g.shape) == w.shape
      assert_close(g, w, F32, "grad")


# -- layers: numpy projections around the oracle --------------------------------------------------------------------


def _randomize(module, seed):
  """Every parameter (kernels, biases, sinks) to random values: zeros would hide a bias or a sink."""
  rng = np.random.default_rng(seed)
  for _, var in nnx.iter_graph(module):
    if isinstance(var, nnx.Param):
      value = var.get_value()
      var.set_value(jnp.asarray(0.3 * rng.standard_normal(value.shape), value.dtype))


def _p(module, name):
  return np.asarray(getattr(module, name)[...], np.float64)


def _project(layer, x):
  """numpy float64 (q, k, v) of inputs x [..., F]."""
  x = np.asarray(x, np.float64)
  return tuple(
    np.einsum("...f,fnh->...nh", x, _p(m, "kernel")) + _p(m, "bias") for m in (layer.query, layer.key, layer.value)
  )


def _out(layer, o):
  return np.einsum("...nh,nhf->...f", o, _p(layer.out, "kernel")) + _p(layer.out, "bias")


def _sinks(layer):
  return None if layer.sinks is None else _p(layer, "sinks")


@dataclasses.dataclass(frozen=True)
class RingLayerDraw:
  problem: DenseDraw
  features: int = 6
  devices: int | None = None  # None: no mesh


@st.composite
def ring_layer_draws(draw):
  devices = draw(st.sampled_from([None, 2]))
  T = draw(st.sampled_from([4, 8] if devices else [3, 4]))
  d = draw(dense_draws(lengths=(T,)))
  # A layer is self attention: T == S, v's head dim from v_head_dim.
  return RingLayerDraw(problem=d, features=draw(st.sampled_from([5, 8])), devices=devices)


def _ring_layer(r: RingLayerDraw):
  d = r.problem
  layer = fr.RingMultiHeadAttention(
    d.N,
    r.features,
    d.N * d.H,
    num_kv_heads=d.K,
    v_head_dim=d.Hv,
    use_sinks=d.sinks,
    local_window_size=d.window,
    logits_soft_cap=d.soft_cap,
    scale=d.scale,
    mesh=None if r.devices is None else _mesh(r.devices),
    implementation="xla",
    rngs=nnx.Rngs(d.seed),
  )
  _randomize(layer, d.seed)
  return layer


@fuzz_settings(1)
@given(ring_layer_draws())
@example(RingLayerDraw(problem=dataclasses.replace(HUGE_EXAMPLES[0], T=8, S=8), devices=2))
def test_ring_layer_matches_oracle(r):
  d = r.problem
  layer = _ring_layer(r)
  rng = np.random.default_rng(d.seed + 3)
  x = rng.standard_normal((d.B, d.T, r.features)).astype(np.float32)
  _, _, _, seg, _ = d.arrays()
  got = nnx.jit(lambda layer, x, seg: layer(x, is_causal=d.is_causal, segment_ids=seg))(layer, x, seg)
  q, k, v = _project(layer, x)
  o, _ = dense_oracle(
    q,
    k,
    v,
    is_causal=d.is_causal,
    local_window_size=d.window,
    segment_ids=seg,
    logits_soft_cap=d.soft_cap,
    scale=d.scale,
    sinks=_sinks(layer),
  )
  want = _out(layer, o)
  assert tuple(got.shape) == want.shape
  assert_close(got, want, F32)


@dataclasses.dataclass(frozen=True)
class PagedLayerDraw:
  N: int = 2
  K: int = 1
  H: int = 4
  Hv: int = 4
  window: object = None
  soft_cap: float | None = None
  sinks: bool = False
  steps: tuple = ((1, 0, 0), (1, 1, 0))  # per serving step: the new tokens of each slot (rows back to back)
  seed: int = 0


LAYER_CACHE = dict(num_pages=12, page_size=2, max_num_seqs=3, pages_per_seq=4)
LAYER_T, LAYER_F = 6, 6


@st.composite
def paged_layer_draws(draw):
  N, K = draw(st.sampled_from(HEAD_LAYOUTS))
  H = draw(st.sampled_from([2, 4]))
  S, cap = LAYER_CACHE["max_num_seqs"], LAYER_CACHE["pages_per_seq"] * LAYER_CACHE["page_size"]
  held = [0] * S
  steps = []
  for step in range(2):
    q_lens, left = [], LAYER_T
    for s in range(S):
      # Slot 0's first step has a token: hypothesis' first (simplest) draw still serves something.
      q = draw(st.integers(int(step == 0 and s == 0), min(left, cap - held[s], 4)))
      held[s] += q
      left -= q
      q_lens.append(q)
    steps.append(tuple(q_lens))
  return PagedLayerDraw(
    N=N,
    K=K,
    H=H,
    Hv=draw(st.sampled_from([H, H + 1])),
    window=draw(windows),
    soft_cap=draw(soft_caps),
    sinks=draw(st.booleans()),
    steps=tuple(steps),
    seed=draw(seeds),
  )


def _paged_layer(p: PagedLayerDraw):
  layer = fr.PagedMultiHeadAttention(
    p.N,
    LAYER_F,
    p.N * p.H,
    num_kv_heads=p.K,
    v_head_dim=p.Hv,
    use_sinks=p.sinks,
    local_window_size=p.window,
    logits_soft_cap=p.soft_cap,
    implementation="xla",
    rngs=nnx.Rngs(p.seed),
  )
  _randomize(layer, p.seed)
  layer.init_cache(**LAYER_CACHE)
  return layer


@nnx.jit
def _layer_step(layer, x, cu_q_lens, num_seqs):
  return layer(x, cu_q_lens=cu_q_lens, num_seqs=num_seqs)


def _cu(q_lens):
  return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


@fuzz_settings(1)
@given(paged_layer_draws())
@example(PagedLayerDraw(window=HUGE, sinks=True, steps=((3, 0, 2), (1, 4, 1)), seed=1))
def test_paged_layer_matches_oracle(p):
  """Two serving steps; every row equals the oracle over the slot's whole history (its earlier tokens too)."""
  layer = _paged_layer(p)
  rng = np.random.default_rng(p.seed + 5)
  history = [np.zeros((0, LAYER_F)) for _ in p.steps[0]]
  for q_lens in p.steps:
    x = rng.standard_normal((LAYER_T, LAYER_F)).astype(np.float32)  # rows past the batch are padding
    cu = _cu(q_lens)
    got = np.asarray(_layer_step(layer, jnp.asarray(x), jnp.asarray(cu), jnp.asarray([len(q_lens)], jnp.int32)))
    assert got.shape == (LAYER_T, LAYER_F)
    want = np.tile(_p(layer.out, "bias"), (LAYER_T, 1))  # padding rows attend to nothing: out(0) = the out bias
    for s, n in enumerate(q_lens):
      rows = x[cu[s] : cu[s + 1]]
      history[s] = np.concatenate([history[s], rows])
      if n == 0:
        continue
      q, k, v = _project(layer, history[s][None])
      L = history[s].shape[0]
      o, _ = dense_oracle(
        q[:, L - n :],
        k,
        v,
        is_causal=True,
        local_window_size=p.window,
        q_positions=np.arange(L - n, L),
        logits_soft_cap=p.soft_cap,
        sinks=_sinks(layer),
      )
      want[cu[s] : cu[s + 1]] = _out(layer, o)[0]
    assert_close(got, want, F32)
  np.testing.assert_array_equal(np.asarray(layer.kv_cache.get_value().kv_lens), [h.shape[0] for h in history])


# -- convert ----------------------------------------------------------------------------------------------------------


class _Tiny(nnx.Module):
  """embedding -> nnx.MultiHeadAttention (residual) -> head."""

  def __init__(self, features, num_heads, num_kv_heads, qkv, *, rngs):
    self.embed = nnx.Linear(features, features, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
      num_heads, features, qkv, num_kv_heads=num_kv_heads, decode=False, deterministic=True, rngs=rngs
    )
    self.head = nnx.Linear(features, 3, rngs=rngs)

  def __call__(self, x, mask=None, is_causal=False):
    h = self.embed(x)
    return self.head(h + self.attn(h, mask=mask, is_causal=is_causal))


@dataclasses.dataclass(frozen=True)
class ConvertDraw:
  B: int = 1
  T: int = 4
  N: int = 2
  K: int = 1
  head_dim: int = 2
  mask: str = "causal"  # "none", "causal" (is_causal=True), "causal_mask", "padding"
  devices: int | None = None
  seed: int = 0


@st.composite
def convert_draws(draw):
  N, K = draw(st.sampled_from(HEAD_LAYOUTS))
  devices = draw(st.sampled_from([None, 1, 2]))
  return ConvertDraw(
    B=draw(st.sampled_from([1, 2])),
    T=draw(st.sampled_from([4, 8] if devices else [3, 4])),
    N=N,
    K=K,
    head_dim=draw(st.sampled_from([2, 4])),
    mask=draw(st.sampled_from(["none", "causal", "causal_mask", "padding"])),
    devices=devices,
    seed=draw(seeds),
  )


@fuzz_settings(1)
@given(convert_draws())
@example(ConvertDraw(B=2, T=8, N=4, K=2, mask="padding", devices=2, seed=1))
def test_convert_matches_original(c):
  F = 8
  model = _Tiny(F, c.N, c.K, c.N * c.head_dim, rngs=nnx.Rngs(c.seed))
  _randomize(model, c.seed)
  original = nnx.clone(model)
  # handwritten=False: the model has no hand-written attention, and the search for it costs a trace per module.
  report = fr.convert(model, mesh=None if c.devices is None else _mesh(c.devices), handwritten=False)
  assert report.replaced == ["attn"], str(report)
  assert isinstance(model.attn, fr.RingMultiHeadAttention)
  rng = np.random.default_rng(c.seed + 1)
  x = rng.standard_normal((c.B, c.T, F)).astype(np.float32)
  valid = np.ones((c.B, c.T), bool)
  kw = {}
  if c.mask == "causal":
    kw = dict(is_causal=True)
  elif c.mask == "causal_mask":
    kw = dict(mask=nnx.make_causal_mask(jnp.ones((c.B, c.T)), dtype=bool))
  elif c.mask == "padding":
    valid = np.arange(c.T)[None] < rng.integers(1, c.T + 1, (c.B, 1))
    causal = nnx.make_causal_mask(jnp.ones((c.B, c.T)), dtype=bool)
    kw = dict(mask=nnx.make_attention_mask(valid, valid, dtype=bool) & causal)
  mask = kw.pop("mask", None)
  got = np.asarray(nnx.jit(lambda m, x, mask: m(x, mask=mask, **kw))(model, x, mask))
  want = np.asarray(original(x, mask=mask, **kw))
  assert got.shape == want.shape
  # Padding queries see no key: flax averages every value there, ring attention gives 0; compare the real rows.
  assert_close(got[valid], want[valid], F32)


# -- invalid draws ----------------------------------------------------------------------------------------------------


def _show(x):
  """Arrays as dtype[shape] (the falsifying example stays readable), other values as they are."""
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return f"{jnp.dtype(x.dtype).name}{list(x.shape)}" + (
      f"={np.asarray(x).tolist()}" if x.ndim == 1 and x.size <= 8 else ""
    )
  if isinstance(x, (tuple, list)):
    return "(" + ", ".join(_show(y) for y in x) + ")"
  return repr(x)


@dataclasses.dataclass(frozen=True)
class InvalidCall:
  """An op call that must raise the library's error naming one of `names`; its repr shows the call."""

  op: str  # "ring", "dpa" or "paged_attention"
  args: tuple
  kwargs: dict
  names: tuple
  errors: tuple

  def run(self):
    fn = {"ring": fr.ring_attention, "dpa": fr.dot_product_attention, "paged_attention": fr.paged_attention}[self.op]
    return fn(*self.args, **self.kwargs)

  def __repr__(self):
    args = ", ".join([_show(a) for a in self.args] + [f"{k}={_show(v)}" for k, v in self.kwargs.items()])
    return f"{self.op}({args}) -> must name one of {list(self.names)}"

  def _repr_pretty_(self, p, cycle):  # hypothesis prints falsifying examples with this
    p.text(repr(self))


def _qkv(B=1, T=4, S=4, N=2, K=1, H=4, Hv=4, dtype=np.float32, seed=0):
  rng = np.random.default_rng(seed)
  return tuple(rng.standard_normal(s).astype(dtype) for s in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv)))


@st.composite
def ring_invalid_draws(draw, kind):
  """An `InvalidCall` of `ring_attention` or `dot_product_attention` with one bad argument (`kind`)."""
  op = draw(st.sampled_from(["ring", "dpa"]))
  seed = draw(seeds)
  B, T, S = draw(st.sampled_from([1, 2])), draw(st.sampled_from([2, 4])), draw(st.sampled_from([2, 4]))
  N, K = draw(st.sampled_from(HEAD_LAYOUTS))
  q, k, v = _qkv(B, T, S, N, K, seed=seed)
  kw = dict(implementation="xla")
  names, errors = (kind,), (ValueError, TypeError)
  which = draw(st.sampled_from(["q", "k", "v"]))
  x = dict(q=q, k=k, v=v)
  if kind == "rank":
    rank = draw(st.sampled_from([2, 3, 5]))
    arr = x[which]
    x[which] = arr.reshape(arr.shape[: rank - 1] + (-1,)) if rank < 4 else arr[..., None]
    names = (which,)
  elif kind == "layout":
    # q, k, v as [B, N, T, H] / [B, K, S, H]: read as [B, T, N, H], the heads no longer divide (T % S != 0).
    T, S = draw(st.sampled_from([(3, 2), (4, 3), (2, 4), (5, 4)]))
    q, k, v = _qkv(B, T, S, N, K, seed=seed)
    x = dict(q=q.transpose(0, 2, 1, 3), k=k.transpose(0, 2, 1, 3), v=v.transpose(0, 2, 1, 3))
    names = ("q", "k")
  elif kind == "dtype":
    x[which] = x[which].astype(draw(st.sampled_from([jnp.bfloat16, jnp.float16, np.float64])))
    names = ("q", "k", "v", "dtype")
  elif kind == "int_dtype":
    x[which] = x[which].astype(np.int32)
    names = (which,)
  elif kind == "heads":
    N, K = draw(st.sampled_from([(3, 2), (2, 4), (1, 2), (4, 3)]))
    x = dict(zip("qkv", _qkv(B, T, S, N, K, seed=seed), strict=True))
    names = ("q", "k", "heads")
  elif kind == "head_dim":
    x["k"] = _qkv(B, T, S, N, K, H=draw(st.sampled_from([2, 3, 8])), seed=seed)[1]
    names = ("q", "k", "head_dim")
  elif kind == "kv_shape":
    x["v"] = _qkv(B, T, S + draw(st.sampled_from([1, 2])), N, K, seed=seed)[2]
    names = ("k", "v")
  elif kind == "batch":
    x["k"] = _qkv(B + 1, T, S, N, K, seed=seed)[1]
    names = ("q", "k", "batch")
  elif kind == "local_window_size":
    value, error = draw(st.sampled_from(BAD_WINDOWS))
    kw["local_window_size"], errors = value, (error,)
  elif kind == "logits_soft_cap":
    kw["logits_soft_cap"] = draw(st.sampled_from(BAD_SOFT_CAPS))
  elif kind == "scale":
    kw["scale"] = draw(st.sampled_from([float("nan"), float("inf"), "0.5", jnp.float32(0.5)]))
  elif kind == "segment_ids":
    bad = draw(st.sampled_from(["float", "shape", "self_cross", "triple"]))
    if bad == "float":
      kw["segment_ids"] = np.zeros((B, T), np.float32) if T == S else (np.zeros((B, T), np.float32), np.zeros((B, S)))
    elif bad == "shape":
      kw["segment_ids"] = (np.zeros((B, T + 1), np.int32), np.zeros((B, S), np.int32))
    elif bad == "self_cross":
      q, k, v = _qkv(B, 2, 4, N, K, seed=seed)
      x = dict(q=q, k=k, v=v)
      kw["segment_ids"] = np.zeros((B, 2), np.int32)
    else:
      kw["segment_ids"] = (np.zeros((B, T), np.int32),) * 3
  elif kind == "sinks":
    kw["sinks"] = draw(
      st.sampled_from(
        [np.zeros((N + 1,), np.float32), np.zeros((N,), np.int32), [0.0] * N, np.zeros((1, N), np.float32)]
      )
    )
  elif kind == "dropout_rng":
    if op == "dpa":
      op = "ring"  # dot_product_attention has no dropout
    kw["dropout_rate"] = 0.25
    kw["dropout_rng"] = draw(
      st.sampled_from(
        [None, 3, np.zeros((2,), np.float32), np.zeros((3,), np.uint32), jax.random.split(jax.random.key(0), 2)]
      )
    )
  elif kind == "dropout_rate":
    op = "ring"
    kw["dropout_rate"] = draw(st.sampled_from([-0.1, 1.0, 1.5, "0.1"]))
    kw["dropout_rng"] = jax.random.key(0)
  elif kind == "is_causal":
    kw["is_causal"] = draw(st.sampled_from([1, "yes", None]))
  elif kind == "strategy":
    kw["strategy"] = draw(st.sampled_from(["rings", "", 3, None]))
  elif kind == "mesh_lengths":
    n = draw(st.sampled_from([2, 4]))
    T = draw(st.sampled_from([1, 3] if n == 2 else [2, 3, 6]))
    x = dict(zip("qkv", _qkv(B, T, T, N, K, seed=seed), strict=True))
    kw["mesh"] = _mesh(n)
    names = ("q_len", "kv_len")
  elif kind == "ulysses_heads":
    N, K = draw(st.sampled_from([(1, 1), (2, 1), (2, 2)]))
    x = dict(zip("qkv", _qkv(B, 4, 4, N, K, seed=seed), strict=True))
    kw.update(mesh=_mesh(4), strategy="ulysses")
    names = ("strategy", "N")
  elif kind == "mask":
    op = "dpa"
    q, k, v = _qkv(B, 4, 4, N, K, seed=seed)
    x = dict(q=q, k=k, v=v)
    bad = draw(st.sampled_from(["shape", "inexact", "both", "bias_values"]))
    rng = np.random.default_rng(seed)
    if bad == "shape":
      kw["mask"] = np.ones((B, 5, 4), bool)
    elif bad == "inexact":  # j <= i, but key 1 hidden from query 3 only: no (causal, window, segments) gives it
      m = np.tril(np.ones((4, 4), bool))
      m[3, 1] = False
      kw["mask"] = m
    elif bad == "both":
      kw["mask"], kw["bias"] = np.ones((4, 4), bool), np.zeros((4, 4), np.float32)
      names = ("mask", "bias")
    else:
      kw["bias"] = np.where(rng.random((4, 4)) < 0.5, 0.0, -5.0).astype(np.float32)
      names = ("mask", "bias")
  else:
    raise AssertionError(kind)
  return InvalidCall(op, (x["q"], x["k"], x["v"]), kw, names, errors)


RING_INVALID = (
  "rank",
  "layout",
  "dtype",
  "int_dtype",
  "heads",
  "head_dim",
  "kv_shape",
  "batch",
  "local_window_size",
  "logits_soft_cap",
  "scale",
  "segment_ids",
  "sinks",
  "dropout_rng",
  "dropout_rate",
  "is_causal",
  "strategy",
  "mesh_lengths",
  "ulysses_heads",
  "mask",
)


@pytest.mark.parametrize("kind", RING_INVALID)
def test_ring_attention_rejects_invalid(kind):
  @fuzz_settings(5)
  @given(ring_invalid_draws(kind))
  def check(draw):
    expect_library_error(draw.run, draw.names, draw.errors)

  check()


@st.composite
def paged_invalid_draws(draw, kind):
  """An `InvalidCall` of `paged_attention` with one bad argument or metadata value (`kind`)."""
  d = draw(paged_draws(geometries=PAGED_GEOMETRIES[:2], batches=0))
  g = d.geometry
  seqs = draw(paged_seqs(g, min_seqs=1))
  d = dataclasses.replace(d, batches=(seqs,), garbage=False)
  b = d.batch()
  a = dict(zip(("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens", "num_seqs"), b.args, strict=True))
  a = {n: np.asarray(x) for n, x in a.items()}
  kw = dict(implementation="xla", sinks=b.sinks)
  names, errors = (kind,), (ValueError, TypeError)
  n = len(seqs)
  cu = a["cu_q_lens"].copy()
  if kind == "q":
    a["q"] = draw(st.sampled_from([a["q"][None], a["q"][:, :, 0]]))
  elif kind == "k_pages":
    a["k_pages"] = draw(st.sampled_from([a["k_pages"][0], a["k_pages"][..., None]]))
  elif kind == "v_pages":
    a["v_pages"] = np.concatenate([a["v_pages"]] * 2, axis=draw(st.sampled_from([0, 1, 2])))
    names = ("k_pages", "v_pages")
  elif kind == "dtype":
    a["v_pages"] = a["v_pages"].astype(draw(st.sampled_from([jnp.bfloat16, jnp.float16])))
    names = ("k_pages", "v_pages")
  elif kind == "heads":  # N + 1 kv heads for N q heads
    a["k_pages"], a["v_pages"] = (np.repeat(a[n][:, :, :1], d.N + 1, axis=2) for n in ("k_pages", "v_pages"))
    names = ("q", "k_pages", "heads")
  elif kind == "head_dim":
    a["q"] = a["q"][..., :-1]
    names = ("q", "k_pages", "head_dim")
  elif kind == "local_window_size":
    value, error = draw(st.sampled_from(BAD_WINDOWS))
    kw["local_window_size"], errors = value, (error,)
  elif kind == "logits_soft_cap":
    kw["logits_soft_cap"] = draw(st.sampled_from(BAD_SOFT_CAPS))
  elif kind == "sinks":
    kw["sinks"] = draw(st.sampled_from([np.zeros((d.N + 1,), np.float32), np.zeros((d.N,), np.int32)]))
  elif kind == "cu_q_lens_start":
    cu[: n + 1] += draw(st.sampled_from([1, -1, 3]))
    a["cu_q_lens"], names = cu, ("cu_q_lens",)
  elif kind == "cu_q_lens_decreasing":
    i = draw(st.integers(1, n))
    cu[i] = cu[i - 1] - draw(st.integers(1, 3))
    a["cu_q_lens"], names = cu, ("cu_q_lens",)
  elif kind == "cu_q_lens_total":
    cu[n] = g.num_tokens + draw(st.integers(1, 4))
    a["cu_q_lens"], names = cu, ("cu_q_lens",)
  elif kind == "num_seqs":
    a["num_seqs"] = np.asarray([draw(st.sampled_from([-1, g.max_num_seqs + 1, 100]))], np.int32)
  elif kind == "page_indices":
    live = [i for i, (_, kv) in enumerate(seqs) if kv > 0]
    if not live:
      seqs = ((0, 1),) + seqs[1:]
      b = dataclasses.replace(d, batches=(seqs,)).batch()
      a = {nm: np.asarray(x) for nm, x in zip(a, b.args, strict=True)}
      live = [0]
    s = draw(st.sampled_from(live))
    j = draw(st.integers(0, -(-seqs[s][1] // g.page_size) - 1))
    table = a["page_indices"].copy()
    table[s, j] = draw(st.sampled_from([-1, g.num_pages, g.num_pages + 7, -100]))
    a["page_indices"] = table
  elif kind == "kv_lens":
    s = draw(st.integers(0, n - 1))
    kv = a["kv_lens"].copy()
    q_len = int(cu[s + 1] - cu[s])
    kv[s] = draw(st.sampled_from([-1, g.capacity + 1] + ([q_len - 1] if q_len > 0 else [])))
    a["kv_lens"] = kv
  elif kind == "metadata_dtype":
    name = draw(st.sampled_from(["kv_lens", "page_indices", "cu_q_lens", "num_seqs"]))
    a[name] = a[name].astype(np.float32)
    names = (name,)
  else:
    raise AssertionError(kind)
  # jax arrays: numpy pages are another property (test_paged_attention_accepts_numpy_inputs)
  return InvalidCall("paged_attention", tuple(jnp.asarray(x) for x in a.values()), kw, names, errors)


PAGED_INVALID = (
  "q",
  "k_pages",
  "v_pages",
  "dtype",
  "heads",
  "head_dim",
  "local_window_size",
  "logits_soft_cap",
  "sinks",
  "cu_q_lens_start",
  "cu_q_lens_decreasing",
  "cu_q_lens_total",
  "num_seqs",
  "page_indices",
  "kv_lens",
  "metadata_dtype",
)


@pytest.mark.parametrize("kind", PAGED_INVALID)
def test_paged_attention_rejects_invalid(kind):
  @fuzz_settings(5)
  @given(paged_invalid_draws(kind))
  def check(draw):
    expect_library_error(draw.run, draw.names, draw.errors)

  check()


LAYER_INVALID = ("local_window_size", "logits_soft_cap", "scale", "strategy", "in_features", "rank", "segment_ids")


@pytest.mark.parametrize("kind", LAYER_INVALID)
def test_ring_layer_rejects_invalid(kind):
  @fuzz_settings(4)
  @given(data=st.data())
  def check(data):
    N, K = data.draw(st.sampled_from(HEAD_LAYOUTS))
    options, names, errors = {}, (kind,), (ValueError, TypeError)
    if kind == "local_window_size":
      options[kind], error = data.draw(st.sampled_from(BAD_WINDOWS))
      errors = (error,)
    elif kind == "logits_soft_cap":
      options[kind] = data.draw(st.sampled_from(BAD_SOFT_CAPS))
    elif kind == "scale":
      options[kind] = data.draw(st.sampled_from([float("nan"), "1.0", float("-inf")]))
    elif kind == "strategy":
      options[kind] = data.draw(st.sampled_from(["rings", 0]))
    x = np.zeros((1, 4, 6), np.float32)
    seg = None
    if kind == "in_features":
      x = np.zeros((1, 4, data.draw(st.sampled_from([5, 7]))), np.float32)
      names = ("inputs_q", "in_features")
    elif kind == "rank":
      # [features] alone: nnx.MultiHeadAttention takes [..., length, features]
      x = np.zeros((6,), np.float32)
      names = ("inputs_q", "inputs", "q")
    elif kind == "segment_ids":
      seg = data.draw(st.sampled_from([np.zeros((1, 5), np.int32), np.zeros((1, 4), np.float32)]))

    def build_and_call():
      layer = fr.RingMultiHeadAttention(N, 6, 2 * N, num_kv_heads=K, implementation="xla", rngs=nnx.Rngs(0), **options)
      return layer(x, segment_ids=seg)

    expect_library_error(build_and_call, names, errors)

  check()


PAGED_LAYER_INVALID = ("cu_q_lens_start", "cu_q_lens_decreasing", "num_seqs", "in_features", "rank", "overflow")


@pytest.mark.parametrize("kind", PAGED_LAYER_INVALID)
def test_paged_layer_rejects_invalid_and_keeps_its_cache(kind):
  """An invalid eager step raises and leaves the layer's cache (every leaf) and parameters as they were."""

  @fuzz_settings(3)
  @given(first=st.tuples(*[st.integers(0, 2)] * LAYER_CACHE["max_num_seqs"]), seed=seeds, data=st.data())
  def check(first, seed, data):
    # One layer configuration (its first step compiles once); the draws are the cache state and the bad call.
    layer = _paged_layer(PagedLayerDraw(seed=seed))
    S = LAYER_CACHE["max_num_seqs"]
    rng = np.random.default_rng(seed)
    _layer_step(layer, jnp.asarray(rng.standard_normal((LAYER_T, LAYER_F)), F32), _cu(first), np.array([S], np.int32))
    before, params = snapshot(layer.kv_cache.get_value()), snapshot(nnx.state(layer, nnx.Param))
    q_lens = list(data.draw(st.tuples(*[st.integers(0, 2)] * S)))
    x = rng.standard_normal((LAYER_T, LAYER_F)).astype(np.float32)
    cu, ns = _cu(q_lens), np.array([S], np.int32)
    names, errors = ("cu_q_lens",), (ValueError, TypeError)
    if kind == "cu_q_lens_start":
      cu = cu + data.draw(st.sampled_from([1, -1]))
    elif kind == "cu_q_lens_decreasing":
      i = data.draw(st.integers(1, S))
      cu[i] = cu[i - 1] - data.draw(st.integers(1, 2))
    elif kind == "num_seqs":
      ns, names = np.array([data.draw(st.sampled_from([-1, S + 1]))], np.int32), ("num_seqs",)
    elif kind == "in_features":
      x, names = x[:, :-1], ("inputs", "in_features")
    elif kind == "rank":
      x, names = x[None], ("inputs",)
    else:  # slot s asks for more tokens than it has room for
      s = data.draw(st.integers(0, S - 1))
      room = LAYER_CACHE["pages_per_seq"] * LAYER_CACHE["page_size"] - first[s]
      q_lens = [0] * S
      q_lens[s] = room + 1
      cu, names, errors = _cu(q_lens), ("slot",), (fr.CacheOverflowError,)
      x = rng.standard_normal((room + 1, LAYER_F)).astype(np.float32)
    expect_library_error(lambda: layer(x, cu_q_lens=cu, num_seqs=ns), names, errors)
    assert_unchanged(before, layer.kv_cache.get_value(), "the layer's cache")
    assert_unchanged(params, nnx.state(layer, nnx.Param), "the layer's parameters")

  check()


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int16, jnp.uint8])
def test_cache_with_an_int_dtype_is_rejected(dtype):
  """int8 / float8 pages are quantized; other integer (and bool) pages are a TypeError naming dtype."""
  expect_library_error(
    lambda: fr.PagedKVCache.create(
      num_pages=4, page_size=2, max_num_seqs=2, pages_per_seq=2, num_kv_heads=1, head_dim=2, dtype=dtype
    ),
    ("dtype",),
    (TypeError,),
  )
  layer = fr.PagedMultiHeadAttention(2, 4, 4, rngs=nnx.Rngs(0))
  expect_library_error(lambda: layer.init_cache(**LAYER_CACHE, dtype=dtype), ("dtype",), (TypeError,))
  assert layer.kv_cache is None


# -- empty inputs ------------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EmptyDraw:
  entry: str = "ring"
  B: int = 0
  T: int = 4
  S: int = 4
  N: int = 2
  K: int = 1
  Hv: int = 4
  devices: int | None = None
  strategy: str = "ring"
  num_seqs: int = 0
  is_causal: bool = False


@st.composite
def empty_draws(draw, entry):
  devices = draw(st.sampled_from([None, 2])) if entry in ("ring", "ring_layer") else None
  B, T = draw(st.sampled_from([(0, 4), (2, 0), (0, 0)]))
  N, K = draw(st.sampled_from(HEAD_LAYOUTS))
  strategy = draw(st.sampled_from(["ring", "all_gather"] + (["ulysses"] if devices and N % devices == 0 else [])))
  return EmptyDraw(
    entry=entry,
    B=B,
    T=T,
    S=draw(st.sampled_from([2, 4])) if entry != "ring_layer" else T,
    N=N,
    K=K,
    Hv=draw(st.sampled_from([4, 3])),
    devices=devices,
    strategy=strategy if devices else "ring",
    num_seqs=draw(st.integers(0, PAGED_GEOMETRIES[0].max_num_seqs)),
    is_causal=draw(st.booleans()),
  )


@pytest.mark.parametrize("entry", ["ring", "dot_product_attention", "paged_attention", "ring_layer", "paged_layer"])
def test_empty_inputs_give_empty_outputs(entry):
  @fuzz_settings(2 if "layer" in entry else 4)
  @given(empty_draws(entry))
  def check(e):
    if entry in ("ring", "dot_product_attention"):
      q, k, v = _qkv(e.B, e.T, e.S, e.N, e.K, Hv=e.Hv)
      if entry == "ring":
        mesh = None if e.devices is None else _mesh(e.devices)
        out = fr.ring_attention(q, k, v, is_causal=e.is_causal, mesh=mesh, strategy=e.strategy, implementation="xla")
      else:
        out = fr.dot_product_attention(q, k, v, is_causal=e.is_causal, implementation="xla")
      assert tuple(out.shape) == (e.B, e.T, e.N, e.Hv)
      assert out.dtype == F32
    elif entry == "paged_attention":
      g = PAGED_GEOMETRIES[0]
      b = PagedDraw(batches=(tuple((0, 3) for _ in range(e.num_seqs)),), N=e.N, K=e.K, Hv=e.Hv).batch()
      args = (np.zeros((0, e.N, 4), np.float32), *b.args[1:])
      out = fr.paged_attention(*args, implementation="xla")
      assert tuple(out.shape) == (0, e.N, e.Hv)
      del g
    elif entry == "ring_layer":
      layer = fr.RingMultiHeadAttention(
        e.N,
        6,
        2 * e.N,
        num_kv_heads=e.K,
        mesh=None if e.devices is None else _mesh(e.devices),
        implementation="xla",
        rngs=nnx.Rngs(0),
      )
      out = layer(np.zeros((e.B, e.T, 6), np.float32), is_causal=e.is_causal)
      assert tuple(out.shape) == (e.B, e.T, 6)
    else:
      p = PagedLayerDraw(N=e.N, K=e.K, H=2, Hv=e.Hv)
      layer = _paged_layer(p)
      before = snapshot(layer.kv_cache.get_value())
      S = LAYER_CACHE["max_num_seqs"]
      out = layer(
        np.zeros((0, LAYER_F), np.float32),
        cu_q_lens=np.zeros(S + 1, np.int32),
        num_seqs=np.array([e.num_seqs], np.int32),
      )
      assert tuple(out.shape) == (0, LAYER_F)
      assert_unchanged(before, layer.kv_cache.get_value(), "the layer's cache")

  check()

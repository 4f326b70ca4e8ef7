"""Ring prefill (`paged_ring_prefill`, `PagedKVCache.reserve_prefill`, `PagedMultiHeadAttention.prefill`): one long
prompt prefilled sequence-parallel into a cache spread over a sequence axis.

Every result is checked against a one-device cache that stores the same tokens with `append` and attends with
`paged_reference_attention`: the prompt's outputs (back in natural order) and the stored K/V, on rings of 2, 4 and
8 devices, fresh slots and slots with a cached prefix, padded prompts, GQA / MQA, window, soft cap, sinks, MLA,
int8 pages and bf16; XLA everywhere, the Pallas TPU kernel in interpret mode with the race detector.  Also: the
placement of the prompt's pages (the ring prefill layout), the refusals (unaligned start, too many tokens, no
pages on one device), pages of other slots and devices poisoned with NaN, activations O(T / n) (no collective but
the ring's permutes), one compile, the `axis_name=` form, `head_axis`, and the layer against a one-device layer.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax.sharding import NamedSharding, PartitionSpec
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src.testing.interpret import interpret_params, no_races

F32 = jnp.float32
NUM = jnp.array([3], jnp.int32)


@dataclasses.dataclass
class Setup:
  """A cache spread over n devices and a one-device twin holding the same tokens; the prompt of slot 1."""

  n: int
  cache: fr.PagedKVCache  # spread, after reserve_prefill
  twin: fr.PagedKVCache  # one device, prompt appended
  q: jax.Array  # [T, N, H] natural order, real tokens only
  k: jax.Array
  v: jax.Array
  Tp: int
  mesh: object
  prefix: int


SLOT = 1


def _tokens(rng, T, K, H, dtype=F32):
  return jnp.asarray(rng.normal(size=(T, K, H)), dtype)


def setup(
  n,
  *,
  prefix=8,
  T=13,
  K=2,
  N=4,
  H=8,
  Hv=None,
  ps=4,
  cache_dtype=F32,
  dtype=F32,
  mesh=None,
  seed=0,
  num_pages=None,
):
  rng = np.random.default_rng(seed)
  mesh = mesh or make_mesh((n,), ("sp",))
  geom = dict(
    num_pages=num_pages or 16 * n,
    page_size=ps,
    max_num_seqs=3,
    pages_per_seq=32,
    num_kv_heads=K,
    head_dim=H,
    v_head_dim=Hv,
    dtype=cache_dtype,
  )
  cache = fr.PagedKVCache.create(**geom, mesh=mesh, seq_axis="sp")
  twin = fr.PagedKVCache.create(**geom)
  # Neighbours: slot 0 holds 6 tokens, slot 1 the prefix, slot 2 nothing.
  lens = [6, prefix, 0]
  cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
  kp, vp = _tokens(rng, sum(lens), K, H), _tokens(rng, sum(lens), K, Hv or H)
  cache, twin = cache.append(kp, vp, cu, NUM), twin.append(kp, vp, cu, NUM)
  q = _tokens(rng, T, N, H, dtype)
  k, v = _tokens(rng, T, K, H, dtype), _tokens(rng, T, K, Hv or H, dtype)
  Tp = cache.ring_prefill_len(T)
  cache = cache.reserve_prefill(SLOT, T, padded_len=Tp)
  cu = jnp.array([0, 0, T, T], jnp.int32)
  twin = twin.append(k, v, cu, NUM)
  return Setup(n, cache, twin, q, k, v, Tp, mesh, prefix)


def padded(s: Setup, x):
  """x [T, ...] padded to Tp rows (garbage: the padding must not matter) and put in the ring prefill layout."""
  fill = jnp.full((s.Tp - x.shape[0], *x.shape[1:]), 7.0, x.dtype)
  return fr.zigzag_order(jnp.concatenate([x, fill]), s.n, axis=0)


def natural(s: Setup, out):
  return jnp.asarray(fr.zigzag_inverse(np.asarray(out), s.n, axis=0))


def run(s: Setup, *, jit=True, **kw):
  kv_lens, table = s.cache.attention_view()
  kw.setdefault("implementation", "xla")

  def f(q, k, v, k_pages, v_pages, k_scale, v_scale, kv_lens, table, slot, num_tokens):
    return fr.paged_ring_prefill(
      q,
      k,
      v,
      k_pages,
      v_pages,
      kv_lens,
      table,
      slot=slot,
      num_tokens=num_tokens,
      k_scale=k_scale,
      v_scale=v_scale,
      mesh=s.mesh,
      seq_axis="sp",
      **kw,
    )

  f = jax.jit(f) if jit else f
  c = s.cache
  args = (padded(s, s.q), padded(s, s.k), padded(s, s.v), c.k_pages, c.v_pages, c.k_scale, c.v_scale)
  return f(*args, kv_lens, table, SLOT, s.q.shape[0])


_STATIC = ("local_window_size", "logits_soft_cap", "scale", "sliding_window", "chunk_size")
_reference = jax.jit(fr.paged_reference_attention, static_argnames=_STATIC)  # one program, not one per op


def expected(s: Setup, **kw):
  t = s.twin
  T = s.q.shape[0]
  cu = jnp.array([0, 0, T, T], jnp.int32)
  return _reference(
    s.q, t.k_pages, t.v_pages, t.kv_lens, t.page_indices, cu, NUM, k_scale=t.k_scale, v_scale=t.v_scale, **kw
  )


def stored(cache, slot, which="k"):
  """The slot's tokens as its pages hold them (dequantized), in order."""
  pages = np.asarray(getattr(cache, f"{which}_pages")).astype(np.float32)
  scale = getattr(cache, f"{which}_scale")
  if scale is not None:
    pages = pages * np.asarray(scale)[..., None]
  L = int(cache.kv_lens[slot])
  ids = np.asarray(cache.page_indices)[slot, : -(-L // cache.page_size)]
  return pages[ids].reshape(-1, *pages.shape[2:])[:L]


def check(s: Setup, result, dtype=F32, **kw):
  out, k_pages, v_pages, k_scale, v_scale = result
  T = s.q.shape[0]
  got = natural(s, out)
  assert not np.any(np.asarray(got[T:])), "padding rows must return 0"
  assert_close(got[:T], expected(s, **kw), dtype)
  c = dataclasses.replace(s.cache, k_pages=k_pages, v_pages=v_pages, k_scale=k_scale, v_scale=v_scale)
  for which in ("k", "v"):
    np.testing.assert_array_equal(stored(c, SLOT, which), stored(s.twin, SLOT, which))
  for slot in (0, 2):  # neighbours untouched
    np.testing.assert_array_equal(stored(c, slot), stored(s.twin, slot))


@pytest.mark.parametrize("n", [2, 8])  # ring 4 runs in test_features, with both schedules
@pytest.mark.parametrize("prefix", [0, 8])
def test_matches_one_device(n, prefix):
  """A padded prompt (13 + 8n tokens, not a multiple of 2n pages) into a fresh slot or after a cached prefix."""
  s = setup(n, prefix=prefix, T=13 + 8 * n, seed=n + prefix)
  check(s, run(s))


FEATURES = {
  "mqa": (dict(K=1), {}),
  "window": ({}, dict(local_window_size=(5, 0))),
  "chunk": ({}, dict(chunk_size=5)),  # chunks of 5 positions cut across the zigzag chunks of 8
  "soft_cap": ({}, dict(logits_soft_cap=2.0)),
  "sinks": ({}, dict(sinks=jnp.array([0.5, -1.0, 2.0, 0.0]))),
  "mla": (dict(Hv=4), {}),
  "int8": (dict(cache_dtype=jnp.int8), {}),
  "bf16": (dict(dtype=jnp.bfloat16, cache_dtype=jnp.bfloat16), {}),
}
# prefix 0: a fresh slot, pass-KV (schedule="auto"); 8: pass-Q.  The features each schedule masks, merges or
# ships at its own width (window, sinks, MLA's v) run together under both (one program each: the suite is
# compile-bound); the rest under one (the other schedule reads the same pages and runs the same per-tile math).
FEATURE_RUNS = [("window+sinks+mla", p) for p in (0, 8)]
# chunk: pass-Q here (its tables keep global columns); pass-KV in test_paged_chunks.py through the layer.
FEATURE_RUNS += [("chunk", 8), ("mqa+soft_cap", 8), ("int8", 0), ("bf16", 8)]


@pytest.mark.parametrize("names,prefix", FEATURE_RUNS, ids=[f"{p}-{f}" for f, p in FEATURE_RUNS])
def test_features(names, prefix):
  setup_kw, op_kw = {}, {}
  for name in names.split("+"):
    setup_kw |= FEATURES[name][0]
    op_kw |= FEATURES[name][1]
  s = setup(4, T=29, seed=len(names), prefix=prefix, **setup_kw)
  dtype = setup_kw.get("dtype", F32)
  check(s, run(s, **op_kw), dtype, **op_kw)


def test_pass_q_on_a_fresh_slot():
  """schedule="pass_q" on a fresh slot (where "auto" takes pass-KV): the same answers."""
  s = setup(4, prefix=0, T=29, seed=11)
  check(s, run(s, schedule="pass_q"))
  with pytest.raises(ValueError, match="schedule='pass_kv' must be 'auto' or 'pass_q'"):
    run(s, schedule="pass_kv")


def test_window_shorter_than_a_chunk():
  """A window of 2 tokens on chunks of 8: most devices' pages lie outside every row's window (lse -inf parts)."""
  s = setup(2, T=30, seed=5)
  check(s, run(s, local_window_size=(1, 0)), local_window_size=(1, 0))


@pytest.mark.interpret
@pytest.mark.parametrize("n,prefix", [(2, 16), (4, 16), (2, 0)])
def test_pallas_tpu_kernel_in_interpret_mode(n, prefix):
  """The ragged paged Pallas kernel on every hop (pass-Q, after a prefix), or the Pallas ring over the prompt's
  K/V (pass-KV, a fresh slot); interpret mode, race detector on, pages of 8 tokens."""
  s = setup(n, T=37, ps=8, prefix=prefix, seed=20 + n)
  sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
  with no_races():
    result = run(
      s,
      implementation="pallas_tpu",
      interpret=interpret_params(),
      block_sizes=fr.BlockSizes(block_q=8, block_kv=8),
      sinks=sinks,
    )
  check(s, result, sinks=sinks)


def test_head_axis_with_seq_axis():
  """Pages over 'sp' (2 devices) and kv heads over 'tp' (2): the prompt split both ways."""
  mesh = make_mesh((2, 2), ("sp", "tp"))
  s = setup(2, T=21, mesh=mesh, seed=31)
  check(s, run(s, head_axis="tp", sinks=jnp.array([0.5, -1.0, 2.0, 0.0])), sinks=jnp.array([0.5, -1.0, 2.0, 0.0]))


def test_inside_a_user_shard_map():
  """axis_name= inside the caller's shard_map: q, k, v are the device's rows, the pages its shard."""
  s = setup(4, T=25, seed=41)
  kv_lens, table = s.cache.attention_view()
  rows, rep = PartitionSpec("sp"), PartitionSpec()

  def body(q, k, v, kp, vp, kv_lens, table):
    return fr.paged_ring_prefill(
      q, k, v, kp, vp, kv_lens, table, slot=SLOT, num_tokens=25, axis_name="sp", implementation="xla"
    )

  specs = (rows, rows, rows, rows, rows, rep, rep)
  f = jax.jit(jax.shard_map(body, mesh=s.mesh, in_specs=specs, out_specs=(rows, rows, rows, None, None)))
  args = (padded(s, s.q), padded(s, s.k), padded(s, s.v), s.cache.k_pages, s.cache.v_pages, kv_lens, table)
  args = [jax.device_put(x, NamedSharding(s.mesh, p)) for x, p in zip(args, specs, strict=True)]
  check(s, f(*args))


def test_other_pages_poisoned_with_nan():
  """Every page the slot does not own holds NaN (other slots, free pages, on every device): no output changes."""
  s = setup(4, T=27, seed=51)
  ids = np.asarray(s.cache.page_indices)[SLOT]
  mine = np.zeros(s.cache.num_pages, bool)
  mine[ids[ids >= 0]] = True
  mask = jax.device_put(jnp.asarray(mine)[:, None, None, None], s.cache.k_pages.sharding)
  poisoned = dataclasses.replace(
    s.cache,
    k_pages=jnp.where(mask, s.cache.k_pages, jnp.nan),
    v_pages=jnp.where(mask, s.cache.v_pages, jnp.nan),
  )
  out = run(dataclasses.replace(s, cache=poisoned))[0]
  assert_close(natural(s, out)[:27], expected(s), F32)


def test_prompt_pages_are_placed_per_shard():
  """reserve_prefill puts chunk c of the prompt's 2n chunks on device c (c < n) or 2n - 1 - c: each device gets
  Tp / n tokens' pages, and the prefix keeps its striped owners."""
  n, ps = 4, 4
  s = setup(n, prefix=8, T=64, ps=ps)  # Tp = 64: chunks of 8 tokens, 2 pages each
  c = s.cache
  owners = np.asarray(c.page_owner(c.page_indices[SLOT]))
  assert list(owners[:2]) == [(SLOT + j) % n for j in range(2)]  # the prefix: striped
  chunk_owner = [0, 1, 2, 3, 3, 2, 1, 0]
  assert list(owners[2:18]) == [d for d in chunk_owner for _ in range(2)]
  assert np.all(owners[18:] == -1)
  assert int(c.kv_lens[SLOT]) == 8 + 64


def _fresh(n=2, num_pages=None):
  mesh = make_mesh((n,), ("sp",))
  return fr.PagedKVCache.create(
    num_pages=num_pages or 8 * n,
    page_size=4,
    max_num_seqs=2,
    pages_per_seq=16,
    num_kv_heads=1,
    head_dim=4,
    mesh=mesh,
    seq_axis="sp",
  )


def test_unaligned_start_and_too_many_tokens_raise():
  cache = _fresh()
  k = jnp.ones((5, 1, 4), F32)
  cache = cache.append(k, k, jnp.array([0, 5, 5], jnp.int32), jnp.array([2], jnp.int32))
  with pytest.raises(ValueError, match=r"slot 0 cannot take a ring prefill of num_tokens=8 .* it holds 5 tokens"):
    cache.reserve_prefill(0, 8, padded_len=16)
  with pytest.raises(ValueError, match=r"slot 1 cannot take a ring prefill of num_tokens=17 .*padded_len=16"):
    cache.reserve_prefill(1, 17, padded_len=16)
  with pytest.raises(ValueError, match=re.escape("padded_len=12 must be a positive multiple of 2 * n * page_size")):
    cache.reserve_prefill(1, 8, padded_len=12)


def test_refused_under_jit_is_flagged_and_sees_nothing():
  cache = _fresh()
  k = jnp.ones((5, 1, 4), F32)
  cache = cache.append(k, k, jnp.array([0, 5, 5], jnp.int32), jnp.array([2], jnp.int32))
  after = jax.jit(lambda c: c.reserve_prefill(0, 8, padded_len=16))(cache)
  assert bool(after.overflowed[0]) and int(after.kv_lens[0]) == 5
  assert int(after.num_free_pages()) == int(cache.num_free_pages())


def test_a_device_out_of_pages_is_reported():
  """Device 0 holds chunks 0 and 3: a prompt needing more pages there than it has is refused whole."""
  cache = _fresh(num_pages=8)  # 4 pages a device
  with pytest.raises(fr.CacheOverflowError, match=r"slot 0 needs 6 more pages on owner 0"):
    cache.reserve_prefill(0, 48, padded_len=48)
  assert int(cache.reserve_prefill(0, 32, padded_len=32).kv_lens[0]) == 32  # 4 pages on each device: fits


def test_pages_not_in_the_ring_prefill_layout_raise():
  """Pages reserved with plain `reserve` (striped) cannot take a shard's rows: named, not dropped."""
  s = setup(2, T=16, seed=3)
  plain = fr.PagedKVCache.create(
    num_pages=32, page_size=4, max_num_seqs=3, pages_per_seq=32, num_kv_heads=2, head_dim=8, mesh=s.mesh, seq_axis="sp"
  ).reserve(jnp.array([0, 16, 0], jnp.int32))
  plain = dataclasses.replace(plain, kv_lens=jax.device_put(np.array([0, 16, 0], np.int32), plain.kv_lens.sharding))
  with pytest.raises(ValueError, match=r"page column 0 of slot 1 \(page id 16\) must lie on device 0 of n=2"):
    run(dataclasses.replace(s, cache=plain, prefix=0), jit=False)


def test_misplaced_pages_fail_a_checked_jit():
  """Under jit with checked=True the placement check runs through checkify (on Auto axes: on Explicit ones,
  JAX 0.10's `Error.get` cannot index the per-device error that checkify brings out of a shard_map)."""
  from jax.experimental import checkify

  s = setup(2, T=16, seed=3, mesh=make_mesh((2,), ("sp",), explicit=False))
  plain = fr.PagedKVCache.create(
    num_pages=32, page_size=4, max_num_seqs=3, pages_per_seq=32, num_kv_heads=2, head_dim=8, mesh=s.mesh, seq_axis="sp"
  ).reserve(jnp.array([0, 16, 0], jnp.int32))
  plain = dataclasses.replace(plain, kv_lens=jax.device_put(np.array([0, 16, 0], np.int32), plain.kv_lens.sharding))
  bad, _ = checkify.checkify(lambda: run(dataclasses.replace(s, cache=plain), checked=True))()
  good, _ = checkify.checkify(lambda: run(s, checked=True))()
  assert re.search(r"page column 0 of slot 1 \(page id 16\) must lie on device 0", str(bad.get()))
  assert good.get() is None


def test_bad_shapes_raise():
  s = setup(2, T=16)
  kv_lens, table = s.cache.attention_view()
  c = s.cache
  q, k, v = padded(s, s.q), padded(s, s.k), padded(s, s.v)
  kw = dict(slot=SLOT, num_tokens=16, mesh=s.mesh, seq_axis="sp")
  with pytest.raises(ValueError, match=re.escape("k must be [Tp, K, H] = [16, 2, 8]")):
    fr.paged_ring_prefill(q, k[:, :1], v, c.k_pages, c.v_pages, kv_lens, table, **kw)
  with pytest.raises(ValueError, match=re.escape("padded length Tp=8 must be a multiple of 2 * n * page_size")):
    fr.paged_ring_prefill(q[:8], k[:8], v[:8], c.k_pages, c.v_pages, kv_lens, table, **kw)
  with pytest.raises(ValueError, match="needs mesh=... with seq_axis"):
    fr.paged_ring_prefill(q, k, v, c.k_pages, c.v_pages, kv_lens, table, slot=SLOT, num_tokens=16)
  with pytest.raises(NotImplementedError, match="per-token scales"):
    fr.paged_ring_prefill(q, k, v, c.k_pages, c.v_pages, kv_lens, table, k_scale=jnp.ones((32, 2)), **kw)


def test_activations_stay_sharded():
  """q, k, v and the output stay Tp / n rows a device, and the only collectives are the ring's permutes (no
  all-gather, all-reduce or all-to-all of the prompt)."""
  s = setup(4, T=40)
  out = run(s)[0]
  assert {x.data.shape for x in out.addressable_shards} == {(s.Tp // 4, 4, 8)}
  kv_lens, table = s.cache.attention_view()
  c = s.cache
  f = jax.jit(
    lambda *a: fr.paged_ring_prefill(*a, slot=SLOT, num_tokens=40, mesh=s.mesh, seq_axis="sp", implementation="xla")
  )
  hlo = f.lower(padded(s, s.q), padded(s, s.k), padded(s, s.v), c.k_pages, c.v_pages, kv_lens, table).compile()
  text = hlo.as_text()
  assert "collective-permute" in text
  for op in ("all-gather", "all-reduce", "all-to-all", "reduce-scatter"):
    assert op not in text, op


def test_one_compile_across_prompts():
  """Prompts of different lengths, slots and prefixes at one Tp: one trace of the jitted step."""
  n, Tp = 4, 64
  mesh = make_mesh((n,), ("sp",))
  traces = []

  @jax.jit
  def step(cache, q, k, v, slot, num_tokens):
    traces.append(1)
    cache = cache.reserve_prefill(slot, num_tokens, padded_len=Tp)
    kv_lens, table = cache.attention_view()
    out, kp, vp, _, _ = fr.paged_ring_prefill(
      q,
      k,
      v,
      cache.k_pages,
      cache.v_pages,
      kv_lens,
      table,
      slot=slot,
      num_tokens=num_tokens,
      mesh=mesh,
      seq_axis="sp",
      implementation="xla",
    )
    return dataclasses.replace(cache, k_pages=kp, v_pages=vp), out

  cache = fr.PagedKVCache.create(
    num_pages=64, page_size=4, max_num_seqs=3, pages_per_seq=48, num_kv_heads=2, head_dim=8, mesh=mesh, seq_axis="sp"
  )
  rng = np.random.default_rng(7)
  # Fresh slots (pass-KV) and prompts after a cached prefix (pass-Q: slots 1 and 0 again, from 8 and 64 tokens).
  for slot, t in [(0, 64), (1, 8), (2, 33), (1, 64), (0, 17)]:
    q = _tokens(rng, Tp, 4, 8)
    k, v = _tokens(rng, Tp, 2, 8), _tokens(rng, Tp, 2, 8)
    cache, out = step(cache, q, k, v, slot, t)
    assert not np.any(np.isnan(np.asarray(out)))
  assert len(traces) == 1
  np.testing.assert_array_equal(cache.kv_lens, [81, 72, 33])
  assert not np.any(cache.overflowed)


def test_layer_prefill_then_decode_matches_one_device():
  """PagedMultiHeadAttention(mesh=, seq_axis=).prefill of a prompt, then decode steps through __call__, against
  the same layer on one device serving the prompt through __call__."""
  from flax import nnx

  n, T = 4, 21
  mesh = make_mesh((n,), ("sp",))
  kw = dict(num_heads=4, in_features=16, qkv_features=16, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0))
  kw["implementation"] = "xla"
  spread = fr.PagedMultiHeadAttention(**kw, mesh=mesh, seq_axis="sp")
  one = fr.PagedMultiHeadAttention(**kw)
  nnx.update(one, nnx.state(spread, nnx.Param))
  geom = dict(num_pages=32, page_size=4, max_num_seqs=2, pages_per_seq=16)
  spread.init_cache(**geom)
  one.init_cache(**geom)
  rng = np.random.default_rng(9)
  x = jnp.asarray(rng.normal(size=(T, 16)), F32)
  Tp = spread.kv_cache.get_value().ring_prefill_len(T)
  xp = fr.zigzag_order(jnp.concatenate([x, jnp.zeros((Tp - T, 16))]), n, axis=0)
  prefill = nnx.jit(lambda m, x: m.prefill(x, slot=1, num_tokens=T))
  step = nnx.jit(lambda m, x, cu, ns: m(x, cu_q_lens=cu, num_seqs=ns))
  y = jnp.asarray(fr.zigzag_inverse(np.asarray(prefill(spread, xp)), n, axis=0))[:T]
  assert_close(y, step(one, x, jnp.array([0, 0, T], jnp.int32), jnp.array([2], jnp.int32)), F32)
  for _ in range(2):
    t = jnp.asarray(rng.normal(size=(2, 16)), F32)
    cu, ns = jnp.array([0, 1, 2], jnp.int32), jnp.array([2], jnp.int32)
    assert_close(step(spread, t, cu, ns), step(one, t, cu, ns), F32)


def test_layer_prefill_needs_seq_axis():
  from flax import nnx

  layer = fr.PagedMultiHeadAttention(num_heads=2, in_features=8, decode=True, rngs=nnx.Rngs(0))
  layer.init_cache(num_pages=8, page_size=4, max_num_seqs=2, pages_per_seq=4)
  with pytest.raises(ValueError, match="prefill is the ring prefill over a sequence axis"):
    layer.prefill(jnp.zeros((8, 8)), slot=0, num_tokens=8)

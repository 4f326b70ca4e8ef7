"""Context-parallel paged attention: the cache's pages spread over a sequence axis, partials merged exactly.

`paged_attention(..., mesh=, seq_axis=)` (and `axis_name=` inside a user's shard_map) against
`paged_reference_attention` on the same global arrays: forward and every gradient (dq, dk_pages, dv_pages,
dsinks), on rings of 2, 4 and 8 devices, the batch mixes of paged_cases.py (decode, prefill, chunked, mixed,
edge: q_len 0, empty and full sequences), sequences whose pages all sit on one device or skip a device, GQA / MQA,
window + soft cap, sinks, MLA, int8 / fp8 pages with scales and shared prefixes; XLA everywhere, the Pallas TPU
kernel in interpret mode with the race detector.  Pages of other sequences and other devices hold NaN and never
change a result.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import pick
from conftest import make_mesh
from jax.sharding import PartitionSpec
from paged_cases import (
  F32,
  PPS,
  PS,
  SMALL,
  WINDOW_CAP,
  P,
  case_batch,
  features,
  make_batch,
  paged_vjp,
  poison,
  ref_vjp,
  scenario,
)
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src.testing.interpret import interpret_params, no_races

_STATIC = ("n", "implementation", "blocks", "explicit", "local_window_size", "logits_soft_cap", "scale")


@functools.partial(jax.jit, static_argnames=_STATIC)
def cp_vjp(
  args,
  do,
  k_scale=None,
  v_scale=None,
  sinks=None,
  *,
  n,
  implementation="xla",
  blocks=SMALL,
  explicit=True,
  local_window_size=None,
  logits_soft_cap=None,
  scale=None,
):
  """The sharded op over a ring of n on global arrays: (out, (dq, dk_pages, dv_pages[, dsinks]))."""
  mesh = make_mesh((n,), ("sp",), explicit=explicit)
  interpret = interpret_params() if implementation == "pallas_tpu" else None
  kw = dict(k_scale=k_scale, v_scale=v_scale, local_window_size=local_window_size, logits_soft_cap=logits_soft_cap)
  kw.update(scale=scale, block_sizes=blocks, implementation=implementation, interpret=interpret)
  return paged_vjp(functools.partial(fr.paged_attention, mesh=mesh, seq_axis="sp"), args, do, sinks, **kw)


def _do(b, seed=1):
  return jnp.asarray(np.random.default_rng(seed).normal(size=b.out_shape), b.q.dtype)


def _check(b, n, dtype=F32, *, page_grads=True, **kw):
  """The sharded op on a NaN-poisoned copy of `b` against the reference on `b`: forward and every gradient."""
  do = _do(b)
  ref_out, ref_grads = ref_vjp(b.args, do, **b.operands, **{k: v for k, v in kw.items() if k in _FEATURES})
  bad = poison(b, np.nan if jnp.issubdtype(b.k_pages.dtype, jnp.floating) else -128)
  out, grads = cp_vjp(bad.args, do, **b.operands, n=n, **kw)
  assert out.shape == b.out_shape and out.dtype == b.q.dtype
  assert_close(out, ref_out, dtype, "fwd")
  assert len(grads) == len(ref_grads)
  read = b.read_mask()[:, :, None, None]
  for i, (g, rg) in enumerate(zip(grads, ref_grads, strict=True)):
    if i in (1, 2):
      if not page_grads:
        continue
      # Unread slots of the poisoned pages get no gradient; compare where the reference's pages are read.
      g, rg = jnp.where(read, g, 0.0), jnp.where(read, rg, 0.0)
    assert_close(g, rg, dtype, "grad")


_FEATURES = ("local_window_size", "logits_soft_cap", "scale")


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("name", ["decode", "prefill", "chunked", "mixed", "edge"])
def test_batch_mixes_match_the_reference(name, n):
  """Every batch mix on every ring size (pages drawn at random over the whole pool: each sequence's pages land
  on several devices, some on none)."""
  rng = np.random.default_rng(10 + n)
  _check(make_batch(rng, scenario(name, rng)), n)


@pytest.mark.parametrize("placement", ["one_device", "skips_devices"])
def test_sequences_on_one_device_or_skipping_devices(placement):
  """A sequence whose pages all sit on one device (the others see no key of it: their partial is empty), and
  sequences with no page on some devices, on a ring of 4 (pages 0..9 on device 0, 10..19 on 1, ...)."""
  rng = np.random.default_rng(20)
  seqs = [(3, 17), (1, 9), (5, 5), (1, 24)]
  b = make_batch(rng, seqs)
  table = np.asarray(b.page_indices).copy()
  local = P // 4
  if placement == "one_device":
    table[0, :5] = np.arange(5) + 2 * local  # all of sequence 0 on device 2
    table[3, :6] = np.arange(6) + 3 * local  # all of sequence 3 on device 3
  else:
    table[0, :5] = [0, 1, 2 * local, 2 * local + 1, 2]  # devices 0 and 2 only
    table[3, :6] = np.arange(6) + local  # device 1 only
  table[1, :3] = [3 * local + 5, 3 * local + 6, 3 * local + 7]
  table[2, :2] = [local + 8, local + 9]
  _check(b.replace(page_indices=jnp.asarray(table, jnp.int32)), 4)


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.parametrize("layout", ["gqa_sinks_mla", "mqa_window_cap"])
def test_features_combine_with_the_merge(layout, n):
  """GQA with sinks and MLA head dims (the sinks enter once, after the merge), and MQA with a window and a soft
  cap."""
  rng = np.random.default_rng(30)
  seqs = scenario("mixed", rng)
  if layout == "gqa_sinks_mla":
    (case,) = pick("mla_sinks")
    _check(case_batch(case, rng, seqs), n, **features(case))
  else:
    b = make_batch(rng, seqs, num_kv_heads=1)
    _check(b, n, **features(WINDOW_CAP))


@pytest.mark.parametrize("page_dtype,scale_shape", [(jnp.int8, "token"), (jnp.float8_e4m3fn, "page")])
def test_quantized_pages_with_scales(page_dtype, scale_shape):
  """int8 pages with per-token scales and fp8 pages with per-page scales: the scales split with their pages."""
  rng = np.random.default_rng(40)
  b = make_batch(rng, scenario("mixed", rng), page_dtype=page_dtype, scale_shape=scale_shape)
  _check(b, 4, page_grads=False)


def test_shared_prefix_pages():
  """Two sequences reading the same prefix pages (spread over devices): dK / dV of a shared page collect both."""
  rng = np.random.default_rng(50)
  _check(make_batch(rng, [(3, 19), (2, 22), (1, 9)], share_prefix=True), 4)


def test_bf16():
  rng = np.random.default_rng(60)
  _check(make_batch(rng, scenario("mixed", rng), dtype=jnp.bfloat16), 4, jnp.bfloat16)


def test_auto_axes():
  rng = np.random.default_rng(70)
  _check(make_batch(rng, scenario("chunked", rng)), 4, explicit=False)


@pytest.mark.interpret
@pytest.mark.parametrize("n", [2, 4])
def test_pallas_tpu_kernel_in_interpret_mode(n):
  """The ragged paged Pallas kernel per device (interpret mode, race detector on), sinks and GQA, pages of 8
  tokens (its sublane tile), against the reference on the same global arrays."""
  rng = np.random.default_rng(80 + n)
  seqs = [(5, 9), (1, 17), (8, 8), (0, 4), (3, 20)]
  geom = dict(page_size=8, num_pages=16, pages_per_seq=4)
  b = make_batch(rng, seqs, sinks=2.0 + rng.normal(size=8), **geom)
  with no_races():
    _check(b, n, implementation="pallas_tpu", blocks=fr.BlockSizes(block_q=8, block_kv=8))


def test_inside_a_user_shard_map():
  """axis_name= inside the caller's shard_map: the pages are the device's shards, the table keeps global ids."""
  rng = np.random.default_rng(90)
  b = make_batch(rng, scenario("mixed", rng), sinks=1.0 + rng.normal(size=8))
  mesh = make_mesh((4,), ("sp",))
  rep, pages = PartitionSpec(), PartitionSpec("sp")

  def body(q, kp, vp, kv_lens, table, cu, ns, sinks):
    return fr.paged_attention(
      q, kp, vp, kv_lens, table, cu, ns, axis_name="sp", sinks=sinks, block_sizes=SMALL, implementation="xla"
    )

  specs = (rep, pages, pages, rep, rep, rep, rep, rep)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=rep))
  args = [
    jax.device_put(x, jax.sharding.NamedSharding(mesh, s)) for x, s in zip((*b.args, b.sinks), specs, strict=True)
  ]
  assert_close(f(*args), fr.paged_reference_attention(*b.args, sinks=b.sinks), F32)


def test_one_compile_across_changing_batches():
  """20 batch compositions (decode, prefill, chunked, mixed, q_len 0, none) through one jitted sharded call."""
  mesh = make_mesh((4,), ("sp",))
  traces = []

  @jax.jit
  def step(*args):
    traces.append(1)
    return fr.paged_attention(*args, mesh=mesh, seq_axis="sp", block_sizes=SMALL, implementation="xla")

  rng = np.random.default_rng(100)
  names = ["decode", "prefill", "chunked", "mixed", "edge", "few", "none"]
  for i in range(20):
    b = make_batch(rng, scenario(names[i % len(names)], rng))
    assert_close(step(*b.args), fr.paged_reference_attention(*b.args), F32)
  assert len(traces) == 1


def test_merge_is_one_psum_of_the_output_and_its_weight():
  """The forward's collectives: one all-reduce (sum) of [T, N, Hv + 1] and one (max) of [T, N]; nothing
  proportional to the pages crosses the axis."""
  rng = np.random.default_rng(110)
  b = make_batch(rng, scenario("mixed", rng), v_head_dim=8)
  mesh = make_mesh((4,), ("sp",))
  f = jax.jit(lambda *a: fr.paged_attention(*a, mesh=mesh, seq_axis="sp", block_sizes=SMALL, implementation="xla"))
  hlo = f.lower(*b.args).as_text(dialect="hlo")
  reduces = [ln for ln in hlo.splitlines() if " all-reduce(" in ln or " all-reduce-start(" in ln]
  T, N = b.q.shape[:2]
  assert any(f"f32[{T},{N},9]" in ln for ln in reduces), reduces
  assert all(f"[{T},{N},9]" in ln or f"f32[{T},{N}]" in ln for ln in reduces), reduces
  assert not any(op in hlo for op in (" all-gather(", " all-to-all(", " collective-permute(")), "pages moved"


@pytest.mark.parametrize(
  "shape,names,axes",
  [((4, 2), ("sp", "tp"), dict(seq_axis="sp", head_axis="tp")), ((2,), ("tp",), dict(head_axis="tp"))],
  ids=["pages_and_heads", "heads_only"],
)
def test_heads_split_with_or_without_the_pages(shape, names, axes):
  """kv heads (with their q heads, sinks and per-token scales) on 'tp', pages on 'sp' or not split: the op's
  shard_map over both axes, against the reference; the output comes back split on its heads."""
  rng = np.random.default_rng(120)
  b = make_batch(rng, scenario("mixed", rng), page_dtype=jnp.int8, scale_shape="token", sinks=1 + rng.normal(size=8))
  mesh = make_mesh(shape, names)
  f = jax.jit(lambda *a, **k: fr.paged_attention(*a, mesh=mesh, block_sizes=SMALL, implementation="xla", **axes, **k))
  out = f(*b.args, **b.operands)
  assert out.sharding.spec == PartitionSpec(None, "tp", None)
  assert_close(out, fr.paged_reference_attention(*b.args, **b.operands), F32)


def test_spread_pages_without_seq_axis_say_what_to_pass():
  """Pages sharded over an Explicit axis handed to the op without mesh / seq_axis: the error says what to pass."""
  b = make_batch(np.random.default_rng(0), [(1, 5)])
  mesh = make_mesh((4,), ("sp",))
  spread = jax.device_put(b.k_pages, jax.sharding.NamedSharding(mesh, PartitionSpec("sp")))
  with pytest.raises(ValueError, match=r"pass mesh=\.\.\. with seq_axis=\.\.\."):
    fr.paged_attention(b.q, spread, spread, *b.args[3:], implementation="xla")


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    (dict(seq_axis="sp"), ValueError, r"seq_axis='sp' needs mesh=\.\.\."),
    (dict(axis_name="sp"), ValueError, r"axis_name='sp' is not bound"),
    (dict(mesh="mesh", seq_axis="tp"), ValueError, r"seq_axis='tp' is not an axis of the mesh"),
    (dict(mesh="mesh3"), ValueError, r"P=40 pages, which must be a multiple of the 'sp' axis size 3"),
    (dict(mesh="mesh", axis_name="sp"), ValueError, r"not both"),
    (dict(mesh=object()), TypeError, r"mesh must be a jax.sharding.Mesh"),
    (dict(head_axis="tp"), ValueError, r"head_axis='tp' needs mesh=\.\.\."),
    (dict(mesh="mesh", head_axis="sp", seq_axis="sp"), ValueError, r"must be different mesh axes"),
    (
      dict(mesh="mesh_tp3", head_axis="tp"),
      ValueError,
      r"kv heads K=2 must be a multiple of the 'tp' mesh axis size 3",
    ),
  ],
)
def test_errors(kwargs, error, match):
  b = make_batch(np.random.default_rng(0), [(1, 5)])
  meshes = {"mesh": make_mesh((4,), ("sp",)), "mesh3": make_mesh((3,), ("sp",)), "mesh_tp3": make_mesh((3,), ("tp",))}
  kwargs = {k: meshes.get(v, v) if isinstance(v, str) and k == "mesh" else v for k, v in kwargs.items()}
  with pytest.raises(error, match=match):
    fr.paged_attention(*b.args, implementation="xla", **kwargs)


assert P % 8 == 0 and PPS * PS >= 24  # the ring sizes and the placement test's sequences fit the shared geometry


def test_decode_rows_are_compacted_to_the_device_pages():
  """A decode row's sequence is rewritten over this device's pages (in column order, its length their tokens);
  a prefill row keeps its global columns.  Worked by hand: page_size 4; slot 0 decodes over 10 tokens in
  columns 0..2 (the last holds 2 tokens), of which this device holds columns 1 and 2 (local ids 5 and 7);
  slot 1 prefills 3 tokens and keeps its table."""
  from flax_ringattn._src.paged.context_parallel import compact_decode_rows

  table = jnp.array([[-1, 5, 7, -1], [3, -1, 2, -1]], jnp.int32)
  kv_lens = jnp.array([10, 11], jnp.int32)
  cu = jnp.array([0, 1, 4], jnp.int32)
  lens, out = compact_decode_rows(kv_lens, table, cu, jnp.array([2], jnp.int32), 4)
  np.testing.assert_array_equal(lens, [4 + 2, 11])
  np.testing.assert_array_equal(out, [[5, 7, -1, -1], [3, -1, 2, -1]])
  # A device holding none of a decode row's pages: length 0 (the row sees nothing there, lse -inf).
  lens, out = compact_decode_rows(kv_lens, jnp.full((2, 4), -1, jnp.int32), cu, jnp.array([2], jnp.int32), 4)
  np.testing.assert_array_equal(lens, [0, 11])

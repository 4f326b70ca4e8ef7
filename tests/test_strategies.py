"""strategy="ulysses" / "all_gather" / "ulysses_ring": the same numbers as the reference, and their errors.

The ring's own suite (test_ring_attention.py) covers strategy="ring".  Here every
other strategy runs the mask / layout / GQA matrix on the XLA backend (forward
and all three gradients, f32 1e-5), one bf16 case, the Pallas TPU kernels in
interpret mode once each, inside a user's shard_map, with a head axis, through
the NNX layer, and every error message.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import (
  GQA_CAUSAL_WINDOW,
  GQA_SEGMENTS,
  GQA_SEGMENTS_LB,
  case_names,
  make_case,
  make_inputs,
  make_sinks,
  pick,
  reference_with_grads,
  with_sinks,
)
from conftest import make_mesh
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src.testing.interpret import interpret_params, no_races

XLA_BLOCKS = fr.BlockSizes(block_q=4, block_kv=4)

# strategy -> (mesh shape, mesh axis names, axis_name)
LAYOUTS = {
  "ulysses": ((4,), ("sp",), "sp"),
  "all_gather": ((4,), ("sp",), "sp"),
  "ulysses_ring": ((2, 2), ("ring", "uly"), ("ring", "uly")),
}
# Cases where the Ulysses axis exceeds the kv heads (kv heads repeated just enough): 8 devices, K = 1 or 2.
WIDE = {
  "ulysses": ((8,), ("sp",), "sp"),
  "all_gather": ((8,), ("sp",), "sp"),
  "ulysses_ring": ((2, 4), ("ring", "uly"), ("ring", "uly")),
}


def strategy_with_grads(
  case, strategy, layout, q, k, v, do, seg, *, implementation="xla", blocks=XLA_BLOCKS, sinks=None, **extra
):
  """Global arrays in natural order -> (out, (dq, dk, dv[, dsinks])) in natural order."""
  shape, names, axis_name = layout
  mesh = make_mesh(shape, names)
  n = int(np.prod(shape))
  zz = (lambda x: fr.zigzag_order(x, n, axis=1)) if case.load_balance else (lambda x: x)
  unzz = (lambda x: fr.zigzag_inverse(x, n, axis=1)) if case.load_balance else (lambda x: x)
  if seg is not None:
    seg = tuple(zz(s) for s in seg) if isinstance(seg, tuple) else zz(seg)

  def f(q, k, v, sinks=None):
    return fr.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name=axis_name,
      strategy=strategy,
      segment_ids=seg,
      load_balance=case.load_balance,
      implementation=implementation,
      block_sizes=blocks,
      sinks=sinks,
      **extra,
      **case.options(),
    )

  f, extra_args = with_sinks(f, sinks)
  out, vjp = jax.vjp(jax.jit(f), zz(q), zz(k), zz(v), *extra_args)
  grads = vjp(zz(do))
  return unzz(out), (*(unzz(g) for g in grads[:3]), *grads[3:])


# Every mask feature, layout and head grouping of the registry (tests/cases.py) at least once per strategy (the
# plain and single-feature cases are covered by these combinations).
# Sinks (each strategy hands `flash` its devices' heads: Ulysses slices them after its all-to-all, with the kv-head
# repeat on 4 devices for 2 kv heads) and MLA (v and the output move at their own head dim through the all-to-alls
# and all-gathers).
MATRIX_CASES = pick(
  "causal_lb", "mqa", "segments_lb", "causal_window_lb", "soft_cap", "cross", "empty_rows", "sinks_gqa",
  "sinks_empty_rows", "mla_gqa", "mla_sinks",
)  # fmt: skip


# ulysses_ring is the Ulysses all-to-all around the ring loop, both covered on every case: its own matrix keeps
# the cases where the two meet in a new way (zigzag positions of a Ulysses group, kv-head repeat, segment ids
# gathered over the Ulysses axis, empty rows).
ULYSSES_RING_CASES = case_names("causal_lb", "mqa", "segments_lb", "empty_rows", "sinks_gqa", "mla_sinks")


def _matrix():
  for strategy, layout in LAYOUTS.items():
    for case in MATRIX_CASES:
      if strategy == "ulysses_ring" and case.name not in ULYSSES_RING_CASES:
        continue
      wide = case.name == "mqa"  # K = 1 on 8 devices: the widest kv-head repeat
      yield pytest.param(strategy, case, WIDE[strategy] if wide else layout, id=f"{strategy}-{case.name}")


@pytest.mark.parametrize("strategy,case,layout", list(_matrix()))
def test_matches_reference(strategy, case, layout):
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  sinks = make_sinks(case)
  out, grads = strategy_with_grads(case, strategy, layout, q, k, v, do, seg, sinks=sinks)
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg, sinks)
  assert out.shape == do.shape and out.dtype == q.dtype and len(grads) == len(ref_grads)
  assert_close(out, ref_out, jnp.float32, "fwd")
  assert_close(grads, ref_grads, jnp.float32, "grad")


@pytest.mark.parametrize("strategy", ["ulysses_ring"])
def test_bf16(strategy):
  case = GQA_SEGMENTS_LB
  q, k, v, do, seg = make_inputs(case, jnp.bfloat16)
  out, grads = strategy_with_grads(case, strategy, WIDE[strategy], q, k, v, do, seg)
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg)
  assert out.dtype == jnp.bfloat16 and all(g.dtype == jnp.bfloat16 for g in grads)
  assert_close(out, ref_out, jnp.bfloat16, "fwd")
  assert_close(grads, ref_grads, jnp.bfloat16, "grad")


@pytest.mark.interpret
@pytest.mark.parametrize("strategy", list(LAYOUTS))
def test_pallas_tpu_interpret(strategy):
  """Any block implementation: the Pallas TPU kernels (interpret mode, race detector on) under each strategy."""
  case = make_case("gqa_lb", "causal", "gqa", N=4, group=2, T=32, S=32, load_balance=True)
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  with no_races():
    out, grads = strategy_with_grads(
      case,
      strategy,
      LAYOUTS[strategy],
      q,
      k,
      v,
      do,
      seg,
      implementation="pallas_tpu",
      blocks=fr.BlockSizes(block_q=8, block_kv=128),
      interpret=interpret_params(),
    )
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg)
  assert_close(out, ref_out, jnp.float32, "fwd")
  assert_close(grads, ref_grads, jnp.float32, "grad")


@pytest.mark.parametrize("sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("strategy", list(LAYOUTS))
def test_inside_user_shard_map(strategy, sinks):
  """axis_name mode: the caller's shard_map binds the axes; the sequence is sharded over both (major first).  With
  sinks replicated over the sequence axes, dsinks is the sum of every shard's rows."""
  case = make_case("sm_sinks", "segments", "gqa", N=8, sinks=True) if sinks else GQA_SEGMENTS
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  s0 = make_sinks(case)
  shape, names, axis_name = LAYOUTS[strategy]
  mesh = make_mesh(shape, names)
  spec, seg_spec = P(None, axis_name, None, None), P(None, axis_name)

  def body(q, k, v, s, sinks=None):
    return fr.ring_attention(
      q, k, v, axis_name=axis_name, strategy=strategy, is_causal=True, segment_ids=s, sinks=sinks
    )

  in_specs = (spec, spec, spec, seg_spec, *((P(),) if sinks else ()))
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec))
  put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))  # noqa: E731
  s_ = put(seg, seg_spec)
  extra = (put(s0, P()),) if sinks else ()
  out, vjp = jax.vjp(lambda q, k, v, *e: f(q, k, v, s_, *e), put(q, spec), put(k, spec), put(v, spec), *extra)
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg, s0)
  assert_close(out, ref_out, jnp.float32)
  grads = vjp(put(do, spec))
  assert len(grads) == len(ref_grads)
  assert_close(grads, ref_grads, jnp.float32, "grad")


@pytest.mark.parametrize("strategy", ["ulysses", "all_gather"])
def test_with_batch_and_head_axes(strategy):
  """Heads on 'tp' and the Ulysses split on 'sp' compose: each device gets N / (tp * sp) q heads, and the
  same slice of the sinks (MLA head dims, so v and the output move at their own size)."""
  case = make_case("3d_sinks_mla", "causal", "gqa", N=8, load_balance=True, sinks=True, H=24, Hv=16)
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  sinks = make_sinks(case)
  mesh = make_mesh((2, 2, 2), ("dp", "sp", "tp"))
  zz, unzz = (lambda x: fr.zigzag_order(x, 2, axis=1)), (lambda x: fr.zigzag_inverse(x, 2, axis=1))

  def f(q, k, v, sinks):
    return fr.ring_attention(
      q, k, v, mesh=mesh, axis_name="sp", batch_axis="dp", head_axis="tp", strategy=strategy, is_causal=True,
      load_balance=True, sinks=sinks,
    )  # fmt: skip

  out, vjp = jax.vjp(jax.jit(f), zz(q), zz(k), zz(v), sinks)
  assert out.sharding.spec == P("dp", "sp", "tp", None)
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg, sinks)
  assert_close(unzz(out), ref_out, jnp.float32)
  *grads, dsinks = vjp(zz(do))
  assert_close(tuple(unzz(g) for g in grads), ref_grads[:3], jnp.float32, "grad")
  assert_close(dsinks, ref_grads[3], jnp.float32, "grad")


def _hlo(strategy, axis_name, mesh, N, K, T=64):
  q = jnp.zeros((2, T, N, 16))
  k = v = jnp.zeros((2, T, K, 16))
  f = jax.jit(
    jax.grad(
      lambda q, k, v: fr.ring_attention(
        q, k, v, mesh=mesh, axis_name=axis_name, strategy=strategy, is_causal=True
      ).sum(),
      argnums=(0, 1, 2),
    )  # fmt: skip
  )
  return f.lower(q, k, v).as_text(dialect="hlo")


def _ops(text, name):
  return [ln.split("=", 1)[1].strip() for ln in text.splitlines() if f" {name}(" in ln or f" {name}-start(" in ln]


def test_all_gather_moves_only_kv_heads_and_reduce_scatters():
  """GQA 8:2 on 4 devices: gathered K/V have 2 heads, the backward reduce-scatters dK/dV, no permutes."""
  text = _hlo("all_gather", "sp", make_mesh((4,), ("sp",)), N=8, K=2)
  gathers = _ops(text, "all-gather")
  assert gathers and all("[2,64,2,16]" in g for g in gathers if "f32[2,64" in g), gathers
  scatters = _ops(text, "reduce-scatter")
  assert len(scatters) == 2 and all(s.startswith("f32[2,16,2,16]") for s in scatters), scatters
  assert not _ops(text, "collective-permute")


def test_ulysses_repeats_kv_heads_just_enough():
  """K=2 on an axis of 4: each kv head is repeated twice (4 heads cross the all-to-all, one per device), not 4x."""
  text = _hlo("ulysses", "sp", make_mesh((4,), ("sp",)), N=8, K=2)
  a2a = [a.split(" ")[0].split("{")[0] for a in _ops(text, "all-to-all")]
  assert not _ops(text, "collective-permute")
  # Forward: the repeated k and v cross with 4 heads (2 x 2); backward: dk and dv come back as 1 head per device.
  assert a2a.count("f32[2,16,4,16]") == 2, a2a
  assert a2a.count("f32[2,64,1,16]") == 2, a2a


def test_nnx_layer_and_attention_fn_with_strategies():
  mesh = make_mesh((2, 4), ("ring", "uly"))
  x = jax.random.normal(jax.random.PRNGKey(0), (2, 32, 16))
  mha = nnx.MultiHeadAttention(4, 16, 32, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
  want = mha(x, is_causal=True)
  layer = fr.RingMultiHeadAttention(
    4, 16, 32, num_kv_heads=2, mesh=mesh, seq_axis=("ring", "uly"), strategy="ulysses_ring", rngs=nnx.Rngs(1)
  )
  nnx.update(layer, nnx.state(mha))
  assert_close(nnx.jit(lambda m, x: m(x, is_causal=True))(layer, x), want, jnp.float32)
  fn_mha = nnx.MultiHeadAttention(
    4,
    16,
    32,
    num_kv_heads=2,
    decode=False,
    attention_fn=fr.make_ring_attention_fn(mesh=mesh, seq_axis="uly", batch_axis="ring", strategy="all_gather"),
    rngs=nnx.Rngs(1),
  )
  nnx.update(fn_mha, nnx.state(mha))
  assert_close(nnx.jit(lambda m, x: m(x, is_causal=True))(fn_mha, x), want, jnp.float32)


def test_one_device_without_axis():
  """With no axis every strategy is attention on one device."""
  case = GQA_CAUSAL_WINDOW
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  ref_out, _ = reference_with_grads(case, q, k, v, do, seg)
  for strategy in ("ulysses_ring",):
    f = jax.jit(
      lambda q, k, v, s=strategy: fr.ring_attention(q, k, v, strategy=s, block_sizes=XLA_BLOCKS, **case.options())
    )
    assert_close(f(q, k, v), ref_out, jnp.float32)


# --------------------------------------------------------------------------------------------
# Errors: each names the argument, the value and what would work
# --------------------------------------------------------------------------------------------


def _qkv(T=16, N=4, K=2, B=2, H=4):
  return jnp.ones((B, T, N, H)), jnp.ones((B, T, K, H)), jnp.ones((B, T, K, H))


@pytest.mark.parametrize("strategy", ["zigzag", "Ulysses", ""])
def test_unknown_strategy(strategy):
  with pytest.raises(ValueError, match=rf"unknown strategy='{strategy}'; choose one of \('ring', 'ulysses', "):
    fr.ring_attention(*_qkv(), strategy=strategy)


@pytest.mark.parametrize("strategy", [None, 1, ("ring",)])
def test_strategy_not_a_string(strategy):
  with pytest.raises(TypeError, match=r"strategy must be a string, one of \('ring', "):
    fr.ring_attention(*_qkv(), strategy=strategy)


@pytest.mark.parametrize("strategy,layout", [("ulysses", LAYOUTS["ulysses"]), ("ulysses_ring", WIDE["ulysses_ring"])])
def test_q_heads_do_not_divide(strategy, layout):
  shape, names, axis_name = layout
  mesh = make_mesh(shape, names)
  ax = "'uly'" if strategy == "ulysses_ring" else "'sp'"
  with pytest.raises(
    ValueError,
    match=rf"strategy='{strategy}' shards the q heads over ulysses axis {ax} of size 4: the number of q heads N=6 "
    rf"must be a multiple of 4 \(kv heads K=2 are repeated as needed\); what would work: .*\[1, 2, 3, 6\].*"
    r"strategy='ring' or 'all_gather'",
  ):
    fr.ring_attention(*_qkv(N=6), mesh=mesh, axis_name=axis_name, strategy=strategy)


def test_q_heads_per_head_axis_device_do_not_divide():
  mesh = make_mesh((4, 2), ("sp", "tp"))
  with pytest.raises(
    ValueError, match=r"the number of q heads N=2 per device of head_axis='tp' must be a multiple of 4"
  ):
    fr.ring_attention(*_qkv(N=4, K=2), mesh=mesh, axis_name="sp", head_axis="tp", strategy="ulysses")


def test_q_heads_do_not_divide_inside_shard_map():
  mesh = make_mesh((4,), ("sp",))
  spec = P(None, "sp")
  f = jax.shard_map(
    lambda q, k, v: fr.ring_attention(q, k, v, axis_name="sp", strategy="ulysses"),
    mesh=mesh,
    in_specs=(spec,) * 3,
    out_specs=spec,
  )
  q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in _qkv(N=6))
  with pytest.raises(ValueError, match=r"the number of q heads N=6 must be a multiple of 4"):
    f(q, k, v)


@pytest.mark.parametrize("strategy", list(LAYOUTS))
def test_sequence_does_not_divide(strategy):
  shape, names, axis_name = LAYOUTS[strategy]
  mesh = make_mesh(shape, names)
  with pytest.raises(
    ValueError,
    match=rf"global q_len=12 must be a multiple of 8 \(ring_size=4 over axis .*, load_balance=True\): "
    rf"the zigzag layout splits each shard into two chunks \(strategy='{strategy}'\)",
  ):
    fr.ring_attention(*_qkv(T=12), mesh=mesh, axis_name=axis_name, strategy=strategy, load_balance=True)


@pytest.mark.parametrize(
  "strategy,axis_name,match",
  [
    ("ulysses", "nope", r"axis_name='nope' is not an axis of the mesh \(mesh axes: \('ring', 'uly'\)\)"),
    ("all_gather", "nope", r"axis_name='nope' is not an axis of the mesh"),
    (
      "ulysses_ring",
      ("ring", "nope"),
      r"axis_name=\('ring', 'nope'\) names 'nope', which is not an axis of the mesh \(mesh axes: \('ring', 'uly'\)\)",
    ),
  ],
)
def test_axis_missing_from_mesh(strategy, axis_name, match):
  mesh = make_mesh((2, 4), ("ring", "uly"))
  with pytest.raises(ValueError, match=match):
    fr.ring_attention(*_qkv(), mesh=mesh, axis_name=axis_name, strategy=strategy)


def test_axis_not_bound_inside_shard_map():
  mesh = make_mesh((2, 2), ("ring", "uly"))
  spec = P(None, ("ring", "uly"))
  f = jax.shard_map(
    lambda q, k, v: fr.ring_attention(q, k, v, axis_name=("ring", "cp"), strategy="ulysses_ring"),
    mesh=mesh,
    in_specs=(spec,) * 3,
    out_specs=spec,
  )
  q, k, v = (jax.device_put(x, NamedSharding(mesh, spec)) for x in _qkv())
  with pytest.raises(ValueError, match=r"axis_name=\('ring', 'cp'\) is not bound: call ring_attention inside"):
    f(q, k, v)


@pytest.mark.parametrize("axis_name", [("uly", "uly"), ["ring", "ring"]])
def test_repeated_axis_in_tuple(axis_name):
  mesh = make_mesh((2, 4), ("ring", "uly"))
  a = axis_name[0]
  with pytest.raises(
    ValueError,
    match=rf"axis_name=\('{a}', '{a}'\) repeats the axis '{a}': strategy='ulysses_ring' needs two different mesh axes",
  ):
    fr.ring_attention(*_qkv(), mesh=mesh, axis_name=axis_name, strategy="ulysses_ring")


@pytest.mark.parametrize("strategy", ["ulysses", "all_gather"])
def test_repeated_axis_in_tuple_single_axis_strategies(strategy):
  mesh = make_mesh((2, 4), ("ring", "uly"))
  with pytest.raises(ValueError, match=r"axis_name=\('uly', 'uly'\) repeats an axis: each mesh axis may appear once"):
    fr.ring_attention(*_qkv(), mesh=mesh, axis_name=("uly", "uly"), strategy=strategy)


@pytest.mark.parametrize("strategy", ["ulysses", "all_gather"])
def test_tuple_axis_for_single_axis_strategies(strategy):
  mesh = make_mesh((2, 4), ("ring", "uly"))
  with pytest.raises(
    NotImplementedError,
    match=rf"strategy='{strategy}' takes one mesh axis, got axis_name=\('ring', 'uly'\); for two axes use "
    r"strategy='ulysses_ring'",
  ):
    fr.ring_attention(*_qkv(), mesh=mesh, axis_name=("ring", "uly"), strategy=strategy)


@pytest.mark.parametrize("axis_name", ["uly", ("uly",), ("ring", "uly", "dp")])
def test_ulysses_ring_needs_an_axis_pair(axis_name):
  mesh = make_mesh((2, 2, 2), ("ring", "uly", "dp"))
  with pytest.raises(ValueError, match=r"strategy='ulysses_ring' needs axis_name=\(ring_axis, ulysses_axis\), two "):
    fr.ring_attention(*_qkv(), mesh=mesh, axis_name=axis_name, strategy="ulysses_ring")


def test_ulysses_ring_axis_also_used_as_head_axis():
  mesh = make_mesh((2, 2, 2), ("ring", "uly", "tp"))
  with pytest.raises(ValueError, match=r"axis_name, batch_axis and head_axis must be different mesh axes, got \["):
    fr.ring_attention(*_qkv(), mesh=mesh, axis_name=("ring", "uly"), head_axis="uly", strategy="ulysses_ring")


# --------------------------------------------------------------------------------------------
# suggest_strategy
# --------------------------------------------------------------------------------------------


class _FakeDevice:
  def __init__(self, i, per_process):
    self.id, self.process_index = i, i // per_process


class _FakeMesh:
  """Two processes x 4 devices, as a multi-process mesh looks to suggest_strategy (no runtime needed)."""

  def __init__(self, shape, names):
    self.axis_names, self.axis_sizes = names, shape
    self.devices = np.array([_FakeDevice(i, 4) for i in range(8)], dtype=object).reshape(shape)


def test_suggest_strategy_lists_every_candidate_with_time_and_memory():
  advice = fr.suggest_strategy(make_mesh((8,), ("sp",)), 32768, 8, 2, 128, jnp.bfloat16, hardware="tpu_v5p")
  assert {c.strategy for c in advice.candidates} == {"ring", "ulysses", "all_gather"}
  assert advice.strategy == advice.candidates[0].strategy and advice.candidates[0].feasible
  times = [c.time_s for c in advice.candidates]
  assert times == sorted(times) and all(t > 0 for t in times)
  mem = {c.strategy: c.memory_bytes for c in advice.candidates}
  assert mem["all_gather"] > mem["ring"]  # the gathered K/V grow with S, the ring's shards with S / n
  ring_4k, ring_32k = (
    {c.strategy: c for c in fr.suggest_strategy(make_mesh((8,), ("sp",)), T, 8, 2, 128, jnp.bfloat16).candidates}[
      "ring"
    ].memory_bytes
    for T in (4096, 32768)
  )
  assert ring_32k == pytest.approx(8 * ring_4k)  # linear in T / n


def test_suggest_strategy_counts_mla_head_dims():
  """DeepSeek-V3's attention (128 heads, qk 192, v 128): every candidate is cheaper in time and memory than the
  same call with v at 192, and dearer than with q/k at 128; a bad v_head_dim is named."""
  mesh = make_mesh((8,), ("sp",))
  run = lambda H, Hv=None: {  # noqa: E731
    c.strategy: c
    for c in fr.suggest_strategy(mesh, 32768, 128, 128, H, jnp.bfloat16, hardware="tpu_v5p", v_head_dim=Hv).candidates
  }
  mla, wide, narrow = run(192, 128), run(192), run(128)
  for name in mla:
    assert narrow[name].time_s < mla[name].time_s < wide[name].time_s, name
    assert narrow[name].memory_bytes < mla[name].memory_bytes < wide[name].memory_bytes, name
  with pytest.raises(ValueError, match=r"v_head_dim must be a positive int, got v_head_dim=0"):
    run(192, 0)


def test_suggest_strategy_marks_ulysses_infeasible_when_heads_do_not_divide():
  advice = fr.suggest_strategy(make_mesh((8,), ("sp",)), 4096, 6, 2, 64, jnp.float32, hardware="h100")
  uly = next(c for c in advice.candidates if c.strategy == "ulysses")
  assert not uly.feasible and "N=6 q heads do not split over 8 devices" in uly.note
  assert advice.strategy != "ulysses"


def test_suggest_strategy_puts_the_ring_across_processes():
  """On 2 processes x 4 devices the ring axis of ulysses_ring is the process axis, the all-to-all stays inside."""
  mesh = _FakeMesh((2, 4), ("host", "local"))
  advice = fr.suggest_strategy(mesh, 32768, 8, 8, 128, jnp.bfloat16, hardware="h100")
  pairs = [c.axis_name for c in advice.candidates if c.strategy == "ulysses_ring"]
  assert pairs == [("host", "local")], pairs
  assert advice.strategy == "ulysses_ring" and advice.factoring == (("host", 2), ("local", 4))


def test_suggest_strategy_errors():
  mesh = make_mesh((8,), ("sp",))
  with pytest.raises(ValueError, match=r"unknown hardware='tpu_v9'; choose one of \('tpu_v5e', "):
    fr.suggest_strategy(mesh, 4096, 8, 2, 64, jnp.float32, hardware="tpu_v9")
  with pytest.raises(ValueError, match=r"axis_name='cp': 'cp' is not an axis of the mesh"):
    fr.suggest_strategy(mesh, 4096, 8, 2, 64, jnp.float32, axis_name="cp")
  with pytest.raises(ValueError, match=r"num_heads=8 must be a multiple of num_kv_heads=3"):
    fr.suggest_strategy(mesh, 4096, 8, 3, 64, jnp.float32)
  with pytest.raises(ValueError, match=r"seq_len must be a positive int, got seq_len=0"):
    fr.suggest_strategy(mesh, 0, 8, 2, 64, jnp.float32)


def test_suggest_strategy_defaults_to_non_causal_like_ring_attention():
  import inspect

  assert inspect.signature(fr.suggest_strategy).parameters["is_causal"].default is False
  assert inspect.signature(fr.ring_attention).parameters["is_causal"].default is False
  args = (make_mesh((8,), ("sp",)), 32768, 8, 2, 128, jnp.bfloat16)
  default = fr.suggest_strategy(*args, hardware="tpu_v5p")
  assert default.candidates == fr.suggest_strategy(*args, hardware="tpu_v5p", is_causal=False).candidates
  causal = {c.strategy: c.time_s for c in fr.suggest_strategy(*args, hardware="tpu_v5p", is_causal=True).candidates}
  assert all(c.time_s > causal[c.strategy] for c in default.candidates)  # causal does half the compute


def test_suggest_strategy_reads_the_hardware_table():
  """The advisor's chips are the hardware table's (one table for the planners, the advisor and the benchmarks)."""
  from flax_ringattn._src.advisor import HARDWARE
  from flax_ringattn.benchmarking import hardware

  assert tuple(HARDWARE) == ("tpu_v5e", "tpu_v5p", "a100", "h100", "cpu")
  h100 = fr.suggest_strategy(make_mesh((8,), ("sp",)), 4096, 8, 2, 64, jnp.float32, hardware="h100").hardware
  assert h100 == fr.Hardware.from_chip(hardware.chip("h100"))
  assert (h100.flops, h100.inner_bandwidth, h100.outer_bandwidth) == (989e12, 450e9, 50e9)

"""The in-kernel ring (`implementation="pallas_tpu_ring"`): ring sizes, DMA modes, tuple axes, protocol checks.

The shared numerical suite (test_ring_attention.py) runs every feature case on a ring of 4; these tests cover
rings of 1, 2 and 8 in both DMA execution modes, rings over two mesh axes, a broken protocol that the race
detector must catch, the bytes the kernels send and TPU lowering (the ring's VMEM model and planner:
test_planner.py).
"""

from __future__ import annotations

import collections
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import Case, dropout, make_case, make_inputs, make_sinks, reference_with_grads, with_sinks
from conftest import make_mesh
from jax import export
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src import flash, masks
from flax_ringattn._src.backends.base import AttentionSpec
from flax_ringattn._src.backends.pallas_tpu import PallasTpuBackend
from flax_ringattn._src.backends.pallas_tpu.ring import protocol as rp
from flax_ringattn._src.backends.pallas_tpu.ring.vmem_forward import ring_fwd
from flax_ringattn._src.testing.interpret import interpret_params, no_races
from flax_ringattn.testing import KernelDebug, Recorder, kernel_debug

interpret = pytest.mark.interpret
BLOCKS = fr.BlockSizes(block_q=16, block_kv=128)


def _inputs(B, T, N, K, H, dtype=jnp.float32, seed=0, segments=False, Hv=None):
  """The registry's inputs (`cases.make_inputs`) for self attention at this shape (v's head dim Hv, None: H),
  with packed-document segment ids or none."""
  shape = Case("inputs", B=B, T=T, S=T, N=N, K=K, H=H, Hv=Hv, segments="self" if segments else None)
  return make_inputs(shape, dtype, seed)


def _run(
  implementation, mesh, axis, q, k, v, do, seg, opts, *, load_balance=False, params=None, blocks=BLOCKS, sinks=None
):
  n = 1
  for a in axis if isinstance(axis, tuple) else (axis,):
    n *= mesh.shape[a]
  if load_balance:
    zz = lambda x: fr.zigzag_order(x, n, axis=1)  # noqa: E731
    q, k, v, do = zz(q), zz(k), zz(v), zz(do)
    seg = None if seg is None else zz(seg)
  extra = {} if implementation == "xla" else dict(interpret=params or interpret_params(), block_sizes=blocks)

  def f(q, k, v, sinks=None):
    return fr.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name=axis,
      segment_ids=seg,
      load_balance=load_balance,
      implementation=implementation,
      sinks=sinks,
      **extra,
      **opts,
    )

  f, extra_args = with_sinks(f, sinks)
  out, vjp = jax.vjp(jax.jit(f), q, k, v, *extra_args)
  grads = vjp(do)
  if load_balance:  # (dsinks, when present, is per head: no token order to undo)
    unzz = lambda x: fr.zigzag_inverse(x, n, axis=1)  # noqa: E731
    out, grads = unzz(out), (*(unzz(g) for g in grads[:3]), *grads[3:])
  return out, grads


def _check(out, grads, q, k, v, do, seg, opts, dtype=jnp.float32):
  ref_out, ref_vjp = jax.vjp(lambda q, k, v: fr.reference_attention(q, k, v, segment_ids=seg, **opts), q, k, v)
  assert_close(out, ref_out, dtype, "fwd")
  assert_close(grads, ref_vjp(do), dtype, "grad")


def _ring_case(n, mask, *, shard=16, B=1, N=2, **fields):
  """A registry case (tests/cases.py) for a ring of n: GQA 2:1 with N q heads, shards of `shard` tokens, head_dim
  16, the mask kind with `fields` (window sizes, zigzag, soft cap, dropout, sinks, MLA head dims) on top."""
  return make_case(f"ring{n}-{mask}", mask, "gqa", N=N, group=2, B=B, T=shard * n, **fields)


def _case_id(n, mode, case):
  """ring{n}-{mode}-{the ring_attention options the case sets}, e.g. ring8-eager-is_causal-local_window_size."""
  options = (
    ("is_causal", case.is_causal),
    ("local_window_size", case.window),
    ("logits_soft_cap", case.soft_cap),
    ("dropout_rate", case.dropout),
    ("sinks", case.sinks),
    ("mla", case.Hv),
  )
  return "-".join([f"ring{n}", mode, *(name for name, value in options if value)])


# (ring size, DMA mode, case): every ring size in both modes across the suite, features spread over them.
RING_CASES = [
  (1, "eager", _ring_case(1, "causal")),
  (2, "on_wait", _ring_case(2, "segments", load_balance=True)),  # zigzag + segment ids
  (2, "eager", _ring_case(2, "window", window=(20, 5), soft_cap=3.0)),
  # Contiguous causal with segment ids: half the K/V sends are skipped (shards past the wrap), receivers of a
  # skipped send keep a stale slot that their EMPTY hop never reads.
  (4, "on_wait", _ring_case(4, "segments")),
  (8, "on_wait", _ring_case(8, "segments", window=(40, 0), load_balance=True)),
  # Contiguous causal window of 20 over shards of 16: hops 3..7 are EMPTY on every member, the ring ends after 3.
  (8, "eager", _ring_case(8, "causal_window", window=(20, 0))),
  # MLA (qk 24, v 16: K and V slots of their own widths) with sinks on rows no key is visible to (the
  # sink-inclusive lse is finite there, the gradients must still be exactly 0), segment ids travelling too.
  (4, "eager", _ring_case(4, "empty_rows", H=24, Hv=16, sinks=True)),
]


@interpret
@pytest.mark.parametrize("n,mode,case", RING_CASES, ids=[_case_id(*c) for c in RING_CASES])
def test_ring_sizes_and_dma_modes(n, mode, case, capfd):
  """GQA 2:1, shards of 16 tokens, forward and all gradients against the reference, no races, and every
  semaphore back at zero when the kernels end (interpret mode prints the ones that are not)."""
  _check_ring_case(n, mode, case, capfd)


def _check_ring_case(n, mode, case, capfd, *, bq=16):
  """One in-kernel ring run of a case on a ring of n against the reference (forward and all gradients, dsinks
  too with sinks), with the race detector on and every semaphore back at zero."""
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  sinks = make_sinks(case)
  opts = case.options()
  mesh = make_mesh((n,), ("sp",))
  with no_races():
    out, grads = _run(
      "pallas_tpu_ring",
      mesh,
      "sp",
      q,
      k,
      v,
      do,
      seg,
      opts,
      load_balance=case.load_balance,
      params=interpret_params(dma_execution_mode=mode),
      blocks=fr.BlockSizes(block_q=bq, block_kv=128),
      sinks=sinks,
    )
  assert "non-zero count" not in capfd.readouterr().out
  if sinks is None:
    _check(out, grads, q, k, v, do, seg, opts)
  else:
    ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg, sinks)
    assert_close(out, ref_out, jnp.float32, "fwd")
    assert_close(grads, ref_grads, jnp.float32, "grad")


# The HBM-slot kernels (`ring/hbm_forward.py`, `ring/hbm_backward.py`), forced on short shards; ring 2 and the
# shared features run in test_ring_attention.py (pallas_tpu_ring_hbm, on 256-token shards: 4 q tiles x 2 kv
# tiles streamed per hop).  (ring size, DMA mode, case, block_q): ring 1 walks 4 x 2 tiles too; rings 4 and 8
# have one kv tile per hop and test hops, skipped sends and skipped rows; B = K = 2 runs four grid steps through
# the same HBM slots.
HBM_CASES = [
  (1, "on_wait", _ring_case(1, "segments", shard=256, soft_cap=5.0), 64),
  # skipped sends: stale HBM slots never read
  (4, "eager", _ring_case(4, "segments", shard=32, B=2, N=4), 16),
  # a two-sided window that spans 3 shards (non-causal), with dropout (one mask for all heads)
  (4, "on_wait", _ring_case(4, "window", shard=32, window=(20, 3), dropout=dropout("broadcast", 3, rate=0.2)), 16),
  # (Ring 8 with zigzag, segments and a window runs with VMEM slots in RING_CASES: the HBM slots' protocol is the
  # same for every hop past the first, and rings 4 show skipped sends, skipped rows and several hops.)
  # MLA (K / V slots, tiles and the dK / dV fold at their own widths) with sinks, zigzag and segment ids; the
  # 24-token kv tile is no whole number of f32 sublane tiles per half: the fold adds with partner buffers
  (4, "on_wait", _ring_case(4, "segments", shard=24, H=24, Hv=16, sinks=True, load_balance=True), 16),
]


@pytest.fixture
def force_slots():
  """force_slots(kind): for the rest of the test, the in-kernel ring keeps its slots in "vmem" or "hbm" whatever
  the planner says (`kernel_debug`)."""
  with contextlib.ExitStack() as stack:
    yield lambda kind: stack.enter_context(kernel_debug(slots=kind))


@pytest.fixture
def hbm_slots(force_slots):
  """The in-kernel ring keeps its slots in HBM whatever the planner says."""
  force_slots("hbm")


@interpret
@pytest.mark.parametrize("n,mode,case,bq", HBM_CASES, ids=[_case_id(*c[:3]) for c in HBM_CASES])
def test_hbm_slots(n, mode, case, bq, hbm_slots, capfd):
  """As test_ring_sizes_and_dma_modes, with the slots, the softmax state and the accumulators in HBM."""
  _check_ring_case(n, mode, case, capfd, bq=bq)


@interpret
@pytest.mark.parametrize("slots", ["vmem", "hbm"])
def test_ragged_tiles_bf16(slots, force_slots):
  """A shard of 48 q rows with 32-row tiles requested: the kernel walks 3 tiles of 16 (bf16, GQA 4:1)."""
  force_slots(slots)
  q, k, v, do, seg = _inputs(1, 48, 4, 1, 16, dtype=jnp.bfloat16)
  mesh = make_mesh((1,), ("sp",))
  opts = dict(is_causal=True)
  blocks = fr.BlockSizes(block_q=32, block_kv=128)

  def f(q, k, v):
    return fr.ring_attention(
      q, k, v, mesh=mesh, implementation="pallas_tpu_ring", interpret=interpret_params(), block_sizes=blocks, **opts
    )

  with no_races():
    out, vjp = jax.vjp(jax.jit(f), q, k, v)
    grads = vjp(do)
  _check(out, grads, q, k, v, do, seg, opts, jnp.bfloat16)


@interpret
@pytest.mark.slow
@pytest.mark.parametrize("shape,lb", [((2, 2), False), ((2, 4), True)], ids=["2x2", "2x4-zigzag"])
def test_tuple_axes_agree(shape, lb):
  """A ring over ("x", "y"): xla and pallas_tpu_ring match the reference (causal, segments, GQA), fwd and grads.
  On 2x2 the layout is contiguous, so the in-kernel ring skips the K/V sends nobody downstream reads, with ring
  members (snake order) that differ from shard order (row-major); on 2x4 zigzag every send runs."""
  n = shape[0] * shape[1]
  q, k, v, do, seg = _inputs(1, 16 * n, 2, 1, 16, segments=True)
  mesh = make_mesh(shape, ("x", "y"))
  opts = dict(is_causal=True)
  for impl in ("xla", "pallas_tpu_ring"):
    checks = no_races() if impl != "xla" else contextlib.nullcontext()
    with checks:
      out, grads = _run(impl, mesh, ("x", "y"), q, k, v, do, seg, opts, load_balance=lb)
    _check(out, grads, q, k, v, do, seg, opts)


@interpret
def test_tuple_axes_hbm_slots(hbm_slots):
  """The HBM-slot kernels on a ring over ("x", "y") 2x2, contiguous causal with segment ids (snake order, 4 of
  12 K/V sends skipped), fwd and grads."""
  q, k, v, do, seg = _inputs(1, 64, 2, 1, 16, segments=True)
  opts = dict(is_causal=True)
  with no_races():
    out, grads = _run("pallas_tpu_ring", make_mesh((2, 2), ("x", "y")), ("x", "y"), q, k, v, do, seg, opts)
  _check(out, grads, q, k, v, do, seg, opts)


@interpret
def test_tuple_axes_block_kernel_ring():
  """The block-kernel ring (pallas_tpu) on ("x", "y") 2x2 agrees too (forward: its ring loop is xla's)."""
  q, k, v, _, _ = _inputs(1, 64, 2, 1, 16)
  mesh = make_mesh((2, 2), ("x", "y"))

  def f(q, k, v):
    return fr.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name=("x", "y"),
      is_causal=True,
      implementation="pallas_tpu",
      interpret=interpret_params(),
      block_sizes=BLOCKS,
    )

  with no_races():
    out = jax.jit(f)(q, k, v)
  assert_close(out, fr.reference_attention(q, k, v, is_causal=True), jnp.float32)


def test_tuple_axis_errors():
  mesh = make_mesh((2, 2), ("x", "y"))
  q = jnp.zeros((1, 16, 2, 8))
  with pytest.raises(
    ValueError, match=r"axis_name=\('x', 'z'\) names 'z', which is not an axis of the mesh \(mesh axes: \('x', 'y'\)\)"
  ):
    fr.ring_attention(q, q, q, mesh=mesh, axis_name=("x", "z"))
  with pytest.raises(ValueError, match=r"must be different mesh axes, got \['x', 'y', 'y'\]"):
    fr.ring_attention(q, q, q, mesh=mesh, axis_name=("x", "y"), batch_axis="y")
  with pytest.raises(ValueError, match=r"axis_name=\(\) names no mesh axis"):
    fr.ring_attention(q, q, q, mesh=mesh, axis_name=())

  def inside(q):
    return fr.ring_attention(q, q, q, axis_name=("x", "z"))

  s = P(None, ("x", "y"))
  with pytest.raises(ValueError, match=r"axis_name=\('x', 'z'\) is not bound: .* \(unbound: \['z'\]\)"):
    jax.shard_map(inside, mesh=mesh, in_specs=s, out_specs=s)(jax.reshard(q, jax.NamedSharding(mesh, s)))


def test_tile_table_too_large_for_smem():
  """4 hops x 8192 q tiles x 512 kv tiles, 2 bits a tile (32 words a row) = 4 MiB of tile table: more than the
  SMEM share.  The ring's own planner (block_sizes=None) never picks such tiles."""
  q = jax.ShapeDtypeStruct((1, 4 * 65536, 1, 8), jnp.float32)
  mesh = make_mesh((4,), ("sp",))

  def f(q):
    return fr.ring_attention(
      q,
      q,
      q,
      mesh=mesh,
      implementation="pallas_tpu_ring",
      interpret=True,
      block_sizes=fr.BlockSizes(block_q=8, block_kv=128),
    )

  with pytest.raises(ValueError, match=r"pallas_tpu_ring: the tile table of 4 hops x 8192 x 512 tiles needs 4194304"):
    jax.eval_shape(f, q)


@interpret
@pytest.mark.races_not_read("expects no_races() to fail on the broken protocol")
@pytest.mark.parametrize("slots", ["vmem", "hbm"])
def test_missing_credit_is_caught_by_the_race_detector(slots):
  """The harness catches what it exists for: without the credit semaphore, r - 1 overwrites a slot that r is
  still reading (ring of 4, eager DMAs), in VMEM or in HBM."""
  n = 4
  q, k, v, _, _ = _inputs(1, 16 * n, 2, 2, 16)
  mesh = make_mesh((n,), ("sp",), explicit=False)
  spec = AttentionSpec(
    mask=masks.MaskSpec(), scale=0.25, block_sizes=BLOCKS, debug=KernelDebug(slots=slots, drop_credits=True)
  )
  s = P(None, "sp")

  def broken(q, k, v):
    return ring_fwd(
      q,
      k,
      v,
      masks.Tokens(),
      masks.Tokens(),
      spec=spec,
      axis_name="sp",
      load_balance=False,
      interpret=interpret_params(dma_execution_mode="eager"),
    )[0]

  f = jax.jit(jax.shard_map(broken, mesh=mesh, in_specs=(s, s, s), out_specs=s))
  with pytest.raises(AssertionError, match="detected a data race"), no_races():
    f(q, k, v)


def _trace_kernels(q, k, v, do, n, **opts):
  """(dmas, events): what the kernels append to a `Recorder` while forward and backward are traced (not run) on a
  ring of n."""
  mesh = make_mesh((n,), ("sp",))

  def f(q, k, v):
    return fr.ring_attention(
      q, k, v, mesh=mesh, implementation="pallas_tpu_ring", interpret=interpret_params(), block_sizes=BLOCKS, **opts
    )

  rec = Recorder()
  with kernel_debug(recorder=rec):
    jax.jit(lambda q, k, v, do: jax.vjp(f, q, k, v)[1](do)).trace(q, k, v, do)
  return rec.dmas, rec.events


def _launched_slots(events):
  """{kernel name: the slot kind it was built with} from the ("slots", kind) events."""
  return {name: detail for name, event, detail in events if event == "slots"}


@pytest.mark.parametrize(
  "opts,load_balance,kv_sends,Hv",
  [
    ({}, False, 12, None),
    (dict(is_causal=True), True, 12, None),
    (dict(is_causal=True), False, 6, None),
    (dict(is_causal=True, local_window_size=(20, 0)), False, 5, None),
    (dict(is_causal=True), True, 12, 8),
  ],
  ids=["full", "causal-zigzag", "causal", "causal-window", "causal-zigzag-mla"],
)
@pytest.mark.parametrize("slots", ["vmem", "hbm"])
def test_bytes_sent_follow_the_schedule(opts, load_balance, kv_sends, Hv, slots, force_slots):
  """Counted from the DMAs the kernels start (once per grid step of B x K), over all 4 ring members: K and V
  (kv heads only) `kv_sends` shard sends each, forward and backward alike; the backward adds the f32 dK and dV
  accumulators n times per member.  Every member sends on each of the n - 1 hops (12 sends) unless nobody
  downstream reads the shard: on the causal contiguous layout member r sends at hops t <= r, and member 3 never
  (shards past the wrap are invisible to everyone): 3 + 2 + 1 = 6.  A causal window of 20 over 16-token shards
  sees 3 shards, so the ring ends after hop 2, and member r sends at hop t when r + 1 sees r - t: 3 + 2 = 5.
  With MLA head dims (qk 16, v 8) K and dK move at H, V and dV at Hv: counted per send size, so a V slot (or dV
  accumulator) at K's width fails.  The same with the slots in HBM: the tiles a kernel streams through VMEM are
  local copies, never sends."""
  force_slots(slots)
  n, B, T, N, K, H = 4, 2, 64, 8, 2, 16
  q, k, v, do, _ = _inputs(B, T, N, K, H, Hv=Hv)
  log, events = _trace_kernels(q, k, v, do, n, load_balance=load_balance, **opts)
  assert _launched_slots(events) == {"ring_fwd": slots, "ring_bwd": slots}
  # member-sends per (kernel, bytes of one grid step's send)
  sends = collections.Counter()
  for name, size, members in log:
    sends[name, size] += members
  k_bytes, v_bytes = ((T // n) * w * 4 for w in (H, Hv or H))  # one grid step's K (V) shard, f32
  expected = collections.Counter({("ring_fwd", k_bytes): kv_sends})
  expected.update({("ring_fwd", v_bytes): kv_sends, ("ring_bwd", k_bytes): kv_sends + n * n})
  expected.update({("ring_bwd", v_bytes): kv_sends + n * n})  # V, then the f32 dV accumulator
  assert sends == expected
  steps = B * K
  sent = {name: steps * sum(b * members for nm, b, members in log if nm == name) for name in ("ring_fwd", "ring_bwd")}
  shard = B * (T // n) * K * (H + (Hv or H))  # elements of one device's K and V shards: kv heads only
  assert sent["ring_fwd"] == kv_sends * shard * 4
  assert sent["ring_bwd"] == kv_sends * shard * 4 + n * n * shard * 4


def _protocol_events(n, opts, slots):
  """(kernel name -> [(event, detail)]) of one grid step of the forward and backward kernels, in program order,
  checking that both were built with `slots`."""
  q, k, v, do, _ = _inputs(1, 16 * n, 2, 1, 16)
  _, events = _trace_kernels(q, k, v, do, n, **opts)
  assert _launched_slots(events) == {"ring_fwd": slots, "ring_bwd": slots}
  out = {}
  for name, event, detail in events:
    if event != "slots":
      out.setdefault(name, []).append((event, detail))
  return out


@pytest.mark.parametrize(
  "n,opts", [(4, {}), (2, {}), (4, dict(is_causal=True, local_window_size=(20, 0)))], ids=["ring4", "ring2", "window"]
)
@pytest.mark.parametrize("slots", ["vmem", "hbm"])
def test_protocol_rules_hold_in_program_order(n, opts, slots, force_slots):
  """The protocol rules, read from the kernels' own program order (the hops are unrolled at trace time):
  * the credit for hop t is released inside hop t, before its first DMA or compute, never at the end of hop
    t - 1 (a compiler may hoist a late signal above the loads of the slot it frees);
  * every descriptor started is the very object waited on, exactly once, within its hop;
  * as many credits are released as are waited for, so the credit semaphore ends at zero.
  Both slot kinds (VMEM and HBM) run the same hop loops, and both are checked."""
  force_slots(slots)
  kernels = _protocol_events(n, opts, slots)
  assert set(kernels) == {"ring_fwd", "ring_bwd"}
  for name, events in kernels.items():
    hops = []  # the events of each hop, split at the ("hop", t) markers
    for event, detail in events:
      if event == "hop":
        assert detail == len(hops), (name, events)
        hops.append([])
      else:
        assert hops, f"{name}: {event} before the first hop"
        hops[-1].append((event, detail))
    releases = sum(e == "release" for e, _ in events)
    assert releases == sum(e == "acquire" for e, _ in events), name
    assert releases >= len(hops) - 1 > 0, (name, releases, len(hops))
    for t, hop in enumerate(hops):
      kinds = [e for e, _ in hop]
      if "release" in kinds:
        assert kinds.index("release") == 0, f"{name} hop {t}: the credit is released after {kinds[0]}"
        assert kinds[1] == "acquire", f"{name} hop {t}: {kinds}"
      if "start" in kinds:
        assert "release" in kinds, f"{name} hop {t} sends without the credit protocol: {kinds}"
      started = [d for e, d in hop if e == "start"]
      waited = [d for e, d in hop if e == "wait"]
      assert sorted(started) == sorted(waited) and len(set(started)) == len(started), f"{name} hop {t}: {hop}"
      for desc in started:
        assert hop.index(("start", desc)) < hop.index(("wait", desc)), f"{name} hop {t}"


@pytest.mark.parametrize(
  "segments,cap,dropout,Hv,terms",
  [
    (False, None, False, None, False),
    (True, 30.0, False, None, False),
    (True, 30.0, True, None, False),
    (True, None, False, 128, False),
    (True, None, True, None, True),
  ],
  ids=["plain", "seg-cap", "seg-cap-dropout", "seg-mla", "seg-dropout-chunk-spans-positions"],
)
@pytest.mark.parametrize("slots", ["vmem", "hbm"])
def test_kernels_lower_to_mosaic_for_tpu(segments, cap, dropout, Hv, terms, slots):
  """jax.export runs the Pallas -> Mosaic lowering of both ring kernels for TPU (ring of 4, bf16, GQA), with
  the slots in VMEM and in HBM, MLA head dims (qk 192, v 128), and every mask term (`terms`: chunks, and
  bidirectional ids and positions given per row travelling with K/V beside the segment ids, the dropout mask
  hashed from those positions).  The kernels are called directly, so the debug hooks go in their spec."""
  rec = Recorder()
  spec = AttentionSpec(
    mask=masks.MaskSpec(
      is_causal=True,
      has_segments=segments,
      chunk_size=300 if terms else None,
      has_bidirectional=terms,
      has_positions=terms,
    ),
    scale=0.1,
    logits_soft_cap=cap,
    block_sizes=fr.BlockSizes(block_q=128, block_kv=256),
    dropout_rate=0.1 if dropout else 0.0,
    dropout_broadcast=False,
    debug=KernelDebug(slots=slots, recorder=rec),
  )
  n, B, T, N, K, H = 4, 1, 512 * 4, 8, 2, 128 if Hv is None else 192
  mesh = jax.sharding.AbstractMesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,))
  s, ss = P(None, "sp"), P(None, "sp")
  sds = jax.ShapeDtypeStruct
  x = sds((B, T, N, H), jnp.bfloat16)
  kv = sds((B, T, K, H), jnp.bfloat16)
  v = sds((B, T, K, Hv or H), jnp.bfloat16)
  seg = sds((B, T), jnp.int32) if segments else None
  ids = sds((B, T), jnp.int32) if terms else None  # positions and bidirectional ids
  drop = sds((4,), jnp.int32) if dropout else None

  def loss(q, k, v, seg, ids, drop):
    # The op's own path for the fused ring: the backend's FlashKernel through the one flash custom_vjp.
    kernel = PallasTpuBackend().fused_ring(axis_name="sp", load_balance=True, spec=spec)
    tokens = masks.Tokens(pos=ids, seg=seg, bid=ids)  # without positions the kernels compute the layout's
    o = flash.flash(kernel, None, q, k, v, tokens, tokens, drop)
    return o.astype(jnp.float32).sum()

  body = jax.shard_map(
    jax.grad(loss, argnums=(0, 1, 2)),
    mesh=mesh,
    in_specs=(s, s, s, ss if segments else None, ss if terms else None, P() if dropout else None),
    out_specs=(s, s, s),
  )
  text = export.export(jax.jit(body), platforms=("tpu",))(x, kv, v, seg, ids, drop).mlir_module()
  assert _launched_slots(rec.events) == {"ring_fwd": slots, "ring_bwd": slots}
  assert text.count("tpu_custom_call") == 2  # forward and backward


def test_packed_tile_table_round_trips():
  """`pack_kinds` / `tile_kind`: every class of a [n, nq, nk] table read back, with nk not a multiple of 16."""
  n, nq, nk = 3, 5, 37
  kinds = jax.random.randint(jax.random.key(0), (n, nq, nk), 0, 3, jnp.int32)
  packed = rp.pack_kinds(kinds)
  assert packed.shape == (n * nq * 3,) and packed.dtype == jnp.int32
  d = rp.RingDims(
    axes=(),
    sizes=(),
    n=n,
    load_balance=False,
    B=1,
    T=nq * 8,
    S=nk * 128,
    N=1,
    K=1,
    H=8,
    dtype=jnp.float32,
    bq=8,
    bk=128,
    has_segments=False,
    live=n,
  )
  got = np.array([[[int(rp.tile_kind(packed, d, t, i, j)) for j in range(nk)] for i in range(nq)] for t in range(n)])
  np.testing.assert_array_equal(got, np.asarray(kinds))


def test_selection_and_errors():
  q = jnp.zeros((1, 64, 2, 16))
  assert "pallas_tpu_ring" in fr.available_implementations()
  if jax.default_backend() != "tpu":
    with pytest.raises(NotImplementedError, match=r"pallas_tpu_ring needs a TPU .* pass interpret=True"):
      fr.ring_attention(q, q, q, implementation="pallas_tpu_ring")
  with pytest.raises(NotImplementedError, match=r"pallas_tpu_ring supports float32 and bfloat16 inputs"):
    h = q.astype(jnp.float16)
    fr.ring_attention(h, h, h, implementation="pallas_tpu_ring", interpret=True)


@interpret
def test_layer_with_tuple_seq_axis():
  """RingMultiHeadAttention over seq_axis=("x", "y") with the in-kernel ring matches nnx.MultiHeadAttention."""
  from flax import nnx

  mesh = make_mesh((1, 2), ("x", "y"))
  kw = dict(num_heads=2, in_features=16, qkv_features=16, decode=False, rngs=nnx.Rngs(0))
  mha = nnx.MultiHeadAttention(**kw)
  ring = fr.RingMultiHeadAttention(
    **kw,
    mesh=mesh,
    seq_axis=("x", "y"),
    implementation="pallas_tpu_ring",
    interpret=interpret_params(),
    block_sizes=BLOCKS,
  )
  nnx.update(ring, nnx.state(mha))
  x = jax.random.normal(jax.random.PRNGKey(1), (1, 64, 16))
  expected = mha(x, is_causal=True)
  x = jax.sharding.reshard(x, jax.sharding.NamedSharding(mesh, P(None, ("x", "y"), None)))
  with no_races():
    got = ring(x, is_causal=True)
  assert_close(got, expected, jnp.float32)
  np.testing.assert_equal(np.isfinite(np.asarray(got)).all(), True)


def test_default_prefers_the_kernel_ring_where_it_fits():
  """implementation=None on a TPU: the in-kernel ring (VMEM or HBM slots) when its tiles fit VMEM, else the ring
  loop over pallas_tpu's block kernels; named, "pallas_tpu_ring" is always the fused ring and "pallas_tpu" never;
  in interpret mode implementation=None never picks it, nor for a ring of one (no axis, or an axis of size 1:
  the block kernels run it, as a model on one chip calls them)."""
  from flax_ringattn._src.backends.pallas_tpu import PallasTpuBackend
  from flax_ringattn._src.backends.registry import Choice
  from flax_ringattn._src.ring import op

  spec = AttentionSpec(mask=masks.MaskSpec(is_causal=True), scale=0.1)
  auto = Choice(PallasTpuBackend(), None)
  small = (
    jax.ShapeDtypeStruct((1, 4 * 256, 8, 128), jnp.bfloat16),
    jax.ShapeDtypeStruct((1, 4 * 256, 2, 128), jnp.bfloat16),
  )
  assert op.use_fused_ring(auto, spec, *small, 4)
  # Every mask term runs in the fused ring too (positions given per row travel as one more token field).
  for terms in (dict(chunk_size=64), dict(has_bidirectional=True), dict(has_positions=True, has_segments=True)):
    assert op.use_fused_ring(auto, AttentionSpec(mask=masks.MaskSpec(is_causal=True, **terms), scale=0.1), *small, 4)
  assert op.use_fused_ring(Choice(PallasTpuBackend(), "pallas_tpu_ring", (("fused", True),)), spec, *small, 4)
  assert not op.use_fused_ring(Choice(PallasTpuBackend(), "pallas_tpu"), spec, *small, 4)  # named block kernels
  assert not op.use_fused_ring(Choice(PallasTpuBackend(interpret=interpret_params()), None), spec, *small, 4)
  assert not op.use_fused_ring(auto, spec, *small, 4, strategy="all_gather")
  assert not op.use_fused_ring(auto, spec, *small, 1)  # mesh=... with a ring axis of size 1
  assert not op.use_fused_ring(auto, spec, *small, 1, ring_size=1)  # no axis_name: one device
  assert op.use_fused_ring(auto, spec, *small, 1, ring_size=4)  # inside shard_map: local shards, a ring of 4
  assert op.use_fused_ring(Choice(PallasTpuBackend(), "pallas_tpu_ring", (("fused", True),)), spec, *small, 1)
  long = (  # 32K tokens per device (planned for v4 off TPU: 16 MiB of VMEM)
    jax.ShapeDtypeStruct((1, 4 << 15, 8, 128), jnp.bfloat16),
    jax.ShapeDtypeStruct((1, 4 << 15, 2, 128), jnp.bfloat16),
  )
  assert op.use_fused_ring(auto, spec, *long, 4)  # HBM slots: the shard length is not capped by VMEM
  wide = (
    jax.ShapeDtypeStruct((1, 4 * 256, 512, 512), jnp.bfloat16),
    jax.ShapeDtypeStruct((1, 4 * 256, 1, 512), jnp.bfloat16),
  )
  assert not op.use_fused_ring(auto, spec, *wide, 4)


@pytest.mark.parametrize("sizes", [(2, 2), (2, 4), (4, 2), (2, 3), (2, 2, 2)])
def test_snake_ring_is_a_walk_between_grid_neighbours(sizes):
  from flax_ringattn._src import layout

  n = int(np.prod(sizes))
  coords = [layout.snake_coords(m, sizes) for m in range(n)]
  assert sorted(coords) == sorted(np.ndindex(*sizes))  # every device once
  assert [layout.snake_member(c, sizes) for c in coords] == list(range(n))
  for a, b in zip(coords, coords[1:] + coords[:1], strict=True):
    steps = [min(abs(x - y), s - abs(x - y)) for x, y, s in zip(a, b, sizes, strict=True)]  # torus distance
    wrap = b == coords[0]
    assert sum(steps) == 1 or (wrap and sizes[0] % 2), (a, b)
  # the traced form agrees with the static one
  traced = [tuple(int(x) for x in layout.snake_coords(jnp.int32(m), sizes)) for m in range(n)]
  assert traced == coords
  assert [layout.ring_shard(m, sizes) for m in range(n)] == [int(np.ravel_multi_index(c, sizes)) for c in coords]


def test_other_strategies_need_block_kernels():
  mesh = make_mesh((2,), ("sp",))
  q = jnp.zeros((1, 32, 2, 8))
  with pytest.raises(NotImplementedError, match=r"implementation='pallas_tpu_ring' is the ring strategy inside one"):
    fr.ring_attention(q, q, q, mesh=mesh, implementation="pallas_tpu_ring", interpret=True, strategy="ulysses")

"""The backend-agnostic numerical suite of ring_attention.

Every backend in BACKENDS runs every case in CASES (the feature registry,
tests/cases.py), or the subset it names: forward and all three gradients
against `reference_attention` (f32 1e-5, bf16 2e-2, from tolerances.py).  A
backend that cannot run a case must raise NotImplementedError, and that is
asserted instead (capability flags).  What runs, per backend:

* xla: every case at ring size 4 in f32, and at 8 the cases whose tiles see
  other shards (ACROSS_SHARDS, segments with sinks, MLA with GQA); ring 1
  (tile skipping in one shard) and ring 2 (both neighbours are one device) on
  the cases each exercises; bf16 at ring 4 for the cases that change what a
  tile computes or merge the most hops; tiles of 4 x 4 tokens, so every shard
  has many.
* pallas_tpu (TPU interpret mode on CPU, race detector read after every run):
  ring 2 in f32 for causal_lb, gqa, segments_lb, cross_causal_lb,
  causal_window_lb, empty_rows (ACROSS_SHARDS: the cases whose tiles see other
  shards' positions in ways a ring of 1 cannot show), MLA and sinks with GQA;
  ring 1 for every other mask, head-layout, cap, sinks and MLA case (ring 2's
  diagonal hop is ring 1's work); ring 4 for causal_window_lb (a window over
  several hops); bf16 at ring 1 for the cases that change what a tile computes
  (BF16_TILE) and at ring 2 for gqa.  The hop loop around the kernel (offsets,
  skipping, merging, bf16 carries) is the portable ring's, shared with xla,
  which runs every case at ring 4.  Interpret mode pays about 50 ms per grid
  step, so this is sized to keep `make test` short.  Batch 1 and one kv head
  (two for segments_lb; GQA group sizes kept), on shards of 2 x 2 tiles: self
  attention 256-token shards in 128-row q tiles and 128-lane kv tiles; cross
  attention 64-row q shards (two 32-row tiles) against 256-token kv shards.
  Several kv tiles accumulate per shard, and masked tiles redirect their fetch.
  test_pallas_tpu.py runs shards of 2 x 4 tiles at ring 2.
* pallas_gpu (Pallas's generic interpreter on CPU; it has no race detector):
  f32 at ring 1 and at ring 4 for the cases with hop skipping, zigzag chunks
  inside a tile, windows and segments across shards (GPU_RING4), bf16 at 1
  (MLA) and 2 (BF16_TILE but plain, causal_lb and window), 16 x 16 tiles; the S=32 cases
  have no legal kv tile at ring 4 and must raise NotImplementedError there.
"""

from __future__ import annotations

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cases import (
  CASE_NAMES,
  CASES,
  DTYPES,
  GQA_CAUSAL_LB,
  GQA_CAUSAL_WINDOW,
  GQA_SEGMENTS,
  GQA_SEGMENTS_LB,
  MLA,
  SINKS,
  Case,
  case_names,
  dtype_id,
  make_inputs,
  make_sinks,
  pick,
  reference_with_grads,
  with_sinks,
)
from conftest import make_mesh
from jax.sharding import PartitionSpec as P
from tolerances import assert_close

import flax_ringattn as fr
from flax_ringattn._src.testing.interpret import interpret_params, no_races
from flax_ringattn.testing import kernel_debug


@dataclasses.dataclass(frozen=True)
class Backend:
  name: str
  unsupported: frozenset = frozenset()  # case names that must raise NotImplementedError
  extra: tuple = ()  # extra keyword arguments for ring_attention, as (key, value) pairs
  blocks: fr.BlockSizes = fr.BlockSizes(block_q=4, block_kv=4)  # small: many tiles per shard
  # (ring size, case names or None for all) to run in each dtype.
  f32_rings: tuple = ((1, None), (2, None), (4, None), (8, None))
  bf16_rings: tuple = ((4, None),)
  marks: tuple = ()
  race_checked: bool = False  # Pallas interpret mode: assert the race detector found nothing
  # Shard geometry (self-attention shard length, cross-attention q shard length, BlockSizes for each) that
  # replaces the cases' own lengths, or None to run the cases as written.
  tiled_shards: tuple | None = None
  cases: frozenset | None = None  # run only these case names (None: all); the rest is covered elsewhere
  # pallas_tpu_ring only: force the communication slots into "vmem" or "hbm" (`flax_ringattn.testing.kernel_debug`);
  # None lets the planner choose (VMEM at these sizes).
  slots: str | None = None
  label: str | None = None  # the test id, where two entries share a backend name

  @property
  def id(self) -> str:
    return self.label or self.name

  @property
  def ring_sizes(self):
    return tuple(sorted({n for n, _ in self.f32_rings + self.bf16_rings}))

  @contextlib.contextmanager
  def checks(self):
    with no_races() if self.race_checked else contextlib.nullcontext():
      # Only the entries that force slots carry a KernelDebug: the rest run with the production debug=None.
      with kernel_debug(slots=self.slots) if self.slots is not None else contextlib.nullcontext():
        yield

  def shape_case(self, case, n):
    """The case at this backend's geometry for ring size n, and the block sizes to run it with."""
    if self.tiled_shards is None:
      return case, self.blocks
    self_len, cross_q_len, self_blocks, cross_blocks = self.tiled_shards
    # Interpret mode pays per grid step: one batch row and one kv head (same GQA group size) keep it fast;
    # segments_lb keeps two kv heads, so a kv-head grid axis longer than 1 runs at every ring size too.
    kv_heads = 2 if case.name == "segments_lb" else 1
    small = dict(B=1, N=kv_heads * case.N // case.K, K=kv_heads)
    if case.S != case.T:  # cross attention: short q shards against full kv shards
      return dataclasses.replace(case, T=cross_q_len * n, S=self_len * n, **small), cross_blocks
    return dataclasses.replace(case, T=self_len * n, S=self_len * n, **small), self_blocks


# Cases whose tiles see other shards' positions in ways a ring of 1 cannot show: zigzag chunks, GQA, segments
# travelling, cross attention, windows across hops and rows left empty by other shards.
ACROSS_SHARDS = case_names("causal_lb", "gqa", "segments_lb", "cross_causal_lb", "causal_window_lb", "empty_rows")
# bf16 at the largest ring: GQA, zigzag and segments (the cases with the most hops merged and skipped).
BF16_RING = case_names("gqa", "causal_lb", "segments_lb")
# bf16 in one shard: the cases that change what a tile computes (soft cap, cross shapes, GQA, segments).
BF16_TILE = case_names("plain", "gqa", "soft_cap", "cross", "segments")
# Attention sinks live in the one `flash` wrapper (no kernel sees them) and MLA changes every kernel's v / output
# tiles.  xla runs every sinks and MLA case at ring 4; the interpret-mode kernels run the ones that reach
# their own code: GQA sinks, sinks on empty rows, MLA with GQA across zigzag shards, and MLA with sinks, a window
# and GQA at once (the gpt-oss / DeepSeek mixes).
FEATURES = case_names(*CASE_NAMES) - set(SINKS) - set(MLA)  # the mask, head-layout and cap cases
SINKS_MLA_KERNEL = case_names("sinks_gqa", "sinks_empty_rows", "mla_gqa", "mla_sinks")
# pallas_gpu at ring 4: the cases whose hops skip, split zigzag chunks inside a tile or carry a window or
# segments across shards, and the three it must refuse there (no legal kv tile); the others' tile math runs at
# ring 1 and their hop loop (shared with xla) at rings 4 and 8 there.
# pallas_tpu at ring 2, f32.
TPU_RING2 = ACROSS_SHARDS | {"mla_gqa", "sinks_gqa"}
GPU_RING4 = case_names(
  "causal_lb", "gqa", "segments_lb", "window", "causal_window_lb", "cross", "cross_causal_lb", "empty_rows"
)

BACKENDS = [
  Backend(
    "xla",
    # Every case at rings 4 and 8; ring 1 (one shard: tile skipping only) and ring 2 (both neighbours are one
    # device) on the cases each exercises.
    f32_rings=(
      (1, case_names("plain", "causal", "segments", "window", "soft_cap", "empty_rows")),
      (2, ACROSS_SHARDS - {"empty_rows"}),
      (4, None),
      # Ring 8: the hop loop's longest run on zigzag chunks, travelling segment ids and rows left empty by other
      # shards (every case runs at ring 4; the others gained nothing at 8, and cost 9 s).
      (8, case_names("causal_lb", "segments_lb", "empty_rows")),
    ),
    # bf16 at ring 4: the hop loop's bf16 carries over many hops (GQA, zigzag, segments, windows, sinks, MLA).
    # What a tile computes in bf16 alone (plain, soft cap, cross shapes) runs at ring 1 in the kernels' backends.
    bf16_rings=((4, BF16_RING | case_names("segments", "causal_window_lb", "mla_sinks", "sinks_window_cap")),),
  ),
  # TPU tiles (kv tiles of 128 lanes, q tiles a multiple of 16 rows for bf16): 2 x 2 tiles per shard.
  Backend(
    "pallas_tpu",
    extra=(("interpret", interpret_params()),),  # race detector on
    # Ring 2's first hop is ring 1's work (the same shard geometry, the diagonal tiles classified and skipped),
    # so ring 1 runs only the cases ring 2 does not (and not "causal": soft_cap is causal MHA with a cap).
    f32_rings=(
      (1, (FEATURES | SINKS_MLA_KERNEL) - TPU_RING2 - {"causal"}),
      (2, TPU_RING2),
      (4, case_names("causal_window_lb")),  # a window reaching over several hops
    ),
    bf16_rings=((1, (BF16_TILE | {"mla_sinks"}) - {"gqa"}), (2, case_names("gqa"))),
    marks=(pytest.mark.interpret,),
    race_checked=True,
    tiled_shards=(256, 64, fr.BlockSizes(block_q=128, block_kv=128), fr.BlockSizes(block_q=32, block_kv=128)),
  ),
  # GPU tiles: powers of two, kv tiles >= 16 tokens (Triton matmuls), so the S=32 cases have no kv tile at ring 4.
  # Pallas's generic interpreter has no race detector (and nothing to race: no DMAs or semaphores).
  Backend(
    "pallas_gpu",
    unsupported=frozenset({"cross-ring4", "cross_causal_lb-ring4", "empty_rows-ring4"}),
    extra=(("interpret", jax.default_backend() != "gpu"),),  # compiled on a GPU (benchmarks/gpu_check.sh)
    blocks=fr.BlockSizes(block_q=16, block_kv=16),
    # f32 at ring 1 (4 x 4 tiles per shard: in-block tile skipping) and ring 4 (hop skipping, zigzag chunks
    # inside a tile), bf16 at ring 2 (both at once); interpret-mode compiles cost ~10 s a test.
    f32_rings=((1, FEATURES | SINKS_MLA_KERNEL), (4, GPU_RING4 | {"mla_gqa", "sinks_gqa"})),
    # bf16 MLA at ring 1 too: the row `benchmarks/gpu_check.sh` runs compiled.
    # bf16 at ring 2 skips "plain" (gqa and soft_cap are plain attention plus one feature each).
    bf16_rings=((1, {"mla_sinks"}), (2, (BF16_TILE - {"plain"}) | {"causal_lb", "window"})),
    marks=(pytest.mark.interpret, pytest.mark.races_not_read("Triton interpret mode: no race detector, no DMAs")),
  ),
]
# The in-kernel ring (one kernel per direction does every hop): ring 2 here (both neighbours are one device);
# rings 1, 4 and 8, tuple axes and both DMA modes in test_pallas_tpu_ring.py.
BACKENDS.append(
  Backend(
    "pallas_tpu_ring",
    extra=(("interpret", interpret_params()),),
    blocks=fr.BlockSizes(block_q=16, block_kv=128),
    f32_rings=((2, None),),
    bf16_rings=((2, case_names("gqa", "causal_lb", "mla_sinks")),),
    marks=(pytest.mark.interpret,),
    race_checked=True,
    # Interpret mode is slow: the other mask features run in test_pallas_tpu_ring.py on other ring sizes.
    cases=case_names("causal_lb", "gqa", "cross_causal_lb", "empty_rows", "sinks_gqa", "mla_gqa", "mla_sinks"),
  )
)
# The in-kernel ring with HBM slots (shards too long for VMEM; forced here on short ones): 4 x 2 tiles per
# shard, so q tiles, streamed kv tiles and the dK / dV pass's streamed q tiles all loop.
BACKENDS.append(
  Backend(
    "pallas_tpu_ring",
    label="pallas_tpu_ring_hbm",
    slots="hbm",
    extra=(("interpret", interpret_params()),),
    f32_rings=((2, None),),
    bf16_rings=((2, case_names("gqa")),),
    marks=(pytest.mark.interpret,),
    race_checked=True,
    tiled_shards=(256, 64, fr.BlockSizes(block_q=64, block_kv=128), fr.BlockSizes(block_q=32, block_kv=128)),
    # MLA through HBM slots with zigzag and segments at ring 4 runs in test_pallas_tpu_ring.py (HBM_CASES).
    cases=case_names("causal_lb", "gqa", "cross_causal_lb", "empty_rows", "mla_sinks"),
  )
)


def ring_with_grads(case: Case, backend: Backend, n: int, q, k, v, do, seg, *, explicit=True, blocks=None, sinks=None):
  """Runs the ring on global arrays (natural order in, natural order out); with `sinks`, dsinks is the fourth
  gradient."""
  mesh = make_mesh((n,), ("sp",), explicit=explicit)
  if case.load_balance:
    zz = lambda x: fr.zigzag_order(x, n, axis=1)
    q, k, v, do = zz(q), zz(k), zz(v), zz(do)
    if seg is not None:
      seg = tuple(zz(s) for s in seg) if isinstance(seg, tuple) else zz(seg)

  def f(q, k, v, sinks=None):
    return fr.ring_attention(
      q,
      k,
      v,
      mesh=mesh,
      axis_name="sp",
      segment_ids=seg,
      load_balance=case.load_balance,
      implementation=backend.name,
      block_sizes=backend.blocks if blocks is None else blocks,
      sinks=sinks,
      **dict(backend.extra),
      **case.options(),
    )

  f, extra = with_sinks(f, sinks)
  out, vjp = jax.vjp(jax.jit(f), q, k, v, *extra)
  grads = vjp(do)
  if case.load_balance:
    unzz = lambda x: fr.zigzag_inverse(x, n, axis=1)
    out, grads = unzz(out), (*(unzz(g) for g in grads[:3]), *grads[3:])
  return out, grads


def _matrix():
  for b in BACKENDS:
    for case in CASES:
      if b.cases is not None and case.name not in b.cases:
        continue
      for dtype, rings in ((DTYPES["f32"], b.f32_rings), (DTYPES["bf16"], b.bf16_rings)):
        for n, selected in rings:
          if selected is None or case.name in selected:
            tag = f"{b.id}-{case.name}-ring{n}-{dtype_id(dtype)}"
            yield pytest.param(b, case, n, dtype, id=tag, marks=b.marks)


def _supported(backend: Backend, case_name: str, n: int) -> bool:
  """`unsupported` names a case ("cross") or a case at one ring size ("cross-ring4")."""
  return not {case_name, f"{case_name}-ring{n}"} & backend.unsupported


@pytest.mark.parametrize("backend,case,n,dtype", list(_matrix()))
def test_matches_reference(backend, case, n, dtype):
  case, blocks = backend.shape_case(case, n)
  q, k, v, do, seg = make_inputs(case, dtype)
  sinks = make_sinks(case)
  if not _supported(backend, case.name, n):
    with pytest.raises(NotImplementedError):
      ring_with_grads(case, backend, n, q, k, v, do, seg, blocks=blocks, sinks=sinks)
    return
  with backend.checks():
    out, grads = ring_with_grads(case, backend, n, q, k, v, do, seg, blocks=blocks, sinks=sinks)
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg, sinks)
  assert out.dtype == dtype and out.shape == do.shape
  assert_close(out, ref_out, dtype, "fwd")
  names = ("q", "k", "v", "sinks")
  assert len(grads) == len(ref_grads) == (4 if case.sinks else 3)
  for name, x, g, rg in zip(names, (q, k, v, sinks), grads, ref_grads, strict=False):
    assert g.dtype == x.dtype and g.shape == x.shape, name
    assert_close(g, rg, dtype, "grad")


@pytest.mark.parametrize("backend", [pytest.param(b, id=b.id, marks=b.marks) for b in BACKENDS])
def test_empty_rows_are_exact_zeros(backend):
  sizes = (2,) if backend.race_checked else (2, 4)  # TPU interpret mode: ring 4 runs in the matrix
  n = max(n for n in sizes if _supported(backend, "empty_rows", n))
  case, blocks = backend.shape_case(pick("empty_rows")[0], n)
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  with backend.checks():
    out, (dq, _, _) = ring_with_grads(case, backend, n, q, k, v, do, seg, blocks=blocks)
  empty = np.asarray(seg[0] == 3)  # [B, T]
  assert empty.any() and not empty.all()
  assert np.all(np.asarray(out)[empty] == 0.0)
  assert np.all(np.asarray(dq)[empty] == 0.0)
  assert np.isfinite(np.asarray(out)).all() and np.isfinite(np.asarray(dq)).all()


# The HBM-slot ring (slots="hbm") reduces in the same fixed order as the VMEM-slot one (no atomics, tiles and
# hops in program order); its numerics run in the matrix above.
@pytest.mark.parametrize("backend", [pytest.param(b, id=b.id, marks=b.marks) for b in BACKENDS if b.slots is None])
def test_deterministic(backend):
  n = 2 if backend.race_checked else backend.ring_sizes[-1]  # TPU interpret mode: a ring of 2 is enough
  case, blocks = backend.shape_case(GQA_SEGMENTS_LB, n)
  q, k, v, do, seg = make_inputs(case, jnp.float32, seed=3)
  with backend.checks():
    a = ring_with_grads(case, backend, n, q, k, v, do, seg, blocks=blocks)
    b = ring_with_grads(case, backend, n, q, k, v, do, seg, blocks=blocks)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize(
  "explicit,sinks", [(True, False), (False, False), (True, True)], ids=["explicit", "auto", "explicit-sinks"]
)
def test_inside_user_shard_map(explicit, sinks):
  """axis_name mode: the caller's shard_map (check_vma on) binds the axis.  Sinks replicated over it: dsinks is
  the sum over every shard's rows (the flash wrapper's psum to the replicated parameter)."""
  case = dataclasses.replace(GQA_SEGMENTS, sinks=sinks)
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  s0 = make_sinks(case)
  mesh = make_mesh((4,), ("sp",), explicit=explicit)
  spec, seg_spec = P(None, "sp", None, None), P(None, "sp")

  @jax.jit
  def f(q, k, v, seg, *sinks):
    def body(q, k, v, s, *sinks):
      return fr.ring_attention(
        q, k, v, axis_name="sp", is_causal=True, segment_ids=s, sinks=sinks[0] if sinks else None
      )

    in_specs = (spec, spec, spec, seg_spec, *((P(),) if sinks else ()))
    return jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=spec)(q, k, v, seg, *sinks)

  put = lambda x, s: jax.device_put(x, jax.sharding.NamedSharding(mesh, s))
  args = (put(q, spec), put(k, spec), put(v, spec), put(seg, seg_spec))
  extra = (put(s0, P()),) if sinks else ()
  out, vjp = jax.vjp(lambda q, k, v, *e: f(q, k, v, args[3], *e), *args[:3], *extra)
  grads = vjp(put(do, spec))
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg, s0)
  assert_close(out, ref_out, jnp.float32)
  assert_close(grads, ref_grads, jnp.float32, "grad")


def test_single_device_without_mesh():
  case = GQA_CAUSAL_WINDOW
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  f = lambda q, k, v: fr.ring_attention(q, k, v, block_sizes=BACKENDS[0].blocks, **case.options())
  out, vjp = jax.vjp(f, q, k, v)
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg)
  assert_close(out, ref_out, jnp.float32)
  assert_close(vjp(do), ref_grads, jnp.float32, "grad")


@pytest.mark.parametrize("features", ["plain", "sinks_mla"])
def test_batch_and_head_axes_on_3d_mesh(features):
  """Sequence on 'sp', batch on 'dp', heads on 'tp', all at once; with sinks each 'tp' device takes its heads'
  slice of them (and dsinks sums the 'dp' and 'sp' devices' rows), with MLA head dims."""
  case = GQA_CAUSAL_LB
  if features == "sinks_mla":
    case = dataclasses.replace(case, sinks=True, H=24, Hv=16)
  q, k, v, do, seg = make_inputs(case, jnp.float32)
  sinks = make_sinks(case)
  mesh = make_mesh((2, 2, 2), ("dp", "sp", "tp"))
  zz = lambda x: fr.zigzag_order(x, 2, axis=1)

  def f(q, k, v, sinks=None):
    return fr.ring_attention(
      q, k, v, mesh=mesh, axis_name="sp", batch_axis="dp", head_axis="tp", is_causal=True, load_balance=True,
      sinks=sinks,
    )  # fmt: skip

  f, extra = with_sinks(f, sinks)
  out, vjp = jax.vjp(jax.jit(f), zz(q), zz(k), zz(v), *extra)
  assert out.sharding.spec == P("dp", "sp", "tp", None)
  grads = vjp(zz(do))
  unzz = lambda x: fr.zigzag_inverse(x, 2, axis=1)
  ref_out, ref_grads = reference_with_grads(case, q, k, v, do, seg, sinks)
  assert_close(unzz(out), ref_out, jnp.float32)
  assert len(grads) == len(ref_grads)
  assert_close((*(unzz(g) for g in grads[:3]), *grads[3:]), ref_grads, jnp.float32, "grad")


def _collective_permutes(hlo_text: str):
  """Shapes of the operands of every collective-permute(-start) in an HLO module."""
  shapes = []
  for line in hlo_text.splitlines():
    if "collective-permute(" in line or "collective-permute-start(" in line:
      lhs = line.split("=", 1)[1].strip()
      shapes.append(lhs.split(" collective-permute")[0])
  return shapes


def test_only_kv_heads_travel():
  """GQA 8:2 -> every permuted K/V buffer has 2 heads, never 8 (no repeat before rotating)."""
  mesh = make_mesh((4,), ("sp",))
  q = jnp.zeros((2, 64, 8, 16))
  k = v = jnp.zeros((2, 64, 2, 16))
  f = jax.jit(lambda q, k, v: fr.ring_attention(q, k, v, mesh=mesh, is_causal=True))
  text = f.lower(q, k, v).as_text(dialect="hlo")
  shapes = _collective_permutes(text)
  assert shapes, "the ring must rotate K/V with collective-permutes"
  assert all("[2,16,2,16]" in s for s in shapes), shapes
  assert not any("[2,16,8,16]" in s for s in shapes), shapes


def test_mla_k_and_v_travel_at_their_own_head_dims():
  """MLA (qk 24, v 16) on a ring of 4: the forward rotates K at 24 and V at 16 (never V padded to K's size), and
  the backward's dK / dV accumulators travel at the same sizes."""
  mesh = make_mesh((4,), ("sp",))
  q, k, v = jnp.zeros((2, 64, 8, 24)), jnp.zeros((2, 64, 2, 24)), jnp.zeros((2, 64, 2, 16))
  f = jax.jit(jax.grad(lambda q, k, v: fr.ring_attention(q, k, v, mesh=mesh, is_causal=True).sum(), (0, 1, 2)))
  shapes = _collective_permutes(f.lower(q, k, v).as_text(dialect="hlo"))
  k_moves = [s for s in shapes if "[2,16,2,24]" in s]
  v_moves = [s for s in shapes if "[2,16,2,16]" in s]
  assert k_moves and v_moves, shapes
  assert len(k_moves) == len(v_moves), shapes  # K and V (and dK and dV) always move together
  assert all(s in k_moves + v_moves or "s32" in s for s in shapes), shapes

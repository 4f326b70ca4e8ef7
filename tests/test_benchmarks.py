"""The benchmarks refuse to time wrong results: their reference checks can fail, and a failure exits with 1."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

_BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name):
  spec = importlib.util.spec_from_file_location(f"_bench_{name}", _BENCHMARKS / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = module
  spec.loader.exec_module(module)
  return module


@pytest.fixture(scope="module")
def paged():
  return _load("paged_throughput")


@pytest.fixture(scope="module")
def ring():
  return _load("ring_scaling")


def _never(*args, **kwargs):
  raise AssertionError("timed although the reference check failed")


def _paged_setup(paged):
  args = paged.parse_args(["--quick"])
  work = paged.make_workload(args)
  rng = np.random.default_rng(0)
  pool = paged.make_pool(work, jnp.float32, rng)
  return args, work, pool, paged.make_layouts(work, pool, jnp.float32, rng)


def test_paged_reference_check_fails_on_a_wrong_op(paged):
  _, work, pool, lay = _paged_setup(paged)
  attn = paged.make_attn(None, None)
  assert paged.reference_check(work, pool, lay, attn, jnp.float32) <= 1e-4
  wrong = jax.jit(lambda *a: attn(*a) * 1.01)
  assert paged.reference_check(work, pool, lay, wrong, jnp.float32) > 1e-4


def test_paged_wrong_result_exits_1_before_timing(paged, monkeypatch):
  monkeypatch.setattr(paged, "reference_check", lambda *a: float("nan"))
  monkeypatch.setattr(paged, "time_interleaved", _never)
  with pytest.raises(SystemExit) as exit_info:
    paged.main(["--quick"])
  assert exit_info.value.code == paged.EXIT_WRONG_RESULT == 1


def test_ring_reference_check_passes_and_fails(ring, monkeypatch):
  """The zigzag row (inputs permuted in, gradients back) passes; a ring that is 1% off fails."""
  monkeypatch.setattr(ring, "CHECK_SEQ_LEN", 256)
  mesh = jax.make_mesh((8,), (ring.AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
  args = ring.parse_args(["--quick", "--impls", "ring+lb", "--causal", "causal"])
  (line,) = ring.check_against_reference(args, mesh, None)
  assert line.startswith("ok: ring+lb causal=True"), line
  real = ring.make_ring
  monkeypatch.setattr(ring, "make_ring", lambda *a: lambda q, k, v: real(*a)(q, k, v) * 1.01)
  (line,) = ring.check_against_reference(args, mesh, None)
  assert line.startswith("FAILED: ring+lb causal=True"), line


def test_ring_wrong_result_exits_1_before_timing(ring, monkeypatch):
  monkeypatch.setattr(ring, "matmul_gflops", lambda repeats: 1.0)
  monkeypatch.setattr(ring, "check_against_reference", lambda *a: ["FAILED: ring causal=True T=1024"])
  monkeypatch.setattr(ring, "measure_seq_len", _never)
  with pytest.raises(SystemExit) as exit_info:
    ring.main(["--quick", "--impls", "ring"])
  assert exit_info.value.code == ring.EXIT_WRONG_RESULT == 1


@pytest.fixture(scope="module")
def roofline():
  return _load("tpu_roofline")


KIB = 1024


def test_roofline_ring_hbm_hop_hand_counted(roofline):
  """`ring_hbm_hop` on v5e, B=1, N=2, K=1 (G=2), H=128, bf16, ring of n=4, shard L=256, tiles bq=bk=128
  (nq = nk = 2), (sublane, 128)-tiled bytes.  One copy of: a q / dO tile [2, 128, 128] bf16 = 64 KiB; a K / V
  tile [128, 128] bf16 = 32 KiB; an f32 [2, 128, 128] tile (o, dq) = 128 KiB; an lse /
  delta tile [2, 128, 1] f32, lane-padded to 128 = 128 KiB (bare: 1 KiB); a dK / dV tile [128, 128] f32 = 64 KiB;
  a K / V shard [256, 128] bf16 = 64 KiB; a dK / dV accumulator [256, 128] f32 = 128 KiB.

  fwd, per q tile: q 64 + K/V of both kv tiles 2 x (32 + 32) = 128 + state (o 128, lse 128) 256 in (not hop 0)
  and 256 out.  x 2 q tiles.  Send: K + V = 128 KiB, read here + received here.
    hop 1: 2 x (64 + 128 + 256 + 256) = 1408;  hop 0: 2 x (64 + 128 + 256) = 896;
    hop 3 (last, no send): 1408.  Bare bytes (lse 1 KiB), hop 1: 2 x (64 + 128 + 129 + 129) = 900.
  bwd hop 1: dQ pass 2 x (q 64 + dO 64 + lse 128 + delta 128 + dq in 128 + dq out 128 + K/V 128) = 1536;
    dK/dV pass 2 x (K/V 64 + both q tiles 2 x 384 + dK, dV out 128) = 1920; fold 2 x 2 x 3 x 64 = 768:
    4224.  Send: K/V 128 + dK/dV 256 = 384 KiB.  Bare bytes (lse / delta 1 KiB): dQ 2 x 514 = 1028,
    dK/dV 2 x (64 + 2 x 130 + 128) = 904, fold 768: 2700.
  FLOPs: 2 x G x L x L x H = 33554432 per matmul; fwd 2 matmuls, bwd 3 (dQ) + 4 (dK/dV).
  """
  p = roofline.Problem(B=1, N=2, K=1, H=128, dtype="bfloat16", n=4, window=0)
  hw = roofline.hardware("v5e")

  def hop(pas, t, tiled=True):
    return roofline.ring_hbm_hop("v5e", 256, p, pas, hop=t, tile=(128, 128), tiled=tiled)

  mm = 2 * 2 * 256 * 256 * 128

  f = hop("fwd", 1)
  assert (f.tiles, f.hop, f.smem_table) == ((128, 128), 1, 4 * 2 * 1 * 4)  # n x nq rows of one packed word
  assert (f.flops, f.tile_bytes, f.sent, f.ring_bytes) == (2 * mm, 1408 * KIB, 128 * KIB, 256 * KIB)
  assert f.bytes == 1664 * KIB and f.t_mxu == f.flops / hw.peak and f.t_hbm == f.bytes / hw.hbm_bw
  assert f.t_ici == f.sent / hw.ici_link and f.bound == ("mxu" if f.t_mxu >= f.t_hbm else "hbm")
  assert f.hidden == (f.t_ici <= max(f.t_mxu, f.t_hbm))
  assert (hop("fwd", 0).tile_bytes, hop("fwd", 0).sent) == (896 * KIB, 128 * KIB)
  assert (hop("fwd", 3).tile_bytes, hop("fwd", 3).sent, hop("fwd", 3).t_ici) == (1408 * KIB, 0, 0)
  assert hop("fwd", 1, tiled=False).tile_bytes == 900 * KIB

  b = hop("bwd", 1)
  assert (b.flops, b.tile_bytes, b.sent, b.ring_bytes) == (7 * mm, 4224 * KIB, 384 * KIB, 768 * KIB)
  assert hop("bwd", 1, tiled=False).tile_bytes == 2700 * KIB
  assert roofline.middle_hop(p.n) == 1 and roofline.ring_hbm_hop("v5e", 256, p, "bwd", tile=(128, 128)).hop == 1
  with pytest.raises(ValueError, match="not a hop"):
    hop("fwd", 4)


def test_roofline_prints_the_ring_hbm_section(roofline, capsys):
  """The section the script prints after `print_kernel_ring` (main calls it): header, labelled as a model, and a
  row per pass, with the ring planner's tiles and slots."""
  p = roofline.Problem(B=1, N=32, K=8, H=128, dtype="bfloat16", n=8, window=4096)
  roofline.print_kernel_ring_hbm(["v5e"], p, True, shards=(8192,))
  out = capsys.readouterr().out
  assert "In-kernel ring with HBM slots" in out and "model-derived, not measured" in out
  rows = [line.split() for line in out.splitlines() if line.startswith("  v5e")]
  assert [r[2] for r in rows] == ["fwd", "bwd"]
  plans = [
    roofline.planner.plan_ring(
      T=8192,
      S=8192,
      n=8,
      num_heads=32,
      num_kv_heads=8,
      head_dim=128,
      dtype=jnp.bfloat16,
      backward=bwd,
      generation="v5e",
    )
    for bwd in (False, True)
  ]
  assert [(r[3], r[4]) for r in rows] == [(f"{pl.bq}x{pl.bk}", pl.slots) for pl in plans]
  assert all(r[11] in ("mxu", "hbm") for r in rows)


def test_roofline_hbm_slot_hops_are_mxu_bound(roofline):
  """What the README says of the model: for the script's default problem, from 8K-token shards on, every
  generation's HBM-slot hop (fwd and bwd, at the ring planner's tiles) is MXU-bound, and hides its ICI send where
  a link figure exists (v5e, v5p, v6e)."""
  p = roofline.Problem(B=1, N=32, K=8, H=128, dtype="bfloat16", n=8, window=4096)
  for g in roofline.GENERATIONS:
    for L in (8192, 32768):
      for pas in ("fwd", "bwd"):
        r = roofline.ring_hbm_hop(g, L, p, pas)
        assert r.slots == "hbm" and r.bound == "mxu", (g, L, pas, r)
        assert r.hidden is (None if g in ("v4", "v7x") else True), (g, L, pas, r)

"""The benchmark harness and the scripts on it: wrong results exit 1 before anything is timed, paired medians,
the JSON report, the hardware table against JAX's, the cost model by hand, and the roofline's models."""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from bench_scripts import load, never
from flax import nnx

import flax_ringattn as fr
from flax_ringattn import benchmarking as bench
from flax_ringattn._src.perf import harness
from flax_ringattn.benchmarking import cost, hardware


@pytest.fixture(scope="module")
def paged():
  return load("paged_throughput")


@pytest.fixture(scope="module")
def ring():
  return load("ring_scaling")


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
  monkeypatch.setattr(paged, "time_interleaved", never)
  with pytest.raises(SystemExit) as exit_info:
    paged.main(["--quick"])
  assert exit_info.value.code == paged.EXIT_WRONG_RESULT == 1


def test_ring_reference_check_passes_and_fails(ring, monkeypatch):
  """The zigzag row (inputs permuted in, gradients back) passes; a ring that is 1% off fails."""
  monkeypatch.setattr(ring, "CHECK_SEQ_LEN", 256)
  mesh = jax.make_mesh((8,), (ring.AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:8])
  args = ring.parse_args(["--quick", "--impls", "ring+lb", "--causal", "causal"])
  (check,) = ring.check_against_reference(args, mesh, None)
  assert check.ok and check.line().startswith("ok: ring+lb causal=True"), check.line()
  real = ring.make_ring
  monkeypatch.setattr(ring, "make_ring", lambda *a: lambda q, k, v: real(*a)(q, k, v) * 1.01)
  (check,) = ring.check_against_reference(args, mesh, None)
  assert not check.ok and check.line().startswith("FAILED: ring+lb causal=True"), check.line()


def test_ring_wrong_result_exits_1_before_timing(ring, monkeypatch):
  monkeypatch.setattr(ring, "measure_matmul_flops", lambda *a, **k: 1e9)
  monkeypatch.setattr(ring, "check_against_reference", lambda *a: [bench.Check("ring causal=True T=1024", 0.1, 2e-4)])
  monkeypatch.setattr(ring, "measure_seq_len", never)
  with pytest.raises(SystemExit) as exit_info:
    ring.main(["--quick", "--impls", "ring"])
  assert exit_info.value.code == ring.EXIT_WRONG_RESULT == 1


@pytest.fixture(scope="module")
def roofline():
  return load("tpu_roofline")


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
  hw = hardware.tpu("v5e")
  peak, hbm = hw.peak_flops("bfloat16"), hw.memory_bandwidth

  def hop(pas, t, tiled=True):
    return roofline.ring_hbm_hop("v5e", 256, p, pas, hop=t, tile=(128, 128), tiled=tiled)

  mm = 2 * 2 * 256 * 256 * 128

  f = hop("fwd", 1)
  assert (f.tiles, f.hop, f.smem_table) == ((128, 128), 1, 4 * 2 * 1 * 4)  # n x nq rows of one packed word
  assert (f.flops, f.tile_bytes, f.sent, f.ring_bytes) == (2 * mm, 1408 * KIB, 128 * KIB, 256 * KIB)
  assert f.bytes == 1664 * KIB and f.t_mxu == f.flops / peak and f.t_hbm == f.bytes / hbm
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


def test_roofline_ring_hbm_hop_uses_the_planners_traffic_model(roofline):
  """The HBM-slot hop's passes are `planners.hbm_bytes` of the block kernels they mirror (the model `plan_ring`
  minimises): hop 0 of the forward, bare bytes, is exactly the forward block kernel's traffic."""
  p = roofline.Problem(B=2, N=8, K=2, H=128, dtype="bfloat16", n=4, window=0)
  hop = roofline.ring_hbm_hop("v5e", 1024, p, "fwd", hop=0, tiled=False)
  bq, bk = hop.tiles
  dims = dict(bq=bq, bk=bk, q_len=1024, kv_len=1024, num_heads=8, num_kv_heads=2, head_dim=128, dtype=jnp.bfloat16)
  assert hop.tile_bytes == 2 * roofline.planner.hbm_bytes("fwd", **dims)


def test_roofline_prints_the_ring_hbm_section(roofline):
  """The section main prints after the in-kernel ring table: labelled as a model, a row per pass, with the ring
  planner's tiles and slots."""
  p = roofline.Problem(B=1, N=32, K=8, H=128, dtype="bfloat16", n=8, window=4096)
  report = bench.Report("roofline", json=True, stream=io.StringIO())
  roofline.kernel_ring_hbm_table(report, ["v5e"], p, True, shards=(8192,))
  (section,) = report.sections
  assert "In-kernel ring with HBM slots" in section["table"] and "model-derived, not measured" in section["table"]
  rows = section["rows"]
  assert [r["pass"] for r in rows] == ["fwd", "bwd"]
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
  assert [(r["tiles"], r["slots"]) for r in rows] == [(f"{pl.bq}x{pl.bk}", pl.slots) for pl in plans]
  assert all(r["bound"] in ("mxu", "hbm") for r in rows)


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


def test_roofline_json_report_parses(roofline):
  """The whole script with --json: one JSON document on stdout, every section a table with rows, exit 0."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = roofline.main(["--quick", "--generations", "v5e", "--masks", "causal-lb", "--json"])
  doc = json.loads(out.getvalue())
  assert code == doc["exit_code"] == bench.EXIT_OK
  tables = {s["table"].split(" (")[0].split(":")[0]: s for s in doc["sections"] if "table" in s}
  assert {
    "Hardware",
    "Per pass, one device's whole ring",
    "ICI per hop",
    "In-kernel ring with HBM slots",
    "MLA",
  } <= set(tables)
  # DeepSeek-V3's MLA row: the walk at v 128 costs less than the same call with v at 192, in both passes.
  mla = tables["MLA"]["rows"]
  assert [r["pass"] for r in mla] == ["fwd", "bwd"]
  assert all(0.5 < r["ratio"] < 1.0 and r["t_dev ms"] < r["t_dev v=192 ms"] for r in mla), mla
  (hw,) = tables["Hardware"]["rows"]
  assert hw["gen"] == "v5e" and hw["bf16 TF/s"] == 197 and hw["HBM GB/s"] == 820  # numbers stay numbers


# --------------------------------------------------------------------------------------------
# tpu_kernels.py: off a TPU its kernels run in interpret mode on tiny shapes (it implies --quick there).

# In-process runs leave JAX's global configuration alone (the script turns the persistent cache on by default).
NO_CACHE = ["--no-compilation-cache"]
SMOKE_RUN = "a benchmark's smoke run: its kernels run without the race detector (the kernel tests read it)"


@pytest.fixture(scope="module")
def tpu_kernels():
  return load("tpu_kernels")


@pytest.mark.interpret
@pytest.mark.races_not_read(SMOKE_RUN)
def test_tpu_kernels_quick_run_checks_and_prints_both_tables(tpu_kernels, tmp_path):
  """--quick on CPU: every row checked before timing (ours vs splash and flash_attention; the paged rows vs JAX's
  jnp reference), both tables printed, and --json PATH writes the same rows as JSON beside the Markdown."""
  path = tmp_path / "tpu_kernels.json"
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    argv = ["--quick", "--repeats", "1", "--block-sizes", "256,128,128,256", "--json", str(path), *NO_CACHE]
    argv += ["--ours-variants", "heads_major+natural_exp"]
    assert tpu_kernels.main(argv) == 0
  text = out.getvalue()
  assert "## Block kernels: ring_attention(implementation='pallas_tpu') on one device vs splash" in text, text
  assert "## Ragged paged attention: paged_attention(implementation='pallas_tpu') vs JAX's" in text, text
  assert "ok: block T=256 causal fwd+bwd: ours vs flash b256 (worst: " in text and "FAILED" not in text, text
  assert "Host round trip, timed after the rows: a tiny jitted call waited for each time: " in text, text
  tables = {s["table"].split(":")[0]: s for s in json.loads(path.read_text())["sections"] if "table" in s}
  block, paged = tables["Block kernels"], tables["Ragged paged attention"]
  # fwd+bwd rows time the gradients alone (what a training step keeps), the peers at their best block (capped at T)
  assert "fwd+bwd: the gradients alone" in block["table"] and {r["splash at"] for r in block["rows"]} == {"b256"}
  summary = tables["Summary"]
  assert [r["ratio"] for r in summary["rows"]] == ["splash/ours", "splash BTNH/ours", "flash/ours"]
  assert all(r["rows"] == 2 and r["min"] <= r["median"] for r in summary["rows"]), summary["rows"]
  assert [(r["T"], r["pass"]) for r in block["rows"]] == [(256, "fwd"), (256, "fwd+bwd")]
  assert {r["ours tiles"] for r in block["rows"]} == {"256x128; 128x256"}  # --block-sizes: forward; backward
  assert all(r["splash BTNH ms"] > 0 for r in block["rows"])  # splash on our layout: checked against ours, timed
  assert all(r["ours heads_major+natural_exp ms"] > 0 for r in block["rows"])  # a forward variant: checked, timed
  assert [r["rows"] for r in paged["rows"]] == [4, 16, 15]  # the last: exactly the new tokens, no padding row
  for r in block["rows"] + paged["rows"]:
    assert r["notes"] == "" and r["ours ms"] > 0 and r["max err"] is not None, r  # checked, then timed


@pytest.mark.interpret
@pytest.mark.races_not_read(SMOKE_RUN)
def test_tpu_kernels_paged_rows_and_a_blocks_sweep(tpu_kernels, tmp_path):
  """--paged-rows runs only those batches; several --paged-blocks give one checked, timed row per choice."""
  path = tmp_path / "paged.json"
  argv = ["--tables", "paged", "--paged-rows", "1", "--paged-blocks", "8,16", "16,32", "--repeats", "1", *NO_CACHE]
  with contextlib.redirect_stdout(io.StringIO()):
    assert tpu_kernels.main([*argv, "--json", str(path)]) == 0
  (paged,) = (s for s in json.loads(path.read_text())["sections"] if "table" in s)
  got = [(r["rows"], r["ours blocks"]) for r in paged["rows"]]
  # Row 1 of [4, 16, 15] only, once per block choice; the blocks as the kernel runs them (bf16 q: a q block of
  # at least 16 rows, so "8,16" runs 16 x 16).
  assert got == [(16, "16x16"), (16, "16x32")], got
  assert all(r["notes"] == "" and r["max err"] is not None for r in paged["rows"]), paged["rows"]
  # Off a TPU (interpret mode) every call is waited for; --calls-per-round sets the calls per turn.
  assert tpu_kernels.parse_args([]).calls_per_round == 1
  assert tpu_kernels.parse_args(["--calls-per-round", "3"]).calls_per_round == 3
  bad_args = [["--paged-blocks", "16"], ["--paged-blocks", "a,b"], ["--paged-rows", "x"], ["--block-sizes", "1,2,3"]]
  bad_args += [["--ours-variants", "lanes"], ["--ours-variants", "heads_major+"]]
  for bad in bad_args + [["--calls-per-round", "0"]]:
    with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
      tpu_kernels.parse_args(bad)
  with pytest.raises(SystemExit, match="no row"), contextlib.redirect_stdout(io.StringIO()):
    tpu_kernels.main(["--tables", "paged", "--paged-rows", "7", *NO_CACHE])


@pytest.mark.interpret
@pytest.mark.races_not_read(SMOKE_RUN)
def test_tpu_kernels_paged_layouts_on_merged_pages(tpu_kernels, tmp_path):
  """--paged-layouts: one table per head layout, ours on merged pages; head dim 64 (which jax refuses) is checked
  against ours on [P, page, K, H] pages and timed beside it; a summary over every layout names the worst row."""
  path = tmp_path / "layouts.json"
  argv = ["--tables", "paged", "--paged-layouts", "4/2/64", "--paged-steps", "decode", "--repeats", "1", *NO_CACHE]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert tpu_kernels.main([*argv, "--json", str(path)]) == 0
  text = out.getvalue()
  assert "ok: paged 4/2/64: decode 4 x 64, 4 rows: ours vs ours [P, page, K, H]" in text, text
  (table, summary) = (s for s in json.loads(path.read_text())["sections"] if "table" in s)
  assert table["table"].startswith("4/2/64: Ragged paged attention") and "ours on merged pages" in table["table"]
  (row,) = table["rows"]
  assert row["ours ms"] > 0 and "[P,page,K,H] pages: " in row["notes"], row
  assert summary["table"] == "Summary: paged kernel, every layout" and summary["rows"][1]["ratio"] == "% HBM"
  with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
    tpu_kernels.parse_args(["--paged-layouts", "6/4/64"])  # N not a multiple of K
  # --layout-timeout: each layout in a child process; one that does not finish in time leaves a row saying so.
  argv = ["--tables", "paged", "--paged-layouts", "4/2/64", "--json", "--layout-timeout=0.01", "--repeats", "1"]
  assert tpu_kernels.child_argv(argv) == ["--repeats", "1"]
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    assert (
      tpu_kernels.main(["--tables", "paged", "--paged-layouts", "4/2/64", "--layout-timeout", "0.01", *NO_CACHE]) == 0
    )
  assert "4/2/64: did not finish in 0.01 s" in out.getvalue(), out.getvalue()


@pytest.mark.interpret
@pytest.mark.races_not_read(SMOKE_RUN)
def test_tpu_kernels_block_layouts_with_gqa_windows_and_segments(tpu_kernels, tmp_path):
  """--block-layouts B/N/K/H with GQA, and the window and segments masks: ours and splash (GQA native, LocalMask,
  SegmentIds) checked against each other in forward and gradients, one table per layout and one summary."""
  path = tmp_path / "block.json"
  argv = ["--tables", "block", "--block-layouts", "1/4/2/128", "--masks", "window,segments", "--window", "128"]
  argv += ["--segments", "2", "--repeats", "1", "--no-flash", "--no-splash-layout", "--json", str(path), *NO_CACHE]
  with contextlib.redirect_stdout(io.StringIO()):
    assert tpu_kernels.main(argv) == 0
  table, summary = (s for s in json.loads(path.read_text())["sections"] if "table" in s)
  assert table["table"].startswith("B=1 N=4 K=2 H=128: Block kernels")
  got = [(r["mask"], r["pass"]) for r in table["rows"]]
  assert got == [("window", "fwd"), ("segments", "fwd"), ("window", "fwd+bwd"), ("segments", "fwd+bwd")], got
  assert all(r["notes"] == "" and r["max err"] is not None for r in table["rows"]), table["rows"]
  assert summary["rows"][0]["rows"] == 4
  assert tpu_kernels.parse_args(["--block-layouts", "models"]).block_layouts[1] == (1, 14, 2, 64)
  with pytest.raises(SystemExit), contextlib.redirect_stderr(io.StringIO()):
    tpu_kernels.parse_args(["--block-layouts", "1/6/4/64"])


@pytest.mark.interpret
@pytest.mark.races_not_read(SMOKE_RUN)
def test_tpu_kernels_wrong_result_exits_1_before_timing(tpu_kernels, monkeypatch):
  real = tpu_kernels.ours_block_fn
  monkeypatch.setattr(tpu_kernels, "ours_block_fn", lambda *a: lambda q, k, v: real(*a)(q, k, v) * 1.1)
  monkeypatch.setattr(tpu_kernels, "time_interleaved", never)
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
    tpu_kernels.main(["--quick", "--tables", "block", "--no-flash", *NO_CACHE])
  assert exit_info.value.code == tpu_kernels.EXIT_WRONG_RESULT == 1
  assert "FAILED: block T=256 causal fwd: ours vs splash" in out.getvalue(), out.getvalue()


# paged_sweep.py: off a TPU, interpret mode on a tiny decode batch.


def test_paged_sweep_checks_times_each_slot_count_and_fails_a_wrong_result(capsys, monkeypatch):
  sweep = load("paged_sweep")
  assert sweep.main(["--rows", "8/2/64/16/40/3", "--fwd-slots", "2", "3", "--repeats", "1"]) == 0
  out = capsys.readouterr().out
  rows = [line for line in out.splitlines() if line.startswith("| 8/2/64, page 16, 3 x 40")]
  assert [line.split("|")[2].strip() for line in rows] == ["2", "3"]
  with pytest.raises(SystemExit):
    sweep.parse_args(["--rows", "6/4/64/16/40"])  # N not a multiple of K
  monkeypatch.setattr(sweep, "TOLERANCE", -1.0)  # any difference is wrong
  monkeypatch.setattr(sweep, "time_interleaved", never)
  with pytest.raises(SystemExit) as exit_info:
    sweep.main(["--rows", "8/2/64/16/40/3", "--repeats", "1"])
  assert exit_info.value.code == sweep.EXIT_WRONG_RESULT == 1


# --------------------------------------------------------------------------------------------
# The harness.


def test_time_interleaved_rotates_warms_up_and_drops_a_failing_candidate():
  order, errors = [], {}

  def call(name):
    order.append(name)
    if name == "c" and order.count("c") == 2:
      raise RuntimeError("boom")
    return name

  calls = {n: (lambda n=n: call(n)) for n in "abc"}
  times = bench.time_interleaved(calls, 3, warmup=1, on_error=lambda n, e: errors.setdefault(n, str(e)))
  # Round 0 (warm-up) a b c; round 1 b c(fails, dropped); then a b, b a.
  assert order == ["a", "b", "c", "b", "c", "a", "a", "b", "b", "a"]
  assert errors == {"c": "boom"} and [len(times[n]) for n in "abc"] == [3, 3, 0]
  with pytest.raises(ZeroDivisionError):  # without on_error a failure propagates
    bench.time_interleaved({"d": lambda: 1 / 0}, 1, warmup=0)


def test_time_interleaved_calls_per_round_dispatches_several_and_divides(monkeypatch):
  """calls_per_round=n: n calls per turn, only the last one waited for, the time per call."""
  waited, calls = [], []
  monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or x)
  clock = iter(range(0, 1000, 6))  # each turn: 6 "seconds" between its two clock reads
  monkeypatch.setattr(harness.time, "perf_counter", lambda: next(clock))
  times = bench.time_interleaved({"a": lambda: calls.append(len(calls)) or len(calls)}, 2, warmup=1, calls_per_round=3)
  assert len(calls) == 9 and waited == [3, 6, 9]  # 3 rounds x 3 calls; the last call of each turn waited for
  assert times == {"a": [2.0, 2.0]}  # 6 s over 3 calls, the warm-up round dropped
  with pytest.raises(ValueError, match="calls_per_round must be >= 1, got 0"):
    bench.time_interleaved({"a": lambda: 1}, 1, calls_per_round=0)


def test_count_compiles_counts_traces_and_times_the_calls_after_the_first():
  seen = []
  fn = lambda x, n: (seen.append(1), x * n)[1]  # noqa: E731 -- appends once per trace
  same = [(jnp.ones(3), i) for i in range(4)]
  traces, step_s = bench.count_compiles(fn, same)
  assert traces == 1 == len(seen) and step_s > 0
  traces, _ = bench.count_compiles(fn, [(jnp.ones(3), 1), (jnp.ones(4), 1)])  # a new shape traces again
  assert traces == 2


def test_paired_ratio_is_the_median_of_per_round_ratios():
  slow, fast = [2.0, 9.0, 4.0, 1.0], [1.0, 3.0, 2.0, 2.0]
  paired = bench.paired_ratio(slow, fast)
  assert paired.ratios == (2.0, 3.0, 2.0, 0.5) and paired.ratio == 2.0 and paired.losses == 1
  assert bench.median(slow) / bench.median(fast) != paired.ratio  # not a ratio of medians
  with pytest.raises(ValueError, match="same rounds"):
    bench.paired_ratio([1.0], [1.0, 2.0])


def test_compare_metrics_and_non_finite_results():
  want = {"o": np.array([1.0, -2.0]), "g": np.array([0.5])}
  got = {"o": np.array([1.0, -2.2]), "g": np.array([0.5])}
  assert bench.error(got, want) == pytest.approx(0.2)
  assert bench.error(got, want, metric="rel_max") == pytest.approx(0.1)
  assert bench.error(got, want, metric="rel_elementwise") == pytest.approx(0.2 / 3)
  assert bench.compare("x", got, want, tol=0.25).ok and not bench.compare("x", got, want, tol=0.1).ok
  bad = bench.compare("nan", {"o": np.array([np.nan, 0.0]), "g": np.zeros(1)}, want, tol=1.0)
  assert not bad.ok and bad.error == math.inf and bad.line().startswith("FAILED: nan:")


def test_a_failing_check_exits_1_and_the_json_report_says_so():
  out = io.StringIO()
  report = bench.Report("t", json=True, stream=out)
  with pytest.raises(SystemExit) as exit_info:
    report.require([bench.Check("good", 0.0, 1e-3), bench.Check("bad", 1.0, 1e-3)])
  assert exit_info.value.code == bench.EXIT_WRONG_RESULT == 1
  doc = json.loads(out.getvalue())
  assert doc["exit_code"] == 1 and [c["ok"] for c in doc["checks"]] == [True, False]


def test_json_report_parses_and_target_misses_exit_3():
  out = io.StringIO()
  report = bench.Report("t", json=True, meta={"machine": "here"}, stream=out)
  report.table("rows", ["name", "ms", "ratio"], [["a", 1.5, None], ["b", np.float32(2.0), float("nan")]])
  report.note("a note")
  report.target("speed", 0.5, ">= 1x", False)
  report.target("info", "n/a", "-", None)
  assert report.finish(enforce_targets=False) == bench.EXIT_OK
  code = report.finish()
  assert code == bench.EXIT_TARGET_MISSED == 3
  doc = json.loads(out.getvalue().split("\n}\n", 1)[1])  # the second document
  assert doc["meta"] == {"machine": "here"} and doc["exit_code"] == 3
  table = next(s for s in doc["sections"] if "table" in s)
  assert table["rows"] == [{"name": "a", "ms": 1.5, "ratio": None}, {"name": "b", "ms": 2.0, "ratio": None}]
  assert [t["met"] for t in doc["targets"]] == [False, None]


def test_markdown_report():
  out = io.StringIO()
  report = bench.Report("title", stream=out)
  report.table("t", ["a", "b"], [[1, 0.12345], ["x", None]], formats={"b": ".2f"})
  report.target("goal", 1.0, ">= 2", False)
  assert report.finish() == 3
  text = out.getvalue()
  assert "# title" in text and "| a | b    |" in text and "| 1 | 0.12 |" in text and "| x | -    |" in text
  assert "**missed**" in text and text == report.markdown()


# --------------------------------------------------------------------------------------------
# The hardware table, the cost model and the problem sets.


def test_hardware_table_tpus_are_jaxs_numbers():
  """Every TPU figure that comes from JAX's table equals `pltpu.get_tpu_info_for_chip` times the device's cores."""
  from jax.experimental.pallas import tpu as pltpu

  assert hardware.TPU_GENERATIONS == ("v4", "v5e", "v5p", "v6e", "v7x")
  fields = {"bfloat16": "bf16_ops_per_second", "int8": "int8_ops_per_second", "float8": "fp8_ops_per_second"}
  for gen in hardware.TPU_GENERATIONS:
    chip = hardware.tpu(gen)
    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, chip.jax_chip), chip.cores_per_device)
    cores = chip.cores_per_device
    assert chip.memory_bandwidth == info.mem_bw_bytes_per_second * cores, gen
    assert chip.memory_bytes == pytest.approx(info.hbm_capacity_bytes * cores, rel=1e-9), gen
    assert (chip.vmem_bytes, chip.mxu_size) == (info.vmem_capacity_bytes, info.mxu_column_size), gen
    jax_flops = {k: getattr(info, f) * cores for k, f in fields.items() if getattr(info, f)}
    assert chip.matmul_flops == jax_flops, gen
  assert hardware.chip("v5e") is hardware.chip("TPU_v5e") is hardware.tpu("v5e")
  with pytest.raises(ValueError, match=r"unknown TPU generation='v9'"):
    hardware.tpu("v9")


def test_hardware_table_serves_planners_advisor_and_benchmarks():
  from flax_ringattn._src.backends.pallas_gpu import planner as gpu_planner
  from flax_ringattn._src.backends.pallas_tpu import planners as tpu_planners

  assert tpu_planners.VMEM_BYTES == {g: hardware.tpu(g).vmem_bytes for g in hardware.TPU_GENERATIONS}
  assert gpu_planner.SMEM_PER_BLOCK["sm_90"] == hardware.chip("h100").smem_per_block == 227 * 1024
  assert list(gpu_planner.SMEM_PER_BLOCK) == ["sm_70", "sm_75", "sm_80", "sm_86", "sm_89", "sm_90", "sm_100"]
  assert hardware.gpu_for_device_kind("NVIDIA L40S").name == "l40s"  # not the L4
  assert hardware.gpu_for_device_kind("NVIDIA H200").peak_flops("bfloat16") == 989e12
  assert hardware.gpu_for_device_kind("Some GPU") is None
  v5e = hardware.tpu("v5e")
  assert (v5e.ici_bidir, v5e.ici_link, v5e.link_bandwidth) == (400e9, 50e9, 200e9)  # 1,600 Gbps each way
  assert hardware.tpu("v7x").ici_bidir == 1200e9 and hardware.tpu("v4").ici_bidir is None


def test_cost_model_by_hand():
  # B=1, T=S=8, N=2, H=4: forward 2 matmuls x 2 flops x 64 pairs x 2 heads x 4 = 2048; backward 2.5x.
  dims = dict(B=1, T=8, S=8, N=2, H=4)
  assert cost.attention_flops(**dims, direction="fwd") == 2048
  assert cost.attention_flops(**dims, direction="bwd") == 5120
  assert cost.attention_flops(**dims) == 7168 == 2 * cost.attention_flops(**dims, is_causal=True)
  # Masks: the visible band's area.  A causal window of w on T = S = L: L w - w^2 / 2.
  assert cost.visible_fraction(1000, is_causal=True) == 0.5
  assert cost.visible_pairs(1000, is_causal=True, local_window_size=(100, 0)) == 1000 * 100 - 100**2 / 2
  assert cost.visible_pairs(1000, local_window_size=100) == 2 * (1000 * 100 - 100**2 / 2)
  assert cost.visible_fraction(512, 1024) == 1.0
  # The ring: K/V per hop forward, plus the f32 accumulators backward; over a ring of n: (n - 1) / n of K/V.
  kv = dict(B=1, S=128, K=2, H=64, itemsize=2)
  assert cost.ring_hop_bytes(**kv) == 2 * 128 * 2 * 64 * 2
  assert cost.ring_hop_bytes(**kv, direction="bwd") == 2 * 128 * 2 * 64 * (2 + 4)
  assert cost.ring_sent_bytes(8, **kv, direction="fwd") == 7 * cost.ring_hop_bytes(**kv)
  # Break-even shard: compute at the peak == the send over the link.
  L = cost.ring_min_shard(peak=1e12, link=1e9, B=1, N=8, K=2, H=64, itemsize=2)
  hop_s = cost.attention_flops(T=round(L), N=8, H=64, direction="fwd") / 1e12
  assert hop_s == pytest.approx(cost.ring_hop_bytes(B=1, S=round(L), K=2, H=64, itemsize=2) / 1e9, rel=1e-2)
  assert cost.itemsize(jnp.bfloat16) == 2 and cost.itemsize("float32") == 4


def test_cost_model_mla_by_hand():
  """MLA (H = 6 for q/k, Hv = 2 for v): per pair and head the forward runs s = q k^T over 6 and o += p v over 2
  (2 x (6 + 2) = 16 flops); the backward s and dq and dk over 6, dp and dv over 2 (2 x (18 + 4) = 44)."""
  dims = dict(B=1, T=8, S=8, N=2, H=6, Hv=2)
  pairs_heads = 64 * 2
  assert cost.attention_flops(**dims, direction="fwd") == 16 * pairs_heads
  assert cost.attention_flops(**dims, direction="bwd") == 44 * pairs_heads
  assert cost.attention_flops(**dims) == 60 * pairs_heads
  assert cost.attention_flops(**dict(dims, Hv=6)) == cost.attention_flops(B=1, T=8, S=8, N=2, H=6)
  assert cost.head_width("dq", 6, 2) == 6 + 2 + 6 and cost.head_width("dkv", 6, 2) == 6 + 2 + 2 + 6
  with pytest.raises(ValueError, match="pass matmuls as a kind"):
    cost.pair_flops(1, N=1, H=6, Hv=2, matmuls=2)
  # Bytes: K at 6 and V at 2 per token and kv head; q / dq at 6, o / dO at 2.
  kv = dict(B=1, S=128, K=2, H=6, Hv=2, itemsize=2)
  assert cost.ring_hop_bytes(**kv) == 128 * 2 * (6 + 2) * 2
  assert cost.ring_hop_bytes(**kv, direction="bwd") == 128 * 2 * (6 + 2) * (2 + 4)
  q, o, k, v, lse = 8 * 2 * 6 * 4, 8 * 2 * 2 * 4, 8 * 1 * 6 * 4, 8 * 1 * 2 * 4, 8 * 2 * 4
  got = cost.attention_bytes(B=1, T=8, N=2, K=1, H=6, Hv=2, itemsize=4, direction="bwd")
  assert got == (q + k + v + 2 * o + lse) + (q + k + v)
  assert cost.attention_bytes(B=1, T=8, N=2, K=1, H=6, Hv=2, itemsize=4) == q + k + v + o + lse


def test_problem_sets_are_valid_and_run_against_the_reference():
  for name, problems in bench.PROBLEM_SETS.items():
    assert problems, name
    for p in problems:
      assert p.N % p.K == 0 and p.flops() > 0 and p.bytes() > 0, (name, p)
  assert bench.PROBLEM_SETS["gpu_attention"][0].flops() == pytest.approx(
    3.5 * 4 * 1 * 32 * 4096 * 4096 * 128 / 2
  )  # causal fwd+bwd, counted once
  for p in bench.PROBLEM_SETS["tiny"]:
    q, k, v, do = p.inputs(0)
    assert q.shape == (p.B, p.T, p.N, p.H) and k.shape == (p.B, p.kv_len, p.K, p.H)
    got = bench.fwd_bwd(lambda q, k, v, p=p: fr.ring_attention(q, k, v, **p.mask_kwargs()))(q, k, v, do)
    want = bench.fwd_bwd(lambda q, k, v, p=p: fr.reference_attention(q, k, v, **p.mask_kwargs()))(q, k, v, do)
    assert bench.compare(p.describe(), got, want, tol=1e-4, metric="rel_max").ok


@pytest.fixture(scope="module")
def serving():
  return load("serving_engine")


def test_serving_engine_quick_run_checks_and_reports(serving):
  """--quick: the engine's tokens equal the dense-cache decode's (checked before timing), and both tables print."""
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    assert serving.main(["--quick", "--repeats", "1"]) == 0
  text = out.getvalue()
  assert "ok: ServingEngine: tokens vs dense cache (flax decode=True): max |a - b| = 0.00e+00" in text, text
  assert re.search(r"^\| ServingEngine \+ NGramDraft +\| [\d.]+ +\| [\d,]+ +\|$", text, re.M), text
  assert re.search(r"^\| ServingEngine +\| [\d.]+ +\| [\d.]+ +\|$", text, re.M), text  # the bytes table


def test_serving_engine_wrong_tokens_exit_1_before_timing(serving, monkeypatch):
  real = serving.DenseDecode.__call__
  monkeypatch.setattr(serving.DenseDecode, "__call__", lambda self: [[t + 1 for t in row] for row in real(self)])
  monkeypatch.setattr(serving, "time_interleaved", never)
  with contextlib.redirect_stdout(io.StringIO()), pytest.raises(SystemExit) as exit_info:
    serving.main(["--quick"])
  assert exit_info.value.code == serving.EXIT_WRONG_RESULT == 1


# --------------------------------------------------------------------------------------------
# real_models.py: the real-size decoders trained three ways and served; --smoke is a tiny model on CPU.


@pytest.mark.slow
@pytest.mark.interpret
@pytest.mark.races_not_read(SMOKE_RUN)
def test_real_models_smoke_trains_three_ways_and_serves(tmp_path):
  """--smoke: the tiny Qwen-shaped decoder trains with its attention converted by the library, swapped for
  splash by hand and for jax.nn.dot_product_attention, to the same loss; the converted model serves from a
  paged cache.  (Off a TPU the times mean nothing.)"""
  real_models = load("real_models")
  out = io.StringIO()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    assert real_models.main(["--smoke", "--profile-decode", "1", "--json", *NO_CACHE]) == 0
  sections = json.loads(out.getvalue())["sections"]
  train, serve = (s for s in sections if "table" in s)
  assert [r["attention"] for r in train["rows"]] == ["library", "splash", "xla"]
  assert all(r["notes"] == "" and r["step ms"] > 0 and r["first step s"] > 0 for r in train["rows"]), train["rows"]
  losses = [r["last loss"] for r in train["rows"]]
  assert max(losses) - min(losses) < 0.05, losses  # the same model and data, one AdamW step each way
  (row,) = serve["rows"]
  assert row["notes"] == "" and row["decode tokens/s"] > 0 and row["decode step ms"] > 0 and row["TTFT ms"] > 0, row
  assert 0 < row["host ms/step"] < row["decode step ms"] and row["prefill tokens/s"] > 0, row
  # Decode is timed over the engine's pure decode steps in which the whole batch decoded.
  assert row["decode batch"] == row["batch"] == 2, row
  assert 0 < row["% overlapped"] <= 100, row  # overlap=True: the engine dispatched decode steps ahead
  # --profile-decode traced a decode step; a CPU trace has no device process, and the report says so.
  assert any("no device trace (1 decode steps traced on cpu)" in str(s.get("note", "")) for s in sections), sections


def test_device_time_sums_a_traces_device_ops_by_name(tmp_path):
  """benchmarking.device_time: the device process's programs and ops, summed by name; host events and other
  threads left out; the newest trace read."""
  meta = [
    {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
    {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:TPU:0"}},
    {"ph": "M", "name": "thread_name", "pid": 2, "tid": 7, "args": {"name": "XLA Modules"}},
    {"ph": "M", "name": "thread_name", "pid": 2, "tid": 8, "args": {"name": "XLA Ops"}},
    {"ph": "M", "name": "thread_name", "pid": 2, "tid": 9, "args": {"name": "Steps"}},
  ]
  x = lambda pid, tid, name, dur: {"ph": "X", "pid": pid, "tid": tid, "name": name, "dur": dur, "ts": 0}  # noqa: E731
  events = meta + [x(2, 7, "jit_step", 100.0), x(2, 7, "jit_step", 50.0), x(2, 8, "paged_fwd", 30.0)]
  events += [x(2, 8, "paged_fwd", 10.0), x(2, 8, "fusion.1", 5.0), x(2, 9, "step 1", 999.0), x(1, 3, "host op", 7.0)]
  old = tmp_path / "plugins" / "profile" / "a" / "perfetto_trace.json.gz"
  old.parent.mkdir(parents=True)
  with gzip.open(old, "wt") as f:
    json.dump({"traceEvents": meta}, f)
  new = tmp_path / "plugins" / "profile" / "b" / "perfetto_trace.json.gz"
  new.parent.mkdir(parents=True)
  with gzip.open(new, "wt") as f:
    json.dump({"traceEvents": events}, f)
  os.utime(old, (1, 1))
  found = bench.device_time(tmp_path)
  assert found.programs == {"jit_step": 150.0} and found.program_us == 150.0
  assert found.ops == {"paged_fwd": 40.0, "fusion.1": 5.0}
  assert found.top(1) == [("paged_fwd", 40.0, 2)]
  with pytest.raises(FileNotFoundError, match="perfetto_trace.json.gz"):
    bench.device_time(tmp_path / "nothing")


def test_real_models_remat_with_the_attention_policy_trains():
  """--remat --remat-policy attention: blocks rematerialised with fr.save_attention_residuals (on the XLA way here:
  the interpret-mode kernels' callbacks do not go under remat) train to the loss of the way without remat."""
  real_models = load("real_models")
  losses = []
  for extra in ([], ["--remat", "--remat-policy", "attention"]):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
      assert real_models.main(["--smoke", "--tables", "train", "--ways", "xla", *extra, "--json", *NO_CACHE]) == 0
    (table,) = (s for s in json.loads(out.getvalue())["sections"] if "table" in s)
    (row,) = table["rows"]
    assert row["notes"] == "", row
    losses.append(row["last loss"])
  assert abs(losses[0] - losses[1]) < 1e-3, losses


def test_real_models_chunked_loss_equals_the_whole_one():
  """--loss-chunk: the cross-entropy over chunks of positions (their logits recomputed in the backward) equals the
  loss over all positions' logits at once, value and gradients, for a chunk that does not divide the positions."""
  real_models = load("real_models")
  decoders = sys.modules["_decoders"]
  c = decoders.tiny(real_models.MODELS["qwen"], dtype="float32")
  model = decoders.Decoder(c, rngs=nnx.Rngs(0))
  tokens, positions = real_models.train_inputs(c, 2, 24)

  def value_and_grad(chunk):
    fn = lambda m: real_models.loss(m, tokens, positions, False, "none", chunk)  # noqa: E731
    return nnx.value_and_grad(fn)(model)

  (whole, g_whole), (chunked, g_chunked) = value_and_grad(0), value_and_grad(5)
  np.testing.assert_allclose(chunked, whole, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), g_chunked, g_whole)


def test_real_models_longest_trainable_sequence_names_the_first_failure():
  """--tables longest: each way trains one step at doubling lengths; the row gives the longest that trained and
  the first that did not, with its error (splash refuses kv tiles under 128 tokens)."""
  real_models = load("real_models")
  out = io.StringIO()
  argv = ["--smoke", "--tables", "longest", "--ways", "splash,xla", "--longest-from", "64", "--longest-cap", "128"]
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    assert real_models.main([*argv, "--json", *NO_CACHE]) == 0
  (table,) = (s for s in json.loads(out.getvalue())["sections"] if "table" in s)
  splash, xla = table["rows"]
  assert splash["longest T"] is None and splash["first failure"].startswith("T=64: ValueError"), splash
  assert xla["longest T"] == 128 and xla["first failure"] == "none up to 128", xla


def test_tpu_compile_without_libtpu_says_how_to_get_it(capsys):
  """benchmarks/tpu_compile.py compiles for a TPU topology with libtpu installed (not in `make test`); without it
  the script exits 2 and names the package to install, and its options parse."""
  import importlib.util

  tpu_compile = load("tpu_compile")
  args = tpu_compile.parse_args(["--tables", "memory,longest", "--seq-lens", "256,512", "--remat-policy", "mask"])
  assert args.tables == ["memory", "longest"] and args.seq_lens == [256, 512] and args.remat_policy == "mask"
  if importlib.util.find_spec("libtpu") is not None:
    pytest.skip("libtpu is installed: the script would compile for a TPU here")
  assert tpu_compile.main(["--seq-lens", "256", "--layers", "1"]) == 2
  assert "pip install 'libtpu==0.0.42.*'" in capsys.readouterr().err

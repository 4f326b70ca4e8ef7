"""benchmarks/context_parallel_serving.py and tpu_roofline.py's context-parallel decode table: the script's JSON
report (its check passed, its sections and targets are there), a sharded op 1% off exits 1 before anything is
timed, and the roofline's model by hand."""

from __future__ import annotations

import contextlib
import io
import json

import pytest
from bench_scripts import load, never

from flax_ringattn import benchmarking as bench
from flax_ringattn.benchmarking import hardware


@pytest.fixture(scope="module")
def cp():
  return load("context_parallel_serving")


@pytest.fixture(scope="module")
def roofline():
  return load("tpu_roofline")


def test_quick_json_report(cp):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = cp.main(["--quick", "--json"])
  doc = json.loads(out.getvalue())
  assert code == doc["exit_code"] == bench.EXIT_OK
  assert [c["name"].split(":")[0] for c in doc["checks"]] == [
    "decode",
    "prefill",
    "ring prefill",
    "ring prefill pass-Q",
  ]
  assert all(c["ok"] for c in doc["checks"]), doc["checks"]
  tables = {s["table"].split(" (")[0].split(":")[0]: s for s in doc["sections"] if "table" in s}
  assert {"Cache bytes per device", "Decode step", "Prefill"} <= set(tables), set(tables)
  rows = tables["Cache bytes per device"]["rows"]
  assert len(rows) == 8 and all(abs(r["share of one device"] - 1 / 8) < 0.01 for r in rows), rows
  spread = ["one device", "8 devices (mesh=, seq_axis=)"]
  ring = [f"8 devices, ring prefill, pass-{x} (q sharded)" for x in ("KV", "Q")]
  for name, calls in (("Decode step", spread), ("Prefill", [*spread, *ring])):
    assert [r["call"] for r in tables[name]["rows"]] == calls
    assert all(r["median ms"] > 0 for r in tables[name]["rows"])
  targets = {t["target"].split(" over")[0]: t for t in doc["targets"]}
  assert set(targets) == {"per-device cache bytes", "compiles"}, targets
  assert all(t["met"] is True for t in targets.values()), targets
  assert targets["compiles"]["value"].startswith("1 ")
  notes = " ".join(s["note"] for s in doc["sections"] if "note" in s)
  assert "ring prefill holds 32 of the prompt's 256 padded rows" in notes and "load average" in notes


def _wrong_run(cp, monkeypatch) -> dict:
  """The quick run, nothing to be timed: it must exit 1 after the checks; returns its JSON report."""
  monkeypatch.setattr(cp, "time_interleaved", never)
  out = io.StringIO()
  with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
    cp.main(["--quick", "--json"])
  assert exit_info.value.code == cp.EXIT_WRONG_RESULT == 1
  doc = json.loads(out.getvalue())
  assert doc["exit_code"] == 1 and not any("table" in s for s in doc["sections"])  # nothing measured
  return {c["name"].split(":")[0]: c["ok"] for c in doc["checks"]}


def test_one_percent_off_exits_1_before_timing(cp, monkeypatch):
  """The sharded op 1% off (decode and prefill use it) and the ring prefill's pass-KV 1% off, in one run (each
  check runs on its own; pass-Q, right, must still pass)."""
  real_sharded, real_ring = cp.make_sharded, cp.make_ring_prefill

  def sharded_off(mesh):
    f = real_sharded(mesh)
    return lambda *a: f(*a) * 1.01

  def ring_off(s, b):
    ring = real_ring(s, b)
    call = ring.call  # pass-KV off, pass-Q right
    return cp.dataclasses.replace(ring, call=lambda: (call()[0] * 1.01,))

  monkeypatch.setattr(cp, "make_sharded", sharded_off)
  monkeypatch.setattr(cp, "make_ring_prefill", ring_off)
  assert _wrong_run(cp, monkeypatch) == {
    "decode": False,
    "prefill": False,
    "ring prefill": False,
    "ring prefill pass-Q": True,
  }


def test_roofline_cp_decode_by_hand(roofline):
  c = roofline.CP_DECODE
  models = {n: roofline.cp_decode_model("v5e", n, **c) for n in (8, 16, 32, 64)}
  for n in (8, 16, 32):  # each device's K/V halves when n doubles, and so does its HBM time
    assert models[2 * n].kv_bytes == models[n].kv_bytes / 2
    assert models[2 * n].t_kv == pytest.approx(models[n].t_kv / 2)
  chip = hardware.tpu("v5e")
  m = models[8]
  kv = 2**20 * 8 * (128 + 128) * 2 / 8  # S K (H + Hv) bf16 / n
  assert m.kv_bytes == kv == 2**29  # 0.5 GiB a device
  assert m.t_kv == pytest.approx(kv / chip.memory_bandwidth)
  merge = 64 * 64 * 129 * 4 + 64 * 64 * 4  # psum [T_q, N, H + 1] f32 + pmax [T_q, N] f32
  assert m.merge_bytes == merge
  assert m.t_merge_bw == pytest.approx(2 * 7 / 8 * merge / chip.ici_link)
  assert m.t_step == pytest.approx(kv / chip.memory_bandwidth + 2 * 7 / 8 * merge / chip.ici_link)
  assert m.merge_share == pytest.approx(m.t_merge_bw / m.t_step)
  assert m.t_merge_lat == pytest.approx(m.t_merge_bw + 4 * 7 * chip.latency)


def test_roofline_prints_the_cp_decode_table(roofline):
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    code = roofline.main(["--quick", "--generations", "v5e,v6e", "--masks", "causal-lb", "--json"])
  doc = json.loads(out.getvalue())
  assert code == doc["exit_code"] == bench.EXIT_OK
  (table,) = [s for s in doc["sections"] if s.get("table", "").startswith("Context-parallel decode (MODEL)")]
  rows = table["rows"]
  assert [(r["gen"], r["n"]) for r in rows] == [(g, n) for g in ("v5e", "v6e") for n in (8, 16, 32, 64)]
  (row,) = [r for r in rows if r["gen"] == "v5e" and r["n"] == 8]
  assert row["KV GiB/dev"] == 0.5
  assert row["HBM ms"] == pytest.approx(2**29 / hardware.tpu("v5e").memory_bandwidth * 1e3)
  assert all(r["merge %"] is not None and 0 < r["merge %"] < 100 for r in rows)


def test_roofline_ring_prefill_hop_by_hand(roofline):
  c = roofline.CP_PREFILL
  chip = hardware.tpu("v5e")
  T, N, K, H = 2**15, 64, 8, 128
  assert c == dict(T=T, N=N, K=K, H=H, dtype="bfloat16")
  m = roofline.cp_prefill_model("v5e", 8, 2**19, **c)
  pairs = T * 2**19 + T * (T + 1) / 2  # the chunk sees the cache and the causal half of itself
  assert m.flops == pytest.approx(4 * N * H * pairs / 64)
  assert m.t_compute == pytest.approx(m.flops / chip.peak_flops())
  assert m.q_bytes == T / 8 * N * (H * 2 + (H + 1) * 4)  # q in bf16, accumulator in f32
  assert m.kv_bytes == (2**19 + T) / 8 * K * 2 * H * 2
  assert m.t_q == pytest.approx(m.q_bytes / chip.ici_link)
  # pass-Q's hop does not depend on the cached context; pass-KV's grows with it.
  fresh, long = (roofline.cp_prefill_model("v5e", 8, C, **c) for C in (0, 2**20 - T))
  assert fresh.q_bytes == long.q_bytes and fresh.kv_bytes < m.kv_bytes < long.kv_bytes
  assert fresh.t_kv < fresh.t_q and long.t_q < long.t_kv < long.t_compute

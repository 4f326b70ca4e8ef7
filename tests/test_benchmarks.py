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

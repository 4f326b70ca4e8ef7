"""The CPU interpret-mode harness: enough CPU threads, a remote-DMA ring, and a race check that can fail."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import make_mesh
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from flax_ringattn._src.testing import interpret as harness

pytestmark = pytest.mark.interpret

AXIS = "x"


def _sharded_iota(mesh, rows):
  n = mesh.shape[AXIS]
  x = jnp.arange(n * rows * 128, dtype=jnp.float32).reshape(n * rows, 128)
  return jax.device_put(x, NamedSharding(mesh, P(AXIS)))


def _ring_shift(mesh, rows, params):
  """Each device sends its (rows, 128) block to its right neighbour with a remote DMA (a ppermute)."""
  n = mesh.shape[AXIS]

  def kernel(x_ref, o_ref, send_sem, recv_sem):
    me = lax.axis_index(AXIS)
    left, right = lax.rem(me + n - 1, n), lax.rem(me + 1, n)
    # Both neighbours must be inside the kernel before any DMA targets them.
    barrier = pltpu.get_barrier_semaphore()
    for peer in (left, right):
      pl.semaphore_signal(barrier, device_id=(peer,), device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(barrier, 2)
    copy = pltpu.make_async_remote_copy(
      x_ref, o_ref, send_sem, recv_sem, device_id=(right,), device_id_type=pl.DeviceIdType.MESH
    )
    copy.start()
    copy.wait()

  call = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((rows, 128), jnp.float32),
    in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
    out_specs=pl.BlockSpec(memory_space=pl.ANY),
    scratch_shapes=[pltpu.SemaphoreType.DMA] * 2,
    compiler_params=pltpu.CompilerParams(collective_id=0),
    interpret=params,
  )
  return jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))


def _all_to_first(mesh, rows, params):
  """Every device DMAs its block into device 0's output, unordered: a write-write race on device 0."""
  n = mesh.shape[AXIS]

  def kernel(x_ref, o_ref, send_sem, recv_sem):
    copy = pltpu.make_async_remote_copy(
      x_ref, o_ref, send_sem, recv_sem, device_id=(0,), device_id_type=pl.DeviceIdType.MESH
    )
    copy.start()
    copy.wait_send()

    @pl.when(lax.axis_index(AXIS) == 0)
    def _():
      for _ in range(n):
        copy.wait_recv()

  call = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((rows, 128), jnp.float32),
    in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
    out_specs=pl.BlockSpec(memory_space=pl.ANY),
    scratch_shapes=[pltpu.SemaphoreType.DMA] * 2,
    interpret=params,
  )
  return jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))


@pytest.mark.skipif(
  not sys.platform.startswith("linux") or not harness._compilers() or os.environ.get(harness.SHIM_ENV) == "0",
  reason="the CPU shim needs Linux and a C compiler (and is not turned off)",
)
@pytest.mark.races_not_read("checks the CPU shim only")
def test_process_sees_enough_cpus():
  assert harness.visible_cpus() >= harness.DEFAULT_MIN_CPUS, (
    f"XLA's CPU thread pool is sized from {harness.visible_cpus()} CPUs; multi-device interpret-mode kernels may "
    "deadlock (tests/conftest.py should have re-executed pytest with the CPU affinity shim)"
  )
  assert 1 <= harness.real_cpus() <= harness.visible_cpus()


@pytest.mark.parametrize(
  "n,rows,dma_mode",
  [
    (2, 128, "on_wait"),
    (8, 128, "on_wait"),
    (8, 128, "eager"),
    (8, 512, "on_wait"),  # 256 KiB blocks: hangs on a 2-core machine without the shim
  ],
)
def test_remote_dma_ring_matches_ppermute(n, rows, dma_mode):
  mesh = make_mesh((n,), (AXIS,))
  x = _sharded_iota(mesh, rows)
  shift = _ring_shift(mesh, rows, harness.interpret_params(dma_execution_mode=dma_mode))
  with harness.no_races():
    got = shift(x).block_until_ready()
  perm = [(i, (i + 1) % n) for i in range(n)]
  want = jax.jit(jax.shard_map(lambda b: lax.ppermute(b, AXIS, perm), mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(
    x
  )
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("n", [2, 8])
@pytest.mark.races_not_read("checks that no_races() fails")
def test_no_races_fails_on_a_race(n):
  mesh = make_mesh((n,), (AXIS,))
  racy = _all_to_first(mesh, 128, harness.interpret_params(dma_execution_mode="eager"))
  with pytest.raises(AssertionError, match="detected a data race"), harness.no_races():
    racy(_sharded_iota(mesh, 128))  # no block_until_ready: no_races waits for the kernel


@pytest.mark.races_not_read("checks that no_races() fails")
def test_no_races_fails_without_a_kernel():
  with pytest.raises(AssertionError, match="no Pallas interpret-mode kernel ran"), harness.no_races():
    jnp.ones(4).block_until_ready()


@pytest.mark.races_not_read("no kernel")
def test_interpret_params_default_detects_races():
  assert harness.interpret_params().detect_races
  assert harness.interpret_params(dma_execution_mode="eager").dma_execution_mode == "eager"
  assert not harness.interpret_params(detect_races=False).detect_races


_HANG_CASE_ENV = "FLAX_RINGATTN_RUN_HANG_CASE"


@pytest.mark.skipif(os.environ.get(_HANG_CASE_ENV) != "1", reason="run by test_timeout_names_the_likely_causes")
@pytest.mark.races_not_read("hangs on purpose")
def test_hang_case():
  """Deadlocks on purpose: device 0 waits for a DMA that nobody starts."""
  mesh = make_mesh((2,), (AXIS,))

  def kernel(x_ref, o_ref, send_sem, recv_sem):
    copy = pltpu.make_async_remote_copy(
      x_ref, o_ref, send_sem, recv_sem, device_id=(0,), device_id_type=pl.DeviceIdType.MESH
    )
    copy.wait_recv()

  call = pl.pallas_call(
    kernel,
    out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    in_specs=[pl.BlockSpec(memory_space=pl.ANY)],
    out_specs=pl.BlockSpec(memory_space=pl.ANY),
    scratch_shapes=[pltpu.SemaphoreType.DMA] * 2,
    interpret=harness.interpret_params(),
  )
  f = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS), check_vma=False))
  f(_sharded_iota(mesh, 8)).block_until_ready()


@pytest.mark.races_not_read("runs the hanging case in a child pytest")
def test_timeout_names_the_likely_causes():
  """A hanging interpret-mode test ends (in a child pytest, 5 s timeout) with the message naming the likely causes."""
  env = {**os.environ, _HANG_CASE_ENV: "1", "FLAX_RINGATTN_INTERPRET_TIMEOUT": "5"}
  env.pop("PYTEST_XDIST_WORKER", None)
  cmd = [sys.executable, "-m", "pytest", f"{__file__}::test_hang_case", "-q", "-n", "0", "-p", "no:cacheprovider"]
  proc = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0, proc.stdout + proc.stderr
  for text in (
    "test_hang_case ran past 5s",
    "thread pool is too small",
    "semaphore / DMA protocol bug",
    "in test_hang_case",
  ):
    assert text in proc.stderr, f"{text!r} missing from the child's stderr:\n{proc.stderr[-3000:]}"


_NO_CHECK_CASE_ENV = "FLAX_RINGATTN_RUN_NO_CHECK_CASE"


@pytest.mark.skipif(os.environ.get(_NO_CHECK_CASE_ENV) != "1", reason="run by test_interpret_tests_must_read_races")
def test_no_check_case():
  """Marked `interpret` (module pytestmark), runs a race-checked kernel, never reads the detector."""
  mesh = make_mesh((2,), (AXIS,))
  _ring_shift(mesh, 8, harness.interpret_params())(_sharded_iota(mesh, 8)).block_until_ready()


@pytest.mark.races_not_read("runs the unchecked case in a child pytest")
def test_interpret_tests_must_read_races():
  """tests/conftest.py fails an `interpret` test that passed without a clean no_races() block."""
  env = {**os.environ, _NO_CHECK_CASE_ENV: "1"}
  env.pop("PYTEST_XDIST_WORKER", None)
  cmd = [sys.executable, "-m", "pytest", f"{__file__}::test_no_check_case", "-q", "-n", "0", "-p", "no:cacheprovider"]
  proc = subprocess.run(cmd, env=env, cwd=Path(__file__).parents[1], capture_output=True, text=True, timeout=300)
  assert proc.returncode != 0, proc.stdout + proc.stderr
  assert "passed without a clean `no_races()` check" in proc.stdout, proc.stdout[-3000:]

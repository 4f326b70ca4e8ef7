"""Across processes: 2 JAX processes x 4 CPU devices, gloo collectives, started by `flax_ringattn.launch`.

The worker (tests/multiprocess_worker.py) computes the single-process reference
itself and checks the shards its process holds.  Every subprocess runs under a
timeout: a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

from flax_ringattn import launch

WORKER = pathlib.Path(__file__).with_name("multiprocess_worker.py")
TIMEOUT_S = 600  # per run, generous for a loaded 2-core machine; a passing run takes far less


def _spawn(tmp_path, *args):
  outs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]  # noqa: SIM115 -- closed in _logs
  port = launch.free_port()
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), *args],
      env=launch.child_env(i, 2, port, 4),
      stdout=outs[i],
      stderr=subprocess.STDOUT,
    )
    for i in range(2)
  ]
  return procs, outs


def _logs(tmp_path, outs):
  for f in outs:
    f.close()
  return [(tmp_path / f"process{i}.log").read_text() for i in range(2)]


def _run(tmp_path, *args):
  procs, outs = _spawn(tmp_path, *args)
  codes = launch.wait_all(procs, timeout=TIMEOUT_S, grace=10)
  logs = _logs(tmp_path, outs)
  detail = "\n".join(
    f"--- process {i} (exit {c}) ---\n{log[-4000:]}" for i, (c, log) in enumerate(zip(codes, logs, strict=True))
  )
  assert codes == [0, 0], detail
  return logs


@pytest.mark.slow
def test_every_strategy_matches_the_reference_on_each_process(tmp_path):
  logs = _run(tmp_path, "strategies")
  for log in logs:
    for line in (
      "OK ring",
      "OK all_gather",
      "OK ulysses mesh {'sp': 8}",
      "OK ulysses mesh {'dp': 2",
      "OK ulysses_ring",
    ):
      assert line in log, log[-3000:]


@pytest.mark.slow
def test_five_training_steps_match_the_single_process_run(tmp_path):
  for log in _run(tmp_path, "train"):
    assert "OK train: 5 steps" in log, log[-3000:]


@pytest.mark.slow
def test_paged_cache_spread_over_both_processes_matches_the_single_process_run(tmp_path):
  for log in _run(tmp_path, "paged_cp"):
    assert "OK paged cp: 2 ragged steps match" in log and "the ring prefill matches too" in log, log[-3000:]


HEARTBEAT_S = 5
# The survivor must fail within the heartbeat timeout plus a margin for detection, error propagation and
# process teardown on a loaded machine; JAX's default heartbeat (100 s) would be the bound without the setting.
DEATH_BOUND_S = HEARTBEAT_S + 55


@pytest.mark.slow
def test_a_dead_process_makes_the_other_fail_not_hang(tmp_path):
  procs, outs = _spawn(tmp_path, "die", str(HEARTBEAT_S))
  try:
    start = time.monotonic()
    while not all("READY" in (tmp_path / f"process{i}.log").read_text() for i in range(2)):
      assert all(p.poll() is None for p in procs), _logs(tmp_path, outs)
      assert time.monotonic() - start < TIMEOUT_S, "workers never got ready"
      time.sleep(0.2)
    os.kill(procs[1].pid, signal.SIGKILL)
    killed = time.monotonic()
    try:
      code = procs[0].wait(timeout=DEATH_BOUND_S)
    except subprocess.TimeoutExpired:
      pytest.fail(f"process 0 still running {DEATH_BOUND_S} s after its peer died: {_logs(tmp_path, outs)[0][-3000:]}")
    took = time.monotonic() - killed
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  log = _logs(tmp_path, outs)[0]
  assert code != 0, log[-3000:]
  print(f"process 0 exited with {code} {took:.1f} s after process 1 was killed")
  # JAX's coordination service names the dead task: "Terminating process because the JAX distributed service
  # detected fatal errors. This most likely indicates that another task died ... The following tasks are unhealthy
  # (stopped sending heartbeats): 1".
  assert "another task died" in log and "stopped sending heartbeats" in log, log[-3000:]

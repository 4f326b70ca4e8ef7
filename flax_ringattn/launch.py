"""Run a script as N local JAX processes: `python -m flax_ringattn.launch --num-processes N -- script.py ...`.

Each process gets `--devices-per-process` CPU devices (XLA's host platform),
JAX's multi-controller runtime on a free loopback port (`JAX_COORDINATOR_ADDRESS`,
which `jax.distributed.initialize` reads itself) and its id in
`FLAX_RINGATTN_PROCESS_ID` / `FLAX_RINGATTN_NUM_PROCESSES`.  The script calls
`initialize_from_env()` first: it switches the CPU collectives to gloo (XLA's
cross-process CPU collectives) and calls `jax.distributed.initialize`.  After
that `jax.devices()` lists the devices of every process, and a mesh over them
spans the processes (devices are ordered by process, so the first mesh axis is
the one that crosses processes).

On a real cluster nothing here is needed: TPU slices and SLURM / Open MPI GPU
clusters are detected by `jax.distributed.initialize()` itself (see the docs,
"Running on accelerators and many hosts").

If any process fails, the launcher waits `--grace` seconds for the others to
fail on their own (JAX's heartbeat, `heartbeat_timeout_seconds`, detects a
dead peer), then kills what is left, and exits with the first non-zero status.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

ENV_PROCESS_ID = "FLAX_RINGATTN_PROCESS_ID"
ENV_NUM_PROCESSES = "FLAX_RINGATTN_NUM_PROCESSES"
ENV_COORDINATOR = "JAX_COORDINATOR_ADDRESS"


def free_port() -> int:
  """A TCP port on 127.0.0.1 that was free a moment ago (bind to port 0, read it, close)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def child_env(process_id: int, num_processes: int, port: int, devices_per_process: int, base=None) -> dict:
  """The environment of process `process_id`: its id, the coordinator, and `devices_per_process` CPU devices."""
  env = dict(os.environ if base is None else base)
  flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
  env["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices_per_process}"])
  env.setdefault("JAX_PLATFORMS", "cpu")
  env[ENV_COORDINATOR] = f"127.0.0.1:{port}"
  env[ENV_PROCESS_ID] = str(process_id)
  env[ENV_NUM_PROCESSES] = str(num_processes)
  return env


def spawn(argv, num_processes: int, *, devices_per_process: int = 4, port: int | None = None, **popen_kw):
  """Starts `argv` (e.g. [sys.executable, "script.py", ...]) as `num_processes` processes; returns the Popens."""
  if num_processes < 1:
    raise ValueError(f"{num_processes=} must be >= 1")
  if devices_per_process < 1:
    raise ValueError(f"{devices_per_process=} must be >= 1")
  port = free_port() if port is None else port
  return [
    subprocess.Popen(list(argv), env=child_env(i, num_processes, port, devices_per_process), **popen_kw)
    for i in range(num_processes)
  ]


def wait_all(procs, *, timeout: float | None = None, grace: float = 30.0) -> list[int]:
  """Waits for every process; returns their exit codes.

  When one fails (or `timeout` seconds pass), the others get `grace` seconds to
  end on their own and are then killed (exit code -9): a launcher never hangs.
  """
  start = time.monotonic()
  deadline = None if timeout is None else start + timeout
  while True:
    codes = [p.poll() for p in procs]
    if all(c is not None for c in codes):
      return codes
    failed = any(c not in (None, 0) for c in codes)
    if failed or (deadline is not None and time.monotonic() > deadline):
      end = time.monotonic() + grace
      for p in procs:
        try:
          p.wait(timeout=max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
          p.kill()
          p.wait()
      return [p.returncode for p in procs]
    time.sleep(0.1)


def initialize_from_env(*, heartbeat_timeout_seconds: int | None = None, initialization_timeout: int = 120) -> bool:
  """`jax.distributed.initialize` for a process started by this launcher; False (and nothing done) otherwise.

  Call it before anything else touches JAX devices.  On CPU it selects gloo,
  XLA's cross-process CPU collectives.  `heartbeat_timeout_seconds` bounds how
  long the survivors of a dead process wait before failing (JAX's default: 100).
  """
  if ENV_PROCESS_ID not in os.environ:
    return False
  import jax

  if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kw = {} if heartbeat_timeout_seconds is None else {"heartbeat_timeout_seconds": int(heartbeat_timeout_seconds)}
  jax.distributed.initialize(
    coordinator_address=os.environ[ENV_COORDINATOR],
    num_processes=int(os.environ[ENV_NUM_PROCESSES]),
    process_id=int(os.environ[ENV_PROCESS_ID]),
    initialization_timeout=initialization_timeout,
    **kw,
  )
  return True


def main(argv=None) -> int:
  p = argparse.ArgumentParser(prog="python -m flax_ringattn.launch", description=__doc__.split("\n\n")[0])
  p.add_argument("--num-processes", type=int, required=True)
  p.add_argument("--devices-per-process", type=int, default=4, help="CPU devices per process (default: 4)")
  p.add_argument("--timeout", type=float, default=None, help="kill everything after this many seconds")
  p.add_argument("--grace", type=float, default=30.0, help="seconds the others get after one fails (default: 30)")
  p.add_argument("command", nargs=argparse.REMAINDER, help="-- script.py [args]: run with this Python")
  args = p.parse_args(argv)
  command = args.command[1:] if args.command[:1] == ["--"] else args.command
  if not command:
    p.error("give the script to run after --, e.g. -- examples/train_long_context.py --steps 5")
  procs = spawn([sys.executable, *command], args.num_processes, devices_per_process=args.devices_per_process)
  codes = wait_all(procs, timeout=args.timeout, grace=args.grace)
  bad = [c for c in codes if c != 0]
  if bad:
    print(f"flax_ringattn.launch: exit codes {codes}", file=sys.stderr)
  return bad[0] if bad else 0


if __name__ == "__main__":
  sys.exit(main())

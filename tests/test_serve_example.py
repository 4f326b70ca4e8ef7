"""examples/serve_paged.py serves a checkpoint of train_long_context.py (tiny sizes, subprocesses)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  env.setdefault("JAX_PLATFORMS", "cpu")
  proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
  assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
  return proc.stdout


@pytest.mark.slow
def test_serve_paged_continuous_batching(tmp_path):
  _run(
    "examples/train_long_context.py", "--steps", "1", "--seq-len", "512", "--d-model", "32", "--out-dir", str(tmp_path)
  )
  out = _run(
    "examples/serve_paged.py",
    "--run-dir",
    str(tmp_path),
    "--prompt-lens",
    "384,512",
    "--requests",
    "4",
    "--queries",
    "3",
    "--max-seqs",
    "2",
    "--max-batched-tokens",
    "128",
  )
  assert len(re.findall(r"^request \d+: prompt", out, re.M)) == 4, out
  summary = re.search(
    r"accuracy (\d+)/(\d+) .*?(\d+) steps \((\d+) mixed prefill\+decode\).*utilisation mean ([\d.]+)%", out
  )
  assert summary, out
  assert int(summary.group(2)) == 12  # 4 requests x 3 answers
  assert int(summary.group(4)) > 0  # requests joined while others decoded
  assert float(summary.group(5)) > 50.0

"""The examples run end to end at a tiny size (as subprocesses, like `make demo`)."""

from __future__ import annotations

import math
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TRAIN = EXAMPLES / "train_long_context.py"
TINY = ["--steps", "2", "--seq-len", "256", "--d-model", "32"]


# The examples that turn JAX's persistent compilation cache on by default: runs here compile anew (a shared cache
# would make one test's time depend on another's), unless a test names a cache directory itself.
CACHED = {"train_long_context.py", "serve_paged.py", "serve_handwritten.py"}


def _run(script: pathlib.Path, *args: str) -> str:
  """Runs an example like a user would (8 CPU devices come from conftest's XLA_FLAGS); returns stdout."""
  if script.name in CACHED and "--compilation-cache" not in args:
    args = (*args, "--no-compilation-cache")
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
  env.setdefault("JAX_PLATFORMS", "cpu")
  proc = subprocess.run(
    [sys.executable, str(script), *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
  )
  assert proc.returncode == 0, f"exit code {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
  return proc.stdout


def _check_run(stdout: str, out_dir: pathlib.Path) -> None:
  first = float(re.search(r"^first loss: (\S+)", stdout, re.M).group(1))
  last = float(re.search(r"^last loss: (\S+)", stdout, re.M).group(1))
  assert math.isfinite(first) and math.isfinite(last), stdout
  ckpt = out_dir / "checkpoint"
  assert ckpt.is_dir() and any(ckpt.iterdir()), f"no checkpoint in {ckpt}"
  assert (out_dir / "config.json").is_file()
  png = out_dir / "loss.png"
  assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  assert f"checkpoint: {ckpt}" in stdout and f"loss curve: {png}" in stdout


@pytest.mark.slow
def test_train_long_context_layer_then_load_and_serve(tmp_path):
  """The default swap style with a one-step curriculum stage; its checkpoint then feeds
  `_model.load_model` (plain nnx attention, one device) and `serve_paged.py`.  One test, so
  that xdist workers do not each train the model."""
  stdout = _run(TRAIN, "--out-dir", str(tmp_path), *TINY, "--curriculum", "128:1", "--pack")
  _check_run(stdout, tmp_path)
  assert "attention=layer" in stdout and "mesh {'sp': 8}" in stdout
  assert "1 steps of 2x128 -> 2 steps of 1x256" in stdout
  # --pack: skewed documents per row, reordered by balanced_layout (the zigzag figure is the same pack's).
  packed = re.findall(r"packed 1x256: balanced layout imbalance ([\d.]+) \(zigzag ([\d.]+)\)", stdout)
  assert packed and float(packed[0][0]) <= 1.05 < float(packed[0][1]), stdout

  sys.path.insert(0, str(EXAMPLES))
  try:
    import _model
  finally:
    sys.path.remove(str(EXAMPLES))
  params = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))
  model = _model.load_model(tmp_path)
  fresh = _model.load_model(tmp_path, restore=False)
  assert not all(np.array_equal(a, b) for a, b in zip(params(model), params(fresh), strict=True)), "not restored"
  assert all(a.devices() == {jax.devices()[0]} for a in params(model))
  tokens = np.zeros((1, 16), np.int32)
  logits = model(tokens, np.arange(16)[None], _model.previous_tokens(tokens))
  assert logits.shape == (1, 16, model.config.vocab_size)
  assert np.isfinite(np.asarray(logits)).all()

  # serve_paged.py converts the loaded model (convert(to="paged")) and serves every question through
  # fr.ServingEngine: three contexts of two questions each on two slots, chunked prefill within 256 tokens.  With
  # --context-parallel 8 it serves them on one device first (the reference), then with every layer's cache spread
  # over 8 devices and the contexts (>= 256 tokens) prefilled sequence-parallel by the ring, and exits non-zero
  # unless the answers are equal.  One run checks both halves.
  args = ["--requests", "3", "--queries", "2", "--prompt-lens", "512", "--max-seqs", "2", "--max-batched-tokens", "256"]
  out = _run(EXAMPLES / "serve_paged.py", "--run-dir", str(tmp_path), *args, "--context-parallel", "8")
  served, ring = out.split("context parallel: the KV cache spread over 8 devices:")
  assert "convert(to='paged'): 2 converted (2 nnx.MultiHeadAttention replaced" in served, served
  summary = re.search(
    r"^accuracy \d+/6 .*?; (\d+) prompt tokens \((\d+) computed, (\d+) shared\) .*, ([\d.]+) s \(([\d.]+) s in the "
    r"calls that compiled\) .*utilisation mean ([\d.]+)%; (\d+) evictions$",
    served,
    re.M,
  )
  assert summary, served
  prompt, computed, shared, seconds, compiling, util, evictions = (float(x) for x in summary.groups())
  assert shared > 0 and computed + shared == prompt, served  # a context's questions share its pages
  assert 0 < compiling <= seconds, served  # its first steps compiled, inside the serving time
  assert util > 50.0 and evictions == 0, served
  # The engine's answers are the loaded model's own greedy next tokens (full forward, no cache, no engine).
  sys.path.insert(0, str(EXAMPLES))
  try:
    import serve_paged
  finally:
    sys.path.remove(str(EXAMPLES))
  requests = serve_paged.make_requests(serve_paged.parse_args([*args]), model.config.vocab_size)
  want = []
  for tokens, at in requests:
    for a in at:
      prompt_tokens = tokens[None, : a + 1]
      logits = model(prompt_tokens, np.arange(a + 1)[None], _model.previous_tokens(prompt_tokens))
      want.append(int(np.argmax(logits[0, -1])))
  lines = re.findall(r"^request \d+: .*-> answers (.*)$", served, re.M)
  got = [int(g) for line in lines for g in re.sub(r"\(want \d+\)", "", line).split()]
  assert got == want, (got, want, served)
  # The spread run: ring prefills happened, and its answers are the single-device run's.
  assert "on 8 devices (each holds" in ring, ring
  assert re.search(r"in \d+ steps \(([1-9]\d*) ring prefills", ring), ring
  assert "context parallel over 8 devices: the 6 answers equal the single-device run's" in ring, ring
  answers = lambda text: re.findall(r"^request \d+: .*$", text, re.M)  # noqa: E731
  assert len(answers(served)) == 3 and answers(ring) == answers(served), (served, ring)


@pytest.mark.slow
def test_train_long_context_attention_fn_with_head_axis(tmp_path):
  args = ["--attention", "attention_fn", "--mesh-shape", "4,2", "--curriculum", "none"]
  stdout = _run(TRAIN, "--out-dir", str(tmp_path), *TINY, *args)
  _check_run(stdout, tmp_path)
  assert "attention=attention_fn" in stdout and "mesh {'sp': 4, 'tp': 2}" in stdout


@pytest.mark.slow
def test_swap_into_existing_model():
  stdout = _run(EXAMPLES / "swap_into_existing_model.py", "--seq-len", "256", "--steps", "2")
  assert "2 converted (2 nnx.MultiHeadAttention replaced, 0 hand-written), 0 left alone" in stdout, stdout
  err = float(re.search(r"max \|ring - original\| = (\S+)", stdout).group(1))
  assert err < 1e-4, stdout
  assert "P(None, 'sp'" in stdout, stdout  # the activations really are sequence-sharded
  losses = [float(x) for x in re.search(r"train losses \(dropout 0.1 in the ring\): (.*)", stdout).group(1).split()]
  assert len(losses) == 2 and all(math.isfinite(x) for x in losses), stdout


@pytest.mark.slow
def test_swap_handwritten_attention():
  stdout = _run(EXAMPLES / "swap_handwritten_attention.py", "--seq-len", "128", "--steps", "2")
  for style in ("GemmaStyleAttention", "LlamaStyleAttention"):
    assert f"converted attn.0 ({style})" in stdout and f"converted attn.1 ({style})" in stdout, stdout
  assert "soft cap 30, mask where: window (31, 31), the rest recovered from the model's mask" in stdout, stdout
  errs = [float(x) for x in re.findall(r"max \|ring - original\| over real tokens = (\S+)", stdout)]
  assert len(errs) == 2 and max(errs) < 1e-4, stdout
  assert "collective-permute in the compiled train step: True" in stdout, stdout
  losses = [float(x) for x in re.search(r"llama train losses \(ring attention\): (.*)", stdout).group(1).split()]
  assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[1] < losses[0], stdout


@pytest.mark.slow
def test_serve_handwritten_matches_full_recompute():
  """The hand-written decoder converted (to="paged") and served by the engine: the example exits non-zero unless
  both runs (plain, n-gram draft) equal greedy decoding by full recompute; here the report, prefix sharing, the
  draft's saving and the single set of compiles are checked too."""
  out = _run(EXAMPLES / "serve_handwritten.py", "--prompts", "5", "--max-new-tokens", "16")
  assert "hand-written attention: 2 converted, 0 left alone" in out, out
  assert "the model's mask (where) not used" in out, out
  line = r"^(plain|ngram draft): equal to full recompute; (\d+) steps, .*\((\d+) computed, (\d+) shared\)"
  runs = {m[0]: [int(x) for x in m[1:]] for m in re.findall(line, out, re.M)}
  assert set(runs) == {"plain", "ngram draft"}, out
  assert runs["plain"][2] > 0 and runs["ngram draft"][2] > 0, out  # the system prompt's pages are shared
  assert runs["ngram draft"][0] < runs["plain"][0], out  # the draft saves steps
  accepted = re.search(r"^ngram draft: .*draft (\d+)/(\d+) accepted$", out, re.M)
  assert accepted and 0 < int(accepted.group(1)) <= int(accepted.group(2)), out
  assert re.search(r"^compiles over both runs: [1-9]\d*, [\d.]+ s in the calls that compiled ", out, re.M), out


def test_second_start_reads_compiled_programs_back(tmp_path):
  """serve_handwritten.py started twice on one compilation cache: the second start compiles at most a tenth of
  what the first did (here nothing), and still serves the same tokens; a changed shape compiles anew."""
  cache = str(tmp_path / "cache")
  args = ("--prompts", "2", "--max-new-tokens", "4", "--compilation-cache", cache)
  counts = []
  for extra in ((), (), ("--max-batched-tokens", "24")):
    out = _run(EXAMPLES / "serve_handwritten.py", *args, *extra)
    line = r"^compilation cache .*: (\d+) hits, (\d+) compiled; ([\d.]+) s in XLA compiles and cache reads$"
    m = re.search(line, out, re.M)
    assert m and "plain: equal to full recompute" in out, out
    counts.append((int(m.group(1)), int(m.group(2)), float(m.group(3))))
  (_, first, first_s), (hits, second, second_s), (_, changed, _) = counts
  assert first > 10 and second <= first // 10 and hits >= first, counts
  assert second_s < first_s, counts  # reading programs back takes less time than compiling them
  assert changed > 0, counts  # a new step shape is not served from the old entries

#!/usr/bin/env bash
# One prepared GPU session for the pallas_gpu backend (about 10 minutes on one H200).
#
#   1. the pallas_gpu tests with the kernels compiled by Triton (no interpret): tests/test_pallas_gpu.py and the
#      shared feature matrix of tests/test_ring_attention.py at ring size 1 (one GPU), f32 and bf16;
#   2. benchmarks/gpu_attention.py: fwd+bwd at 4k..32k vs the xla backend and cuDNN, targets checked.
#
# Everything it prints is also kept under $OUT (default benchmarks/results/): gpu_tests.log, gpu_attention.log and
# the table gpu_attention.md, for the README.  Exit status: non-zero if a step failed.
#
#   bash benchmarks/gpu_check.sh                 # PYTHON=... to pick the interpreter, OUT=... the folder
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}
PY=${PYTHON:-python}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export JAX_DEFAULT_MATMUL_PRECISION=highest  # the f32 reference must not run in TF32 (the kernels' f32 dots are IEEE)
status=0

{ nvidia-smi || true; "$PY" -c "import jax; print(jax.__version__, jax.devices())"; } 2>&1 | tee "$OUT/gpu_env.log"

echo "== 1. compiled pallas_gpu tests"
timeout 300 "$PY" -m pytest -q -n 0 -p no:cacheprovider --durations=10 \
  tests/test_pallas_gpu.py tests/test_ring_attention.py \
  -k "pallas_gpu and not ring2 and not ring4 and not empty_rows_are and not deterministic" 2>&1 | tee "$OUT/gpu_tests.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1

echo "== 2. benchmark"
timeout 420 "$PY" benchmarks/gpu_attention.py --repeats 10 --out "$OUT/gpu_attention.md" 2>&1 | tee "$OUT/gpu_attention.log"
test "${PIPESTATUS[0]}" -eq 0 || status=1

echo "gpu_check: exit status $status (logs in $OUT)"
exit $status

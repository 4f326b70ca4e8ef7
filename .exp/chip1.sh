set -x
T0=$(date +%s)
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site flax optax einops toolz absl-py typing-extensions 2>&1 | tail -2
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --target /tmp/site .whl-tpu/*.whl 2>&1 | tail -2
export PYTHONPATH=$PYTHONPATH:$PWD:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import jax, flax, chex; print(jax.devices(), flax.__version__)"
echo setup $(( $(date +%s) - T0 )) s
timeout 330 python3 benchmarks/tpu_kernels.py --tables paged --paged-layouts models --paged-heads-pages --paged-steps decode,mixed,prefill --repeats 10 --json $OUT/paged.json 2>&1 | tee $OUT/paged.md | grep -v "^ok:\|^timing"
echo bench $(( $(date +%s) - T0 )) s
FLAX_RINGATTN_TPU_TIER=1 timeout $(( 560 - $(date +%s) + T0 )) python3 -m pytest -q -ra -m tpu tests/test_tpu_compiled.py -k "merged or plain_bf16 or kv8_hd256" -p no:cacheprovider -x 2>&1 | tail -30
echo done $(( $(date +%s) - T0 )) s

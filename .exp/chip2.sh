T0=$(date +%s)
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site flax optax einops toolz absl-py typing-extensions 2>&1 | grep -v notice | tail -2
PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --target /tmp/site .whl-tpu/*.whl 2>&1 | tail -2
export PYTHONPATH=$PYTHONPATH:$PWD:/tmp/site PYTHONUNBUFFERED=1
echo setup $(( $(date +%s) - T0 )) s
FLAX_RINGATTN_TPU_TIER=1 timeout 170 python3 -m pytest -q -ra -m tpu tests/test_tpu_compiled.py -k "merged" -p no:cacheprovider 2>&1 | grep -v "Warning\|warn" | tail -25
echo tier $(( $(date +%s) - T0 )) s
timeout $(( 575 - $(date +%s) + T0 )) python3 benchmarks/tpu_kernels.py --tables paged --paged-layouts models --paged-steps decode,mixed,prefill --repeats 10 --json $OUT/paged.json 2>&1 | tee $OUT/paged.md | grep "^timed\|Error\|error" 
echo done $(( $(date +%s) - T0 )) s

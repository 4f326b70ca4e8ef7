export PYTHONPATH=$PYTHONPATH:$PWD:/tmp/site PYTHONUNBUFFERED=1
ls /tmp/site >/dev/null 2>&1 || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site flax optax einops toolz absl-py typing-extensions 2>&1 | tail -1
ls /tmp/site/chex >/dev/null 2>&1 || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --target /tmp/site .whl-tpu/*.whl
FLAX_RINGATTN_TPU_TIER=1 timeout 150 python3 -m pytest -q -ra -m tpu tests/test_tpu_compiled.py -k "g7_f32 or bf16_merged_kv1" -p no:cacheprovider 2>&1 | grep -E "^E |FAILED|passed|failed" | cut -c1-300 | head -40

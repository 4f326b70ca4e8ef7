export PYTHONPATH=$PYTHONPATH:$PWD:/tmp/site PYTHONUNBUFFERED=1
ls /tmp/site/flax >/dev/null 2>&1 || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --only-binary=:all: --index-url file:///opt/pypi/simple --target /tmp/site flax optax einops toolz absl-py typing-extensions 2>&1 | tail -1
timeout 230 python3 benchmarks/tpu_kernels.py --tables paged --paged-layouts "8/1/128,16/4/128,14/2/64" --paged-heads-pages --paged-steps decode,mixed --repeats 5 --warmup 1 2>&1 | tee $OUT/paged4.md | grep "^timed\|rror"

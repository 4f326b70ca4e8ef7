# Entry points: `make demo`, `make test` and `make docs`.  Each bootstraps .venv.  (`make test-tpu`, on a TPU host,
# does not: see below.)
PYTHON ?= python3
# The interpreter of `make test-tpu`: one with jax, libtpu, pytest, numpy and the package's dependencies importable.
TPU_PY ?= $(PYTHON)
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
# Tests are compile-bound and single-threaded: one worker per core.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: demo test test-tpu test-tpu-block test-tpu-paged test-tpu-fused lint bench docs clean

$(VENV)/.stamp-base: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PIP) -e ".[examples]"
	touch $@

$(VENV)/.stamp-test: $(VENV)/.stamp-base
	$(PIP) -e ".[test,examples,dev,docs]"
	touch $@

demo: $(VENV)/.stamp-base
	$(PY) examples/train_long_context.py
	$(PY) examples/serve_paged.py

test: $(VENV)/.stamp-test
	$(PY) -m ruff check flax_ringattn tests examples benchmarks
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist worksteal --durations=25

# The compiled-on-TPU tier: the Pallas TPU kernels compiled on the chip against the float64 oracles, forward and
# gradients, in one process (one program at a time holds the chip).  No venv and nothing installed: the package
# comes from this checkout through PYTHONPATH.  Every test skips without a TPU (`make test` collects them too).
# `TPU_TESTS` passes pytest options (e.g. TPU_TESTS='-k merged'); the parts below split the tier for machines
# lent with a time limit per command: block and ring kernels, the paged kernel, its fused cache write.
TPU_TESTS ?=
test-tpu:
	FLAX_RINGATTN_TPU_TIER=1 PYTHONPATH="$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH}" \
	  $(TPU_PY) -m pytest -q -ra -m tpu tests/test_tpu_compiled.py -p no:cacheprovider $(TPU_TESTS)

test-tpu-block:
	$(MAKE) test-tpu TPU_TESTS='-k "block or ring"'

test-tpu-paged:
	$(MAKE) test-tpu TPU_TESTS='-k test_paged_kernel'

test-tpu-fused:
	$(MAKE) test-tpu TPU_TESTS='-k test_paged_fused_cache_write'

lint: $(VENV)/.stamp-test
	$(PY) -m ruff check flax_ringattn tests examples benchmarks
	$(PY) -m ruff format --check flax_ringattn tests examples benchmarks

# The documentation site, warnings as errors (the API pages are generated into docs/_autosummary).
docs: $(VENV)/.stamp-test
	$(PY) -m sphinx -W --keep-going -q -b html docs docs/_build/html

bench: $(VENV)/.stamp-test
	$(PY) benchmarks/ring_scaling.py

clean:
	rm -rf $(VENV) .pytest_cache docs/_build docs/_autosummary

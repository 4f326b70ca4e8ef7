# Entry points: `make demo`, `make test` and `make docs`.  Each bootstraps .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q -c constraints.txt
# Tests are compile-bound and single-threaded: one worker per core.
TEST_WORKERS ?= $(shell nproc 2>/dev/null || echo 2)

.PHONY: demo test lint bench docs clean

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

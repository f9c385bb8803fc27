# The two commands a user needs: `make run` and `make test`. Both install first.
VENV ?= .venv
PY := $(VENV)/bin/python
PYTEST := $(PY) -m pytest

.PHONY: install run test test-fast lint format bench-smoke clean

install:
	@scripts/install.sh

run: install
	$(VENV)/bin/llmgate serve $(ARGS)

test: install
	$(PYTEST) $(PYTEST_ARGS)

test-fast: install
	$(PYTEST) -m "not slow" $(PYTEST_ARGS)

lint: install
	$(PY) -m ruff format --check gateway worker shared tests loadtest
	$(PY) -m ruff check gateway worker shared tests loadtest
	$(PY) -m mypy

format: install
	$(PY) -m ruff format gateway worker shared tests loadtest
	$(PY) -m ruff check --fix gateway worker shared tests loadtest

bench-smoke: install
	$(PY) -m loadtest.bench_smoke $(ARGS)

clean:
	rm -rf $(VENV) .models .pytest_cache .mypy_cache .ruff_cache loadtest/results

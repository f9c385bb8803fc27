# The two commands a user needs: `make run` and `make test`. Both install first.
VENV ?= .venv
PY := $(VENV)/bin/python
# Python writes each module's bytecode the first time it imports it, once:
# a run imports ~6,000 of the ~24,000 modules installed, so the install
# writes only those of llmgate's own processes (scripts/warm_bytecode.py),
# and under make a machine that sets this still writes the rest as imported
# rather than compiling them anew in every process.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install run test test-fast lint format docs bench bench-overhead bench-scaling loadtest clean

install:
	@scripts/install.sh

run: install
	$(VENV)/bin/llmgate serve $(ARGS)

# The cache tests start a real Redis, the state store's tests a real PostgreSQL
# (tests/harness/postgres_server.py runs the server binaries, which are off
# the PATH), and the overhead harness's test runs wrk: Debian's redis-server,
# postgresql and wrk, installed when missing.
POSTGRES_SERVER := '/usr/lib/postgresql/*/bin/postgres'

test: install
	@scripts/debian-package.sh redis-server
	@scripts/debian-package.sh $(POSTGRES_SERVER) postgresql
	@scripts/debian-package.sh wrk
	@VENV=$(VENV) scripts/test.sh --durations=30 $(PYTEST_ARGS)

test-fast: install
	@scripts/debian-package.sh redis-server
	@scripts/debian-package.sh $(POSTGRES_SERVER) postgresql
	@scripts/debian-package.sh wrk
	@VENV=$(VENV) scripts/test.sh -m "not slow" $(PYTEST_ARGS)

# The layers (pyproject's [tool.importlinter]) are checked with import-linter.
lint: install
	$(PY) -m ruff format --check gateway worker shared serve tests loadtest deploy
	$(PY) -m ruff check gateway worker shared serve tests loadtest deploy
	$(PY) -m mypy
	$(VENV)/bin/lint-imports
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet --site-dir site

format: install
	$(PY) -m ruff format gateway worker shared serve tests loadtest deploy
	$(PY) -m ruff check --fix gateway worker shared serve tests loadtest deploy

# The documentation site (mkdocs.yml, docs/) into site/; --strict: a broken link,
# a missing anchor or a page left out of the nav fails.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --site-dir site

# llmgate against vLLM, vllm-router, the FastAPI batching baseline and vLLM in-process.
bench: install
	$(PY) -m loadtest.bench $(ARGS)

# The gateway's own cost over a zero-cost fake worker, beside vllm-router
# (installs Debian's wrk when it is missing).
bench-overhead: install
	@scripts/debian-package.sh wrk
	$(PY) -m loadtest.overhead $(ARGS)

# One gateway in front of 1, 2, 4, 8 FAKE workers: scaling and saturation (wrk too).
bench-scaling: install
	@scripts/debian-package.sh wrk
	$(PY) -m loadtest.scaling $(ARGS)

loadtest: install
	$(PY) -m loadtest.loadtest $(ARGS)

clean:
	rm -rf $(VENV) .models .pytest_cache .mypy_cache .ruff_cache loadtest/results site

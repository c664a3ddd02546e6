# The two commands a new machine needs: `make serve` and `make test` (each sets up first).
.PHONY: setup serve test test-unit lint bench fixtures

VENV := .venv
SETUP_STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=

$(SETUP_STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

setup: $(SETUP_STAMP)

serve: setup
	$(VENV)/bin/vllm-nvext serve $(ARGS)

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-unit: setup
	$(VENV)/bin/python -m pytest -m "not e2e" $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check vllm_nvext tests benchmarks examples
	$(VENV)/bin/mypy vllm_nvext

bench: setup
	$(VENV)/bin/python -m benchmarks.run_all

fixtures: setup
	$(VENV)/bin/python scripts/record_fixtures.py

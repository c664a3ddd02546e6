"""Repository scripts, run from the repository root as a package (`python -m scripts.record_fixtures`);
the tests import `scripts.vllm_harness` and `scripts.vllm_cpu_refs` from it (tests/support/refs.py).
None of them changes `sys.path`."""

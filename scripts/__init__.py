"""Repository scripts; `tests` and `benchmarks` import the vLLM 0.33 harness as `scripts.vllm033_harness`."""

"""Benchmarks for vllm-nvext: scripts that print ratios measured side by side in one run.

Run them all with `python -m benchmarks.run_all` (`make bench`); see benchmarks/README.md.
"""

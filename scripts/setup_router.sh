#!/usr/bin/env bash
# Create the vllm-router reference venv (outside the repository and outside .venv):
#   "${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}/vllm-router-<version>"
# It holds vLLM's Rust load balancer from PyPI (`vllm-router`, a Python launcher around a native
# extension; ~80 MB), which the scale-out e2e tests put in front of vllm-nvext servers
# (tests/e2e/scaleout.py). Idempotent: a complete venv is marked by a stamp written last, and reused.
# Prints the path of the `vllm-router` executable on its last line.
set -euo pipefail
ROUTER_VERSION=0.1.17
REFS="${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}"
VENV="$REFS/vllm-router-$ROUTER_VERSION"
STAMP="$VENV/.setup-stamp"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3.10 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi

if [ ! -f "$STAMP" ]; then
  start=$(date +%s)
  echo "setup-router: installing vllm-router==$ROUTER_VERSION into $VENV" >&2
  rm -rf "$VENV"
  mkdir -p "$REFS"
  "$PY" -m venv "$VENV"
  "$VENV/bin/python" -m pip --disable-pip-version-check install -q "vllm-router==$ROUTER_VERSION"
  "$VENV/bin/vllm-router" --help >/dev/null
  "$VENV/bin/python" -c "
from importlib.metadata import version
assert version('vllm-router') == '$ROUTER_VERSION', version('vllm-router')
print('setup-router: vllm-router', version('vllm-router'))" >&2
  echo "setup-router: done in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
  touch "$STAMP"
fi
echo "$VENV/bin/vllm-router"

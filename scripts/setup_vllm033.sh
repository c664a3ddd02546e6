#!/usr/bin/env bash
# Create the vLLM 0.33 reference venv (outside the repository and outside .venv):
#   "${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}/vllm-0.33.0"
# It holds the CUDA wheel of vLLM 0.33.0 (its serving layer runs on CPU machines; the engine
# core does not, see scripts/vllm033_harness.py) and this project, installed editable without
# dependencies. Idempotent: a complete venv is marked by a stamp written last; with the stamp
# present only the project install is refreshed when it points at another checkout.
# Prints the venv's python path on its last line.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VERSION=0.33.0
REFS="${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}"
VENV="$REFS/vllm-$VLLM_VERSION"
STAMP="$VENV/.setup-stamp"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

if [ ! -f "$STAMP" ]; then
  start=$(date +%s)
  echo "setup-vllm033: installing vllm==$VLLM_VERSION into $VENV (about 3 minutes, ~9.5 GB)" >&2
  rm -rf "$VENV"
  mkdir -p "$REFS"
  "$PY" -m venv "$VENV"
  "${PIP[@]}" install -q "vllm==$VLLM_VERSION" "setuptools>=68" wheel
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO"
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "
import vllm, vllm_nvext
assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__
print('setup-vllm033: vllm', vllm.__version__, '+ vllm-nvext', vllm_nvext.__version__)" >&2
  echo "setup-vllm033: done in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
  touch "$STAMP"
fi

# The project is an editable install: repoint it when this checkout is not the one installed.
installed="$("$VENV/bin/python" -c 'import os, vllm_nvext; print(os.path.dirname(os.path.dirname(vllm_nvext.__file__)))' 2>/dev/null || true)"
if [ "$installed" != "$REPO" ]; then
  echo "setup-vllm033: installing vllm-nvext from $REPO" >&2
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO"
fi
echo "$VENV/bin/python"

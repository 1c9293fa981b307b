#!/usr/bin/env bash
# The README's two quick-start commands:
#   bash scripts/quickstart.sh pipeline [snakemake args]   run the pipeline on the embedded default
#   bash scripts/quickstart.sh test [pytest args]          run the test suite (2 pytest-xdist workers; -n 0: one)
# Each first sets up .venv (Python 3.11, CPU torch without a GPU, the pinned packages, the embedded model).
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/setup_env.sh
. scripts/setup_env.sh

command="${1:-}"
shift || true
case "$command" in
  pipeline)
    setup_venv quickstart
    exec snakemake --cores "${CORES:-2}" "$@"
    ;;
  test)
    setup_venv quickstart
    bash scripts/setup_vllm.sh >/dev/null   # vLLM's CPU build for tests/test_vllm.py: set-up, not test time
    # two workers, a test module each at a time (tests/conftest.py: the groups, the fixtures made once per run)
    exec python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
    ;;
  *)
    echo "usage: $0 pipeline [snakemake args] | test [pytest args]" >&2
    exit 2
    ;;
esac

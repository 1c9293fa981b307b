#!/usr/bin/env bash
# Run by Snakemake (`--sdm conda`) inside the environment it just built from clemprm.yaml, in the working
# directory of the run: installs clemprm itself (editable, so it follows the checkout) without touching the
# pinned packages. Run snakemake from the repository root, or set CLEMPRM_REPO to the checkout.
set -euo pipefail
repo="${CLEMPRM_REPO:-$PWD}"
if ! grep -qs '^name = "clemprm"' "$repo/pyproject.toml"; then
  echo "clemprm.post-deploy.sh: $repo is not a clemprm checkout: run snakemake from the repository root" \
       "or set CLEMPRM_REPO=/path/to/clemprm" >&2
  exit 1
fi
python -m pip install --no-deps -e "$repo"

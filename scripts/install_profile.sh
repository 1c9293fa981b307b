#!/usr/bin/env bash
# Make `snakemake --profile slurm` work as typed, from the repository root or anywhere.
#
# Snakemake looks a profile name up in ./NAME, then in the user's config folder
# (~/.config/snakemake/NAME, or $XDG_CONFIG_HOME/snakemake/NAME), then in the site folder
# (/etc/xdg/snakemake/NAME); never in ./profiles/NAME. This script puts profiles/slurm there.
#
#   bash scripts/install_profile.sh                  link ~/.config/snakemake/slurm -> <repo>/profiles/slurm
#   bash scripts/install_profile.sh --copy           copy it instead (edit your copy for your cluster)
#   bash scripts/install_profile.sh --site           into the site folder (/etc/xdg/snakemake; needs root)
#   bash scripts/install_profile.sh --dest DIR       into DIR/slurm
#   bash scripts/install_profile.sh --name NAME      as profile NAME (`snakemake --profile NAME`)
#   bash scripts/install_profile.sh --force          replace an existing, different profile of that name
#                                                    (a folder that is not our link is moved to NAME.bak.<time>)
#   bash scripts/install_profile.sh --profile DIR    install another profile folder (default profiles/slurm)
#
# A link follows the repository (edits to profiles/slurm apply at once); it points at this checkout, so
# re-run the script from another checkout to switch. No install at all: `snakemake --profile profiles/slurm`
# or `snakemake --workflow-profile profiles/slurm` from the repository root.
set -euo pipefail
repo="$(cd "$(dirname "$0")/.." && pwd)"

mode=link name=slurm dest="" force=0 site=0 source="$repo/profiles/slurm"
while [ $# -gt 0 ]; do
  case "$1" in
    --copy) mode=copy ;;
    --site) site=1 ;;
    --force) force=1 ;;
    --dest) dest="${2:?--dest needs a folder}"; shift ;;
    --name) name="${2:?--name needs a name}"; shift ;;
    --profile) source="$(cd "${2:?--profile needs a folder}" && pwd)"; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "install_profile.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

[ -f "$source/config.yaml" ] || { echo "install_profile.sh: no config.yaml in $source" >&2; exit 1; }

if [ -z "$dest" ]; then
  # Ask snakemake where it looks (platformdirs); fall back to the XDG default where it is not installed.
  which=user_config_dir; [ "$site" = 1 ] && which=site_config_dir
  dest="$(python3 -c "from snakemake.common import get_appdirs; print(get_appdirs().$which)" 2>/dev/null \
          || python -c "from snakemake.common import get_appdirs; print(get_appdirs().$which)" 2>/dev/null || true)"
  if [ -z "$dest" ]; then
    if [ "$site" = 1 ]; then dest=/etc/xdg/snakemake; else dest="${XDG_CONFIG_HOME:-$HOME/.config}/snakemake"; fi
  fi
fi
target="$dest/$name"
mkdir -p "$dest"

if [ -L "$target" ] && [ "$(readlink -f "$target")" = "$(readlink -f "$source")" ] && [ "$mode" = link ]; then
  echo "profile '$name' already installed: $target -> $source"
  exit 0
fi
if [ -e "$target" ] || [ -L "$target" ]; then
  if [ "$force" != 1 ]; then
    echo "install_profile.sh: $target exists (a different profile named '$name'); use --force to replace it," \
         "or --name to install under another name" >&2
    exit 1
  fi
  if [ -L "$target" ]; then
    rm -f "$target"
  else
    backup="$target.bak.$(date +%Y%m%d%H%M%S)"
    mv "$target" "$backup"
    echo "moved the existing $target to $backup"
  fi
fi

if [ "$mode" = link ]; then
  ln -s "$source" "$target"
  echo "installed profile '$name': $target -> $source"
else
  cp -R "$source" "$target"
  echo "installed profile '$name': copied $source to $target (edit the EDIT lines there)"
fi
echo "run from the repository root: snakemake --profile $name"

"""``python -m clemprm.games [--seed 42] [--out DIR]``: regenerates the built-in games' instance files."""

import argparse
from pathlib import Path

from clemprm.games import BUILTIN_GAMES, generate_all_instances

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--seed", type=int, default=42, help="generation seed (default: 42, the committed files)")
parser.add_argument("--out", type=Path, default=None,
                    help="write to OUT/<game>/ instead of the games' in/ folders")
args = parser.parse_args()
generate_all_instances(args.seed, args.out)
print(f"wrote instances_{{train,validation,test}}.json for {', '.join(BUILTIN_GAMES)}"
      + (f" under {args.out}" if args.out else ""))

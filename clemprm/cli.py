"""The ``clemprm`` console command: one subcommand per job, each a function that returns the exit status."""

from __future__ import annotations

import argparse
import sys

from clemprm import records


def inspect_command(args: argparse.Namespace) -> int:
    from clemprm.evaluation.inspect import inspect_file

    try:
        print(inspect_file(args.path, examples=args.examples, width=args.width, bins=args.bins))
    except records.RecordFileError as error:
        print(f"clemprm inspect: {error}", file=sys.stderr)
        return 2
    return 0


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="clemprm", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    inspect = commands.add_parser("inspect", help="summarize a record file (any parquet the pipeline writes)")
    inspect.add_argument("path", metavar="PATH", help="a .parquet record file")
    inspect.add_argument("--examples", type=int, default=3, metavar="N", help="example rows to show (default 3)")
    inspect.add_argument("--width", type=positive_int, default=100, metavar="W", help="line width (default 100)")
    inspect.add_argument("--bins", type=positive_int, default=10, metavar="B", help="label histogram bins (default 10)")
    inspect.set_defaults(run=inspect_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)

"""The ``clemprm`` console command: one subcommand per job, each a function that returns the exit status."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from clemprm import records


def inspect_command(args: argparse.Namespace) -> int:
    from clemprm.evaluation.inspect import episode_transcript, inspect_file

    try:
        if args.transcript is not None:
            print(episode_transcript(args.path, args.transcript))
        else:
            print(inspect_file(args.path, examples=args.examples, width=args.width, bins=args.bins))
    except records.RecordFileError as error:
        print(f"clemprm inspect: {error}", file=sys.stderr)
        return 2
    return 0


def check_config_command(args: argparse.Namespace) -> int:
    """What ``snakemake --configfile FILE...`` would check at parse time, with errors that name the file: Snakemake
    reads its ``--configfile``s before the Snakefile runs, and says only ``Config file is not valid JSON or YAML``."""
    from clemprm.checks.parse_time import ConfigInputError
    from clemprm.config import ConfigError, merge_config_files
    from clemprm.workflow import check_config

    try:
        warnings = check_config(merge_config_files(args.files), args.files, inputs=not args.schema_only)
    except (ConfigError, ConfigInputError) as error:
        print(f"clemprm check-config: {error}", file=sys.stderr)
        return 2
    for warning in warnings:
        print(f"clemprm check-config: WARNING: {warning}", file=sys.stderr)
    print(f"clemprm check-config: {', '.join(args.files) or 'the default config'}: ok")
    return 0


def summary_command(args: argparse.Namespace) -> int:
    """The results table of a run's ``prm_eval.json`` (what the pipeline prints when it finishes), after a warning
    where the table is stale; a file that is not a prm_eval.json is refused, naming what it is not."""
    from clemprm.evaluation.console import SummaryError, read_summary, staleness, summary_table
    from clemprm.evaluation.stage_account import stage_lines

    try:
        summary = read_summary(args.path)
    except SummaryError as error:
        print(f"clemprm summary: {error}", file=sys.stderr)
        return 2
    for warning in staleness(args.path, summary, args.run_start):
        print(warning)
    print(summary_table(summary, args.path))
    print("\n".join(stage_lines(Path(args.path).parent)))
    return 0


def publish_command(args: argparse.Namespace) -> int:
    """Upload an adapter folder or merged checkpoint (with its model card) to the Hub; opt-in, never in the DAG."""
    from clemprm.model_card import PublishError, publish_folder

    try:
        url = publish_folder(args.folder, args.repo_id, private=args.private)
    except PublishError as error:
        print(f"clemprm publish: {error}", file=sys.stderr)
        return 2
    print(f"clemprm publish: {args.folder} -> {url}")
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
    inspect.add_argument("--transcript", type=int, metavar="N", help="print row N of an episodes file as a transcript "
                                                                     "(one line per message), not the summary")
    inspect.set_defaults(run=inspect_command)
    check = commands.add_parser("check-config", help="check config files as the Snakefile does at parse time, "
                                                     "naming the file or key that is wrong")
    check.add_argument("files", nargs="*", metavar="FILE", help="config files, merged in order over config.yaml "
                                                                "(as snakemake --configfile FILE...)")
    check.add_argument("--schema-only", action="store_true",
                       help="only the schema: not the models, games and folders the config names")
    check.set_defaults(run=check_config_command)
    summary = commands.add_parser("summary", help="print the results table of a run (its prm_eval.json): per mode "
                                                  "%% played, quality and clemscore with CIs, each search against its "
                                                  "controls, the PRM against its baselines and its quality gate")
    summary.add_argument("path", nargs="?", default="results/prm_eval.json", metavar="PATH",
                         help="a prm_eval.json (default results/prm_eval.json)")
    summary.add_argument("--run-start", type=float, metavar="SECONDS",
                         help="when the run printing the table started (seconds since the epoch; the Snakefile gives "
                              "it): an older summary is named as not made by this run")
    summary.set_defaults(run=summary_command)
    publish = commands.add_parser("publish", help="upload an adapter folder or merged checkpoint, with its model "
                                                  "card, to a Hugging Face Hub model repo (needs a token and network)")
    publish.add_argument("folder", metavar="FOLDER", help="e.g. results/sft/adapter or results/merged/sft")
    publish.add_argument("repo_id", metavar="REPO_ID", help="the Hub model repo, e.g. user/clemprm-sft (created when "
                                                            "missing)")
    publish.add_argument("--private", action="store_true", help="create the repo private")
    publish.set_defaults(run=publish_command)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()   # a reader that went away shows here, not as a traceback at the interpreter's exit
    except BrokenPipeError:
        # the reader stopped reading (`clemprm inspect ... | head`): stop quietly, with the status of a Unix tool
        # ended by SIGPIPE; stdout goes to /dev/null so that Python's own flush at exit does not fail again
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    return status

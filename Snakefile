# clemprm: base rollouts -> win filter -> SFT -> branch points -> soft labels -> PRM -> PRM-guided eval
# Run: snakemake -c2 (local, embedded default) | snakemake --profile slurm (cluster; see docs/slurm.md)
import os

from snakemake.logging import logger
from snakemake.utils import min_version

from clemprm.checks.parse_time import ConfigInputError, snakemake_processes_problems
from clemprm.config import (base_rollouts_params, eval_mode_params, policy_sections, rl_params, sections,
                            trained_adapters)
from clemprm.stages.merge import merge_params
from clemprm.workflow import check_config, label_shard_count, rule_params

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config.yaml")


# fails at parse time naming the config file or the dotted key: each config file (a key set twice), the schema, and
# in the main process only (not again in every job) the model spec, the model cache, the clembench checkout, its games,
# their packages and NLTK data, the instance list and the input files: the checks of `clemprm check-config`
for warning in check_config(config, workflow.configfiles, workflow.config_settings.config,
                            inputs=workflow.is_main_process):
    logger.warning(f"WARNING: {warning}")
# a `processes` resource (--set-resources RULE:processes=N, --default-resources, the profile) is a whole number >= 1
if workflow.is_main_process and (problems := snakemake_processes_problems(workflow.resource_settings)):
    raise ConfigInputError("the resources given cannot run a job:\n  - " + "\n  - ".join(problems))


report: "report/workflow.rst"


include: "rules/rollouts.smk"
include: "rules/sft.smk"
include: "rules/labels.smk"
include: "rules/prm.smk"
include: "rules/eval.smk"
include: "rules/merge.smk"
include: "rules/rl.smk"
include: "rules/score.smk"


rule all:
    input:
        "results/prm_eval.json",
        "results/report/eval_scores.png",
        "results/report/soft_labels.png",
        "results/report/prm_calibration.png",
        "results/report/training_curves.png",
        "results/report/transcripts",
        expand("results/merged/{name}", name=config["merge"]["adapters"]),
        SCORE_TARGETS,
    default_target: True


def results_table():
    """A run ends with its results table (clemprm summary): the answer, not only the files; named stale where this run
    did not make it (one aimed at part of the DAG, or one that failed) or it is older than its inputs."""
    if os.path.isfile("results/prm_eval.json"):
        from clemprm.cli import main as clemprm_main

        clemprm_main(["summary", "results/prm_eval.json", "--run-start", str(workflow.start_time.timestamp())])


onsuccess:
    results_table()


onerror:
    # then each failed job's own error from its log (a StageFailure, "context too long ..."), not only Snakemake's
    # CalledProcessError
    from clemprm.evaluation.console import failed_jobs

    results_table()
    for line in failed_jobs(log):
        logger.error(line)

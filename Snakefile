# clemprm: base rollouts -> win filter -> SFT -> branch points -> soft labels -> PRM -> PRM-guided eval
# Run: snakemake -c2 (local, embedded default) | snakemake --profile slurm (cluster; see docs/slurm.md)
import os

from snakemake.utils import min_version

from clemprm.checks.parse_time import check_config_inputs
from clemprm.config import base_rollouts_params, eval_mode_params, policy_sections, rl_params, sections, validate_config
from clemprm.stages.merge import merge_params

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config.yaml")


validate_config(config)  # fails at parse time with the dotted name of a bad key
if workflow.is_main_process:  # not again in every job
    check_config_inputs(config)  # the model spec, the clembench checkout, its games, their packages and NLTK data


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
        expand("results/merged/{name}", name=MERGED_ADAPTERS),
        SCORE_TARGETS,
    default_target: True

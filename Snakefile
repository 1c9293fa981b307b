# clemprm: base rollouts -> win filter -> (SFT -> branch points -> soft labels -> PRM -> PRM-guided eval)
# Run: snakemake -c2 (local, embedded default) | snakemake --profile slurm (cluster; see README)
import os

from snakemake.utils import min_version

from clemprm.config import sections, validate_config

min_version("9.0")


configfile: os.path.join(workflow.basedir, "config.yaml")


validate_config(config)  # fails at parse time with the dotted name of a bad key


include: "rules/rollouts.smk"
include: "rules/sft.smk"


rule all:
    input:
        "results/sft/sft_data.parquet",
        "results/sft/adapter",
        "results/sft/metrics.json",
    default_target: True

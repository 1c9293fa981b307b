from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.stages import answers  # noqa: E402

answers.gather_answers(snakemake.input.rollouts, snakemake.input.sft_episodes, snakemake.input.branch_points,
                       list(snakemake.input.shards), snakemake.output[0])

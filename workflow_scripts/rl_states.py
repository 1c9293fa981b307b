from clemprm.workflow import setup_job

setup_job(snakemake)

from clemprm.stages import rl_states as states  # noqa: E402  (after setup_job: offline mode is read at import)

settings = snakemake.params.settings
states.write_states(settings["games"], snakemake.output[0], settings["states"]["split"],
                    settings["states"]["max_per_episode"])

from clemprm.workflow import job_settings, setup_job

setup_job(snakemake)

from clemprm.stages import rl_states as states  # noqa: E402  (after setup_job: offline mode is read at import)

settings = job_settings(snakemake)
states.write_states(settings["games"], snakemake.output[0], settings["seed"], settings["states"]["split"],
                    settings["states"]["max_per_episode"])

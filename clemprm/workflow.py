"""Set-up shared by the rule scripts: logging into the rule's log file and the job's environment."""

from __future__ import annotations

import logging
import os
import sys

from clemprm.config import job_environment


def setup_job(snakemake) -> None:
    """Send all logging (and stray stderr) to the rule's log file; set HF_HOME and offline mode from config.

    Called first in every rule script, before torch/transformers are imported: the hub's offline switch is
    read at import time. The parse-time checks read the same settings (:func:`clemprm.config.hub_offline_reason`).
    """
    config = snakemake.config
    os.environ.update(job_environment(config))   # HF_HOME; offline for embedded/tiny models (clemprm.config)
    log_file = open(snakemake.log[0], "a", buffering=1)
    sys.stderr = log_file
    logging.basicConfig(level=logging.INFO, stream=log_file, force=True,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.captureWarnings(True)
    logging.getLogger(__name__).info("rule %s: inputs %s -> outputs %s", snakemake.rule,
                                     list(snakemake.input), list(snakemake.output))

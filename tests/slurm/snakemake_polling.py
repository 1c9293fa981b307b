"""The SLURM tests' `snakemake`: ``python tests/slurm/snakemake_polling.py ARGS`` is ``snakemake ARGS`` with the SLURM
executor's status checks at most POLL_S apart.

The executor (snakemake-executor-plugin-slurm 2.8, documented) waits 10 s longer after each status check that finds no
job finished, up to 180 s, and only a successful job resets the wait. On the test cluster, where a job takes 20-60 s,
that was up to half a job's time spent before Snakemake noticed it had ended, and after a failed job's retry Snakemake
waited 42 s more before it exited. What is submitted, run and reported is unchanged; users' runs keep the plugin's
back-off, which costs little against jobs of hours.
"""

from __future__ import annotations

from snakemake_interface_executor_plugins.executors.remote import RemoteExecutor

POLL_S = 3


def _capped(interval: property) -> property:
    return property(interval.fget, lambda executor, seconds: interval.fset(executor, min(seconds, POLL_S)))


RemoteExecutor.next_seconds_between_status_checks = _capped(RemoteExecutor.next_seconds_between_status_checks)

if __name__ == "__main__":
    from snakemake.cli import main

    main()

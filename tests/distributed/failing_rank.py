"""A rule script whose rank 1 fails while rank 0 waits for it in a gather (tests/test_distributed.py)."""
from clemprm.workflow import setup_job

setup_job(snakemake)  # noqa: F821  (Snakemake's preamble defines it)

from clemprm import distributed  # noqa: E402


def work(share):
    if distributed.rank() == 1:
        raise RuntimeError("rank 1 cannot play its share")
    return share


distributed.map_split(list(range(4)), work)
open(snakemake.output[0], "w").write("never")  # noqa: F821

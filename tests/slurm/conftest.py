"""Fixtures for the SLURM tests: a real single-node cluster (tests/slurm/cluster.py) for the whole session.

The cluster's Debian packages are installed when missing (as root, e.g. in CI). Where that is impossible the
tests fail, saying what to install: a missing cluster is never a silent skip. Only
CLEMPRM_SLURM_TESTS=skip skips them, by name, in the test report.
"""

from __future__ import annotations

import os

import pytest

from tests.slurm.cluster import Cluster, ensure_installed


def pytest_configure(config):
    config.addinivalue_line("markers", "slurm: runs jobs on the local SLURM test cluster (tests/slurm/cluster.py)")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if os.environ.get("CLEMPRM_SLURM_TESTS") == "skip":
        pytest.skip("CLEMPRM_SLURM_TESTS=skip: the SLURM cluster tests were switched off")
    ensure_installed(log=lambda message: print(message, flush=True))
    # A short path: the munge socket lives in it and a unix socket path is limited to 107 bytes.
    cluster = Cluster(tmp_path_factory.mktemp("slurm"), partition="clemprm", memory_mb=4000)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()

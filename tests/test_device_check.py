"""scripts/device_check.sh, the GPU check, as far as a machine without a GPU can check it: the script parses, its
dry run lists every step under a time limit, the checks fit in 8 minutes, and the summary goes where
docs/benchmarks.md says."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "device_check.sh"


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **(env or {})})


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True).returncode == 0


def test_dry_run_lists_every_step_within_the_time_budget():
    done = run("--dry-run")
    assert done.returncode == 0, done.stderr
    limits = dict(re.findall(r"^(\w+) +timeout +(\d+)s", done.stdout, flags=re.MULTILINE))
    assert list(limits) == ["setup", "probe", "pipeline", "trainers", "bench", "multigpu", "vllm"]
    assert sum(int(limit) for step, limit in limits.items() if step != "setup") <= 8 * 60
    assert "summary and logs would go to results/device_check/" in done.stdout
    assert not Path("results").exists()   # a dry run writes nothing


def test_summary_goes_to_out_and_setup_can_be_skipped():
    done = run("--dry-run", "--skip-setup", env={"OUT": "/tmp/device-out"})
    assert done.returncode == 0 and "would go to /tmp/device-out/device_check/" in done.stdout
    assert not re.search(r"^setup ", done.stdout, flags=re.MULTILINE)


def test_an_unknown_argument_is_refused():
    done = run("--fast")
    assert done.returncode == 2 and "unknown argument --fast" in done.stderr

"""The SLURM profile (profiles/slurm) as data, and the test profile derived from it for the local test cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "profiles" / "slurm"


def load_profile(path: Path = PROFILE) -> dict:
    """The profile's config.yaml (YAML anchors and merge keys resolved, as Snakemake reads it)."""
    return yaml.safe_load((path / "config.yaml").read_text())


def is_gpu_request(resources: dict) -> bool:
    return bool(resources.get("gpu")) or "gpu" in str(resources.get("gres") or "")


def gpu_rules(profile: dict) -> set[str]:
    return {rule for rule, res in (profile.get("set-resources") or {}).items() if is_gpu_request(res)}


def workflow_rules(snakefile: Path = REPO / "Snakefile", cwd: Path | None = None) -> set[str]:
    """Rule names of the workflow as it is now (`snakemake --list-rules`)."""
    result = subprocess.run([sys.executable, "-m", "snakemake", "--snakefile", str(snakefile), "--list-rules"],
                            capture_output=True, text=True, timeout=300, cwd=cwd)
    if result.returncode != 0:
        raise RuntimeError(f"snakemake --list-rules failed:\n{result.stdout}\n{result.stderr}")
    return {line.strip() for line in result.stdout.splitlines() if line.strip() and " " not in line.strip()}


class _NoAliases(yaml.SafeDumper):
    def ignore_aliases(self, data):
        return True


def derive_test_profile(dest: Path, partition: str, profile: dict | None = None) -> dict:
    """profiles/slurm adapted to the 2-core test cluster: same executor, rules, GPU requests and retries; the
    cluster-specific values (partition, account, sizes) and the status command replaced. Writes dest/config.yaml.
    """
    profile = load_profile() if profile is None else profile
    derived = dict(profile)

    def shrink(resources: dict, gpu: bool) -> dict:
        resources = {k: v for k, v in resources.items() if k not in ("slurm_account", "qos", "constraint")}
        resources["slurm_partition"] = partition
        mem = 1000 if gpu else 500
        # keep the growth of a retried job's memory (`attempt` is 1, then 2 on the retry)
        resources["mem_mb"] = f"{mem} * attempt" if "attempt" in str(resources.get("mem_mb", "")) else mem
        resources["cpus_per_task"] = 1
        resources["runtime"] = 15
        return resources

    derived["default-resources"] = shrink(dict(profile.get("default-resources") or {}), gpu=False)
    derived["set-resources"] = {rule: shrink(dict(res), is_gpu_request(res))
                                for rule, res in (profile.get("set-resources") or {}).items()}
    derived.update({
        # no slurmdbd on the test cluster: sacct fails, squeue works (MinJobAge 3600 s)
        "slurm-status-command": "squeue",
        "slurm-init-seconds-before-status-checks": 2,
        "seconds-between-status-checks": 2,
        "slurm-keep-successful-logs": True,   # the tests read every job's SLURM log
        "latency-wait": 5,                    # one machine: outputs are there at once
        "jobs": 2,
        "verbose": True,                      # the executor logs each sbatch call at debug level
    })
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.yaml").write_text(
        "# derived from profiles/slurm by tests/slurm/profiles.py for the local test cluster\n"
        + yaml.dump(derived, Dumper=_NoAliases, sort_keys=False))
    return derived

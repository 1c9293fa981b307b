"""profiles/slurm without a cluster: every rule is placed, and `--profile slurm` resolves as typed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.slurm.profiles import PROFILE, REPO, gpu_rules, load_profile, workflow_rules

MODEL_RULES = {"base_rollouts", "sft_adapter", "branch_points", "soft_labels", "prm_adapter", "eval_mode", "rl_adapter",
               "merge", "score_adapter"}  # rules that load a model


def test_every_rule_has_slurm_resources_and_model_rules_ask_for_a_gpu():
    profile = load_profile()
    assert profile["executor"] == "slurm"
    for key in ("jobs", "latency-wait", "rerun-incomplete", "retries"):
        assert key in profile, key
    for key in ("mem_mb", "runtime", "cpus_per_task"):
        assert key in profile["default-resources"], key
    rules = workflow_rules() - {"all"}
    missing = rules - set(profile["set-resources"])
    assert not missing, (f"rules without an entry under set-resources in profiles/slurm/config.yaml: {missing}. "
                         "Add one (a GPU model stage: `<<: *gpu_job`; a CPU step: mem_mb/runtime/cpus_per_task).")
    assert MODEL_RULES & rules <= gpu_rules(profile)
    assert MODEL_RULES <= rules
    # filtering, gathering and summaries are small CPU jobs
    assert not gpu_rules(profile) & {"win_filter", "gather_soft_labels", "prm_metrics", "eval_summary",
                                     "eval_report_figures"}


def _dry_run(*args, cwd, env):
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _resources(output: str, rule: str) -> str:
    match = re.search(rf"rule {rule}:.*?resources: ([^\n]*)", output, re.S)
    assert match, output[-3000:]
    return match.group(1)


def test_install_profile_makes_profile_slurm_work_as_typed_from_the_repo_root(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg"), "HF_HUB_OFFLINE": "1"}
    install = subprocess.run(["bash", str(REPO / "scripts/install_profile.sh")], env=env, capture_output=True,
                             text=True, timeout=120)
    assert install.returncode == 0, install.stderr
    link = tmp_path / "xdg" / "snakemake" / "slurm"
    assert link.is_symlink() and link.resolve() == PROFILE.resolve()
    again = subprocess.run(["bash", str(REPO / "scripts/install_profile.sh")], env=env, capture_output=True,
                           text=True, timeout=120)
    assert again.returncode == 0 and "already installed" in again.stdout

    # exactly as typed, from the repository root (--directory only keeps .snakemake/ out of the checkout)
    result = _dry_run("--profile", "slurm", "--directory", str(tmp_path / "work"), cwd=REPO, env=env)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "Using profile slurm for setting default command line arguments" in output
    rollouts = _resources(output, "base_rollouts")
    assert "gpu=1" in rollouts and "mem_mb=64000" in rollouts
    assert "gpu=" not in _resources(output, "win_filter")

    # without installing: a path, or the workflow profile (looked up in profiles/ beside the Snakefile)
    for args in (["--profile", "profiles/slurm"], ["--workflow-profile", "profiles/slurm"],
                 ["--workflow-profile", "slurm"]):
        result = _dry_run(*args, "--directory", str(tmp_path / "work"), cwd=REPO, env=env)
        output = result.stdout + result.stderr
        assert result.returncode == 0, (args, output[-3000:])
        assert "gpu=1" in _resources(output, "base_rollouts"), args


def test_install_profile_refuses_to_replace_a_different_profile(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    other = tmp_path / "xdg" / "snakemake" / "slurm"
    other.mkdir(parents=True)
    (other / "config.yaml").write_text("executor: slurm\n")
    result = subprocess.run(["bash", str(REPO / "scripts/install_profile.sh")], env=env, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0 and "--force" in result.stderr
    assert (other / "config.yaml").read_text() == "executor: slurm\n"
    result = subprocess.run(["bash", str(REPO / "scripts/install_profile.sh"), "--force"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert other.is_symlink() and list(other.parent.glob("slurm.bak.*"))


def test_install_profile_copy_and_name(tmp_path):
    env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "xdg")}
    result = subprocess.run(["bash", str(REPO / "scripts/install_profile.sh"), "--copy", "--name", "mycluster"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    copied = tmp_path / "xdg" / "snakemake" / "mycluster" / "config.yaml"
    assert not copied.parent.is_symlink()
    assert copied.read_text() == (PROFILE / "config.yaml").read_text()

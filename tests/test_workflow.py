"""The Snakemake workflow end to end on the tiny model, in a temporary directory.

The whole pipeline runs once per session (``completed_run`` in tests/conftest.py); each stage's checks are one small
test on that run, rerun triggers are dry runs (``-n``) of a changed config against it, and the one real rerun works
on a copy. A new stage adds a test function taking ``completed_run``. The run plays the built-in games and clembench
fixture games (tests/test_clembench.py checks those, and a game whose every episode fails, on the same run).
"""

from __future__ import annotations

import base64
import collections
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pyarrow.parquet as pq
import pytest
import yaml

from clemprm import records
from clemprm.evaluation import console, evaluate, report
from clemprm.evaluation.inspect import inspect_file
from clemprm.config import deep_merge, eval_mode_params, load_config, policy_sections, provenance
from clemprm.workflow import job_settings, label_shard_count, rule_params
from tests.conftest import TESTS_SHAPE, CompletedRun, copy_of_run, tiny_config

REPO = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake", "--snakefile", str(REPO / "Snakefile"), "--cores", "2"]
DEFAULT_EVAL_MODES = TESTS_SHAPE["eval"]["modes"]   # the eval modes the tests pin (tests/conftest.py)
EVAL_MODES = set(DEFAULT_EVAL_MODES)
RL_ALGORITHMS = tuple(TESTS_SHAPE["rl"]["algorithms"])
BUILTIN_GAMES = ("guessnumber", "wordref", "oddoneout")   # the default games.builtin
# tests/test_clembench.py's fixture games: a spec list's variant, a nested game, a random game, and one whose every
# episode fails at set-up (played on: on_failure continue); its checks of them run on the session's completed run
CLEMBENCH_GAMES = ["pair_variant", "family", "coin", "broken_setup"]
GAMES = (*BUILTIN_GAMES, *CLEMBENCH_GAMES)


def tiny_workflow_config(cache_dir: str) -> dict:
    return deep_merge(TESTS_SHAPE, {
        "cache_dir": cache_dir,
        "model": {"spec": "tiny:0", "threads": 1},
        # the random tiny model aborts most label continuations: labels without variance would stop the run
        "on_failure": "continue",
        # the clembench checkout and the playpen-data instance list that picks every game's splits (a hash split may
        # leave a small game without validation instances): files in the working directory (prepare_workdir)
        "games": {"max_instances": {"train": 2, "validation": 1, "test": 1}, "clembench_path": "clembench",
                  "clembench_games": CLEMBENCH_GAMES, "instance_list": "instances.csv"},
        "base_rollouts": {"episodes_per_instance": 2, "max_new_tokens": 8},
        "win_filter": {"require_success": True, "min_bench_score": 0.0},
        # a random tiny model rarely wins: a small playpen-data file guarantees SFT examples
        "sft": {"epochs": 2, "batch_size": 4, "grad_accum": 1, "max_examples": 8, "lr": 1e-3,
                "extra_data": "extra.jsonl"},
        "branch_points": {"max_new_tokens": 8, "siblings": 2},   # the PRM's held-out ranking needs siblings
        "labels": {"k": 2, "max_new_tokens": 8, "shards": 2, "checkpoint_every": 2},
        "prm": {"epochs": 1, "max_examples": 16, "batch_size": 8, "grad_accum": 1},
        "eval": {"max_new_tokens": 8, "n": 2, "num_beam_iterations": 4, "bootstrap_samples": 100,
                 # SCoRe's mode is not a default one (cost): the tiny run adds it, so score_adapter runs too
                 "modes": DEFAULT_EVAL_MODES + ["self_correct"]},
        "score": {"stage1_steps": 1, "stage2_steps": 1, "instances_per_step": 1, "group_size": 2, "max_new_tokens": 8},
    })


def write_extra_interactions(path: Path) -> None:
    """A playpen-data interactions export: 4 instances of one won dialogue (and one lost row, filtered out)."""
    rows = [{"messages": [{"role": "user", "content": f"Guess a number from 1 to 10. (game {i})"},
                          {"role": "assistant", "content": "GUESS: 5"}],
             "meta": {"game": "extra", "experiment": "e", "task_id": i, "player_name": "Player 1",
                      "game_role": "Guesser", "model": "m", "outcome": "success" if i < 4 else "lose"}}
            for i in range(5)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def write_instance_list(path: Path, max_instances: dict) -> None:
    """The tiny run's playpen-data instance list: the built-in games' instances that a run without a list plays (their
    own split files, capped by ``max_instances``), and the clembench games' game ids 0-3 as train instances, 4 as the
    validation one."""
    from clemprm.play.catalog import GameCatalog

    builtin = GameCatalog(load_config(overrides={"games": {"builtin": list(BUILTIN_GAMES),
                                                           "max_instances": max_instances}})["games"])
    rows = [(game, instance.experiment["name"], instance.key[2], split) for game in BUILTIN_GAMES
            for split in ("train", "validation", "test") for instance in builtin.instances(game, split)]
    rows += [(game, "variant" if game == "pair_variant" else "e", game_id, "train" if game_id < 4 else "validation")
             for game in CLEMBENCH_GAMES for game_id in range(5)]
    path.write_text("game,experiment,task_id,split\n" + "".join(",".join(map(str, row)) + "\n" for row in rows))


def prepare_workdir(path: Path, cache_dir: str) -> Path:
    """A working directory with the tiny config (tiny.yaml) and the files it names: the extra data file, the clembench
    checkout (tests/test_clembench.py's fixture games) and the instance list."""
    from tests.test_clembench import write_checkout

    config = tiny_workflow_config(cache_dir)
    (path / "tiny.yaml").write_text(yaml.safe_dump(config))
    write_extra_interactions(path / config["sft"]["extra_data"])
    write_checkout(path / config["games"]["clembench_path"])
    write_instance_list(path / config["games"]["instance_list"], config["games"]["max_instances"])
    return path


def planned_rules(dry_run_output: str) -> set[str]:
    """The jobs a dry run would run, by rule name (its `rule <name>:` / `localrule <name>:` blocks); an eval job by
    its mode (the one ``eval_mode`` rule's wildcard), as every mode used to be a rule of its own."""
    jobs = set()
    for rule, block in re.findall(r"^(?:local)?rule (\w+):\n((?:[ \t]+\S.*\n?)*)", dry_run_output, flags=re.MULTILINE):
        mode = re.search(r"^\s+wildcards: mode=(\w+)", block, flags=re.MULTILINE)
        jobs.add(mode.group(1) if rule == "eval_mode" and mode else rule)
    return jobs


def planned_outputs(dry_run_output: str) -> set[str]:
    """The files the jobs of a dry run would write (their `output:` lines)."""
    return {path.strip() for line in re.findall(r"^\s+output: (.*)$", dry_run_output, flags=re.MULTILINE)
            for path in line.split(",")}


def snakemake(workdir: Path, *args: str, check: bool = True,
              configfile: Path | None = None) -> subprocess.CompletedProcess:
    """snakemake in ``workdir`` with its tiny.yaml (or ``configfile``, e.g. a changed copy for a dry run)."""
    # targets and options before --configfile, which takes every following word as a config file
    configfile = configfile or workdir / "tiny.yaml"
    result = subprocess.run(SNAKEMAKE + [*args, "--directory", str(workdir), "--configfile", str(configfile)],
                            capture_output=True, text=True, timeout=900,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if check and result.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed:\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


@pytest.fixture
def workdir(tmp_path, test_cache_dir):
    return prepare_workdir(tmp_path, test_cache_dir)


def changed_config(run: CompletedRun, folder: Path, **sections) -> Path:
    """The completed run's config with ``sections`` merged into it (a nested dict changes only the keys it names), as
    a new file in ``folder``."""
    config = deep_merge(yaml.safe_load((run.workdir / "tiny.yaml").read_text()), sections)
    path = folder / "changed.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# ------------------------------------------------------------------------------ without a run


def test_dry_run_lists_the_rules(workdir):
    planned = planned_rules(snakemake(workdir, "-n").stdout)
    assert {"base_rollouts", "win_filter", "sft_adapter", "branch_points", "soft_labels", "gather_soft_labels",
            "gather_answers", "prm_adapter", "prm_metrics", "eval_summary", "all", *DEFAULT_EVAL_MODES} <= planned


def test_malformed_config_fails_at_parse_time_naming_the_key(workdir):
    result = snakemake(workdir, "-n", "--config", "seed=-3", check=False)
    assert result.returncode != 0
    assert "'seed'" in result.stdout + result.stderr


def test_a_rules_params_leave_out_what_only_says_how_its_job_runs():
    """The params (the rerun trigger) hold no thread count, shard count, checkpoint cadence, bootstrap count or gate
    action, and games.max_instances only of the splits the rule plays; the job gets the whole settings back."""
    config = tiny_config(eval={"split": "test"})
    labels = policy_sections(config, "seed", "model", "games", "labels")
    params = rule_params("soft_labels", labels, config)
    assert "threads" not in params["model"] and "shards" not in params["labels"]
    assert "checkpoint_every" not in params["labels"] and set(params["games"]["max_instances"]) == {"train"}
    job = SimpleNamespace(rule="soft_labels", params=SimpleNamespace(settings=params), config=config)
    assert job_settings(job) == labels
    mode = eval_mode_params(config, "best_of_n")
    params = rule_params("eval_mode", mode, config)
    assert set(params["games"]["max_instances"]) == {"test"} and "bootstrap_samples" not in params["prm"]
    assert "gate" not in params["prm"] and "ci" not in params["prm"] and "lr" in params["prm"]   # rule prm_metrics's
    assert job_settings(SimpleNamespace(rule="eval_mode", params=SimpleNamespace(settings=params), config=config)) \
        == mode


# ------------------------------------------------------------------------------ the completed run, stage by stage


def test_base_rollouts(completed_run):
    episodes = records.read_records(completed_run.workdir / "results/rollouts/base_train.parquet", records.EPISODES)
    assert len(episodes) == 7 * 2 * 2  # 7 games (3 built-in, 4 clembench) x 2 train instances x 2 episodes
    assert {row["game"] for row in episodes} == set(GAMES)
    assert all(row["policy"].startswith("tiny") for row in episodes)
    # broken_setup fails at set-up, before any turn (tests/test_clembench.py); every other episode plays
    assert all((row["n_turns"] >= 1) == (row["game"] != "broken_setup") for row in episodes)


def test_win_filter_and_sft_adapter(completed_run):
    results = completed_run.workdir / "results"
    records.read_records(results / "sft/sft_data.parquet", records.INTERACTIONS)  # schema checked
    adapter = results / "sft/adapter"
    assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
    metrics = json.loads((results / "sft/metrics.json").read_text())
    assert metrics["status"] == "trained" and metrics["steps"] > 0 and metrics["examples"]["rows"]["extra_data"] == 4
    assert metrics["config"]["sft"]["lr"] == 1e-3 and metrics["config"]["model"]["spec"] == "tiny:0"


def test_branch_points_and_soft_labels(completed_run):
    results = completed_run.workdir / "results"
    bps = records.read_records(results / "labels/branch_points.parquet", records.BRANCH_POINTS)
    soft_labels = records.read_records(results / "labels/soft_labels.parquet", records.SOFT_LABELS)
    assert bps and [row["bp_id"] for row in soft_labels] == [bp["bp_id"] for bp in bps]
    assert all(0 <= row["label"] <= 1 and row["k"] in (0, 2) for row in soft_labels)
    assert sorted(p.name for p in (results / "labels/shards").iterdir()) == ["0-of-2.parquet", "1-of-2.parquet"]


def test_answers_with_verdicts(completed_run):
    """gather_answers ran in the DAG: the train answers of the base rollouts, the SFT policy's trajectories and the
    label continuations, each with the game's verdict; `clemprm inspect` reads them."""
    results = completed_run.workdir / "results"
    rows = records.read_records(results / "labels/answers.parquet", records.ANSWERS, splits=records.TRAIN_SPLITS)
    assert {"base_rollouts", "sft_trajectories", "label_continuations"} <= {row["source"] for row in rows}
    assert all(row["parse_ok"] is not None and row["count"] >= 1 for row in rows)
    base_turns = sum(episode["n_turns"] for episode in records.read_records(
        results / "rollouts/base_train.parquet", records.EPISODES))
    assert sum(row["count"] for row in rows) > base_turns   # the later stages' plays too
    assert "first played in: base_rollouts" in inspect_file(results / "labels/answers.parquet")


def test_prm_adapter_and_prm_metrics(completed_run):
    """prm_adapter writes the adapter and every side's predictions (the training record in their provenance);
    prm_metrics measures them: the metrics hold the training record and the held-out ranking of every side's rows."""
    results = completed_run.workdir / "results"
    metrics = json.loads((results / "prm/metrics.json").read_text())
    assert metrics["status"] == "trained" and metrics["config"]["prm"]["epochs"] == 1
    assert (results / "prm/adapter/adapter_model.safetensors").is_file()
    predicted = records.read_records(results / "prm/predictions.parquet", records.PRM_PREDICTIONS)
    training = records.read_provenance(results / "prm/predictions.parquet")["training"]
    assert training["steps"] == metrics["steps"] and training["history"] == metrics["history"]
    assert collections.Counter(row["side"] for row in predicted) == {
        side: count for side, count in metrics["examples"].items() if side in ("train", "validation", "heldout")
        and count}
    ranked = metrics["ranking"]["side"]   # validation: the tiny run holds out no validation-split states
    assert metrics["evaluation"][ranked]["n"] == sum(row["side"] == ranked for row in predicted) > 0
    assert sum(row["policy_logprob"] is not None for row in predicted if row["side"] == ranked) > 0


def test_eval_modes_and_summary(completed_run):
    results = completed_run.workdir / "results"
    summary = json.loads((results / "prm_eval.json").read_text())
    jsonschema.validate(summary, evaluate.summary_schema())
    assert set(summary["modes"]) == EVAL_MODES
    for mode in EVAL_MODES:
        rows = records.read_records(results / f"eval/{mode}.parquet", records.EVAL_EPISODES)
        assert len(rows) == len(GAMES) and {row["mode"] for row in rows} == {mode}   # 7 games x 1 validation instance
        assert summary["modes"][mode]["results"]["overall"]["episodes"] == len(rows)
    # the PRM's held-out global and within-prefix metrics, for it and every baseline
    prm_metrics = json.loads((results / "prm/metrics.json").read_text())
    assert summary["prm"] == evaluate.prm_summary(prm_metrics) and summary["prm"]["ranking"]["prefixes"] > 0
    assert set(summary["prm"]["ranking"]["scorers"]) == set(evaluate.RANKING_SCORERS)


def test_the_run_ends_with_its_results_table(completed_run):
    """The last thing a run prints is the table of its prm_eval.json (clemprm summary): every mode's row holds its
    overall % played, quality and clemscore with their intervals, and the PRM's gate verdict is there."""
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())
    printed = console.summary_table(summary, "results/prm_eval.json")
    assert printed in completed_run.output
    lines = printed.splitlines()
    for mode, entry in summary["modes"].items():
        overall = entry["results"]["overall"]
        row = next(line for line in lines if line.strip().startswith(f"{mode} "))
        for metric in console.METRICS:
            assert console.estimate(overall[metric]) in row, (mode, metric)
    difference = summary["differences"]["random_of_n"]["best_of_n"]["overall"]["quality"]
    row = next(line for line in lines if line.strip().startswith("best_of_n - random_of_n"))
    assert console.estimate(difference, signed=True) in row
    assert f"quality gate: {summary['prm']['gate']['status']}".lower() in printed.lower()
    assert "BLIND: one answer per turn" in printed and "LOOKAHEAD" not in printed   # the default is blind only
    # then what each stage did, read from the run's files
    from clemprm.evaluation.stage_account import stage_lines

    account = stage_lines(completed_run.workdir / "results")
    assert "\n".join(account[1:]) in completed_run.output and len(account) == 6   # blank, title, four stages
    base = records.read_records(completed_run.workdir / "results/rollouts/base_train.parquet")
    assert account[2].startswith(f"  base rollouts: {len(base)} episodes, {sum(row['success'] for row in base)} won")
    assert account[5].startswith("  PRM: ") and "on its train siblings" in account[5]


def test_report_figures_show_their_inputs(completed_run):
    """Each figure's data (kept in its PNG) is what its input files hold, not a "no data" placeholder."""
    results = completed_run.workdir / "results"
    summary = json.loads((results / "prm_eval.json").read_text())
    scores = report.figure_data(results / "report/eval_scores.png")
    games = sorted({game for mode in summary["modes"].values() for game in mode["results"]} - {"overall"})
    assert scores["groups"] == games + ["overall"] and set(scores["modes"]) == EVAL_MODES
    for mode, metrics in scores["modes"].items():
        assert set(metrics) == {"percent_played", "quality", "clemscore"}
        for metric, drawn in metrics.items():
            expected = [summary["modes"][mode]["results"][group][metric]["value"] for group in scores["groups"]]
            assert drawn["values"] == pytest.approx([float("nan") if v is None else v for v in expected], nan_ok=True)

    labels = pq.read_table(results / "labels/soft_labels.parquet", columns=["game", "label"]).to_pylist()
    histogram = report.figure_data(results / "report/soft_labels.png")
    assert histogram["counts"] and set(histogram["counts"]) == {row["game"] for row in labels}
    for game, counts in histogram["counts"].items():
        values = [row["label"] for row in labels if row["game"] == game]
        assert counts == [sum(i / 10 <= v < (i + 1) / 10 or (i == 9 and v == 1.0) for v in values) for i in range(10)]

    prm_metrics = json.loads((results / "prm/metrics.json").read_text())
    calibration = report.figure_data(results / "report/prm_calibration.png")
    side = "validation" if prm_metrics["evaluation"]["validation"] else "train"
    bins = [b for b in prm_metrics["evaluation"][side]["calibration"] if b["count"]]
    assert calibration["side"] == side and bins
    assert calibration["points"] == [[b["mean_prediction"], b["mean_label"], b["count"]] for b in bins]

    picks = report.figure_data(results / "report/prm_sibling_picks.png")
    ranking = summary["prm"]["ranking"]
    assert picks["groups"] == sorted(set(ranking["best_label"]) - {"overall"}) + ["overall"]
    prm_picks = [_none_as_nan(ranking["scorers"]["prm"][group]["pick_label"]["value"]) for group in picks["groups"]]
    assert picks["bars"]["PRM pick"]["values"] == pytest.approx(prm_picks, nan_ok=True)
    assert picks["bars"]["best sibling"]["values"] == pytest.approx(
        [_none_as_nan(ranking["best_label"][group]["value"]) for group in picks["groups"]], nan_ok=True)

    curves = report.figure_data(results / "report/training_curves.png")
    for name, path in (("SFT adapter", "sft/metrics.json"), ("PRM adapter", "prm/metrics.json")):
        history = json.loads((results / path).read_text())["history"]
        for key in ("train_loss", "eval_loss"):
            assert curves[name][key] == [[row["epoch"], row[key]] for row in history if row.get(key) is not None]
        assert curves[name]["train_loss"]


def _none_as_nan(value):
    return float("nan") if value is None else value


def test_every_rule_logs_and_benchmarks(completed_run):
    results = completed_run.workdir / "results"
    finished = set(re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", completed_run.output)) - {"all"}
    assert {"base_rollouts", "soft_labels", "prm_adapter", "prm_metrics", "eval_summary", "eval_report_figures",
            "eval_transcripts"} <= finished
    for rule in finished:   # a rule with wildcards (a label shard, a merge) logs into a folder of its name
        name = {"soft_labels": "soft_labels/0-of-2", "merge": "merge/sft", "rl_adapter": "rl_adapter/grpo",
                "eval_mode": "eval/greedy_rl_grpo"}.get(rule, rule)
        assert "rule " in (results / f"logs/{name}.log").read_text(), rule
        assert (results / f"benchmarks/{name}.tsv").exists(), rule
    assert "episodes done" in (results / "logs/base_rollouts.log").read_text()
    assert "sft step" in (results / "logs/sft_adapter.log").read_text()


def test_snakemake_report(completed_run, tmp_path):
    snakemake(completed_run.workdir, "--report", str(tmp_path / "report.html"))
    page = (tmp_path / "report.html").read_text()
    assert len(page) > 10000
    # the front page starts with results/report/warnings.html (report/workflow.rst): its headline, "WARNING: N failed
    # stage check(s) went on ..." (the run plays on after broken_setup's failures: tests/test_clembench.py checks the
    # block's rows)
    warnings = (completed_run.workdir / "results/report/warnings.html").read_text()
    headline = re.sub(r"<[^>]+>", "", warnings.split("</p>")[0]).strip()
    assert headline.startswith("WARNING: ") and headline in page, headline
    # the transcripts (rule eval_transcripts): per mode and game a won and a lost episode where there are (every game
    # has one or the other), a search's choices beside them; every page in the report as written, with its labels
    transcripts = completed_run.workdir / "results/report/transcripts"
    pages = sorted(transcripts.rglob("*.html"))
    modes = {path.relative_to(transcripts).parts[0] for path in pages}
    assert modes == set(DEFAULT_EVAL_MODES) and {path.parent.name for path in pages} == set(GAMES)
    assert {path.stem for path in pages if path.parts[-3] == "best_of_n"} >= {"lost", "lost_choices"}
    assert not any(path.stem.endswith("_choices") for path in pages if path.parts[-3].startswith("greedy"))
    embedded = json.loads(re.search(r"var results = (\{.*?\});\n", page).group(1))
    for path in pages:
        entry = embedded[str(path.relative_to(completed_run.workdir))]
        assert entry["labels"] == {"game": path.parent.name, "page": path.stem}
        assert base64.b64decode(entry["data_uri"].split(",", 1)[1]).decode() == path.read_text(encoding="utf-8")


# ------------------------------------------------------------------------------ rerun triggers, on the completed run


def test_a_completed_run_is_up_to_date(completed_run):
    up_to_date = snakemake(completed_run.workdir, "-n")
    assert "Nothing to be done" in up_to_date.stdout + up_to_date.stderr


UPSTREAM = ("base_rollouts", "win_filter", "sft_adapter", "branch_points", "soft_labels", "gather_soft_labels",
            "gather_answers")

# (config change, rules that must rerun, rules that must not); None: exactly the rules that must rerun
RERUNS = {
    "win_filter": ({"win_filter": {"min_bench_score": 50.0}},
                   {"win_filter", "sft_adapter", "branch_points", "soft_labels", "prm_adapter", "greedy_sft",
                    "eval_summary"}, {"base_rollouts", "greedy_base"}),
    "sft": ({"sft": {"lr": 2e-3}}, {"sft_adapter", "branch_points", "greedy_sft", "best_of_n", "merge"},
            {"base_rollouts", "win_filter", "greedy_base"}),
    "labels": ({"labels": {"k": 3}},
               {"soft_labels", "gather_soft_labels", "gather_answers", "prm_adapter", "best_of_n"},
               {"base_rollouts", "win_filter", "sft_adapter", "branch_points", "greedy_base", "greedy_sft"}),
    "prm": ({"prm": {"lr": 1e-3}}, {"prm_adapter", "prm_metrics", "best_of_n", "eval_summary", "merge"},
            set(UPSTREAM) | {"greedy_base", "greedy_sft", "random_of_n", "best_of_n_logprob"}),
    # eval settings rerun only the modes that play by them: the bootstrap only the summary, a beam key no mode here
    "eval": ({"eval": {"bootstrap_samples": 150, "beam_width": 1}},
             {"eval_summary", "eval_report_figures", "self_correction_figure", "all"}, None),
    # rl.* reruns the RL stage, its eval mode and the summary, nothing upstream and no other mode
    "rl": ({"rl": {"lr": 1e-4}}, {"rl_adapter", "greedy_rl_grpo", "greedy_rl_prime", "eval_summary"},
           set(UPSTREAM) | {"greedy_base", "greedy_sft", "random_of_n", "best_of_n", "best_of_n_logprob"}),
    # score.* reruns SCoRe, its eval mode, the summary and the figures after it; no other stage or mode
    # how the PRM is measured (prm.ci, the gate's thresholds) reruns its metrics and what reads them, not its training
    # or a search with it or its merge (their input metrics.json is ancient)
    "prm_metrics": ({"prm": {"ci": 0.9, "gate": {"min_spread_ratio": 0.5}}}, {"prm_metrics", "eval_summary"},
                    set(UPSTREAM) | {"prm_adapter", "eval_mode", "merge", "self_correct"} | EVAL_MODES),
    "score": ({"score": {"lr": 1e-4}}, {"score_adapter", "self_correct", "eval_summary", "self_correction_figure"},
              set(UPSTREAM) | {"greedy_base", "greedy_sft", "random_of_n", "best_of_n", "best_of_n_logprob",
                               "rl_adapter", "greedy_rl_grpo", "greedy_rl_prime", "prm_adapter"}),
}


@pytest.mark.parametrize("change", list(RERUNS))
def test_a_config_change_reruns_only_what_it_touches(completed_run, tmp_path, change):
    sections, rerun, kept = RERUNS[change]
    dry_run = snakemake(completed_run.workdir, "-n", configfile=changed_config(completed_run, tmp_path, **sections))
    planned = planned_rules(dry_run.stdout)
    if kept is None:
        assert planned == rerun
    else:
        assert rerun <= planned and not planned & kept, planned
    if not planned:
        assert "Nothing to be done" in dry_run.stdout + dry_run.stderr


# docs/configuration.md's table "What a changed key reruns": each key's new value here (a row without one fails)
KEY_CHANGES = {
    "model.threads": 2, "model.spec": "tiny:1", "games.parse_mode": "strict", "games.max_instances.train": 3,
    "games.max_instances.validation": 2, "games.max_instances.test": 2, "base_rollouts.temperature": 0.5,
    "win_filter.min_bench_score": 50.0, "sft.lr": 2e-3, "branch_points.siblings": 3, "labels.k": 3,
    "labels.shards": 3, "labels.checkpoint_every": 5, "prm.lr": 1e-3, "prm.ci": 0.9,
    "prm.gate.min_spread_ratio": 0.5, "prm.gate.max_mean_gap": 0.3, "prm.bootstrap_samples": 200,
    "prm.gate.on_failure": "stop",
    "eval.split": "test", "eval.bootstrap_samples": 150, "rl.lr": 1e-4, "score.lr": 1e-4, "merge.dtype": "bfloat16",
    "on_failure": "stop", "cache_dir": "elsewhere", "tracking.report_to": "tensorboard",
    "generation.vllm.concurrency": 8,
}


def documented_reruns() -> dict[str, str]:
    """The rows of docs/configuration.md's table "What a changed key reruns": key -> its "reruns" cell."""
    text = (REPO / "docs" / "configuration.md").read_text()
    table = text.split("### What a changed key reruns", 1)[1].split("\n#", 1)[0]
    return dict(re.findall(r"^\| `([\w.]+)` \| ([^|]+) \|", table, flags=re.MULTILINE))


def nested(key: str, value) -> dict:
    """``{"a": {"b": value}}`` for the dotted key ``a.b``."""
    for part in reversed(key.split(".")):
        value = {part: value}
    return value


def holds(condition: str, config: dict) -> bool:
    """Whether a cell's condition (`` `key` is `value` `` or `` `key` is not `value` ``, joined by "and") holds."""
    clauses = re.findall(r"`([\w.]+)` is (not )?`([^`]*)`", condition)
    assert clauses, f"no condition in {condition!r}"
    found = []
    for key, negated, value in clauses:
        actual = config
        for part in key.split("."):
            actual = actual[part]
        found.append((actual == yaml.safe_load(value)) != bool(negated))
    return all(found)


def documented_rules(cell: str, config: dict) -> set[str]:
    """The rules a "reruns" cell names whose condition holds in ``config``: items separated by ", " outside brackets,
    each one or more `rule` names joined by "and", with an optional "(when ...)" condition; "nothing" names none."""
    if cell.strip() == "nothing":
        return set()
    items, depth, start = [], 0, 0
    for i, char in enumerate(cell):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(cell[start:i])
            start = i + 1
    items.append(cell[start:])
    rules = set()
    for item in items:
        names, _, condition = item.strip().partition(" (when ")
        if not condition or holds(condition.rstrip(")"), config):
            rules |= set(re.findall(r"`(\w+)`", names))
    return rules


def test_the_rerun_table_has_a_change_for_every_key():
    assert set(documented_reruns()) == set(KEY_CHANGES)


@pytest.mark.parametrize("key", list(KEY_CHANGES))
def test_a_changed_key_reruns_what_the_docs_say(completed_run, tmp_path, key):
    """A dry run with one key changed plans what a dry run forcing the rules of its docs row plans (those rules and
    every rule after them), on the completed tiny run."""
    config = load_config(completed_run.workdir / "tiny.yaml")
    rules = documented_rules(documented_reruns()[key], config)
    changed = snakemake(completed_run.workdir, "-n",
                        configfile=changed_config(completed_run, tmp_path, **nested(key, KEY_CHANGES[key])))
    planned = planned_rules(changed.stdout)
    if not rules:
        assert planned == set() and "Nothing to be done" in changed.stdout + changed.stderr, planned
        return
    forced = forced_rules(completed_run.workdir, tuple(sorted(rules)))
    assert planned == forced, f"{key}: planned {sorted(planned)}, the docs' rules force {sorted(forced)}"


@functools.cache
def forced_rules(workdir: Path, rules: tuple[str, ...]) -> set[str]:
    """The jobs (:func:`planned_rules`) a dry run forcing ``rules`` plans on the run in ``workdir``: those rules' and
    every job after them. Once per set of rules (several rows name the same)."""
    return planned_rules(snakemake(workdir, "-n", "--forcerun", *rules).stdout)


def test_the_shard_count_of_labels_already_made_is_kept_until_the_labels_change(tmp_path):
    """labels.shards 3 over labels made in 2 shards with the same settings: the DAG keeps 2 (nothing to remake);
    with another labels.k (the labels are made again anyway), a shard missing, or a set of 3 there, it is 3."""
    def soft_labels_params(config):
        return rule_params("soft_labels", policy_sections(config, "seed", "model", "games", "labels"), config)

    made = load_config(overrides={"labels": {"shards": 2}})
    folder = tmp_path / "shards"
    for shard in range(2):
        records.write_records(folder / f"{shard}-of-2.parquet", [], records.SOFT_LABEL_SHARDS,
                              provenance(policy_sections(made, "seed", "model", "games", "labels")))
    now = load_config(overrides={"labels": {"shards": 3, "checkpoint_every": 7}})
    assert label_shard_count(now, soft_labels_params(now), str(folder)) == 2
    other_k = load_config(overrides={"labels": {"shards": 3, "k": made["labels"]["k"] + 1}})
    assert label_shard_count(other_k, soft_labels_params(other_k), str(folder)) == 3
    assert label_shard_count(now, soft_labels_params(now), str(tmp_path / "none")) == 3
    (folder / "2-of-3.parquet").write_bytes(b"")   # an incomplete set of the count asked for: the made one is kept
    assert label_shard_count(now, soft_labels_params(now), str(folder)) == 2
    (folder / "1-of-2.parquet").unlink()
    assert label_shard_count(now, soft_labels_params(now), str(folder)) == 3


def test_a_job_reads_the_keys_its_params_leave_out(completed_run):
    """The keys left out of the params (clemprm.workflow.unread_keys) still reach the jobs: their records'
    provenance shows the run's values."""
    run = load_config(completed_run.workdir / "tiny.yaml")
    shard = records.read_provenance(completed_run.workdir / "results/labels/shards/0-of-2.parquet")["config"]
    assert shard["labels"]["shards"] == 2 and shard["labels"]["checkpoint_every"] == run["labels"]["checkpoint_every"]
    assert shard["model"]["threads"] == run["model"]["threads"]
    assert shard["games"]["max_instances"] == run["games"]["max_instances"]
    prm = json.loads((completed_run.workdir / "results/prm/metrics.json").read_text())["config"]
    assert prm["prm"]["bootstrap_samples"] == run["prm"]["bootstrap_samples"]
    summary = json.loads((completed_run.workdir / "results/prm_eval.json").read_text())["config"]
    assert summary["games"]["max_instances"] == run["games"]["max_instances"]


def test_a_changed_section_reruns_its_stage_for_real(completed_run, tmp_path):
    """On a copy of the run: a new win filter threshold rewrites the SFT data (with the new setting in its
    provenance) and leaves the base rollouts alone."""
    work = copy_of_run(completed_run, tmp_path / "run")
    episodes, sft_data = work / "results/rollouts/base_train.parquet", work / "results/sft/sft_data.parquet"
    mtimes = episodes.stat().st_mtime_ns, sft_data.stat().st_mtime_ns
    assert "Nothing to be done" in snakemake(work, "-n").stdout   # the copy is as up to date as the run
    changed = changed_config(completed_run, tmp_path, win_filter={"min_bench_score": 50.0})
    snakemake(work, "results/sft/sft_data.parquet", configfile=changed)
    assert episodes.stat().st_mtime_ns == mtimes[0]  # base rollouts not rerun
    assert sft_data.stat().st_mtime_ns != mtimes[1]  # win filter rerun
    assert records.read_provenance(sft_data)["config"]["win_filter"]["min_bench_score"] == 50.0


# ------------------------------------------------------------------------------ clemprm inspect on the run's records


RECORD_FILES = {"rollouts/base_train.parquet": records.EPISODES, "sft/sft_data.parquet": records.INTERACTIONS,
                "labels/branch_points.parquet": records.BRANCH_POINTS,
                "labels/sft_train_episodes.parquet": records.EPISODES,
                "labels/shards/0-of-2.parquet": records.SOFT_LABELS, "labels/soft_labels.parquet": records.SOFT_LABELS,
                **{f"eval/{mode}.parquet": records.EVAL_EPISODES for mode in sorted(EVAL_MODES)},
                "eval/self_correct.parquet": records.SELF_CORRECT_EPISODES}


@pytest.mark.parametrize("name", list(RECORD_FILES))
def test_inspect_command_on_every_record_file(completed_run, name):
    path = completed_run.workdir / "results" / name
    done = subprocess.run([str(Path(sys.executable).parent / "clemprm"), "inspect", str(path), "--examples", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    table = pq.read_table(path)
    assert lines[:2] == [str(path), f"rows: {table.num_rows}"]
    # the random tiny model rarely wins (the clembench game coin is won by the coin), so the run's own SFT data may be
    # empty (its SFT learns from extra.jsonl too)
    assert table.num_rows > 0 or name == "sft/sft_data.parquet"
    for field in RECORD_FILES[name]:
        assert any(line.startswith(f"  {field.name}: ") for line in lines), field.name
    sections = ", ".join(sorted(records.read_provenance(path)["config"]))
    assert f"provenance: config sections {sections}; clemprm " in done.stdout
    rows = table.to_pylist()
    games = [row["meta"]["game"] if "meta" in row else row["game"] for row in rows]
    groups = [f"{game} / {row['mode']}" if "mode" in row else game for game, row in zip(games, rows)]
    for group in set(groups):
        assert f"  {group}: {groups.count(group)} rows" in lines or any(
            line.startswith(f"  {group}: {groups.count(group)} rows,") for line in lines), group
    if "label" in table.column_names:
        assert any(line.strip().startswith("label: mean ") for line in lines)
    assert ("example row 0:" in lines) == (table.num_rows > 0)


def test_merged_adapters(completed_run):
    """The merge stage: every adapter merged into a standalone checkpoint that matches PEFT(base + adapter)."""
    results = completed_run.workdir / "results"
    for name in ("sft", "prm", *(f"rl_{algorithm}" for algorithm in RL_ALGORITHMS)):
        verification = json.loads((results / f"merged/{name}/verification.json").read_text())
        assert verification["passed"] and (results / f"merged/{name}/config.json").is_file()
        assert "verification (passed)" in (results / f"logs/merge/{name}.log").read_text()


def test_rl_adapters(completed_run):
    """The RL stage, one job per algorithm of rl.algorithms, and their eval modes side by side in prm_eval.json."""
    results = completed_run.workdir / "results"
    summary = json.loads((results / "prm_eval.json").read_text())
    for algorithm in RL_ALGORITHMS:
        rl_metrics = json.loads((results / f"rl/{algorithm}/metrics.json").read_text())
        assert rl_metrics["status"] == "trained" and rl_metrics["algorithm"] == algorithm
        assert len(rl_metrics["history"]) == rl_metrics["config"]["rl"]["steps"]
        assert (results / f"rl/{algorithm}/adapter/adapter_model.safetensors").is_file()
        assert f"greedy_rl_{algorithm}" in summary["differences"]["greedy_sft"]
        assert "rl step" in (results / f"logs/rl_adapter/{algorithm}.log").read_text()
    assert (results / "rl/prime/adapter/prm/adapter_model.safetensors").is_file()   # PRIME's implicit PRM
    assert not (results / "rl/grpo/adapter/prm").exists()
    assert set(summary["differences"]["greedy_rl_grpo"]) == EVAL_MODES - {"greedy_rl_grpo"}   # prime against grpo


def test_a_prime_setting_reruns_prime_alone(completed_run, tmp_path):
    """rl.prime is PRIME's alone: GRPO's stage and eval mode stay; a key of every algorithm reruns both."""
    prime = planned_outputs(snakemake(completed_run.workdir, "-n", configfile=changed_config(
        completed_run, tmp_path, rl={"prime": {"lr": 1e-4}})).stdout)
    assert {"results/rl/prime/metrics.json", "results/eval/greedy_rl_prime.parquet"} <= prime
    assert not {path for path in prime if "grpo" in path}, prime
    shared = planned_outputs(snakemake(completed_run.workdir, "-n", configfile=changed_config(
        completed_run, tmp_path, rl={"steps": 3})).stdout)
    assert {f"results/rl/{algorithm}/metrics.json" for algorithm in RL_ALGORITHMS} <= shared


def test_an_old_rl_algorithm_key_fails_at_parse_time_naming_its_replacement(workdir):
    result = snakemake(workdir, "-n", "--config", "rl={'algorithm': 'grpo'}", check=False)
    assert result.returncode != 0
    assert "config key 'rl.algorithm' was replaced by rl.algorithms" in result.stdout + result.stderr



def test_rl_on_hanabi_states_needs_only_the_prompt_set(workdir):
    """rl.data states with a fresh LoRA (configs/hanabi.yaml's RL stage): the merged RL checkpoint needs the prompt
    set (rule rl_states) and the RL stage only, no rollouts or SFT; the RL stage and the merge read the states."""
    config = yaml.safe_load((workdir / "tiny.yaml").read_text())
    config["games"].update(builtin=["hanabi"], experiments={"hanabi": ["small"]}, clembench_games=[],
                           instance_list=None)
    config["rl"] = {"algorithms": ["grpo"], "data": "states", "reward": {"source": "turn_scores"},
                    "loss": "importance_sampling",
                    "lora": {"r": 4, "alpha": 4, "dropout": 0.0, "target_modules": ["q_proj", "lm_head"]}}
    config["eval"] = {"modes": ["greedy_base", "greedy_rl_grpo"]}   # PRIME refuses per-turn rewards: no PRIME mode
    config["merge"] = {"adapters": ["rl_grpo"]}
    path = workdir / "hanabi.yaml"
    path.write_text(yaml.safe_dump(config))
    dry_run = snakemake(workdir, "-n", "results/merged/rl_grpo", configfile=path).stdout
    assert planned_rules(dry_run) == {"rl_states", "rl_adapter", "merge"}
    jobs = dict(re.findall(r"^rule (\w+):\n    input: ([^\n]*)", dry_run, flags=re.MULTILINE))
    assert "results/states/states.parquet" in jobs["rl_adapter"] and "sft" not in jobs["rl_adapter"]
    assert jobs["merge"] == "results/rl/grpo/adapter, results/states/states.parquet"


def test_score_adapter_and_self_correct(completed_run):
    """SCoRe's stage (stage I then II) and eval mode self_correct: both attempts for both policies, the summary's
    self-correction table and its figure."""
    results = completed_run.workdir / "results"
    metrics = json.loads((results / "score/metrics.json").read_text())
    assert metrics["status"] == "trained" and [entry["stage"] for entry in metrics["history"]] == [1, 2]
    assert (results / "score/adapter/adapter_model.safetensors").is_file()
    assert "score stage 2 step 1" in (results / "logs/score_adapter.log").read_text()
    rows = records.read_records(results / "eval/self_correct.parquet", records.SELF_CORRECT_EPISODES)
    # guessnumber (score.games) x 1 validation instance x 1 episode x 2 attempts x 2 policies
    assert sorted((row["policy_role"], row["attempt"]) for row in rows) == [("score", 1), ("score", 2), ("sft", 1),
                                                                            ("sft", 2)]
    assert {row["game"] for row in rows} == {"guessnumber"}
    summary = json.loads((results / "prm_eval.json").read_text())
    assert "self_correct" not in summary["modes"]
    table = summary["self_correction"]
    assert set(table["policies"]) == {"sft", "score"} and "score_minus_sft" in table["difference"]
    for role in ("sft", "score"):
        attempts = {row["attempt"]: row for row in rows if row["policy_role"] == role}
        overall = table["policies"][role]["results"]["overall"]
        assert overall["accuracy_t1"]["value"] == 100.0 * attempts[1]["success"]
        assert overall["accuracy_t2"]["value"] == 100.0 * attempts[2]["success"]
    drawn = report.figure_data(results / "report/self_correction.png")
    assert set(drawn["bars"]) == {"sft", "score"} and [step[1] for step in drawn["steps"]] == [1, 2]

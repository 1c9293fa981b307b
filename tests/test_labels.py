"""Branch points and K-rollout soft labels on the real built-in games: forced outcomes, caps, shards, resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from clemprm import records
from clemprm.config import load_config
from clemprm.stages import branch_points, labels
from clemprm.play.catalog import GameCatalog
from tests.conftest import binary_search_answer, tiny_config

REPO = Path(__file__).resolve().parent.parent

LABEL_SETTINGS = {"k": 3, "k_first": None, "temperature": 0.7, "top_p": 1.0, "max_new_tokens": 8,
                  "max_rollout_rounds": 10, "aborted_value": 0.25, "shards": 1, "checkpoint_every": 4}


def settings_for(config: dict, **label_overrides) -> dict:
    return {"seed": config["seed"], "model": config["model"], "games": config["games"],
            "branch_points": config["branch_points"], "labels": {**LABEL_SETTINGS, **label_overrides}}


def same_rows(a: list[dict], b: list[dict]) -> bool:
    """Row lists equal, NaN included (an aborted trajectory's bench score is NaN, which != itself)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def oddoneout_oracle(catalog: GameCatalog):
    """Answers oddoneout right at once: the odd word looked up from the train and validation instances by the words
    in the prompt."""
    odd = {tuple(i.instance["words"]): i.instance["odd_word"]
           for split in ("train", "validation") for i in catalog.instances("oddoneout", split)}

    def answer(messages):
        words = re.search(r"The words are: (.*?)\. ", messages[0]["content"]).group(1).split(", ")
        return f"ANSWER: {odd[tuple(words)]}"
    return answer


def invalid_then(answer):
    """Breaks the rules on a game's first answer (a violation, reprompted), then plays ``answer``."""
    return lambda messages: "I am not sure." if len(messages) == 1 else answer(messages)


@pytest.fixture
def oddoneout(scripted_policy, tmp_path):
    config = tiny_config(games={"builtin": ["oddoneout"]}, branch_points={"max_per_episode": 4})
    catalog = GameCatalog(config["games"], config["seed"])   # the instances the stage draws
    oracle = oddoneout_oracle(catalog)
    settings = settings_for(config)
    bp_path = tmp_path / "bp.parquet"
    rows = branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path,
                                       policy=scripted_policy(invalid_then(oracle)))
    return settings, bp_path, rows, oracle


def test_evenly_spaced_keeps_ends():
    assert branch_points.evenly_spaced(3, 4) == [0, 1, 2]
    assert branch_points.evenly_spaced(10, 4) == [0, 3, 6, 9]
    assert branch_points.evenly_spaced(10, 1) == [9]


def test_branch_points_cover_every_turn_with_replayable_history(oddoneout):
    _, bp_path, rows, _ = oddoneout
    assert rows == records.read_records(bp_path, records.BRANCH_POINTS)
    by_episode = {}
    for row in rows:
        by_episode.setdefault(row["episode_id"], []).append(row)
    for bps in by_episode.values():  # the violation, then the right answer
        assert [bp["turn_idx"] for bp in bps] == [0, 1]
        assert [bp["parse_ok"] for bp in bps] == [False, True]
        assert bps[1]["history"] == [bps[0]["candidate"], bps[1]["candidate"]]
        assert bps[1]["prefix"][-2] == {"role": "assistant", "content": "I am not sure."}
    assert len({row["seed"] for row in rows}) == len(rows)


def test_winning_continuations_label_one_and_terminal_candidates_keep_their_score(oddoneout, scripted_policy,
                                                                                   tmp_path):
    settings, bp_path, bps, oracle = oddoneout
    rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet",
                                    policy=scripted_policy(oracle))
    assert [row["bp_id"] for row in rows] == [bp["bp_id"] for bp in bps]
    for row in rows:
        if row["turn_idx"] == 0:  # after the violation: K continuations that win at the first attempt
            assert not row["terminal"] and row["k"] == 3 and row["rollout_scores"] == [100.0] * 3
            assert row["n_success"] == 3 and row["n_aborted"] == 0 and row["label"] == 1.0
        else:  # the right answer ended the game: its own score, no continuation
            assert row["terminal"] and row["k"] == 0 and row["rollout_scores"] == [100.0] and row["label"] == 1.0
    assert records.read_records(tmp_path / "labels.parquet", records.SOFT_LABELS) == rows


def test_aborting_continuations_get_the_aborted_value(oddoneout, scripted_policy, tmp_path):
    settings, bp_path, _, _ = oddoneout
    rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet",
                                    policy=scripted_policy(lambda messages: "No idea."))
    continued = [row for row in rows if not row["terminal"]]
    assert continued
    for row in continued:  # a second violation in a row aborts: each continuation scores aborted_value
        assert row["n_aborted"] == 3 and row["n_success"] == 0 and row["label"] == pytest.approx(0.25)


def coin_flip_policy(scripted_policy, answer):
    """Answers ``answer(messages)`` on odd sampling seeds and breaks the rules on even ones: continuations of one
    candidate that differ, as sampled ones do."""
    class CoinFlips(scripted_policy):
        def generate(self, perspectives, seeds=None, **sampling):
            return [scripted_policy(answer if seed % 2 else (lambda _: "No idea.")).generate([messages], **sampling)[0]
                    for messages, seed in zip(perspectives, seeds)]
    return CoinFlips(answer)


def test_k_first_labels_settled_states_from_the_first_round_and_the_rest_as_all_k_at_once(
        scripted_policy, tmp_path):
    """Two rounds: a state whose first-round continuations all scored alike keeps those k_first; every other
    state's labels are the ones all K at once give, continuation for continuation, in any chunking."""
    config = tiny_config(games={"builtin": ["guessnumber"]}, branch_points={"max_per_episode": 4, "siblings": 3})
    policy = coin_flip_policy(scripted_policy, binary_search_answer)
    settings = settings_for(config, k=6)
    bp_path = tmp_path / "bp.parquet"
    branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=policy)
    all_k = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "all.parquet", policy=policy)
    two_rounds = labels.soft_labels_shard({**settings, "labels": {**settings["labels"], "k_first": 2,
                                                                  "checkpoint_every": 1}},
                                          bp_path, None, 0, 1, tmp_path / "two.parquet", policy=policy)
    first_scores = {}
    for row in all_k:
        first_scores.setdefault(row["prefix_id"], set()).update(row["rollout_scores"][:1 if row["terminal"] else 2])
    settled = {prefix for prefix, scores in first_scores.items() if len(scores) == 1}
    assert settled and set(first_scores) - settled   # both kinds of state
    assert [row["bp_id"] for row in two_rounds] == [row["bp_id"] for row in all_k]
    for full, row in zip(all_k, two_rounds):
        if full["prefix_id"] not in settled or full["terminal"]:
            assert same_rows([row], [full])
        else:
            assert row["k"] == 2 and row["rollout_scores"] == full["rollout_scores"][:2]
            assert row["label"] == pytest.approx(sum(row["rollout_scores"]) / 200)
    assert sum(row["k"] for row in two_rounds) < sum(row["k"] for row in all_k)


def test_capped_continuations_get_the_partial_score(scripted_policy, tmp_path):
    config = tiny_config(games={"builtin": ["guessnumber"]})

    def count_up(messages):  # guesses 1, 2, 3, ...
        guesses = re.findall(r"than (\d+)", "\n".join(m["content"] for m in messages))
        return f"GUESS: {int(guesses[-1]) + 1 if guesses else 1}"

    settings = settings_for(config, max_rollout_rounds=1)
    bp_path = tmp_path / "bp.parquet"
    policy = scripted_policy(count_up)
    branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=policy)
    rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet", policy=policy)
    catalog = GameCatalog(config["games"], config["seed"])
    experiments = {i.key: i.experiment for i in catalog.instances("guessnumber", "train")}
    targets = {i.key: int(i.instance["target"]) for i in catalog.instances("guessnumber", "train")}
    checked = 0
    for row in rows:
        key = (row["game"], row["experiment"], row["game_id"])
        guesses = row["turn_idx"] + 2  # the branch point's guesses plus the one continuation turn
        if row["terminal"] or targets[key] <= guesses or guesses >= experiments[key]["max_guesses"]:
            continue
        remaining = experiments[key]["max_number"] - guesses  # the numbers above the last guess
        assert row["n_capped"] == 3 and row["n_aborted"] == 0
        assert row["label"] == pytest.approx(1 / (guesses + 1) / remaining)
        checked += 1
    assert checked


def test_labels_do_not_depend_on_the_shard_count(tiny_policy, tmp_path):
    config = tiny_config(games={"builtin": ["guessnumber", "wordref"]})
    settings = settings_for(config)
    bp_path = tmp_path / "bp.parquet"
    branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=tiny_policy)
    one = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "one.parquet", policy=tiny_policy)
    shard_paths = [tmp_path / f"{s}-of-3.parquet" for s in range(3)]
    for shard, path in enumerate(shard_paths):
        labels.soft_labels_shard({**settings, "labels": {**settings["labels"], "shards": 3}}, bp_path, None, shard, 3,
                                 path, policy=tiny_policy)
    # the random tiny model aborts every continuation: all labels alike, which would stop the run
    gathered = labels.gather_soft_labels(settings, bp_path, shard_paths, tmp_path / "gathered.parquet",
                                         on_failure="continue")
    assert len(one) == len(records.read_records(bp_path)) > 3
    assert same_rows(gathered, one)
    assert all(0.0 <= row["label"] <= 1.0 and len(row["rollout_scores"]) == max(row["k"], 1) for row in one)
    assert sum(row["new_tokens"] for row in one) > 0


@pytest.fixture(scope="module")
def tiny_policy(tmp_path_factory, test_cache_dir):
    from clemprm.models.generation import load_policy
    return load_policy({**tiny_config()["model"], "max_context_tokens": 2048}, test_cache_dir)


# the shard as a job of its own; with a third argument N, the job is killed with SIGKILL right after the checkpoint's
# N-th part is written, as a preempted job would be mid-way: the process, and under torchrun first torchrun (the
# other ranks then lose rank 0 and end too)
RESUMABLE_SHARD = """
import logging, os, signal, sys, yaml
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from clemprm import distributed
from clemprm.stages import labels
distributed.init_from_environment()
if len(sys.argv) > 3:
    save = labels.ShardCheckpoint.save
    def save_then_die(checkpoint, rows):
        save(checkpoint, rows)
        if len(checkpoint._parts()) == int(sys.argv[3]):
            if distributed.world_size() > 1:
                os.kill(os.getppid(), signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
    labels.ShardCheckpoint.save = save_then_die
settings = yaml.safe_load(open("settings.yaml"))
labels.soft_labels_shard(settings, "bp.parquet", None, 0, 1, sys.argv[1], cache_dir=sys.argv[2])
"""


@pytest.mark.parametrize("killed_processes", [1, 2])
def test_a_killed_shard_resumes_from_its_checkpoint_with_identical_labels(killed_processes, tiny_policy, tmp_path,
                                                                         test_cache_dir):
    """Killed after its second checkpoint chunk (in one process, or in two under torchrun, each labelling half of
    every chunk), the shard rerun in one process labels only what the checkpoint lacks: the labels of a run that
    was never interrupted."""
    config = tiny_config(games={"builtin": ["guessnumber", "oddoneout"]})
    settings = settings_for(config, checkpoint_every=killed_processes, k=4, max_new_tokens=16)
    branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", tmp_path / "bp.parquet",
                                policy=tiny_policy)
    (tmp_path / "settings.yaml").write_text(yaml.safe_dump(settings))
    (tmp_path / "shard.py").write_text(RESUMABLE_SHARD)
    command = [sys.executable, "shard.py", "resumed.parquet", test_cache_dir]
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"] if killed_processes > 1 else []

    killed = subprocess.run([command[0], *launcher, *command[1:], "2"], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    checkpoint = tmp_path / "resumed.parquet.ckpt"
    assert killed.returncode == -signal.SIGKILL, killed.stdout[-3000:] + killed.stderr[-3000:]
    assert len(list(checkpoint.glob("part-*.parquet"))) == 2
    assert not (tmp_path / "resumed.parquet").exists()

    rerun = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    done_before = int(re.search(r"(\d+) done in the checkpoint", rerun.stdout).group(1))
    assert done_before == 2 * killed_processes, rerun.stdout[-3000:]   # the two parts' branch points
    assert not checkpoint.exists()

    labels.soft_labels_shard(settings, tmp_path / "bp.parquet", None, 0, 1, tmp_path / "straight.parquet",
                             policy=tiny_policy)
    # the labels and each continuation's answers (records.SOFT_LABEL_SHARDS) of a run never interrupted
    straight = records.read_records(tmp_path / "straight.parquet")
    assert same_rows(records.read_records(tmp_path / "resumed.parquet"), straight)


def stale_row(bp: dict) -> dict:
    """A soft-label row of ``bp`` with a label no run of the oracle gives (0.125: 1 of 8 continuations won)."""
    return {**bp, "k": 8, "terminal": False, "rollout_scores": [100.0] + [0.0] * 7, "n_aborted": 0, "n_success": 1,
            "n_capped": 0, "n_errors": 0, "new_tokens": 0, "label": 0.125}


def test_a_checkpoint_of_other_settings_is_discarded(oddoneout, scripted_policy, tmp_path, caplog):
    settings, bp_path, bps, oracle = oddoneout
    output = tmp_path / "labels.parquet"
    stale = labels.ShardCheckpoint(output, "made with other settings")
    stale.load()
    stale.save([stale_row(bp) for bp in bps])   # every branch point "done", with a wrong label
    with caplog.at_level("INFO", logger="clemprm.stages.labels"):
        rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, output, policy=scripted_policy(oracle))
    assert "made with other settings or branch points" in caplog.text and "0 done in the checkpoint" in caplog.text
    assert [row["bp_id"] for row in rows] == [bp["bp_id"] for bp in bps]
    assert all(row["label"] == 1.0 for row in rows)   # the oracle wins everywhere: nothing of the stale rows
    assert not stale.folder.exists()


def test_a_corrupt_checkpoint_part_is_discarded_and_relabelled(oddoneout, scripted_policy, tmp_path, caplog):
    """Part 0 of the checkpoint is good, part 1 is a real part cut short: part 0's rows are kept as they are (a
    marked label shows they are not recomputed), part 1's branch points are labelled again, with a warning."""
    settings, bp_path, bps, oracle = oddoneout
    straight = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "straight.parquet",
                                        policy=scripted_policy(oracle))
    output = tmp_path / "labels.parquet"
    checkpoint = labels.ShardCheckpoint(output, labels.shard_fingerprint(settings, bp_path, 0, 1))
    assert checkpoint.load() == []
    kept = [stale_row(bp) for bp in bps[:2]]
    checkpoint.save(kept)
    checkpoint.save(straight[2:4])
    part = checkpoint.folder / "part-00001.parquet"
    part.write_bytes(part.read_bytes()[:part.stat().st_size // 2])
    with caplog.at_level("INFO", logger="clemprm.stages.labels"):
        rows = labels.soft_labels_shard(settings, bp_path, None, 0, 1, output, policy=scripted_policy(oracle))
    warnings = [r for r in caplog.records if r.levelname == "WARNING" and "part-00001.parquet" in r.getMessage()]
    assert warnings and "discarded" in warnings[0].getMessage()
    assert f"{len(bps)} branch points, 2 done in the checkpoint, {len(bps) - 2} to label" in caplog.text
    assert same_rows(rows, kept + straight[2:])
    assert same_rows(records.read_records(output, records.SOFT_LABELS), rows) and not checkpoint.folder.exists()


def test_a_checkpoint_part_after_a_discarded_one_gets_a_new_number(tmp_path):
    checkpoint = labels.ShardCheckpoint(tmp_path / "labels.parquet", "fingerprint")
    checkpoint.load()
    for _ in range(3):
        checkpoint.save([])
    (checkpoint.folder / "part-00001.parquet").unlink()   # as load() does with an unreadable part
    checkpoint.save([])
    assert sorted(p.name for p in checkpoint.folder.glob("part-*")) == [
        "part-00000.parquet", "part-00002.parquet", "part-00003.parquet"]


def test_validation_instances_give_held_out_branch_points_that_label_like_train_ones(oddoneout, scripted_policy,
                                                                                    tmp_path):
    settings, _, train_rows, oracle = oddoneout
    settings = {**settings, "branch_points": {**settings["branch_points"], "validation_instances": 2}}
    catalog = GameCatalog(settings["games"], settings["seed"])
    bp_path = tmp_path / "with_validation.parquet"
    rows = branch_points.branch_points(settings, None, tmp_path / "episodes2.parquet", bp_path,
                                       policy=scripted_policy(invalid_then(oracle)))
    held_out = [row for row in rows if row["split"] == "validation"]
    assert [row for row in rows if row["split"] == "train"] == train_rows
    # the instances the run's seed draws (2 of 40 per split here), not the first ones of the files
    played = {(row["experiment"], row["game_id"]) for row in rows}
    drawn = {i.key[1:] for split in ("train", "validation") for i in catalog.instances("oddoneout", split)}
    first = {i.key[1:] for split in ("train", "validation") for i in GameCatalog(settings["games"]).instances(
        "oddoneout", split)}
    assert played == drawn != first
    assert {row["game_id"] for row in held_out} == {i.instance["game_id"]
                                                    for i in catalog.instances("oddoneout", "validation")[:2]}
    assert len(held_out) == 2 * 2   # the violation and the right answer of each of 2 instances
    labelled = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet",
                                        policy=scripted_policy(oracle))
    assert [row["split"] for row in labelled] == [row["split"] for row in rows]
    assert [row["label"] for row in labelled if row["split"] == "validation"] == [1.0, 1.0] * 2


def test_siblings_share_their_prefix_and_label_alike_in_any_shard_count(tiny_policy, tmp_path):
    config = tiny_config(games={"builtin": ["guessnumber", "wordref"]}, branch_points={"siblings": 3})
    settings = settings_for(config, k=2)
    bp_path = tmp_path / "bp.parquet"
    bps = branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path, policy=tiny_policy)
    by_prefix = {}
    for bp in bps:
        by_prefix.setdefault(bp["prefix_id"], []).append(bp)
    assert any(len(group) > 1 for group in by_prefix.values())
    for prefix_id, group in by_prefix.items():
        played, *siblings = group
        assert played["bp_id"] == prefix_id and len(group) <= 3
        assert len({bp["candidate"] for bp in group}) == len(group)
        for sibling in siblings:
            assert sibling["bp_id"].startswith(f"{prefix_id}/s") and sibling["prefix"] == played["prefix"]
            assert sibling["history"] == played["history"][:-1] + [sibling["candidate"]]
        assert all(bp["multiplicity"] >= 1 for bp in group) and sum(bp["multiplicity"] for bp in group) <= 3
    assert len({bp["seed"] for bp in bps}) == len(bps)
    one = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "one.parquet", policy=tiny_policy)
    shard_paths = [tmp_path / f"{s}-of-2.parquet" for s in range(2)]
    shards = [labels.soft_labels_shard(settings, bp_path, None, s, 2, path, policy=tiny_policy)
              for s, path in enumerate(shard_paths)]
    assert not {row["prefix_id"] for row in shards[0]} & {row["prefix_id"] for row in shards[1]}
    gathered = labels.gather_soft_labels(settings, bp_path, shard_paths, tmp_path / "gathered.parquet",
                                         on_failure="continue")
    assert [row["bp_id"] for row in one] == [bp["bp_id"] for bp in bps] and same_rows(gathered, one)


def test_distinct_siblings_keep_the_first_of_each_answer_and_count_its_samples():
    from clemprm.play.contract import Generation

    def sample(text, error=None):
        return Generation(text=text, raw_text=text, prompt_tokens=1, new_tokens=1, error=error)

    generations = [sample("A"), sample("B"), sample("B"), sample("", error="out of memory"), sample("C"), sample("A")]
    fresh, counts = branch_points.distinct_siblings("A", generations)
    assert [(j, g.text) for j, g in fresh] == [(2, "B"), (4, ""), (5, "C")]   # the failed one is kept to be logged
    assert counts == {"A": 3, "B": 2, "C": 1}


def test_a_policy_that_repeats_itself_gives_one_branch_point_per_state_with_all_its_samples(scripted_policy,
                                                                                            tmp_path):
    """A deterministic policy's 4 samples of a state are one answer: no sibling row, and the played one's
    multiplicity 4 (a random pick among the samples always picks it); soft labels carry it on."""
    config = tiny_config(games={"builtin": ["oddoneout"]}, branch_points={"max_per_episode": 4, "siblings": 4})
    settings = settings_for(config)
    oracle = oddoneout_oracle(GameCatalog(config["games"], config["seed"]))
    bp_path = tmp_path / "bp.parquet"
    rows = branch_points.branch_points(settings, None, tmp_path / "episodes.parquet", bp_path,
                                       policy=scripted_policy(invalid_then(oracle)))
    assert rows and all(row["bp_id"] == row["prefix_id"] and row["multiplicity"] == 4 for row in rows)
    labelled = labels.soft_labels_shard(settings, bp_path, None, 0, 1, tmp_path / "labels.parquet",
                                        policy=scripted_policy(oracle))
    assert [row["multiplicity"] for row in labelled] == [4] * len(rows)
    without_siblings = branch_points.branch_points(settings_for(tiny_config(games={"builtin": ["oddoneout"]})), None,
                                                   tmp_path / "episodes1.parquet", tmp_path / "bp1.parquet",
                                                   policy=scripted_policy(invalid_then(oracle)))
    assert {row["multiplicity"] for row in without_siblings} == {1}


def test_the_seed_draws_the_train_and_held_out_instances_and_every_seed_tests_on_the_whole_test_split():
    """configs/learning.yaml: 12 of 40 train instances per game, every one of the 40 validation instances held out
    (the yardstick: about 4 times the pairs of 10), all 20 test instances. Seeds 7 and 11 train on other instances of
    every game, hold out and test on the same, whole splits; a held-out set capped below its split (10 of 40) is
    drawn by the seed too; one seed draws alike every time, each experiment as often (round-robin), and a game's
    draw does not depend on the other games."""
    config = load_config(REPO / "configs/learning.yaml")
    assert config["branch_points"]["validation_instances"] == 40

    def draw(seed: int, games: dict = config["games"], per_game: int = 40) -> dict[str, list]:
        catalog = GameCatalog(games, seed)
        return {"train": [i.key for i in catalog.all_instances("train")],
                "held_out": [i.key for i in branch_points.held_out_instances(catalog, per_game)[0]],
                "test": [i.key for i in catalog.all_instances("test")]}

    seven, eleven = draw(7), draw(11)
    assert draw(7) == seven
    capped_seven, capped_eleven = draw(7, per_game=10), draw(11, per_game=10)
    every_validation_instance = {i.key for i in GameCatalog(config["games"]).all_instances("validation")}
    assert set(seven["held_out"]) == set(eleven["held_out"]) == every_validation_instance
    for game in config["games"]["builtin"]:
        for keys, part, size in ((seven, "train", 12), (capped_seven, "held_out", 10)):
            other = eleven if keys is seven else capped_eleven
            ours, theirs = ({key for key in drawn[part] if key[0] == game} for drawn in (keys, other))
            assert len(ours) == len(theirs) == size and ours != theirs, (game, part)
    every_test_instance = {i.key for i in GameCatalog(config["games"]).all_instances("test")}
    assert len(every_test_instance) == 60 and set(seven["test"]) == set(eleven["test"]) == every_test_instance
    experiments = [key[1] for key in seven["train"] if key[0] == "guessnumber"]
    assert {experiments.count(name) for name in set(experiments)} == {3}   # 4 experiments, 3 each
    alone = draw(7, {**config["games"], "builtin": ["guessnumber"]})
    assert alone["train"] == [key for key in seven["train"] if key[0] == "guessnumber"]


def test_label_stages_refuse_branch_points_of_the_test_split(oddoneout, scripted_policy, tmp_path):
    """Branch points are of train and held-out validation instances; a file with test rows is another stage's."""
    settings, bp_path, rows, oracle = oddoneout
    wrong = tmp_path / "test_bp.parquet"
    records.write_records(wrong, [{**row, "split": "test"} for row in rows[:2]] + rows[2:], records.BRANCH_POINTS, {})
    expected = re.escape(f"record file {wrong} holds 2 test rows (of {len(rows)}), where this stage reads only train "
                         f"and validation rows")
    with pytest.raises(records.RecordFileError, match=expected):
        labels.soft_labels_shard(settings, wrong, None, 0, 1, tmp_path / "labels.parquet",
                                 policy=scripted_policy(oracle))
    with pytest.raises(records.RecordFileError, match=expected):
        labels.gather_soft_labels(settings, wrong, [], tmp_path / "gathered.parquet")

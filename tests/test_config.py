"""Config validation: the default is valid; bad values fail naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clemprm.modes import MODES
from clemprm.config import ConfigError, eval_mode_params, load_config, provenance, rl_params, sections

REPO = Path(__file__).resolve().parent.parent


def test_default_config_is_valid():
    config = load_config()
    assert config["model"]["spec"] == "embedded:smollm2-135m-instruct"


@pytest.mark.parametrize("files", [["configs/cluster.yaml"], ["configs/learning.yaml"], ["configs/hanabi.yaml"],
                                   ["configs/learning.yaml", "configs/lookahead.yaml"], ["configs/tiny.yaml"]])
def test_the_shipped_configs_are_valid(files):
    """Each config in configs/ on top of config.yaml, as its header says to use it (a default changed under one of
    them, e.g. blind search, must not leave it failing at parse time)."""
    load_config([str(REPO / name) for name in files])


def test_merge_adapters_name_adapters_the_run_trains():
    assert load_config()["merge"]["adapters"] == []   # the embedded default merges nothing unless asked
    assert load_config(overrides={"merge": {"adapters": ["sft", "prm"]}})["merge"]["adapters"] == ["sft", "prm"]
    with pytest.raises(ConfigError, match=r"'merge.adapters': rl_grpo is no adapter this run trains"):
        load_config(overrides={"merge": {"adapters": ["sft", "rl_grpo"]}})
    load_config(overrides={"merge": {"adapters": ["rl_grpo"]}, "rl": {"algorithms": ["grpo"]}})
    with pytest.raises(ConfigError, match=r"'merge.adapters': prm is a probe here \(prm.kind: probe\)"):
        load_config(overrides={"merge": {"adapters": ["prm"]}, "prm": {"kind": "probe"}})


@pytest.mark.parametrize("override, key", [
    ({"base_rollouts": {"temperature": -1}}, "base_rollouts.temperature"),
    ({"base_rollouts": {"episodes_per_instance": "many"}}, "base_rollouts.episodes_per_instance"),
    ({"games": {"builtin": ["chess"]}}, "games.builtin.0"),
    ({"games": {"parse_mode": "sloppy"}}, "games.parse_mode"),
    ({"model": {"quantization": "int3"}}, "model.quantization"),
    ({"win_filter": {"min_bench_score": 101}}, "win_filter.min_bench_score"),
    ({"win_filter": {"typo_key": 1}}, "win_filter.typo_key"),
    ({"unknown_section": {}}, "unknown_section"),
])
def test_bad_values_fail_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        load_config(overrides=override)


def test_max_context_tokens_is_a_number_or_auto():
    assert load_config(overrides={"model": {"max_context_tokens": "auto"}})["model"]["max_context_tokens"] == "auto"
    assert load_config()["model"]["max_context_tokens"] == 2048   # the default keeps the records of earlier runs
    with pytest.raises(ConfigError, match=r"^config key 'model.max_context_tokens': 8 is less than the minimum of "
                                          r"16, or 'auto' was expected$"):
        load_config(overrides={"model": {"max_context_tokens": 8}})
    with pytest.raises(ConfigError, match="'model.max_context_tokens': 'all' is not of type 'integer', or 'auto'"):
        load_config(overrides={"model": {"max_context_tokens": "all"}})


def test_sections_are_key_sorted_so_reordering_is_not_a_change():
    a = sections({"x": {"b": 1, "a": {"d": 2, "c": 3}}, "y": 0}, "x")
    b = sections({"x": {"a": {"c": 3, "d": 2}, "b": 1}}, "x")
    assert str(a) == str(b)


def test_provenance_names_config_and_versions():
    record = provenance({"win_filter": {"require_success": True}})
    assert record["config"] == {"win_filter": {"require_success": True}}
    assert {"clemcore", "torch", "transformers", "snakemake"} <= set(record["versions"])


def test_eval_mode_params_hold_only_what_the_mode_plays_by():
    config = load_config()
    params = {mode: eval_mode_params(config, mode) for mode in MODES}
    assert set(params["greedy_base"]) == {"seed", "model", "games", "eval"}
    assert set(params["best_of_n"]) == set(params["beam_search"]) == {"seed", "model", "games", "eval", "prm"}
    assert "random_of_n" in config["eval"]["modes"] and "prm" not in params["random_of_n"]
    changed = load_config(overrides={"eval": {"bootstrap_samples": 7, "ci": 0.5, "modes": ["greedy_base"],
                                              "beam_width": 3}})
    assert {mode for mode in MODES if eval_mode_params(changed, mode) != params[mode]} == {
        "beam_search", "beam_search_logprob", "beam_search_rule"}
    sampled = load_config(overrides={"eval": {"temperature": 0.3}})
    assert {mode for mode in MODES if eval_mode_params(sampled, mode) != params[mode]} == \
        {"random_of_n", "best_of_n", "beam_search", "best_of_n_implicit", "best_of_n_logprob", "beam_search_logprob",
         "best_of_n_lookahead", "best_of_n_rule", "beam_search_rule"}
    assert set(params["self_correct"]) == {"seed", "model", "games", "eval", "score"}
    assert params["best_of_n_implicit"]["rl"]["algorithm"] == "prime" and "prime" in params["best_of_n_implicit"]["rl"]


def test_a_new_mode_is_one_row_of_the_table(monkeypatch):
    """A mode added to clemprm.modes.MODES is valid in eval.modes, has params and a summary schema entry."""
    from clemprm import modes
    from clemprm.evaluation import evaluate

    row = modes.EvalMode("best_of_n_wide", "sft", "best_of_n", "prm", modes.SEARCH_KEYS, ("prm",),
                         {"sft_adapter": modes.SFT_ADAPTER, "prm_adapter": modes.PRM_ADAPTER})
    monkeypatch.setitem(modes.MODES, row.name, row)
    config = load_config(overrides={"eval": {"modes": ["greedy_sft", "best_of_n_wide"]}})
    assert set(eval_mode_params(config, "best_of_n_wide")) == {"seed", "model", "games", "eval", "prm"}
    assert "best_of_n_wide" in evaluate.summary_schema()["$defs"]["mode"]["enum"]
    assert modes.upstream_outputs(["best_of_n_wide"])[-1] == "results/labels/soft_labels.parquet"
    with pytest.raises(ConfigError, match="eval.modes"):
        load_config(overrides={"eval": {"modes": ["best_of_n_narrow"]}})


def test_a_mode_whose_prm_reads_another_input_than_the_prm_is_trained_on_fails_at_parse_time():
    """The PRM is trained for one input: blind modes show it the candidate, lookahead modes the game's reply too."""
    with pytest.raises(ConfigError, match=r"'prm.input': eval mode beam_search \(lookahead\) needs a PRM trained on "
                                          r"'candidate_with_reply', but prm.input is 'candidate'"):
        load_config(overrides={"eval": {"modes": ["greedy_sft", "beam_search"]}})
    with pytest.raises(ConfigError, match=r"eval mode best_of_n \(blind\) needs a PRM trained on 'candidate'"):
        load_config(overrides={"prm": {"input": "candidate_with_reply"}, "eval": {"modes": ["best_of_n"]}})
    lookahead = load_config(overrides={"prm": {"input": "candidate_with_reply"},
                                       "eval": {"modes": ["best_of_n_lookahead", "best_of_n_rule", "beam_search",
                                                          "beam_search_rule", "random_of_n", "best_of_n_logprob"]}})
    assert lookahead["prm"]["input"] == "candidate_with_reply"
    assert load_config()["prm"]["input"] == "candidate"   # blind is the default


def test_a_search_over_one_candidate_fails_at_parse_time():
    """eval.n 1 with best_of_n and random_of_n was accepted: a search over one candidate is its own control."""
    with pytest.raises(ConfigError, match=r"config key 'eval.n': 1 candidate per turn, so random_of_n, best_of_n "
                                          r"choose among one"):
        load_config(overrides={"eval": {"n": 1, "modes": ["greedy_sft", "random_of_n", "best_of_n"]}})
    assert load_config(overrides={"eval": {"n": 1, "modes": ["greedy_sft"]}})["eval"]["n"] == 1   # no search


@pytest.mark.parametrize("overrides, message", [
    ({"labels": {"k": 99999999999999999999999}}, r"'labels.k': 99999999999999999999999 is above 1024, more than any "
                                                 r"run can mean \(continuations per candidate"),
    ({"labels": {"shards": 100000}}, r"'labels.shards': 100000 is above 1024"),
    ({"eval": {"n": 10**6}}, r"'eval.n': 1000000 is above 256"),
    ({"games": {"max_instances": {"train": 10**9}}}, r"'games.max_instances.train': 1000000000 is above 1000000, "
                                                    r"more instances than any game holds; null takes every instance"),
], ids=["k", "shards", "n", "instances"])
def test_sizes_no_run_can_mean_fail_at_parse_time_saying_why(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)
    assert load_config(overrides={"labels": {"k": 1024, "shards": 1024}})["labels"]["k"] == 1024   # the bound itself


def test_the_old_rl_algorithm_key_fails_naming_its_replacement():
    with pytest.raises(ConfigError, match=r"'rl.algorithm' was replaced by rl.algorithms, a list"):
        load_config(overrides={"rl": {"algorithm": "prime"}})


@pytest.mark.parametrize("mode, algorithms", [("greedy_rl_prime", ["grpo"]), ("greedy_rl_grpo", ["prime"]),
                                              ("best_of_n_implicit", ["grpo"]), ("greedy_rl_grpo", [])])
def test_an_rl_eval_mode_needs_its_algorithm_trained(mode, algorithms):
    with pytest.raises(ConfigError, match=f"'eval.modes': {mode} plays the .* 'rl.algorithms'"):
        load_config(overrides={"rl": {"algorithms": algorithms}, "eval": {"modes": ["greedy_sft", mode]}})
    load_config(overrides={"rl": {"algorithms": algorithms}, "eval": {"modes": ["greedy_sft"]}})


def test_a_config_that_lowers_k_alone_is_valid_under_the_default_k_first():
    """The default's k_first 2 with a user's labels.k 2 (or less) is one round of K, not a parse-time error."""
    assert load_config()["labels"]["k_first"] == 2
    assert load_config(overrides={"labels": {"k": 2}})["labels"]["k"] == 2
    assert load_config(overrides={"labels": {"k": 1}})["labels"]["k_first"] == 2


def test_rl_params_hold_one_algorithm_and_prime_keys_only_for_prime():
    config = load_config()
    grpo, prime = rl_params(config, "grpo"), rl_params(config, "prime")
    assert set(grpo) == {"seed", "model", "games", "rl"} and grpo["rl"]["algorithm"] == "grpo"
    assert "algorithms" not in grpo["rl"] and "prime" not in grpo["rl"]
    assert prime["rl"]["prime"] == config["rl"]["prime"]
    changed = load_config(overrides={"rl": {"prime": {"lr": 1e-3}, "algorithms": ["prime", "grpo"]}})
    assert rl_params(changed, "grpo") == grpo and rl_params(changed, "prime") != prime


def test_documented_snakemake_commands_name_no_target_after_configfile():
    """snakemake's ``--configfile`` takes every following word as a config file, so a target written after it fails
    with "No such file" for the target: every command in the README, the pages of docs/ and the config files puts
    targets before it or ends the file list with ``--``."""
    import re
    import shlex
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    documents = [repo / "README.md", *sorted((repo / "docs").glob("*.md")), *sorted((repo / "configs").glob("*.yaml"))]
    commands = [(path.name, match.group(0)) for path in documents
                for match in re.finditer(r"snakemake [^\n`#(]*--configfile[^\n`#(]*", path.read_text())]
    assert len(commands) >= 4
    for name, command in commands:
        words = shlex.split(command)
        files = words[words.index("--configfile") + 1:]
        files = files[:next((i for i, word in enumerate(files) if word.startswith("-")), len(files))]
        assert files and all(word.endswith((".yaml", ".yml", ".json")) for word in files), (name, command)


# ------------------------------------------------------- issue 57: config rows that failed late, now named at parse


def test_a_number_written_without_a_dot_is_taken_as_the_number_it_spells(tmp_path):
    """YAML 1.1 (PyYAML, Snakemake) reads `1e-4` as text: `sft.lr: '1e-4' is not of type 'number'`. Every number key
    takes such text as its number (inside oneOf too); text that spells no number is still refused."""
    (tmp_path / "user.yaml").write_text("sft:\n  lr: 1e-4\nrl:\n  prime:\n    accuracy_filter: [1e-1, 9E-1]\n")
    config = load_config(tmp_path / "user.yaml")
    assert config["sft"]["lr"] == 1e-4 and config["rl"]["prime"]["accuracy_filter"] == [0.1, 0.9]
    with pytest.raises(ConfigError, match=re.escape("config key 'sft.lr': 'fast' is not of type 'number'")):
        load_config(overrides={"sft": {"lr": "fast"}})
    with pytest.raises(ConfigError, match=re.escape("config key 'labels.k': '8' is not of type 'integer'")):
        load_config(overrides={"labels": {"k": "8"}})   # integer keys: a whole number has no exponent to hide


def test_a_config_file_setting_no_config_key_is_named_as_perhaps_a_target(tmp_path):
    (tmp_path / "metrics.json").write_text('{"baselines": {}, "seed": 3}')
    with pytest.raises(ConfigError, match=re.escape(
            f"config file {tmp_path / 'metrics.json'}: baselines is no config key (allowed: base_rollouts,")):
        load_config(tmp_path / "metrics.json")


@pytest.mark.parametrize("rl, message", [
    ({"algorithms": ["prime"], "reward": {"source": "turn_scores"}},
     "config key 'rl.reward.source': turn_scores rewards single turns, which grpo trains on; prime's implicit PRM "
     "learns from an episode's success"),
    ({"algorithms": ["grpo"], "data": "states"},
     "config key 'rl.data': states trains single turns, which needs a per-turn rl.reward.source (turn_scores), not "
     "success_played"),
    ({"algorithms": ["grpo"], "data": "states", "reward": {"source": "turn_scores"}},
     "config key 'rl.data': states trains on hanabi's rule-based self-play, but games.builtin (guessnumber, wordref"),
], ids=["prime_turn_scores", "states_episode_reward", "states_without_hanabi"])
def test_rl_settings_the_rl_job_refuses_are_refused_at_parse_time(rl, message):
    """Each passed parse time and failed inside rl_adapter, after SFT (and the states' self-play)."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(overrides={"rl": rl})
    load_config(overrides={"rl": {**rl, "algorithms": []}})   # no RL trained: the settings are not used


def test_acceptance_examples_that_fit_one_batch_are_accepted():
    """They train beside the soft labels in one schedule whose first step is not at lr 0 (it was refused while they
    were a separate epoch of one step at learning rate 0)."""
    load_config(overrides={"prm": {"acceptance_examples": 4}})


def test_a_gate_that_stops_the_run_needs_a_held_out_set():
    """With no held-out set the gate was "not measured" (an INFO line) and a `stop` gate let the run go on."""
    none = {"branch_points": {"validation_instances": 0}, "prm": {"validation_fraction": 0.0}}
    for gate, on_failure in (("stop", "continue"), ("inherit", "stop")):
        with pytest.raises(ConfigError, match=re.escape(
                "config key 'prm.gate.on_failure': the gate stops the run when the PRM fails it, but there is no "
                "held-out set")):
            load_config(overrides={**none, "on_failure": on_failure,
                                   "prm": {**none["prm"], "gate": {"on_failure": gate}}})
    load_config(overrides={**none, "prm": {**none["prm"], "gate": {"on_failure": "continue"}}})
    load_config(overrides={"prm": {"gate": {"on_failure": "stop"}}})

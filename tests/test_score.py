"""SCoRe on the RL trainer (tiny model, CPU): the attempt builder on a real game, the stage objectives' gradients, the
shaping formula, real learning at attempt 2 on a forced game, the stage's outputs, and eval mode self_correct's metrics
recomputed from its parquet."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from clemprm import records
from clemprm.evaluation import evaluate
from clemprm.play.catalog import GameCatalog
from clemprm.config import eval_mode_params
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.rl import policy_adapter, policy_update, score
from clemprm.checks.game_inputs import check_single_player_games, single_player_problems
from clemprm.checks.parse_time import ConfigInputError, check_config_inputs
from clemprm.rl.attempts import start_second_attempt
from clemprm.rl.logprobs import answer_logprobs, reference_logprobs, using_adapter
from clemprm.rl.rollouts import Group, Sequence, Turn
from clemprm.evaluation.self_correct import METRICS, evaluate_self_correct, self_correction_summary
from tests.conftest import binary_search_answer, tiny_config, train_tiny_sft
from tests.test_rl import FORCED, random_adapter, tokens

INSTRUCTION = "Correct your mistakes, if any."


def score_settings(**score_overrides) -> dict:
    config = tiny_config(score={"instruction": INSTRUCTION, **score_overrides})
    return {name: config[name] for name in ("seed", "model", "games", "score")}


def play(engine: RolloutEngine, policy, instance=FORCED, episode_id="forced/0", seed=7) -> dict:
    episode = engine.start(instance, [policy], episode_id, seed)
    engine.run([episode])
    return episode.record(policy.name, engine.sampling)


# ------------------------------------------------------------------------------------------- rewards, config


def test_success_binary_is_normalised_and_the_shaping_formula():
    assert score.success_binary({"success": True, "aborted": False}) == 1.0
    assert score.success_binary({"success": False, "aborted": False}) == 0.5
    assert score.success_binary({"success": False, "aborted": True}) == 0.0
    assert score.shaped_reward(0.5, 1.0, 10.0) == pytest.approx(1.0 + 10 * 0.5)    # corrected: a large bonus
    assert score.shaped_reward(1.0, 0.5, 10.0) == pytest.approx(0.5 - 10 * 0.5)    # broke a right answer: punished
    assert score.shaped_reward(0.5, 0.5, 10.0) == 0.5                              # no change: r2 alone
    stage2 = score.ScoreStage(2, alpha=10.0, beta1=0.01, beta2=0.1)
    assert stage2.weights(0.0, 1.0) == (0.0, 0.01, pytest.approx(11.0), 0.01)
    assert score.ScoreStage(1, alpha=10.0, beta1=0.01, beta2=0.1).weights(0.0, 1.0) == (0.0, 0.1, 1.0, 0.0)


def test_two_player_games_are_rejected_naming_the_key():
    config = tiny_config(score={"games": ["guessnumber", "wordref"]})
    problems = single_player_problems(config)
    assert len(problems) == 1 and "'score.games'" in problems[0] and "'wordref'" in problems[0]
    assert "players: 2" in problems[0]
    with pytest.raises(ConfigInputError, match="config key 'score.games': 'wordref' is not a single-player game"):
        check_config_inputs(config)   # at parse time; eval mode self_correct does not check it again
    with pytest.raises(ValueError, match="score.games"):
        check_single_player_games(config)   # SCoRe's stage, which a run may make alone
    # a game that is not configured is an error only where SCoRe is part of the run
    elsewhere = tiny_config(games={"builtin": ["wordref"]})
    assert single_player_problems(elsewhere, in_use=False) == []
    assert "not a configured game" in single_player_problems(elsewhere)[0]


def test_a_two_player_score_game_stops_the_workflow_at_parse_time(tmp_path, test_cache_dir):
    import yaml

    from tests.test_workflow import prepare_workdir, snakemake

    workdir = prepare_workdir(tmp_path, test_cache_dir)
    config = yaml.safe_load((workdir / "tiny.yaml").read_text())
    config["score"] = {"games": ["oddoneout", "wordref"]}
    (workdir / "bad.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(workdir, "-n", check=False, configfile=workdir / "bad.yaml")
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "config key 'score.games': 'wordref' is not a single-player game" in output
    assert "oddoneout" not in output.split("score.games")[-1].split("\n")[0]   # oddoneout has one player


# ------------------------------------------------------------------------------------------- the attempt builder


def test_attempt_two_starts_with_attempt_ones_transcript_and_outcome(scripted_policy):
    """guessnumber, a train instance: attempt 1 guesses a wrong number, then breaks the format twice (abort);
    attempt 2's first prompt holds each answer, the game's reply to it, the outcome and the instruction, then the
    game's own first prompt; attempt 2 then plays normally (here: binary search wins)."""
    catalog = GameCatalog({**tiny_config()["games"], "builtin": ["guessnumber"]})
    instance = catalog.all_instances("train")[0]
    engine = RolloutEngine(catalog, Sampling())
    wrong = 1 if instance.instance["target"] != 1 else 2
    answers = iter([f"GUESS: {wrong}", "no idea", "still none"])
    first = play(engine, scripted_policy(lambda messages: next(answers)), instance)
    assert first["aborted"] and first["n_turns"] == 3
    second = start_second_attempt(engine, instance, [scripted_policy(binary_search_answer)], first,
                                  "guessnumber/attempt2", 11, INSTRUCTION)
    assert second.seed == 11 and second.context_prefix
    prompt = RolloutEngine.waiting(second)[1]
    text = prompt[0]["content"]
    game_prompt = first["turns"][0]["messages"][0]["content"]
    assert text.endswith(game_prompt) and text.index(INSTRUCTION) < text.index(game_prompt)
    positions = [text.index(f"Your answer: {turn['response']}") for turn in first["turns"]]
    assert positions == sorted(positions)
    feedback = first["turns"][1]["messages"][-1]["content"]   # the game's reply to the wrong guess
    reprompt = first["turns"][2]["messages"][-1]["content"]   # ... and to the first broken answer
    assert re.search(rf"(higher|lower) than {wrong}\.", feedback) and positions[0] < text.index(feedback) < positions[1]
    assert positions[1] < text.index(reprompt) < positions[2]
    assert "Outcome of that attempt: aborted" in text and text.index("Outcome") > positions[2]
    engine.run([second])
    record = second.record("binary search", Sampling())
    assert record["success"] and not record["aborted"]
    assert all(turn["messages"][0]["content"] == text for turn in record["turns"])   # as the model got it
    # a won or lost attempt 1 is named so, with its score
    assert "you lost (score 0 of 100)" in score_prefix_of(engine, scripted_policy(lambda m: "GUESS: 2"))
    assert "you won (score 100 of 100)" in score_prefix_of(engine, scripted_policy(lambda m: "GUESS: 1"))


def score_prefix_of(engine, policy) -> str:
    first = play(engine, policy)
    return start_second_attempt(engine, FORCED, [policy], first, "forced/attempt2", 3, INSTRUCTION).context_prefix


# ------------------------------------------------------------------------------------------- the objective


@pytest.fixture(scope="module")
def training_model(tmp_path_factory, test_cache_dir):
    adapter = random_adapter(tmp_path_factory.mktemp("score-adapter") / "a", 5, test_cache_dir)
    _, tokenizer, model = policy_adapter.load_training_model({"spec": "tiny:0", "threads": 1}, adapter, test_cache_dir,
                                                             implicit_prm=False)
    model.eval()   # no dropout: the manual and the trainer's passes see the same function
    return tokenizer, model


def two_attempts(tokenizer, r1: float, r2: float) -> score.TwoAttempts:
    """One episode pair: y1 of two turns, y2 of one turn, with the given (normalised) rewards."""
    def sequence(episode_id, reward, answers):
        turns = [Turn(tokens(tokenizer, f"Guess a number. {i}"), tokens(tokenizer, f"{answer}<|im_end|>"))
                 for i, answer in enumerate(answers)]
        return Sequence(episode_id, "Player 1", turns, reward=reward)

    first = Group(FORCED, [{"episode_id": "e"}], [sequence("e", r1, ["GUESS: 2", "GUESS: 5"])])
    second = Group(FORCED, [{"episode_id": "e/attempt2"}], [sequence("e/attempt2", r2, ["GUESS: 1"])])
    return score.TwoAttempts.of(first, second)


def policy_gradients(model, groups, stage: score.ScoreStage) -> tuple[list[torch.Tensor], float]:
    stage.assign(None, groups)
    turns = [turn for group in groups for sequence in group.sequences for turn in sequence.turns]
    normaliser = policy_update.step_normaliser(turns, "constant", 24)
    params = policy_adapter.adapter_parameters(model, policy_adapter.POLICY_ADAPTER)
    for param in params:
        param.grad = None
    policy_update.accumulate_policy_gradients(model, turns, kl_beta=0.0, normaliser=normaliser)
    return [param.grad.clone() if param.grad is not None else torch.zeros_like(param) for param in params], normaliser


def manual_gradients(model, terms, normaliser) -> list[torch.Tensor]:
    """Gradients of ``sum(-advantage * logp(turn) + kl_weight * K3(turn)) / normaliser`` over ``terms``."""
    params = policy_adapter.adapter_parameters(model, policy_adapter.POLICY_ADAPTER)
    for param in params:
        param.grad = None
    total = 0
    with using_adapter(model, policy_adapter.POLICY_ADAPTER):
        for turn, advantage, kl_weight in terms:
            logp = answer_logprobs(model, turn.prompt_ids, turn.completion_ids)
            d = reference_logprobs(model, turn.prompt_ids, turn.completion_ids) - logp
            total = total + (-advantage * logp.sum() + kl_weight * (torch.exp(d) - d - 1).sum()) / normaliser
    total.backward()
    return [param.grad.clone() for param in params]


def test_stage_one_gradient_comes_only_from_y2s_logprobs_and_y1s_kl(training_model):
    tokenizer, model = training_model
    stage1 = score.ScoreStage(1, alpha=10.0, beta1=0.01, beta2=0.1)
    groups = [two_attempts(tokenizer, r1=0.5, r2=1.0)]
    got, normaliser = policy_gradients(model, groups, stage1)
    (y1,), (y2,) = groups[0].first.sequences, groups[0].second.sequences
    weighted_turns = [(turn, 0.0, 0.1) for turn in y1.turns] + [(turn, 1.0, 0.0) for turn in y2.turns]
    expected = manual_gradients(model, weighted_turns, normaliser)
    assert any(g.abs().max() > 0 for g in got)
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)
    # y1's reward plays no part in stage I; without y1's KL only y2's log-prob term is left
    other_r1, _ = policy_gradients(model, [two_attempts(tokenizer, r1=0.0, r2=1.0)], stage1)
    assert all(torch.allclose(a, b, atol=1e-7) for a, b in zip(got, other_r1))
    no_kl, _ = policy_gradients(model, [two_attempts(tokenizer, r1=0.5, r2=1.0)],
                                score.ScoreStage(1, alpha=10.0, beta1=0.01, beta2=0.0))
    only_y2 = manual_gradients(model, [(turn, 1.0, 0.0) for turn in y2.turns], normaliser)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(no_kl, only_y2))
    # an aborted y2 (r2 = 0) leaves y1's KL as the only gradient
    aborted, _ = policy_gradients(model, [two_attempts(tokenizer, r1=0.5, r2=0.0)], stage1)
    only_kl = manual_gradients(model, [(turn, 0.0, 0.1) for turn in y1.turns], normaliser)
    assert all(torch.allclose(a, b, atol=1e-6, rtol=1e-4) for a, b in zip(aborted, only_kl))


def test_stage_two_gradient_is_both_policy_gradients_with_the_shaped_reward_and_both_kls(training_model):
    tokenizer, model = training_model
    groups = [two_attempts(tokenizer, r1=0.5, r2=1.0)]
    got, normaliser = policy_gradients(model, groups, score.ScoreStage(2, alpha=10.0, beta1=0.01, beta2=0.1))
    (y1,), (y2,) = groups[0].first.sequences, groups[0].second.sequences
    shaped = 1.0 + 10.0 * (1.0 - 0.5)
    assert all(turn.advantages == [shaped] * len(turn.completion_ids) for turn in y2.turns)
    expected = manual_gradients(model, [(turn, 0.5, 0.01) for turn in y1.turns] +
                                [(turn, shaped, 0.01) for turn in y2.turns], normaliser)
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-4)


# ------------------------------------------------------------------------------------------- real learning


@pytest.fixture(scope="module")
def forced_prompts(scripted_policy):
    """The forced game's attempt-1 prompt and its attempt-2 prompts after a win, a loss and an abort."""
    engine = RolloutEngine(GameCatalog(tiny_config()["games"]), Sampling())
    prompts = {"attempt1": RolloutEngine.waiting(engine.start(FORCED, [scripted_policy(str)], "p", 0))[1]}
    for outcome, answer in (("won", "GUESS: 1"), ("lost", "GUESS: 2"), ("aborted", "none")):
        policy = scripted_policy(lambda messages, answer=answer: answer)
        second = start_second_attempt(engine, FORCED, [policy], play(engine, policy), "p/2", 0, INSTRUCTION)
        prompts[outcome] = RolloutEngine.waiting(second)[1]
    return prompts


@pytest.fixture(scope="module")
def half_and_half_sft(tmp_path_factory, forced_prompts, test_cache_dir):
    """An SFT adapter that answers every forced prompt (both attempts) with "GUESS: 1" or "GUESS: 2", half each."""
    folder = tmp_path_factory.mktemp("score-sft")
    rows = [{"messages": prompt + [{"role": "assistant", "content": f"GUESS: {1 + i % 2}"}],
             "meta": {"game": "guessnumber", "experiment": "forced", "task_id": 10 * k + i, "player_name": "Player 1",
                      "game_role": "Guesser", "model": "test", "outcome": "success"}}
            for k, prompt in enumerate(forced_prompts.values()) for i in range(8)]
    return train_tiny_sft(folder, rows, test_cache_dir)


def test_score_steps_raise_success_at_attempt_two_on_a_forced_game(half_and_half_sft, forced_prompts, test_cache_dir):
    settings = score_settings(stage1_steps=3, stage2_steps=1, group_size=8, instances_per_step=2, temperature=1.0,
                              lr=2e-2, warmup_ratio=0.0, max_new_tokens=8)
    cfg, tokenizer, model = policy_adapter.load_training_model(settings["model"], half_and_half_sft, test_cache_dir,
                                                               implicit_prm=False)
    scorer = score.ScoreTrainer(settings, cfg, tokenizer, model, GameCatalog(settings["games"]))
    policy = scorer.trainer.policy
    win, lose = tokens(tokenizer, "GUESS: 1<|im_end|>"), tokens(tokenizer, "GUESS: 2<|im_end|>")

    def win_probability(outcome: str) -> float:
        """P(win) at attempt 2 after attempt 1 ended ``outcome``, of the two answers the SFT policy gives."""
        prompt = tokens(tokenizer, policy.render(forced_prompts[outcome]))
        model.eval()
        with torch.no_grad(), using_adapter(model, policy_adapter.POLICY_ADAPTER):
            odds = float(answer_logprobs(model, prompt, win).sum() - answer_logprobs(model, prompt, lose).sum())
        return 1 / (1 + torch.exp(torch.tensor(-odds)).item())

    before = {outcome: win_probability(outcome) for outcome in ("won", "lost")}
    assert all(0.2 < p < 0.8 for p in before.values()), before   # the SFT policy has no preference yet
    history = [scorer.step([FORCED, FORCED], step, 1 if step < 3 else 2) for step in range(4)]
    after = {outcome: win_probability(outcome) for outcome in ("won", "lost")}
    assert all(after[o] > before[o] + 0.2 for o in before), (before, after, [h["reward_t2"] for h in history])
    assert history[-1]["attempt2"]["success_rate"] > history[0]["attempt2"]["success_rate"]
    assert [h["stage"] for h in history] == [1, 1, 1, 2]
    first = history[0]
    assert first["attempt1"]["episodes"] == first["attempt2"]["episodes"] == 16
    assert first["kl"]["attempt1"] is not None and first["kl"]["attempt1"] >= 0 and first["trained_turns"] > 0
    assert first["advantage"]["attempt1"]["max"] == 0.0   # stage I: no policy gradient on y1
    assert history[-1]["advantage"]["attempt1"]["max"] > 0   # stage II: y1's reward


def test_train_score_writes_the_adapter_and_per_stage_metrics(half_and_half_sft, test_cache_dir, tmp_path):
    from peft import PeftModel

    from clemprm.models.loader import ModelConfig, load_tokenizer_and_model

    settings = score_settings(stage1_steps=1, stage2_steps=1, group_size=2, instances_per_step=1, max_new_tokens=8)
    metrics = score.train_score(settings, half_and_half_sft, str(tmp_path / "score"), str(tmp_path / "metrics.json"),
                                test_cache_dir)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written == metrics and written["status"] == "trained" and written["config"]["score"]["stage1_steps"] == 1
    assert [entry["stage"] for entry in written["history"]] == [1, 2] and set(written["stages"]) == {"1", "2"}
    for entry in written["history"]:
        for key in ("reward_t1", "reward_t2", "reward_difference", "kl", "tokens", "seconds", "transitions"):
            assert key in entry, key
        assert entry["reward_difference"] == pytest.approx(entry["reward_t2"] - entry["reward_t1"])
        assert set(entry["kl"]) == {"attempt1", "attempt2", "trained"}
        assert set(entry["seconds"]) == {"attempt1", "attempt2", "update"}
    assert written["peak_memory_mb"]["rss"] > 0 and "peft" in written["versions"]
    config = json.loads((tmp_path / "score/adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "tiny:0"
    PeftModel.from_pretrained(load_tokenizer_and_model(ModelConfig(spec="tiny:0", cache_dir=test_cache_dir))[1],
                              str(tmp_path / "score"))


# ------------------------------------------------------------------------------------------- eval mode self_correct


def test_self_correct_metrics_recomputed_from_the_parquet(scripted_policy, tmp_path):
    """The SFT stand-in guesses 5 twice per attempt (wins where the target is 5), then at attempt 2 breaks the format
    (abort: right -> wrong); the SCoRe stand-in guesses 1 at attempt 1 and plays binary search at attempt 2 (always
    wins: wrong -> right). The summary's numbers are recomputed here from the parquet alone."""
    def attempt2(messages):
        return "Your previous attempt" in messages[0]["content"]

    policies = {"sft": scripted_policy(lambda m: "nothing" if attempt2(m) else "GUESS: 5", name="sft"),
                "score": scripted_policy(lambda m: binary_search_answer(m) if attempt2(m) else "GUESS: 1",
                                         name="score")}
    config = tiny_config(games={"max_instances": {"validation": 6}}, eval={"episodes_per_instance": 2})
    settings = {**eval_mode_params(config, "self_correct"), "score": config["score"]}
    output = tmp_path / "self_correct.parquet"
    evaluate_self_correct(settings, str(output), sft_adapter=None, score_adapter=None, policies=policies)
    rows = records.read_records(output, records.SELF_CORRECT_EPISODES)
    assert {row["game"] for row in rows} == {"guessnumber"} and len(rows) == 2 * 2 * 6 * 2
    summary = evaluate.summarize_eval({**settings, "eval": config["eval"]}, [str(output)], str(tmp_path / "s.json"))
    jsonschema.validate(summary, evaluate.summary_schema())
    assert summary["modes"] == {} and set(summary["self_correction"]["policies"]) == {"sft", "score"}
    for role in ("sft", "score"):
        mine = [row for row in rows if row["policy_role"] == role]
        pairs = [(a, next(b for b in mine if b["attempt"] == 2 and b["episode_id"] == a["episode_id"]))
                 for a in mine if a["attempt"] == 1]
        n = len(pairs)

        def share(test):
            return 100 * sum(test(a, b) for a, b in pairs) / n

        def quality(t):
            played = [pair[t]["bench_score"] for pair in pairs if not pair[t]["aborted"]]
            return sum(played) / len(played) if played else None

        expected = {"accuracy_t1": share(lambda a, b: a["success"]), "accuracy_t2": share(lambda a, b: b["success"]),
                    "delta_i_to_c": share(lambda a, b: not a["success"] and b["success"]),
                    "delta_c_to_i": share(lambda a, b: a["success"] and not b["success"]),
                    "percent_played_t1": share(lambda a, b: not a["aborted"]),
                    "percent_played_t2": share(lambda a, b: not b["aborted"]),
                    "quality_t1": quality(0), "quality_t2": quality(1)}
        expected["delta_t1_t2"] = expected["accuracy_t2"] - expected["accuracy_t1"]
        overall = summary["self_correction"]["policies"][role]["results"]["overall"]
        assert overall["episodes"] == n == 12 and overall["instances"] == 6
        for metric in METRICS:
            got = overall[metric]
            if expected[metric] is None:
                assert got["value"] is None
                continue
            assert got["value"] == pytest.approx(expected[metric]), (role, metric)
            assert got["ci_low"] <= got["value"] + 1e-9 and got["value"] <= got["ci_high"] + 1e-9
    score_overall = summary["self_correction"]["policies"]["score"]["results"]["overall"]
    sft_overall = summary["self_correction"]["policies"]["sft"]["results"]["overall"]
    assert score_overall["accuracy_t2"]["value"] == 100.0 and score_overall["delta_c_to_i"]["value"] == 0.0
    assert sft_overall["percent_played_t2"]["value"] == 0.0
    difference = summary["self_correction"]["difference"]["score_minus_sft"]["overall"]
    assert difference["accuracy_t2"]["value"] == pytest.approx(100.0 - sft_overall["accuracy_t2"]["value"])
    # attempt 1 is the episode every eval mode plays (same ids and seeds)
    assert {row["seed"] for row in rows if row["attempt"] == 1 and row["policy_role"] == "sft"} == \
        {row["seed"] for row in rows if row["attempt"] == 1 and row["policy_role"] == "score"}
    assert self_correction_summary(rows, 50, 1, 0.9)["policies"]["sft"]["results"]["overall"]["episodes"] == 12

"""The RL trainer on the tiny model (CPU): advantages, the implicit PRM, log-probabilities with adapters on and off,
per-turn backward, and real learning on a forced game (a guessnumber instance that only "1" wins)."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from clemprm import records
from clemprm.evaluation import evaluate
from clemprm.play.catalog import GameCatalog, Instance
from clemprm.config import eval_mode_params, rl_params
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.models.loader import ModelConfig, load_tokenizer_and_model
from clemprm.rl import grpo, policy_adapter, policy_update, prime, trainer
from clemprm.evaluation.implicit_scorer import load_implicit_prm
from clemprm.rl.logprobs import answer_logprobs, reference_logprobs, using_adapter
from clemprm.models.scoring import selective_log_softmax
from clemprm.rl.rollouts import Group, Sequence, Turn
from clemprm.play.contract import Pair
from tests.conftest import tiny_config, train_tiny_sft

# Only the answer 1 wins: one guess of a number from 1 to 2; "2" loses; anything else is a violation (abort).
FORCED = Instance("guessnumber", "train", {"name": "forced", "parse_mode": "lenient", "max_number": 2,
                                           "max_guesses": 1}, {"game_id": 0, "target": 1})


def rl_settings(algorithm: str = "grpo", **rl) -> dict:
    """The settings of one algorithm's ``rl_adapter`` job (its params) on the tiny config."""
    return rl_params(tiny_config(rl=rl), algorithm)


def random_adapter(path, seed: int, test_cache_dir: str, dropout: float = 0.0) -> str:
    """A LoRA with random A and B (so it changes the model) saved at ``path``."""
    from peft import LoraConfig, get_peft_model

    _, model = load_tokenizer_and_model(ModelConfig(spec="tiny:0", cache_dir=test_cache_dir))
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear",
                                                  init_lora_weights=False))
    peft_model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, test_cache_dir):
    folder = tmp_path_factory.mktemp("adapters")
    return [random_adapter(folder / f"a{seed}", seed, test_cache_dir) for seed in (1, 2)]


@pytest.fixture(scope="module")
def forced_prompt(scripted_policy):
    """The forced game's first perspective (what the policy sees), from the game through the engine."""
    catalog = GameCatalog(tiny_config()["games"])
    episode = RolloutEngine(catalog, Sampling()).start(FORCED, [scripted_policy(lambda m: "GUESS: 1")], "forced/0", 0)
    return RolloutEngine.waiting(episode)[1]


def tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------- advantages


def test_outcome_advantage_is_the_group_z_score_and_zero_for_equal_rewards():
    assert grpo.outcome_advantages([1.0, 1.0, 1.0, 1.0]) == [0.0] * 4
    advantages = grpo.outcome_advantages([2.0, 0.0, 1.0, 1.0])
    assert advantages == pytest.approx([2 ** 0.5, -(2 ** 0.5), 0.0, 0.0])
    # every turn of an episode (both players in self-play) gets the episode's advantage
    rows = [{"episode_id": f"e{i}"} for i in range(3)]
    sequences = [Sequence(f"e{i}", player, [Turn([1], [2, 3]), Turn([1], [4])], reward=1.0)
                 for i in range(3) for player in ("Player 1", "Player 2")]
    group = Group(FORCED, rows, sequences)
    stats = grpo.GRPO().assign(None, [group])
    assert stats["zero_advantage_groups"] == 1
    assert all(turn.advantages == [0.0] * len(turn.completion_ids) and not turn.trained
               for sequence in sequences for turn in sequence.turns)
    sequences[0].reward = sequences[1].reward = 2.0   # episode e0 won (both of its players' sequences)
    grpo.GRPO().assign(None, [group])
    expected = grpo.outcome_advantages([2.0, 1.0, 1.0])
    for sequence in sequences:
        index = int(sequence.episode_id[1])
        assert all(turn.advantages == [expected[index]] * len(turn.completion_ids) for turn in sequence.turns)


def _process_group(token_rewards_per_sequence: list[list[list[float]]]):
    """One group whose sequence i has turns with the given token rewards; returns (group, rewards by turn id)."""
    rows, sequences, rewards = [], [], {}
    for i, turns in enumerate(token_rewards_per_sequence):
        rows.append({"episode_id": f"e{i}"})
        sequence = Sequence(f"e{i}", "Player 1")
        for values in turns:
            turn = Turn([1], list(range(len(values))))
            sequence.turns.append(turn)
            rewards[id(turn)] = torch.tensor(values)
        sequences.append(sequence)
    return Group(FORCED, rows, sequences), rewards


def test_process_advantages_follow_the_normalised_leave_one_out_returns():
    group, rewards = _process_group([[[0.2, -0.1], [0.3]], [[0.0, 0.1, 0.0]], [[-0.2], [0.1, 0.1]]])
    advantages, stats = prime.process_advantages([group], rewards, std_threshold=0.01)
    flat = [torch.cat([rewards[id(t)] for t in s.turns]) for s in group.sequences]
    largest = max(float(prime.reverse_cumsum(r).abs().max()) for r in flat)
    assert stats["largest_return"] == pytest.approx(largest)
    normalised = [r / (largest + prime.NORM_EPSILON) for r in flat]
    n = 3
    baseline = sum(float(r.mean()) for r in normalised) / (n - 1)
    for sequence, r in zip(group.sequences, normalised):
        expected = [sum(float(x) for x in (r * n / (n - 1) - baseline)[t:]) for t in range(len(r))]
        got = [a for turn in sequence.turns for a in advantages[id(turn)]]
        assert got == pytest.approx(expected, abs=1e-6)
    assert stats["zeroed_cohorts"] == 0


def test_process_advantages_are_zero_below_the_std_threshold():
    # sequence returns (raw: the threshold is absolute, not relative to the batch's largest) 0.300, 0.302, 0.301:
    # std ~ 0.0008 < 0.01
    group, rewards = _process_group([[[0.1, 0.2]], [[0.151, 0.151]], [[0.3, 0.001]]])
    advantages, stats = prime.process_advantages([group], rewards, std_threshold=0.01)
    assert stats["zeroed_cohorts"] == 1
    assert all(value == 0.0 for values in advantages.values() for value in values)
    advantages, stats = prime.process_advantages([group], rewards, std_threshold=1e-4)
    assert stats["zeroed_cohorts"] == 0 and any(value != 0.0 for values in advantages.values() for value in values)



def test_the_std_threshold_is_absolute_so_a_prm_at_chance_gives_no_process_advantages():
    # returns -1e-4, 3e-4, -1e-4: as a share of the largest they spread widely (std 0.6), as logits they are noise
    group, rewards = _process_group([[[1e-4, -2e-4]], [[3e-4]], [[-1e-4]]])
    advantages, stats = prime.process_advantages([group], rewards, std_threshold=0.01)
    assert stats["zeroed_cohorts"] == 1
    assert all(value == 0.0 for values in advantages.values() for value in values)

# -------------------------------------------------------------------------------------------- log-probs


def test_selective_log_softmax_equals_log_softmax_gather():
    logits = torch.randn(5, 11, generator=torch.Generator().manual_seed(0))
    index = torch.tensor([0, 3, 10, 2, 2])
    expected = torch.log_softmax(logits, -1).gather(-1, index.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(selective_log_softmax(logits, index), expected, atol=1e-6)


def test_adapter_disabled_logprobs_equal_the_base_models(adapters, test_cache_dir):
    tokenizer, base = load_tokenizer_and_model(ModelConfig(spec="tiny:0", cache_dir=test_cache_dir))
    _, _, model = policy_adapter.load_training_model({"spec": "tiny:0", "threads": 1}, adapters[0], test_cache_dir,
                                                     implicit_prm=False)
    prompt, answer = tokens(tokenizer, "Guess a number from 1 to 10."), tokens(tokenizer, "GUESS: 7<|im_end|>")
    with torch.no_grad():
        expected = torch.log_softmax(base(input_ids=torch.tensor([prompt + answer])).logits[0].float(), -1)
    expected = expected[len(prompt) - 1:-1].gather(-1, torch.tensor(answer).unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(reference_logprobs(model, prompt, answer), expected, atol=1e-5)
    model.eval()
    with torch.no_grad():
        adapted = answer_logprobs(model, prompt, answer)
    assert (adapted - expected).abs().max() > 1e-2   # the adapter does change the model


def test_token_rewards_equal_beta_times_the_log_ratio_of_two_separate_models(adapters, test_cache_dir):
    """The implicit PRM's adapter (adapters[1]) and its reference (adapters[0]) on one base, against two models."""
    from peft import PeftModel

    _, _, model = policy_adapter.load_training_model({"spec": "tiny:0", "threads": 1}, adapters[0], test_cache_dir,
                                                     implicit_prm=True)
    model.load_adapter(adapters[1], adapter_name="phi", is_trainable=True)
    implicit = prime.ImplicitPRM(model, beta=0.05, adapter="phi", reference=prime.REFERENCE_ADAPTER)
    model.eval()
    tokenizer = load_tokenizer_and_model(ModelConfig(spec="tiny:0", cache_dir=test_cache_dir))[0]
    turn = Turn(tokens(tokenizer, "Which word does not belong?"), tokens(tokenizer, "ANSWER: table<|im_end|>"))

    def separate(adapter):
        _, base = load_tokenizer_and_model(ModelConfig(spec="tiny:0", cache_dir=test_cache_dir))
        peft_model = PeftModel.from_pretrained(base, adapter).eval()
        with torch.no_grad():
            logits = peft_model(input_ids=torch.tensor([turn.prompt_ids + turn.completion_ids])).logits[0]
        positions = logits[len(turn.prompt_ids) - 1:-1].float()
        return torch.log_softmax(positions, -1).gather(-1, torch.tensor(turn.completion_ids).unsqueeze(-1)).squeeze(-1)

    expected = 0.05 * (separate(adapters[1]) - separate(adapters[0]))
    with torch.no_grad():
        rewards = implicit.beta * implicit.log_ratios(turn)
    assert expected.abs().max() > 1e-3 and torch.allclose(rewards, expected, atol=1e-5)
    assert implicit.score(turn) == pytest.approx(float(expected.sum()), abs=1e-5)


def test_implicit_prm_equals_its_reference_at_the_start_even_in_train_mode(tmp_path, test_cache_dir):
    """The implicit PRM starts as the SFT adapter, like its reference: its token rewards are exactly 0 then, also
    when the SFT adapter has LoRA dropout and the model is in train mode (dropout would make them noise)."""
    sft_adapter = random_adapter(tmp_path / "sft", 3, test_cache_dir, dropout=0.5)
    _, tokenizer, model = policy_adapter.load_training_model({"spec": "tiny:0", "threads": 1}, sft_adapter,
                                                             test_cache_dir, implicit_prm=True)
    model.train()
    implicit = prime.ImplicitPRM(model, beta=0.05)
    turn = Turn(tokens(tokenizer, "Guess a number from 1 to 2."), tokens(tokenizer, "GUESS: 1<|im_end|>"))
    with torch.no_grad():
        assert torch.equal(implicit.log_ratios(turn), torch.zeros(len(turn.completion_ids)))


def test_the_implicit_prm_scorers_reference_adapter_is_loaded_by_the_model_loader(adapters, tmp_path,
                                                                                  test_cache_dir):
    """The SFT adapter loaded beside the implicit PRM (its reference) is checked as the loader checks an adapter: a
    missing folder and a truncated weights file are named."""
    import re

    from clemprm.models.loader import WeightsFileError

    shutil.copytree(adapters[1], tmp_path / "rl" / "prm")
    reference = shutil.copytree(adapters[0], tmp_path / "sft")
    weights = reference / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(WeightsFileError, match=re.escape(f"adapter {reference}: cannot read {weights}: ")):
        load_implicit_prm({"spec": "tiny:0", "threads": 1}, str(tmp_path / "rl"), str(reference), beta=0.05,
                          cache_dir=test_cache_dir)
    with pytest.raises(FileNotFoundError, match="adapter folder .*gone' does not exist"):
        load_implicit_prm({"spec": "tiny:0", "threads": 1}, str(tmp_path / "rl"), str(tmp_path / "gone"), beta=0.05,
                          cache_dir=test_cache_dir)


def test_implicit_prm_bce_falls_on_a_separable_toy_set(adapters, test_cache_dir):
    _, tokenizer, model = policy_adapter.load_training_model({"spec": "tiny:0", "threads": 1}, adapters[0],
                                                             test_cache_dir, implicit_prm=True)
    model.train()
    implicit = prime.ImplicitPRM(model, beta=0.5)
    prompt = tokens(tokenizer, "Guess a number from 1 to 2.")
    sequences = [Sequence(f"e{i}", "Player 1", [Turn(prompt, tokens(tokenizer, f"GUESS: {answer}<|im_end|>"))],
                          success=answer == 1) for i, answer in enumerate([1, 2, 1, 2])]
    optimizer = torch.optim.AdamW(implicit.parameters(), lr=3e-2)
    losses = []
    for _ in range(6):
        stats, _ = implicit.accumulate_gradients(sequences)
        losses.append(stats["bce"])
        optimizer.step()
        optimizer.zero_grad()
    assert losses[0] == pytest.approx(math.log(2), abs=1e-6)   # PRM == reference at the start: sigmoid(0)
    assert losses[-1] < 0.5 * losses[0]
    assert stats["accuracy"] == 1.0


def test_prime_skips_groups_outside_the_accuracy_filter(adapters, test_cache_dir):
    """Groups won by 0 of 4, 2 of 4 and 4 of 4 episodes: with [0.2, 0.8] only the second one updates the implicit PRM
    and gets advantages (the others' turns are out of the step); off (null), all three; all filtered, nothing moves."""
    _, tokenizer, model = policy_adapter.load_training_model({"spec": "tiny:0", "threads": 1}, adapters[0],
                                                             test_cache_dir, implicit_prm=True)
    model.train()
    prompt = tokens(tokenizer, "Guess a number from 1 to 2.")

    def groups() -> list[Group]:
        made = []
        for wins in (0, 2, 4):
            rows = [{"episode_id": f"w{wins}/{i}", "success": i < wins} for i in range(4)]
            sequences = [Sequence(row["episode_id"], "Player 1",
                                  [Turn(prompt, tokens(tokenizer, f"GUESS: {1 + i % 2}<|im_end|>"))],
                                  reward=float(row["success"]), success=row["success"])
                         for i, row in enumerate(rows)]
            made.append(Group(FORCED, rows, sequences))
        return made

    def run(accuracy_filter, made):
        implicit = prime.ImplicitPRM(model, beta=0.5)
        optimizer = torch.optim.AdamW(implicit.parameters(), lr=1e-2)
        objective = prime.PRIME(implicit, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0),
                                std_threshold=0.01, max_grad_norm=1.0, accuracy_filter=accuracy_filter)
        before = [param.detach().clone() for param in implicit.parameters()]
        stats = objective.assign(None, made)
        moved = any(not torch.equal(a, param) for a, param in zip(before, implicit.parameters()))
        return stats, moved

    made = groups()
    stats, moved = run([0.2, 0.8], made)
    assert stats["filtered_groups"] == 2 and stats["group_accuracy"] == [0.0, 0.5, 1.0]
    assert stats["implicit_prm"]["sequences"] == 4 and moved
    trained = [[turn.advantages is not None for s in group.sequences for turn in s.turns] for group in made]
    assert trained == [[False] * 4, [True] * 4, [False] * 4]
    assert any(turn.trained for s in made[1].sequences for turn in s.turns)
    stats, _ = run(None, made := groups())
    assert stats["filtered_groups"] == 0 and stats["implicit_prm"]["sequences"] == 12
    assert all(turn.advantages is not None for group in made for s in group.sequences for turn in s.turns)
    stats, moved = run([0.6, 0.7], made := groups())
    assert stats["filtered_groups"] == 3 and stats["implicit_prm"]["bce"] is None and not moved
    assert all(turn.advantages is None for group in made for s in group.sequences for turn in s.turns)
    with pytest.raises(ValueError, match="rl.prime.accuracy_filter"):
        run([0.8, 0.2], groups())


def test_per_turn_backward_gives_the_gradients_of_one_combined_backward(adapters, test_cache_dir):
    _, tokenizer, model = policy_adapter.load_training_model({"spec": "tiny:0", "threads": 1}, adapters[0],
                                                             test_cache_dir, implicit_prm=False)
    model.eval()   # no dropout: both passes see the same function
    turns = []
    for prompt, answer, advantage in [("Guess a number.", "GUESS: 5<|im_end|>", 0.5),
                                      ("Which word?", "ANSWER: table<|im_end|>", -1.0),
                                      ("Hello!", "Hi<|im_end|>", 0.0)]:
        completion = tokens(tokenizer, answer)
        turns.append(Turn(tokens(tokenizer, prompt), completion, advantages=[advantage] * len(completion), kl_beta=0.1))
    normaliser = policy_update.step_normaliser(turns, "tokens", 24)
    params = policy_adapter.adapter_parameters(model, policy_adapter.POLICY_ADAPTER)
    policy_update.accumulate_policy_gradients(model, turns, kl_beta=0.1, normaliser=normaliser)
    per_turn = [param.grad.clone() for param in params]
    for param in params:
        param.grad = None
    total = 0
    for turn in turns:   # the third turn has zero advantages but a KL term: it is trained too
        logp = answer_logprobs(model, turn.prompt_ids, turn.completion_ids)
        reference = reference_logprobs(model, turn.prompt_ids, turn.completion_ids)
        total = total + policy_update.turn_loss(logp, reference, torch.tensor(turn.advantages), 0.1, normaliser)[0]
    total.backward()
    assert any(g.abs().max() > 0 for g in per_turn)
    for param, grad in zip(params, per_turn):
        assert torch.allclose(param.grad, grad, atol=1e-6, rtol=1e-4)


# -------------------------------------------------------------------------------------- real learning


@pytest.fixture(scope="module")
def half_and_half_sft(tmp_path_factory, forced_prompt, test_cache_dir):
    """An SFT adapter that answers the forced game's prompt with "GUESS: 1" or "GUESS: 2", half each."""
    folder = tmp_path_factory.mktemp("forced-sft")
    rows = [{"messages": forced_prompt + [{"role": "assistant", "content": f"GUESS: {1 + i % 2}"}],
             "meta": {"game": "guessnumber", "experiment": "forced", "task_id": i, "player_name": "Player 1",
                      "game_role": "Guesser", "model": "test", "outcome": "success"}} for i in range(16)]
    return train_tiny_sft(folder, rows, test_cache_dir)


@pytest.mark.parametrize("algorithm", ["grpo", "prime"])
def test_rl_steps_raise_the_winning_answers_probability(algorithm, half_and_half_sft, forced_prompt,
                                                         test_cache_dir):
    settings = rl_settings(algorithm=algorithm, steps=4, group_size=8, instances_per_step=2, temperature=1.0,
                           lr=2e-2, warmup_ratio=0.0, max_new_tokens=8,
                           prime={"lr": 1e-2, "accuracy_filter": None})   # won groups stay in (tested apart)
    cfg, tokenizer, model = policy_adapter.load_training_model(settings["model"], half_and_half_sft, test_cache_dir,
                                                               implicit_prm=algorithm == "prime")
    rl = trainer.RLTrainer(settings, cfg, tokenizer, model, GameCatalog(settings["games"]))
    prompt = tokens(tokenizer, rl.policy.render(forced_prompt))
    win, lose = tokens(tokenizer, "GUESS: 1<|im_end|>"), tokens(tokenizer, "GUESS: 2<|im_end|>")

    def log_odds() -> float:
        model.eval()
        with torch.no_grad(), using_adapter(model, policy_adapter.POLICY_ADAPTER):
            return float(answer_logprobs(model, prompt, win).sum() - answer_logprobs(model, prompt, lose).sum())

    before = log_odds()
    assert abs(before) < 1.5   # the SFT policy has no preference yet
    weights = {name: param.detach().clone() for name, param in model.named_parameters()}
    rl.rollouts([FORCED], step=99)   # generation merges the adapter into the base and unmerges it afterwards
    assert all(torch.allclose(param, weights[name], atol=1e-6) for name, param in model.named_parameters())
    assert log_odds() == pytest.approx(before, abs=1e-4)
    history = [rl.step([FORCED, FORCED], step) for step in range(4)]
    after = log_odds()
    assert after > before + 1.0, (before, after, [h["reward"] for h in history])
    assert history[0]["trained_turns"] > 0 and history[0]["grad_norm"] > 0
    assert history[0]["kl"] is not None and history[0]["tokens"]["trained"] > 0
    if algorithm == "prime":
        assert all(h["implicit_prm"]["bce"] is not None for h in history)
        # the PRM starts equal to its reference (no process signal), then moves: process advantages appear
        assert history[0]["process_advantage"]["std"] == 0.0 and history[-1]["process_advantage"]["std"] > 0


def test_train_rl_writes_the_adapters_and_metrics(half_and_half_sft, test_cache_dir, tmp_path):
    from peft import PeftModel

    # the tiny model never wins: with the accuracy filter every group would be left out and the PRM stay untrained
    settings = rl_settings(algorithm="prime", steps=2, group_size=2, instances_per_step=2, max_new_tokens=8,
                           prime={"accuracy_filter": None})
    metrics = trainer.train_rl(settings, half_and_half_sft, str(tmp_path / "rl"), str(tmp_path / "metrics.json"),
                               test_cache_dir)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written == metrics and written["status"] == "trained" and len(written["history"]) == 2
    assert written["config"]["rl"]["algorithm"] == "prime" and "peft" in written["versions"]
    step = written["history"][0]
    for key in ("reward", "success_rate", "percent_played", "advantage", "kl", "implicit_prm", "grad_norm",
                "tokens", "seconds", "filtered_groups", "group_accuracy", "zero_advantage_groups"):
        assert key in step
    assert {"bce", "accuracy"} <= set(step["implicit_prm"])
    for folder in (tmp_path / "rl", tmp_path / "rl" / "prm"):
        config = json.loads((folder / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == "tiny:0" and (folder / "adapter_model.safetensors").is_file()
    _, base = load_tokenizer_and_model(ModelConfig(spec="tiny:0", cache_dir=test_cache_dir))
    PeftModel.from_pretrained(base, str(tmp_path / "rl"))   # loads as a plain policy adapter
    # the implicit PRM as a best-of-N scorer: beta * sum log-ratio of the candidate against the SFT adapter
    pairs = [Pair([{"role": "user", "content": "Guess a number from 1 to 2."}], answer) for answer in ("GUESS: 1", "x")]
    trained = load_implicit_prm({"spec": "tiny:0", "threads": 1}, str(tmp_path / "rl"), half_and_half_sft,
                                beta=0.05, cache_dir=test_cache_dir)
    scores = trained.score(pairs)
    assert all(math.isfinite(score) for score in scores) and scores[0] != scores[1]
    assert trained.stats.pairs == 2
    untrained_rl = tmp_path / "untrained"
    shutil.copytree(half_and_half_sft, untrained_rl / "prm")   # the PRM equal to its reference: every score 0
    untrained = load_implicit_prm({"spec": "tiny:0", "threads": 1}, str(untrained_rl), half_and_half_sft, beta=0.05,
                                  cache_dir=test_cache_dir)
    assert untrained.score(pairs) == [0.0, 0.0]
    with pytest.raises(FileNotFoundError, match="prime in rl.algorithms"):
        load_implicit_prm({"spec": "tiny:0"}, str(tmp_path), half_and_half_sft, beta=0.05, cache_dir=test_cache_dir)
    # ... and as the scorer of the eval mode best_of_n_implicit (the rule's params: the mode's eval keys + rl)
    config = tiny_config(games={"max_instances": {"train": 1, "validation": 1, "test": 1}},
                         eval={"n": 2, "max_new_tokens": 8})
    mode_settings = {**eval_mode_params(config, "best_of_n_implicit"), "rl": rl_params(config, "prime")["rl"]}
    rows = evaluate.evaluate_mode("best_of_n_implicit", mode_settings, str(tmp_path / "implicit.parquet"),
                                  test_cache_dir, sft_adapter=half_and_half_sft, rl_adapter=str(tmp_path / "rl"))
    assert len(rows) == 3 and all(row["search_nodes"] == 2 * row["n_turns"] for row in rows)
    assert sum(row["prm_pairs"] for row in rows) > 0
    run = records.read_provenance(tmp_path / "implicit.parquet")["run"]
    assert run["prm"]["adapter"] == f"{tmp_path / 'rl'}/prm" and run["prm"]["stats"]["pairs"] > 0

"""The RL stage as the Hanabi card runs it, on the tiny model (CPU): single-turn training on the hanabi prompt set
(``rl.data: states``), per-turn rewards (``rl.reward.source: turn_scores``) on the right turns' advantages, the
importance-sampling loss against the policy gradient, and a fresh LoRA on a tied lm_head that trains and merges."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from safetensors.torch import load_file

from clemprm import records
from clemprm.config import rl_params
from clemprm.stages import merge
from clemprm.play.catalog import GameCatalog
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.games.hanabi.rewards import turn_rewards
from clemprm.stages.rl_states import write_states
from clemprm.models.tiny import build_tiny_model
from clemprm.rl import grpo, policy_adapter, policy_update, rewards, trainer
from clemprm.rl.logprobs import answer_logprobs, using_adapter
from clemprm.rl.rollouts import Group, Sequence, Turn, collect_groups
from clemprm.training import write_adapter
from tests.conftest import tiny_config

WEIGHTS = {"deduction": 1.0, "move_rating": 1.0}
FRESH_LORA = {"r": 4, "alpha": 4, "dropout": 0.0, "target_modules": ["q_proj", "v_proj", "down_proj", "lm_head"]}
HANABI = {"builtin": ["hanabi"], "experiments": {"hanabi": ["small"]},
          "max_instances": {"train": 2, "validation": 1, "test": 1}}


def hanabi_rl_settings(spec: str = "tiny:0", **rl) -> dict:
    rl = {"data": "states", "lora": FRESH_LORA, "loss": "importance_sampling", "temperature": 1.0,
          "max_new_tokens": 16, "group_size": 3, "instances_per_step": 2, "steps": 1,
          "reward": {"source": "turn_scores", "turn_weights": WEIGHTS}, **rl}
    config = tiny_config(model={"spec": spec}, games=HANABI, rl={"algorithms": ["grpo"], **rl},   # prime refuses
                         merge={"adapters": ["sft", "prm", "rl_grpo"]},                     # per-turn rewards
                         eval={"modes": ["greedy_base", "greedy_rl_grpo"]})
    return rl_params(config, "grpo")


@pytest.fixture(scope="module")
def states_file(tmp_path_factory) -> str:
    """The hanabi prompt set of two train deck orders, three states of each game."""
    path = tmp_path_factory.mktemp("states") / "states.parquet"
    settings = hanabi_rl_settings()
    write_states(settings["games"], str(path), settings["seed"], max_per_episode=3)
    return str(path)


def tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_states_data_feeds_the_trainer_single_turn_prompts(states_file, test_cache_dir):
    settings = hanabi_rl_settings()
    rl_settings = settings["rl"]
    catalog = GameCatalog(settings["games"], settings["seed"])   # the draw the states were written from
    schedule = trainer.state_schedule(catalog, states_file, rl_settings["instances_per_step"], 3, settings["seed"])
    all_states = records.read_records(states_file, records.STATES)
    assert [len(step) for step in schedule] == [2, 2, 2]
    assert len({state["state_id"] for step in schedule for _, state in step}) == len(all_states)  # 6 states, no repeat
    cfg, tokenizer, model = policy_adapter.load_training_model(settings["model"], None, test_cache_dir,
                                                               implicit_prm=False, lora=rl_settings["lora"])
    with torch.no_grad():   # a fresh LoRA is the base (B = 0): move it, so merged generation differs from the base
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05 * torch.randn_like(param))
    rl = trainer.RLTrainer(settings, cfg, tokenizer, model, catalog)
    groups = rl.rollouts(schedule[0], step=0)
    assert len(groups) == 2
    for group, (instance, state) in zip(groups, schedule[0]):
        assert group.instance.key == instance.key == (state["game"], state["experiment"], state["game_id"])
        assert len(group.sequences) == rl_settings["group_size"]
        prompt = tokens(tokenizer, rl.policy.render(list(state["messages"])))
        for sequence in group.sequences:
            assert len(sequence.turns) == 1 and sequence.player == state["player"]   # one turn: the state's answer
            turn = sequence.turns[0]
            assert turn.prompt_ids == prompt   # exactly the state's prompt, as the policy renders it
            assert turn.reward == pytest.approx(sum(w * turn.scores[k] for k, w in WEIGHTS.items()))
            assert sequence.reward == turn.reward and {"format", "exact_deduction"} <= set(turn.scores)
            # the sampler's log-probs (merged weights, eval mode) are the trainer's own distribution: ratio ~ 1
            model.eval()
            with torch.no_grad(), using_adapter(model, policy_adapter.POLICY_ADAPTER):
                own = answer_logprobs(model, turn.prompt_ids, turn.completion_ids)
            assert len(turn.sampler_logprobs) == len(turn.completion_ids)
            assert torch.allclose(own, torch.tensor(turn.sampler_logprobs), atol=1e-4)


def test_train_rl_on_states_writes_per_turn_scores(states_file, test_cache_dir, tmp_path):
    settings = hanabi_rl_settings(steps=2)
    metrics = trainer.train_rl(settings, None, str(tmp_path / "rl"), str(tmp_path / "metrics.json"), test_cache_dir,
                               states=states_file)
    assert metrics["data"] == {"kind": "states", "states": states_file} and metrics["model"]["sft_adapter"] is None
    for step in metrics["history"]:
        assert step["episodes"] == 2 * 3 and step["policy_turns"] == 2 * 3
        assert {"deduction", "exact_deduction", "move_rating", "format"} <= set(step["turn_scores"])
        assert step["turn_reward"]["mean"] == pytest.approx(step["reward"]["mean"])
    adapter_config = json.loads((tmp_path / "rl" / "adapter_config.json").read_text())
    assert "lm_head" in adapter_config["target_modules"] and adapter_config["r"] == 4
    outcome = hanabi_rl_settings()   # the config refuses this pair at parse time; train_rl refuses it too
    outcome["rl"]["reward"]["source"] = "success_played"
    with pytest.raises(ValueError, match="rl.data states trains single turns"):
        trainer.train_rl(outcome, None, str(tmp_path / "x"), str(tmp_path / "x.json"), test_cache_dir,
                         states=states_file)


def tokenised(policy):
    """``policy`` (a scripted one) with token ids on its answers, as a tokenising policy gives them."""
    generate = policy.generate

    def with_tokens(perspectives, **kwargs):
        generations = generate(perspectives, **kwargs)
        for generation in generations:
            generation.prompt_ids, generation.token_ids = [1, 2], [3] * (1 + len(generation.text) % 4)
        return generations
    policy.generate = with_tokens
    return policy


def test_per_turn_rewards_reach_their_turns_advantages(scripted_policy):
    """Whole hanabi episodes (``rl.data: episodes``) with the per-turn source: each turn gets the reward of its own
    answer (checked against a replay of the recorded answers), and its advantage is its z-score in the group."""
    answers = itertools.cycle(["DEDUCTION: ?? ?? ??\nMOVE: play 1", "DEDUCTION: R1 Y1 R2\nMOVE: discard 2",
                               "DEDUCTION: ?1 ?? R?\nMOVE: hint 1", "MOVE: play 3"])
    policy = tokenised(scripted_policy(lambda messages: next(answers)))
    catalog = GameCatalog(hanabi_rl_settings()["games"])
    engine = RolloutEngine(catalog, Sampling())
    instances = catalog.instances("hanabi", "train")
    reward_of = rewards.turn_reward_function({"source": "turn_scores", "turn_weights": WEIGHTS})
    groups = collect_groups(engine, policy, instances, 3, base_seed=0, step=0, sampling=Sampling(), reward_of=None,
                            turn_reward_of=reward_of)
    seen = []
    for group in groups:
        by_episode = {}
        for sequence in group.sequences:
            by_episode.setdefault(sequence.episode_id, {})[sequence.player] = sequence
        for row in group.rows:
            replay = engine.replay(engine.start(group.instance, [policy], "replay", 0),
                                   [turn["response"] for turn in row["turns"]])
            expected = [sum(w * scores[k] for k, w in WEIGHTS.items()) for scores in turn_rewards(replay)]
            for player, sequence in by_episode[row["episode_id"]].items():
                mine = [reward for turn, reward in zip(row["turns"], expected) if turn["player"] == player]
                assert [turn.reward for turn in sequence.turns] == pytest.approx(mine)
                assert sequence.reward == pytest.approx(sum(mine) / len(mine))
                seen += mine
    assert len(set(seen)) > 2   # the answers earn different rewards: a misplaced reward would show
    grpo.GRPO().assign(None, groups)
    for group in groups:
        turns = [turn for sequence in group.sequences for turn in sequence.turns]
        z = grpo.outcome_advantages([turn.reward for turn in turns])
        for turn, advantage in zip(turns, z):
            assert turn.advantages == [pytest.approx(advantage)] * len(turn.completion_ids)
        assert any(advantage != 0 for advantage in z)


def test_importance_sampling_gradient_equals_the_policy_gradient_on_policy(test_cache_dir):
    _, tokenizer, model = policy_adapter.load_training_model({"spec": "tiny:0", "threads": 1}, None, test_cache_dir,
                                                             implicit_prm=False, lora=FRESH_LORA)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.add_(0.05 * torch.randn_like(param))
    model.eval()   # no dropout: trainer and sampler compute the same distribution
    turns = []
    for prompt, answer, advantage in [("Your move.", "MOVE: play 1<|im_end|>", 0.7),
                                      ("Deduce.", "DEDUCTION: R1 ??<|im_end|>", -1.2)]:
        completion = tokens(tokenizer, answer)
        turns.append(Turn(tokens(tokenizer, prompt), completion, advantages=[advantage] * len(completion)))
    params = policy_adapter.adapter_parameters(model, policy_adapter.POLICY_ADAPTER)
    normaliser = policy_update.step_normaliser(turns, "tokens", 16)

    def gradients(loss: str) -> list[torch.Tensor]:
        for param in params:
            param.grad = None
        policy_update.accumulate_policy_gradients(model, turns, kl_beta=0.0, normaliser=normaliser, loss=loss)
        return [param.grad.clone() for param in params]

    with using_adapter(model, policy_adapter.POLICY_ADAPTER):   # the sampler's log-probs: these weights, no gradients
        policy_update.record_sampler_logprobs(model, [Group(None, [], [Sequence("e", "Player A", turns)])])
    policy_gradient = gradients("policy_gradient")
    importance_sampling = gradients("importance_sampling")
    assert any(float(g.abs().max()) > 0 for g in policy_gradient)
    for a, b in zip(policy_gradient, importance_sampling):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-4)
    # off policy (the sampler gave every token 0.5 nats more) the ratio weighs the gradient by exp(-0.5)
    for turn in turns:
        turn.sampler_logprobs = [value + 0.5 for value in turn.sampler_logprobs]
    for a, b in zip(policy_gradient, gradients("importance_sampling")):
        assert torch.allclose(a * math.exp(-0.5), b, atol=1e-7, rtol=1e-4)
    with pytest.raises(ValueError, match="rl.loss"):
        policy_update.accumulate_policy_gradients(model, turns, kl_beta=0.0, normaliser=normaliser, loss="ppo")


def test_a_fresh_lora_on_a_tied_lm_head_trains_and_merges(states_file, test_cache_dir, tmp_path):
    tied = tmp_path / "tied"
    build_tiny_model(0, tied, tie_word_embeddings=True)
    settings = hanabi_rl_settings(spec=str(tied), lr=5e-2, adam_betas=[0.9, 0.95])
    cfg, tokenizer, model = policy_adapter.load_training_model(settings["model"], None, test_cache_dir,
                                                               implicit_prm=False, lora=settings["rl"]["lora"])
    base = model.get_base_model()
    assert base.lm_head.weight is base.model.embed_tokens.weight   # tied
    embedding = base.model.embed_tokens.weight.detach().clone()
    rl = trainer.RLTrainer(settings, cfg, tokenizer, model, GameCatalog(settings["games"], settings["seed"]))
    assert rl.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
    row = records.read_records(states_file, records.STATES)[0]
    prompt = tokens(tokenizer, rl.policy.render(list(row["messages"])))
    turns = [Turn(prompt, tokens(tokenizer, row["reference"] + "<|im_end|>"), advantages=None)]
    turns[0].advantages = [1.0] * len(turns[0].completion_ids)
    normaliser = policy_update.step_normaliser(turns, "tokens", 16)
    policy_update.accumulate_policy_gradients(model, turns, kl_beta=0.0, normaliser=normaliser)
    lm_head_b = [param for name, param in model.named_parameters() if "lm_head.lora_B" in name]
    assert lm_head_b and float(lm_head_b[0].grad.abs().max()) > 0   # the lm_head LoRA gets a gradient
    rl.optimizer.step()
    assert float(lm_head_b[0].detach().abs().max()) > 0 and torch.equal(base.model.embed_tokens.weight, embedding)
    write_adapter(model, cfg.spec, tmp_path / "adapter", [policy_adapter.POLICY_ADAPTER])
    saved_adapter = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert all("lora_" in key for key in saved_adapter)   # not PEFT's copy of the whole lm_head matrix
    merge_settings = merge.merge_params(tiny_config(model={"spec": str(tied)}, merge={"contrasts": True}), "causal-lm")
    verification = merge.merge_and_verify("rl", "causal-lm", merge_settings, str(tmp_path / "adapter"), states_file,
                                          str(tmp_path / "merged"), test_cache_dir)
    assert verification["passed"] and verification["untied"] == ["lm_head"]
    assert verification["examples"]["source"] == "states" and verification["adapter_detectable"]
    # PEFT's merge_and_unload() writes the lm_head delta into the shared embedding: the check sees it
    naive = verification["contrasts"]["peft_merge_and_unload"]
    assert naive["max_abs_logit_diff"] > verification["thresholds"]["max_abs_logit_diff"]
    saved = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert saved["tie_word_embeddings"] is False

"""The RL trainer: one step = groups of rollouts through the engine, the objective's advantages, one policy update.

Step
    1. Rollouts: ``rl.instances_per_step`` train instances x ``rl.group_size`` episodes, played by the current
       policy (adapter ``default``) in lockstep (:func:`clemprm.rl.rollouts.collect_groups`), sampled at
       ``rl.temperature``, with the adapter merged into an fp32 base while generating
       (:func:`clemprm.rl.logprobs.merged_for_generation`). The generator's conversation store is emptied first
       (the weights changed).
    2. The objective sets each turn's per-token advantages (:class:`clemprm.rl.grpo.GRPO`,
       :class:`clemprm.rl.prime.PRIME`, which also updates its implicit PRM).
    3. Policy update: every trained turn forwarded and backpropagated on its own, per token
       ``-A_t * ratio_t + kl_beta * K3_t`` against the adapter-disabled reference, the ratio on policy or
       (``rl.loss: importance_sampling``) to the sampler's log-probabilities, normalised by
       ``rl.length_normalisation`` (:mod:`clemprm.rl.policy_update`). Then gradient clipping
       (``rl.max_grad_norm``), one optimizer step, the learning-rate schedule (linear warmup, cosine down to
       ``min_lr_rate`` x lr).

The model: the base with the policy adapter ``default`` (the SFT adapter, or with ``rl.lora`` a fresh LoRA) and, for
PRIME, the implicit PRM and its reference (:mod:`clemprm.rl.policy_adapter`, also the optimizer and schedule).

Data: ``rl.data: episodes`` plays whole games of train instances; ``states`` trains single-turn on a prompt set
(:data:`clemprm.records.STATES`, e.g. the hanabi states of the rule-based player's self-play): each step takes
``rl.instances_per_step`` states and samples ``rl.group_size`` answers at each (:func:`collect_state_groups`),
rewarded per turn (``rl.reward.source: turn_scores``).

Devices: as SFT (:mod:`clemprm.rl.policy_adapter`); on CUDA the forwards run under bf16 autocast.

Extensions use the same step: SCoRe adds only its objective (advantages per attempt, ``Turn.kl_beta`` per attempt)
and its attempt builder (the episodes it plays); per-turn rewards (Hanabi's state tracking and move rating) are a
reward source whose objective turns them into per-turn advantages. The update, the reference and the metrics stay
the trainer's (this module and its loss, :mod:`clemprm.rl.policy_update`).
"""

from __future__ import annotations

import contextlib
import logging
import random
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from clemprm import distributed
from clemprm.checks.run_time import check_episodes, marks_metadata
from clemprm.modes import RL_ALGORITHMS
from clemprm.play.catalog import GameCatalog, Instance, _round_robin
from clemprm.play.contract import Sampling
from clemprm.play.engine import RolloutEngine
from clemprm.stats import derive_seed
from clemprm.rl.grpo import GRPO, summary
from clemprm.rl.logprobs import merged_for_generation
from clemprm.rl.policy_adapter import (POLICY_ADAPTER, adapter_parameters, load_training_model, make_optimizer,
                                       make_scheduler)
from clemprm.rl.policy_update import (accumulate_policy_gradients, record_sampler_logprobs, step_normaliser,
                                      update_statistics)
from clemprm.rl.prime import PRIME, PRM_ADAPTER, ImplicitPRM
from clemprm.rl.rewards import TURN_SOURCES, reward_function, turn_reward_function
from clemprm.rl.rollouts import Group, Turn, collect_groups, collect_state_groups
from clemprm.model_card import write_adapter_card
from clemprm.tracking import OFF, TrackingRun, open_run
from clemprm.training import write_adapter

log = logging.getLogger(__name__)

DATA = ("episodes", "states")


# ------------------------------------------------------------------------------------------ the trainer


def instance_schedule(instances: list[Instance], per_step: int, steps: int, seed: int) -> list[list[Instance]]:
    """The instances of each step: every game's instances in a seeded order, interleaved round-robin over games,
    then cycled, so consecutive steps see every game and every instance before any repeats."""
    by_game: dict[str, list[Instance]] = {}
    for instance in instances:
        by_game.setdefault(instance.game, []).append(instance)
    for game, game_instances in by_game.items():
        random.Random(derive_seed(seed, "rl order", game)).shuffle(game_instances)
    order = _round_robin(by_game)
    if not order:
        raise ValueError("rl: no train instance to play (games.max_instances.train, games.builtin)")
    return [[order[(step * per_step + k) % len(order)] for k in range(per_step)] for step in range(steps)]


def state_schedule(catalog: GameCatalog, states_path: str, per_step: int, steps: int,
                   seed: int) -> list[list[tuple[Instance, dict]]]:
    """The states of each step (``rl.data: states``): the prompt set's rows with their instances, in a seeded order,
    cycled, so every state is trained on before any repeats."""
    from clemprm import records
    from clemprm.stages.rl_states import state_instance

    rows = records.read_records(states_path, records.STATES)
    if not rows:
        raise ValueError(f"rl.data states: the prompt set {states_path} has no state")
    states = [(state_instance(catalog, row), row) for row in rows]
    random.Random(derive_seed(seed, "rl states order")).shuffle(states)
    return [[states[(step * per_step + k) % len(states)] for k in range(per_step)] for step in range(steps)]


def turn_score_summary(turns: list[Turn]) -> dict:
    """The step's per-turn rewards and the mean of each per-turn score the game logged (a per-turn source)."""
    scored = [turn for turn in turns if turn.scores is not None]
    if not scored:
        return {}
    numbers: dict[str, list[float]] = {}   # a score the game leaves empty on a turn (None) counts where given
    for turn in scored:
        for name, value in turn.scores.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                numbers.setdefault(name, []).append(float(value))
    return {"turn_reward": summary([turn.reward for turn in scored]),
            "turn_scores": {name: sum(values) / len(values) for name, values in sorted(numbers.items())}}


class RLTrainer:
    """On-policy RL of the policy adapter of ``model`` on games of ``catalog`` (``settings``: seed, model, rl)."""

    def __init__(self, settings: dict, model_cfg, tokenizer, model, catalog: GameCatalog, *, objective=None,
                 reward_of=None, on_failure: str = "stop"):
        from clemprm.models.generation import PolicyModel
        from clemprm.models.loader import resolve_dtype
        from clemprm.training import device_name

        if model_cfg.backend == "vllm" and distributed.world_size() > 1:   # one server generates for the job
            raise ValueError(f"the RL trainer with generation.backend vllm runs in one process (the server "
                             f"generates every rollout); this job has {distributed.world_size()}: set the rule's "
                             f"`processes` resource to 1")
        self.settings, self.rl, self.seed = settings, settings["rl"], int(settings["seed"])
        self.model, self.tokenizer = model, tokenizer
        self.device = device_name()
        self.compute_dtype = resolve_dtype(model_cfg, self.device)
        rl = self.rl
        self.sampling = Sampling(rl["temperature"], rl["top_p"], rl["max_new_tokens"])
        self.policy = PolicyModel(model_cfg, name=f"{model_cfg.short_name}+rl", tokenizer=tokenizer, model=model,
                                  temperature=rl["temperature"], top_p=rl["top_p"], max_new_tokens=rl["max_new_tokens"])
        self.engine = RolloutEngine(catalog, self.sampling)
        # the vllm backend: a server generates; after each optimizer step it gets the policy adapter as it is now
        self.served_adapter = tempfile.TemporaryDirectory(prefix="clemprm-rl-adapter-") \
            if model_cfg.backend == "vllm" else None
        # SCoRe passes its own episode reward (clemprm.rl.score); a per-turn source of rl.reward rewards each turn
        self.turn_reward_of = None if reward_of else turn_reward_function(rl["reward"])
        self.reward_of = reward_of or (None if self.turn_reward_of else reward_function(rl["reward"]))
        self.optimizer = make_optimizer(adapter_parameters(model, POLICY_ADAPTER), rl, rl["lr"], self.device)
        self.scheduler = make_scheduler(self.optimizer, rl)
        self.objective = objective or self._objective()   # SCoRe passes its stage's objective
        # a step whose rollouts of some game all failed stops the stage, unless on_failure: continue (then marked)
        self.on_failure, self.failure_marks = on_failure, []

    def _objective(self):
        algorithm = self.rl["algorithm"]
        if algorithm == "grpo":
            return GRPO()
        if algorithm == "prime":
            prime = self.rl["prime"]
            prm = ImplicitPRM(self.model, prime["beta"], compute_dtype=self.compute_dtype)
            optimizer = make_optimizer(prm.parameters(), self.rl, prime["lr"], self.device)
            return PRIME(prm, optimizer, make_scheduler(optimizer, self.rl),
                         std_threshold=prime["process_std_threshold"], max_grad_norm=self.rl["max_grad_norm"],
                         accuracy_filter=prime["accuracy_filter"])
        raise ValueError(f"rl.algorithm: unknown algorithm {algorithm!r} (known: {', '.join(RL_ALGORITHMS)})")

    def rollouts(self, instances: list, step: int) -> list[Group]:
        """Groups of episodes of ``instances`` (``rl.data: states``: ``(instance, state)`` pairs) played by the
        current policy (no gradients, eval mode); with the importance-sampling loss, the sampler's log-probs."""
        self.model.eval()
        if self.served_adapter is not None:   # the server generates with the adapter written as it is now
            folder = Path(self.served_adapter.name) / "rl-policy"   # served as rl-policy-<digest of the weights>
            write_adapter(self.model, self.policy.cfg.spec, folder, [POLICY_ADAPTER])
            # PEFT's layout: the default adapter at the top, a named one in its sub-folder
            self.policy.decoder.serve_adapter(folder if POLICY_ADAPTER == "default" else folder / POLICY_ADAPTER)
            generating = contextlib.nullcontext()
        else:
            self.policy.decoder.forget_conversations()   # states of the previous weights are stale
            generating = merged_for_generation(self.model, POLICY_ADAPTER)
        with generating:   # several processes: each plays its share of the groups, every one gets them all
            return distributed.map_split(instances, lambda share: self.play_groups(share, step))

    def play_groups(self, instances: list, step: int) -> list[Group]:
        """One group per instance (or state), played by the policy as it generates now."""
        if self.rl["data"] == "states":
            groups = collect_state_groups(self.engine, self.policy, instances, self.rl["group_size"],
                                          base_seed=self.seed, step=step, sampling=self.sampling,
                                          turn_reward_of=self.turn_reward_of)
        else:
            groups = collect_groups(self.engine, self.policy, instances, self.rl["group_size"],
                                    base_seed=self.seed, step=step, sampling=self.sampling,
                                    reward_of=self.reward_of, turn_reward_of=self.turn_reward_of)
        if self.rl["loss"] == "importance_sampling":
            record_sampler_logprobs(self.model, groups, self.compute_dtype)
        return groups

    def update(self, groups: list[Group]) -> dict:
        """The objective's advantages, then one policy update on ``groups``; the update's statistics."""
        self.model.train()
        objective_stats = self.objective.assign(self, groups)
        # turns left without advantages (PRIME's filtered groups) are out of the step, also of its normaliser
        turns = [turn for group in groups for sequence in group.sequences for turn in sequence.turns
                 if turn.advantages is not None]
        normaliser = step_normaliser(turns, self.rl["length_normalisation"], self.rl["max_new_tokens"])
        trained = [turn for turn in turns if turn.trained]
        # several processes: each backpropagates its share of the turns, then the gradients are summed (the loss
        # is a sum over turns divided by the step's normaliser, so the sum is one process's gradient)
        per_turn = distributed.map_split(trained, lambda share: accumulate_policy_gradients(
            self.model, share, kl_beta=self.rl["kl_beta"], normaliser=normaliser, compute_dtype=self.compute_dtype,
            loss=self.rl["loss"]))
        stats = update_statistics(trained, per_turn, self.rl["loss"])
        params = adapter_parameters(self.model, POLICY_ADAPTER)
        if trained:
            distributed.sum_gradients(params)
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(params, self.rl["max_grad_norm"])) \
            if stats["trained_turns"] else 0.0
        stats["lr"] = self.scheduler.get_last_lr()[0]
        self.optimizer.step()   # parameters without a gradient (nothing trained) are left alone
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return {**objective_stats, **stats}

    def step(self, instances: list[Instance], step: int) -> dict:
        """One RL step on ``instances``; its metrics."""
        start = time.perf_counter()
        groups = self.rollouts(instances, step)
        rollout_seconds = time.perf_counter() - start
        rows = [row for group in groups for row in group.rows]
        self.failure_marks += check_episodes(f"rl_adapter ({self.rl['algorithm']}) step {step}", rows,
                                             self.on_failure)
        update = self.update(groups)
        rewards = [reward for group in groups for reward in group.rewards()]
        turns = [turn for group in groups for sequence in group.sequences for turn in sequence.turns]
        metrics = {
            "step": step, "instances": [list(group.instance.key) for group in groups], "episodes": len(rows),
            "reward": summary(rewards),
            "success_rate": 100 * sum(bool(row["success"]) for row in rows) / max(1, len(rows)),
            "percent_played": 100 * sum(not row["aborted"] for row in rows) / max(1, len(rows)),
            "errors": sum(row["error"] is not None for row in rows),
            "policy_turns": len(turns), "tokens": {"generated": sum(len(t.completion_ids) for t in turns),
                                                   "trained": update.pop("trained_tokens")},
            **update, **turn_score_summary(turns),
            # the vllm backend: the name the step's rollouts were generated under (a new one after weights changed)
            **({"served_adapter": self.policy.decoder.model_name} if self.served_adapter is not None else {}),
            "seconds": {"rollouts": round(rollout_seconds, 3),
                        "update": round(time.perf_counter() - start - rollout_seconds, 3)},
        }
        log.info("rl step %d: reward %.3f (std %.3f), success %.0f%%, played %.0f%%, %d/%d turns trained, kl %s, "
                 "grad norm %.3g, %.0f s rollouts + %.0f s update", step, metrics["reward"]["mean"] or 0.0,
                 metrics["reward"]["std"] or 0.0, metrics["success_rate"], metrics["percent_played"],
                 metrics["trained_turns"], len(turns), metrics["kl"], metrics["grad_norm"],
                 metrics["seconds"]["rollouts"], metrics["seconds"]["update"])
        return metrics


def tracked_history(steps: Iterable[dict], tracking: TrackingRun) -> list[dict]:
    """Run the steps (an iterable that trains one step per item it yields: that step's metrics) and return their
    metrics, every number of each step written to the ``tracking`` run at the step's ``step`` as soon as it is done
    (:mod:`clemprm.tracking`)."""
    history = []
    with open_run(tracking) as log:
        for metrics in steps:
            log({key: value for key, value in metrics.items() if key != "step"}, metrics["step"])
            history.append(metrics)
    return history


# ------------------------------------------------------------------------------------------ the stage


def train_rl(settings: dict, sft_adapter: str | None, adapter_dir: str, metrics_path: str,
             cache_dir: str | None = None, states: str | None = None, on_failure: str = "stop",
             tracking: TrackingRun = OFF) -> dict:
    """The ``rl_adapter`` stage: RL of the SFT policy (or, ``rl.lora``, of a fresh LoRA) on the train split of
    every configured game, or (``rl.data: states``) on the prompt set ``states``; writes the policy adapter (and,
    for PRIME, the implicit PRM in its ``prm/`` sub-folder) and the per-step metrics. A step in which every episode
    of a game failed stops the stage (``on_failure: continue``: the metrics record it, :mod:`clemprm.checks.run_time`).
    ``settings`` is the rule's params (:func:`clemprm.config.rl_params`): seed, model, games, rl, where
    ``rl.algorithm`` is the job's algorithm (one of ``rl.algorithms``); ``tracking``: the tracker run that gets every
    step's metrics (:func:`tracked_history`)."""
    from clemprm.models.loader import resolve_quantization
    from clemprm.training import finish_metrics

    start = time.perf_counter()
    rl = settings["rl"]
    if rl["algorithm"] not in RL_ALGORITHMS:
        raise ValueError(f"rl.algorithm: unknown algorithm {rl['algorithm']!r} (known: {', '.join(RL_ALGORITHMS)})")
    if rl["data"] not in DATA:
        raise ValueError(f"rl.data: unknown value {rl['data']!r} (known: {', '.join(DATA)})")
    if rl["data"] == "states" and rl["reward"]["source"] not in TURN_SOURCES:
        raise ValueError(f"rl.data states trains single turns: it needs a per-turn rl.reward.source "
                         f"({', '.join(TURN_SOURCES)}), not {rl['reward']['source']!r}")
    if rl["algorithm"] == "prime" and rl["reward"]["source"] in TURN_SOURCES:
        raise ValueError(f"rl.reward.source {rl['reward']['source']!r} rewards turns, which grpo trains on; prime's "
                         f"implicit PRM learns from an episode's success (rl.algorithm)")
    torch.manual_seed(int(settings["seed"]))
    catalog = GameCatalog(settings["games"], settings["seed"])
    if rl["data"] == "states":
        if states is None:
            raise ValueError("rl.data states: no prompt set (the states file) given")
        schedule = state_schedule(catalog, states, rl["instances_per_step"], rl["steps"], int(settings["seed"]))
    else:
        schedule = instance_schedule(catalog.all_instances("train"), rl["instances_per_step"], rl["steps"],
                                     int(settings["seed"]))
    cfg, tokenizer, model = load_training_model(settings["model"], sft_adapter, cache_dir,
                                                implicit_prm=rl["algorithm"] == "prime", lora=rl["lora"])
    trainer = RLTrainer(settings, cfg, tokenizer, model, catalog, on_failure=on_failure)
    log.info("rl %s: %d steps x %d %s x %d %s, %s loss, policy %s from %s", rl["algorithm"], rl["steps"],
             rl["instances_per_step"], "states" if rl["data"] == "states" else "instances", rl["group_size"],
             "answers" if rl["data"] == "states" else "episodes", rl["loss"], trainer.policy.name,
             "a fresh LoRA" if rl["lora"] is not None else sft_adapter)
    steps = tracked_history((trainer.step(instances, index) for index, instances in enumerate(schedule)), tracking)
    adapters = [POLICY_ADAPTER] + ([PRM_ADAPTER] if rl["algorithm"] == "prime" else [])
    write_adapter(model, cfg.spec, adapter_dir, adapters)
    metrics = {"status": "trained", "algorithm": rl["algorithm"],
               "model": {"spec": cfg.spec, "sft_adapter": None if rl["lora"] is not None else str(sft_adapter),
                         "fresh_lora": rl["lora"], "device": trainer.device,
                         "quantization": resolve_quantization(cfg, trainer.device),
                         "dtype": str(trainer.compute_dtype)},
               "implicit_prm_adapter": "prm" if rl["algorithm"] == "prime" else None,
               "data": {"kind": rl["data"], "states": states}, "loss": rl["loss"],
               "history": steps, "generation": trainer.policy.stats.as_dict(),
               **marks_metadata(trainer.failure_marks)}
    finish_metrics(metrics, start, settings, metrics_path)
    write_adapter_card(rl["algorithm"], adapter_dir, metrics)   # after finish_metrics: the final metrics
    log.info("rl %s: %d steps in %.0f s; reward %s -> %s; adapter %s", rl["algorithm"], len(steps),
             metrics["seconds"], steps[0]["reward"]["mean"] if steps else None,
             steps[-1]["reward"]["mean"] if steps else None, adapter_dir)
    return metrics

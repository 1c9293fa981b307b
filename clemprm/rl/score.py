"""SCoRe (Kumar et al. 2024, arXiv 2409.12917) for dialogue games: two-attempt self-correction RL on the RL trainer.

SCoRe differs from GRPO and PRIME only in its episodes and its objective; rollouts, log-probabilities, the reference
(the adapter disabled), the per-turn backward, the K3 KL, the length normalisation, clipping, the optimizer and its
schedule are :class:`clemprm.rl.trainer.RLTrainer`'s.

Episodes (:meth:`ScoreTrainer.attempts`)
    A step plays ``score.group_size`` episodes of each of its ``score.instances_per_step`` train instances with the
    trainer's own rollouts (attempt 1, ``y1``), then one attempt 2 (``y2``) per attempt-1 episode
    (:mod:`clemprm.rl.attempts`), all in lockstep through the engine.

Reward (:func:`success_binary`)
    The card's ``success_binary``: +1 success, 0 loss, -1 abort (a cold-start model aborts most episodes: a reward of 0
    for aborts would delete the dominant signal), normalised to [0, 1] before shaping: ``(r + 1) / 2``.

Objective (:class:`ScoreStage`), REINFORCE without a baseline (the card's), per token of every turn of an attempt
    * Stage I (``score.stage1_steps``): ``-logp(y2) * r2 + beta2 * KL(y1)``: only y2 gets a policy gradient; y1 is
      anchored to the reference by the K3 KL weighted ``beta2``; y2 has no KL term.
    * Stage II (``score.stage2_steps``): ``-logp(y1) * r1 - logp(y2) * r_shaped + beta1 * (KL(y1) + KL(y2))`` with
      ``r_shaped = r2 + alpha * (r2 - r1)`` (:func:`shaped_reward`): both attempts get a policy gradient, and the
      bonus rewards genuine correction (wrong at t1, right at t2) and punishes the reverse.
    Expressed on the trainer's turns: every token of a turn of y_k gets the attempt's advantage
    (:attr:`~clemprm.rl.rollouts.Turn.advantages`) and the attempt's KL weight
    (:attr:`~clemprm.rl.rollouts.Turn.kl_beta`); ``score.length_normalisation: constant`` (the card's) divides the
    step's sums by ``max_new_tokens`` x the step's policy turns.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from clemprm import distributed
from clemprm.play.catalog import GameCatalog, Instance
from clemprm.stats import derive_seed
from clemprm.checks.game_inputs import check_single_player_games
from clemprm.rl.attempts import score_games_config, start_second_attempt
from clemprm.rl.grpo import summary
from clemprm.rl.logprobs import merged_for_generation
from clemprm.rl.rollouts import Group, Sequence, play_groups
from clemprm.rl.policy_adapter import POLICY_ADAPTER, load_training_model
from clemprm.rl.trainer import RLTrainer, instance_schedule, tracked_history
from clemprm.model_card import write_adapter_card
from clemprm.tracking import OFF, TrackingRun
from clemprm.training import write_adapter

log = logging.getLogger(__name__)

STAGES = (1, 2)
# the trainer keys SCoRe takes from its own section (the rest of the trainer's ``rl`` section is fixed: no global KL
# weight, every turn carries its attempt's)
TRAINER_KEYS = ("instances_per_step", "group_size", "temperature", "top_p", "max_new_tokens", "lr", "warmup_ratio",
                "min_lr_rate", "weight_decay", "optimizer", "max_grad_norm", "length_normalisation")


def success_binary(row: dict) -> float:
    """+1 success, 0 loss, -1 abort, normalised to [0, 1]: 1, 0.5, 0."""
    raw = 1 if row["success"] else -1 if row["aborted"] else 0
    return (raw + 1) / 2


def shaped_reward(r1: float, r2: float, alpha: float) -> float:
    """Stage II's reward of attempt 2: ``r2 + alpha * (r2 - r1)``."""
    return r2 + alpha * (r2 - r1)


@dataclass
class TwoAttempts(Group):
    """Both attempts of ``G`` episodes of one instance: ``rows`` and ``sequences`` hold attempt 1's then attempt
    2's (what the trainer's update trains on); ``first`` and ``second`` keep them apart, episode ``g`` of each
    paired."""

    first: Group
    second: Group

    @classmethod
    def of(cls, first: Group, second: Group) -> "TwoAttempts":
        return cls(first.instance, first.rows + second.rows, first.sequences + second.sequences, first, second)

    def pairs(self) -> list[tuple[Sequence, Sequence]]:
        """``(y1, y2)`` per episode: the one player's sequence of attempt 1 and of its attempt 2."""
        def by_episode(group: Group) -> dict[str, Sequence]:
            return {sequence.episode_id: sequence for sequence in group.sequences}

        first, second = by_episode(self.first), by_episode(self.second)
        return [(first[a["episode_id"]], second[b["episode_id"]]) for a, b in zip(self.first.rows, self.second.rows)]


class ScoreStage:
    """SCoRe's objective in stage 1 or 2 (module docstring): per attempt, an advantage and a KL weight per turn."""

    name = "score"

    def __init__(self, stage: int, *, alpha: float, beta1: float, beta2: float):
        if stage not in STAGES:
            raise ValueError(f"SCoRe has stages 1 and 2, not {stage!r}")
        self.stage, self.alpha, self.beta1, self.beta2 = stage, float(alpha), float(beta1), float(beta2)

    def weights(self, r1: float, r2: float) -> tuple[float, float, float, float]:
        """``(advantage of y1, KL weight of y1, advantage of y2, KL weight of y2)``."""
        if self.stage == 1:
            return 0.0, self.beta2, r2, 0.0
        return r1, self.beta1, shaped_reward(r1, r2, self.alpha), self.beta1

    def assign(self, trainer, groups: list[TwoAttempts]) -> dict:
        """Set every turn's advantages and KL weight; return the step's advantage statistics per attempt."""
        first, second = [], []
        for group in groups:
            for y1, y2 in group.pairs():
                a1, kl1, a2, kl2 = self.weights(y1.reward, y2.reward)
                first.append(a1)
                second.append(a2)
                for sequence, advantage, kl_beta in ((y1, a1, kl1), (y2, a2, kl2)):
                    for turn in sequence.turns:
                        turn.advantages = [advantage] * len(turn.completion_ids)
                        turn.kl_beta = kl_beta
        return {"stage": self.stage, "advantage": {"attempt1": summary(first), "attempt2": summary(second)}}


def trainer_settings(settings: dict) -> dict:
    """The RL trainer's settings for SCoRe: seed, model, and an ``rl`` section from ``score``'s keys (steps = both
    stages' steps, so the learning-rate schedule spans the whole run)."""
    score = settings["score"]
    rl = {key: score[key] for key in TRAINER_KEYS}
    # whole episodes, the plain policy gradient, AdamW's default betas (the RL stage's defaults; SCoRe's card is silent)
    rl.update(steps=score["stage1_steps"] + score["stage2_steps"], kl_beta=0.0, algorithm="score", data="episodes",
              loss="policy_gradient", adam_betas=[0.9, 0.999])
    return {"seed": settings["seed"], "model": settings["model"], "rl": rl}


def attempt_metrics(groups: list[Group]) -> dict:
    """One attempt's statistics: reward, success, % played, errors, turns, generated tokens, and the mean K3 per token
    of its turns that the update trained (None when it trained none)."""
    rows = [row for group in groups for row in group.rows]
    rewards = [reward for group in groups for reward in group.rewards()]
    turns = [turn for group in groups for sequence in group.sequences for turn in sequence.turns]
    trained = [turn for turn in turns if turn.kl_sum is not None]
    trained_tokens = sum(len(turn.completion_ids) for turn in trained)
    return {"episodes": len(rows), "reward": summary(rewards),
            "success_rate": 100 * sum(bool(row["success"]) for row in rows) / max(1, len(rows)),
            "percent_played": 100 * sum(not row["aborted"] for row in rows) / max(1, len(rows)),
            "errors": sum(row["error"] is not None for row in rows), "policy_turns": len(turns),
            "tokens": sum(len(turn.completion_ids) for turn in turns),
            "kl": sum(turn.kl_sum for turn in trained) / trained_tokens if trained_tokens else None}


def transitions(groups: list[TwoAttempts]) -> dict:
    """Episodes wrong at attempt 1 and right at attempt 2 (``incorrect_to_correct``) and the reverse."""
    pairs = [(a, b) for group in groups for a, b in zip(group.first.rows, group.second.rows)]
    return {"incorrect_to_correct": sum(not a["success"] and b["success"] for a, b in pairs),
            "correct_to_incorrect": sum(a["success"] and not b["success"] for a, b in pairs), "pairs": len(pairs)}


class ScoreTrainer:
    """SCoRe on the one RL trainer: its rollouts for attempt 1, the attempt builder for attempt 2, a stage's
    objective, the trainer's update."""

    def __init__(self, settings: dict, model_cfg, tokenizer, model, catalog: GameCatalog):
        score = settings["score"]
        self.score, self.seed = score, int(settings["seed"])
        self.stages = {stage: ScoreStage(stage, alpha=score["alpha"], beta1=score["beta1"], beta2=score["beta2"])
                       for stage in STAGES}
        self.trainer = RLTrainer(trainer_settings(settings), model_cfg, tokenizer, model, catalog,
                                 objective=self.stages[1], reward_of=success_binary)

    def second_attempts(self, first: list[Group], step: int) -> list[Group]:
        """Attempt 2 of every attempt-1 episode of ``first``, played by the current policy in lockstep (several
        processes: each its share of the groups, every one gets them all)."""
        self.trainer.model.eval()
        with merged_for_generation(self.trainer.model, POLICY_ADAPTER):
            return distributed.map_split(first, lambda share: self.play_second_attempts(share, step))

    def play_second_attempts(self, first: list[Group], step: int) -> list[Group]:
        trainer = self.trainer
        episodes, owner = [], []
        for index, group in enumerate(first):
            for row in group.rows:
                episode_id = f"{row['episode_id']}/attempt2"
                episodes.append(start_second_attempt(
                    trainer.engine, group.instance, [trainer.policy], row, episode_id,
                    derive_seed(self.seed, "score attempt 2", step, episode_id), self.score["instruction"]))
                owner.append(index)
        return play_groups(trainer.engine, trainer.policy, [group.instance for group in first], episodes, owner,
                           step=step, sampling=trainer.sampling, reward_of=trainer.reward_of, label="attempt 2")

    def step(self, instances: list[Instance], step: int, stage: int) -> dict:
        """One SCoRe step of ``stage`` on ``instances``; its metrics."""
        trainer = self.trainer
        trainer.objective = self.stages[stage]
        start = time.perf_counter()
        first = trainer.rollouts(instances, step)
        first_seconds = time.perf_counter() - start
        second = self.second_attempts(first, step)
        second_seconds = time.perf_counter() - start - first_seconds
        groups = [TwoAttempts.of(a, b) for a, b in zip(first, second)]
        update = trainer.update(groups)
        attempt1, attempt2 = attempt_metrics(first), attempt_metrics(second)
        r1, r2 = attempt1["reward"]["mean"], attempt2["reward"]["mean"]
        metrics = {
            "step": step, "stage": stage, "instances": [list(instance.key) for instance in instances],
            "reward_t1": r1, "reward_t2": r2, "reward_difference": None if r1 is None or r2 is None else r2 - r1,
            "attempt1": attempt1, "attempt2": attempt2, "transitions": transitions(groups),
            "kl": {"attempt1": attempt1["kl"], "attempt2": attempt2["kl"], "trained": update.pop("kl")},
            "tokens": {"generated": attempt1["tokens"] + attempt2["tokens"], "trained": update.pop("trained_tokens")},
            **update,
            "seconds": {"attempt1": round(first_seconds, 3), "attempt2": round(second_seconds, 3),
                        "update": round(time.perf_counter() - start - first_seconds - second_seconds, 3)},
        }
        log.info("score stage %d step %d: reward t1 %.3f -> t2 %.3f, success %.0f%% -> %.0f%%, kl %s / %s, "
                 "%d turns trained, grad norm %.3g, %.0f + %.0f s attempts, %.0f s update", stage, step, r1 or 0.0,
                 r2 or 0.0, attempt1["success_rate"], attempt2["success_rate"], attempt1["kl"], attempt2["kl"],
                 metrics["trained_turns"], metrics["grad_norm"], first_seconds, second_seconds,
                 metrics["seconds"]["update"])
        return metrics


def stage_summary(history: list[dict], stage: int) -> dict:
    """A stage's steps at a glance: mean reward at t1 and t2 and their difference, seconds."""
    steps = [entry for entry in history if entry["stage"] == stage]

    def mean(key):
        values = [entry[key] for entry in steps if entry[key] is not None]
        return sum(values) / len(values) if values else None

    return {"steps": len(steps), "reward_t1": mean("reward_t1"), "reward_t2": mean("reward_t2"),
            "reward_difference": mean("reward_difference"),
            "seconds": round(sum(sum(entry["seconds"].values()) for entry in steps), 3)}


def train_score(settings: dict, sft_adapter: str, adapter_dir: str, metrics_path: str,
                cache_dir: str | None = None, tracking: TrackingRun = OFF) -> dict:
    """The ``score_adapter`` stage: SCoRe's two stages on the SFT policy, on the train split of ``score.games``;
    writes the policy adapter and the per-stage, per-step metrics (each step's also to the ``tracking`` run).
    ``settings``: seed, model, games, score."""
    from clemprm.models.loader import resolve_quantization
    from clemprm.training import finish_metrics

    start = time.perf_counter()
    score = settings["score"]
    check_single_player_games(settings)
    if score["stage1_steps"] + score["stage2_steps"] < 1:
        raise ValueError("config keys 'score.stage1_steps' + 'score.stage2_steps': SCoRe needs at least one step")
    torch.manual_seed(int(settings["seed"]))
    catalog = GameCatalog(score_games_config(settings["games"], score["games"]), settings["seed"])
    steps = score["stage1_steps"] + score["stage2_steps"]
    schedule = instance_schedule(catalog.all_instances("train"), score["instances_per_step"], steps,
                                 int(settings["seed"]))
    cfg, tokenizer, model = load_training_model(settings["model"], sft_adapter, cache_dir, implicit_prm=False)
    trainer = ScoreTrainer(settings, cfg, tokenizer, model, catalog)
    log.info("score: stage I %d steps, stage II %d steps, %d instances x %d episodes x 2 attempts, games %s, from %s",
             score["stage1_steps"], score["stage2_steps"], score["instances_per_step"], score["group_size"],
             ", ".join(score["games"]), sft_adapter)
    history = tracked_history((trainer.step(instances, index, 1 if index < score["stage1_steps"] else 2)
                               for index, instances in enumerate(schedule)), tracking)
    write_adapter(model, cfg.spec, adapter_dir, [POLICY_ADAPTER])
    metrics = {"status": "trained", "method": "score",
               "model": {"spec": cfg.spec, "sft_adapter": str(sft_adapter), "device": trainer.trainer.device,
                         "quantization": resolve_quantization(cfg, trainer.trainer.device),
                         "dtype": str(trainer.trainer.compute_dtype)},
               "stages": {str(stage): stage_summary(history, stage) for stage in STAGES},
               "history": history, "generation": trainer.trainer.policy.stats.as_dict()}
    finish_metrics(metrics, start, settings, metrics_path)
    write_adapter_card("score", adapter_dir, metrics)   # after finish_metrics: the final metrics
    log.info("score: %d steps in %.0f s; stage I reward t1 %s -> t2 %s; stage II %s -> %s; adapter %s", steps,
             metrics["seconds"], metrics["stages"]["1"]["reward_t1"], metrics["stages"]["1"]["reward_t2"],
             metrics["stages"]["2"]["reward_t1"], metrics["stages"]["2"]["reward_t2"], adapter_dir)
    return metrics

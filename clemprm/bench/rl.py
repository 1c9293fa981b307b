"""RL: lockstep rollout collection vs HF generate, an update's peak memory against episode length, sizing.

1. Rollout collection on SmolLM2 (the embedded default's train instances, ``rl.group_size`` episodes each,
   temperature 0.7): the trainer's lockstep collection (:func:`clemprm.rl.rollouts.collect_groups`: one generate
   call per engine step for every waiting episode) against one episode at a time with plain HF ``generate`` at
   batch 1 (how the SCoRe card's trainer collects), both through the same games and the same adapter-carrying
   model. Reports episodes/s of each and the ratio; ``--profile``: also a cProfile of the lockstep collection.
2. Peak memory of one policy update against episode length: episodes of T turns (each turn a fixed-length prompt
   and answer, so only the number of turns grows), the trainer's per-turn backward against one combined backward
   of the whole episode; each case in a fresh process (peak RSS above the high-water mark of a warm-up update).
3. ``--sizing``: is the RL stage big enough to change play? From an SFT adapter of the embedded default
   (``--results``: a run's ``sft/adapter``; or ``--sft-adapter``), greedy play of the SFT policy on the eval split,
   then per ``--setting``
   (a JSON object of ``rl`` keys, ``algorithm`` among them) the RL stage (:func:`clemprm.rl.trainer.train_rl`) and
   greedy play of its adapter: RL seconds, per-step reward spread (groups whose rewards are all equal, advantage
   statistics), and the greedy episodes whose answers differ from the SFT policy's, with % played, quality and
   success of both and their paired differences with bootstrap CIs (value, low, high; as in ``prm_eval.json``).

    python -m clemprm.bench rl [--instances 2] [--group-size 8] [--baseline-episodes 6] [--threads 1]
                               [--turns 1 2 4 8] [--skip-rollouts] [--skip-memory] [--profile]
    python -m clemprm.bench rl --sizing --results results --setting '{"algorithm": "grpo", "steps": 4}' ...
"""

from __future__ import annotations

import cProfile
import json
import os
import pstats
import resource
import subprocess
import sys
import time
from pathlib import Path

from clemprm.bench import Figures, RunFiles

SPEC = "embedded:smollm2-135m-instruct"


def untrained_adapter(folder: str, threads: int) -> str:
    """An SFT-shaped LoRA (the default ``sft.lora``; B = 0) for SmolLM2: the cost of the policy's adapter."""
    from peft import get_peft_model

    from clemprm.config import load_config
    from clemprm.models.loader import ModelConfig, load_tokenizer_and_model
    from clemprm.training import lora_config

    path = os.path.join(folder, "adapter")
    if not os.path.isdir(path):
        _, model = load_tokenizer_and_model(ModelConfig(spec=SPEC, threads=threads))
        get_peft_model(model, lora_config(load_config()["sft"]["lora"], "CAUSAL_LM")).save_pretrained(path)
    return path


class HFOneAtATime:
    """A policy that answers each perspective by itself with plain HF ``generate`` (batch 1, sampling)."""

    def __init__(self, policy):
        self.policy, self.name = policy, "hf-generate"

    def __deepcopy__(self, memo):
        return self

    def generate(self, perspectives, seeds=None, temperature=0.7, top_p=1.0, max_new_tokens=24):
        import torch

        from clemprm.play.contract import Generation

        tokenizer, model = self.policy.tokenizer, self.policy.model
        out = []
        for messages, seed in zip(perspectives, seeds or range(len(perspectives))):
            ids = tokenizer(self.policy.render(messages), add_special_tokens=False, return_tensors="pt")["input_ids"]
            torch.manual_seed(int(seed) & 0xFFFF_FFFF)
            with torch.inference_mode():
                generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                           temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens,
                                           pad_token_id=tokenizer.pad_token_id)
            new = generated[0, ids.shape[1]:].tolist()
            text = tokenizer.decode(new, skip_special_tokens=True)
            out.append(Generation(text=text.strip(), raw_text=text, prompt_tokens=ids.shape[1], new_tokens=len(new)))
        return out


def bench_rollouts(args, adapter: str, figures: Figures) -> None:
    from clemprm.play.catalog import GameCatalog
    from clemprm.config import load_config, rl_params
    from clemprm.play.engine import RolloutEngine
    from clemprm.stats import derive_seed
    from clemprm.rl.policy_adapter import load_training_model
    from clemprm.rl.trainer import RLTrainer, instance_schedule

    config = load_config(overrides={"model": {"threads": args.threads},
                                    "rl": {"group_size": args.group_size, "instances_per_step": args.instances}})
    settings = rl_params(config, "grpo")
    catalog = GameCatalog(config["games"])
    instances = instance_schedule(catalog.all_instances("train"), args.instances * len(catalog.games), 1,
                                  config["seed"])[0]
    cfg, tokenizer, model = load_training_model(config["model"], adapter, None, implicit_prm=False)
    trainer = RLTrainer(settings, cfg, tokenizer, model, catalog)
    profile = cProfile.Profile() if args.profile else None
    start = time.perf_counter()
    if profile:
        profile.enable()
    groups = trainer.rollouts(instances, step=0)
    lockstep_seconds = time.perf_counter() - start
    if profile:   # where the lockstep time goes: forwards (prefill: _prefill, decode: the rest of _decode) or not
        profile.disable()
        print(json.dumps({"generation": trainer.policy.stats.as_dict()}), flush=True)
        pstats.Stats(profile, stream=sys.stdout).sort_stats("cumulative").print_stats(40)
    lockstep_episodes = sum(len(group.rows) for group in groups)
    lockstep_tokens = sum(len(t.completion_ids) for g in groups for s in g.sequences for t in s.turns)

    baseline = HFOneAtATime(trainer.policy)
    engine = RolloutEngine(catalog, trainer.sampling)
    # the same episodes as the lockstep run, spread over instances (games differ in length), as many as asked
    pairs = [(instance, g) for g in range(args.group_size) for instance in instances][:args.baseline_episodes]
    model.eval()
    start = time.perf_counter()
    tokens = 0
    for instance, g in pairs:   # one episode at a time, each answer its own generate call
        game, experiment, game_id = instance.key
        episode_id = f"{game}/{experiment}/{game_id}/{g}"
        episode = engine.start(instance, [baseline], episode_id, derive_seed(config["seed"], "rl", 0, episode_id))
        engine.run([episode], label="hf generate")
        tokens += sum(turn["new_tokens"] for turn in episode.turns)
    baseline_seconds = time.perf_counter() - start
    lockstep_rate, baseline_rate = lockstep_episodes / lockstep_seconds, len(pairs) / baseline_seconds
    figures.add("lockstep collection", lockstep_rate, "episodes/s")
    figures.add("HF generate one at a time", baseline_rate, "episodes/s")
    figures.ratio("lockstep / HF generate", "lockstep collection", "HF generate one at a time")
    figures.add("lockstep collection tokens/s", lockstep_tokens / lockstep_seconds, "tokens/s")
    figures.add("HF generate tokens/s", tokens / baseline_seconds, "tokens/s")
    figures.note(f"rollouts: lockstep {lockstep_episodes} episodes in {lockstep_seconds:.1f} s, HF generate "
                 f"{len(pairs)} episodes in {baseline_seconds:.1f} s, {args.threads} thread(s)")


def memory_case(adapter: str, turns: int, mode: str, threads: int) -> dict:
    """Peak RSS (MB) above the loaded model of one update on an episode of ``turns`` turns (run in a fresh process)."""
    import torch

    from clemprm.rl.logprobs import answer_logprobs, reference_logprobs
    from clemprm.rl.rollouts import Turn
    from clemprm.rl.policy_adapter import load_training_model
    from clemprm.rl.policy_update import accumulate_policy_gradients, step_normaliser, turn_loss

    _, _, model = load_training_model({"spec": SPEC, "threads": threads}, adapter, None, implicit_prm=False)
    model.train()
    generator = torch.Generator().manual_seed(0)
    episode = [Turn(torch.randint(100, 40000, (256,), generator=generator).tolist(),
                    torch.randint(100, 40000, (24,), generator=generator).tolist(), advantages=[1.0] * 24)
               for _ in range(turns)]
    normaliser = step_normaliser(episode, "tokens", 24)
    # warm-up on a short turn: weight pages and allocator pools are in place before the high-water mark is read
    accumulate_policy_gradients(model, [Turn(episode[0].prompt_ids[:8], episode[0].completion_ids[:2],
                                             advantages=[1.0] * 2)], kl_beta=0.0, normaliser=normaliser)
    model.zero_grad(set_to_none=True)
    loaded = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if mode == "per_turn":
        accumulate_policy_gradients(model, episode, kl_beta=0.0, normaliser=normaliser)
    else:   # every turn's graph kept until one backward of the episode
        total = 0
        for turn in episode:
            logp = answer_logprobs(model, turn.prompt_ids, turn.completion_ids)
            reference = reference_logprobs(model, turn.prompt_ids, turn.completion_ids)
            total = total + turn_loss(logp, reference, torch.tensor(turn.advantages), 0.0, normaliser)[0]
        total.backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"turns": turns, "mode": mode, "peak_rss_above_warm_mb": round(peak - loaded, 1),
            "seconds": round(time.perf_counter() - start, 1)}


def bench_memory(args, adapter: str, figures: Figures) -> None:
    for turns in args.turns:
        for mode in ("per_turn", "combined"):
            result = subprocess.run([sys.executable, "-m", "clemprm.bench.rl", adapter, str(turns), mode,
                                     str(args.threads)], capture_output=True, text=True, check=True)
            row = json.loads(result.stdout.strip().splitlines()[-1])
            figures.add(f"update of {turns} turn(s), {mode}: peak RSS above warm", row["peak_rss_above_warm_mb"], "MB")
            figures.add(f"update of {turns} turn(s), {mode}: seconds", row["seconds"], "s")


def greedy_play(config: dict, adapter: str, output: str) -> list[dict]:
    """The policy ``model`` + ``adapter`` played greedily on the eval split (the greedy eval modes' episodes)."""
    from clemprm.config import eval_mode_params
    from clemprm.evaluation.evaluate import evaluate_mode

    return evaluate_mode("greedy_sft", eval_mode_params(config, "greedy_sft"), output, sft_adapter=adapter)


def play_summary(rows: list[dict]) -> dict:
    played = [row for row in rows if not row["aborted"]]
    return {"episodes": len(rows), "percent_played": round(100 * len(played) / max(1, len(rows)), 1),
            "quality": round(sum(row["bench_score"] for row in played) / len(played), 2) if played else None,
            "success_rate": round(100 * sum(bool(row["success"]) for row in rows) / max(1, len(rows)), 1)}


def answers(row: dict) -> list[str]:
    return [turn["response"] for turn in row["turns"]]


def paired_difference(rows: list[dict], baseline: list[dict], config: dict) -> dict:
    """``rows`` minus ``baseline`` per game and overall with paired bootstrap CIs (as prm_eval.json's differences)."""
    from clemprm.evaluation.evaluate import difference, instance_table

    result = difference(instance_table(rows), instance_table(baseline), config["eval"]["bootstrap_samples"],
                        config["seed"], config["eval"]["ci"])
    def rounded(value):
        return None if value is None else round(value, 1)
    return {group: {metric: [rounded(estimate[key]) for key in ("value", "ci_low", "ci_high")]
                    for metric, estimate in metrics.items() if metric != "instances"}
            for group, metrics in result.items()}


def bench_sizing(args, sft_adapter: str, figures: Figures) -> None:
    from clemprm.config import load_config
    from clemprm.rl.trainer import train_rl

    config = load_config(overrides={"model": {"threads": args.threads}})
    folder = str(args.workdir / "sizing")
    start = time.perf_counter()
    sft_rows = greedy_play(config, sft_adapter, os.path.join(folder, "greedy_sft.parquet"))
    print(json.dumps({"greedy_sft": {**play_summary(sft_rows), "seconds": round(time.perf_counter() - start, 1)}}),
          flush=True)
    figures.add("greedy_sft % played", play_summary(sft_rows)["percent_played"], "%")
    sft_answers = {row["episode_id"]: answers(row) for row in sft_rows}
    base_rl = {key: value for key, value in config["rl"].items() if key not in ("algorithm", "algorithms")}
    for index, setting in enumerate(args.setting):
        rl = {**base_rl, **json.loads(setting)}
        settings = {"seed": config["seed"], "model": config["model"], "games": config["games"], "rl": rl}
        out = os.path.join(folder, str(index))
        start = time.perf_counter()
        metrics = train_rl(settings, sft_adapter, os.path.join(out, "adapter"), os.path.join(out, "metrics.json"))
        rl_seconds = time.perf_counter() - start
        rows = greedy_play(config, os.path.join(out, "adapter"), os.path.join(out, "greedy_rl.parquet"))
        figures.add(f"setting {index}: RL", rl_seconds, "s")
        figures.add(f"setting {index}: greedy % played", play_summary(rows)["percent_played"], "%")
        figures.add(f"setting {index}: episodes changed", sum(answers(row) != sft_answers[row["episode_id"]]
                                                             for row in rows), f"of {len(rows)}")
        figures.note(f"setting {index}: {setting}")
        history = metrics["history"]
        groups = len(history[0]["instances"]) * len(history)
        print(json.dumps({"setting": json.loads(setting), "rl_seconds": round(rl_seconds, 1),
                          "steps": [{"reward": {k: round(v, 3) for k, v in h["reward"].items()},
                                     "success_rate": round(h["success_rate"], 1),
                                     "percent_played": round(h["percent_played"], 1),
                                     "zero_advantage_groups": h.get("zero_advantage_groups"),
                                     "outcome_advantage": h["outcome_advantage"],
                                     "trained_turns": h["trained_turns"], "policy_turns": h["policy_turns"],
                                     "grad_norm": round(h["grad_norm"], 4), "kl": h["kl"],
                                     "seconds": h["seconds"]} for h in history],
                          "groups_with_equal_rewards": f"{sum(h.get('zero_advantage_groups', 0) for h in history)}"
                                                       f"/{groups}",
                          "greedy_rl": play_summary(rows), "greedy_sft": play_summary(sft_rows),
                          "greedy_rl_minus_greedy_sft": paired_difference(rows, sft_rows, config),
                          "episodes_changed": sum(answers(row) != sft_answers[row["episode_id"]] for row in rows),
                          "turns": sum(len(answers(row)) for row in rows)}), flush=True)


def add_arguments(parser) -> None:
    parser.add_argument("--instances", type=int, default=2, help="train instances per game")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--baseline-episodes", type=int, default=6, help="of those, episodes played one at a time")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--turns", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--skip-rollouts", action="store_true")
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--profile", action="store_true", help="cProfile the lockstep collection (1.)")
    parser.add_argument("--sizing", action="store_true", help="measure whether RL changes greedy play (3.)")
    parser.add_argument("--results", type=Path, help="--sizing: a run's results folder (its SFT adapter)")
    parser.add_argument("--sft-adapter", help="--sizing: the SFT adapter (instead of --results)")
    parser.add_argument("--setting", action="append", default=[], help="--sizing: a JSON object of rl keys")


def run(args) -> Figures:
    import logging
    logging.basicConfig(level=logging.WARNING)
    figures = Figures("rl")
    figures.note("shared machine: figures are pessimistic when other processes compete for the cores")
    if args.sizing:
        if not (args.results or args.sft_adapter):
            raise SystemExit("--sizing needs the SFT adapter RL starts from: --results DIR or --sft-adapter DIR")
        bench_sizing(args, args.sft_adapter or str(RunFiles(args.results).sft_adapter()), figures)
        return figures
    adapter = untrained_adapter(str(args.workdir), args.threads)   # made once per work folder
    if not args.skip_rollouts:
        bench_rollouts(args, adapter, figures)
    if not args.skip_memory:
        bench_memory(args, adapter, figures)
    return figures


if __name__ == "__main__":   # one memory case in a fresh process (bench_memory): ADAPTER TURNS MODE THREADS
    print(json.dumps(memory_case(sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))))

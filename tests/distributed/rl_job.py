"""GRPO, PRIME and SCoRe steps of the tiny model on two forced guessnumber instances, in as many processes as torchrun
starts (or one, run plainly): tests/test_distributed.py runs it at world size 1 and 2 and compares the adapters and
the step metrics.

    PYTHONPATH=. python tests/distributed/rl_job.py SFT_ADAPTER OUT_DIR CACHE_DIR
    PYTHONPATH=. python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/rl_job.py ...
"""

import dataclasses
import logging
import sys
from pathlib import Path

from clemprm import distributed
from clemprm.records import write_json


def main(sft_adapter: str, out: Path, cache_dir: str) -> None:
    distributed.init_from_environment()
    logging.basicConfig(level=logging.INFO, format=f"rank {distributed.rank()}: %(name)s: %(message)s")
    from clemprm.play.catalog import GameCatalog
    from clemprm.rl import policy_adapter, score, trainer
    from clemprm.training import write_adapter
    from tests.test_rl import FORCED, rl_settings
    from tests.test_score import score_settings

    # two instances, one per rank: "1" wins the first, "2" the second
    instances = [FORCED, dataclasses.replace(FORCED, instance={"game_id": 1, "target": 2})]
    for algorithm in ("grpo", "prime"):
        # the SFT adapter has no LoRA dropout, and PRIME's PRM none either: each process would draw its own masks
        settings = rl_settings(algorithm=algorithm, steps=2, group_size=4, instances_per_step=2, temperature=1.0,
                               lr=5e-3, warmup_ratio=0.0, max_new_tokens=8, kl_beta=0.05,
                               prime={"lr": 1e-2, "accuracy_filter": None})
        cfg, tokenizer, model = policy_adapter.load_training_model(settings["model"], sft_adapter, cache_dir,
                                                                   implicit_prm=algorithm == "prime")
        rl = trainer.RLTrainer(settings, cfg, tokenizer, model, GameCatalog(settings["games"]))
        history = [rl.step(instances, step) for step in range(2)]
        adapters = [policy_adapter.POLICY_ADAPTER] + (["prm"] if algorithm == "prime" else [])
        write_adapter(model, cfg.spec, out / algorithm, adapters)
        write_json(out / f"{algorithm}_history.json", [{key: value for key, value in step.items() if key != "seconds"}
                                                      for step in history])
    # SCoRe: a stage I and a stage II step (attempt 1 as GRPO's rollouts, then attempt 2 of each of its episodes)
    settings = score_settings(stage1_steps=1, stage2_steps=1, group_size=4, instances_per_step=2, temperature=1.0,
                              lr=5e-3, warmup_ratio=0.0, max_new_tokens=8)
    cfg, tokenizer, model = policy_adapter.load_training_model(settings["model"], sft_adapter, cache_dir,
                                                               implicit_prm=False)
    scorer = score.ScoreTrainer(settings, cfg, tokenizer, model, GameCatalog(settings["games"]))
    history = [scorer.step(instances, step, stage) for step, stage in ((0, 1), (1, 2))]
    write_adapter(model, cfg.spec, out / "score", [policy_adapter.POLICY_ADAPTER])
    write_json(out / "score_history.json", [{key: value for key, value in step.items() if key != "seconds"}
                                            for step in history])


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), sys.argv[3])

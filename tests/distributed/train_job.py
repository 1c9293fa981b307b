"""SFT and the PRM of the tiny model on a completed run's records, in as many processes as torchrun starts (or one,
run plainly): tests/test_distributed.py runs it at world size 1 and 2 and compares the adapters.

    python tests/distributed/train_job.py RUN_DIR OUT_DIR CACHE_DIR
    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/train_job.py RUN_DIR OUT_DIR CACHE_DIR
"""

import logging
import sys
from pathlib import Path

from clemprm import distributed
from clemprm.config import load_config


def main(run_dir: Path, out: Path, cache_dir: str) -> None:
    distributed.init_from_environment()
    logging.basicConfig(level=logging.INFO, format=f"rank {distributed.rank()}: %(name)s: %(message)s")
    from clemprm.stages import prm, prm_evaluation, sft

    # dropout 0: each process draws its own dropout masks, so weights compare only without it; grad_accum 2: one
    # process accumulates 2 batches, two processes 1 each (the same effective batch); train sets of a multiple of
    # the effective batch (4 SFT pairs, 16 PRM pairs): DDP fills an uneven last step with repeated examples
    lora = {"r": 4, "alpha": 8, "dropout": 0.0}
    config = load_config(overrides={
        "model": {"spec": "tiny:0", "threads": 1},
        "sft": {"epochs": 2, "batch_size": 2, "grad_accum": 2, "max_examples": 4, "lr": 1e-2,
                "validation_fraction": 0.25, "extra_data": str(run_dir / "extra.jsonl"), "lora": lora},
        # pointwise pairs, a validation slice for the best epoch (the embedded default batches whole states instead)
        # (whole sibling groups: on the tiny run's labels validation_fraction 0.25 leaves 16 of them; the test checks)
        "prm": {"epochs": 2, "batch_size": 4, "grad_accum": 2, "max_examples": 16, "lr": 1e-2, "lora": lora,
                "pairwise_weight": 0.0, "validation_fraction": 0.25}})
    settings = {name: config[name] for name in ("seed", "model", "sft", "prm")}
    sft.train_sft(settings, str(run_dir / "results/sft/sft_data.parquet"), str(out / "sft"),
                  str(out / "sft_metrics.json"), cache_dir, on_failure="continue")
    labels = str(run_dir / "results/labels/soft_labels.parquet")
    prm.train_prm(settings, labels, str(out / "prm"), str(out / "prm_predictions.parquet"), cache_dir)
    if distributed.is_main():   # rule prm_metrics: one process, after the training wrote the predictions
        prm_evaluation.measure_prm(settings, labels, str(out / "prm_predictions.parquet"),
                                   str(out / "prm_metrics.json"), on_failure="continue")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])

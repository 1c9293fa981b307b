"""The engine's decoder vs a vLLM server on the embedded SmolLM2: tokens/s, greedy agreement, real workloads.

Both backends on the same prompts and settings: clemprm's decoder (``engine``) and a vLLM server (``vllm``: vLLM's
CPU build here, fp32 and bf16).

1. decoding speed: generated tokens/s at each batch size, every row generating exactly ``--new-tokens`` tokens
   (end tokens suppressed on both: ``ignore_eos`` on vLLM, ``min_new_tokens`` on the engine), T 0.7 / top-p 0.9 /
   top-k 50, ``--repeat`` runs of each, each backend alone on the machine (an idle vLLM CPU server's threads spin);
2. greedy agreement: the share of greedy answers (natural length, 32 tokens) that are token-identical;
3. real workloads: the embedded default's ``base_rollouts`` and one ``soft_labels`` shard (on the base policy's
   branch points) through each backend: seconds and record counts.

    python -m clemprm.bench vllm --vllm-python .venv-vllm/bin/python
    python -m clemprm.bench vllm --vllm-python .venv-vllm/bin/python --batch-sizes 32,128 --skip-workloads

Measure on a quiet machine: vLLM's spinning threads win a contended CPU, so figures under load flip.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from clemprm.bench import Figures
from clemprm.bench.generation import make_prompts
from clemprm.config import job_environment, load_config, policy_model
from clemprm.models.generation import PolicyModel
from clemprm.models.loader import ModelConfig, resolve_model_dir
from clemprm.models.sampling import SamplingParams
from clemprm.models.vllm_backend import VLLMServer, vllm_settings

REPEATS_ITSELF = True   # each backend alone, --repeat runs of each (not interleaved: see above)


def engine_speed(policy: PolicyModel, prompts: list[list[int]], params: SamplingParams) -> float:
    """Tokens/s of the engine's decoder with every row running to max_new_tokens (``min_new_tokens``)."""
    fixed = SamplingParams(**{**params.__dict__, "min_new_tokens": params.max_new_tokens})
    start = time.perf_counter()
    out = policy.decoder.generate(prompts, fixed, list(range(len(prompts))), token_budget=policy.cfg.token_budget)
    return sum(len(ids) for ids, _ in out) / (time.perf_counter() - start)


def vllm_speed(server: VLLMServer, prompts: list[list[int]], params: SamplingParams) -> float:
    from clemprm.models.vllm_backend import VLLMDecoder

    decoder = VLLMDecoder(server, server.served_name, eos_token_ids=[], concurrency=256)
    decoder.request_extras = {"ignore_eos": True}
    start = time.perf_counter()
    out = decoder.generate(prompts, params, list(range(len(prompts))))
    seconds = time.perf_counter() - start
    return sum(len(ids or []) for ids, _, _ in out) / seconds


def workloads(python: str, cache_dir: str, work: Path, threads: int, figures: Figures) -> None:
    """base_rollouts and one soft_labels shard of the embedded default through each backend."""
    from clemprm import records
    from clemprm.stages import branch_points, labels, rollouts

    for backend in ("engine", "vllm"):
        overrides = {"model": {"threads": threads}, "generation": {"backend": backend,
                                                                   "vllm": {"python": python, "kv_cache_gb": 2}}}
        config = {**load_config(overrides=overrides), "cache_dir": cache_dir}
        os.environ.update(job_environment(config))
        os.environ["CLEMPRM_LOG"] = str(work / f"{backend}.log")
        settings = {"seed": config["seed"], "games": config["games"], "model": policy_model(config)}
        start = time.perf_counter()
        rows = rollouts.base_rollouts({**settings, "base_rollouts": config["base_rollouts"]},
                                      str(work / f"{backend}-rollouts.parquet"), cache_dir)
        rollout_s = time.perf_counter() - start
        if backend == "engine":   # the branch points both shards label: the base policy's, made once
            branch_points.branch_points({**settings, "branch_points": config["branch_points"]}, None,
                                        str(work / "episodes.parquet"), str(work / "branch_points.parquet"), cache_dir)
        shards = config["labels"]["shards"]
        start = time.perf_counter()
        shard = labels.soft_labels_shard({**settings, "labels": config["labels"]}, str(work / "branch_points.parquet"),
                                         None, 0, shards, str(work / f"{backend}-shard.parquet"), cache_dir)
        shard_s = time.perf_counter() - start
        figures.add(f"{backend} base_rollouts", rollout_s, "s")
        figures.add(f"{backend} soft_labels shard", shard_s, "s")
        figures.note(f"{backend}: base_rollouts {len(rows)} episodes, {sum(row['error'] is not None for row in rows)} "
                     f"errors; soft_labels shard 0/{shards}: {len(shard)} labels of "
                     f"{len(labels.shard_rows(records.read_records(work / 'branch_points.parquet'), 0, shards))} "
                     "branch points" + (" (server start included)" if backend == "vllm" else ""))


def add_arguments(parser) -> None:
    parser.add_argument("--vllm-python", required=True, help="the Python of the vLLM virtualenv")
    parser.add_argument("--batch-sizes", default="32,128")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--dtypes", default="float32,bfloat16", help="vLLM dtypes to time (float32 first: the "
                        "greedy agreement and the workloads run on it)")
    parser.add_argument("--skip-workloads", action="store_true")
    parser.set_defaults(repeat=2)


def run(args) -> Figures:
    cfg = ModelConfig(threads=args.threads, cache_dir=args.cache_dir)
    policy = PolicyModel(cfg)
    work = args.workdir
    figures = Figures("vllm")
    sampling = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, max_new_tokens=args.new_tokens)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    prompts = {batch: [policy._tokenize([policy.render(m)])[0] for m in make_prompts(batch, 67, policy)]
               for batch in batches}
    greedy = SamplingParams(temperature=0.0, top_p=1.0, top_k=0, max_new_tokens=32)
    greedy_prompts = [policy._tokenize([policy.render(m)])[0] for m in make_prompts(64, 67, policy)]
    # one at a time: an idle vLLM CPU server's threads spin and would slow whatever runs beside it
    figures.note(f"decoding speed: {args.new_tokens} new tokens per row, T 0.7 / top-p 0.9 / top-k 50; "
                 f"{args.repeat} runs of each, each backend alone on the machine")
    for batch in batches:
        for _ in range(args.repeat):
            figures.add(f"engine batch {batch}", engine_speed(policy, prompts[batch], sampling), "tokens/s")
    engine_greedy = policy.decoder.generate(greedy_prompts, greedy, list(range(64)), token_budget=cfg.token_budget)
    agreement = None
    for dtype in args.dtypes.split(","):
        server = VLLMServer(resolve_model_dir(cfg), settings=vllm_settings({"python": args.vllm_python,
                                                                            "kv_cache_gb": 2}),
                            dtype=dtype, max_model_len=3072, seed=0, max_lora_rank=16,
                            log_path=work / f"vllm-{dtype}.log")
        try:
            for batch in batches:
                for _ in range(args.repeat):
                    figures.add(f"vllm {dtype} batch {batch}", vllm_speed(server, prompts[batch], sampling),
                                "tokens/s")
                if dtype == "float32":   # the runs are not interleaved (one backend at a time): best against best
                    best = [max(figures.figures[f"{name} batch {batch}"].samples)
                            for name in ("vllm float32", "engine")]
                    figures.add(f"vllm fp32 / engine batch {batch}", best[0] / best[1], "x (best of each)")
            if dtype == "float32":
                from clemprm.models.vllm_backend import VLLMDecoder
                vllm_greedy = VLLMDecoder(server, server.served_name, eos_token_ids=policy.decoder.eos,
                                          concurrency=64).generate(greedy_prompts, greedy, list(range(64)))
                agreement = sum(a[0] == b[0] for a, b in zip(engine_greedy, vllm_greedy))
        finally:
            server.stop()
    figures.note(f"greedy agreement (fp32, 64 prompts, up to 32 tokens): {agreement}/64 answers token-identical")
    if not args.skip_workloads:
        workloads(args.vllm_python, args.cache_dir, work, args.threads, figures)
    return figures

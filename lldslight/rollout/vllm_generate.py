"""The vLLM generation backend: the Search-R1 protocol sampled by vLLM, token ids in and out, the
policy's LoRA adapter pushed to vLLM after every update and proven there by the weight-sync probe.

Two modes, as GPU recipes run vLLM:

- ``server`` (default): a vLLM OpenAI-compatible server on loopback, in its own Python environment
  (vLLM pins its own transformers). lldslight starts it (``python -m
  vllm.entrypoints.openai.api_server`` from ``python``, stopped when the run ends) or attaches to one
  you run (``url``). Turns go to ``/v1/completions`` as token ids; the adapter is loaded with
  ``/v1/load_lora_adapter`` (``load_inplace``, one fixed name).
- ``inprocess``: ``vllm.LLM`` in the trainer's own process (TRL's "colocate"), where vLLM is
  importable next to lldslight; the adapter goes in with ``add_lora`` (``load_inplace``, one fixed id).
  There, ``weights: merged`` instead reloads every weight into vLLM's model (the adapted layers' as
  W + BA): no LoRA kernels in vLLM, and the way full fine-tuning reaches it.

What vLLM does by itself that would silently break training, and what is done about it here:

- a LoRA name or id loaded again *without* ``load_inplace`` keeps serving the OLD adapter, with no
  warning: every sync here loads in place, and the probe below fails a run where a sync did not take;
- vLLM's prefix cache keys a LoRA request by its name and path, so an adapter reloaded in place from
  the same path would reuse prompt blocks computed with the old weights: each sync writes the
  adapter to a new folder (and removes the previous one);
- a server fills what a request leaves out from the model's generation_config, and returns log-probs
  before temperature by default: the server is started with ``--generation-config vllm`` and
  ``--logprobs-mode processed_logprobs``, every sampling field is sent, and a server attached to
  is checked for the log-prob mode when the temperature is not 1;
- stop strings are matched on vLLM's detokenised text: each turn's ids are replayed through the
  protocol's own rule (``EpisodeRules.turn_stops``), so a turn ends exactly where the engine's would.

After every sync (and before the first step) the backend scores the weight-sync probe
(lldslight/rollout/sync.py) through vLLM and through the trainer's plain forward, token by token,
and stops the run when they differ by more than ``probe_tolerance`` (nats per token, mean absolute):
a stale or ignored adapter, a server serving another model, an adapter vLLM bound to other modules.

Log-probs: vLLM returns, with ``processed_logprobs``, those of the distribution it sampled from,
after temperature *and* top-k/top-p; lldslight's are of the temperature-scaled distribution before
top-k/top-p (backend.py). The two agree only without top-k/top-p, so this backend refuses
``rollout.top_k`` / ``rollout.top_p``.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any, Literal, Optional

import torch
from torch import nn

from lldslight.data.example import QAExample
from lldslight.errors import ConfigError, UserError, require, require_choice
from lldslight.retrieval.base import Retriever
from lldslight.rewards import RewardFn
from lldslight.trajectory import Trajectory

from .engine import RolloutConfig
from .episode import Episode, EpisodeRules
from .layout import Layout
from .protocol import STOP_TAGS, prompt_token_ids
from .settings import SamplingSettings
from .sync import SyncMismatch

Mode = Literal["server", "inprocess"]
Weights = Literal["lora", "merged"]
DType = Literal["auto", "float32", "bfloat16"]

# The oldest vLLM whose API this backend uses as it does (load_inplace, return_token_ids,
# --logprobs-mode processed_logprobs, --generation-config vllm). Tested with 0.32.0.
MIN_VLLM = (0, 11, 0)
# vLLM accepts only these as --max-lora-rank (vllm/config/lora.py MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_NAME = "lldslight-policy"
ADAPTER_ID = 1


class VLLMError(UserError, RuntimeError):
    """vLLM cannot serve this run: absent or too old, a server that does not answer, is not vLLM,
    died, or refused an adapter. One line, naming the setting or the server at fault."""


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def check_vllm_version(version: str, where: str) -> None:
    """A VLLMError when ``version`` is older than :data:`MIN_VLLM`."""
    if _version_tuple(version) < MIN_VLLM:
        raise VLLMError(f"{where}: vLLM {version} is too old for VLLMGenerate (it needs >= "
                        f"{'.'.join(map(str, MIN_VLLM))}: load_inplace, return_token_ids, processed_logprobs)")


def default_python() -> str:
    """The interpreter that runs a server lldslight starts: ``.venv-vllm`` beside the project
    (scripts/setup_vllm.sh makes it), else this one."""
    here = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"
    return str(here) if here.is_file() else sys.executable


@dataclasses.dataclass
class _Turn:
    """What vLLM returned for one turn: token ids, their sampled log-probs, why it stopped."""

    ids: list[int]
    logp: list[float]
    finish: str


# -- clients: one for a server, one for vllm.LLM ---------------------------------------------------


class _ServerClient:
    """vLLM's OpenAI-compatible server over HTTP (started here or attached to)."""

    def __init__(self, url: str, timeout_s: float, concurrency: int, process: Optional["_ServerProcess"]) -> None:
        import httpx

        self.url = url.rstrip("/")
        self.process = process
        self.http = httpx.Client(base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, concurrency), thread_name_prefix="lldslight-vllm")
        self.model_name = ""
        self.root = ""
        self.max_model_len = 0

    def _post(self, path: str, body: dict) -> Any:
        import httpx

        try:
            response = self.http.post(path, json=body)
        except httpx.HTTPError as err:
            raise VLLMError(self._gone(f"{path}: {type(err).__name__}: {err}")) from None
        if response.status_code != 200:
            raise VLLMError(f"the vLLM server at {self.url} refused {path}: HTTP {response.status_code}: "
                            f"{_error_message(response)}")
        return response

    def _gone(self, what: str) -> str:
        """The one line for a server that stopped answering: its exit status and last log line when
        lldslight started it."""
        if self.process is not None and self.process.proc.poll() is not None:
            return (f"the vLLM server lldslight started at {self.url} has exited (status {self.process.proc.returncode}; "
                    f"its log {self.process.log_path}: {self.process.last_log_line()})")
        return f"the vLLM server at {self.url} stopped answering ({what})"

    def connect(self) -> None:
        """Check that the URL answers and is vLLM, of a version this backend can use."""
        import httpx

        try:
            version = self.http.get("/version", timeout=10.0)
            models = self.http.get("/v1/models", timeout=10.0)
        except httpx.HTTPError as err:
            raise VLLMError(f"VLLMGenerate.url: {self.url} does not answer ({type(err).__name__}: {err}); start the "
                            "server first (docs/generation_backends.md) or leave url unset to let lldslight start one") from None
        number, cards = _json_field(version, "version"), _json_field(models, "data")
        cards = [c for c in cards if isinstance(c, dict)] if isinstance(cards, list) else []
        owned = {c.get("owned_by") for c in cards}
        if version.status_code != 200 or not isinstance(number, str) or "vllm" not in owned:
            raise VLLMError(f"VLLMGenerate.url: {self.url} is not a vLLM server (GET /version -> HTTP {version.status_code}, "
                            f"GET /v1/models -> HTTP {models.status_code}, owned_by {sorted(map(str, owned)) or 'none'})")
        check_vllm_version(number, f"VLLMGenerate.url {self.url}")
        base = [c for c in cards if not c.get("parent")]
        self.model_name, self.root = base[0]["id"], base[0].get("root") or base[0]["id"]
        self.max_model_len = int(base[0].get("max_model_len") or 0)

    def complete(self, prompts: list[list[int]], params: list[dict], adapter: Optional[str]) -> list[_Turn]:
        model = ADAPTER_NAME if adapter else self.model_name
        futures = [self.pool.submit(self._complete_one, model, p, q) for p, q in zip(prompts, params)]
        return [f.result() for f in futures]

    def _complete_one(self, model: str, prompt: list[int], params: dict) -> _Turn:
        body = {"model": model, "prompt": prompt, "logprobs": 0, "return_token_ids": True, "echo": False, "n": 1,
                "stream": False, **params}
        choice = self._post("/v1/completions", body).json()["choices"][0]
        ids = [int(t) for t in choice["token_ids"]]
        logp = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        return _Turn(ids, logp, str(choice.get("finish_reason")))

    def prompt_logprobs(self, ids: list[int], adapter: Optional[str]) -> list[float]:
        body = {"model": ADAPTER_NAME if adapter else self.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0.0,
                "prompt_logprobs": 0}
        rows = self._post("/v1/completions", body).json()["choices"][0]["prompt_logprobs"]
        return [float(row[str(t)]["logprob"]) for row, t in zip(rows[1:], ids[1:])]

    def load_adapter(self, path: str) -> None:
        self._post("/v1/load_lora_adapter", {"lora_name": ADAPTER_NAME, "lora_path": path, "load_inplace": True})

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.http.close()
        if self.process is not None:
            self.process.stop()


def _json_field(response, key: str) -> Any:
    """``response.json()[key]``, or None when the body is not a JSON object holding it."""
    try:
        body = response.json()
    except ValueError:
        return None
    return body.get(key) if isinstance(body, dict) else None


def _error_message(response) -> str:
    try:
        body = response.json()
        message = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message") or body.get("detail")
        return " ".join(str(message).split())[:400]
    except ValueError:
        return " ".join(response.text.split())[:400]


class _ServerProcess:
    """A vLLM server lldslight started: its own process group, stopped at exit."""

    def __init__(self, python: str, args: list[str], env: dict, log_path: Path) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([python, "-m", "vllm.entrypoints.openai.api_server", *args], stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, start_new_session=True)
        # the server must not outlive the run, whatever ends it
        self._finalizer = weakref.finalize(self, _stop_process, self.proc)
        atexit.register(self._finalizer)

    def last_log_line(self) -> str:
        try:
            lines = [ln for ln in self.log_path.read_text(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "no log"
        errors = [ln for ln in lines if "Error" in ln or "error:" in ln]
        return " ".join((errors or lines or ["empty"])[-1].split())[:400]

    def stop(self) -> None:
        self._finalizer()
        self.log.close()


def _stop_process(proc: subprocess.Popen) -> None:
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, PermissionError):
        return
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _InProcessClient:
    """``vllm.LLM`` in this process (its engine core too: no second process, no HTTP)."""

    def __init__(self, kwargs: dict) -> None:
        try:
            import vllm
        except ImportError as err:
            raise VLLMError(f"VLLMGenerate.mode: 'inprocess' needs vLLM in this Python environment ({sys.executable}: "
                            f"{err}); use mode: server (vLLM in its own environment, scripts/setup_vllm.sh)") from None
        check_vllm_version(vllm.__version__, "VLLMGenerate.mode 'inprocess'")
        from vllm import LLM

        # vLLM's CPU worker pins its threads and replaces torch.set_num_threads for the whole process;
        # the trainer shares this process, so its thread count is put back afterwards.
        threads, set_threads = torch.get_num_threads(), torch.set_num_threads
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            self.llm = LLM(**kwargs)
        finally:
            torch.set_num_threads = set_threads
            torch.set_num_threads(threads)
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.path: Optional[str] = None

    def _lora(self, adapter: Optional[str]):
        from vllm.lora.request import LoRARequest

        return LoRARequest(ADAPTER_NAME, ADAPTER_ID, adapter) if adapter else None

    def complete(self, prompts: list[list[int]], params: list[dict], adapter: Optional[str]) -> list[_Turn]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sampling = [SamplingParams(logprobs=0, **p) for p in params]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling,
                                 lora_request=self._lora(adapter), use_tqdm=False)
        turns = []
        for out in outs:
            o = out.outputs[0]
            ids = list(o.token_ids)
            turns.append(_Turn(ids, [float(step[t].logprob) for step, t in zip(o.logprobs, ids)], str(o.finish_reason)))
        return turns

    def prompt_logprobs(self, ids: list[int], adapter: Optional[str]) -> list[float]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0),
                                lora_request=self._lora(adapter), use_tqdm=False)[0]
        return [float(row[t].logprob) for row, t in zip(out.prompt_logprobs[1:], ids[1:])]

    def load_adapter(self, path: str) -> None:
        from vllm.lora.request import LoRARequest

        try:
            self.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, path, load_inplace=True))
        except Exception as err:  # vLLM raises plain exceptions (ValueError, RuntimeError) for a bad adapter
            raise VLLMError(f"vLLM refused the policy's adapter: {' '.join(str(err).split())[:400]}") from None

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Reload vLLM's model in place from ``(name, tensor)`` pairs (Hugging Face names; vLLM
        maps them onto its fused layers and repacks them for its kernels), then drop its prefix
        cache (blocks computed with the old weights would be reused otherwise)."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        self.llm = None



# -- the backend -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Connection:
    """One vLLM (a server or an LLM) and the adapter it serves, shared by the backends built with
    the same arguments (SearchRollout builds one for training and one for evaluation)."""

    client: Any
    workdir: Path
    probe_tolerance: float
    adapter: Optional[str] = None  # the folder vLLM serves the adapter from now
    synced: Optional[list] = None  # the adapter's weights as last pushed
    syncs: int = 0  # weight pushes (adapters, or merged weights)


_CONNECTIONS: dict[tuple, _Connection] = {}


class VLLMGenerate:
    """Samples Search-R1 trajectories with vLLM (a GenerationBackend; backend.py).

    Args:
        tokenizer (transformers.PreTrainedTokenizerBase): the policy's tokenizer.
        retriever: any object with ``search(queries, k) -> list[list[Passage]]``.
        reward_fn: the reward (rewards.RewardFn).
        config: sampling settings (rollout.RolloutConfig); top_k and top_p must be off.
        mode: ``server`` (vLLM in its own process and environment) or ``inprocess`` (``vllm.LLM`` here).
        url: a running vLLM server to attach to (``http://127.0.0.1:8000``); unset, lldslight starts
            one on a free loopback port and stops it when the run ends. Adapters are passed by path:
            the server must see this machine's files.
        model: the base weights vLLM serves (a Hugging Face folder); unset, the folder the policy was
            loaded from. The probe refuses a server whose model is not the trainer's.
        python: the interpreter that runs a server lldslight starts (default ``.venv-vllm/bin/python``
            beside the project, made by scripts/setup_vllm.sh).
        dtype: vLLM's dtype; ``auto`` follows the policy's arithmetic (float32, or bfloat16 under
            bf16 precisions).
        max_lora_rank: the server's ``--max-lora-rank`` when lldslight starts it (default: the
            policy's rank, rounded up to a value vLLM accepts).
        max_model_len: vLLM's context length (default: the model's, capped at 4096).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` on a CPU (GiB); on a GPU vLLM sizes its cache itself.
        gpu_memory_utilization: on a GPU, the share of its memory vLLM may take (the trainer needs the rest).
        enforce_eager: no CUDA graphs or torch.compile in vLLM; default on a CPU (compiling costs
            minutes there), off on a GPU.
        probe_tolerance: the most the probe's per-token log-probs may differ, mean absolute (nats),
            between vLLM and the trainer after a sync; default 0.01 in float32, 0.1 in bfloat16.
        startup_timeout_s: how long a server lldslight starts may take to answer.
        request_timeout_s: how long one request may take.
        concurrency: requests in flight at once (server mode): vLLM batches them.
        weights: how the trainer's weights reach vLLM after each update: ``lora`` (the adapter,
            loaded in place; both modes) or ``merged`` (mode ``inprocess`` only: every weight,
            the adapted layers' as W + BA, reloaded into vLLM's model in place, the prefix cache
            dropped; also full fine-tuning's way).
        server_args: further arguments for a server lldslight starts.
    """

    def __init__(self, tokenizer: Any, retriever: Retriever, reward_fn: RewardFn, config: RolloutConfig, mode: Mode = "server",
                 url: Optional[str] = None, model: Optional[str] = None, python: Optional[str] = None, dtype: DType = "auto",
                 max_lora_rank: Optional[int] = None, max_model_len: Optional[int] = None, kv_cache_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.3, enforce_eager: Optional[bool] = None, probe_tolerance: Optional[float] = None, startup_timeout_s: float = 900.0, request_timeout_s: float = 600.0,
                 concurrency: int = 64, server_args: Optional[list[str]] = None, weights: Weights = "lora") -> None:
        require_choice(mode, "VLLMGenerate.mode", Mode)
        require_choice(dtype, "VLLMGenerate.dtype", DType)
        require_choice(weights, "VLLMGenerate.weights", Weights)
        require(weights == "lora" or mode == "inprocess", "VLLMGenerate.weights", "'lora' in mode 'server'", weights,
                "merged and full weights are copied into vLLM's model inside the trainer's process")
        require(url is None or mode == "server", "VLLMGenerate.url", "unset in mode 'inprocess'", url)
        require(url is None or url.startswith(("http://", "https://")), "VLLMGenerate.url", "an http(s):// URL", url)
        require(model is None or Path(model).is_dir(), "VLLMGenerate.model", "a folder holding a Hugging Face model", model)
        require(max_lora_rank is None or max_lora_rank in VLLM_LORA_RANKS, "VLLMGenerate.max_lora_rank",
                f"one of {VLLM_LORA_RANKS} (vLLM's choices) or null", max_lora_rank)
        require(probe_tolerance is None or probe_tolerance > 0, "VLLMGenerate.probe_tolerance", "> 0 (nats per token) or null", probe_tolerance)
        require(kv_cache_gib > 0, "VLLMGenerate.kv_cache_gib", "> 0", kv_cache_gib)
        require(0 < gpu_memory_utilization <= 1, "VLLMGenerate.gpu_memory_utilization", "in (0, 1]", gpu_memory_utilization)
        require(concurrency >= 1, "VLLMGenerate.concurrency", ">= 1", concurrency)
        require(config.top_k == 0 and config.top_p == 1.0, "rollout.top_k / rollout.top_p", "off (top_k 0, top_p 1.0) with VLLMGenerate",
                (config.top_k, config.top_p), "vLLM returns log-probs before temperature or after top-k/top-p, never the "
                "temperature-scaled ones lldslight trains on")
        self.tokenizer, self.retriever, self.config = tokenizer, retriever, config
        self.rules = EpisodeRules(tokenizer, config, reward_fn)
        self.mode, self.url, self.model_dir, self.dtype = mode, url, model, dtype
        self.python = python or default_python()
        self.max_lora_rank, self.max_model_len, self.kv_cache_gib = max_lora_rank, max_model_len, kv_cache_gib
        self.gpu = torch.cuda.is_available()
        self.gpu_memory_utilization = gpu_memory_utilization
        self.enforce_eager = (not self.gpu) if enforce_eager is None else enforce_eager
        self.probe_tolerance = probe_tolerance
        self.startup_timeout_s, self.request_timeout_s, self.concurrency = startup_timeout_s, request_timeout_s, concurrency
        self.server_args = list(server_args or [])
        self.weights = weights
        self.stats: dict[str, float] = {}
        self._key = (mode, url, model, self.python, dtype, max_lora_rank, max_model_len, kv_cache_gib, gpu_memory_utilization,
                     self.enforce_eager, tuple(self.server_args), weights)
        self.conn: Optional[_Connection] = None

    @property
    def client(self) -> Any:
        return self.conn.client if self.conn is not None else None

    @property
    def syncs(self) -> int:
        """Weight pushes to vLLM so far (adapters, or merged weights)."""
        return self.conn.syncs if self.conn is not None else 0

    # -- start-up ---------------------------------------------------------------------------------

    def _start(self, model: nn.Module) -> None:
        if self.conn is not None:
            return
        shared = _CONNECTIONS.get(self._key)
        if shared is not None:
            self.conn = shared
            return
        from lldslight.policy.load import has_adapter
        from lldslight.policy.precision import model_arithmetic

        lora = self.weights == "lora"
        require(not lora or has_adapter(model), "model.policy.lora", "set with VLLMGenerate(weights: lora)", None,
                "the adapter is what reaches vLLM after every step; full fine-tuning needs weights: merged (mode: inprocess)")
        base = model.get_base_model() if has_adapter(model) else model
        model_dir = self.model_dir or getattr(base.config, "_name_or_path", "")
        if self.url is None:  # vLLM loads the base weights here (an attached server has its own: the probe checks them)
            require(bool(model_dir) and (Path(model_dir) / "config.json").is_file(), "VLLMGenerate.model",
                    "a Hugging Face folder holding the policy's base weights (the policy was not loaded from one)", model_dir or None)
        arith = model_arithmetic(model)
        bf16 = arith is not None and (arith.frozen == torch.bfloat16 or arith.autocast == torch.bfloat16)
        dtype = self.dtype if self.dtype != "auto" else ("bfloat16" if bf16 else "float32")
        tolerance = self.probe_tolerance if self.probe_tolerance is not None else (0.1 if dtype == "bfloat16" else 0.01)
        workdir = Path(tempfile.mkdtemp(prefix="lldslight-vllm-"))
        atexit.register(shutil.rmtree, str(workdir), True)
        rank = self._policy_rank(model) if lora else 1
        max_rank = self.max_lora_rank or next((r for r in VLLM_LORA_RANKS if r >= rank), VLLM_LORA_RANKS[-1])
        length = self.max_model_len or min(int(getattr(base.config, "max_position_embeddings", 4096) or 4096), 4096)
        if self.mode == "inprocess":
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.kv_cache_gib:g}")
            client = _InProcessClient(dict(
                model=str(model_dir), dtype=dtype, max_model_len=length, enable_lora=lora,
                **({"max_lora_rank": max_rank, "max_loras": 1} if lora else {}),
                enforce_eager=self.enforce_eager, generation_config="vllm", logprobs_mode="processed_logprobs", seed=0,
                **({"gpu_memory_utilization": self.gpu_memory_utilization} if self.gpu else {})))
        elif self.url is not None:
            client = _ServerClient(self.url, self.request_timeout_s, self.concurrency, None)
            client.connect()
        else:
            client = self._launch(str(model_dir), dtype, max_rank, length, workdir)
        self.conn = _CONNECTIONS[self._key] = _Connection(client, workdir, tolerance)
        if self.mode == "server" and self.url is not None and not self.config.greedy and self.config.temperature != 1.0:
            self._check_logprobs_mode()

    @staticmethod
    def _policy_rank(model: nn.Module) -> int:
        config = model.peft_config[model.active_adapter]
        ranks = [config.r, *dict(getattr(config, "rank_pattern", {}) or {}).values()]
        return int(max(ranks))

    def _launch(self, model_dir: str, dtype: str, max_rank: int, length: int, workdir: Path) -> _ServerClient:
        if not Path(self.python).is_file():
            raise VLLMError(f"VLLMGenerate.python: {self.python} does not exist (bash scripts/setup_vllm.sh makes .venv-vllm)")
        probe = subprocess.run([self.python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
        if probe.returncode != 0:
            last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
            raise VLLMError(f"VLLMGenerate.python: vLLM does not import in {self.python} ({last}); bash scripts/setup_vllm.sh installs it")
        check_vllm_version(probe.stdout.strip().splitlines()[-1], f"VLLMGenerate.python {self.python}")
        port = _free_port()
        args = ["--model", model_dir, "--served-model-name", "lldslight-base", "--host", "127.0.0.1", "--port", str(port),
                "--dtype", dtype, "--max-model-len", str(length), "--enable-lora", "--max-lora-rank", str(max_rank),
                "--max-loras", "1", "--generation-config", "vllm", "--logprobs-mode", "processed_logprobs", "--seed", "0",
                *(["--enforce-eager"] if self.enforce_eager else []),
                *(["--gpu-memory-utilization", f"{self.gpu_memory_utilization:g}"] if self.gpu else []), *self.server_args]
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.kv_cache_gib:g}")
        process = _ServerProcess(self.python, args, env, workdir / "server.log")
        url = f"http://127.0.0.1:{port}"
        client = _ServerClient(url, self.request_timeout_s, self.concurrency, process)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if process.proc.poll() is not None:
                raise VLLMError(f"the vLLM server did not start (exit status {process.proc.returncode}; log {process.log_path}: "
                                f"{process.last_log_line()})")
            try:
                client.connect()
                return client
            except VLLMError:
                if time.monotonic() > deadline:
                    process.stop()
                    raise VLLMError(f"VLLMGenerate.startup_timeout_s: the vLLM server did not answer within "
                                    f"{self.startup_timeout_s:g} s (log {process.log_path}: {process.last_log_line()})") from None
                time.sleep(2.0)

    def _check_logprobs_mode(self) -> None:
        """A server attached to must return the sampled distribution's log-probs (after
        temperature): one token sampled at the configured temperature against the prompt
        log-prob of the same token (before temperature) tells which it returns."""
        prompt = self.tokenizer("The capital of France is", add_special_tokens=False)["input_ids"]
        turn = self.client.complete([prompt], [self._params(1, greedy=False, seed=0)], None)[0]
        raw = self.client.prompt_logprobs(prompt + turn.ids[:1], None)[-1]
        if abs(turn.logp[0] - raw) < 1e-4 and abs(raw) > 1e-3:
            raise VLLMError(f"VLLMGenerate.url: the server at {self.url} returns log-probs before temperature; start it with "
                            "--logprobs-mode processed_logprobs (lldslight trains on the sampled distribution's)")

    # -- weights ----------------------------------------------------------------------------------

    def _sync(self, model: nn.Module) -> None:
        """Push the policy's weights when they changed since the last push. LoRA: the adapter, to
        a new folder each time (vLLM's prefix cache keys an adapter by its path), loaded in place
        under one name and id. Merged: the changed layers' weights copied into vLLM's model."""
        conn = self.conn
        trainable = [p.detach() for p in model.parameters() if p.requires_grad]
        if conn.synced is not None and len(conn.synced) == len(trainable) and all(
                torch.equal(a, b) for a, b in zip(trainable, conn.synced)):
            return
        t0 = time.perf_counter()
        if self.weights == "merged":
            conn.client.load_weights(merged_weights(model))
        else:
            folder = conn.workdir / f"adapter-{conn.syncs}"
            model.save_pretrained(str(folder), safe_serialization=True)
            try:
                conn.client.load_adapter(str(folder))
            except VLLMError as err:
                raise VLLMError(_adapter_refusal(str(err), self._policy_rank(model))) from None
            if conn.adapter is not None:
                shutil.rmtree(conn.adapter, ignore_errors=True)
            conn.adapter = str(folder)
        conn.synced = [p.clone() for p in trainable]
        conn.syncs += 1
        self.stats["sync_s"] = self.stats.get("sync_s", 0.0) + time.perf_counter() - t0

    def mark_stale(self) -> None:
        """Push the weights before the next rollout even if they equal the last push (an unchanged
        push is skipped): for a benchmark timing a run's steady state, where every step pushes, or a
        server whose adapter was replaced behind lldslight's back."""
        if self.conn is not None:
            self.conn.synced = None

    @torch.no_grad()
    def probe_logprob(self, model: nn.Module, ids: list[int]) -> float:
        """The summed log-prob of ``ids`` (tokens 2..n) as vLLM scores it now, after pushing the
        policy's adapter. Raises SyncMismatch when vLLM's per-token log-probs differ from the
        trainer's plain forward by more than ``probe_tolerance`` (mean absolute)."""
        from .sync import token_logprobs

        self._start(model)
        self._sync(model)
        served = torch.tensor(self.client.prompt_logprobs(list(ids), self.conn.adapter), dtype=torch.float64)
        trainer = token_logprobs(model, list(ids))
        gap = float((served - trainer).abs().mean())
        self.stats["probe_gap"] = gap
        if not gap <= self.conn.probe_tolerance:
            raise SyncMismatch(
                f"vLLM's log-probs of the probe differ from the trainer's by {gap:.4g} nats per token (mean absolute; "
                f"probe_tolerance {self.conn.probe_tolerance:g}) after {self.syncs} weight push(es): vLLM is not sampling from the "
                "trainer's weights (a stale or ignored adapter, or a server serving another model than the policy's)")
        return float(served.sum())

    # -- sampling ---------------------------------------------------------------------------------

    def _params(self, budget: int, greedy: bool, seed: int) -> dict:
        """Every sampling field sent (a server fills what is left out), the protocol's stops."""
        return {"max_tokens": budget, "temperature": 0.0 if greedy else float(self.config.temperature), "top_p": 1.0, "top_k": 0,
                "min_tokens": 0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0,
                "stop": list(STOP_TAGS), "stop_token_ids": list(self.rules.eos_ids), "include_stop_str_in_output": True,
                "skip_special_tokens": False, "ignore_eos": False, "seed": seed}

    def sampling_settings(self, greedy: Optional[bool] = None) -> SamplingSettings:
        """What every request asks vLLM for (settings.py): the config's, all fields sent."""
        greedy = self.config.greedy if greedy is None else greedy
        return dataclasses.replace(SamplingSettings.configured(self.config, self.tokenizer, self.rules.eos_ids), greedy=greedy)

    @torch.no_grad()
    def generate(self, model: nn.Module, examples: list[QAExample], group_size: Optional[int] = None,
                 greedy: Optional[bool] = None) -> Trajectory:
        cfg = self.config
        G = cfg.group_size if group_size is None else group_size
        greedy = cfg.greedy if greedy is None else greedy
        self.stats = {"retrieval_s": 0.0, "retrieval_calls": 0.0, "generate_calls": 0.0, "sync_s": 0.0}
        self._start(model)
        self._sync(model)
        episodes = []
        for example in examples:
            prompt = prompt_token_ids(self.tokenizer, example.messages)
            episodes.extend(Episode(example, Layout(list(prompt))) for _ in range(G))
        for ep in episodes:
            self.rules.start_turn(ep)
        # One wave per turn: every rollout still going sends its turn at once (vLLM batches them),
        # then the wave's searches go to the retriever as one batch.
        while True:
            live = [ep for ep in episodes if ep.phase == "decode"]
            if not live:
                break
            self._need_room(live)
            # seeds from torch's stream: a seeded run samples the same rollouts again
            seeds = torch.randint(0, 2**31 - 1, (len(live),)).tolist()
            turns = self.client.complete([ep.layout.prompt + [t for ids, _ in ep.layout.segments for t in ids] for ep in live],
                                         [self._params(ep.budget, greedy, s) for ep, s in zip(live, seeds)], self.conn.adapter)
            self.stats["generate_calls"] += len(live)
            searching = []
            for ep, turn in zip(live, turns):
                self._take(ep, turn)
                query = self.rules.close_turn(ep)
                if query is not None:
                    searching.append((ep, query))
            if searching:
                t0 = time.perf_counter()
                results = self.retriever.search([q for _, q in searching], cfg.topk)
                self.stats["retrieval_s"] += time.perf_counter() - t0
                self.stats["retrieval_calls"] += 1
                for (ep, _), passages in zip(searching, results):
                    self.rules.observe_passages(ep, passages)
            for ep in live:
                if ep.phase == "ready":
                    ep.turn_index += 1
                    self.rules.start_turn(ep)
        return self.rules.to_trajectory(episodes, next(model.parameters()).device)

    def _need_room(self, live: list[Episode]) -> None:
        limit = self.client.max_model_len
        for ep in live:
            if limit and len(ep.layout) + ep.budget > limit:
                raise ConfigError(f"VLLMGenerate.max_model_len: a rollout needs {len(ep.layout) + ep.budget} tokens of context "
                                  f"(prompt, turns so far and this turn's budget), vLLM serves {limit}")

    def _take(self, ep: Episode, turn: _Turn) -> None:
        """The turn vLLM returned, cut where the protocol's rule ends it (turn_stops: EOS, the
        budget, a completed stop tag: the engine's rule, token by token)."""
        ids, logp = turn.ids, turn.logp
        for n in range(1, len(ids) + 1):
            ep.turn = ids[:n]
            if self.rules.turn_stops(ep, ids[n - 1]):
                ep.turn, ep.turn_logp = ids[:n], logp[:n]
                return
        raise RuntimeError(f"vLLM ended a turn where the protocol does not (finish {turn.finish!r} after {len(ids)} of "
                           f"{ep.budget} tokens, no EOS or stop tag): {self.tokenizer.decode(ids[-12:])!r}")

    def close(self) -> None:
        """Stop a server lldslight started (also done at exit), for every backend sharing it."""
        if self.conn is not None:
            self.conn.client.close()
            shutil.rmtree(self.conn.workdir, ignore_errors=True)
            _CONNECTIONS.pop(self._key, None)
            self.conn = None


@torch.no_grad()
def merged_weights(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every weight of the policy by its Hugging Face name, each adapted layer's as W + BA (its
    base weight with the adapter's delta added). All of them, not only the changed ones: vLLM's
    in-place reload processes its layers whole (a fused q/k/v layer given only q would be left
    half loaded)."""
    from lldslight.policy.load import has_adapter

    if not has_adapter(model):
        return [(name, p.detach()) for name, p in model.named_parameters()]
    merged = {}
    for name, layer in model.named_modules():
        if callable(getattr(layer, "get_delta_weight", None)) and hasattr(layer, "base_layer"):
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            weight = layer.base_layer.weight
            merged[name.removeprefix("base_model.model.") + ".weight"] = weight + delta.to(weight.dtype)
    out = []
    for name, p in model.named_parameters():
        if "lora_" not in name:
            hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
            out.append((hf, merged.get(hf, p.detach())))
    return out


def _adapter_refusal(message: str, rank: int) -> str:
    if "rank" in message.lower():
        return (f"model.policy.lora.r: vLLM refused the policy's adapter of rank {rank}: {message} (start the server with "
                f"--max-lora-rank >= {rank}, or leave url unset and lldslight starts one that fits)")
    return message

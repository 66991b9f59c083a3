"""What a resume took from its checkpoint: LightningCLI merges the checkpoint's hyper-parameters
over the config silently; every setting that differs from yours is said in one line at start, and
``--resume_override`` gives the keys it names back to your config.
"""
from __future__ import annotations

import copy
import os
import sys
from typing import Any, Optional


def _leaves(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys -> values of a nested mapping; a mapping on one side and not the other (a LoRA
    config vs null) is compared whole, at its own key."""
    out: dict[str, Any] = {}
    for k, v in (tree or {}).items():
        if isinstance(v, dict) and v:
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = list(v) if isinstance(v, tuple) else v
    return out


def _differences(yours: dict, checkpoint: dict) -> list[str]:
    """Keys whose value differs, at the coarsest level where one side is a mapping and the other not."""
    keys: list[str] = []
    for k in sorted(set(yours) | set(checkpoint)):
        a, b = yours.get(k), checkpoint.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            keys += [f"{k}.{sub}" for sub in _differences(a, b)]
        elif (list(a) if isinstance(a, tuple) else a) != (list(b) if isinstance(b, tuple) else b):
            keys.append(k)
    return keys


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(list(value) if isinstance(value, tuple) else value)


class ResumeSettings:
    """The model settings a resume took from its checkpoint where they differ from the config and
    command line (LightningCLI merges the checkpoint's hyper-parameters over them), and those that
    ``--resume_override`` gave back to the config."""

    def __init__(self, ckpt: str, taken: dict[str, tuple[Any, Any]], overridden: dict[str, tuple[Any, Any]]):
        self.ckpt = ckpt
        self.taken = taken  # key -> (checkpoint's value, yours), kept from the checkpoint
        self.overridden = overridden  # key -> (checkpoint's value, yours), yours used

    def line(self) -> Optional[str]:
        if not self.taken and not self.overridden:
            return None
        parts = []
        if self.taken:
            kept = ", ".join(f"model.{k}={_show(c)} (yours: {_show(y)})" for k, (c, y) in self.taken.items())
            parts.append(f"{len(self.taken)} setting(s) taken from the checkpoint, not your config: {kept}")
        if self.overridden:
            used = ", ".join(f"model.{k}={_show(y)} (checkpoint: {_show(c)})" for k, (c, y) in self.overridden.items())
            parts.append(f"yours by --resume_override: {used}")
        hint = (f"; --resume_override {','.join('model.' + k for k in self.taken)} (or all) uses yours"
                if self.taken else "")
        return f"[lldslight] resuming from {self.ckpt}: " + "; ".join(parts) + hint

    def explain(self, err: Exception) -> Exception:
        """``err`` with the settings that came from the checkpoint: an error about a model path that
        is in no config of yours must say where it came from."""
        from lldslight.errors import UserError

        if not self.taken or not isinstance(err, UserError):
            return err
        shown = ", ".join(f"model.{k}={_show(c)}" for k, (c, _) in list(self.taken.items())[:5])
        more = f" and {len(self.taken) - 5} more" if len(self.taken) > 5 else ""
        message = (f"{err} (resuming from checkpoint {self.ckpt}, whose saved settings replaced yours: {shown}{more}; "
                   "is it a checkpoint of this config? --resume_override all uses yours)")
        try:
            return type(err)(message)
        except TypeError:  # an error class with its own constructor
            return UserError(message)


def _override_keys(value: Optional[str], known: set[str]) -> Optional[set[str]]:
    """The keys ``--resume_override`` names (without "model."), None for 'all'."""
    from lldslight.errors import ConfigError

    if value is None or not str(value).strip():
        return set()
    text = str(value).strip()
    if text.lower() in ("all", "true"):
        return None
    from lldslight.run import deprecated_keys

    keys = set()
    for raw in text.split(","):
        key = raw.strip().removeprefix("model.")
        if not key:
            continue
        if key in deprecated_keys.GROUP_OF:
            raise ConfigError("--resume_override: " + deprecated_keys.moved([key]))
        if not any(key == k or k.startswith(key + ".") for k in known):
            raise ConfigError(f"--resume_override: {raw.strip()!r} is not a model setting (give keys such as "
                              "model.optim.lr, model.policy.lora.r, comma-separated, or 'all')")
        keys.add(key)
    return keys


def resume_settings(config: Any, sub: str, yours: Any) -> Optional[ResumeSettings]:
    """After LightningCLI merged a checkpoint's hyper-parameters into ``config[sub].model``: list what
    they changed, give the keys ``--resume_override`` names back to ``yours``, and say it in one line."""
    from lightning.pytorch.utilities import rank_zero_only

    ckpt = config[sub].get("ckpt_path")
    merged = config[sub].get("model")
    if yours is None or merged is None or not ckpt or not os.path.isfile(str(ckpt)):
        return None
    mine, theirs = yours.as_dict(), merged.as_dict()
    differ = _differences(mine, theirs)
    wanted = _override_keys(config[sub].get("resume_override"), set(_leaves(mine)) | set(_leaves(theirs)))
    taken, overridden = {}, {}
    for key in differ:
        pair = (_lookup(theirs, key), _lookup(mine, key))
        if wanted is None or any(key == w or key.startswith(w + ".") for w in wanted):
            leaf, value = _setting(yours, key)
            config[f"{sub}.model.{leaf}"] = value.clone() if hasattr(value, "clone") else copy.deepcopy(value)
            overridden[key] = pair
        else:
            taken[key] = pair
    settings = ResumeSettings(str(ckpt), taken, overridden)
    line = settings.line()
    if line:
        rank_zero_only(lambda: print(line, file=sys.stderr, flush=True))()
    return settings


def _setting(namespace: Any, key: str) -> tuple[str, Any]:
    """The setting of ``namespace`` that holds ``key`` and its value: ``key`` itself, or the
    mapping-valued setting above it (``policy.random_init`` for ``policy.random_init.hidden_size``:
    a plain dict, replaced whole, as a config file replaces it), None where yours has none."""
    parts = key.split(".")
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            value = namespace[name]
        except KeyError:
            return name, None
        if not hasattr(value, "as_dict"):  # not a nested Namespace: this setting holds the key
            return name, value
    return key, namespace[key]


def _lookup(tree: dict, key: str) -> Any:
    for part in key.split("."):
        tree = tree.get(part) if isinstance(tree, dict) else None
    return tree

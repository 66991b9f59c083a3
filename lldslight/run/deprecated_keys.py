"""The flat ``model.*`` keys of the release before the groups (``model.lr``, ``model.clip_eps``, ...).
Each now lives in a group under the same name: ``model.optim.<key>`` (optim.OptimConfig) or
``model.update.<key>`` (update.UpdateConfig); GRPOModule takes the groups only.

This table is the one place that knows the old keys. It has two readers:

- a user's config file, command line or ``--resume_override`` that still names one: lldslight/cli/checks.py
  stops before the model loads, with one line naming the key's new place (:func:`moved`);
- the hyper-parameters of a checkpoint an earlier lldslight wrote (before the groups, or after them
  with every flat key saved as null): a resume reads them through :func:`nested`, which folds the
  old keys into their groups silently (the user did not write them).

It also knows the modules that moved when the package was grouped into folders (lldslight.distributed
is now lldslight.policy.distributed): a class path in a user's config or command line that names an
old module gets one line naming the new one (:func:`moved_class_path`), before the parse.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional

# The flat keys of the release before the groups, frozen: a field added to a group later has only
# its group's key. Each moved to the group of the same field name: the first six to OptimConfig's
# fields, the rest to UpdateConfig's. Written out rather than read from the dataclasses, as the
# table is frozen by definition (and the run's files need not import the update path).
_OPTIM_KEYS = ("lr", "weight_decay", "betas", "warmup_steps", "warmup_ratio", "optimizer")
_UPDATE_KEYS = (
    "updates_per_rollout", "micro_batch_size", "micro_batch_tokens", "reuse_onpolicy_logp", "old_logp_source", "clip_eps",
    "clip_eps_high", "ratio_clamp", "aggregation", "normalize_adv_std", "kl_coef", "kl_estimator", "entropy_coef",
    "grad_clip", "shuffle_minibatches", "minibatch_grouping", "negative_advantages",
)
FLAT_KEYS = _OPTIM_KEYS + _UPDATE_KEYS
# flat key -> its group ("optim" or "update")
GROUP_OF: dict[str, str] = {**dict.fromkeys(_OPTIM_KEYS, "optim"), **dict.fromkeys(_UPDATE_KEYS, "update")}


def new_key(flat: str) -> str:
    """``model.optim.lr`` for ``lr``: the key that replaced a flat one."""
    return f"model.{GROUP_OF[flat]}.{flat}"


def moved(flat: list[str]) -> str:
    """The one line a user's flat keys get, each named with its new place (the caller prefixes
    where they were written)."""
    news = ", ".join(f"model.{key} is now {new_key(key)}" for key in flat)
    return f"{news}: write {'it' if len(flat) == 1 else 'them'} there (the flat model keys moved into model.optim and model.update)"


def flat_keys_in(model: Any) -> list[str]:
    """The flat keys a ``model:`` mapping of a config holds, null or not (a config saved by an
    earlier lldslight lists them all as null)."""
    return [key for key in model if key in GROUP_OF] if isinstance(model, Mapping) else []


def nested(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's hyper-parameters ``saved`` with the groups' settings as mappings ``update``
    and ``optim``: an earlier lldslight's flat keys folded into them where set (a flat key given
    won over its group's field then, so it does here), dropped where null; other keys as they are."""
    out = {k: v for k, v in saved.items() if k not in GROUP_OF}
    groups = {name: _as_mapping(saved.get(name)) for name in ("update", "optim")}
    for key, value in saved.items():
        if key in GROUP_OF and value is not None:
            groups[GROUP_OF[key]][key] = value
    out.update(groups)
    return out


def _as_mapping(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return dict(value)


# The modules of the flat package that moved into folders, frozen: old dotted path -> new. A user
# names them in class paths (trainer.strategy: lldslight.distributed.FSDP2Strategy; a config saved
# by an earlier lldslight holds trainer.plugins: lldslight.checkpoint_io.AtomicCheckpointIO).
MOVED_MODULES = {
    **{f"lldslight.{name}": f"lldslight.run.{name}" for name in (
        "checkpoint_io", "config_files", "deprecated_keys", "events", "hostmem", "metric_rules", "run_dir", "stopping", "writes")},
    **{f"lldslight.{name}": f"lldslight.policy.{name}" for name in (
        "activation_checkpointing", "distributed", "export", "lora_forward")},
    **{f"lldslight.{name}": f"lldslight.update.{name}" for name in (
        "frozen_prefix", "logprobs", "objectives", "optim", "shared_prefix")},
    **{f"lldslight.{name}": f"lldslight.rollout.{name}" for name in ("bounds", "dynamic_sampling", "evaluation")},
}


def moved_class_path(path: str) -> Optional[str]:
    """The one line for a class path that names a moved module (``lldslight.distributed.FSDP2Strategy
    is now lldslight.policy.distributed.FSDP2Strategy: ...``), None for any other."""
    module, _, name = path.rpartition(".")
    if module not in MOVED_MODULES or not name:
        return None
    return f"{path} is now {MOVED_MODULES[module]}.{name}: write that (lldslight's modules moved into folders)"

"""The flat ``model.*`` keys of earlier releases (``model.lr``, ``model.clip_eps``, ...), accepted for
one release: each now lives in a group, ``model.optim.<key>`` (optim.OptimConfig) or
``model.update.<key>`` (update.UpdateConfig), under the same name.

One table and one fold serve every way a flat key can arrive: a YAML file or command line
(lldslight/cli.py folds the parsed config, then GRPOModule sees the groups only), Python keyword
arguments (``GRPOModule(lr=...)``), and the hyper-parameters of a checkpoint written before the
groups existed (a resume, ``GRPOModule.load_from_checkpoint``). A user's flat key prints one line
naming it and its new key; a checkpoint's is folded silently (the user did not write it).
"""
from __future__ import annotations

import dataclasses
import sys
from typing import Any, Mapping

from lldslight.optim import OptimConfig
from lldslight.update import UpdateConfig

# The flat keys of the release before the groups, frozen: a field added to a group later has only
# its group's key. Each moved to the group of the same field name.
FLAT_KEYS = (
    "lr", "weight_decay", "betas", "warmup_steps", "warmup_ratio", "optimizer",
    "updates_per_rollout", "micro_batch_size", "micro_batch_tokens", "reuse_onpolicy_logp", "old_logp_source", "clip_eps",
    "clip_eps_high", "ratio_clamp", "aggregation", "normalize_adv_std", "kl_coef", "kl_estimator", "entropy_coef",
    "grad_clip", "shuffle_minibatches", "minibatch_grouping", "negative_advantages",
)
_OPTIM = {f.name for f in dataclasses.fields(OptimConfig)}
# flat key -> its group ("optim" or "update")
GROUP_OF: dict[str, str] = {key: "optim" if key in _OPTIM else "update" for key in FLAT_KEYS}


def new_key(flat: str) -> str:
    """``model.optim.lr`` for ``lr``: the key that replaces a flat one."""
    return f"model.{GROUP_OF[flat]}.{flat}"


def deprecation_line(flat: str) -> str:
    return f"[lldslight] model.{flat} is deprecated: write {new_key(flat)} (the flat key is accepted for one more release)"


def announce(flat: str) -> None:
    """Print the deprecation line of ``flat`` once (rank zero)."""
    from lightning.pytorch.utilities import rank_zero_only

    rank_zero_only(lambda: print(deprecation_line(flat), file=sys.stderr, flush=True))()


def fold(flat: Mapping[str, Any], update: Any, optim: Any, quiet: bool = False) -> tuple[Any, Any]:
    """``update`` and ``optim`` (dataclasses, or mappings of their fields) with the flat keys of
    ``flat`` that are set (not None) written into them; a flat key given wins over its group's
    field. Each flat key folded is announced (one line) unless ``quiet``. Returns the same
    kinds it was given: dataclasses stay dataclasses, mappings come back as new dicts."""
    groups = {"update": update, "optim": optim}
    for key, value in flat.items():
        if value is None or key not in GROUP_OF:
            continue
        name = GROUP_OF[key]
        current = groups[name]
        if dataclasses.is_dataclass(current):
            groups[name] = dataclasses.replace(current, **{key: value})
        else:
            groups[name] = {**dict(current or {}), key: value}
        if not quiet:
            announce(key)
    return groups["update"], groups["optim"]


def nested(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's hyper-parameters ``saved`` with the groups' settings as mappings ``update``
    and ``optim`` (an old checkpoint's flat keys folded in silently; a group it lacks is empty);
    other keys as they are."""
    out = {k: v for k, v in saved.items() if k not in GROUP_OF}
    groups = [_as_mapping(saved[name]) if name in saved else {} for name in ("update", "optim")]
    out["update"], out["optim"] = fold({k: v for k, v in saved.items() if k in GROUP_OF}, *groups, quiet=True)
    return out


def _as_mapping(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if dataclasses.is_dataclass(value):
        return dataclasses.asdict(value)
    return dict(value)

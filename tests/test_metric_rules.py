"""lldslight/run/metric_rules.py: one table of how each metric is reduced across ranks and over a
step's updates. Checked against a hand-written table of keys from docs/metrics.md, against the
key-name conventions the sites used before the table (the same values logged), against every key
docs/metrics.md and the source name, and against the page's section on it. That every key a real
tiny fit logs has a rule is checked by tests/test_docs.py, on the run it already makes."""
from __future__ import annotations

import math
import re

import pytest
import torch
from test_docs import METRICS_PAGE, source_keys

from lldslight.run import metric_rules as mr
from lldslight.update.train import RolloutUpdates

# key: (across ranks, over updates; None = logged once per step), by hand from docs/metrics.md
EXPECTED = {
    "train/reward": ("mean", None),
    "train/em": ("mean", None),
    "train/zero_var_groups": ("mean", None),
    "train/lr": ("mean", None),
    "train/loss": ("sum", "mean"),
    "train/pg_loss": ("sum", "mean"),
    "train/kl": ("sum", "mean"),
    "train/clip_frac": ("sum", "mean"),
    "train/entropy": ("sum", "mean"),
    "train/ratio_max": ("max", "max"),
    "train/grad_norm": ("mean", "mean"),
    "train/grad_norm_max": ("max", "max"),
    "train/nonfinite_tokens": ("sum", "sum"),
    "train/nonfinite_loss": ("sum", "sum"),
    "train/vetoed_updates": ("mean", "sum"),
    "time/rollout_s": ("max", None),
    "time/update_s": ("max", None),
    "time/lld_monitor_s": ("max", None),
    "llds/loss": ("sum", "mean"),
    "llds/active_actions": ("sum", "mean"),
    "llds/active_tokens": ("sum", "mean"),
    "llds/beta": ("mean", None),
    "guard/grad_norm": ("mean", "mean"),
    "guard/median": ("mean", "mean"),
    "guard/vetoed": ("mean", "mean"),
    "guard/stopped": ("mean", "mean"),
    "lld/logp_pos": ("mean", None),
    "lld/ref_logp_neg": ("mean", None),
    "lld/n_pos": ("mean", None),
    "lld/delta_correct": ("mean", None),
    "lld/phase": ("mean", None),
    "diag/p_eos": ("mean", None),
    "diag/tool_call_rate": ("mean", None),
    "rollout/rounds": ("mean", None),
    "rollout/kept_groups": ("sum", None),
    "rollout/dropped_groups": ("sum", None),
    "rollout/filled": ("mean", None),
    "rollout/logp_mismatch": ("sum", "mean"),
    "rollout/logp_mismatch_kl": ("sum", "mean"),
    "retrieval/unavailable": ("sum", None),
    "retrieval/short_circuited": ("sum", None),
    "retrieval/breaker_open": ("max", None),
    "alarm/logp_pos": ("mean", None),
    "alarm/logp_pos_crossed": ("mean", None),
    "alarm/fired": ("mean", None),
    "heal/count": ("mean", None),
    "probe/lld_share": ("mean", None),
    "val/em": ("mean", None),
    "val/em/nq": ("mean", None),
    "test/n": ("mean", None),
    "val_before/f1": ("mean", None),
    "val_after/em/synth_1hop": ("mean", None),
    "sft/loss": ("mean", None),
}

# What the update's channels held before the table (update/train.py: RolloutUpdates.summed): the keys
# the module summed over ranks by channel rather than by name.
SUMMED_CHANNEL = {"train/loss", "train/pg_loss", "train/kl", "train/clip_frac", "train/entropy", "train/ratio_max",
                  "train/nonfinite_tokens", "train/nonfinite_loss", "rollout/logp_mismatch", "rollout/logp_mismatch_kl",
                  "llds/loss", "llds/active_actions", "llds/active_tokens"}
MODULE_LOGGED = {k for k in EXPECTED if k.split("/")[0] in ("train", "time", "llds", "guard")} | SUMMED_CHANNEL


@pytest.mark.parametrize("key", sorted(EXPECTED))
def test_rules_of_representative_keys(key):
    ranks, updates = EXPECTED[key]
    assert mr.reduction(key) == ranks
    rule = mr.rule_for(key)
    assert rule is not None and rule.ranks == ranks
    if updates is not None:
        assert mr.over_updates(key) == updates


def test_the_same_reductions_as_the_key_conventions_before_the_table():
    """GRPOModule._log_step's old expression, on every key it logs: unchanged."""
    for k in sorted(MODULE_LOGGED - {"llds/beta"}):  # llds/beta is logged by the LLDS callback itself
        old = "max" if (k.endswith("_max") or k.startswith("time/")) else "sum" if k in SUMMED_CHANNEL else "mean"
        assert mr.reduction(k, default="sum" if k in SUMMED_CHANNEL else "mean") == old, k


def test_keys_without_a_rule():
    with pytest.raises(KeyError, match="no reduction rule.*metric_rules.py"):
        mr.reduction("mine/thing")
    assert mr.reduction("mine/thing", default="sum") == "sum"
    assert mr.rule_for("train/my_term") is None  # an update key of your own: its channel decides
    assert mr.reduction("train/my_term_max", default="sum") == "max"  # maxima win, as before
    assert mr.over_updates("train/my_term") == "mean"
    assert mr.logged_name("pg_loss") == "train/pg_loss" and mr.logged_name("llds/loss") == "llds/loss"
    assert {r.ranks for r in mr.RULES} <= set(mr.REDUCTIONS)
    assert {r.updates for r in mr.RULES} <= set(mr.REDUCTIONS) | {None}


def _documented() -> set[str]:
    """The keys of docs/metrics.md's table rows, each placeholder filled with a word."""
    keys = set()
    for line in METRICS_PAGE.read_text().splitlines():
        if line.startswith("| `"):
            keys |= {re.sub(r"<[^>]+>", "x", k) for k in re.findall(r"`([^`]+)`", line.split(" | ")[0])}
    return keys - {"step", "epoch"}  # Lightning's own columns


def test_every_documented_and_every_source_key_has_a_rule():
    documented = _documented()
    assert {"train/reward", "alarm/x_crossed", "val_after/em/x", "sft/loss"} <= documented
    found = set(source_keys())
    missing = sorted(k for k in documented | found if mr.rule_for(k) is None)
    assert not missing, "no rule in lldslight/run/metric_rules.py for: " + ", ".join(missing)


def test_the_page_names_every_rule():
    text = METRICS_PAGE.read_text()
    section = text.split("## How metrics are reduced across ranks", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([^`]+)`", section))
    assert not [r.pattern for r in mr.RULES if r.pattern not in named]


def test_step_metrics_combine_updates_by_the_rules():
    nan = float("nan")
    out = RolloutUpdates(
        trajectory=None,  # type: ignore[arg-type]
        summed={"loss": [1.0, 3.0], "ratio_max": [2.0, 5.0], "nonfinite_tokens": [1.0, 2.0], "llds/loss": [nan, 4.0], "mine": [1.0, 2.0]},
        shared={"grad_norm": [1.0, 3.0], "vetoed": [0.0, 1.0], "guard/vetoed": [0.0, 1.0]},
        lr=0.1, timings={},
    )
    metrics, summed = out.step_metrics()
    assert metrics == {"train/vetoed_updates": 1.0, "train/loss": 2.0, "train/ratio_max": 5.0, "train/nonfinite_tokens": 3.0,
                       "llds/loss": 4.0, "train/mine": 1.5, "train/grad_norm": 2.0, "train/grad_norm_max": 3.0, "guard/vetoed": 0.5}
    assert summed == {"train/loss", "train/ratio_max", "train/nonfinite_tokens", "llds/loss", "train/mine"}
    nothing = RolloutUpdates(None, {"kl": [nan]}, {}, 0.1, {}).step_metrics()[0]  # type: ignore[arg-type]
    assert math.isnan(nothing["train/kl"])


def test_micro_batches_combine_by_the_rules():
    from lldslight.update.train import _combine

    assert _combine(mr.reduction("train/ratio_max"), torch.tensor(2.0), torch.tensor(5.0)) == 5.0
    assert float(_combine(mr.reduction("train/loss"), torch.tensor(2.0), torch.tensor(5.0))) == 7.0
    assert float(_combine(mr.reduction("train/mine", default="sum"), 2.0, 5.0)) == 7.0

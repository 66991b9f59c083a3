"""GroupSignal (lldslight/callbacks/signal.py): a run whose groups tie, or whose groups are smaller
than 4 with LLDS or a drift bound on, says so once in words and then every step as a metric.

Real fits through the CLI on configs/tiny.yaml (G = 2): its random policy never answers, so every
reward is 0 and every group ties; composed with configs/llds.yaml both warnings must come, once
each, and the metrics mark every step. A reward that alternates 0 and 1 makes every group mixed:
then neither warning comes, and the guard, configured nowhere, still logs (it is on in every fit).
"""
from __future__ import annotations

import csv
import warnings

import pytest
import yaml

from lldslight.callbacks.signal import GroupSignal, tie_probability
from lldslight.errors import ConfigError
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"
STARVED = "no GRPO signal"
SMALL = "rollout.group_size 2 < 4 with LLDS on"


class Alternate:
    """A reward of 0, 1, 0, 1, ... in call order: the engine scores a group's rollouts one after the
    other, so each group of 2 holds a 0 and a 1."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        self.calls += 1
        return float(self.calls % 2)


def fit(tmp_path, monkeypatch, *configs: str, steps: int = 3, base=TINY) -> tuple[list[dict], list[str]]:
    """Run ``lldslight fit`` on ``base`` composed with ``configs`` (YAML texts); the training rows
    of metrics.csv and the warnings' messages."""
    from lldslight.cli import main

    args = ["fit", "--config", str(base)]
    for n, text in enumerate(configs):
        (tmp_path / f"extra{n}.yaml").write_text(text)
        args += ["--config", str(tmp_path / f"extra{n}.yaml")]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([*args, "--trainer.max_steps", str(steps)]) == 0
    with open(tmp_path / "runs" / "tiny" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/reward")]
    return rows, [str(w.message) for w in caught]


def column(rows: list[dict], key: str) -> list[float]:
    return [float(r[key]) for r in rows]


def test_tie_probability_by_hand():
    assert tie_probability(2, 0.5) == 0.5  # 0.25 + 0.25
    assert tie_probability(4, 0.5) == 0.125
    assert abs(tie_probability(4, 0.2) - (0.0016 + 0.4096)) < 1e-12
    assert tie_probability(5, 0.0) == 1.0


def test_bad_settings_are_one_line_errors():
    with pytest.raises(ConfigError, match=r"GroupSignal.window must be >= 1"):
        GroupSignal(window=0)
    with pytest.raises(ConfigError, match=r"GroupSignal.max_tied_share must be in \[0, 1\)"):
        GroupSignal(max_tied_share=1.0)


def test_tied_groups_of_two_with_llds_warn_once_each_and_mark_every_step(tmp_path, monkeypatch):
    llds = (ROOT / "configs" / "llds.yaml").read_text()
    signal = "trainer:\n  callbacks+:\n    - class_path: lldslight.callbacks.GroupSignal\n      init_args: {window: 2}\n"
    rows, messages = fit(tmp_path, monkeypatch, llds, signal)
    assert column(rows, "train/zero_var_groups") == [1.0, 1.0, 1.0]  # the random policy: every reward 0
    assert column(rows, "signal/tied_share") == [1.0, 1.0, 1.0]
    assert column(rows, "signal/starved") == [0.0, 1.0, 1.0]  # the window of 2 is full from the second step
    assert column(rows, "signal/small_groups") == [1.0, 1.0, 1.0]
    starved = [m for m in messages if m.startswith(STARVED)]
    small = [m for m in messages if m.startswith(SMALL)]
    assert len(starved) == 1 and len(small) == 1, messages
    assert "100% of the groups of the last 2 steps tied" in starved[0] and "With LLDS on" in starved[0]
    # what it does to them, and the remedy
    assert "LLDS preserves every response with A >= 0, tied ones included" in small[0]
    assert "ties with probability 50% at a success rate of 0.5 and 68% at 0.2" in small[0]
    assert "rollout.group_size >= 4" in small[0]


def test_the_drift_bound_is_named_too(tmp_path, monkeypatch):
    rows, messages = fit(tmp_path, monkeypatch, "model:\n  update:\n    target_kl: 0.05\n", steps=1)
    (small,) = [m for m in messages if m.startswith("rollout.group_size 2 < 4 with model.update.target_kl on")]
    assert "the drift bound reads the KL of mini-batches made mostly of tied rows" in small and "LLDS preserves" not in small
    assert column(rows, "signal/small_groups") == [1.0]


def test_mixed_groups_without_llds_say_nothing_and_the_guard_is_on_by_default(tmp_path, monkeypatch):
    config = yaml.safe_load(TINY.read_text())
    rollout = config["trainer"]["callbacks"][0]
    rollout["init_args"]["reward"] = {"class_path": "tests.test_signal.Alternate"}
    (tmp_path / "mixed.yaml").write_text(yaml.safe_dump(config))
    rows, messages = fit(tmp_path, monkeypatch, steps=2, base=tmp_path / "mixed.yaml")
    assert column(rows, "train/zero_var_groups") == [0.0, 0.0]
    assert column(rows, "signal/tied_share") == [0.0, 0.0]  # logged: GroupSignal is on without being configured
    assert column(rows, "signal/starved") == [0.0, 0.0] and column(rows, "signal/small_groups") == [0.0, 0.0]
    assert not [m for m in messages if m.startswith((STARVED, "rollout.group_size"))], messages

"""The collapse alarm's rule (lldslight.science.alarm) on hand-built series whose statistics are worked out
by hand in the comments, its state, its offline replay, and its config checks."""
from __future__ import annotations

import math
import random

import pytest

from lldslight.science.alarm import AlarmConfig, AlarmRule, read_metrics_csv, replay_alarm
from lldslight.errors import ConfigError

NAN = float("nan")
# Two "raw" signals that fall before a collapse. Values 0.75 / 0.5 and a floor of 0.25 are exact in
# binary: a drop to 0.5 is z = 1 exactly, so C grows by exactly 1 - k = 0.5 per step.
TWO = dict(signals=["answered_rate", "tool_call_rate"], baseline_start=0, baseline_end=10, baseline_min=5,
           k=0.5, h=5.0, votes=2, consecutive=5, far=2.0, sd_floor={"answered_rate": 0.25, "tool_call_rate": 0.25})


def feed(rule: AlarmRule, series: dict[str, list[float]]):
    n = len(next(iter(series.values())))
    return [rule.update({k: v[i] for k, v in series.items()}) for i in range(n)]


def step_change(at: int, n: int, low: float = 0.5, high: float = 0.75) -> list[float]:
    return [high if i < at else low for i in range(n)]


def test_a_flat_series_never_alarms():
    # Constant signals (sd 0 -> the floor) and a wobble of +-0.02 (z = +-0.4 < k): C stays 0.
    rule = AlarmRule(AlarmConfig(**TWO))
    wobble = [0.75 + (0.02 if i % 2 else -0.02) for i in range(2000)]
    ups = feed(rule, {"train/answered_rate": [0.75] * 2000, "diag/tool_call_rate": wobble})
    assert not any(u.fired for u in ups)
    assert max(u.cusum["tool_call_rate"] for u in ups[10:]) == 0.0
    assert rule.baseline["answered_rate"] == (0.75, 0.25)  # sd 0 in the baseline: the floor


def test_default_rule_on_gaussian_noise_stays_quiet():
    # All five default signals as independent N(mu, sd) noise (sd above every floor) for 3000 steps:
    # with k = 0.5, h = 5, two votes for 5 steps or one signal past 10, nothing fires.
    rng = random.Random(0)
    rule = AlarmRule(AlarmConfig())
    fired = []
    for t in range(3000):
        m = {
            "diag/tool_call_rate": rng.gauss(0.9, 0.08), "train/answered_rate": rng.gauss(0.9, 0.08),
            "lld/gate_open_actions": rng.gauss(0.3, 0.08), "lld/delta_correct": rng.gauss(0.02, 0.015),
            "train/reward": rng.gauss(0.6, 0.1),
        }
        if rule.update(m).fired:
            fired.append(t)
    assert fired == []
    assert all(rule.baseline[n] is not None for n in rule.config.signals)


def test_a_step_change_in_two_signals_fires_after_the_worked_out_number_of_steps():
    # Baseline steps 0-9 at 0.75 (mu 0.75, sd floored to 0.25); from step 20 both drop to 0.5:
    # z = 1, C_t = 0.5 (t - 19): C_29 = 5.0 (not > h), C_30 = 5.5 crosses; 2 votes on steps
    # 30..34 -> fires on step 34 (C = 7.5 < far x h = 10). Onset: C last stood at 0 on step 19 -> 20.
    rule = AlarmRule(AlarmConfig(**TWO))
    ups = feed(rule, {"train/answered_rate": step_change(20, 40), "diag/tool_call_rate": step_change(20, 40)})
    assert [u.step for u in ups if u.fired] == [34]
    assert ups[29].cusum["answered_rate"] == 5.0 and not ups[29].crossed["answered_rate"]
    assert ups[30].votes == 2 and ups[33].streak == 4
    assert ups[34].onset == 20 and ups[34].cusum["answered_rate"] == 7.5
    assert ups[34].log_metrics()["alarm/fired"] == 1.0 and ups[34].log_metrics()["alarm/votes"] == 2.0
    # The statistics restart after the firing: C_35 = 0 + 1 - 0.5.
    assert ups[35].cusum["answered_rate"] == 0.5 and not ups[35].fired
    # Before the baseline is known the statistic is NaN and cannot vote.
    assert math.isnan(ups[5].cusum["answered_rate"]) and ups[9].cusum["answered_rate"] == 0.0


def test_one_signal_alone_needs_to_cross_far():
    # Only answered_rate drops: never 2 votes; C_t = 0.5 (t - 19) passes far x h = 10 on step 40.
    rule = AlarmRule(AlarmConfig(**TWO))
    ups = feed(rule, {"train/answered_rate": step_change(20, 50), "diag/tool_call_rate": [0.75] * 50})
    assert [u.step for u in ups if u.fired] == [40]
    assert ups[40].onset == 20 and ups[40].reason == "answered_rate above 2 x h=10"
    assert all(u.votes <= 1 for u in ups)


def test_nan_gaps_hold_the_statistic():
    # As the two-signal case, with both signals missing on steps 25-27 (NaN for one, absent key for
    # the other): C holds there (2.5), so the crossing moves 3 steps later (33) and the firing to 37.
    a = step_change(20, 45)
    a[25:28] = [NAN] * 3
    rule = AlarmRule(AlarmConfig(**TWO))
    ups = []
    for i in range(45):
        m = {"train/answered_rate": a[i]}
        if not 25 <= i <= 27:
            m["diag/tool_call_rate"] = step_change(20, 45)[i]
        ups.append(rule.update(m))
    assert [ups[i].cusum["answered_rate"] for i in (24, 25, 26, 27, 28)] == [2.5, 2.5, 2.5, 2.5, 3.0]
    assert math.isnan(ups[26].z["answered_rate"])
    assert [u.step for u in ups if u.fired] == [37] and ups[37].onset == 20
    # A NaN inside the baseline window is skipped, not a zero: the baseline mean stays 0.75.
    b = [0.75] * 10 + [0.75] * 5
    b[3] = NAN
    rule = AlarmRule(AlarmConfig(**TWO))
    feed(rule, {"train/answered_rate": b, "diag/tool_call_rate": [0.75] * 15})
    assert rule.baseline["answered_rate"] == (0.75, 0.25) and len(rule.baseline_values["answered_rate"]) == 9


def test_held_values_keep_voting_through_a_gap():
    # Once both signals crossed (step 30), a gap in the data does not stop the streak.
    a = step_change(20, 40)
    a[31:34] = [NAN] * 3
    rule = AlarmRule(AlarmConfig(**TWO))
    ups = feed(rule, {"train/answered_rate": a, "diag/tool_call_rate": a})
    assert [u.step for u in ups if u.fired] == [34]
    assert ups[33].cusum["answered_rate"] == 5.5 and ups[33].streak == 4


def test_derived_signals():
    cfg = AlarmConfig(signals=["delta_negative_share", "reward_vs_peak"], share_window=4, share_min=2, reward_window=2,
                      baseline_start=0, baseline_end=3, baseline_min=2, votes=1)
    rule = AlarmRule(cfg)
    deltas = [0.1, NAN, -0.2, 0.3, -0.1, -0.1, -0.2]
    rewards = [0.2, 0.6, 1.0, 0.4, 0.0, 0.5, 0.5]
    ups = feed(rule, {"lld/delta_correct": deltas, "train/reward": rewards})
    share = [u.values["delta_negative_share"] for u in ups]
    # measured steps: 0.1 | - | -0.2 | 0.3 | -0.1 | -0.1 | -0.2 -> last 4 measured, once 2 are
    assert math.isnan(share[0]) and math.isnan(share[1])
    assert share[2:] == [1 / 2, 1 / 3, 2 / 4, 3 / 4, 3 / 4]
    ratio = [u.values["reward_vs_peak"] for u in ups]
    # trailing means: -, 0.4, 0.8, 0.7, 0.2, 0.25, 0.5; running peak 0.4, 0.8, 0.8, ...
    assert math.isnan(ratio[0])
    assert ratio[1:] == pytest.approx([1.0, 1.0, 0.7 / 0.8, 0.2 / 0.8, 0.25 / 0.8, 0.5 / 0.8])
    diff = AlarmRule(AlarmConfig(signals=["first_vs_later_logp"], baseline_start=0, baseline_end=5, baseline_min=2, votes=1))
    u = diff.update({"lld/logp_first_action": -1.5, "lld/logp_later_actions": -1.0})
    assert u.values["first_vs_later_logp"] == -0.5
    assert math.isnan(diff.update({"lld/logp_first_action": -1.5}).values["first_vs_later_logp"])


def test_state_dict_resumes_exactly():
    series = {"train/answered_rate": step_change(20, 60), "diag/tool_call_rate": step_change(25, 60, low=0.625)}
    whole = feed(AlarmRule(AlarmConfig(**TWO)), series)
    first = AlarmRule(AlarmConfig(**TWO))
    feed(first, {k: v[:32] for k, v in series.items()})
    second = AlarmRule(AlarmConfig(**TWO))
    second.load_state_dict(first.state_dict())
    rest = feed(second, {k: v[32:] for k, v in series.items()})
    assert [u.log_metrics() for u in rest] == [u.log_metrics() for u in whole[32:]]
    assert any(u.fired for u in whole[32:])  # the resumed part holds a firing: the check can fail
    with pytest.raises(ConfigError, match="signals"):
        AlarmRule(AlarmConfig(signals=["answered_rate"], votes=1)).load_state_dict(first.state_dict())


def test_replay_from_columns_and_csv_equals_stepping_the_rule(tmp_path):
    n = 60
    steps = list(range(n))
    cols = {"step": steps, "train/answered_rate": step_change(20, n), "diag/tool_call_rate": step_change(20, n),
            "train/reward": [0.5] * n}
    ups = feed(AlarmRule(AlarmConfig(**TWO)), {k: cols[k] for k in ("train/answered_rate", "diag/tool_call_rate")})
    out = replay_alarm(cols, AlarmConfig(**TWO))
    assert out["step"] == [float(s) for s in steps]
    assert out["alarm/fired"] == [float(u.fired) for u in ups]
    # The shift persists after the first firing and its restart: C grows again from 0 at step 35,
    # crosses on 45 and fires again on 49 (onset 35).
    assert [s for s, f in zip(steps, out["alarm/fired"]) if f] == [34, 49]
    assert out["alarm/onset"][34] == 20.0 and out["alarm/onset"][49] == 35.0 and math.isnan(out["alarm/onset"][33])
    for i, u in enumerate(ups):
        for k, v in u.log_metrics().items():
            assert out[k][i] == v or (math.isnan(out[k][i]) and math.isnan(v)), (i, k)
    # The same from a metrics.csv with an evaluation-only row and a split step row, as Lightning writes.
    lines = ["step,train/answered_rate,diag/tool_call_rate,train/reward,val/em"]
    for s in steps:
        lines.append(f"{s},{cols['train/answered_rate'][s]},,0.5,")
        lines.append(f"{s},,{cols['diag/tool_call_rate'][s]},,")
    lines.append("60,,,,0.3")
    (tmp_path / "metrics.csv").write_text("\n".join(lines) + "\n")
    assert read_metrics_csv(tmp_path)["val/em"][-1] == 0.3
    again = replay_alarm(tmp_path, AlarmConfig(**TWO))
    assert again["step"] == out["step"] and again["alarm/fired"] == out["alarm/fired"]


@pytest.mark.parametrize("kwargs, key", [
    (dict(signals=["nope"]), "signals"),
    (dict(h=0.0), "rule.h"),
    (dict(k=-1.0), "rule.k"),
    (dict(votes=6), "rule.votes"),
    (dict(baseline_end=10, baseline_start=20), "baseline_end"),
    (dict(far=1.0), "rule.far"),
    (dict(sd_floor={"gate_open": 0.0}), "sd_floor"),
    (dict(share_min=40), "share_min"),
])
def test_bad_config_values_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=key):
        AlarmConfig(**kwargs)

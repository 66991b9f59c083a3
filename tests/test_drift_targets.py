"""lab/drift_targets.py: the rate controller's target from archived runs, steps without signal left
out. The fixed point by hand and against the controller itself run on the same batches; the signal
filter on archives built here; the all-steps statistic against C2's registered calibration script."""
from __future__ import annotations

import gzip
import math
import random
import statistics

import pytest
from conftest import load_lab

from lldslight.callbacks.drift import AdaptiveRate

T = 1e-3


def test_the_fixed_point_by_hand():
    dt = load_lab("drift_targets")
    # ln(v / T) = -2, 0, 0.5. With x = ln(T* / T) in [-0.5, 0] the clipped errors are -1, -x and
    # 0.5 - x, whose sum -0.5 - 2x is 0 at x = -0.25: T* = T e^-0.25 (the median would be T).
    values = [T * math.exp(-2), T, T * math.exp(0.5)]
    assert dt.log_pi_fixed_point(values) == pytest.approx(T * math.exp(-0.25), rel=1e-9)
    # A non-finite KL counts +1, as the controller reads it: with errors -2, 0 and +1 and x in [-1, 1]
    # the clipped sum is -1 + (-x) + 1 = -x, 0 at x = 0: T* = T.
    assert dt.log_pi_fixed_point([T * math.exp(-2), T, float("nan")]) == pytest.approx(T, rel=1e-9)
    with pytest.raises(ValueError, match="needs values > 0"):
        dt.log_pi_fixed_point([T, 0.0])


def test_the_fixed_point_is_where_the_controller_stops_moving():
    dt = load_lab("drift_targets")
    rnd = random.Random(11)
    values = [T * math.exp(rnd.gauss(0.4, 2.5)) for _ in range(301)]
    target = dt.log_pi_fixed_point(values)
    # The controller at that target, fed these batches once from mid-range: its integral moves by
    # -gain x the sum of the clipped errors, which is 0 at the fixed point (and not 0 away from it).
    for t, moved in ((target, False), (target * 1.2, True)):
        cb = AdaptiveRate(target_kl=t, gain=0.01, down_gain=0.0, max_scale=1e6, lr_min=1e-12)
        for v in values:
            cb.observe(v, True, 1e-3)
        assert (abs(cb.integral) > 1e-6) == moved, (t, cb.integral)
    assert target != pytest.approx(statistics.median(values), rel=1e-3)  # not the median: a real check


def write_run(path, rows):
    path.mkdir(parents=True)
    keys = list(rows[0])
    with gzip.open(path / "metrics.csv.gz", "wt") as f:
        f.write(",".join(["step", *keys]) + "\n")
        for step, row in enumerate(rows):
            f.write(",".join([str(step), *(str(row[k]) for k in keys)]) + "\n")


def archived_row(kl, tied=0.5, grad=1.0, signal=None):
    row = {"train/reward": 0.5, "train/answered_rate": 1.0, "train/zero_var_groups": tied, "train/grad_norm_max": grad,
           "drift/kl_k3_last": kl, "drift/kl_k3": kl / 2, "train/entropy": 0.5, "drift/log_ratio_m2_last": 2 * kl,
           "drift/clip_frac_last": 0.0, "train/lr": 2.5e-4}
    if signal is not None:
        row["drift/signal"] = signal
    return row


def test_steps_without_signal_are_left_out(tmp_path):
    dt = load_lab("drift_targets")
    # seed 0, an old archive (no drift/signal): steps 0-29 (warm-up) hold KL 1; of steps 30-89,
    # every 3rd is tied (KL 1e-6) and every 10th has no gradient (KL 1e-6): the rest hold 0.002.
    old = [archived_row(1.0) for _ in range(30)]
    for s in range(30, 90):
        old.append(archived_row(1e-6, tied=1.0) if s % 3 == 0 else archived_row(1e-6, grad=0.0) if s % 10 == 0 else archived_row(0.002))
    write_run(tmp_path / "arm" / "seed0", old)
    # seed 1 logs drift/signal: its 0s hold KL 1e-6, its 1s 0.002 (the proxy columns say otherwise)
    new = [archived_row(1.0, signal=1.0) for _ in range(30)]
    new += [archived_row(0.002 if s % 2 else 1e-6, tied=1.0, signal=float(s % 2)) for s in range(30, 90)]
    write_run(tmp_path / "arm" / "seed1", new)
    out = dt.calibrate(tmp_path / "arm", [0, 1], first=30, last=89)
    # seed 0: 60 steps, 20 tied (s % 3 == 0), and of the others 4 with no gradient (s % 10 == 0, s % 3 != 0:
    # 40, 50, 70, 80): 36 with signal; seed 1: 30. All hold 0.002, so every statistic on them is 0.002.
    assert (out["steps"], out["steps_with_signal"]) == (120, 66)
    assert out["target_kl"] == pytest.approx(0.002, rel=1e-9) and out["kl_median"] == 0.002
    assert out["kl_all_median"] == pytest.approx(0.002)  # 66 of 120 steps hold 0.002: the middle two do
    assert out["rms_per_eps_median"] == pytest.approx(math.sqrt(0.004) / 0.2)
    with pytest.raises(SystemExit, match="seed0 is not a finished pilot run"):
        dt.calibrate(tmp_path / "arm", [0, 1], first=30, last=120)
    (tmp_path / "arm" / "seed1").rename(tmp_path / "arm" / "n60_seed1")  # the demo archives' names
    assert dt.calibrate(tmp_path / "arm", [1], first=30, last=89, run_name="n60_seed{}")["steps_with_signal"] == 30


def test_the_all_steps_statistic_is_c2s_registered_one():
    """On the archived C2 pilot, the median of every step read is the registered script's value
    (lab/calibrate_target_kl.py, computed its own way), and the statistic over steps with signal is
    not (the check can fail)."""
    dt, c2 = load_lab("drift_targets"), load_lab("calibrate_target_kl")
    registered = statistics.median(c2.pooled_drift(c2.PILOT))
    out = dt.calibrate(c2.PILOT, list(c2.SEEDS), first=c2.FIRST, last=c2.LAST)
    assert out["kl_all_median"] == registered
    assert out["kl_median"] > 1.5 * registered


def test_describe_a_group(tmp_path):
    dt = load_lab("drift_targets")
    write_run(tmp_path / "set" / "arm" / "seed3", [archived_row(0.001 * (1 + s % 2)) for s in range(40)])
    (row,) = [dt.describe(dt.Group("x", "set/arm/seed*", 30), root=tmp_path)]
    assert (row.runs, row.steps, row.signal_share) == (1, 10, 1.0)
    assert row.kl_median == pytest.approx(0.0015)  # 5 at 0.001, 5 at 0.002
    assert row.kl_per_entropy == pytest.approx(0.003) and row.entropy == pytest.approx(0.5)
    assert dt.describe(dt.Group("none", "set/other/seed*", 30), root=tmp_path) is None
    assert "| x | 1 | 10 | 1.00 |" in dt.table([row])

"""lab/calibrate_target_kl.py: C2's registered calibration rule on pilot archives built here, with
the median and its rounding worked out by hand."""
from __future__ import annotations

import gzip

import pytest
import yaml
from conftest import load_lab


def pilot(root, values_by_seed, steps=600):
    for seed, (early, late) in values_by_seed.items():
        run = root / f"seed{seed}"
        run.mkdir(parents=True)
        lines = ["step,train/reward,drift/kl_k3_last"]
        lines += [f"{s},0.5,{early if s < 30 else late}" for s in range(steps)]
        with gzip.open(run / "metrics.csv.gz", "wt") as f:
            f.write("\n".join(lines) + "\n")
    return root


def test_the_rule_by_hand(tmp_path):
    cal = load_lab("calibrate_target_kl")
    # Steps 30-599 of seed 0 hold 0.00123, of seed 1 0.00456 (570 each): the pooled median is the
    # mean of the two middle values, (0.00123 + 0.00456) / 2 = 0.002895 -> 0.0029. Steps 0-29 hold
    # 1.0: were they counted, the median would be 0.00456.
    archive = pilot(tmp_path / "grpo", {0: (1.0, 0.00123), 1: (1.0, 0.00456)})
    out = tmp_path / "bound.yaml"
    assert cal.main(["--pilot", str(archive), "--out", str(out)]) == 0
    arm = yaml.safe_load(out.read_text())
    assert arm["model"]["update"] == {"target_kl": 0.0029, "target_kl_factor": 1.5}
    (callback,) = arm["trainer"]["callbacks+"]
    assert callback["class_path"] == "lldslight.callbacks.AdaptiveRate"
    assert callback["init_args"] == {"target_kl": 0.0029, "rule": "bang_bang", "signal_free": "react", "factor": 1.5, "high": 2.0,
                                     "low": 0.5, "lr_min": 1e-5, "lr_max": 1e-3}
    assert out.read_text().startswith("# Drift bound")  # the runner labels an arm by its first comment line


def test_an_unfinished_pilot_run_is_refused_by_name(tmp_path):
    cal = load_lab("calibrate_target_kl")
    archive = pilot(tmp_path / "grpo", {0: (1.0, 0.001), 1: (1.0, 0.002)}, steps=400)
    with pytest.raises(SystemExit, match="seed0 is not a finished pilot run"):
        cal.main(["--pilot", str(archive), "--out", str(tmp_path / "x.yaml")])

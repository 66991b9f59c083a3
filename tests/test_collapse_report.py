"""benchmarks/collapse.py's comparison numbers on a hand-written metrics.csv (no training)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from conftest import load_benchmark


@pytest.fixture(scope="module")
def collapse():
    return load_benchmark("collapse")


def _write_run(run_dir: Path) -> None:
    run_dir.mkdir(parents=True)
    rows = []
    for step in range(6):
        rows.append({
            "step": step, "train/reward": 0.1 * step, "lld/logp_pos": [-0.5, -0.4, -0.6, -0.9, float("nan"), -0.7][step],
            "lld/logp_neg": -1.0, "train/entropy": 1.0, "train/grad_norm": [1.0, 1.0, 1.2, 9.0, 1.1, 1.0][step],
            "train/grad_norm_max": [1.0, 1.0, 1.5, 12.0, 1.1, float("nan")][step],
            "train/vetoed_updates": [0, 1, 0, 0, 0, 0][step],
            "lld/delta_correct": [0.01, -0.02, -0.03, float("nan"), 0.0, -0.01][step],
            "lld/phase": [0, 1, 2, 3, 3, 2][step], "lld/warning": [0, 0, 0, 1, 0, 0][step],
        })
    rows.append({"step": 0, "val_before/em": 0.125})  # Lightning writes evaluation rows apart
    rows.append({"step": 6, "val_after/em": 0.25})
    pd.DataFrame(rows).to_csv(run_dir / "metrics.csv", index=False)
    (run_dir / "summary.json").write_text(json.dumps({"wall_time_s": 600.0}))


def test_summary_numbers(collapse, tmp_path) -> None:
    run = tmp_path / "grpo" / "version_0"
    _write_run(run)
    r = collapse.summarise_run(run, explode_factor=5.0)
    assert r["steps"] == 6  # the evaluation-only row at step 6 is not a training step
    assert (r["dev_em_before"], r["dev_em_after"]) == (0.125, 0.25)
    assert (r["logp_pos_min"], r["logp_pos_min_step"]) == (-0.9, 3)
    assert r["delta_correct_negative_steps"] == 3 and r["delta_correct_measured_steps"] == 5
    assert r["delta_correct_mean"] == pytest.approx((0.01 - 0.02 - 0.03 + 0.0 - 0.01) / 5)
    # median of the per-step max grad norm 1.1: step 3 (12 > 5.5) and step 5 (NaN max) explode; step 1 was vetoed.
    assert (r["exploding_steps"], r["vetoed_steps"], r["vetoed_or_exploding_steps"]) == (2, 1, 3)
    assert r["first_warning_step"] == 3 and r["steps_in_acceleration"] == 2 and r["final_phase"] == 2
    assert r["train_reward_last5"] == pytest.approx(0.3)
    assert r["signal_steps"] == 5  # steps with an A>0 response (no lld/n_pos column: logp_pos present)
    assert (r["grad_norm_peak"], r["grad_norm_peak_step"]) == (12.0, 3)
    # first third = steps 0-1, last third = steps 4-5 (NaNs skipped)
    assert r["logp_pos_first_third"] == pytest.approx(-0.45) and r["logp_pos_last_third"] == pytest.approx(-0.7)
    assert r["reward_first_third"] == pytest.approx(0.05) and r["reward_last_third"] == pytest.approx(0.45)


def test_a_run_without_learning_signal_is_called_out(collapse, tmp_path) -> None:
    _write_run(tmp_path / "grpo" / "version_0")
    csv = tmp_path / "grpo" / "version_0" / "metrics.csv"
    frame = pd.read_csv(csv).assign(**{"lld/n_pos": 0.0, "lld/logp_pos": float("nan")})
    frame.to_csv(csv, index=False)
    collapse.report(tmp_path, ["grpo"], 5.0, 1, {})
    assert "NO LEARNING SIGNAL in GRPO:" in (tmp_path / "collapse.md").read_text()


def test_report_writes_table_figure_and_json(collapse, tmp_path) -> None:
    for arm in ("grpo", "llds"):
        _write_run(tmp_path / arm / "version_0")
    payload = collapse.report(tmp_path, ["grpo", "llds"], 5.0, 1, {"recipe": "x"})
    table = (tmp_path / "collapse.md").read_text()
    assert "| GRPO+LLDS | 0.125 -> 0.250 | -0.900 (3) | -0.0100 (3 / 5) | 3 of 6 | 12.00 (3) | step 3 |" in table
    assert "| GRPO | -0.450 -> -0.700 | -1.000 -> -1.000 |" in table
    assert (tmp_path / "collapse.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "collapse.json").read_text())["arms"]["llds"]["first_warning_step"] == 3
    assert not math.isnan(payload["arms"]["grpo"]["grad_norm_median"])


def test_fit_command_composes_recipe_then_arm(collapse, tmp_path) -> None:
    cmd = collapse.fit_command("llds", "benchmarks/collapse.yaml", tmp_path, 7, 12, ["configs/guard.yaml"], ["--model.lr", "1e-4"])
    configs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"]
    assert configs == ["benchmarks/collapse.yaml", "configs/llds.yaml", "configs/guard.yaml"]
    assert cmd[cmd.index("--seed_everything") + 1] == "7" and cmd[cmd.index("--data.seed") + 1] == "7"
    assert cmd[cmd.index("--trainer.max_steps") + 1] == "12" and cmd[-2:] == ["--model.lr", "1e-4"]


def test_smoke_run_warm_starts_then_runs_both_arms_side_by_side(collapse, tmp_path) -> None:
    """The whole experiment end to end at toy size: knowledge base, supervised warm start, both arms
    at once (one thread each) from the warm-started weights, table, figure."""
    out = tmp_path / "smoke"
    assert collapse.main(["--smoke", "--steps", "1", "--parallel", "--out", str(out)]) == 0
    warm = json.loads((out / "warmstart" / "lldslight_export.json").read_text())
    assert warm["warm_start"]["kept"] > 0 and math.isfinite(warm["warm_start"]["final_loss"])
    result = json.loads((out / "collapse.json").read_text())
    assert set(result["arms"]) == {"grpo", "llds"} and result["meta"]["warm_start"] == collapse.WARM_START["smoke"]
    for arm in ("grpo", "llds"):
        config = (out / arm / "version_0" / "config.yaml").read_text()
        assert str(out / "warmstart") in config  # the arm trained the warm-started weights
        assert "random_init: null" in config
    assert (out / "collapse.png").stat().st_size > 0 and (out / "collapse.md").is_file()

"""benchmarks/collapse.py: collapse detection on hand-made metric series with known events, the
report over seeds x arms, and the whole smoke pipeline end to end."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from conftest import load_benchmark

NAN = float("nan")
# The hand-worked runs assume 5-step reward smoothing (collapse.py defaults to 20: lab steps are noisy).


@pytest.fixture(scope="module")
def collapse():
    return load_benchmark("collapse")


def test_decay_run_counts_measured_steps_only(collapse) -> None:
    steps = list(range(14))
    phase = [1, 2, 2, 2, 3, 2, 2, 2, 2, 2, 2, 2, 1, 2]
    measured = [True] * 14
    measured[5] = False  # an unmeasured step inside the run neither counts nor breaks it
    # measured decay steps from 1: 1 2 3 4 6 7 8 9 10 11 -> the 10th is step 11
    assert collapse.decay_run(steps, phase, measured, 10) == (1, 11)
    assert collapse.decay_run(steps, phase, [True] * 14, 12) is None  # step 12 (phase 1) breaks it at 11
    broken = phase[:6] + [1] + phase[7:]
    assert collapse.decay_run(steps, broken, [True] * 14, 10) is None


def test_reward_fall_against_running_peak(collapse) -> None:
    crit = collapse.Criteria(reward_smooth=1, fall_fraction=0.5, fall_steps=3)
    steps = list(range(10))
    reward = [0.2, 0.6, 0.8, 0.5, 0.4, 0.39, 0.3, 0.41, 0.2, 0.1]
    # peak 0.8 -> threshold 0.4: steps 4, 5, 6 are <= 0.4, step 7 is not
    assert collapse.reward_fall(steps, reward, crit) == 4
    assert collapse.reward_fall(steps, reward, crit, after=5) is None  # 5, 6 then 7 breaks; 8, 9 only two
    assert collapse.reward_fall(steps, [0.0] * 10, crit) is None  # no positive peak: nothing to fall from
    # trailing mean of 2: [nan, .4, .7, .65, .45, .395, .345, .355, .305, .15]; peak .7 -> .35: steps 6..9? 6 .345 ok, 7 .355 no
    smooth = collapse.Criteria(reward_smooth=2, fall_fraction=0.5, fall_steps=2)
    assert collapse.smoothed_reward(reward, 2)[1:4] == pytest.approx([0.4, 0.7, 0.65])
    assert collapse.reward_fall(steps, reward, smooth) == 8


def test_explosions_like_the_guard(collapse) -> None:
    crit = collapse.Criteria(explode_factor=10.0, explode_window=3, explode_warmup=3)
    steps = list(range(9))
    mean = [1.0, 0.0, 2.0, 3.0, 25.0, 3.0, 4.0, 1.0, 1.0]
    peak = [1.0, 0.0, 2.0, 3.0, 25.0, 31.0, NAN, 1.0, 1.0]
    vetoed = [0, 0, 0, 0, 0, 0, 0, 1, 0]
    # history (non-zero, non-exploding means): 1, 2, 3 after step 3 -> median 2: step 4 (25 > 20) explodes and
    # stays out of the history; step 5: median of 1, 2, 3 = 2 -> 31 > 20 explodes; step 6 NaN; step 7 vetoed.
    assert collapse.explosions(steps, mean, peak, vetoed, crit) == [4, 5, 6, 7]
    early = collapse.Criteria(explode_factor=10.0, explode_window=3, explode_warmup=4)
    assert collapse.explosions(steps[:5], mean[:5], peak[:5], vetoed[:5], early) == []  # warm-up not over at step 4


def frame_of(rows: dict[str, list]) -> pd.DataFrame:
    return pd.DataFrame(rows).set_index("step")


def series(n: int = 60, **events) -> dict[str, list]:
    """60 steps of a run: phases, log-prob, reward, grad norms, Delta and warnings (defaults: flat)."""
    base = {
        "step": list(range(n)),
        "train/reward": [min(0.8, 0.1 + 0.025 * s) for s in range(n)],
        "lld/logp_pos": [-0.1] * n, "lld/logp_neg": [-1.0] * n, "train/entropy": [0.5] * n,
        "lld/phase": [0] * 10 + [1] * (n - 10), "lld/warning": [0] * n,
        "train/grad_norm": [1.0] * n, "train/grad_norm_max": [1.5] * n, "lld/delta_correct": [0.01] * n,
        "lld/n_pos": [2.0] * n,
    }
    base.update(events)
    return base


def collapsing_run() -> dict[str, list]:
    """Decay 20-31, acceleration 32-40 (warning at 32), reward 0.8 until 34 then 0.1, a spike at 45."""
    n = 60
    s = series(n)
    s["lld/phase"] = [0] * 10 + [1] * 10 + [2] * 12 + [3] * 9 + [1] * 19
    s["lld/logp_pos"][25] = NAN
    s["lld/warning"][32] = 1
    s["train/reward"] = [min(0.8, 0.1 + 0.025 * t) for t in range(35)] + [0.1] * 25
    s["train/grad_norm_max"][45] = 50.0
    for t in (22, 28, 33, 50):
        s["lld/delta_correct"][t] = -0.02
    s["lld/delta_correct"][24] = NAN
    return s


def test_a_collapse_with_warning_lead_and_mechanism(collapse) -> None:
    r = collapse.detect(frame_of(collapsing_run()), collapse.Criteria(reward_smooth=5))
    # measured decay steps 20-24, 26-30 (25 unmeasured): confirmed at the 10th, step 30
    assert (r["decay_start"], r["decay_confirmed"]) == (20, 30)
    # smoothed over 5: k steps of 0.1 in the window: (0.8 (5 - k) + 0.1 k) / 5 <= 0.4 from k = 3, step 37
    assert r["reward_fall"] == 37 and r["reward_fall_any"] == 37
    assert r["explosion_steps"] == [45] and r["explosion"] == 45
    assert r["collapsed"] and (r["collapse_step"], r["collapse_cause"]) == (37, "reward fall")
    assert r["warnings"] == [32] and r["lead_time"] == 5 and r["false_alarms"] == 0
    # Delta < 0 at 22, 28, 33 before step 37 (50 is after); measured before 37: 37 steps minus the NaN at 24
    assert (r["delta_negative_before"], r["delta_measured_before"]) == (3, 36)


def test_no_collapse_without_ten_decay_steps_and_false_alarms_counted(collapse) -> None:
    s = collapsing_run()
    s["lld/phase"] = [0] * 10 + [1] * 10 + [2] * 6 + [1] * 34  # 20-25: five measured decay steps (25 unmeasured)
    r = collapse.detect(frame_of(s), collapse.Criteria(reward_smooth=5))
    assert r["decay_start"] is None and not r["collapsed"]
    assert r["reward_fall_any"] == 37 and r["reward_fall"] is None  # fell, but not after a decay
    assert r["false_alarms"] == 1 and r["lead_time"] is None
    assert r["delta_negative_before"] == 4  # no collapse: counted over the whole run


def test_explosion_after_decay_is_a_collapse(collapse) -> None:
    s = collapsing_run()
    s["train/reward"] = [0.8] * 60  # no reward fall at all
    s["train/grad_norm_max"][45] = 1.5
    s["train/grad_norm_max"][38] = NAN  # a non-finite norm: the guard vetoes it whatever the median
    s["train/grad_norm_max"][5] = 99.0  # in the guard's warm-up (5 of 10 steps seen): not judged
    s["train/grad_norm_max"][15] = 99.0  # > 10 x the median 1.0, but before the decay: not a collapse
    r = collapse.detect(frame_of(s), collapse.Criteria(reward_smooth=5))
    assert r["explosion_steps"] == [15, 38] and r["explosion"] == 38
    assert r["collapsed"] and (r["collapse_step"], r["collapse_cause"]) == (38, "gradient explosion")
    assert r["lead_time"] == 6


def write_run(path: Path, rows: dict[str, list], em: tuple[float, float] = (0.25, 0.5)) -> None:
    path.mkdir(parents=True)
    frame = pd.DataFrame(rows)
    extra = pd.DataFrame([{"step": 0, "val_before/em": em[0]}, {"step": len(frame), "val_after/em": em[1]}])
    pd.concat([frame, extra]).to_csv(path / "metrics.csv", index=False)  # evaluation rows logged apart
    (path / "summary.json").write_text(json.dumps({"wall_time_s": 600.0}))


def test_report_over_seeds_and_arms(collapse, tmp_path) -> None:
    quiet = series(60)
    quiet["lld/warning"][40] = 1  # a false alarm
    write_run(collapse.run_dir(tmp_path, "grpo", 0), collapsing_run(), em=(0.25, 0.125))
    write_run(collapse.run_dir(tmp_path, "grpo", 1), quiet)
    write_run(collapse.run_dir(tmp_path, "llds", 0), series(60), em=(0.25, 0.75))
    meta = {"recipe": "r.yaml", "runs": {"grpo/seed0": {"command": "fit ...", "wall_s": 1200.0}, "llds/seed1": {"error": "exit 1; log: x"}}}
    payload = collapse.report(tmp_path, [("grpo", 0), ("grpo", 1), ("llds", 0), ("llds", 1)], collapse.Criteria(reward_smooth=5), meta)
    arms = payload["arms"]
    assert arms["grpo"] == {"runs": 2, "failed": 0, "collapses": 1, "mean_dev_em_after": pytest.approx(0.3125), "mean_lead_time": 5.0,
                            "warned_collapses": 1, "false_alarm_runs": 1, "false_alarms": 1}
    assert arms["llds"]["collapses"] == 0 and arms["llds"]["failed"] == 1 and arms["llds"]["mean_lead_time"] is None
    runs = {(r["arm"], r["seed"]): r for r in payload["runs"]}
    assert runs[("grpo", 0)]["wall_s"] == 1200.0 and runs[("grpo", 1)]["wall_s"] == 600.0  # the runner's, else summary.json's
    assert runs[("grpo", 0)]["steps"] == 60 and runs[("grpo", 0)]["dev_em_after"] == 0.125
    table = (tmp_path / "collapse.md").read_text()
    assert "| GRPO | 0 | yes, step 37 (reward fall) | 20, 30 | 37 | 45 | 32 | 5 | 0 | 3 / 36 | 0.250 -> 0.125 | 60 | 20 min |" in table
    assert "| LLDS action gate | 1 | FAILED: exit 1; log: x |" in table
    assert "| GRPO | 1 of 2 | 0.312 | 5.0 | 1 of 1 | 1 of 1 |" in table
    assert "NO LEARNING SIGNAL" not in table
    assert (tmp_path / "collapse.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "collapse.json").read_text())["runs"][0]["collapse_step"] == 37


def test_a_run_without_learning_signal_is_called_out(collapse, tmp_path) -> None:
    write_run(collapse.run_dir(tmp_path, "grpo", 3), series(12, **{"lld/n_pos": [0.0] * 12, "lld/logp_pos": [NAN] * 12}))
    collapse.report(tmp_path, [("grpo", 3)], collapse.Criteria(reward_smooth=5), {})
    assert "NO LEARNING SIGNAL in GRPO seed 3:" in (tmp_path / "collapse.md").read_text()


def test_fit_command_composes_recipe_then_arm(collapse, tmp_path) -> None:
    cmd = collapse.fit_command("llds_response", "configs/lab/x.yaml", tmp_path, 7, 12, ["configs/guard.yaml"], ["--model.lr", "1e-4"])
    configs = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--config"]
    assert configs == ["configs/lab/x.yaml", "configs/llds_response.yaml", "configs/guard.yaml"]
    assert cmd[cmd.index("--seed_everything") + 1] == "7" and cmd[cmd.index("--data.seed") + 1] == "7"
    assert cmd[cmd.index("--trainer.logger.init_args.save_dir") + 1] == str(tmp_path / "llds_response")
    assert cmd[cmd.index("--trainer.logger.init_args.name") + 1] == "seed7"
    assert cmd[cmd.index("--trainer.max_steps") + 1] == "12" and cmd[-2:] == ["--model.lr", "1e-4"]


def test_smoke_pipeline_end_to_end(collapse, tmp_path) -> None:
    """At toy size: knowledge base, warm start, 3 arms x 1 seed two at a time (one thread each) from the
    warm-started weights, then collapse.json / .md / .png; --report-only redoes them from the runs."""
    out = tmp_path / "smoke"
    assert collapse.main(["--smoke", "--steps", "2", "--out", str(out)]) == 0
    warm = json.loads((out / "warmstart" / "lldslight_export.json").read_text())
    assert warm["warm_start"]["kept"] > 0 and math.isfinite(warm["warm_start"]["final_loss"])
    result = json.loads((out / "collapse.json").read_text())
    assert [(r["arm"], r["seed"]) for r in result["runs"]] == [("grpo", 0), ("llds", 0), ("llds_response", 0)]
    assert all("error" not in r and r["steps"] == 2 and r["wall_s"] > 0 for r in result["runs"])
    assert result["meta"]["jobs"] == 2 and result["meta"]["warm_start"] == collapse.WARM_START["smoke"]
    for arm in ("grpo", "llds", "llds_response"):
        config = (collapse.run_dir(out, arm, 0) / "config.yaml").read_text()
        assert str(out / "warmstart") in config and "random_init: null" in config  # trained the warm-started weights
        assert ("gate: response" in config) == (arm == "llds_response")
    assert (out / "collapse.png").stat().st_size > 0 and (out / "collapse.md").is_file()
    (out / "collapse.md").unlink()
    assert collapse.main(["--report-only", "--out", str(out)]) == 0
    again = json.loads((out / "collapse.json").read_text())
    assert again["runs"] == result["runs"] and (out / "collapse.md").is_file()

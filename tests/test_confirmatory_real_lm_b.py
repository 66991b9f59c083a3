"""lab/confirmatory.py --real-lm-b, the real-model lab's Stage B (PREREGISTRATION_real_lm_B.md), on
small hand-made archives written here (per-step metrics.csv.gz and the set's collapse.json, as
lab/collapse.py writes them): collapse steps, exact p-values, Holm and the horizon rule worked out by
hand below, a partial set that computes no test, and a seed whose arms ran on two machine kinds."""
import csv
import gzip
import json
from math import comb

import pytest
from conftest import load_lab

H = 100
SEEDS = range(10, 16)
KIND = {"cpu_model": "Intel Xeon", "cpu_flags_simd": ["avx512_bf16", "amx_bf16"], "cpu_capability": "AVX512", "torch": "2.x"}
DROP = 10  # a collapsing run earns 0 from this step. By hand, for a reward r before it: the first trailing-20
# mean (step 19) holds 10 non-zero steps, 10r/20, and is the running peak; from step t the window holds
# 29 - t non-zero steps, <= half the peak once 29 - t <= 5: from step 24 on, past the 30-step hold.
# Rewards are multiples of 1/4 so that the sums are exact in binary (no tie decided by rounding).
COLLAPSE_STEP = 24


@pytest.fixture(scope="module")
def conf():
    return load_lab("confirmatory")


def write_run(path, reward: float, collapse: bool, drop: int = DROP) -> None:
    """100 steps, every rollout answered and searching: a constant reward, 0 from DROP when it collapses."""
    path.mkdir(parents=True)
    with gzip.open(path / "metrics.csv.gz", "wt", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "train/reward", "train/answered_rate", "diag/tool_call_rate", "lld/logp_pos"])
        for step in range(H):
            w.writerow([step, 0.0 if collapse and step >= drop else reward, 1.0, 1.0, -0.5])


def make_b(lab, collapsed: dict[str, set], rewards: dict[str, float], skip=(), other_kind=(), drop: int = DROP) -> None:
    runs = {}
    for arm in ("grpo", "llds", "stable"):
        for seed in SEEDS:
            if (arm, seed) in skip:
                continue
            write_run(lab / "real_lm_B" / f"{arm}_1e-3" / f"seed{seed}", rewards[arm], seed in collapsed[arm], drop)
            kind = {**KIND, "cpu_model": "AMD EPYC"} if (arm, seed) in other_kind else KIND
            runs[f"{arm}_1e-3/seed{seed}"] = {"cpu_s": 1200.0, "machine_kind": {**kind, "init": ".lldslight/demo_warmstart", "init_digest": "w"}}
    meta = {"recipe": "lab/configs/real_lm.yaml", "arms": [f"{a}_1e-3" for a in ("grpo", "llds", "stable")], "seeds": list(SEEDS),
            "horizon": H, "runs": runs}
    (lab / "real_lm_B" / "collapse.json").write_text(json.dumps({"meta": meta}))


def fisher_by_hand(a: int, b: int, n: int) -> float:
    """P(treated collapses <= b | margins), two arms of n, a + b collapses in all (hypergeometric)."""
    total = a + b
    return sum(comb(total, k) * comb(2 * n - total, n - k) for k in range(0, b + 1)) / comb(2 * n, n)


def test_a_complete_set_by_hand(conf, tmp_path):
    # GRPO 6 of 6; LLDS 1 of 6 (seed 12); the bound 2 of 6 (seeds 10, 11).
    make_b(tmp_path, {"grpo": set(SEEDS), "llds": {12}, "stable": {10, 11}}, {"grpo": 0.5, "llds": 0.5, "stable": 0.25})
    rep = conf.b_report(tmp_path)
    assert rep["status"] == "complete" and rep["collapsed"] == {"grpo": 6, "llds": 1, "stable": 2}
    # by hand: 7 collapses in 12 runs, LLDS holds 1 of them at most: C(7,1) C(5,5) / C(12,6) = 7 / 924;
    # 8 collapses, the bound holds 2 at most (4 non-collapses fill the rest): C(8,2) C(4,4) / 924 = 28 / 924
    p1, p2 = 7 / 924, 28 / 924
    assert fisher_by_hand(6, 1, 6) == pytest.approx(p1) and fisher_by_hand(6, 2, 6) == pytest.approx(p2)
    b = rep["claims"]
    assert b["llds"]["p"] == pytest.approx(p1) and b["stable"]["p"] == pytest.approx(p2)
    # Holm: the smaller (7/924) x 2 = 0.01515 <= 0.05; the larger x 1 = 28/924 = 0.0303 <= 0.05
    assert b["llds"]["p_holm"] == pytest.approx(2 * p1) and b["stable"]["p_holm"] == pytest.approx(p2)
    assert b["llds"]["passes"] and b["stable"]["passes"]
    # every GRPO run collapsed at step 24: median 24 <= H / 2 = 50, the horizon rule holds
    assert rep["grpo_median_time"] == COLLAPSE_STEP and rep["horizon_rule_holds"]
    assert b["llds"]["verdict"] == "LLDS prevented the collapse within 100 steps"
    # last-20 reward: GRPO's collapsed runs earn 0; LLDS 0.5 on 5 seeds, 0 on one; the bound 0.25 on 4
    assert b["llds"]["final_reward"]["mean_diff"] == pytest.approx(5 * 0.5 / 6)
    assert b["stable"]["final_reward"]["mean_diff"] == pytest.approx(4 * 0.25 / 6)
    # RMST to 100: GRPO all at 24 (area 24); LLDS 5 runs held and one at 24: KM area 24 + (5/6) x 76
    assert b["llds"]["rmst_difference"]["diff"] == pytest.approx(5 / 6 * 76)
    assert "P1 (llds vs grpo" in conf.b_text(rep) and "Holm 0.0152" in conf.b_text(rep)


def test_holm_can_fail(conf, tmp_path):
    # GRPO 4 of 6, LLDS and the bound 0 of 6: p = C(4,0) C(8,6) / C(12,6) = 28/924 = 0.0303 each;
    # Holm: the smaller x 2 = 56/924 = 0.0606 > 0.05, the other max(0.0606, 0.0303): neither passes,
    # though each alone would have passed at 0.05
    make_b(tmp_path, {"grpo": {10, 11, 12, 13}, "llds": set(), "stable": set()}, {"grpo": 0.5, "llds": 0.5, "stable": 0.5})
    rep = conf.b_report(tmp_path)
    for arm in ("llds", "stable"):
        c = rep["claims"][arm]
        assert c["p"] == pytest.approx(28 / 924) and c["p_holm"] == pytest.approx(56 / 924) and not c["passes"]
        assert c["verdict"].startswith("not supported")


def test_a_late_collapse_breaks_the_horizon_rule(conf, tmp_path):
    # Rewards drop at step 52: the peak is the reward itself and the window keeps 71 - t non-zero steps,
    # <= 10 from step 61 (held to 90 < H). GRPO 6 of 6 at 61: median 61 > H / 2 = 50. LLDS 0 of 6:
    # p = 1/924, Holm 2/924: passes, but only "fewer runs collapsed", not "prevented"
    make_b(tmp_path, {"grpo": set(SEEDS), "llds": set(), "stable": set(SEEDS)}, {"grpo": 0.5, "llds": 0.5, "stable": 0.5}, drop=52)
    rep = conf.b_report(tmp_path)
    assert rep["grpo_median_time"] == 61 and not rep["horizon_rule_holds"]
    llds = rep["claims"]["llds"]
    assert llds["p_holm"] == pytest.approx(2 / 924) and llds["passes"]
    assert llds["verdict"] == "fewer runs collapsed within 100 steps with LLDS (the horizon rule did not hold)"
    assert rep["claims"]["stable"]["p"] == 1.0 and not rep["claims"]["stable"]["passes"]


def test_a_partial_set_computes_no_test(conf, tmp_path):
    make_b(tmp_path, {"grpo": set(SEEDS), "llds": set(), "stable": set()}, {"grpo": 0.4, "llds": 0.4, "stable": 0.4},
           skip={("stable", 15)})
    rep = conf.b_report(tmp_path)
    assert rep["status"] == "partial" and "claims" not in rep and "runs" not in rep
    assert rep["counts"]["stable"] == {"archived": 5, "registered": 6} and rep["missing"] == ["real_lm_B/stable_1e-3/seed15"]


def test_a_seed_split_across_machines_is_refused(conf, tmp_path):
    make_b(tmp_path, {"grpo": set(), "llds": set(), "stable": set()}, {"grpo": 0.4, "llds": 0.4, "stable": 0.4},
           other_kind={("stable", 13)})
    with pytest.raises(SystemExit, match=r"seeds \[13\] ran their arms on different machine kinds"):
        conf.b_report(tmp_path)

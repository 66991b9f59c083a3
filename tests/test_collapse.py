"""lldslight.science.collapse on hand-built series: each expected step is worked out by hand in the test."""
from __future__ import annotations

import itertools
import math

import pandas as pd
import pytest

from lldslight.science import collapse as C

CRIT = C.CollapseCriteria(smooth=2, hold=3, mode_window=4)


def test_trailing_mean_and_peak_by_hand():
    assert C.trailing_mean([1, 3, float("nan"), 5], 2)[1:] == [2.0, 3.0, 5.0]
    assert math.isnan(C.trailing_mean([1, 3], 2)[0])
    assert C.running_peak([float("nan"), 1, 0.5, 2])[1:] == [1, 1, 2]


def test_reward_collapse_step_by_hand():
    # trailing-2 means: -, .8, .8, .6, .3, .2, .2, .2 ; peak .8, half .4 -> low from index 4
    reward = [0.8, 0.8, 0.8, 0.4, 0.2, 0.2, 0.2, 0.2]
    c = C.find_collapse(reward, None, CRIT)
    assert (c.collapsed, c.index, c.cause) == (True, 4, "reward")


def test_a_dip_shorter_than_hold_is_not_a_collapse():
    reward = [0.8, 0.8, 0.1, 0.1, 0.8, 0.8, 0.8, 0.8]  # trailing low at indices 2,3 only (< hold 3)
    assert not C.find_collapse(reward, None, CRIT).collapsed


def test_answered_collapse_comes_first_and_is_death():
    reward = [0.5] * 10
    answered = [1, 1, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]  # trailing .6 at 2, then .2 from 3
    c = C.find_collapse(reward, answered, CRIT, tool_call=[1.0] * 10, steps=list(range(100, 110)))
    assert (c.collapsed, c.index, c.step, c.cause, c.mode) == (True, 3, 103, "answered", "death")


def test_both_conditions_from_the_same_step_is_a_reward_collapse():
    # trailing-2 reward: -, .8, .8, .6, .3, ... -> low (<= .4) from index 4;
    # trailing-2 answered: -, 1, 1, .7, .4, ... -> low (< .5) from index 4 too: a tie, and the
    # documented tie-break says "reward" (comparing the names would say "answered")
    reward = [0.8, 0.8, 0.8, 0.4, 0.2, 0.2, 0.2, 0.2]
    answered = [1.0, 1.0, 1.0, 0.4, 0.4, 0.4, 0.4, 0.4]
    c = C.find_collapse(reward, answered, CRIT, tool_call=[1.0] * 8)
    assert (c.index, c.reward_index, c.answered_index, c.cause) == (4, 4, 4, "reward")


def test_decay_when_the_agent_keeps_searching_and_answering():
    reward = [0.8, 0.8, 0.8, 0.4, 0.2, 0.2, 0.2, 0.2]
    c = C.find_collapse(reward, [0.95] * 8, CRIT, tool_call=[0.9] * 8)
    assert (c.collapsed, c.mode) == (True, "decay")
    c = C.find_collapse(reward, [0.95] * 8, CRIT, tool_call=[0.9] * 5 + [0.1] * 3)
    assert c.mode == "death"  # it stopped searching within the mode window


def test_explosions_like_with_like_and_zero_gradients_ignored():
    crit = C.CollapseCriteria(explode_warmup=3, explode_window=5)
    # zeros (all groups tied) do not drag the median down: median of [1,1,1] is 1, so 5 is no
    # explosion; 20 is (> 10 x 1); a NaN step is not logged; inf always explodes.
    grad = [1.0, 0.0, 1.0, 0.0, 0.0, 1.0, 5.0, 20.0, float("nan"), float("inf")]
    assert C.explosions(grad, crit) == [7, 9]
    # With the zeros counted the median would be 0 and every step a spike: the bug this avoids.


def test_explosion_settings_are_the_guards():
    """The lab counts an explosion where GradientSpikeGuard (at its defaults, and as configs/guard.yaml
    sets it) would veto the update: the three numbers are pinned here, apart from both, so that
    neither can change alone."""
    import inspect

    import yaml

    from lldslight.callbacks.guard import GradientSpikeGuard
    from tests.conftest import ROOT

    guard = {k: p.default for k, p in inspect.signature(GradientSpikeGuard.__init__).parameters.items()}
    crit = C.CollapseCriteria()
    lab = {"factor": crit.explode_factor, "window": crit.explode_window, "warmup": crit.explode_warmup}
    assert lab == {k: guard[k] for k in lab} == {"factor": 10.0, "window": 50, "warmup": 10}
    preset = yaml.safe_load((ROOT / "configs" / "guard.yaml").read_text())["trainer"]["callbacks+"]
    (init,) = [c["init_args"] for c in preset if c["class_path"].endswith("GradientSpikeGuard")]
    assert {k: init[k] for k in lab} == lab


def test_summarise_a_frame():
    frame = pd.DataFrame({"train/reward": [0.8, 0.8, 0.8, 0.4, 0.2, 0.2, 0.2, 0.2], "train/answered_rate": [1.0] * 8,
                          "diag/tool_call_rate": [1.0] * 8, "lld/delta_correct": [0.1, -0.1, float("nan"), -0.2] + [0.1] * 4},
                         index=range(10, 18))
    s = C.summarise(frame, CRIT, final_window=4)
    assert s["collapsed"] and s["step"] == 14 and s["mode"] == "decay"
    assert s["peak_reward"] == pytest.approx(0.8) and s["final_reward"] == pytest.approx(0.2)
    assert s["delta_negative_share"] == pytest.approx(2 / 7)


def test_fisher_matches_the_hypergeometric_sum():
    # 5/5 vs 1/5: P(X >= 5) with X ~ Hypergeom(10 runs, 6 collapses, 5 drawn) = C(6,5)C(4,0)/C(10,5)
    assert C.fisher_one_sided(5, 5, 1, 5) == pytest.approx(6 / 252)
    assert C.fisher_one_sided(2, 3, 0, 3) == pytest.approx(0.2)  # the old lab's 2 of 3 vs 0 of 3


def test_sign_test_and_permutation_by_hand():
    assert C.sign_test([(1, 2)] * 5)["p"] == pytest.approx(1 / 32)
    r = C.sign_test([(1, 2), (2, 1), (3, 3)])
    assert (r["wins"], r["losses"], r["ties"]) == (1, 1, 1)
    # diffs 1, 2, 3: of the 8 sign flips only (+,+,+) reaches the observed mean 2
    res = C.paired_permutation([0, 0, 0], [1, 2, 3])
    assert res["mean_diff"] == pytest.approx(2.0) and res["p"] == pytest.approx(1 / 8)
    flips = [sum(s * d for s, d in zip(signs, (1, -2, 3))) for signs in itertools.product((1, -1), repeat=3)]
    assert C.paired_permutation([0, 0, 0], [1, -2, 3])["p"] == pytest.approx(sum(f >= 2 - 1e-12 for f in flips) / 8)


def test_rmst_by_hand():
    # Two runs, horizon 10: one collapses at 4, one censored at 10. KM: S=1 on [0,4), S=1/2 on [4,10).
    assert C.rmst([4, 10], [True, False], 10) == pytest.approx(4 + 0.5 * 6)
    assert C.rmst([10, 10], [False, False], 10) == pytest.approx(10)
    d = C.rmst_difference([(4, True), (4, True)], [(10, False), (10, False)], 10, n_boot=200)
    assert d["diff"] == pytest.approx(6) and d["low"] == pytest.approx(6) and d["high"] == pytest.approx(6)


def test_rmst_bootstrap_resamples_seeds_as_pairs():
    # Every run collapses before the horizon, so RMST = the mean collapse time. Seed 1: 2 vs 4,
    # seed 2: 8 vs 10: B beats A by exactly 2 in each pair, so every paired resample of seeds gives
    # a difference of 2 (a degenerate interval). Resampling arms independently can draw A = {8, 8}
    # and B = {4, 4} (probability 1/16 > 2.5%), a difference of -4, so its interval spans 0.
    a, b = [(2, True), (8, True)], [(4, True), (10, True)]
    paired = C.rmst_difference(a, b, 100, n_boot=2000)
    assert (paired["diff"], paired["low"], paired["high"], paired["paired"]) == (2, 2, 2, True)
    unpaired = C.rmst_difference(a, b, 100, n_boot=2000, paired=False)
    assert unpaired["diff"] == 2 and unpaired["low"] == pytest.approx(-4) and unpaired["high"] == pytest.approx(8)
    with pytest.raises(ValueError, match="paired by seed"):
        C.rmst_difference(a, b[:1], 100)


def test_time_to_collapse_censors_at_the_horizon():
    assert C.time_to_collapse({"collapsed": True, "step": 300, "last_step": 599}, 600) == (300.0, True)
    assert C.time_to_collapse({"collapsed": True, "step": 650, "last_step": 699}, 600) == (600.0, False)
    assert C.time_to_collapse({"collapsed": False, "last_step": 599}, 600) == (600.0, False)


def test_criteria_reject_bad_values():
    with pytest.raises(ValueError, match="fall_fraction"):
        C.CollapseCriteria(fall_fraction=1.5)


def test_holm_by_hand():
    # The lab's five primary tests as first reported: sorted 0.004, 0.024, 0.083, 0.262, 0.5 ->
    # x5, x4, x3, x2, x1 = 0.02, 0.096, 0.249, 0.524, 0.5 -> made non-decreasing: the last 0.524
    adjusted = C.holm([0.004, 0.5, 0.024, 0.083, 0.262])
    assert adjusted == pytest.approx([0.02, 0.524, 0.096, 0.249, 0.524])
    assert C.holm([0.3, 0.9]) == pytest.approx([0.6, 0.9]) and C.holm([]) == []


def test_stratified_fisher_by_hand():
    from scipy.stats import fisher_exact

    # One stratum: Fisher's own one-sided test (scipy, an independent implementation).
    for table in ((5, 5, 1, 5), (3, 5, 1, 5), (7, 10, 2, 10)):
        ca, na, cb, nb = table
        want = fisher_exact([[ca, na - ca], [cb, nb - cb]], alternative="greater").pvalue
        assert C.fisher_stratified_one_sided([table]) == pytest.approx(want)
    # Two strata of 1 vs 1 run, each with one collapse: A's count in each is 1 with probability 1/2
    # (which of the two runs collapsed), so P(sum >= 2) = 1/4 by hand; pooling would say
    # Fisher([[2, 0], [0, 2]]) = 1/6.
    assert C.fisher_stratified_one_sided([(1, 1, 0, 1), (1, 1, 0, 1)]) == pytest.approx(0.25)
    # A stratum with no collapse at all carries no information: the p-value is unchanged.
    assert C.fisher_stratified_one_sided([(5, 5, 1, 5), (0, 3, 0, 3)]) == pytest.approx(C.fisher_one_sided(5, 5, 1, 5))

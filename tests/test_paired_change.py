"""evaluation.paired_change: the demo's "EM before vs after, with a paired standard error"."""
import math

import pytest
from scipy import stats

from lldslight.rollout.evaluation import paired_change


def rec(q: str, em: float, source: str = "nq", gold=("a",)) -> dict:
    return {"data_source": source, "question": q, "golden_answers": list(gold), "em": em}


def test_hand_worked_example():
    # d = after - before per question: q1 +1, q2 0, q3 0, q4 +1 -> mean 0.5;
    # sample var = ((0.5)^2 * 4) / 3 = 1/3; se = sqrt(1/3 / 4) = 0.288675...
    before = [rec("q1", 0), rec("q2", 1), rec("q3", 0), rec("q4", 0)]
    after = [rec("q4", 1), rec("q3", 0), rec("q2", 1), rec("q1", 1)]  # another order: pairing is by question
    out = paired_change(before, after)
    assert out["n"] == 4 and out["before"] == 0.25 and out["after"] == 0.75 and out["change"] == 0.5
    assert out["se"] == pytest.approx(math.sqrt(1 / 12))
    assert out["z"] == pytest.approx(0.5 / math.sqrt(1 / 12))


def test_agrees_with_scipy_paired_t_statistic():
    import random

    rng = random.Random(3)
    b = [float(rng.random() < 0.4) for _ in range(64)]
    a = [float(rng.random() < 0.55) for _ in range(64)]
    out = paired_change([rec(f"q{i}", x) for i, x in enumerate(b)], [rec(f"q{i}", x) for i, x in enumerate(a)])
    t = stats.ttest_rel(a, b).statistic  # the paired t statistic is change / paired se
    assert out["z"] == pytest.approx(t)
    assert out["change"] == pytest.approx(sum(a) / 64 - sum(b) / 64)


def test_pairs_only_common_questions_and_repeats_in_order():
    before = [rec("q", 0), rec("q", 1), rec("only-before", 1), rec("q", 1, source="hotpotqa")]
    after = [rec("q", 1), rec("q", 1), rec("only-after", 0), rec("q", 0, source="hotpotqa")]
    out = paired_change(before, after)
    # nq/q#1: 0 -> 1, nq/q#2: 1 -> 1, hotpotqa/q: 1 -> 0; the unmatched ones are left out.
    assert out["n"] == 3 and out["change"] == pytest.approx(0.0)
    assert out["before"] == pytest.approx(2 / 3) and out["after"] == pytest.approx(2 / 3)


def test_degenerate_cases():
    assert paired_change([], [])["n"] == 0 and math.isnan(paired_change([], [])["change"])
    one = paired_change([rec("q", 0)], [rec("q", 1)])
    assert one["change"] == 1.0 and math.isnan(one["se"])
    same = paired_change([rec("q", 0), rec("r", 0)], [rec("q", 1), rec("r", 1)])
    assert same["se"] == 0.0 and same["z"] == math.inf

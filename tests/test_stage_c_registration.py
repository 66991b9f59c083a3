"""The Stage C registration's "what passes" figures (lab/archive/collapse/PREREGISTRATION_real_lm_C.md),
recomputed from the hypergeometric distribution with math.comb (independent of the scipy call the
analysis uses), and checked against that call too."""
from __future__ import annotations

import re
from math import comb

from conftest import ROOT

PAGE = ROOT / "lab" / "archive" / "collapse" / "PREREGISTRATION_real_lm_C.md"


def one_sided(grpo: int, arm: int, n: int = 12) -> float:
    """P(the arm's count <= arm | both margins), the arm and GRPO n runs each: Fisher's one-sided p."""
    total = grpo + arm
    return sum(comb(total, x) * comb(2 * n - total, n - x) for x in range(arm + 1) if total - x <= n) / comb(2 * n, n)


def test_what_passes_is_the_exact_test_by_hand():
    from lldslight.science.collapse import fisher_one_sided

    text = " ".join(PAGE.read_text().split())
    for grpo, arms in ((12, (3, 5, 6, 7)), (10, (3, 4, 5, 6)), (9, (3, 4))):
        ps = ", ".join(f"{one_sided(grpo, a):.4f}" for a in arms)
        counts = ", ".join(str(a) for a in arms[:-1]) + (f", {arms[-1]}" if len(arms) > 1 else "")
        assert re.search(rf"with GRPO at {grpo} of 12, (an arm at )?{re.escape(counts)} (of 12 )?gives? {re.escape(ps)}", text), (grpo, ps)
        for a in arms:
            assert abs(fisher_one_sided(grpo, 12, a, 12) - one_sided(grpo, a)) < 1e-12
    # the sentence's thresholds at GRPO 10 of 12
    assert one_sided(10, 4) <= 0.025 < one_sided(10, 5) <= 0.05 < one_sided(10, 6)
    assert "the first Holm step (<= 0.025) with at most 4 collapses and the second (<= 0.05) with at most 5" in text

"""The collapse lab's reading of the real-model runs (docs/lab/collapse_lab.md, Stages A and B):
what the likelihood of correct responses did before each GRPO tool death, recomputed from the
archived metrics with the csv module alone, and every figure the page quotes checked against it.

The reading: `lld/logp_pos` (the sampler's log-prob of its own sampled correct responses) rises as
entropy falls, so it cannot show displacement; `lld/delta_correct` (the change across a step's
updates) was most negative on the 1-2 updates before each of Stage B's GRPO tool deaths, on the
same update as the run's largest drift: displacement and drift x rate coincide there.
"""
from __future__ import annotations

import csv
import gzip
import math
import statistics

import pytest
from conftest import ROOT

ARCHIVE = ROOT / "lab" / "archive" / "collapse"
PAGE = ROOT / "docs" / "lab" / "collapse_lab.md"
KEYS = ("lld/delta_correct", "drift/kl_k3_last", "diag/tool_call_rate", "train/entropy", "lld/logp_pos")


def columns(run: str) -> dict[str, dict[int, float]]:
    """Each key's finite values by step, from the archived metrics.csv.gz."""
    out: dict[str, dict[int, float]] = {k: {} for k in KEYS}
    with gzip.open(ARCHIVE / run / "metrics.csv.gz", "rt", newline="") as f:
        for row in csv.DictReader(f):
            for k in KEYS:
                if row.get(k) not in (None, ""):
                    v = float(row[k])
                    if math.isfinite(v):
                        out[k][int(row["step"])] = v
    return out


def tool_death(tool: dict[int, float]) -> int | None:
    """The first step from which the tool-call rate stays under 0.5 to the end (None: never)."""
    steps = sorted(tool)
    for i, s in enumerate(steps):
        if all(tool[t] < 0.5 for t in steps[i:]):
            return s
    return None


def window_mean(values: dict[int, float], first: int, last: int) -> float:
    return statistics.fmean(v for s, v in values.items() if first <= s <= last)


def most_negative(values: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(values.items(), key=lambda kv: kv[1])[:n]


def largest(values: dict[int, float]) -> tuple[int, float]:
    return max(values.items(), key=lambda kv: kv[1])


@pytest.fixture(scope="module")
def text() -> str:
    return " ".join(PAGE.read_text().split())  # the page with its line breaks folded


def test_stage_b_tool_deaths_follow_the_most_negative_delta_on_the_largest_drift(text):
    ten = columns("real_lm_B/grpo_1e-3/seed10")
    (s1, d1), (s2, d2) = sorted(most_negative(ten["lld/delta_correct"], 2))
    assert (s1, s2) == (51, 52)
    assert largest(ten["drift/kl_k3_last"])[0] == 52
    tool = ten["diag/tool_call_rate"]
    assert tool_death(tool) == 52 and all(tool[s] == 0 for s in tool if s >= 53) and tool[52] > 0
    kl_max, kl_med = largest(ten["drift/kl_k3_last"])[1], statistics.median(ten["drift/kl_k3_last"].values())
    # the collapse step (61, the archived summary's) and the 10 steps before it
    assert window_mean(ten["train/entropy"], 0, 9) > 0.7 > 0.3 > window_mean(ten["train/entropy"], 51, 60)
    quoted = (f"seed 10 {d1:.3f} and {d2:.3f} at steps 51-52 (the tool-call rate fell to {tool[52]:.2f} at step 52 and was 0 from 53)",
              f"`lld/logp_pos` {window_mean(ten['lld/logp_pos'], 0, 9):.2f} -> {window_mean(ten['lld/logp_pos'], 51, 60):.2f} in seed 10",
              f"falls, {window_mean(ten['train/entropy'], 0, 9):.2f} -> {window_mean(ten['train/entropy'], 51, 60):.2f} there",
              f"KL {kl_max:.3f} at step 52")
    fourteen = columns("real_lm_B/grpo_1e-3/seed14")
    ((s, d),) = most_negative(fourteen["lld/delta_correct"], 1)
    k_step, k = largest(fourteen["drift/kl_k3_last"])
    assert s == k_step == 93 and tool_death(fourteen["diag/tool_call_rate"]) == 95
    quoted += (f"seed 14 {d:.3f} at step 93 (the tool-call rate under 0.5 from step 95)",
               f"and {k:.3f} at step 93, against run medians of {kl_med:.4f} and {statistics.median(fourteen['drift/kl_k3_last'].values()):.4f}")
    for seed, step in ((11, 60), (15, 75)):
        run = columns(f"real_lm_B/grpo_1e-3/seed{seed}")
        ((s, d),) = most_negative(run["lld/delta_correct"], 1)
        assert s == step and tool_death(run["diag/tool_call_rate"]) is None
        quoted += (f"seed {seed} {d:.3f} at step {step}",)
    for q in quoted:
        assert q in text, q


def test_stage_a_tool_deaths_and_delta_correct(text):
    runs = {seed: columns(f"real_lm_A/grpo_1e-3/seed{seed}") for seed in (1, 2, 3)}
    deaths = {seed: tool_death(r["diag/tool_call_rate"]) for seed, r in runs.items()}
    assert deaths == {1: 24, 2: 14, 3: 65}
    three = runs[3]
    ((s, d),) = most_negative(three["lld/delta_correct"], 1)
    assert s == deaths[3] - 1
    kl, med = three["drift/kl_k3_last"][s], statistics.median(three["drift/kl_k3_last"].values())
    two = runs[2]["lld/delta_correct"]
    assert two[12] > 0 and two[13] > 0
    assert largest({k: v for k, v in runs[2]["drift/kl_k3_last"].items() if k <= 14})[0] == 14
    quoted = [f"({d:.3f} at step {s}, with a drift of {kl:.3f}, {kl / med:.0f}x the run's median)",
              f"(+{two[12]:.3f} and +{two[13]:.3f} at steps 12-13)",
              f"({runs[1]['lld/delta_correct'][22]:.3f} at step 22)"]
    assert min(runs[1]["lld/delta_correct"][s] for s in runs[1]["lld/delta_correct"] if deaths[1] - 4 <= s < deaths[1]) == \
        runs[1]["lld/delta_correct"][22]
    logp = [f"{window_mean(runs[k]['lld/logp_pos'], 0, 9):.2f} -> {window_mean(runs[k]['lld/logp_pos'], deaths[k] - 10, deaths[k] - 1):.2f}"
            for k in (1, 3, 2)]
    quoted.append(f"which rose {logp[0]} (seed 1), {logp[1]} (seed 3) and held {logp[2]} (seed 2) from the first 10 steps to the "
                  "10 before the tool died")
    for q in quoted:
        assert q in text, q
    assert "No likelihood displacement came first" not in text

"""LLD metrics on hand-built trajectories and the phase detector on synthetic likelihood curves."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from lldslight.science import diagnostics as diag

# Three responses (rows), 6 positions; position 0 is the prompt. Row 0: A>0 with two actions
# (action 1 after an observation at t=3); row 1: A<0, one action; row 2: A=0, one short action.
LOGP = torch.tensor([
    [0.0, -1.0, -3.0, 9.9, -2.0, 0.0],
    [0.0, -4.0, -6.0, -8.0, 0.0, 0.0],
    [0.0, -0.5, 0.0, 0.0, 0.0, 0.0],
])
MASK = torch.tensor([
    [0, 1, 1, 0, 1, 0],
    [0, 1, 1, 1, 0, 0],
    [0, 1, 0, 0, 0, 0],
], dtype=torch.bool)
ACTION = torch.tensor([
    [-1, 0, 0, -1, 1, -1],
    [-1, 0, 0, 0, -1, -1],
    [-1, 0, -1, -1, -1, -1],
])
ADV = torch.tensor([1.2, -0.7, 0.0])


def test_set_means_are_per_token_over_each_set() -> None:
    stats = {k: diag.finish(v) for k, v in diag.likelihood_stats(LOGP, MASK, ADV, ACTION).items()}
    assert stats["lld/logp_pos"] == pytest.approx((-1 - 3 - 2) / 3)  # the observation's 9.9 is masked
    assert stats["lld/logp_neg"] == pytest.approx(-6.0)
    assert stats["lld/logp_zero"] == pytest.approx(-0.5)
    # Action level over all responses: first actions hold 6 tokens, later actions 1.
    assert stats["lld/logp_first_action"] == pytest.approx((-1 - 3 - 4 - 6 - 8 - 0.5) / 6)
    assert stats["lld/logp_later_actions"] == pytest.approx(-2.0)
    assert stats["lld/logp_pos_first_action"] == pytest.approx(-2.0)
    assert stats["lld/logp_pos_later_actions"] == pytest.approx(-2.0)
    assert not any(k.startswith("lld/ref_") for k in stats)


def test_token_mean_weights_tokens_not_responses() -> None:
    # Two A>0 responses of 3 tokens and 1 token: the token mean differs from the mean of means.
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert diag.token_mean(logp, mask) == pytest.approx(-2.0)  # mean of means would be -3


def test_reference_means_and_empty_sets() -> None:
    ref = LOGP - 1.0
    adv = torch.tensor([-1.0, -1.0, -1.0])  # no A>0 and no A=0 response
    stats = {k: diag.finish(v) for k, v in diag.likelihood_stats(LOGP, MASK, adv, ACTION, ref_logp=ref).items()}
    assert math.isnan(stats["lld/logp_pos"]) and math.isnan(stats["lld/ref_logp_zero"])
    assert stats["lld/ref_logp_neg"] == pytest.approx(stats["lld/logp_neg"] - 1.0)


def test_non_finite_tokens_are_left_out() -> None:
    logp = LOGP.clone()
    logp[1, 2] = float("-inf")
    assert diag.token_mean(logp, MASK & (ADV < 0).unsqueeze(-1)) == pytest.approx(-6.0)


def test_correct_rows_rules() -> None:
    adv = torch.tensor([1.0, 0.0, -1.0, 0.0])
    reward = torch.tensor([1.0, 1.0, 0.0, 0.0])  # row 1: correct in an all-correct group (A=0)
    assert diag.correct_rows(adv, reward, "positive_advantage").tolist() == [0]
    assert diag.correct_rows(adv, reward, "reward").tolist() == [0, 1]
    with pytest.raises(ValueError, match=r"correct-set rule \(LLDMonitor.correct_set\) must be 'positive_advantage' or 'reward', got 'right'"):
        diag.correct_rows(adv, reward, "right")


def test_likelihood_delta_sign() -> None:
    after = LOGP - 0.25 * MASK
    total, count = diag.likelihood_delta(LOGP, after, MASK)
    assert count == 7 and total / count == pytest.approx(-0.25)


# ------------------------------------------------------------------------------ phases


def _run(curve, grad=None, entropy=None, config=None):
    det = diag.PhaseDetector(config or diag.PhaseConfig())
    out = []
    for i, v in enumerate(curve):
        out.append(det.update(v, grad[i] if grad else 1.0, entropy[i] if entropy else 2.0))
    return det, out


def _noise(n, scale, seed=0):
    rng = random.Random(seed)
    return [rng.gauss(0.0, scale) for _ in range(n)]


def test_flat_noisy_curve_raises_no_alarm() -> None:
    curve = [-0.4 + e for e in _noise(200, 0.01)]
    det, out = _run(curve, grad=[1.0 + 0.1 * abs(e) for e in _noise(200, 1, 1)], entropy=[2.0 + e for e in _noise(200, 0.05, 2)])
    assert [u.phase for u in out[:9]] == [0] * 9  # warm-up: window=10
    assert {u.phase for u in out[9:]} == {1}
    assert not any(u.warning for u in out) and det.warnings == []


def test_rising_curve_is_stagnation_not_decay() -> None:
    _, out = _run([-0.8 + 0.005 * i for i in range(60)])
    assert {u.phase for u in out[9:]} == {1}


def test_steady_decay_without_acceleration() -> None:
    curve = [-0.3 - 0.004 * i + e for i, e in enumerate(_noise(120, 0.002))]
    _, out = _run(curve)
    phases = [u.phase for u in out]
    assert phases[-1] == 2 and 3 not in phases
    assert all(p == 2 for p in phases[20:])
    assert not any(u.warning for u in out)


def test_decay_then_acceleration_warns_once() -> None:
    # Stagnation (30 steps), steady decay (40 steps, -0.004/step), then the fall steepens to 10x.
    curve = [-0.3] * 30
    curve += [curve[-1] - 0.004 * (i + 1) for i in range(40)]
    curve += [curve[-1] - 0.04 * (i + 1) for i in range(20)]
    det, out = _run(curve)
    phases = [u.phase for u in out]
    assert phases[10:30] == [1] * 20
    first_decay = phases.index(2)
    first_accel = phases.index(3)
    assert 30 < first_decay < 50 and 70 <= first_accel < 82
    assert all(p == 2 for p in phases[first_decay:first_accel])
    warnings = [i for i, u in enumerate(out) if u.warning]
    assert warnings == [first_accel] and "median slope" in out[first_accel].reason
    assert det.warnings == [first_accel + 1]  # counted in valid updates


def test_grad_norm_jump_during_decay_is_acceleration() -> None:
    curve = [-0.3 - 0.004 * i for i in range(40)]
    grad = [1.0] * 30 + [5.0] * 10
    _, out = _run(curve, grad=grad)
    phases = [u.phase for u in out]
    assert phases[25] == 2 and 3 in phases[30:35]
    assert "grad norm" in next(u.reason for u in out if u.warning)


def test_grad_norm_jump_without_decay_is_no_alarm() -> None:
    _, out = _run([-0.3] * 40, grad=[1.0] * 30 + [50.0] * 10, entropy=[2.0] * 30 + [9.0] * 10)
    assert not any(u.warning for u in out)


def test_nan_signal_leaves_state_unchanged() -> None:
    det, _ = _run([-0.3 - 0.004 * i for i in range(20)])
    before = det.state_dict()
    update = det.update(float("nan"), float("nan"), float("nan"))
    assert det.state_dict() == before and update.phase == 2 and not update.warning


def test_state_dict_resumes_exactly() -> None:
    curve = [-0.3] * 20 + [-0.3 - 0.004 * i for i in range(30)] + [-0.42 - 0.05 * i for i in range(15)]
    grad = [1.0 + 0.01 * i for i in range(len(curve))]
    _, full = _run(curve, grad=grad)
    first = diag.PhaseDetector()
    for v, g in zip(curve[:37], grad[:37]):
        first.update(v, g, 2.0)
    resumed = diag.PhaseDetector()
    resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))  # through a serialiser
    rest = [resumed.update(v, g, 2.0) for v, g in zip(curve[37:], grad[37:])]
    assert [(u.phase, u.slope, u.warning) for u in rest] == [(u.phase, u.slope, u.warning) for u in full[37:]]
    assert any(u.warning for u in rest)


def test_bad_thresholds_are_named() -> None:
    with pytest.raises(ValueError, match="accel_factor"):
        diag.PhaseConfig(accel_factor=0.5)
    with pytest.raises(ValueError, match="ema_alpha"):
        diag.PhaseConfig(ema_alpha=0.0)


def test_ols_slope() -> None:
    assert diag.ols_slope([1.0, 3.0, 5.0, 7.0]) == pytest.approx(2.0)
    assert diag.ols_slope([4.0]) == 0.0


# ------------------------------------------------------------------------------ gate, control tokens, tools


def test_gate_open_share_by_hand() -> None:
    # Row 0 (preserving): action 0 at t=1,2 (d = 0.5, -0.2: sum 0.3, opens), an observation at t=3,
    # action 1 at t=4,5 (d = -0.5, 0.1: sum -0.4, stays shut); the response's d sums to -0.1: shut.
    # Row 1 (preserving): one action, d = 0.1, 0.1 plus a NaN token left out: opens, response opens.
    # Row 2 is not in the measured set (A < 0): its big fall counts for nothing.
    before = torch.full((3, 6), -1.0)
    after = torch.tensor([
        [0.0, -1.5, -0.8, 5.0, -0.5, -1.1],
        [0.0, -1.1, -1.1, float("nan"), 0.0, 0.0],
        [0.0, -9.0, -9.0, -9.0, 0.0, 0.0],
    ])
    action = torch.tensor([[-1, 0, 0, -1, 1, 1], [-1, 0, 0, 0, -1, -1], [-1, 0, 0, 0, -1, -1]])
    measured = torch.tensor([[0, 1, 1, 0, 1, 1], [0, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    stats = diag.gate_open_stats(before, after, measured, action)
    assert stats["lld/gate_open_actions"] == (2.0, 3.0)
    assert stats["lld/gate_open_responses"] == (1.0, 2.0)
    assert diag.gate_open_stats(before, after, torch.zeros_like(measured), action)["lld/gate_open_actions"] == (0.0, 0.0)


def test_tag_spans_name_the_tokens_that_spell_each_tag() -> None:
    pieces = ["<", "search", ">", " who", "</", "search", ">", "x<answer>y", " </answer", ">"]
    found = diag.tag_spans(pieces)
    assert found == {"search_open": [(0, 2)], "search_close": [(4, 6)], "answer_open": [(7, 7)], "answer_close": [(8, 9)]}
    assert diag.tag_spans(["<search><search>"])["search_open"] == [(0, 0), (0, 0)]
    assert diag.tag_spans(["</search>"])["search_open"] == []


def test_control_token_probabilities_with_the_real_tokenizer(tiny_policy) -> None:
    """Real SmolLM2 tokens (it splits "<search>" into "<", "search", ">"); the tokens that spell each tag
    found independently, by decoding growing prefixes."""
    from lldslight.rollout import eos_ids

    _, tok = tiny_policy
    eos = eos_ids(tok)
    act0 = tok("<think>go</think>\n<search> Paris mayor </search>", add_special_tokens=False)["input_ids"]
    obs = tok("\n\n<information>Doc 1 <search>not the model's</search></information>\n\n", add_special_tokens=False)["input_ids"]
    act1 = tok("<answer> Anne </answer>", add_special_tokens=False)["input_ids"] + [eos[0]]
    prompt = [1, 2]
    ids = prompt + act0 + obs + act1
    T = len(ids)
    mask = torch.zeros(1, T, dtype=torch.bool)
    action = torch.full((1, T), -1)
    a0, a1 = len(prompt), len(prompt) + len(act0) + len(obs)
    mask[0, a0 : a0 + len(act0)] = mask[0, a1:] = True
    action[0, a0 : a0 + len(act0)], action[0, a1:] = 0, 1
    probs = torch.linspace(0.05, 0.95, T)  # a different probability at every position
    stats = diag.control_token_stats(
        torch.tensor([ids]), mask, action, probs.log().unsqueeze(0),
        lambda xs: tok.batch_decode([[x] for x in xs], skip_special_tokens=False), eos,
    )

    def spelled(offset: int, action_ids: list[int], tag: str) -> float:
        start = tok.decode(action_ids).index(tag)
        first = next(i for i in range(len(action_ids)) if len(tok.decode(action_ids[: i + 1])) > start)
        last = next(i for i in range(len(action_ids)) if len(tok.decode(action_ids[: i + 1])) >= start + len(tag))
        assert last > first  # the tag takes several tokens: the product is not one token's probability
        return math.prod(float(probs[offset + i]) for i in range(first, last + 1))

    expected = {
        "diag/p_search_open": spelled(a0, act0, "<search>"),
        "diag/p_search_close": spelled(a0, act0, "</search>"),
        "diag/p_answer_open": spelled(a1, act1, "<answer>"),
        "diag/p_answer_close": spelled(a1, act1, "</answer>"),
        "diag/p_eos": float(probs[T - 1]),
    }
    for key, value in expected.items():
        total, count = stats[key]
        assert count == 1 and total == pytest.approx(float(value), rel=1e-5), key  # the observation's tags are not counted


def test_tool_call_stats_by_hand() -> None:
    stats = diag.tool_call_stats(torch.tensor([0, 2, 1, 0]), torch.tensor([1, 3, 2, 2]))
    assert stats["diag/tool_call_rate"] == (2.0, 4.0)
    assert stats["diag/searches_per_action"] == (3.0, 8.0)

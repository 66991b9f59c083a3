"""LLD metrics on hand-built trajectories and the phase detector on synthetic likelihood curves."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from lldslight import diagnostics as diag

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
    with pytest.raises(ValueError, match="correct-set rule 'right'"):
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

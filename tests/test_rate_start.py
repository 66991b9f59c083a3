"""AdaptiveRate's start phase (``start_scale`` < 1; lldslight/callbacks/drift.py): a fresh run starts
at a fraction of the ceiling, doubles per batch with signal under the target, and leaves the phase at
the first batch at or above it with the quadratic model's cut sqrt(target / KL), or at the ceiling.

Every expected value is computed a second way: a sequence worked out by hand (the numbers in the
comments), a re-implementation in plain floats over random sequences (start phase, then log_pi), the
phase through the real hooks (a real AdamW and LambdaLR) and through a checkpoint mid-phase.
"""
from __future__ import annotations

import math
import random

import pytest

from lldslight.callbacks.drift import AdaptiveRate
from lldslight.errors import ConfigError
from tests.test_rate_controller import BASE, T, Run, controller, through_a_checkpoint


def started(**kw) -> AdaptiveRate:
    """A controller whose fresh run has begun (what apply_bounds does at the first batch)."""
    run = Run()
    cb = controller(**kw)
    cb.setup(run.trainer, run.module, "fit")
    cb.on_train_batch_start(run.trainer, run.module, None, 0)
    return cb


def test_the_start_phase_by_hand():
    cb = started(start_scale=0.125)
    assert (cb.scale, cb.integral, cb.starting) == (0.125, pytest.approx(math.log(0.125)), True)
    steps = [
        # (KL, signal, scale after, starting after), worked out by hand (T = 1e-3):
        (2e-4, True, 0.25, True),  # under the target: doubled
        (9e-3, False, 0.25, True),  # every group tied: held, whatever its KL
        (0.0, True, 0.25, True),  # a KL of exactly 0 moved nothing: held
        (8e-4, True, 0.5, True),  # still under: doubled
        (4e-3, True, 0.25, False),  # 4x the target: leaves with 0.5 x sqrt(1e-3 / 4e-3) = 0.25
        # now the log_pi rule from z = ln 0.25: e = -1 -> z = ln 0.25 + 0.1, no proportional cut
        (T * math.exp(-1), True, 0.25 * math.exp(0.1), False),
    ]
    for i, (kl, signal, scale, starting) in enumerate(steps):
        cb.observe(kl, signal, BASE)
        assert (cb.scale, cb.starting) == (pytest.approx(scale, rel=1e-12), starting), i
    assert cb.integral == pytest.approx(math.log(0.25) + 0.1, rel=1e-12)
    assert 0.25 * math.exp(0.1) == pytest.approx(0.276293, abs=1e-6)
    assert (cb.informative, cb.held) == (4, 2)


def test_the_start_phase_ends_at_the_ceiling_and_cuts_hard_on_a_large_or_unmeasurable_overshoot():
    cb = started(start_scale=0.125)
    for scale in (0.25, 0.5, 1.0):  # three doublings reach the ceiling (max_scale 1): the phase ends there
        cb.observe(1e-5, True, BASE)
        assert cb.scale == pytest.approx(scale)
    assert not cb.starting and cb.integral == pytest.approx(0.0)
    cb.observe(1e-5, True, BASE)  # log_pi now: at the cap already, stays
    assert cb.scale == pytest.approx(1.0)

    big = started(start_scale=0.5)
    big.observe(T * 400, True, BASE)  # 400x the target: 0.5 x sqrt(1 / 400) = 0.025 in one batch (log_pi: x0.70)
    assert (big.scale, big.starting) == (pytest.approx(0.025), False)

    lost = started(start_scale=0.5)
    lost.observe(float("nan"), True, BASE)  # not measurable: to the floor, lr_min / base = 1e-2
    assert (lost.scale, lost.starting) == (pytest.approx(1e-2), False)


def test_tied_batches_that_drift_past_the_target_cut_by_hand():
    """``signal_free: cut``: the demo run the preset lost (CALIBRATION_real_lm_C.md) reached its ceiling,
    then every group tied and Adam's momentum drifted 4-7x the target on held batches."""
    cb = started(start_scale=0.125, signal_free="cut")
    steps = [
        # (KL, signal, scale after, starting after), worked out by hand (T = 1e-3, gain 0.1, down_gain 0.25):
        (2e-4, True, 0.25, True),  # under the target: doubled
        (3e-3, False, 0.14433756729740646, False),  # tied, 3x the target: ends the phase, 0.25 x sqrt(1/3)
        (5e-4, False, 0.14433756729740646, False),  # tied, under the target: held (a tie never raises)
        (0.0, False, 0.14433756729740646, False),  # tied, nothing moved: held
        (4e-3, False, 0.10171296457345560, False),  # tied, 4x: e = 1, z = ln s - 0.1, scale = s e^-0.35
        (T * math.exp(-1), True, 0.14433756729740646, False),  # with signal, e = -1: z back up by 0.1, no cut
        (float("nan"), False, 0.10171296457345560, False),  # tied and not measurable: e = +1, as the 4x batch
    ]
    for i, (kl, signal, scale, starting) in enumerate(steps):
        cb.observe(kl, signal, BASE)
        assert (cb.scale, cb.starting) == (pytest.approx(scale, rel=1e-12), starting), i
    assert 0.25 / math.sqrt(3) == pytest.approx(0.1443375673, rel=1e-9) and 0.25 / math.sqrt(3) * math.exp(-0.35) == pytest.approx(0.1017129646, rel=1e-9)
    assert (cb.informative, cb.held) == (5, 2)
    held = started(start_scale=0.125)  # the default, hold: the same tied batches move nothing
    for kl, signal, _, _ in steps[1:5]:
        held.observe(kl, signal, BASE)
    assert (held.scale, held.starting, held.held) == (0.125, True, 4)


def test_a_tied_batch_logs_its_error_only_when_it_was_read():
    run = Run()
    cb = controller(start_scale=0.125, signal_free="cut")
    cb.setup(run.trainer, run.module, "fit")
    run.step(cb, 2e-4, 1.0)  # read: doubled
    run.step(cb, 5e-4, 0.0)  # tied, under: held, no error logged
    run.step(cb, 3e-3, 0.0)  # tied, past: read, its error logged
    errors = [d.get("drift/rate_error") for d in run.logged]
    assert errors == [-1.0, None, 1.0], errors  # ln(3e-3 / 1e-3) = 1.10, clipped to error_clip 1
    assert [d["drift/rate_held"] for d in run.logged] == [0.0, 1.0, 1.0]


def reference(seq, start, lo, hi, gain=0.1, down=0.25, clip=1.0, signal_free="hold"):
    """The start phase and then log_pi, a second time from the docstring's formulas, in plain floats."""
    s, starting = start, start < 1
    z = math.log(s)
    out = []
    for kl, signal in seq:
        measurable = kl == kl and kl != math.inf
        if (signal and kl != 0) or (signal_free == "cut" and not signal and (not measurable or kl > T)):
            if starting:
                if kl == kl and kl != math.inf and kl < T:
                    ls = min(math.log(s) + math.log(2), hi)
                    starting = ls < hi
                else:
                    ls = math.log(s) + (0.5 * math.log(T / kl) if kl == kl and kl != math.inf else -math.inf)
                    starting = False
                ls = max(lo, min(hi, ls))
                z, s = ls, math.exp(ls)
            else:
                e = clip if (kl != kl or kl == math.inf) else max(-clip, min(clip, math.log(kl / T)))
                z = max(lo, min(hi, z - gain * e))
                s = math.exp(max(lo, min(hi, z - down * max(e, 0.0))))
        out.append((s, z, starting))
    return out


@pytest.mark.parametrize("signal_free", ["hold", "cut"])
@pytest.mark.parametrize("start", [0.125, 0.5, 1 / 64])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_start_phase_matches_an_independent_implementation(start, seed, signal_free):
    rnd = random.Random(seed)
    seq = [(T * 0.1, True)]  # one doubling first, so that every case passes through the phase
    for _ in range(150):
        kl = T * math.exp(rnd.gauss(-1.5, 2.0))
        kl = rnd.choice([kl, float("nan"), 0.0, float("inf")]) if rnd.random() < 0.05 else kl
        seq.append((kl, rnd.random() > 0.25))
    cb = started(start_scale=start, signal_free=signal_free)
    want = reference(seq, start, math.log(1e-5 / BASE), 0.0, signal_free=signal_free)
    got = []
    for kl, signal in seq:
        cb.observe(kl, signal, BASE)
        got.append((cb.scale, cb.integral, cb.starting))
    assert want[0][0] == pytest.approx(min(2 * start, 1.0)) and not want[-1][2], "the phase should double, then end: vacuous otherwise"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-15), i


def test_the_start_phase_through_the_hooks_and_a_checkpoint():
    """The first batch trains at start_scale x the schedule's rate; a checkpoint mid-phase resumes the
    phase exactly (the same rates and logs as the run never interrupted)."""
    seq = [(2e-4, 1.0), (3e-4, 0.0), (1e-4, 1.0), (5e-3, 1.0), (T * 0.5, 1.0), (T * 2, 1.0)]
    full, cb = Run(), controller(start_scale=0.125)
    cb.setup(full.trainer, full.module, "fit")
    cb.on_train_batch_start(full.trainer, full.module, None, 0)
    # warm-up step 0 of the Run's LambdaLR: multiplier 1/4; base 1e-3 x 0.125
    assert full.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.125 / 4)
    for kl, signal in seq:
        full.step(cb, kl, signal)
    assert [row["drift/rate_starting"] for row in full.logged] == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert [row["drift/lr_scale"] for row in full.logged][:4] == pytest.approx([0.25, 0.25, 0.5, 0.5 * math.sqrt(0.2)])

    part, b = Run(), controller(start_scale=0.125)
    b.setup(part.trainer, part.module, "fit")
    for kl, signal in seq[:2]:
        part.step(b, kl, signal)
    assert b.starting
    resumed, c = Run(), controller(start_scale=0.125)
    resumed.restore(c, part.checkpoint(b))
    for kl, signal in seq[2:]:
        resumed.step(c, kl, signal)
    assert c.state_dict() == cb.state_dict()
    assert resumed.logged == full.logged[2:]
    assert resumed.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]


def test_an_old_checkpoint_has_no_start_phase_and_bad_start_scales_are_refused():
    old = controller(start_scale=0.125)
    state = started().state_dict()
    state.pop("starting")
    old.load_state_dict(through_a_checkpoint(state))
    assert old.starting is False
    for bad in (0.0, -0.5, 1.5, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match=r"AdaptiveRate.start_scale must be in \(0, 1\]"):
            controller(start_scale=bad)
    with pytest.raises(ConfigError, match=r"AdaptiveRate.start_scale must be 1 with rule bang_bang"):
        controller(rule="bang_bang", start_scale=0.5)


@pytest.mark.parametrize("ceiling", ["2e-3", "4e-3"])
def test_the_calibration_arms_are_the_shipped_preset_at_their_ceiling(ceiling):
    """lab/configs/arms_real/slowstart_skip_*.yaml write the preset out (the lab runs arms on the real-model
    recipe); they must stay configs/stable.yaml but for the ceiling, read here as plain YAML. The
    previous round's arms (slowstart_cut_*) are the preset without its zero-gradient skip."""
    import yaml

    from tests.conftest import ROOT

    preset = yaml.safe_load((ROOT / "configs" / "stable.yaml").read_text())
    arms = ROOT / "lab" / "configs" / "arms_real"
    arm = yaml.safe_load((arms / f"slowstart_skip_{ceiling}.yaml").read_text())
    assert arm["trainer"] == preset["trainer"] and arm["model"]["update"] == preset["model"]["update"]
    assert arm["model"]["optim"] == {"lr": float(ceiling)}
    assert preset["trainer"]["callbacks+"][0]["init_args"]["signal_free"] == "cut"
    assert preset["model"]["update"]["zero_gradient"] == "skip"
    previous = yaml.safe_load((arms / f"slowstart_cut_{ceiling}.yaml").read_text())
    assert previous["trainer"] == preset["trainer"] and previous["model"]["optim"] == arm["model"]["optim"]
    assert previous["model"]["update"] == {k: v for k, v in preset["model"]["update"].items() if k != "zero_gradient"}

"""AdaptiveRate, the rate controller of the drift bound (lldslight/callbacks/drift.py).

Every expected value is computed here a second way: the ``log_pi`` rule on a sequence worked out by
hand (the numbers in the comments) and against a re-implementation in plain Python floats over a
random sequence; the ``bang_bang`` rule by hand; batches without signal against a state that must
not move; a resume against the run never interrupted, in the state and in a real tiny fit; the
bounds on resume against an optimiser and scheduler restored from a state with a higher rate.
"""
from __future__ import annotations

import io
import math
import random
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch

from lldslight.callbacks.drift import AdaptiveRate
from lldslight.errors import ConfigError
from lldslight.update import UpdateConfig
from tests.test_bad_input import assert_one_line_error, run_cli, tiny_config, unloadable_model, work  # noqa: F401

T = 1e-3  # the target of the hand-worked sequences
BASE = 1e-3  # the configured base rate


def controller(**kw) -> AdaptiveRate:
    return AdaptiveRate(**{"target_kl": T, "lr_min": 1e-5, **kw})


# -- the log_pi rule ---------------------------------------------------------------------------------


def test_log_pi_rule_by_hand():
    # gain 0.1, down_gain 0.25, error_clip 1, cap = the configured rate (max_scale 1): ln scale <= 0.
    cb = controller()
    steps = [
        # (KL, signal, integral z after, scale after), worked out by hand:
        (T * math.e ** 2, True, -0.1, math.exp(-0.35)),  # e = ln(e^2) = 2 -> clip 1; z = -0.1; ln s = -0.1 - 0.25 x 1
        (5e-6, False, -0.1, math.exp(-0.35)),  # every group tied: held, nothing moves
        (T * math.e ** -0.5, True, -0.05, math.exp(-0.05)),  # e = -0.5; z = -0.1 + 0.05; no cut below the target
        (T * math.e ** -3, True, 0.0, 1.0),  # e = -3 -> -1; z = -0.05 + 0.1 = 0.05 -> the cap, 0
        (float("nan"), True, -0.1, math.exp(-0.35)),  # not measurable: counted as too far, e = +1
        (T, True, -0.1, math.exp(-0.1)),  # e = 0: z stays; no cut
        (0.0, True, -0.1, math.exp(-0.1)),  # a KL of exactly 0 moved nothing: held
        (T * math.e ** 0.5, True, -0.15, math.exp(-0.275)),  # e = 0.5; z = -0.15; ln s = -0.15 - 0.125
    ]
    for i, (kl, signal, z, scale) in enumerate(steps):
        got = cb.observe(kl, signal, BASE)
        assert (cb.integral, got) == pytest.approx((z, scale), abs=1e-12), i
    assert (cb.informative, cb.held) == (6, 2)
    assert math.exp(-0.35) == pytest.approx(0.704688, abs=1e-6)  # the numbers above, to 6 places
    assert math.exp(-0.275) == pytest.approx(0.759572, abs=1e-6)
    for _ in range(60):  # 60 batches at e = +1: z falls by 0.1 each until the floor ln(1e-5 / 1e-3)
        cb.observe(1.0, True, BASE)
    assert cb.integral == pytest.approx(math.log(1e-2))
    assert cb.scale == pytest.approx(1e-2)  # lr_min / base


def reference_log_pi(seq, gain, down, clip, lo, hi):
    """The rule a second time, from its formula: per batch with signal and KL != 0,
    e = clip(ln(KL/T)) (+clip when KL is not finite), z <- clamp(z - gain e), ln s = clamp(z - down max(e, 0))."""
    z, s, held, out = 0.0, 1.0, 0, []
    for kl, signal in seq:
        if signal and kl != 0:
            e = clip if kl != kl or kl == float("inf") else max(-clip, min(clip, math.log(kl / T)))
            z = max(lo, min(hi, z - gain * e))
            s = math.exp(max(lo, min(hi, z - down * max(e, 0.0))))
        else:
            held += 1
        out.append((z, s, held))
    return out


@pytest.mark.parametrize("settings", [{}, {"gain": 0.3, "down_gain": 0.0, "error_clip": 2.5, "max_scale": 4.0}])
def test_log_pi_matches_an_independent_implementation(settings):
    rnd = random.Random(7)
    seq = []
    for _ in range(400):
        kl = T * math.exp(rnd.gauss(0.3, 2.0))
        kl = rnd.choice([kl, kl, kl, kl, kl, kl, float("nan"), 0.0, float("inf")]) if rnd.random() < 0.1 else kl
        seq.append((kl, rnd.random() > 0.2))
    cb = controller(**settings)
    gain, down, clip, cap = (settings.get(k, d) for k, d in (("gain", 0.1), ("down_gain", 0.25), ("error_clip", 1.0), ("max_scale", 1.0)))
    want = reference_log_pi(seq, gain, down, clip, math.log(1e-5 / BASE), math.log(cap))
    got = []
    for kl, signal in seq:
        cb.observe(kl, signal, BASE)
        got.append((cb.integral, cb.scale, cb.held))
    assert len({round(s, 9) for _, s, _ in want}) > 20, "the sequence should move the rate: the comparison would be vacuous"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == pytest.approx(w, rel=1e-12, abs=1e-15), i


# -- batches without signal ---------------------------------------------------------------------------


@pytest.mark.parametrize("rule", ["log_pi", "bang_bang"])
def test_a_batch_without_signal_leaves_the_state_unchanged(rule):
    cb = controller(rule=rule)
    for kl in (3 * T, 0.2 * T, 5 * T):
        cb.observe(kl, True, BASE)
    before = cb.state_dict()
    for kl in (1e-9, 0.0, 100 * T):  # tied batches: tiny (momentum), zero, or anything at all
        cb.observe(kl, False, BASE)
    after = cb.state_dict()
    assert after.pop("held") == before.pop("held") + 3
    assert after == before
    # the same batches read as signal move it (the check above could fail)
    react = controller(rule=rule, signal_free="react")
    for kl in (3 * T, 0.2 * T, 5 * T):
        react.observe(kl, True, BASE)
    react.observe(1e-9, False, BASE)
    assert react.scale != before["scale"]


def test_bang_bang_rule_by_hand():
    cb = controller(rule="bang_bang", target_kl=0.01, factor=1.5, lr_max=2e-3)
    scale = 1.0
    # KL 0.03 > 2 x 0.01: down; 0.01: inside [0.005, 0.02], kept; 0.001 < 0.005: up; nan: down
    for kl, want in ((0.03, 1 / 1.5), (0.01, 1 / 1.5), (0.001, 1.0), (0.001, 1.5), (0.001, 2.0), (float("nan"), 2.0 / 1.5)):
        scale = cb.observe(kl, True, BASE)
        assert scale == pytest.approx(want)  # 2.0 is lr_max / base: 1.5 x 1.5 = 2.25 clamped
    for _ in range(40):
        scale = cb.observe(1.0, True, BASE)
    assert scale == pytest.approx(1e-5 / BASE)  # floored at lr_min


def test_old_keys_keep_the_old_rule_and_settings_of_the_other_rule_are_refused():
    with pytest.warns(UserWarning, match="bang_bang rule of earlier versions"):
        old = AdaptiveRate(target_kl=0.00046, factor=1.5, high=2.0, low=0.5, lr_min=1e-5, lr_max=1e-3)
    assert (old.rule, old.lr_max, old.signal_free) == ("bang_bang", 1e-3, "hold")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert AdaptiveRate(target_kl=0.001).rule == "log_pi"
        assert AdaptiveRate(target_kl=0.001).lr_max == math.inf
        assert AdaptiveRate(target_kl=0.001, rule="bang_bang").factor == 1.5
    with pytest.raises(ConfigError, match=r"AdaptiveRate.factor must be left out with rule 'log_pi'"):
        AdaptiveRate(target_kl=0.001, rule="log_pi", factor=1.5)
    with pytest.raises(ConfigError, match=r"AdaptiveRate.gain must be left out with rule 'bang_bang'"):
        AdaptiveRate(target_kl=0.001, rule="bang_bang", gain=0.1)
    with pytest.raises(ConfigError, match=r"AdaptiveRate.rule must be 'log_pi' or 'bang_bang', got 'pid'"):
        AdaptiveRate(target_kl=0.001, rule="pid")
    with pytest.raises(ConfigError, match=r"AdaptiveRate.signal_free must be 'hold', 'react' or 'cut', got 'skip'"):
        AdaptiveRate(target_kl=0.001, signal_free="skip")
    with pytest.raises(ConfigError, match=r"AdaptiveRate.gain must be > 0"):
        AdaptiveRate(target_kl=0.001, gain=0.0)


# -- resume ------------------------------------------------------------------------------------------


def through_a_checkpoint(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("rule", ["log_pi", "bang_bang"])
def test_the_state_restores_exactly(rule):
    rnd = random.Random(3)
    seq = [(T * math.exp(rnd.gauss(0.0, 1.5)), rnd.random() > 0.25) for _ in range(60)]
    full = controller(rule=rule)
    for kl, signal in seq[:30]:
        full.observe(kl, signal, BASE)
    resumed = controller(rule=rule)
    resumed.load_state_dict(through_a_checkpoint(full.state_dict()))
    assert resumed.state_dict() == full.state_dict()
    for kl, signal in seq[30:]:
        assert resumed.observe(kl, signal, BASE) == full.observe(kl, signal, BASE)
        assert resumed.integral == full.integral
    assert resumed.state_dict() == full.state_dict()
    assert full.held > 0 and full.informative > 0


class Run:
    """What the callback's hooks touch of a Lightning run: a real AdamW and LambdaLR (a 4-step warm-up)."""

    def __init__(self, lr: float = BASE, updates: int = 8) -> None:
        self.param = torch.nn.Parameter(torch.zeros(3))
        self.optimizer = torch.optim.AdamW([self.param], lr=lr)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 4))
        self.trainer = SimpleNamespace(lr_scheduler_configs=[SimpleNamespace(scheduler=self.scheduler)], is_global_zero=True,
                                       global_step=0)
        self.module = SimpleNamespace(optimizers=lambda use_pl_optimizer=False: self.optimizer, last_step_metrics={},
                                      update_config=UpdateConfig(updates_per_rollout=updates), log_dict=self.log_dict)
        self.logged: list[dict] = []

    def log_dict(self, values, **kw) -> None:
        self.logged.append(dict(values))

    def step(self, cb: AdaptiveRate, kl: float, signal: float = 1.0) -> None:
        """One training step: the batch-start hook, the update's scheduler step, the batch-end hook."""
        cb.on_train_batch_start(self.trainer, self.module, None, 0)
        self.optimizer.step()
        self.scheduler.step()
        self.module.last_step_metrics = {"drift/kl_k3_last": kl, "drift/signal": signal}
        cb.on_train_batch_end(self.trainer, self.module, None, None, 0)
        self.trainer.global_step += 1

    def checkpoint(self, cb: AdaptiveRate) -> dict:
        return through_a_checkpoint({"cb": cb.state_dict(), "opt": self.optimizer.state_dict(), "sched": self.scheduler.state_dict(),
                                     "step": self.trainer.global_step})

    def restore(self, cb: AdaptiveRate, ckpt: dict) -> None:
        cb.setup(self.trainer, self.module, "fit")
        self.optimizer.load_state_dict(ckpt["opt"])
        self.scheduler.load_state_dict(ckpt["sched"])
        cb.load_state_dict(ckpt["cb"])
        self.trainer.global_step = ckpt["step"]


def test_a_lowered_lr_max_applies_at_once_on_resume_and_says_so(capsys):
    first = Run()
    cb = controller(max_scale=4.0)  # may rise to 4x the configured rate
    for _ in range(20):
        first.step(cb, T * math.exp(-3))  # far under the target: the scale climbs to its cap, 4
    assert cb.scale == pytest.approx(4.0)
    ckpt = first.checkpoint(cb)
    assert ckpt["sched"]["base_lrs"] == [pytest.approx(4e-3)]

    second = Run()
    lowered = controller(max_scale=4.0, lr_max=1e-4)
    second.restore(lowered, ckpt)
    assert second.optimizer.param_groups[0]["lr"] == pytest.approx(4e-3)  # as restored: 40x the new ceiling
    lowered.on_train_batch_start(second.trainer, second.module, None, 0)
    # before the step's update: base 1e-4 (the new ceiling) x the schedule's multiplier (1 after the warm-up)
    assert second.optimizer.param_groups[0]["lr"] == pytest.approx(1e-4)
    assert second.scheduler.base_lrs == [pytest.approx(1e-4)]
    assert lowered.scale == pytest.approx(0.1) and lowered.integral == pytest.approx(math.log(0.1))
    out = capsys.readouterr().out
    (line,) = [l for l in out.splitlines() if "AdaptiveRate" in l]
    assert "lr_max inf -> 0.0001" in line and "base rate 0.004 outside [1e-05, 0.0001]: 0.0001 from this step" in line, line
    # the next decisions stay within the new bounds
    for _ in range(5):
        second.step(lowered, T * math.exp(-3))
        assert second.optimizer.param_groups[0]["lr"] <= 1e-4 * (1 + 1e-12)


def test_a_plain_resume_says_nothing_and_continues_exactly(capsys):
    full, interrupted = Run(), Run()
    a, b = controller(), controller()
    rnd = random.Random(5)
    seq = [(T * math.exp(rnd.gauss(0.5, 1.5)), float(rnd.random() > 0.2)) for _ in range(12)]
    for kl, signal in seq:
        full.step(a, kl, signal)
    for kl, signal in seq[:6]:
        interrupted.step(b, kl, signal)
    resumed, c = Run(), controller()
    resumed.restore(c, interrupted.checkpoint(b))
    for kl, signal in seq[6:]:
        resumed.step(c, kl, signal)
    assert c.state_dict() == a.state_dict()
    assert resumed.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]
    assert resumed.logged == full.logged[6:]
    assert "AdaptiveRate" not in capsys.readouterr().out


def test_a_rate_set_on_resume_becomes_the_base(capsys):
    first = Run()
    cb = controller()
    for _ in range(6):
        first.step(cb, T * math.e)  # above the target: the scale falls
    ckpt = first.checkpoint(cb)
    second, again = Run(), controller()
    second.restore(again, ckpt)
    # what GRPOModule.on_train_start does with --resume_override of model.optim.lr
    from lldslight.update.optim import set_learning_rate
    set_learning_rate(second.optimizer, second.scheduler, 2e-4)
    again.on_train_batch_start(second.trainer, second.module, None, 0)
    assert (again.base, again.scale, again.integral) == ([2e-4], 1.0, 0.0)
    assert second.optimizer.param_groups[0]["lr"] == pytest.approx(2e-4)
    assert "set on resume: the controller restarts from it" in capsys.readouterr().out


def test_a_configured_rate_above_lr_max_is_clamped_before_the_first_update(capsys):
    run = Run(lr=2e-3)
    cb = controller(lr_max=5e-4)
    cb.setup(run.trainer, run.module, "fit")
    cb.on_train_batch_start(run.trainer, run.module, None, 0)
    assert run.scheduler.base_lrs == [pytest.approx(5e-4)]
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(5e-4 / 4)  # warm-up step 0: multiplier 1/4
    assert "base rate 0.002 outside [1e-05, 0.0005]" in capsys.readouterr().out


# -- one update per rollout batch ---------------------------------------------------------------------


def test_one_update_per_rollout_batch_is_refused():
    run = Run(updates=1)
    with pytest.raises(ConfigError, match=r"model.update.updates_per_rollout must be >= 2 with AdaptiveRate, got 1: the drift is "
                                          r"measured before each update's step"):
        controller().setup(run.trainer, run.module, "fit")
    controller().setup(Run(updates=2).trainer, Run(updates=2).module, "fit")  # two updates: fine


def test_one_update_per_rollout_batch_is_one_line_before_the_model_loads(work, unloadable_model, capsys):
    extra = [{"class_path": "lldslight.callbacks.AdaptiveRate", "init_args": {"target_kl": 0.001}}]
    cfg = tiny_config(work / "rate_u1.yaml", model=unloadable_model, callbacks_extra=extra)
    code, err = run_cli(["fit", "--config", str(cfg), "--model.update.updates_per_rollout", "1",
                         "--trainer.logger.init_args.save_dir", str(work / "runs_rate")], work, capsys)
    assert_one_line_error(code, err, "fit", "model.update.updates_per_rollout must be >= 2 with AdaptiveRate, got 1")


# -- a real fit ---------------------------------------------------------------------------------------

ADAPTIVE = """    - class_path: lldslight.callbacks.AdaptiveRate
      init_args: {{target_kl: 1.0e-4, lr_min: 1.0e-5{more}}}
"""


@pytest.mark.slow
def test_adaptive_rate_is_logged_and_resumes_exactly(tmp_path):
    """A tiny fit with AdaptiveRate (log_pi) killed at step 2 and resumed logs the same rates,
    scales, controller state and drift as the run never interrupted; a resume with a lowered
    lr_max trains its first step under the new ceiling and says so."""
    from run_helpers import KILL
    from test_resume import KILL_AT, STEPS, fit, metrics

    args = ("--model.update.updates_per_rollout", "2", "--model.update.micro_batch_size", "1")
    cb = ADAPTIVE.format(more=", max_scale: 4.0")
    full = fit(tmp_path, "full", tmp_path / "full", extra=cb, args=args)
    assert full.returncode == 0, full.stderr[-3000:]
    killed = fit(tmp_path, "killed", tmp_path / "run", extra=cb + KILL.format(step=KILL_AT), args=args)
    assert killed.returncode == -9, killed.stderr[-3000:]
    lowered_dir = tmp_path / "lowered"
    shutil.copytree(tmp_path / "run", lowered_dir)  # the killed run, before the exact resume writes to it
    resumed = fit(tmp_path, "resumed", tmp_path / "run", extra=cb, args=args + ("--ckpt_path", "last"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "AdaptiveRate" not in resumed.stdout  # nothing changed: nothing to say
    want = metrics(tmp_path / "full" / "tiny" / "version_0" / "metrics.csv")
    got = {**metrics(tmp_path / "run" / "tiny" / "version_0" / "metrics.csv"),
           **metrics(tmp_path / "run" / "tiny" / "version_1" / "metrics.csv")}
    assert sorted(got) == sorted(want) == list(range(STEPS))
    scales = [want[s]["drift/lr_scale"] for s in range(STEPS)]
    assert len(set(scales)) > 1, f"the scale never moved: the comparison would be vacuous ({scales})"
    for step in range(STEPS):
        for key in ("train/lr", "drift/lr_scale", "drift/rate_integral", "drift/rate_held", "drift/signal", "drift/kl_k3",
                    "drift/kl_k3_last", "drift/updates"):
            assert want[step][key] == got[step][key], (step, key, want[step][key], got[step][key])

    # The same checkpoint resumed with lr_max lowered under the rate it holds: the first step trains under it.
    ceiling = 1.5e-5
    assert want[KILL_AT]["train/lr"] > 2 * ceiling, "the rate at the resumed step should exceed the new ceiling: vacuous"
    lowered = fit(tmp_path, "lowered", lowered_dir, extra=ADAPTIVE.format(more=f", max_scale: 4.0, lr_max: {ceiling}"),
                  args=args + ("--ckpt_path", "last"))
    assert lowered.returncode == 0, lowered.stderr[-3000:]
    (line,) = [l for l in lowered.stdout.splitlines() if "AdaptiveRate" in l]
    assert f"at step {KILL_AT}: settings changed since the checkpoint: lr_max inf -> {ceiling}" in line, line
    assert "from this step" in line, line
    low = metrics(lowered_dir / "tiny" / "version_1" / "metrics.csv")
    assert all(low[s]["train/lr"] <= ceiling * (1 + 1e-9) for s in range(KILL_AT, STEPS)), low


# -- the archived controller set reproduces ------------------------------------------------------------


@pytest.mark.parametrize("arm", ["c2_5e-4", "c2_1e-3"])
def test_the_c2_arm_file_replays_its_archived_runs(arm):
    """lab/configs/arms/bound.yaml with today's code makes C2's decisions: each archived bound run's
    KLs, fed to the callback the arm file builds, give the scale it logged at every step. With the
    default ``signal_free: hold`` they would not (the check can fail)."""
    import yaml

    from lldslight.science import collapse as C
    from tests.conftest import ROOT

    arm_file = yaml.safe_load((ROOT / "lab/configs/arms/bound.yaml").read_text())
    (spec,) = arm_file["trainer"]["callbacks+"]
    base = float(arm.split("_")[1])
    runs = C.archived_runs(ROOT / "lab/archive/collapse" / arm / "bound")
    assert len(runs) == 5
    for run in runs:
        frame = C.training_rows(C.read_metrics(run))
        kls, logged = C.column(frame, "drift/kl_k3_last"), C.column(frame, "drift/lr_scale")
        tied = [z == 1.0 for z in C.column(frame, "train/zero_var_groups")]
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            cb, held = AdaptiveRate(**spec["init_args"]), AdaptiveRate(**{**spec["init_args"], "signal_free": "hold"})
        replayed = [cb.observe(kl, not t, base) for kl, t in zip(kls, tied)]
        assert replayed == pytest.approx(logged, rel=1e-5), run
        assert [held.observe(kl, not t, base) for kl, t in zip(kls, tied)] != pytest.approx(logged, rel=1e-5)


# -- the preset -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", ["configs/demo.yaml", "lab/configs/constant.yaml"])
def test_the_preset_composes_after_a_recipe(recipe, tmp_path, monkeypatch):
    """configs/stable.yaml through the real CLI after the demo and the lab's recipe: one AdaptiveRate
    with the log_pi rule and the early stop at the same target, the recipe's rate left as the ceiling."""
    import yaml

    from tests.conftest import ROOT
    from tests.test_config_groups import _instantiate

    monkeypatch.chdir(ROOT)
    cli = _instantiate(["--config", recipe, "--config", "configs/stable.yaml", "--model.policy.model", "smollm2-135m-instruct",
                        "--trainer.logger.init_args.save_dir", str(tmp_path)])
    (cb,) = [c for c in cli.trainer.callbacks if isinstance(c, AdaptiveRate)]
    preset = yaml.safe_load((ROOT / "configs/stable.yaml").read_text())
    assert (cb.rule, cb.signal_free, cb.max_scale, cb.lr_max, cb.start_scale) == ("log_pi", "cut", 1.0, math.inf, 0.125)
    assert cb.target_kl == cli.model.update_config.target_kl == preset["model"]["update"]["target_kl"]
    assert cli.model.update_config.updates_per_rollout >= 2
    assert cli.model.optim_config.lr == yaml.safe_load((ROOT / recipe).read_text())["model"]["optim"]["lr"]


# The preset as C3 and the real-model Stage B registered it (configs/stable.yaml before its start
# phase): their arm files must keep exactly these settings, whatever the shipped preset becomes.
REGISTERED_PRESET = {
    "model": {"update": {"target_kl": 0.00081, "target_kl_factor": 10.0}},
    "trainer": {"callbacks+": [{"class_path": "lldslight.callbacks.AdaptiveRate",
                                "init_args": {"target_kl": 0.00081, "rule": "log_pi", "lr_min": 1.0e-6}}]},
}


def test_the_shipped_preset_is_the_registered_one_plus_its_start_phase():
    """configs/stable.yaml is the preset C3 tested plus start_scale 1/8, signal_free cut and
    zero_gradient skip (and nothing else)."""
    import copy

    import yaml

    from tests.conftest import ROOT

    preset = yaml.safe_load((ROOT / "configs/stable.yaml").read_text())
    want = copy.deepcopy(REGISTERED_PRESET)
    want["trainer"]["callbacks+"][0]["init_args"].update(start_scale=0.125, signal_free="cut")
    want["model"]["update"]["zero_gradient"] = "skip"
    assert preset == want


def test_the_c3_arm_is_the_registered_preset():
    """C3 tests configs/stable.yaml as registered (lab/archive/collapse/C3.md): its arm file holds the
    same settings, the registered target, 0.00081 with the early stop at 10x."""
    import yaml

    from tests.conftest import ROOT

    preset = REGISTERED_PRESET
    arm = yaml.safe_load((ROOT / "lab/configs/arms/stable.yaml").read_text())
    assert preset == arm
    assert preset["model"]["update"] == {"target_kl": 0.00081, "target_kl_factor": 10.0}
    (controller,) = preset["trainer"]["callbacks+"]
    assert controller["init_args"]["target_kl"] == 0.00081 and controller["init_args"]["rule"] == "log_pi"


def test_the_real_model_stage_b_arms_are_the_registered_preset_and_c1s_llds():
    """Stage B on the real model (lab/archive/collapse/PREREGISTRATION_real_lm_B.md) tests
    configs/stable.yaml as registered with its ceiling at the set's rate, and C1's LLDS arm at that rate:
    each arm file is the GRPO arm's rate plus exactly the preset's (or C1's LLDS arm's) settings."""
    import yaml

    from tests.conftest import ROOT

    preset = REGISTERED_PRESET
    llds = yaml.safe_load((ROOT / "lab/configs/arms/llds.yaml").read_text())
    for rate in ("1e-3", "2e-3"):
        grpo = yaml.safe_load((ROOT / f"lab/configs/arms_real/grpo_{rate}.yaml").read_text())
        assert grpo["model"]["optim"]["lr"] == float(rate)
        stable = yaml.safe_load((ROOT / f"lab/configs/arms_real/stable_{rate}.yaml").read_text())
        assert stable["model"].pop("optim") == grpo["model"]["optim"]
        assert stable == preset
        with_llds = yaml.safe_load((ROOT / f"lab/configs/arms_real/llds_{rate}.yaml").read_text())
        assert with_llds.pop("model") == grpo["model"] and with_llds == llds

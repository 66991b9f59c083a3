"""AdaptiveRate: set the learning rate once per rollout batch from how far that batch moved the policy.

The lab found the collapse here governed by off-policy drift times the rate: 8 updates per rollout
batch at 7e-4 died where one update (the on-policy twin) or half the rate held (docs/lab/collapse_lab.md).
A fixed rate that is safe must be guessed; this callback measures the drift instead and keeps it
near a target, as rsl_rl's "adaptive" schedule does for PPO from the KL it measures (there between
Gaussian policies; here the token-level estimate the update logs).

Each training step, after the rollout batch's updates, it reads the batch's drift, the k3 estimate of
KL(pi_old || pi_theta) on the last update's mini-batch before its step (``drift/kl_k3_last``,
lldslight/update/train.py ``drift_shares``; reduced over ranks, so every rank decides alike), and sets the
factor ``scale`` on the schedule's base rate ``base`` for the next rollout batch.

**Batches without signal change nothing.** A rollout batch whose groups all tied (every advantage
0), or whose drift was measured before any update with a non-zero gradient was applied, says nothing
about the rate (``drift/signal`` = 0, lldslight/update/train.py ``drift_has_signal``): its KL is only the
optimiser's momentum. Reading it as "room to move" raised the rate after every tied batch in the
lab's registered controller set, and the next batch with signal was stopped early or cut back: a
sawtooth. Such a batch leaves the rate and every state below unchanged and is counted
(``drift/rate_held``). ``signal_free: react`` reads them like any other batch (the behaviour of
earlier versions, kept to reproduce the archived runs).

**But a tied batch can still move the policy too far** (``signal_free: cut``, the preset's): with every
advantage 0 the gradient is 0, yet Adam keeps stepping along its momentum at the current rate. On the
demo the preset's start phase reached a ceiling 4x the demo's rate, every group then tied, and six
held batches in a row drifted 1.4-7x the target until the run was lost
(lab/archive/collapse/CALIBRATION_real_lm_C.md). With ``cut``, a batch without signal whose KL is
above the target (or not finite) is read as a batch with signal would be, so it can only lower the
rate (an error > 0; in the start phase it ends the phase with its cut); at or under the target it is
held as with ``hold``: a tie never raises the rate.

**The rule ``log_pi`` (the default)**: a proportional-integral controller on the log of the rate.
Per rollout batch with signal, with KL the measured drift and T = ``target_kl``::

    e  = clip(ln(KL / T), -c, c)              c = error_clip; a non-finite KL counts as e = +c
    z <- clamp(z - gain * e)                  the integral: the learned log-scale
    ln scale = clamp(z - down_gain * max(e, 0))

with clamp() keeping the base rate x scale within [``lr_min``, ``lr_cap``], lr_cap = min(``lr_max``,
``max_scale`` x the configured base rate); by default ``max_scale`` 1, so the configured rate is a
ceiling the controller never exceeds. Why this form:

- *Log space*: the KL of a batch grows about as the square of the rate, so a log-rate step
  proportional to ln(KL / T) corrects a KL 4x too high and one 4x too low by the same amount.
- *The integral sets the level, in position form*: z is the sum of the (scaled) errors, and the
  rate is exp(z) (minus the proportional term), not a rate that is itself stepped by an integral
  (that is a double integrator, which oscillates on a plant without dynamics, as a rate is). z stops
  moving only where the mean clipped error is 0: where ln KL's clipped mean over batches with signal
  is ln T, about the median batch KL. The calibration (lab/calibrate_target_kl.py) computes the same
  statistic, so a target read off a run is the drift this rule holds.
- *Clipped errors*: one mini-batch's KL varies by a factor ~e^3 between batches at a fixed rate in
  the lab (4 rows a mini-batch); clipping at c = 1 keeps one outlier from moving the rate by more
  than ``gain`` + ``down_gain`` nats, and makes the fixed point robust (near the median, not the
  mean, of a heavy-tailed KL).
- *Faster down than up*: the proportional term acts on errors above the target only. A batch that
  moved the policy e times too far cuts the next batch's rate by e^-(gain + down_gain) (x0.70 with
  the defaults); one that moved it e times too little raises it by e^gain (x1.105). It is a
  transient: the level returns to exp(z) at the next batch with signal under the target.
- *Anti-windup*: z is clamped to the same bounds as the rate, so a warm-up (whose low rates give a
  low KL) cannot store up a rise past the cap.

**A safe start (``start_scale`` < 1; the preset's 1/8)**: a fixed rate that is safe must be guessed,
and the rate a user tries first may be several times too high: on the demo a ceiling 4x its rate lost
2 of 3 runs in the first 2-3 rollout batches, faster than the rule above can cut (x0.70 a batch), and
Adam's first steps (sign-like, before its second moment has settled) move the policy furthest. So a
fresh run starts at ``start_scale`` x the ceiling and climbs as TCP's slow start does: each batch with
signal whose KL is under the target doubles the scale (the KL grows about as the rate squared, so a
doubling overshoots the target by at most ~4x); the first batch with KL >= target ends the start at
once, with the cut the same quadratic model asks for, scale x sqrt(target / KL) (a non-finite KL:
the floor), which brings a batch that overshot 16x back to the target in one step instead of eight;
reaching the ceiling ends it too. From there the ``log_pi`` rule above runs from that scale (its
integral z = ln scale). Batches without signal are held as above. Logged: ``drift/rate_starting``
(1 while starting). ``start_scale`` 1 (the default) has no start phase: the behaviour of earlier versions.

**The rule ``bang_bang``** (rsl_rl's, the one earlier versions had): KL > ``high`` x T:
``scale /= factor``; KL < ``low`` x T: ``scale *= factor``; then the bounds. A non-finite KL lowers it.

**Bounds apply at once.** At the first training batch of a fit (fresh or resumed), before its
update, the base rate x scale is clamped to the configured bounds; on a resume, one line says which
settings differ from the checkpoint's and what the rate became (a lowered ``lr_max`` takes effect for
that very step). A rate that another party changed on resume (``--resume_override`` of
``model.optim.lr``) becomes the new base, and the controller restarts from it (scale 1).

**One update per rollout batch is refused**: the drift is measured before each update's step, so
with ``model.update.updates_per_rollout`` 1 it is 0 (or the sampler/trainer mismatch) by
construction, and every batch would read as room to move. The lab's on-policy runs (one update per
batch) never collapsed; a rate bound is not needed there.

Coherent with the scheduler: the scheduler's ``base_lrs`` become the configured base rates x
``scale``, and the optimiser's current rates the scheduler's multiplier at this step x those, so a
warm-up or decay keeps its shape, scaled. Both live in the scheduler's and optimiser's states, which
Lightning checkpoints; the controller's own state (scale, integral, counts, the settings it ran
with) is this callback's checkpoint state, so a resumed run decides exactly as the uninterrupted one.
Logged: ``drift/lr_scale``, ``drift/target_kl``, ``drift/rate_held``, and with ``log_pi``
``drift/rate_integral`` and, on batches with signal, ``drift/rate_error`` (docs/metrics.md).

Pair it with the update's own early stop (``model.update.target_kl``: no further update of a rollout batch
once a mini-batch's KL passes ``target_kl_factor`` x the target) for the two halves of a drift bound.
"""
from __future__ import annotations

import math
from typing import Any, Literal, Optional, Protocol

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from lldslight.errors import ConfigError, require, require_choice
from lldslight.update.optim import scheduler_of, set_learning_rate

RateRule = Literal["log_pi", "bang_bang"]
SignalFree = Literal["hold", "react", "cut"]

# The defaults of each rule's own settings (None in the signature: "the rule's default").
BANG_BANG = {"factor": 1.5, "high": 2.0, "low": 0.5, "lr_max": 1e-3}
LOG_PI = {"gain": 0.1, "down_gain": 0.25, "error_clip": 1.0, "max_scale": 1.0, "lr_max": math.inf}
SIGNAL = "drift/signal"


class DriftMeasured(Protocol):
    """What AdaptiveRate reads of the module at each step: the last step's metrics, reduced over
    ranks (GRPOModule.last_step_metrics). At setup it also reads ``update_config`` when there is one."""

    last_step_metrics: dict[str, float]


class AdaptiveRate(pl.Callback):
    """Scale the learning rate each rollout batch to keep its measured drift near ``target_kl``.

    Args:
        target_kl: the drift aimed at: KL(pi_old || pi_theta) per model token, in nats, of a
            rollout batch's last update.
        factor: ``bang_bang`` only: the multiplicative step of the scale (rsl_rl: 1.5).
        high: ``bang_bang`` only: the scale falls when the KL exceeds ``high x target_kl`` (rsl_rl: 2).
        low: ``bang_bang`` only: the scale rises when the KL is below ``low x target_kl`` (rsl_rl: 0.5).
        lr_min: the smallest base rate the scale may reach.
        lr_max: the largest base rate the scale may reach (null: 1e-3 under ``bang_bang``, no
            absolute cap under ``log_pi``, whose cap is ``max_scale``).
        metric: the step metric read as the batch's drift.
        rule: ``log_pi`` (the default) or ``bang_bang`` (earlier versions'). Left out, a config that
            sets ``factor``, ``high`` or ``low`` gets ``bang_bang``, as it did before.
        gain: ``log_pi``: the integral gain (the log-rate moves by ``gain`` x the clipped error per
            batch with signal; default 0.1).
        down_gain: ``log_pi``: the proportional gain on errors above the target (default 0.25).
        error_clip: ``log_pi``: the error ln(KL / target) is clipped to +-this (default 1).
        max_scale: ``log_pi``: the cap on the scale (default 1: never above the configured rate).
        signal_free: ``hold`` (default): a rollout batch without signal (``drift/signal`` 0) changes
            nothing; ``cut`` (the preset's): such a batch whose KL is above the target lowers the rate
            as a batch with signal would, one at or under it changes nothing; ``react``: read it like
            any other (earlier versions; to reproduce their runs).
        start_scale: ``log_pi``: a fresh run starts at this fraction of the ceiling and doubles it per
            batch with signal under the target, until the first batch at or above the target (cut
            by sqrt(target / KL)) or the ceiling (default 1: no start phase; the preset's 0.125).
    """

    def __init__(self, target_kl: float, factor: Optional[float] = None, high: Optional[float] = None,
                 low: Optional[float] = None, lr_min: float = 1e-6, lr_max: Optional[float] = None,
                 metric: str = "drift/kl_k3_last", rule: Optional[RateRule] = None, gain: Optional[float] = None,
                 down_gain: Optional[float] = None, error_clip: Optional[float] = None, max_scale: Optional[float] = None,
                 signal_free: SignalFree = "hold", start_scale: float = 1.0) -> None:
        require(math.isfinite(target_kl) and target_kl > 0, "AdaptiveRate.target_kl", "a finite number > 0 (nats per token, e.g. 0.001)", target_kl)
        require_choice(signal_free, "AdaptiveRate.signal_free", SignalFree)
        own = {"factor": factor, "high": high, "low": low, "gain": gain, "down_gain": down_gain, "error_clip": error_clip,
               "max_scale": max_scale}
        given = {k for k, v in own.items() if v is not None}
        if rule is None:
            rule = "bang_bang" if given & {"factor", "high", "low"} else "log_pi"
            if rule == "bang_bang":
                rank_zero_warn("AdaptiveRate: factor/high/low without a rule: the bang_bang rule of earlier versions "
                               "(add `rule: bang_bang` to keep it and silence this, or drop them for the default log_pi)")
        require_choice(rule, "AdaptiveRate.rule", RateRule)
        defaults = BANG_BANG if rule == "bang_bang" else LOG_PI
        for key in sorted(given - set(defaults)):
            require(False, f"AdaptiveRate.{key}", f"left out with rule {rule!r} (it is a setting of the other rule)", own[key])
        resolved = {k: float(own[k]) if own.get(k) is not None else v for k, v in defaults.items() if k != "lr_max"}
        self.rule: RateRule = rule
        self.target_kl, self.metric, self.signal_free = float(target_kl), metric, signal_free
        self.lr_min = float(lr_min)
        self.lr_max = float(lr_max) if lr_max is not None else defaults["lr_max"]
        require(0 < self.lr_min <= self.lr_max and math.isfinite(self.lr_min) and not math.isnan(self.lr_max),
                "AdaptiveRate.lr_min/lr_max", "0 < lr_min <= lr_max, lr_min finite", (lr_min, lr_max))
        if rule == "bang_bang":
            self.factor, self.high, self.low = resolved["factor"], resolved["high"], resolved["low"]
            require(math.isfinite(self.factor) and self.factor > 1, "AdaptiveRate.factor", "> 1 (rsl_rl uses 1.5)", self.factor)
            require(0 < self.low < self.high, "AdaptiveRate.low/high", "0 < low < high (rsl_rl: 0.5 and 2)", (self.low, self.high))
            self.max_scale = math.inf
        else:
            self.gain, self.down_gain, self.error_clip = resolved["gain"], resolved["down_gain"], resolved["error_clip"]
            self.max_scale = resolved["max_scale"]
            require(math.isfinite(self.gain) and self.gain > 0, "AdaptiveRate.gain", "> 0 (default 0.1)", self.gain)
            require(math.isfinite(self.down_gain) and self.down_gain >= 0, "AdaptiveRate.down_gain", ">= 0 (default 0.25)", self.down_gain)
            require(math.isfinite(self.error_clip) and self.error_clip > 0, "AdaptiveRate.error_clip", "> 0 (default 1)", self.error_clip)
            require(self.max_scale > 0, "AdaptiveRate.max_scale", "> 0 (default 1: never above the configured rate)", self.max_scale)
        require(math.isfinite(start_scale) and 0 < start_scale <= 1, "AdaptiveRate.start_scale",
                "in (0, 1]: the fraction of the ceiling a fresh run starts from (1 = no start phase; the preset's 0.125)", start_scale)
        require(rule == "log_pi" or start_scale == 1, "AdaptiveRate.start_scale", "1 with rule bang_bang (the start phase is log_pi's)",
                start_scale)
        self.start_scale = float(start_scale)
        # -- state (checkpointed) ---------------------------------------------------------------------
        self.scale = 1.0
        self.integral = 0.0  # z: log_pi's learned log-scale
        self.base: Optional[list[float]] = None  # the configured base rates (scale 1), from the first step
        self.last_kl: Optional[float] = None
        self.last_error: Optional[float] = None
        self.informative = 0  # rollout batches the rule read (with signal; with ``cut`` also tied ones past the target)
        self.held = 0  # rollout batches without signal that left everything unchanged
        self.starting = False  # in the start phase (set at a fresh run's first batch when start_scale < 1)
        self.saved_settings: Optional[dict[str, Any]] = None  # the settings of the run a checkpoint came from
        self._started = False  # bounds applied at this fit's first batch

    # -- the rules (pure: state in, state out) -------------------------------------------------------

    def settings(self) -> dict[str, Any]:
        """The settings the decisions depend on (saved in checkpoints, compared on resume)."""
        own = ("factor", "high", "low") if self.rule == "bang_bang" else ("gain", "down_gain", "error_clip", "max_scale", "start_scale")
        return {"rule": self.rule, "target_kl": self.target_kl, "lr_min": self.lr_min, "lr_max": self.lr_max,
                "metric": self.metric, "signal_free": self.signal_free, **{k: getattr(self, k) for k in own}}

    def log_bounds(self, base: float) -> tuple[float, float]:
        """[ln(lr_min / base), ln(lr_cap / base)]: the bounds of ln scale for a base rate ``base``."""
        cap = min(self.lr_max, self.max_scale * base)
        return math.log(self.lr_min / base), math.log(max(cap, self.lr_min) / base)

    def next_scale(self, kl: float, scale: float, base: float) -> float:
        """``bang_bang``: the scale for the next rollout batch from this batch's KL (a non-finite KL
        lowers it: a step that cannot be measured is treated as too far)."""
        if not math.isfinite(kl) or kl > self.high * self.target_kl:
            scale /= self.factor
        elif kl < self.low * self.target_kl:
            scale *= self.factor
        return min(max(scale, self.lr_min / base), self.lr_max / base)

    def error(self, kl: float) -> float:
        """``log_pi``'s error: ln(KL / target) clipped to +-``error_clip``; +``error_clip`` for a
        non-finite KL (a step that cannot be measured counts as too far), -``error_clip`` for a KL <= 0."""
        if not math.isfinite(kl):
            return self.error_clip
        if kl <= 0:
            return -self.error_clip
        return min(max(math.log(kl / self.target_kl), -self.error_clip), self.error_clip)

    def observe(self, kl: float, signal: bool, base: float) -> float:
        """Take one rollout batch's drift into the state; returns the scale for the next batch. With
        ``signal_free: hold`` a batch without signal, or whose KL is exactly 0 (nothing moved on its
        tokens: TorchRL's KL-adaptive schedule skips those too), changes nothing and is counted. With
        ``signal_free: cut`` the same, except a batch without signal that drifted past the target (or
        whose KL is not finite): that one is read, and can only lower the rate."""
        quiet = not signal or kl == 0
        past = not math.isfinite(kl) or kl > self.target_kl
        if self.signal_free != "react" and quiet and not (self.signal_free == "cut" and not signal and past):
            self.held += 1
            return self.scale
        self.informative += 1
        self.last_kl = float(kl)
        if self.rule == "bang_bang":
            self.scale = self.next_scale(self.last_kl, self.scale, base)
            self.integral = math.log(self.scale)
            return self.scale
        lo, hi = self.log_bounds(base)
        e = self.error(self.last_kl)
        self.last_error = e
        if self.starting:
            return self._start_step(lo, hi)
        self.integral = min(max(self.integral - self.gain * e, lo), hi)
        self.scale = math.exp(min(max(self.integral - self.down_gain * max(e, 0.0), lo), hi))
        return self.scale

    def _start_step(self, lo: float, hi: float) -> float:
        """One batch with signal of the start phase: double below the target; at or above it, leave
        the phase with the quadratic model's cut sqrt(target / KL); at the ceiling, leave it."""
        kl = self.last_kl
        if math.isfinite(kl) and kl < self.target_kl:
            log_scale = min(math.log(self.scale) + math.log(2.0), hi)
            self.starting = log_scale < hi
        else:
            cut = 0.5 * math.log(self.target_kl / kl) if math.isfinite(kl) else -math.inf
            log_scale = math.log(self.scale) + cut
            self.starting = False
        log_scale = min(max(log_scale, lo), hi)
        self.integral, self.scale = log_scale, math.exp(log_scale)
        return self.scale

    # -- Lightning hooks ---------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        # Before the policy loads: a refused combination costs nothing.
        if stage != "fit":
            return
        self._started = False
        updates = getattr(getattr(pl_module, "update_config", None), "updates_per_rollout", None)
        require(updates is None or updates >= 2, "model.update.updates_per_rollout", ">= 2 with AdaptiveRate", updates,
                "the drift is measured before each update's step, so with one update per rollout batch it is 0 by "
                "construction and says nothing about the rate (one update per batch is on-policy: no rate bound is needed)")
        from lldslight.update.train import DRIFT_PER_UPDATE

        known = sorted({*DRIFT_PER_UPDATE, *(f"{k}_last" for k in DRIFT_PER_UPDATE), SIGNAL, "drift/updates", "drift/stopped"})
        require(not self.metric.startswith("drift/") or self.metric in known, "AdaptiveRate.metric",
                f"a drift metric the update logs ({', '.join(known)})", self.metric)
        lr = getattr(getattr(pl_module, "optim_config", None), "lr", None)
        if isinstance(lr, (int, float)):
            # clamp() keeps the rate in [lr_min, ceiling] with lr_min winning: above the ceiling, the
            # controller could only hold the rate at lr_min, above the rate configured as the highest.
            ceiling = min(self.lr_max, self.max_scale * lr)
            require(self.lr_min <= ceiling, "AdaptiveRate.lr_min", f"<= the rate's ceiling, min(lr_max, max_scale x "
                    f"model.optim.lr) = {ceiling:g}", self.lr_min)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if not self._started:
            self._started = True
            self.apply_bounds(trainer, pl_module)

    def apply_bounds(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At a fit's first batch (after any checkpoint was restored, before the update): adopt the
        run's base rates, clamp the rate to this run's bounds and say what changed since the checkpoint."""
        optimizer = pl_module.optimizers(use_pl_optimizer=False)
        scheduler = scheduler_of(trainer)
        current = list(scheduler.base_lrs) if scheduler is not None else [float(g["lr"]) for g in optimizer.param_groups]
        notes = []
        if self.saved_settings is not None:
            saved_target = self.saved_settings.get("target_kl")
            early_stop = getattr(getattr(pl_module, "update_config", None), "target_kl", None)
            if saved_target is not None and saved_target != self.target_kl and early_stop == saved_target:
                # A resume takes model.* from the checkpoint and callbacks from the config: half a changed bound.
                raise ConfigError(
                    f"AdaptiveRate.target_kl changed since the checkpoint ({saved_target:g} -> {self.target_kl:g}) but "
                    f"model.update.target_kl (the early stop) is still the checkpoint's {early_stop:g}: a resume takes model.* "
                    f"settings from the checkpoint. Change both (--model.update.target_kl {self.target_kl:g} "
                    "--resume_override model.update.target_kl) or neither")
            now = self.settings()
            changed = [f"{k} {self.saved_settings.get(k)!r} -> {v!r}" for k, v in now.items() if self.saved_settings.get(k) != v]
            if changed:
                notes.append("settings changed since the checkpoint: " + ", ".join(changed))
        if self.base is None:
            # A fresh run: its start phase begins here (a resumed one restores scale and phase).
            self.base = current
            if self.start_scale < 1:
                self.scale, self.integral, self.starting = self.start_scale, math.log(self.start_scale), True
        elif not all(math.isclose(c, b * self.scale, rel_tol=1e-9) for c, b in zip(current, self.base)):
            # Someone else set the rate since the checkpoint (a --resume_override of model.optim.lr):
            # that is the run's base rate now; the controller restarts from it.
            notes.append(f"base rate {max(self.base) * self.scale:.4g} -> {max(current):.4g} set on resume: the controller restarts from it")
            self.base, self.scale, self.integral, self.starting = current, 1.0, 0.0, False
        lo, hi = self.log_bounds(max(self.base))
        log_scale = math.log(self.scale)
        if not lo <= log_scale <= hi or not lo <= self.integral <= hi:
            before = max(self.base) * self.scale
            self.scale = math.exp(min(max(log_scale, lo), hi))
            self.integral = min(max(self.integral, lo), hi)
            notes.append(f"base rate {before:.4g} outside [{self.lr_min:.4g}, {math.exp(hi) * max(self.base):.4g}]: "
                         f"{max(self.base) * self.scale:.4g} from this step")
        set_learning_rate(optimizer, scheduler, [b * self.scale for b in self.base])
        if notes and trainer.is_global_zero:
            print(f"[lldslight] AdaptiveRate at step {trainer.global_step}: " + "; ".join(notes), flush=True)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: DriftMeasured, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.base is None:  # a caller that skipped on_train_batch_start (not Lightning)
            self.apply_bounds(trainer, pl_module)
        metrics = pl_module.last_step_metrics
        kl = metrics.get(self.metric)
        require(kl is not None, "AdaptiveRate.metric", "a metric the step logged (GRPOModule's update logs "
                "'drift/kl_k3_last', the default)", self.metric)
        signal = metrics.get(SIGNAL)
        if self.signal_free != "react" and signal is None:
            raise ConfigError(f"AdaptiveRate: the step logged no {SIGNAL!r} (a module from before it?); "
                              "set signal_free: react to read every batch")
        read_before = self.informative
        self.observe(float(kl), bool(signal) if signal is not None else True, max(self.base))
        set_learning_rate(pl_module.optimizers(use_pl_optimizer=False), scheduler_of(trainer), [b * self.scale for b in self.base])
        logged = {"drift/lr_scale": self.scale, "drift/target_kl": self.target_kl, "drift/rate_held": float(self.held)}
        if self.rule == "log_pi":
            logged["drift/rate_integral"] = self.integral
            logged["drift/rate_starting"] = float(self.starting)
            if self.last_error is not None and self.informative > read_before:  # only a batch the rule read
                logged["drift/rate_error"] = self.last_error
        pl_module.log_dict(logged, on_step=True, on_epoch=False, batch_size=1, sync_dist=False)

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "integral": self.integral, "base": self.base, "last_kl": self.last_kl,
                "last_error": self.last_error, "informative": self.informative, "held": self.held, "starting": self.starting,
                "settings": self.settings()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # The rates themselves come back with the optimiser's and scheduler's states; the controller's
        # state so that the next decision continues from it. A checkpoint of an earlier version holds
        # the scale, the base and the last KL only: its integral is ln(scale).
        self.scale = float(state_dict.get("scale", 1.0))
        self.integral = float(state_dict.get("integral", math.log(self.scale)))
        self.base = state_dict.get("base")
        self.last_kl = state_dict.get("last_kl")
        self.last_error = state_dict.get("last_error")
        self.informative = int(state_dict.get("informative", 0))
        self.held = int(state_dict.get("held", 0))
        self.starting = bool(state_dict.get("starting", False))  # earlier versions had no start phase
        self.saved_settings = state_dict.get("settings")
        self._started = False

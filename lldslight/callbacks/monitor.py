"""LLDMonitor: sees the death spiral coming (docs/diagnostics.md).

Reward is a lagging indicator of GRPO collapse; the likelihood of correct responses, entropy and
the gradient norm lead it. After every training step this callback logs, under ``lld/*``:
- lld/logp_pos, lld/logp_neg, lld/logp_zero: per-token mean log-prob under pi_old of the step's
  responses with A > 0, A < 0, A = 0 (lld/ref_logp_* the same under the reference, when the module
  computed it, i.e. kl_coef > 0); lld/n_pos, lld/n_neg: how many responses are in each set;
- lld/logp_first_action, lld/logp_later_actions (all responses) and lld/logp_pos_first_action,
  lld/logp_pos_later_actions (A > 0 only): action-level LLD;
- lld/delta_correct: per-token mean of (log-prob after the step's updates - log-prob before) on
  the step's own correct responses (``correct_set``), measured by one extra no-grad forward over
  those rows only, in micro-batches. Negative = LLD observed directly;
- lld/delta_incorrect: the same on the step's incorrect responses (A < 0; reward <= 0 under
  ``correct_set: reward``), from the same forward widened to those rows: how hard the step pushed
  the wrong answers down, beside how much of that push reached the right ones;
- lld/gate_open_actions, lld/gate_open_responses (``measure_gate``): over the preserving set
  (responses with A >= 0, the set LLDS protects), the share of actions / responses whose summed
  log-likelihood fell during the step (sum of log pi_old - log pi_after > 0): how often the LLDS
  action / response gate opens, measured whether LLDS is on or not (the same extra forward, then
  over the A >= 0 rows);
- diag/p_search_open, diag/p_search_close, diag/p_answer_open, diag/p_answer_close, diag/p_eos: the
  mean probability, under the sampling distribution (temperature applied, before top-k/top-p), of
  each ``<search>``, ``</search>``, ``<answer>``, ``</answer>`` the model wrote (the joint
  probability of the tokens that spell it) and of each EOS it sampled
  (diagnostics.control_token_stats; from the sampler's own log-probs, no forward). Shifts in
  control-token probabilities precede tool-use collapse;
- diag/tool_call_rate (share of responses with >= 1 valid search) and diag/searches_per_action;
- lld/logp_smooth, lld/slope, lld/phase (0 warm-up, 1 stagnation, 2 steady decay, 3 acceleration)
  and lld/warning (1 on the step decay turned into acceleration), from ``PhaseDetector``.
Entropy, pre-clip grad norm, max ratio, zero-variance groups, searches and response length are
logged by GRPOModule as train/*; the monitor reads them from ``module.last_step_metrics`` (the phase
detector uses grad norm and entropy) instead of computing them twice. At the end of fit it draws
``lld.png`` in the run directory (lldslight.science.plots).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Literal, Optional, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn

from lldslight.science import diagnostics as diag
from lldslight.errors import require
from lldslight.run.metric_rules import reduction

WarningAction = Literal["none", "stop", "checkpoint"]


class LLDMonitor(pl.Callback):
    """Logs likelihood-displacement diagnostics each step and raises an early warning.

    Args:
        measure_delta: run the extra no-grad forward that measures lld/delta_correct and
            lld/delta_incorrect.
        measure_gate: measure lld/gate_open_* on the A >= 0 rows (widens that forward to them).
        correct_set: which responses Delta is measured on: "positive_advantage" (A > 0, the ones
            GRPO pushes up; default) or "reward" (reward > 0, all-correct groups included).
        signal: the metric the phase detector smooths (any lld/* or train/* name).
        phases: the detector's smoothing window and thresholds.
        on_warning: what to do when decay turns into acceleration: "none" (log and print),
            "stop" (end training after this step) or "checkpoint" (save
            ``lld-warning-step<N>.ckpt`` in the run directory and go on).
        plot: write ``plot_name`` into the run directory at the end of fit.
        plot_name: file name of that figure.
        print_every_n_steps: print a one-line status (reward, likelihoods, Delta, phase) every N
            steps (0 = never); handy to follow long runs without a progress bar.
    """

    def __init__(
        self,
        measure_delta: bool = True,
        measure_gate: bool = True,
        correct_set: diag.CorrectSet = "positive_advantage",
        signal: str = "lld/logp_pos",
        phases: diag.PhaseConfig = diag.PhaseConfig(),
        on_warning: WarningAction = "none",
        plot: bool = True,
        plot_name: str = "lld.png",
        print_every_n_steps: int = 0,
    ) -> None:
        require(on_warning in get_args(WarningAction), "LLDMonitor.on_warning", f"one of {get_args(WarningAction)}", on_warning)
        require(correct_set in get_args(diag.CorrectSet), "LLDMonitor.correct_set", f"one of {get_args(diag.CorrectSet)}", correct_set)
        self.measure_delta = measure_delta
        self.measure_gate = measure_gate
        self.correct_set = correct_set
        self.signal = signal
        self.phases = phases
        self.on_warning = on_warning
        self.plot = plot
        self.plot_name = plot_name
        self.print_every_n_steps = print_every_n_steps
        self.detector = diag.PhaseDetector(phases)
        self.warning_steps: list[int] = []  # trainer steps at which the early warning fired
        self.checkpoints: list[str] = []
        self.last_metrics: dict[str, float] = {}
        self.last_step: Optional[int] = None  # the training step ``last_metrics`` belong to (CollapseAlarm checks it)

    # -- per step ------------------------------------------------------------------------------------

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        traj = pl_module.last_rollout
        if traj is None or traj.old_logp is None or traj.advantage is None:
            return
        t0 = time.perf_counter()
        stats = diag.likelihood_stats(traj.old_logp, traj.loss_mask, traj.advantage, traj.action_id, traj.ref_logp)
        stats["lld/n_pos"] = (float((traj.advantage > 0).sum()), 1.0)
        stats["lld/n_neg"] = (float((traj.advantage < 0).sum()), 1.0)
        stats["lld/neg_shared_share"] = neg_shared_share(traj)
        stats.update(diag.tool_call_stats(traj.num_searches, traj.num_actions))
        if traj.sample_logp is not None and getattr(pl_module, "tokenizer", None) is not None:
            stats.update(self._control_tokens(pl_module.tokenizer, traj))
        if self.measure_delta or self.measure_gate:
            stats.update(self._after_step(trainer, pl_module, traj))
        metrics = {k: diag.finish(v) for k, v in self._reduce(trainer, stats).items()}

        step_metrics = pl_module.last_step_metrics
        value = metrics.get(self.signal, step_metrics.get(self.signal))
        require(value is not None, "LLDMonitor.signal", "a metric logged every step (an lld/* or train/* key, e.g. 'lld/logp_pos')",
                self.signal)
        update = self.detector.update(
            value, step_metrics.get("train/grad_norm", float("nan")), step_metrics.get("train/entropy", float("nan"))
        )
        step = trainer.global_step - 1  # this step's row in metrics.csv (global_step counts it already)
        metrics.update({
            "lld/logp_smooth": update.smoothed,
            "lld/slope": update.slope,
            "lld/phase": float(update.phase),
            "lld/warning": float(update.warning),
            # this rank's time, not max-reduced like the other time/* keys (docs/metrics.md)
            "time/lld_monitor_s": time.perf_counter() - t0,
        })
        self.last_metrics = metrics
        self.last_step = step
        # Values are already reduced over ranks above: no second reduction.
        pl_module.log_dict(metrics, on_step=True, on_epoch=False, batch_size=len(traj), sync_dist=False)
        if self.print_every_n_steps and (step + 1) % self.print_every_n_steps == 0 and trainer.is_global_zero:
            print(
                f"[lldslight] step {step}: reward {step_metrics.get('train/reward', float('nan')):.3f}  "
                f"logp A>0 {metrics['lld/logp_pos']:.4f}  A<0 {metrics['lld/logp_neg']:.4f}  "
                f"Delta correct {metrics.get('lld/delta_correct', float('nan')):+.4f}  "
                f"entropy {step_metrics.get('train/entropy', float('nan')):.3f}  "
                f"grad {step_metrics.get('train/grad_norm', float('nan')):.3f}  "
                f"phase {diag.PHASE_NAMES[update.phase]}",
                flush=True,
            )
        if update.warning:
            self._warn(trainer, step, update)

    def _after_step(self, trainer, pl_module, traj) -> dict[str, diag.SumCount]:
        """lld/delta_correct, lld/delta_incorrect and lld/gate_open_*: one no-grad forward with the
        updated weights over the rows they need (correct and incorrect rows, the A >= 0 rows for the gate)."""
        correct = set(diag.correct_rows(traj.advantage, traj.reward, self.correct_set).tolist()) if self.measure_delta else set()
        incorrect = set(diag.incorrect_rows(traj.advantage, traj.reward, self.correct_set).tolist()) if self.measure_delta else set()
        preserving = set((traj.advantage >= 0).nonzero()[:, 0].tolist()) if self.measure_gate else set()
        rows = sorted(correct | incorrect | preserving)
        n = len(rows)
        if trainer.world_size > 1:
            # Sharded models need every rank in every forward: all ranks run the same number of
            # rows, padding with row 0 whose result is dropped.
            n_max = int(trainer.strategy.reduce(torch.tensor(float(n), device=pl_module.device), reduce_op="max"))
            rows = rows + [0] * (n_max - n)
        out: dict[str, diag.SumCount] = {}
        if not rows:
            if self.measure_delta:
                out.update({k: (0.0, 0.0) for k in ("lld/delta_correct", "lld/delta_incorrect")})
            if self.measure_gate:
                out.update({k: (0.0, 0.0) for k in ("lld/gate_open_actions", "lld/gate_open_responses")})
            return out
        sub = traj.select(rows)
        after = pl_module.batch_logprobs(sub, reference=False)

        def tokens_of(members: set[int]):
            keep = torch.tensor([i < n and r in members for i, r in enumerate(rows)], device=sub.loss_mask.device)
            return sub.loss_mask & keep.unsqueeze(-1)

        if self.measure_delta:
            out["lld/delta_correct"] = diag.likelihood_delta(sub.old_logp, after, tokens_of(correct))
            out["lld/delta_incorrect"] = diag.likelihood_delta(sub.old_logp, after, tokens_of(incorrect))
        if self.measure_gate:
            out.update(diag.gate_open_stats(sub.old_logp, after, tokens_of(preserving), sub.action_id))
        return out

    def _control_tokens(self, tokenizer, traj) -> dict[str, diag.SumCount]:
        from lldslight.rollout import eos_ids

        def decode_tokens(ids: list[int]) -> list[str]:
            return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)

        return diag.control_token_stats(traj.input_ids, traj.loss_mask, traj.action_id, traj.sample_logp, decode_tokens, eos_ids(tokenizer))

    @staticmethod
    def _reduce(trainer, stats: dict[str, diag.SumCount]) -> dict[str, diag.SumCount]:
        """(sum, count) pairs over ranks: a mean by metric_rules (``lld/*``, ``diag/*``), a true
        ratio, so both parts add up before dividing."""
        not_means = sorted(k for k in stats if reduction(k) != "mean")
        if not_means:  # a (sum, count) pair is a mean; a rule saying otherwise is a bug here or there
            raise RuntimeError(f"LLDMonitor: {', '.join(not_means)} are (sum, count) means, but metric_rules reduces them otherwise")
        if trainer.world_size <= 1:
            return stats
        keys = sorted(stats)
        flat = torch.tensor([x for k in keys for x in stats[k]], dtype=torch.float64, device=trainer.strategy.root_device)
        flat = trainer.strategy.reduce(flat, reduce_op="sum").cpu().tolist()
        return {k: (flat[2 * i], flat[2 * i + 1]) for i, k in enumerate(keys)}

    def _warn(self, trainer, step: int, update: diag.PhaseUpdate) -> None:
        self.warning_steps.append(step)
        if trainer.is_global_zero:
            print(
                f"[lldslight] LLD EARLY WARNING at step {step}: the likelihood of correct responses is "
                f"falling faster ({update.reason}); smoothed log-prob {update.smoothed:.4f}, slope "
                f"{update.slope:.2e}/step. Reward usually collapses next (docs/diagnostics.md). action: {self.on_warning}",
                flush=True,
            )
        if self.on_warning == "stop":
            trainer.should_stop = True
        elif self.on_warning == "checkpoint":
            path = Path(trainer.log_dir or trainer.default_root_dir) / f"lld-warning-step{step}.ckpt"
            trainer.save_checkpoint(path)
            self.checkpoints.append(str(path))

    # -- end of fit ----------------------------------------------------------------------------------

    def on_fit_end(self, trainer, pl_module) -> None:
        # Loggers are finalised (metrics.csv flushed) before on_fit_end.
        if not self.plot or not trainer.is_global_zero or not trainer.log_dir:
            return
        run_dir = Path(trainer.log_dir)
        if not (run_dir / "metrics.csv").exists():
            return  # not a CSVLogger run: `lldslight plot` needs metrics.csv
        from lldslight.science.plots import PlotInputError, plot_runs

        try:
            out = plot_runs([run_dir], run_dir / self.plot_name)
        except (PlotInputError, ValueError, OSError) as err:
            rank_zero_warn(f"LLDMonitor: no plot written: {err}")
            return
        print(f"[lldslight] LLD diagnostics plot: {out}", flush=True)

    # -- exact resume --------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"detector": self.detector.state_dict(), "warning_steps": list(self.warning_steps), "checkpoints": list(self.checkpoints)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.detector.load_state_dict(state_dict["detector"])
        self.warning_steps = list(state_dict.get("warning_steps", []))
        self.checkpoints = list(state_dict.get("checkpoints", []))


def neg_shared_share(traj) -> tuple[float, float]:
    """(tokens, of tokens): the model tokens of A < 0 rows that lie in a prefix they share with an
    A > 0 row of their group (objectives.shared_prefix_negatives: the paper's LLD route, where an
    incorrect response's negative gradient lands on a correct one's identical first actions), out
    of all model tokens of A < 0 rows; a mean over ranks as the other lld/* keys."""
    from lldslight.update.objectives import shared_prefix_negatives

    shared = shared_prefix_negatives(traj.input_ids, traj.attention_mask, traj.loss_mask, traj.group_id, traj.advantage)
    negative = traj.loss_mask & (traj.advantage < 0)[:, None]
    return float(shared.sum()), float(negative.sum())


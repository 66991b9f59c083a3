"""RunSummary: what a run did, in one block at the end and in summary.json beside the metrics."""
from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import lightning.pytorch as pl

from lldslight.rollout import evaluation


def peak_rss_mb() -> float:
    """Peak resident memory of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


# A launcher that runs several commands before fit (scripts/demo.sh: data, warm start, then fit) sets
# this to the Unix time its own work began (after set-up), so the summary can say what the whole
# command took; fit's own wall time leaves the earlier commands out.
STARTED_ENV = "LLDSLIGHT_STARTED_AT"


def command_time_s(now: Optional[float] = None) -> Optional[float]:
    """Seconds since ``$LLDSLIGHT_STARTED_AT`` (Unix time), or None where it is unset or not a time."""
    raw = os.environ.get(STARTED_ENV)
    try:
        started = float(raw) if raw else None
    except ValueError:
        return None
    return None if started is None else (time.time() if now is None else now) - started


def machine_line(machine: dict) -> str:
    """The CPU a run's times hold on (summary.json's ``machine``): model, the SIMD flags that decide
    kernels, torch's threads."""
    flags = [f for f in machine.get("cpu_flags_simd", []) if f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")]
    return f"{machine.get('cpu_model') or 'unknown CPU'} ({', '.join(flags) or 'no AVX2'}), {machine['threads']} thread(s)"


class RunSummary(pl.Callback):
    """Prints dev EM before/after, searches per question, step-time split, peak RSS, wall time and
    the machine; with ``$LLDSLIGHT_STARTED_AT`` set (scripts/demo.sh does), the whole command's time.

    Args:
        path: where to write the JSON (default: the logger's directory / summary.json).
    """

    def __init__(self, path: Optional[str] = None) -> None:
        self.path = path
        self._start = 0.0
        self._steps: list[dict[str, float]] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = dict(getattr(pl_module, "last_step_metrics", {}))
        traj = getattr(pl_module, "last_rollout", None)
        if traj is not None:  # for the collapse's failure mode: did the agent still search?
            step["tool_call_rate"] = float((traj.num_searches > 0).float().mean())
        self._steps.append(step)

    def _collapse(self) -> dict:
        from dataclasses import asdict

        from lldslight.science.collapse import find_collapse

        nan = float("nan")
        reward = [s.get("train/reward", nan) for s in self._steps]
        answered = [s.get("train/answered_rate", nan) for s in self._steps]
        tool = [s.get("tool_call_rate", nan) for s in self._steps]
        return asdict(find_collapse(reward, answered, tool_call=tool))

    def on_fit_end(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        history = getattr(pl_module, "eval_history", {})

        def median(key: str) -> float:
            values = [s[key] for s in self._steps if key in s]
            return statistics.median(values) if values else float("nan")

        import torch

        from lldslight.policy.precision import cpu_description

        summary = {
            "wall_time_s": time.perf_counter() - self._start,
            "command_time_s": command_time_s(),
            "machine": {**cpu_description(), "threads": torch.get_num_threads()},
            "steps": len(self._steps),
            "median_step_s": {k: median(f"time/{k}") for k in ("rollout_s", "retrieval_s", "logprob_s", "update_s")},
            "peak_rss_mb": peak_rss_mb(),
            "dev_before": history.get("before", {}).get("overall"),
            "dev_after": history.get("after", {}).get("overall"),
            "dev_after_per_source": history.get("after", {}).get("per_source"),
            # EM after minus before, paired by question, with its standard error (evaluation.paired_change).
            "dev_em_change": (evaluation.paired_change(history["before"]["records"], history["after"]["records"])
                              if "records" in history.get("before", {}) and "records" in history.get("after", {}) else None),
            # The collapse verdict of lldslight/science/collapse.py (reward / answered rate only, no detector).
            "collapse": self._collapse(),
            "train_reward_first_last": [
                self._steps[0].get("train/reward") if self._steps else None,
                self._steps[-1].get("train/reward") if self._steps else None,
            ],
        }
        out = Path(self.path) if self.path else Path(trainer.log_dir or ".") / "summary.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(summary, indent=2))
        lines = ["", "=" * 72, "lldslight run summary", "=" * 72]
        for when in ("before", "after"):
            o = summary[f"dev_{when}"]
            if o:
                lines.append(f"dev EM {when:6s} training: {o['em']:.3f}   F1 {o['f1']:.3f}   searches/question {o['searches']:.2f}   answered {o['answered']:.2f}   (n={o['n']})")
        change = summary["dev_em_change"]
        if change and change["n"]:
            lines.append(f"dev EM change: {change['change']:+.3f}, paired standard error {change['se']:.3f} "
                         f"({change['z']:+.1f} SE; n={change['n']} questions seen both times)")
        t = summary["median_step_s"]
        lines.append(
            f"steps: {summary['steps']}   median step: rollout {t['rollout_s']:.1f}s (retrieval {t['retrieval_s']:.2f}s)"
            f" + log-probs {t['logprob_s']:.1f}s + updates {t['update_s']:.1f}s"
        )
        c = summary["collapse"]
        lines.append(f"collapse (docs/lab/collapse_lab.md criteria): " + (f"yes, at step {c['step']} ({c['cause']}, {c['mode']})" if c["collapsed"] else "no"))
        lines.append(f"peak RSS: {summary['peak_rss_mb']:.0f} MiB   wall time: {summary['wall_time_s']:.0f}s")
        if summary["command_time_s"] is not None:
            minutes, seconds = divmod(round(summary["command_time_s"]), 60)
            lines.append(f"the whole command after set-up: {minutes} min {seconds} s")
        lines.append(f"machine: {machine_line(summary['machine'])}")
        lines.append(f"metrics and summary.json: {out.parent}")
        ckpt = trainer.checkpoint_callback
        if ckpt is not None and getattr(ckpt, "last_model_path", ""):
            lines.append(f"checkpoint: {ckpt.last_model_path or ckpt.best_model_path}")
        lines.append("=" * 72)
        print("\n".join(lines), flush=True)

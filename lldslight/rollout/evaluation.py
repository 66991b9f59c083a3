"""Evaluation records and their summary: EM, F1, searches, invalid actions, answered rate, per
data_source and averaged (the paper averages its seven benchmarks with equal weight).

One path for every evaluation (Lightning's validate/test loops in GRPOModule, and SearchRollout's
before/after-fit evaluation): ``trajectory_records`` per batch, then :func:`finish` (gather over
ranks, summary, report files) and :func:`flat_metrics` (what is logged).
"""
from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import torch

from lldslight.trajectory import Trajectory

METRICS = ("em", "f1", "searches", "invalid_rate", "answered")


def trajectory_records(traj: Trajectory) -> list[dict[str, Any]]:
    """One plain record per rollout (cheap to gather across ranks, easy to write as JSON)."""
    records = []
    for i in range(len(traj)):
        actions = max(int(traj.num_actions[i]), 1)
        records.append(
            {
                "data_source": traj.data_source[i],
                "question": traj.questions[i] if traj.questions else "",
                "golden_answers": traj.golden_answers[i] if traj.golden_answers else [],
                "response": traj.responses[i],
                "answer": traj.answers[i] if traj.answers else None,  # from the model's last action: what em/f1 scored
                "group_id": int(traj.group_id[i]),
                "em": float(traj.em[i]) if traj.em is not None else 0.0,
                "f1": float(traj.f1[i]) if traj.f1 is not None else 0.0,
                "reward": float(traj.reward[i]),
                "searches": int(traj.num_searches[i]),
                "invalid_rate": int(traj.num_invalid[i]) / actions,
                "answered": float(traj.finish_reason[i] == "answer"),
            }
        )
    return records


def gather_records(records: list[dict]) -> list[dict]:
    """All ranks' records, in rank order, without the filler rows that evened out the ranks'
    batch counts (lldslight.data.datamodule.EVAL_PADDING)."""
    from lldslight.data.datamodule import EVAL_PADDING

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        gathered: list[list[dict]] = [None] * torch.distributed.get_world_size()  # type: ignore[list-item]
        torch.distributed.all_gather_object(gathered, records)
        records = [r for part in gathered for r in part]
    return [r for r in records if r["data_source"] != EVAL_PADDING]


def summarise(records: list[dict]) -> dict[str, Any]:
    """Per-source means, the mean over all examples ("overall") and the unweighted mean over
    sources ("macro", how the paper averages benchmarks)."""
    per_source: dict[str, dict[str, float]] = {}
    for source in sorted({r["data_source"] for r in records}):
        rows = [r for r in records if r["data_source"] == source]
        per_source[source] = {m: sum(r[m] for r in rows) / len(rows) for m in METRICS}
        per_source[source]["n"] = len(rows)
    overall = {m: (sum(r[m] for r in records) / len(records) if records else 0.0) for m in METRICS}
    overall["n"] = len(records)
    macro = {m: (sum(v[m] for v in per_source.values()) / len(per_source) if per_source else 0.0) for m in METRICS}
    return {"overall": overall, "macro": macro, "per_source": per_source}


def paired_change(before: list[dict], after: list[dict], metric: str = "em") -> dict[str, float]:
    """``metric`` after minus before on the questions both evaluations saw, paired by question
    (data_source, question, golden answers; a repeated question pairs occurrence by occurrence), with
    the paired standard error sd(d) / sqrt(n) (sample sd, n - 1). Pairing removes the spread between
    questions, which on a small dev set is most of an unpaired error. Returns {"n", "before", "after",
    "change", "se", "z"} (se and z are nan for n < 2; z is change / se, inf when se is 0 and change is not)."""
    def keyed(records: list[dict]) -> dict[tuple, float]:
        seen: dict[tuple, int] = {}
        out: dict[tuple, float] = {}
        for r in records:
            key = (r["data_source"], r["question"], tuple(r["golden_answers"]))
            seen[key] = seen.get(key, 0) + 1
            out[key + (seen[key],)] = float(r[metric])
        return out

    b, a = keyed(before), keyed(after)
    common = [k for k in b if k in a]
    n = len(common)
    nan = float("nan")
    if n == 0:
        return {"n": 0, "before": nan, "after": nan, "change": nan, "se": nan, "z": nan}
    d = [a[k] - b[k] for k in common]
    mean = statistics.fmean(d)
    se = statistics.stdev(d) / math.sqrt(n) if n > 1 else nan
    if math.isnan(se) or (se == 0 and mean == 0):
        z = nan
    else:
        z = mean / se if se > 0 else math.copysign(math.inf, mean)
    return {"n": n, "before": sum(b[k] for k in common) / n, "after": sum(a[k] for k in common) / n, "change": mean, "se": se, "z": z}


def markdown_table(summary: dict[str, Any]) -> str:
    head = "| data_source | n | EM | F1 | searches/q | invalid-action rate | answered |\n|---|---|---|---|---|---|---|\n"
    lines = []
    for name, v in list(summary["per_source"].items()) + [("**all (examples)**", summary["overall"]), ("**mean of sources**", summary["macro"])]:
        n = v.get("n", "")
        lines.append(
            f"| {name} | {n} | {v['em']:.3f} | {v['f1']:.3f} | {v['searches']:.2f} | {v['invalid_rate']:.3f} | {v['answered']:.3f} |"
        )
    return head + "\n".join(lines) + "\n"


def write_report(summary: dict[str, Any], records: list[dict], out_dir: str | Path, stem: str) -> tuple[Path, Path]:
    """``stem``.json (summary and every record) and ``stem``.md (the table) under ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps({"summary": summary, "records": records}, indent=1))
    md_path.write_text(markdown_table(summary))
    return json_path, md_path


def finish(records: list[dict], stage: str, trainer: Any, write: bool = True, step: int | None = None) -> dict[str, Any]:
    """The end of an evaluation: every rank's records gathered (a collective: call it on every rank),
    summarised, and with ``write`` reported by rank 0 as ``{stage}_step{N}.json`` / ``.md`` in the
    logger's directory; N is ``step`` (default: the trainer's global step). Returns {"stage", "step",
    "summary", "records"} (records: every rank's) and "report" (the markdown path)."""
    records = gather_records(records)
    step = trainer.global_step if step is None else step
    result: dict[str, Any] = {"stage": stage, "step": step, "summary": summarise(records), "records": records}
    if write and trainer.is_global_zero and trainer.log_dir:
        _, md_path = write_report(result["summary"], records, trainer.log_dir, f"{stage}_step{step}")
        result["report"] = str(md_path)
    return result


def flat_metrics(summary: dict[str, Any], stage: str) -> dict[str, float]:
    """``stage/<metric>`` over all examples and ``stage/em/<data_source>`` per source."""
    flat = {f"{stage}/{k}": float(v) for k, v in summary["overall"].items()}
    for source, values in summary["per_source"].items():
        flat[f"{stage}/em/{source}"] = values["em"]
    return flat

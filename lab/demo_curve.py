"""How a longer run of the demo learns: dev EM at every evaluation against the one before training
(paired by question, with its standard error), and the training rollouts' EM, answered rate and
entropy in blocks of steps.

The run (about 48 min on one thread of this project's 2-core CPU, shared with two lab runs):

    lldslight fit --config configs/demo.yaml --model.policy.model .lldslight/demo_warmstart \\
        --model.optim.lr 5e-4 --trainer.max_steps 60 --trainer.val_check_interval 10 \\
        --trainer.check_val_every_n_epoch null --trainer.num_sanity_val_steps 0 \\
        --trainer.logger.init_args.name demo_curve_lr5e-4

Then (a run directory, or its archive under lab/archive/demo/, whose files may be gzipped):

    python lab/demo_curve.py lab/archive/demo/curve_lr5e-4 --json lab/archive/demo/curve_lr5e-4/curve.json
    python lab/demo_curve.py runs/demo_curve_lr5e-4/version_0 --archive lab/archive/demo/curve_lr5e-4
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import re
import shutil
import statistics
from pathlib import Path

from lldslight.errors import script_main
from lldslight.run.writes import check_out_file
from lldslight.errors import require
from lldslight.rollout.evaluation import paired_change


def read_text(path: Path) -> str:
    """A file's text, or its .gz twin's."""
    if path.is_file():
        return path.read_text()
    gz = path.with_name(path.name + ".gz")
    require(gz.is_file(), str(path), "a file written by the run (or its .gz)", "missing")
    return gzip.decompress(gz.read_bytes()).decode()


def evaluations(run: Path) -> list[tuple[int, list[dict]]]:
    """(step, records) of every periodic dev evaluation, in step order; the one before training first."""
    names = {p.name.removesuffix(".gz") for p in run.glob("val_*.json*")}
    out = []
    for name in names:
        m = re.fullmatch(r"val_(?:before_)?step(\d+)\.json", name)
        if m:  # val_after_stepN repeats the last periodic evaluation's weights
            out.append((int(m.group(1)), json.loads(read_text(run / name))["records"]))
    require(any(s == 0 for s, _ in out), f"{run}/val_before_step0.json", "the evaluation before training", "missing")
    return sorted(out, key=lambda e: e[0])


def training_blocks(run: Path, block: int) -> list[dict]:
    rows = [r for r in csv.DictReader(io.StringIO(read_text(run / "metrics.csv"))) if r.get("train/em")]
    out = []
    for start in range(0, len(rows), block):
        seg = rows[start : start + block]
        out.append({"steps": f"{start}-{start + len(seg) - 1}",
                    **{key: statistics.fmean(float(r[col]) for r in seg)
                       for key, col in (("em", "train/em"), ("answered", "train/answered_rate"), ("entropy", "train/entropy"))}})
    return out


def first_vs_last(run: Path, steps: int) -> dict:
    """Sampled training EM: the mean of the last ``steps`` steps minus the first ``steps``, with
    the standard error of that difference over per-step means (each step's 8 rollouts are one
    unit: a group's rollouts are not independent)."""
    em = [float(r["train/em"]) for r in csv.DictReader(io.StringIO(read_text(run / "metrics.csv"))) if r.get("train/em")]
    require(len(em) >= 2 * steps, str(run / "metrics.csv"), f">= {2 * steps} training steps", len(em))
    a, b = em[:steps], em[-steps:]
    se = (statistics.variance(a) / steps + statistics.variance(b) / steps) ** 0.5
    diff = statistics.fmean(b) - statistics.fmean(a)
    return {"steps": steps, "first": statistics.fmean(a), "last": statistics.fmean(b), "change": diff, "se": se, "z": diff / se}


def by_question_type(before: list[dict], after: list[dict]) -> list[dict]:
    """Per ``data_source`` (1-hop, 2-hop, comparison, ...): the paired EM change and the searches
    per question before and after. Where EM moves and where it cannot: a policy that never makes a
    second search cannot answer a 2-hop question however sharp it gets."""
    out = []
    for source in sorted({r["data_source"] for r in before}):
        b = [r for r in before if r["data_source"] == source]
        a = [r for r in after if r["data_source"] == source]
        out.append({"data_source": source, **paired_change(b, a),
                    "searches_before": statistics.fmean(r["searches"] for r in b),
                    "searches_after": statistics.fmean(r["searches"] for r in a) if a else float("nan")})
    return out


def curve(run: Path, block: int = 10, compare: int = 20) -> dict:
    evals = evaluations(run)
    before = evals[0][1]
    dev = []
    for step, records in evals[1:]:
        c = paired_change(before, records)
        dev.append({"step": step, **c, "answered": statistics.fmean(r["answered"] for r in records)})
    last_step, last = evals[-1]
    return {"run": str(run), "dev": dev, "dev_by_type": {"step": last_step, "types": by_question_type(before, last)},
            "train": training_blocks(run, block), "train_first_vs_last": first_vs_last(run, compare)}


def archive(run: Path, out: Path) -> None:
    """The evidence of a run, compressed: metrics, evaluations, config and summary."""
    out.mkdir(parents=True, exist_ok=True)
    for f in [run / "metrics.csv", *sorted(run.glob("val_*.json"))]:
        (out / (f.name + ".gz")).write_bytes(gzip.compress(f.read_bytes(), mtime=0))
    for name in ("config.yaml", "summary.json"):
        if (run / name).is_file():
            shutil.copy(run / name, out / name)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a demo run directory (runs/NAME/version_N) or its archive")
    p.add_argument("--block", type=int, default=10, help="training steps per row of the training table")
    p.add_argument("--compare", type=int, default=20, help="training steps at each end for the first-vs-last comparison")
    p.add_argument("--archive", default=None, help="also copy the run's evidence here, gzipped")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.json is not None:  # refused now, not after the work
        check_out_file(args.json, "--json")
    run = Path(args.run)
    if args.archive:
        archive(run, Path(args.archive))
    c = curve(run, args.block, args.compare)
    print("| dev evaluation after step | EM before -> after (n) | paired change (SE) | z | answered |\n|---|---|---|---|---|")
    for d in c["dev"]:
        print(f"| {d['step']} | {d['before']:.3f} -> {d['after']:.3f} ({d['n']}) | {d['change']:+.3f} ({d['se']:.3f}) | {d['z']:.2f} | {d['answered']:.2f} |")
    t = c["dev_by_type"]
    print(f"\n| question type | EM before -> after step {t['step']} (n) | paired change (SE) | searches / question |\n|---|---|---|---|")
    for d in t["types"]:
        print(f"| {d['data_source']} | {d['before']:.3f} -> {d['after']:.3f} ({d['n']}) | {d['change']:+.3f} ({d['se']:.3f}) | "
              f"{d['searches_before']:.2f} -> {d['searches_after']:.2f} |")
    print("\n| training steps | sampled EM | answered | entropy (nats/token) |\n|---|---|---|---|")
    for t in c["train"]:
        print(f"| {t['steps']} | {t['em']:.3f} | {t['answered']:.2f} | {t['entropy']:.3f} |")
    f = c["train_first_vs_last"]
    print(f"\nsampled training EM, last {f['steps']} steps vs first {f['steps']}: {f['first']:.3f} -> {f['last']:.3f}, "
          f"{f['change']:+.3f} (SE {f['se']:.3f} over per-step means, z {f['z']:.2f})")
    if args.json:
        Path(args.json).write_text(json.dumps(c, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))

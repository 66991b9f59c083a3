"""Join a lab run's metrics from its first log directory and the one its resume wrote into.

    python lab/join_metrics.py FIRST/metrics.csv RESUMED/metrics.csv OUT/metrics.csv.gz --from-step 80

A run continued by exact resume (``--ckpt_path .../last.ckpt``) into a new log directory logs its
later steps there; the lab's archive holds one file a run. Rows of FIRST with a step below
``--from-step`` and rows of RESUMED from that step on (rows without a step, an evaluation's, from
both) are written, gzip-compressed with mtime 0 as lab/collapse.py archives a run; the columns are
the union, FIRST's order first. Refuses a join that would leave a step twice or a gap.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import sys
from pathlib import Path


def rows_of(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return list(reader.fieldnames or []), list(reader)


def step_of(row: dict):
    value = row.get("step", "")
    return int(float(value)) if value not in ("", None) else None


def join(first: Path, resumed: Path, from_step: int) -> tuple[list[str], list[dict]]:
    cols_a, a = rows_of(first)
    cols_b, b = rows_of(resumed)
    kept = [r for r in a if step_of(r) is None or step_of(r) < from_step] + [r for r in b if step_of(r) is None or step_of(r) >= from_step]
    steps = [step_of(r) for r in kept if step_of(r) is not None]
    train = sorted({s for s in steps})
    if train != list(range(len(train))):
        raise SystemExit(f"join_metrics: the joined steps are not 0..{len(train) - 1} without gaps")
    columns = cols_a + [c for c in cols_b if c not in cols_a]
    return columns, kept


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first")
    p.add_argument("resumed")
    p.add_argument("out", help="a metrics.csv.gz to write")
    p.add_argument("--from-step", type=int, required=True, help="the checkpoint's step: the first step the resume trained")
    args = p.parse_args(argv)
    columns, rows = join(Path(args.first), Path(args.resumed), args.from_step)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
        gz.write(text.getvalue().encode("utf-8"))
    print(f"join_metrics: {len(rows)} rows -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

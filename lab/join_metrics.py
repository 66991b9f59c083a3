"""Join a lab run's metrics from its first log directory and the one its resume wrote into.

    python lab/join_metrics.py FIRST/metrics.csv RESUMED/metrics.csv OUT/metrics.csv.gz --from-step 80

A run continued by exact resume (``--ckpt_path .../last.ckpt``) into a new log directory logs its
later steps there; the lab's archive holds one file a run. Rows of FIRST with a step below
``--from-step`` and rows of RESUMED from that step on (rows without a step, an evaluation's, from
both) are written, gzip-compressed with mtime 0 as lab/collapse.py archives a run; the columns are
the union, FIRST's order first. An input may be a metrics.csv or an archived metrics.csv.gz.
Refuses, in one line: a join that would leave a gap, an input that holds a step twice (two rows of
the same columns), has no step column or is not a readable CSV, and an OUT that exists (without
--force) or is a directory.
"""
from __future__ import annotations

import argparse
import csv
import gzip
import io
import os
import zlib
from pathlib import Path

from lldslight.errors import script_main


def refuse(message: str) -> SystemExit:
    return SystemExit(f"join_metrics: {message}")


def rows_of(path: Path) -> tuple[list[str], list[dict]]:
    """A metrics.csv (or the lab archive's metrics.csv.gz): its columns and rows; one line naming the
    file for a missing, unreadable, compressed-but-broken or non-CSV one, or one without a step column."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise refuse(f"{path}: no such file") from None
    except IsADirectoryError:
        raise refuse(f"{path}: is a directory, not a metrics.csv") from None
    except OSError as err:
        raise refuse(f"{path}: cannot read it ({err.strerror or err})") from None
    if data[:2] == b"\x1f\x8b":  # gzip's magic number: an archived run's metrics.csv.gz
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as err:
            raise refuse(f"{path}: a truncated or damaged gzip file ({err})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise refuse(f"{path}: not a metrics.csv (byte {data[err.start]:#04x} at offset {err.start} is not UTF-8)") from None
    try:
        reader = csv.DictReader(io.StringIO(text, newline=""))
        columns, rows = list(reader.fieldnames or []), list(reader)
    except csv.Error as err:
        raise refuse(f"{path}: not a metrics.csv ({err})") from None
    if "step" not in columns:
        # every row would count as "without a step" (an evaluation's) and be taken from both files
        raise refuse(f"{path}: no 'step' column (its header: {', '.join(columns[:6]) or 'none'}); not a Lightning metrics.csv")
    return columns, rows


def step_of(row: dict):
    value = row.get("step", "")
    try:
        return int(float(value)) if value not in ("", None) else None
    except ValueError:
        raise refuse(f"a row's step is {value!r}, not a number") from None


def _kind(row: dict) -> frozenset:
    """The columns a row fills: a step's training row and its evaluation row differ in them."""
    return frozenset(k for k, v in row.items() if k not in ("step", "epoch") and v not in ("", None))


def _twice(rows: list[dict]) -> list[int]:
    """Steps with two rows of the same kind (the same columns filled)."""
    seen, twice = set(), []
    for row in rows:
        key = (step_of(row), _kind(row))
        if key[0] is not None and key in seen:
            twice.append(key[0])
        seen.add(key)
    return sorted(set(twice))


def join(first: Path, resumed: Path, from_step: int) -> tuple[list[str], list[dict]]:
    cols_a, a = rows_of(first)
    cols_b, b = rows_of(resumed)
    for path, rows in ((first, a), (resumed, b)):
        twice = _twice(rows)
        if twice:
            raise refuse(f"{path} holds step {twice[0]} twice{f' (and {len(twice) - 1} more)' if len(twice) > 1 else ''}: "
                         "two rows of the same columns; a run logs one row a step (a file of two runs appended?)")
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
    p.add_argument("--force", action="store_true", help="replace OUT when it exists (an archived run's metrics, say)")
    args = p.parse_args(argv)
    out = Path(args.out)
    # Before the join: an output that is not a new file fails here, not after the work, and an
    # archived run's metrics are not replaced without a word.
    if out.is_dir():
        raise refuse(f"{out}: is a directory; give the file to write (e.g. {out / 'metrics.csv.gz'})")
    if any(out.resolve() == Path(x).resolve() for x in (args.first, args.resumed)):
        raise refuse(f"{out}: is one of the inputs")
    if out.exists() and not args.force:
        raise refuse(f"{out} exists (an archived run's metrics?); pass --force to replace it")
    columns, rows = join(Path(args.first), Path(args.resumed), args.from_step)
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    partial = out.with_name(f".{out.name}.tmp{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(partial, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            gz.write(text.getvalue().encode("utf-8"))
        os.replace(partial, out)  # whole or not at all
    except OSError as err:
        partial.unlink(missing_ok=True)
        raise refuse(f"cannot write {err.filename or out}: {err.strerror or err}") from None
    print(f"join_metrics: {len(rows)} rows -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))

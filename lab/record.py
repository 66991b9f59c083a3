"""The lab's primary tests as a family, corrected: what the README's results table rests on.

    python lab/record.py                      # prints the table, writes lab/archive/collapse/record.json

The earlier registration (lab/archive/collapse/PREREGISTRATION.md) let five primary-endpoint tests
be run, each at its own level. This recomputes each from the archived per-step metrics
(``lldslight.science.collapse``: the registered collapse rule) and reports, for each, the counts, the
one-sided Fisher p, Holm's adjustment over the five, the set's horizon rule (GRPO's median time to
collapse, held runs counted at the horizon, against H / 2), and the count under a 30-step hold.
Nothing here is a new test: it is the record, with its multiplicity and its rules applied.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Optional

from lldslight.errors import script_main
from lldslight.run.writes import check_out_file
from lldslight.science import collapse as C

ROOT = Path(__file__).resolve().parents[1]
ARCHIVE = ROOT / "lab" / "archive" / "collapse"
HORIZON = 600
# (set, arm tested against GRPO, what it tested): the five primary-endpoint tests that were run.
PRIMARY = [
    ("final", "onpolicy", "H1 at 7e-4 (Xeon): GRPO vs the on-policy twin"),
    ("final", "llds", "H2 at 7e-4 (Xeon): GRPO vs LLDS"),
    ("final_5e-4", "llds", "H2 at 5e-4 (Xeon): GRPO vs LLDS"),
    ("final_5e-4_epyc", "onpolicy", "H1 at 5e-4 (EPYC): GRPO vs the on-policy twin"),
    ("final_5e-4_epyc", "llds", "H2 at 5e-4 (EPYC): GRPO vs LLDS"),
]


def outcomes(archive: Path, name: str, arm: str, hold: int) -> dict[int, tuple[float, bool]]:
    """Seed -> (time to collapse censored at the horizon, collapsed by it) of one arm."""
    crit = C.CollapseCriteria(hold=hold)
    out = {}
    for run in C.archived_runs(archive / name / arm):
        train = C.training_rows(C.read_metrics(run))
        out[int(run.name[4:])] = C.time_to_collapse(C.summarise(train[train.index < HORIZON], crit), HORIZON)
    if not out:
        raise SystemExit(f"record: no archived run in {archive / name / arm}")
    return out


def row(archive: Path, name: str, arm: str, what: str) -> dict:
    out = {"set": name, "arm": arm, "test": what}
    for hold in (20, 30):
        grpo, other = outcomes(archive, name, "grpo", hold), outcomes(archive, name, arm, hold)
        k_g, k_o = sum(c for _, c in grpo.values()), sum(c for _, c in other.values())
        out[f"hold{hold}"] = {"grpo": [k_g, len(grpo)], arm: [k_o, len(other)],
                              "fisher_p": C.fisher_one_sided(k_g, len(grpo), k_o, len(other))}
        if hold == 20:
            median = statistics.median(t for t, _ in grpo.values())
            out["grpo_median_time"] = median
            out["horizon_rule_holds"] = median <= HORIZON / 2
    return out


def record(archive: Path = ARCHIVE) -> dict:
    rows = [row(archive, name, arm, what) for name, arm, what in PRIMARY]
    for r, adjusted in zip(rows, C.holm([r["hold20"]["fisher_p"] for r in rows])):
        r["holm_p"] = adjusted
    return {"horizon": HORIZON, "alpha": 0.05, "family": "the five primary-endpoint tests that were run", "rows": rows}


def table(rec: dict) -> str:
    lines = ["| test | GRPO collapsed | other arm collapsed | Fisher p | Holm p (5 tests) | hold 30: counts, p "
             "| GRPO median time (H/2 = 300) | horizon rule |", "|---|---|---|---|---|---|---|---|"]
    for r in rec["rows"]:
        h20, h30 = r["hold20"], r["hold30"]
        g, o = h20["grpo"], h20[r["arm"]]
        lines.append(f"| {r['test']} | {g[0]} of {g[1]} | {o[0]} of {o[1]} | {h20['fisher_p']:.3f} | {r['holm_p']:.3f} "
                     f"| {h30['grpo'][0]} vs {h30[r['arm']][0]}, {h30['fisher_p']:.3f} | {r['grpo_median_time']:.0f} "
                     f"| {'holds' if r['horizon_rule_holds'] else 'broken: horizon too short'} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", type=Path, default=ARCHIVE, help="the lab's archive (default lab/archive/collapse)")
    parser.add_argument("--json", type=Path, default=None, help="where to write the record (default ARCHIVE/record.json)")
    args = parser.parse_args(argv)
    if args.json is not None:  # refused now, not after the work
        check_out_file(args.json, "--json")
    rec = record(args.archive)
    print(table(rec), end="")
    path = args.json or args.archive / "record.json"
    path.write_text(json.dumps(rec, indent=1) + "\n")
    print(f"json: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))

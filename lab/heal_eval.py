"""A run that heals itself, compared: healed vs the same seeds unhealed vs the lower rate from the start.

    python lab/heal_eval.py --healed lab/archive/collapse/heal_5e-4/grpo_heal \\
        --unhealed lab/archive/collapse/final_5e-4/grpo --lower lab/archive/collapse/half_2.5e-4/grpo \\
        --json lab/archive/collapse/heal.json

Each directory holds archived lab runs (``seed<S>/metrics.csv.gz``, lab/collapse.py); runs
are paired by seed (a seed missing from an arm is reported as missing). Per seed and arm: collapsed
by the horizon (``lldslight/science/collapse.py``, reward and answered rate only), the collapse step, the
mean reward over the last 100 steps; for the healed run, every heal (the step it acted on, the
alarm's onset, the snapshot put back, the rate after) and whether it was a *false-alarm heal*: the
same seed's unhealed run did not collapse within ``--window`` (100) steps after the alarm. The
registered design (lab/archive/collapse/PREREGISTRATION.md, amendment A2) has 3 pairs: the numbers
are descriptive; no test is claimed.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Optional

from lldslight.errors import script_main
from lldslight.run.writes import check_out_file
from lldslight.science import collapse as C


def load(directory: Optional[str]) -> dict[int, dict]:
    """{seed: {"frame", "summary"}} of the archived runs under ``directory``."""
    out: dict[int, dict] = {}
    if directory is None:
        return out
    for path in C.archived_runs(directory):
        frame = C.read_metrics(path)
        train = C.training_rows(frame)
        out[int(path.name[4:])] = {"frame": frame, "train": train, "summary": C.summarise(train), "path": str(path)}
    return out


def heals(frame) -> list[dict]:
    """The heals a run logged: one row per ``heal/rolled_back_to`` value (Heal logs it on a heal)."""
    if "heal/rolled_back_to" not in frame.columns:
        return []
    rows = frame[frame["heal/rolled_back_to"].notna()]
    out = []
    for step, row in rows.iterrows():
        out.append({"step": int(step), "onset": int(row["heal/onset"]), "rolled_back_to": int(row["heal/rolled_back_to"]),
                    "lr_after": float(row["heal/lr"])})
    return out


def alarms(frame) -> list[int]:
    if "alarm/fired" not in frame.columns:
        return []
    return [int(s) for s, v in frame["alarm/fired"].items() if C.finite(v) and v > 0]


def row(run: Optional[dict], horizon: int) -> dict:
    if run is None:
        return {"missing": True}
    s = run["summary"]
    collapsed = bool(s["collapsed"]) and s["step"] is not None and s["step"] < horizon
    return {"collapsed": collapsed, "collapse_step": s["step"] if collapsed else None, "mode": s.get("mode") if collapsed else None,
            "final_reward": s["final_reward"], "peak_reward": s["peak_reward"], "steps": s["steps"], "path": run["path"]}


def fmt(r: dict) -> str:
    if r.get("missing"):
        return "not run"
    state = f"collapsed at {r['collapse_step']} ({r['mode']})" if r["collapsed"] else "no collapse"
    return f"{state}; last-100 reward {r['final_reward']:.3f}"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--healed", required=True, help="archive directory of the healed arm (seed<S>/ inside)")
    parser.add_argument("--unhealed", required=True, help="archive directory of the same recipe without healing")
    parser.add_argument("--lower", default=None, help="archive directory of the lower rate from the start (the trivial fix)")
    parser.add_argument("--horizon", type=int, default=600)
    parser.add_argument("--window", type=int, default=100, help="a heal is a false alarm when the unhealed run did not collapse within this many steps after it")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.json is not None:  # refused now, not after the work
        check_out_file(args.json, "--json")

    healed, unhealed, lower = load(args.healed), load(args.unhealed), load(args.lower)
    if not healed:
        raise SystemExit(f"heal_eval: no archived run in {args.healed} (expected {args.healed}/seed<S>/metrics.csv.gz)")
    seeds = sorted(healed)
    per_seed = []
    for seed in seeds:
        h, u, lo = healed[seed], unhealed.get(seed), lower.get(seed)
        u_row = row(u, args.horizon)
        events = heals(h["frame"])
        for e in events:
            c = u_row.get("collapse_step")
            e["false_alarm"] = None if u_row.get("missing") else not (c is not None and 0 <= c - e["step"] <= args.window)
        per_seed.append({"seed": seed, "healed": {**row(h, args.horizon), "heals": events, "alarms": alarms(h["frame"])},
                         "unhealed": u_row, "lower": row(lo, args.horizon)})

    def count(arm: str) -> str:
        rows = [p[arm] for p in per_seed if not p[arm].get("missing")]
        return f"{sum(r['collapsed'] for r in rows)} of {len(rows)}" if rows else "n/a"

    def mean_final(arm: str) -> Optional[float]:
        vals = [p[arm]["final_reward"] for p in per_seed if not p[arm].get("missing") and C.finite(p[arm]["final_reward"])]
        return statistics.mean(vals) if vals else None

    n_heals = sum(len(p["healed"]["heals"]) for p in per_seed)
    n_false = sum(bool(e["false_alarm"]) for p in per_seed for e in p["healed"]["heals"])
    totals = {arm: {"collapsed": count(arm), "mean_final_reward": mean_final(arm)} for arm in ("healed", "unhealed", "lower")}
    totals["heals"], totals["false_alarm_heals"] = n_heals, n_false

    print("| seed | healed | heals (step: onset -> snapshot, lr after; false alarm?) | unhealed | lower rate from the start |")
    print("|---|---|---|---|---|")
    for p in per_seed:
        hs = "; ".join(f"{e['step']}: {e['onset']} -> {e['rolled_back_to']}, lr {e['lr_after']:.2g}"
                       + (" (false alarm)" if e["false_alarm"] else "") for e in p["healed"]["heals"]) or "none"
        print(f"| {p['seed']} | {fmt(p['healed'])} | {hs} | {fmt(p['unhealed'])} | {fmt(p['lower'])} |")
    mf = {k: (f"{v['mean_final_reward']:.3f}" if v["mean_final_reward"] is not None else "n/a") for k, v in totals.items() if isinstance(v, dict)}
    print(f"| all | {totals['healed']['collapsed']} collapsed, mean last-100 reward {mf['healed']} | {n_heals} heals, "
          f"{n_false} on false alarms | {totals['unhealed']['collapsed']} collapsed, {mf['unhealed']} | "
          f"{totals['lower']['collapsed']} collapsed, {mf['lower']} |")
    if args.json:
        payload = {"settings": vars(args), "per_seed": per_seed, "totals": totals}
        Path(args.json).write_text(json.dumps(payload, indent=1, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
        print(f"json: {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))

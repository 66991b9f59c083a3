"""lab/heal_eval.py on hand-built archives: pairing by seed, heals read from heal/* rows,
false-alarm heals judged against the unhealed run's collapse."""
from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pandas as pd
from conftest import load_lab


def archived(path: Path, reward: list[float], heal_at: dict[int, int] | None = None) -> None:
    """A run in the archive's form; ``heal_at`` = {step: snapshot step} rows of a Heal."""
    path.mkdir(parents=True)
    n = len(reward)
    frame = pd.DataFrame({"step": range(n), "train/reward": reward, "train/answered_rate": [1.0] * n,
                          "diag/tool_call_rate": [1.0] * n})
    for col in ("heal/rolled_back_to", "heal/onset", "heal/lr", "alarm/fired"):
        frame[col] = math.nan
    for step, snap in (heal_at or {}).items():
        frame.loc[step, ["heal/rolled_back_to", "heal/onset", "heal/lr", "alarm/fired"]] = [snap, snap + 10, 2.5e-4, 1.0]
    with gzip.open(path / "metrics.csv.gz", "wt") as f:
        frame.to_csv(f, index=False)


def test_heals_paired_with_the_unhealed_collapse(tmp_path: Path) -> None:
    heal_eval = load_lab("heal_eval")
    high, low = [0.6] * 150, [0.0] * 150
    # Unhealed seed 1 collapses at step 159: its trailing-20 mean first reaches half the peak (10 of 20
    # steps at 0: 0.3 = 0.5 x 0.6) and stays there; seed 2 never.
    archived(tmp_path / "u" / "seed1", high + low)
    archived(tmp_path / "u" / "seed2", high + high)
    # Healed seed 1: a heal at 140 (19 steps before the unhealed collapse: a true alarm) and the
    # reward kept; healed seed 2: a heal at 200 though its unhealed twin never fell (a false alarm).
    archived(tmp_path / "h" / "seed1", high + high, {140: 120})
    archived(tmp_path / "h" / "seed2", high + high, {200: 180})
    out = tmp_path / "heal.json"
    assert heal_eval.main(["--healed", str(tmp_path / "h"), "--unhealed", str(tmp_path / "u"), "--horizon", "300",
                           "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    s1, s2 = data["per_seed"]
    assert s1["unhealed"]["collapsed"] and s1["unhealed"]["collapse_step"] == 159
    assert not s1["healed"]["collapsed"] and not s2["unhealed"]["collapsed"]
    assert s1["healed"]["heals"] == [{"step": 140, "onset": 130, "rolled_back_to": 120, "lr_after": 2.5e-4, "false_alarm": False}]
    assert s2["healed"]["heals"][0]["false_alarm"] is True
    assert data["totals"]["heals"] == 2 and data["totals"]["false_alarm_heals"] == 1
    assert data["totals"]["unhealed"]["collapsed"] == "1 of 2" and data["totals"]["lower"]["collapsed"] == "n/a"
    assert s1["lower"] == {"missing": True}

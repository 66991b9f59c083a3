"""The collapse lab's runner: seeds x arms of `lldslight fit`, side by side, then the report.

    python lab/collapse.py --name final --arms grpo llds onpolicy --seeds 0 1 2 3 4
    python lab/collapse.py --name final --report-only      # from the committed metrics
    python lab/collapse.py --smoke                         # a tiny model, 1 seed x 2 arms, minutes

Each run is one `lldslight fit` child process (one thread; ``--jobs`` at a time) of the recipe
(``--recipe``, default lab/configs/constant.yaml) composed with its arm's config; an arm is a file
of ``--arms-dir`` (default lab/configs/arms/: its name is the file's stem, its label the file's
first comment line; the one definition of the arms). ``seed_everything`` and the data order are
the seed. Warm starts: ``--inits`` lists the policy directories of the warm-start
initialisations (default: the recipe's ``model.policy.model``); seed s trains init ``s mod
len(inits)``; each is built by lab/make_policy.py (``--seed`` k for init k; cached).
``--smoke`` runs the tiny recipe from an `lldslight sft` warm start instead.

As each run ends, its per-step metrics are archived, gzip-compressed, in
``lab/archive/collapse/<name>/<arm>/seed<S>/`` (metrics.csv.gz, summary.json): the evidence every
number of the report is recomputed from (``--report-only`` reads only the archive).

Per run (lldslight/science/collapse.py, no detector involved): whether and when it collapsed, death or
decay, peak and final reward, explosions; the LLDMonitor's first warning and its lead. Per arm:
collapses out of N. Tests (pre-registered, lab/archive/collapse/PREREGISTRATION.md): one-sided Fisher
exact on "collapsed by the horizon" of the first arm (``--baseline``, default the first of
``--arms``) against each other arm, paired sign test on times to collapse (censored at the horizon),
restricted mean survival time difference with a bootstrap interval, paired permutation test on the
mean reward of the last 100 steps. Output: collapse.json, collapse.md, collapse.png in the archive.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import yaml

from lldslight.errors import UserError, script_main
from lldslight.science import collapse as C

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_RECIPE = "lab/configs/constant.yaml"
SMOKE_RECIPE = "lab/configs/collapse_smoke.yaml"
ARCHIVE = "lab/archive/collapse"
DEFAULT_ARMS = ["grpo", "llds"]
FINAL_WINDOW = 100  # steps of the "final reward" secondary outcome
# The smoke recipe's random 2-layer model, every weight trained by a supervised warm start first.
SMOKE_SFT = ["--limit", "16", "--topk", "1", "--max-obs-tokens", "32", "--max-searches", "1", "--over-budget", "truncate",
             "--keep-unanswerable", "--epochs", "1", "--lr", "3e-3", "--lora-r", "0"]


# --------------------------------------------------------------------------- arms and runs


def arms_in(directory: Path) -> dict[str, tuple[str, Path]]:
    """{name: (label, config)} of every arm file in ``directory``."""
    out = {}
    for path in sorted(directory.glob("*.yaml")):
        first = next(iter(path.read_text().splitlines()), "")
        out[path.stem] = (first.lstrip("# ").split(":")[0].rstrip(".") if first.startswith("#") else path.stem, path)
    return out


def recipe_steps(recipe: str) -> int:
    """The recipe's ``trainer.max_steps``: the horizon a run is judged over unless told otherwise."""
    return int(yaml.safe_load((ROOT / recipe).read_text())["trainer"]["max_steps"])


def run_dir(out: Path, arm: str, seed: int) -> Path:
    return out / arm / f"seed{seed}" / "version_0"


def fit_command(recipe: str, arm_config: Path, out: Path, arm: str, seed: int, policy: Optional[str], steps: Optional[int],
                extra_configs: list[str], overrides: list[str]) -> list[str]:
    """The `lldslight fit` command line of one run (configs compose left to right)."""
    cmd = [sys.executable, "-m", "lldslight.cli", "fit", "--config", recipe, "--config", str(arm_config)]
    for config in extra_configs:
        cmd += ["--config", config]
    cmd += ["--seed_everything", str(seed), "--data.seed", str(seed),
            "--trainer.logger.init_args.save_dir", str(out / arm), "--trainer.logger.init_args.name", f"seed{seed}",
            "--trainer.logger.init_args.version", "0"]
    if policy is not None:
        cmd += ["--model.policy.model", policy]
    if steps is not None:
        cmd += ["--trainer.max_steps", str(steps)]
    return cmd + overrides


def archive_run(src: Path, dest: Path) -> None:
    """metrics.csv gzip-compressed (mtime 0: the same run gives the same bytes) and summary.json."""
    dest.mkdir(parents=True, exist_ok=True)
    with open(src / "metrics.csv", "rb") as f, open(dest / "metrics.csv.gz", "wb") as raw:
        with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as gz:
            shutil.copyfileobj(f, gz)
    if (src / "summary.json").is_file():
        shutil.copy(src / "summary.json", dest / "summary.json")


RUN_RECORD = "run.json"


def set_jobs(archive: Path, meta: dict) -> list[tuple[str, int]]:
    """Every run a set reports: each archived run, and each run its last invocation named that has a
    record (a failed run); the last invocation's arms first (its first arm is the baseline). A set is
    filled by several invocations (a lab spans sessions)."""
    archived = {(p.parent.name, int(p.name[4:])) for p in archive.glob("*/seed*") if (p / "metrics.csv.gz").is_file()}
    named = [(a, s) for a in meta.get("arms", []) for s in meta.get("seeds", [])]
    order = list(dict.fromkeys([a for a, _ in named] + sorted(a for a, _ in archived)))
    return sorted({j for j in named if j in archived or f"{j[0]}/seed{j[1]}" in meta.get("runs", {})} | archived,
                  key=lambda j: (order.index(j[0]), j[1]))


def with_run_records(runs: dict[str, dict], archive: Path, jobs: list[tuple[str, int]]) -> dict[str, dict]:
    """``runs`` with each job it holds no record of filled from the run's own ``RUN_RECORD``, if any
    (a run whose invocation ended before it wrote collapse.json)."""
    runs = dict(runs)
    for arm, seed in jobs:
        path = archive / arm / f"seed{seed}" / RUN_RECORD
        if not runs.get(f"{arm}/seed{seed}") and path.is_file():
            try:
                runs[f"{arm}/seed{seed}"] = json.loads(path.read_text())
            except json.JSONDecodeError as err:
                raise SystemExit(f"collapse: {path}: not JSON ({err}); the run's record is damaged") from None
    return runs


_RUNNING: set[subprocess.Popen] = set()  # every live child, so an interrupt can stop them all


def _kill_children() -> None:
    for proc in list(_RUNNING):
        proc.kill()


def _stop_children(*_) -> None:
    _kill_children()
    sys.exit(143)


def run_child(name: str, cmd: list[str], log_path: Path, threads: Optional[int] = None) -> tuple[float, float]:
    """Run one child process, its output teed to ``log_path``; its [lldslight] lines are echoed.
    Returns (wall seconds, CPU seconds of the child); raises RuntimeError when it fails. CPU
    seconds are what a run costs on a shared machine, where wall seconds mean little."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"\n=== {name}: {' '.join(cmd[1:])}\n    log: {log_path}", flush=True)
    t0 = time.perf_counter()
    tail: list[str] = []
    with open(log_path, "w") as log, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, bufsize=1) as proc:
        _RUNNING.add(proc)
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()  # the log is what one watches during an hour-long run
                tail = (tail + [line])[-40:]
                if line.startswith("[lldslight]") or "Error" in line:
                    print(f"    {name}| " + line.rstrip(), flush=True)
            _, status, usage = os.wait4(proc.pid, 0)  # the child's own resource usage (Popen keeps none)
            proc.returncode = code = os.waitstatus_to_exitcode(status)
            cpu = usage.ru_utime + usage.ru_stime
        finally:
            _RUNNING.discard(proc)
            if proc.poll() is None:  # interrupted: never leave an orphaned training run behind
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    if code != 0:
        sys.stdout.write("".join(tail))
        raise RuntimeError(f"exit {code}; log: {log_path}")
    print(f"    {name} done in {wall / 60:.1f} min ({cpu / 60:.1f} CPU min)", flush=True)
    return wall, cpu


def run_all(commands: dict[tuple[str, int], list[str]], out: Path, archive: Path, jobs: int, threads: int,
            kinds: dict[tuple[str, int], dict]) -> dict[str, dict]:
    """Every run, ``jobs`` at a time; a failed run is recorded, not fatal; each finished run is archived
    with its run record (``RUN_RECORD``: command, wall and CPU seconds, machine kind)."""
    results: dict[str, dict] = {}

    def one(key: tuple[str, int]) -> None:
        arm, seed = key
        name = f"{arm}/seed{seed}"
        # Recorded relative to the repository: an archive names no machine's paths.
        entry = results[name] = {"command": " ".join(shlex.quote(a) for a in commands[key][1:]).replace(f"{ROOT}/", ""),
                                 "machine_kind": kinds[key]}
        try:
            entry["wall_s"], entry["cpu_s"] = run_child(name, commands[key], out / "logs" / f"{arm}_seed{seed}.log", threads)
            dest = archive / arm / f"seed{seed}"
            archive_run(run_dir(out, arm, seed), dest)
            # Beside the metrics, not only in collapse.json (written once the invocation ends): a set
            # whose invocation is cut short keeps each finished run's machine kind and CPU time.
            (dest / RUN_RECORD).write_text(json.dumps(entry, indent=1) + "\n")
        except RuntimeError as err:
            entry["error"] = str(err)

    pool = ThreadPoolExecutor(max(1, jobs))
    futures = [pool.submit(one, key) for key in commands]
    try:
        while not all(f.done() for f in futures):
            time.sleep(1.0)  # a bounded wait, so Ctrl-C and SIGTERM reach this thread
        for f in futures:
            f.result()
    finally:
        _kill_children()
        pool.shutdown(wait=False, cancel_futures=True)
    return results


def build_policies(recipe: str, inits: list[str], out: Path) -> dict[str, str]:
    """Each init's policy built by make_policy.py (cached: a second call only checks); their digests."""
    digests = {}
    for k, policy in enumerate(inits):
        # As a module from ROOT (run_child's cwd): the policy is built with this checkout's lldslight.
        cmd = [sys.executable, "-m", "lab.make_policy", "--config", recipe, "--out", policy, "--seed", str(k)]
        try:
            run_child(f"lab policy {k}", cmd, out / "logs" / f"policy{k}.log", threads=1)
        except RuntimeError as err:
            raise SystemExit(f"collapse: building the lab policy {policy} failed ({err})") from None
        digests[policy] = weights_digest(ROOT / policy)
    return digests


def weights_digest(directory: Path) -> Optional[str]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    h = hashlib.sha256()
    for p in files:
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def machine() -> dict:
    """What "the same machine" means for a chaotic run: CPU model and flags, BLAS, library versions."""
    import torch

    from lldslight.policy import cpu_description

    info = {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count(), "torch": torch.__version__,
            **cpu_description()}
    config = torch.__config__.show()
    info["blas"] = next((l.strip() for l in config.splitlines() if "BLAS_INFO" in l), None)
    info["mkldnn"] = torch.backends.mkldnn.is_available()
    return info


# --------------------------------------------------------------------------- report


def summarise_archive(path: Path, crit: C.CollapseCriteria, horizon: int) -> dict:
    """Every number of one archived run."""
    frame = C.read_metrics(path)
    summary = json.loads((path / "summary.json").read_text()) if (path / "summary.json").is_file() else {}
    out = {"dev_em_before": (summary.get("dev_before") or {}).get("em"), "dev_em_after": (summary.get("dev_after") or {}).get("em"),
           "wall_time_s": summary.get("wall_time_s")}
    train = C.training_rows(frame)
    train = train[train.index < horizon]
    out.update(C.summarise(train, crit, FINAL_WINDOW))
    time_, collapsed = C.time_to_collapse(out, horizon)
    out["time_to_collapse"], out["collapsed_by_horizon"] = time_, collapsed
    warnings = [int(s) for s, w in zip(train.index, C.column(train, "lld/warning") or []) if C.finite(w) and w > 0]
    out["first_warning"] = int(warnings[0]) if warnings else None
    out["warning_lead"] = out["step"] - out["first_warning"] if collapsed and warnings else None
    return out


def arm_stats(runs: list[dict], baseline: str, horizon: int) -> dict:
    """Per arm: collapses of N; against the baseline arm: the pre-registered tests."""
    arms: dict[str, dict] = {}
    for arm in dict.fromkeys(r["arm"] for r in runs):
        mine = [r for r in runs if r["arm"] == arm and "error" not in r]
        arms[arm] = {
            "runs": len(mine), "failed": sum(1 for r in runs if r["arm"] == arm and "error" in r),
            "collapsed": sum(r["collapsed_by_horizon"] for r in mine),
            "death": sum(r["collapsed_by_horizon"] and r["mode"] == "death" for r in mine),
            "decay": sum(r["collapsed_by_horizon"] and r["mode"] == "decay" for r in mine),
            "median_collapse_step": _median([r["step"] for r in mine if r["collapsed_by_horizon"]]),
            "mean_final_reward": _mean([r["final_reward"] for r in mine]),
            "mean_peak_reward": _mean([r["peak_reward"] for r in mine]),
            "rmst": C.rmst([r["time_to_collapse"] for r in mine], [r["collapsed_by_horizon"] for r in mine], horizon) if mine else None,
        }
    base = {r["seed"]: r for r in runs if r["arm"] == baseline and "error" not in r}
    for arm, a in arms.items():
        if arm == baseline or baseline not in arms:
            continue
        other = {r["seed"]: r for r in runs if r["arm"] == arm and "error" not in r}
        paired = sorted(set(base) & set(other))
        b = arms[baseline]
        tests = {"fisher_p": C.fisher_one_sided(b["collapsed"], b["runs"], a["collapsed"], a["runs"]) if a["runs"] and b["runs"] else None,
                 "paired_seeds": paired}
        if paired:
            tests["sign_test"] = C.sign_test([(base[s]["time_to_collapse"], other[s]["time_to_collapse"]) for s in paired])
            tests["final_reward_permutation"] = C.paired_permutation([base[s]["final_reward"] or 0.0 for s in paired],
                                                                     [other[s]["final_reward"] or 0.0 for s in paired])
            tests["rmst_difference"] = C.rmst_difference([(base[s]["time_to_collapse"], base[s]["collapsed_by_horizon"]) for s in paired],
                                                         [(other[s]["time_to_collapse"], other[s]["collapsed_by_horizon"]) for s in paired], horizon)
        a["vs_" + baseline] = tests
    return arms


def _mean(values) -> Optional[float]:
    values = [v for v in values if C.finite(v)]
    return sum(values) / len(values) if values else None


def _median(values) -> Optional[float]:
    import statistics

    values = [v for v in values if C.finite(v)]
    return float(statistics.median(values)) if values else None


def _f(value, spec: str = ".3f") -> str:
    return "n/a" if value is None or not C.finite(value) else format(value, spec)


def table(runs: list[dict], arms: dict, labels: dict[str, str], baseline: str, horizon: int, hold: int = 20) -> str:
    lines = [f"Horizon {horizon} steps. Collapse: trailing-20 reward <= 0.5 x its running peak, or trailing-20 answered rate < 0.5,"
             f" for {hold} steps (lldslight/collapse.py).", "",
             "| arm | seed | collapsed (step, cause, mode) | peak reward (step) | final reward | final answered / tool call "
             "| Delta<0 share | explosions | first LLD warning (lead) | dev EM before -> after | steps |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        name = labels.get(r["arm"], r["arm"])
        if "error" in r:
            lines.append(f"| {name} | {r['seed']} | FAILED: {r['error']} |" + " |" * 8)
            continue
        collapsed = f"yes, {r['step']}, {r['cause']}, {r['mode']}" if r["collapsed_by_horizon"] else "no"
        warn = "none" if r["first_warning"] is None else f"{r['first_warning']} ({r['warning_lead'] if r['warning_lead'] is not None else 'n/a'})"
        lines.append(f"| {name} | {r['seed']} | {collapsed} | {_f(r['peak_reward'])} ({r['peak_step']}) | {_f(r['final_reward'])} "
                     f"| {_f(r['final_answered'], '.2f')} / {_f(r['final_tool_call'], '.2f')} | {_f(r.get('delta_negative_share'), '.2f')} "
                     f"| {len(r['explosion_steps'])} | {warn} | {_f(r['dev_em_before'])} -> {_f(r['dev_em_after'])} | {r['steps']} |")
    lines += ["", f"| arm | collapsed by {horizon} (death / decay) | median collapse step | RMST | mean peak reward | mean final reward "
              f"| Fisher p vs {labels.get(baseline, baseline)} | sign test p (wins-losses) | RMST diff [95% CI] | final reward diff (perm. p) |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, a in arms.items():
        t = a.get("vs_" + baseline, {})
        sign = t.get("sign_test")
        rd = t.get("rmst_difference")
        perm = t.get("final_reward_permutation")
        failed = f" ({a['failed']} failed)" if a["failed"] else ""
        lines.append(
            f"| {labels.get(arm, arm)} | {a['collapsed']} of {a['runs']}{failed} ({a['death']} / {a['decay']}) | {_f(a['median_collapse_step'], '.0f')} "
            f"| {_f(a['rmst'], '.0f')} | {_f(a['mean_peak_reward'])} | {_f(a['mean_final_reward'])} | {_f(t.get('fisher_p'), '.3f')} "
            f"| {_f(sign['p'], '.3f') + ' (' + str(sign['wins']) + '-' + str(sign['losses']) + ')' if sign else 'n/a'} "
            f"| {_f(rd['diff'], '+.0f') + ' [' + _f(rd['low'], '+.0f') + ', ' + _f(rd['high'], '+.0f') + ']' if rd else 'n/a'} "
            f"| {_f(perm['mean_diff'], '+.3f') + ' (' + _f(perm['p'], '.3f') + ')' if perm else 'n/a'} |")
    return "\n".join(lines) + "\n"


def figure(runs: list[dict], archive: Path, labels: dict[str, str], crit: C.CollapseCriteria, path: Path) -> Path:
    """Arms side by side: trailing reward, answered rate and tool-call rate per seed; collapses marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = list(dict.fromkeys(r["arm"] for r in runs))
    seeds = sorted({r["seed"] for r in runs})
    rows = [("train reward (trailing 20)", "train/reward"), ("answered (trailing 20)", "train/answered_rate"),
            ("tool-call rate (trailing 20)", "diag/tool_call_rate")]
    fig, axes = plt.subplots(len(rows), len(arms), figsize=(3.6 * len(arms) + 0.8, 7.0), sharex=True, sharey="row", squeeze=False,
                             layout="constrained")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for j, arm in enumerate(arms):
        axes[0][j].set_title(labels.get(arm, arm), fontsize=9)
        for r in (r for r in runs if r["arm"] == arm and "error" not in r):
            frame = C.training_rows(C.read_metrics(archive / arm / f"seed{r['seed']}"))
            colour = colours[seeds.index(r["seed"]) % len(colours)]
            for i, (_, col) in enumerate(rows):
                values = C.column(frame, col)
                if values is None:
                    continue
                axes[i][j].plot(frame.index, C.trailing_mean(values, crit.smooth), color=colour, lw=1.0)
                if r["collapsed_by_horizon"]:
                    axes[i][j].axvline(r["step"], color=colour, ls="--" if r["mode"] == "decay" else "-", lw=1.2, alpha=0.8)
    for i, (name, _) in enumerate(rows):
        axes[i][0].set_ylabel(name, fontsize=8)
        for ax in axes[i]:
            ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set_xlabel("training step")
    handles = [plt.Line2D([], [], color=colours[k % len(colours)], lw=2, label=f"seed {s}") for k, s in enumerate(seeds)]
    handles += [plt.Line2D([], [], color="grey", ls="-", label="collapse: death"), plt.Line2D([], [], color="grey", ls="--", label="collapse: decay")]
    fig.legend(handles=handles, loc="outside upper center", ncol=min(len(handles), 8), fontsize=7, frameon=False)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def report(archive: Path, jobs: list[tuple[str, int]], labels: dict[str, str], baseline: str, horizon: int, meta: dict,
           crit: C.CollapseCriteria = C.CollapseCriteria(), draw: bool = True) -> dict:
    """Summarise every archived run and write collapse.{json,md,png} into the archive."""
    # Arm by arm (arms in their first order in ``jobs``), seeds ascending: a run (seed by seed) and a
    # later --report-only write the same report.
    arms_first = list(dict.fromkeys(a for a, _ in jobs))
    runs = []
    for arm, seed in sorted(jobs, key=lambda j: (arms_first.index(j[0]), j[1])):
        info = meta.get("runs", {}).get(f"{arm}/seed{seed}", {})
        entry = {"arm": arm, "seed": seed, "command": info.get("command"), "wall_s": info.get("wall_s"), "cpu_s": info.get("cpu_s")}
        if info.get("error"):
            entry["error"] = info["error"]
        else:
            try:
                entry.update(summarise_archive(archive / arm / f"seed{seed}", crit, horizon))
            except (OSError, ValueError, KeyError) as err:
                entry["error"] = f"{type(err).__name__}: {err}"
        runs.append(entry)
    arms = arm_stats(runs, baseline, horizon)
    text = table(runs, arms, labels, baseline, horizon, crit.hold)
    png = None
    if any("error" not in r for r in runs):
        # --no-figure keeps the committed figure: the table still points at it.
        png = figure(runs, archive, labels, crit, archive / "collapse.png") if draw else archive / "collapse.png"
    (archive / "collapse.md").write_text(f"# Collapse lab: {archive.name}\n\n" + "".join(f"`{i}`\n\n" for i in meta.get("invocations") or [meta.get("invocation", "")] if i) + text
                                         + (f"\n![seeds x arms]({png.name})\n" if png else ""))
    payload = {"meta": meta, "criteria": asdict(crit), "horizon": horizon, "baseline": baseline, "arms": arms, "runs": runs}
    (archive / "collapse.json").write_text(json.dumps(payload, indent=1, default=float))
    print("\n" + text + f"\nfigure: {png}\ntable:  {archive / 'collapse.md'}\njson:   {archive / 'collapse.json'}", flush=True)
    return payload


# --------------------------------------------------------------------------- main


def recorded_meta(previous: Path) -> dict:
    """The ``meta`` a set's collapse.json recorded; one line naming the file when it is not a report."""
    try:
        return C.report_meta(previous)
    except UserError as err:
        raise SystemExit(f"collapse: {err}") from None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog="Arguments after `--` go to every `lldslight fit`.")
    parser.add_argument("--name", default=None, help="the experiment's name: runs in runs/lab/NAME, archive in lab/archive/collapse/NAME")
    parser.add_argument("--smoke", action="store_true", help="tiny random model, sft warm start, 2 arms x 1 seed: proves the pipeline")
    parser.add_argument("--recipe", default=None, help=f"base config (default {DEFAULT_RECIPE}; {SMOKE_RECIPE} with --smoke)")
    parser.add_argument("--arms-dir", default=None,
                        help="one YAML per arm (default lab/configs/arms; --report-only: the folder the set recorded)")
    parser.add_argument("--arms", nargs="+", default=None, help=f"arm names (default {' '.join(DEFAULT_ARMS)})")
    parser.add_argument("--baseline", default=None, help="the arm the others are tested against (default: the first of --arms)")
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="seeds (default 0 1 2; 0 with --smoke)")
    parser.add_argument("--inits", nargs="+", default=None, help="policy directory of each warm-start init (seed s trains init s mod N)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at a time (default 2: one per core on 2 cores)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per run (default 1)")
    parser.add_argument("--steps", type=int, default=None, help="override trainer.max_steps")
    parser.add_argument("--horizon", type=int, default=None, help="steps judged (default: --steps, else the recipe's max_steps)")
    parser.add_argument("--config", dest="extra_configs", action="append", default=[], help="extra config after the arm's (repeatable)")
    parser.add_argument("--out", default=None, help="where the runs go (default runs/lab/NAME)")
    parser.add_argument("--archive", default=None, help="where the evidence goes (default lab/archive/collapse/NAME)")
    parser.add_argument("--hold", type=int, default=None,
                        help="consecutive steps the collapse condition must hold (default: the archive's, else CollapseCriteria's 20)")
    parser.add_argument("--report-only", action="store_true", help="only redo collapse.{json,md,png} from the archive")
    parser.add_argument("--no-figure", action="store_true", help="with --report-only: leave collapse.png as it is")
    parser.add_argument("--force", action="store_true", help="redo runs already archived, deleting their previous output first")
    parser.add_argument("--no-build", action="store_true",
                        help="train the --inits policy directories as they are (no make_policy.py check, which retrains "
                             "when lldslight's settings schema changed); their weight digests are still recorded")
    args, overrides = parser.parse_known_args(argv)
    signal.signal(signal.SIGTERM, _stop_children)  # a scheduler's kill unwinds like Ctrl-C, children too
    if overrides and overrides[0] == "--":
        overrides = overrides[1:]
    name = args.name or ("smoke" if args.smoke else None)
    if name is None and not (args.out and args.archive):
        raise SystemExit("collapse: give --name (or --out and --archive)")
    if args.hold is not None and args.hold < 1:
        # 0 was read as "not given", and the archive's hold reported silently
        raise SystemExit(f"collapse: --hold must be >= 1 (consecutive steps the collapse condition holds), got {args.hold}")
    out = (ROOT / (args.out or f"runs/lab/{name}")).resolve()
    archive = (ROOT / (args.archive or f"{ARCHIVE}/{name}")).resolve()
    previous = archive / "collapse.json"
    recorded = recorded_meta(previous) if args.report_only and previous.is_file() else {}
    # A report labels each arm from its file: a set run from another arms folder records it.
    args.arms_dir = args.arms_dir or recorded.get("arms_dir") or "lab/configs/arms"
    available = arms_in(ROOT / args.arms_dir)
    labels = {k: v[0] for k, v in available.items()}

    if args.report_only:
        # What chooses runs or their settings has no effect on a report of the archive: said, not
        # ignored while the set's committed report is rewritten.
        ignored = [flag for flag, given in (("--arms", args.arms), ("--seeds", args.seeds), ("--inits", args.inits),
                                            ("--config", args.extra_configs), ("--steps", args.steps), ("--force", args.force),
                                            ("--no-build", args.no_build), (" ".join(overrides), overrides)) if given]
        if ignored:
            raise SystemExit(f"collapse: --report-only reports every archived run of {archive} as archived: "
                             f"{', '.join(ignored)} would be ignored; leave {'it' if len(ignored) == 1 else 'them'} out "
                             "(to run other arms or seeds, drop --report-only)")
        meta = recorded
        jobs = set_jobs(archive, meta)
        if not jobs:
            raise SystemExit(f"collapse: no archived run in {archive} (expected {archive}/<arm>/seed<S>/metrics.csv.gz)")
        arms = list(dict.fromkeys(a for a, _ in jobs))
        meta["runs"] = with_run_records(meta.get("runs", {}), archive, jobs)
        # An archive without its collapse.json: the horizon is the recipe's max_steps, as for a new run.
        horizon = args.horizon or meta.get("horizon") or recipe_steps(args.recipe or meta.get("recipe") or (SMOKE_RECIPE if args.smoke else DEFAULT_RECIPE))
        # The hold a set was registered with is kept in its meta: a later --report-only uses it. A set
        # written before holds were recorded keeps its meta as it is (the criteria in the report say
        # the hold), so a rerun writes the committed collapse.json again, byte for byte.
        hold = args.hold or meta.get("hold") or C.CollapseCriteria().hold
        if args.hold and args.hold != (meta.get("hold") or C.CollapseCriteria().hold):
            meta["hold"] = args.hold
        try:
            report(archive, jobs, labels, args.baseline or meta.get("baseline") or arms[0], horizon, meta,
                   C.CollapseCriteria(hold=hold), draw=not args.no_figure)
        except UserError as err:  # a damaged archived file: named, and the committed report left as it is
            raise SystemExit(f"collapse: {err}") from None
        return 0

    recipe = args.recipe or (SMOKE_RECIPE if args.smoke else DEFAULT_RECIPE)
    arms = args.arms or DEFAULT_ARMS
    unknown = [a for a in arms if a not in available]
    if unknown:
        raise SystemExit(f"collapse: unknown arm(s) {', '.join(unknown)}; {args.arms_dir} has {', '.join(available)}")
    seeds = args.seeds if args.seeds is not None else ([0] if args.smoke else [0, 1, 2])
    for path in [recipe] + args.extra_configs:
        if not (ROOT / path).is_file():
            raise SystemExit(f"collapse: config not found: {path} (relative to {ROOT})")
    config = yaml.safe_load((ROOT / recipe).read_text())
    horizon = args.horizon or args.steps or recipe_steps(recipe)
    jobs = [(arm, seed) for seed in seeds for arm in arms]
    # A lab spans sessions: a run already archived (finished earlier) is kept and reported, not redone.
    done = [(a, s) for a, s in jobs if (archive / a / f"seed{s}" / "metrics.csv.gz").is_file() and not args.force]
    if done:
        print(f"collapse: {len(done)} run(s) already archived in {archive}, kept: " + ", ".join(f"{a}/seed{s}" for a, s in done), flush=True)
    todo = [j for j in jobs if j not in done]
    for arm, seed in todo:
        previous_run = out / arm / f"seed{seed}"
        if previous_run.exists():
            if not args.force:
                raise SystemExit(f"collapse: {previous_run} exists; pass --force to redo it or --report-only to reuse the archive")
            shutil.rmtree(previous_run)
    out.mkdir(parents=True, exist_ok=True)
    archive.mkdir(parents=True, exist_ok=True)
    meta = {"invocation": "python lab/collapse.py " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv)),
            "recipe": recipe, "arms_dir": args.arms_dir, "arms": arms, "seeds": seeds, "baseline": args.baseline or arms[0], "horizon": horizon, "jobs": args.jobs,
            "threads": args.threads, "steps": args.steps, "extra_configs": args.extra_configs, "overrides": overrides,
            "machine": machine(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "load_at_start": os.getloadavg()}
    t0 = time.perf_counter()
    if args.smoke:
        from lldslight.data.synth import synthesize

        synthesize(**config["data"]["synthesize"])
        kb = ROOT / config["data"]["synthesize"]["out_dir"]
        warm = out / "warmstart"
        policy = config["model"]["policy"]
        cmd = [sys.executable, "-m", "lldslight.cli", "sft", "--data", str(kb / "train.jsonl"), "--corpus", str(kb / "corpus.jsonl"),
               "--model", policy["model"], "--out", str(warm), "--random-init", json.dumps(policy["random_init"]), *SMOKE_SFT]
        run_child("warm start", cmd, out / "logs" / "warmstart.log")
        policy_of = {s: str(warm) for s in seeds}
        overrides = ["--model.policy.random_init", "null"] + overrides
    else:
        inits = args.inits or [config["model"]["policy"]["model"]]
        if args.no_build:
            missing = [p for p in inits if weights_digest(ROOT / p) is None]
            if missing:
                raise SystemExit(f"collapse: --no-build but no weights in {', '.join(missing)}")
            meta["inits"] = {p: weights_digest(ROOT / p) for p in inits}
        else:
            meta["inits"] = build_policies(recipe, inits, out)
        policy_of = {s: inits[s % len(inits)] for s in seeds}
        meta["init_of_seed"] = {str(s): policy_of[s] for s in seeds}
    commands = {(arm, seed): fit_command(recipe, available[arm][1].relative_to(ROOT), out, arm, seed, policy_of[seed], args.steps,
                                         args.extra_configs, overrides) for arm, seed in todo}
    previous = archive / "collapse.json"
    earlier = recorded_meta(previous).get("runs", {}) if previous.is_file() else {}
    # A set spans sessions and maybe machines: each run keeps the machine kind it ran on (CPU model,
    # SIMD flags, its init's digest), the stratum of a stratified test.
    kind = {k: meta["machine"].get(k) for k in ("cpu_model", "cpu_flags_simd", "cpu_capability", "torch")}
    kinds = {(arm, seed): {**kind, "init": policy_of.get(seed), "init_digest": (meta.get("inits") or {}).get(policy_of.get(seed))}
             for arm, seed in todo}
    new_runs = run_all(commands, out, archive, args.jobs, args.threads, kinds)
    # Every run of the set keeps its entry, those of earlier invocations with other arms or seeds too
    # (a set filled round by round once kept only its last round's machine kinds and CPU times).
    meta["runs"] = {**earlier, **{f"{a}/seed{s}": earlier.get(f"{a}/seed{s}", {}) for a, s in done}, **new_runs}
    reported = set_jobs(archive, meta)
    meta["runs"] = with_run_records(meta["runs"], archive, reported)
    meta["wall_s"] = time.perf_counter() - t0
    meta["hold"] = args.hold or (recorded_meta(previous).get("hold") if previous.is_file() else None) \
        or C.CollapseCriteria().hold
    try:
        # The set's report, not this invocation's: a set filled seed by seed reports every archived run,
        # as --report-only does, so the two write the same collapse.json.
        report(archive, reported, labels, meta["baseline"], horizon, meta, C.CollapseCriteria(hold=meta["hold"]))
    except UserError as err:
        raise SystemExit(f"collapse: {err}") from None
    failed = [n for n, r in meta["runs"].items() if "error" in r]
    if failed:
        print(f"collapse: {len(failed)} run(s) failed: {', '.join(failed)} (see collapse.md)", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(script_main(main))

"""lab/confirmatory.py, C1's registered analysis: the stratified exact test against an independent
enumeration, the registration's own worked figures, the verdict rules, the machine-kind strata,
and the partial / complete report on copies of the committed archive."""
import itertools
import json
import shutil

import pytest
from conftest import ROOT, load_lab

SET = ROOT / "lab" / "archive" / "collapse" / "c1_5e-4"


@pytest.fixture(scope="module")
def conf():
    return load_lab("confirmatory")


def outcome(collapsed: bool, time: float = 500.0, reward: float = 0.1) -> dict:
    return {"time": time if collapsed else 1100.0, "collapsed": collapsed, "final_reward": reward, "drift_kl_k3_median": 0.001}


def arms(grpo: list[bool], llds: list[bool], seeds=range(20, 30)) -> dict:
    return {"grpo": {s: outcome(c) for s, c in zip(seeds, grpo)}, "llds": {s: outcome(c, reward=0.3) for s, c in zip(seeds, llds)}}


def enumerated_p(strata: list[tuple[list[bool], list[bool]]]) -> float:
    """P(summed GRPO collapses >= observed) given every stratum's margins, by listing every way to
    place each stratum's collapses among its runs (all equally likely under the null)."""
    per_stratum = []
    for g, l in strata:
        runs, k = len(g) + len(l), sum(g) + sum(l)
        counts = [sum(1 for i in chosen if i < len(g)) for chosen in itertools.combinations(range(runs), k)]
        per_stratum.append(counts)
    observed = sum(sum(g) for g, _ in strata)
    total = hits = 0
    for combo in itertools.product(*per_stratum):
        total += 1
        hits += sum(combo) >= observed
    return hits / total


def test_registration_worked_figures(conf):
    """CONFIRMATORY.md: 8 of 10 vs 2 of 10 gives p = 0.012; 6 of 10 vs 2 of 10, p = 0.085 (one machine)."""
    kinds = {s: ("cpu", ()) for s in range(20, 30)}
    p8 = conf.primary(arms([True] * 8 + [False] * 2, [True] * 2 + [False] * 8), kinds)
    p6 = conf.primary(arms([True] * 6 + [False] * 4, [True] * 2 + [False] * 8), kinds)
    assert p8["test"] == "Fisher exact" and round(p8["p"], 3) == 0.012 and p8["passes"]
    assert round(p6["p"], 3) == 0.085 and not p6["passes"]


def test_stratified_test_equals_an_enumeration(conf):
    """Seeds 20-23 on one machine kind, 24-29 on another: the exact stratified p equals listing
    every placement of each stratum's collapses."""
    grpo = [True, True, True, True, True, False, True, True, False, True]
    llds = [False, False, True, False, False, False, True, False, False, False]
    kinds = {s: ("avx2", ()) if s < 24 else ("avx512", ()) for s in range(20, 30)}
    got = conf.primary(arms(grpo, llds), kinds)
    assert got["test"] == "exact stratified (machine kind)" and [s["n"] for s in got["strata"]] == [4, 6]
    want = enumerated_p([(grpo[:4], llds[:4]), (grpo[4:], llds[4:])])
    assert got["p"] == pytest.approx(want, rel=1e-9)
    # pooling the strata would be a different (wrong) test here
    assert got["p"] != pytest.approx(enumerated_p([(grpo, llds)]), rel=1e-6)


def test_verdict_words_follow_the_test_and_the_horizon_rule(conf):
    kinds = {s: ("cpu", ()) for s in range(20, 30)}
    early = arms([True] * 9 + [False], [False] * 10)  # GRPO median time 500 <= 550
    assert conf.analyse(early, kinds)["verdict"] == "LLDS prevented the collapse within 1,100 steps"
    late = arms([True] * 9 + [False], [False] * 10)
    for s in late["grpo"]:
        late["grpo"][s]["time"] = 800.0 if late["grpo"][s]["collapsed"] else 1100.0
    rep = conf.analyse(late, kinds)
    assert not rep["horizon_rule_holds"] and rep["verdict"] == "horizon too short: no prevention claimed"
    assert conf.analyse(arms([True] * 5 + [False] * 5, [True] * 4 + [False] * 6), kinds)["verdict"].startswith("not supported")


def test_machine_kind_splits_a_cpu_kind_whose_inits_differ(conf):
    def run(flags, init, digest):
        return {"machine_kind": {"cpu_model": "EPYC", "cpu_flags_simd": flags, "init": init, "init_digest": digest}}

    one = conf.machine_kinds({"grpo/seed20": run(["avx2"], "q0", "a"), "grpo/seed21": run(["avx2"], "q1", "b"),
                              "grpo/seed24": run(["avx512_bf16"], "q0", "c")})
    assert one["grpo/seed20"] == one["grpo/seed21"] != one["grpo/seed24"]
    two = conf.machine_kinds({"grpo/seed20": run(["avx2"], "q0", "a"), "grpo/seed22": run(["avx2"], "q0", "z")})
    assert two["grpo/seed20"] != two["grpo/seed22"]


@pytest.mark.skipif(not (SET / "collapse.json").is_file(), reason="C1's archive is not in this checkout")
def test_report_on_copies_of_the_archive(conf, tmp_path):
    """The committed archive as it stands is partial (no test); a copy completed with renamed copies
    of its own runs gets the full analysis, recomputed from the metrics."""
    part = tmp_path / "part"
    shutil.copytree(SET, part)
    rep = conf.report(part)
    if rep["status"] == "partial":
        assert "primary" not in rep and rep["archived"] + len(rep["missing"]) == 20
    meta = json.loads((part / "collapse.json").read_text())
    have = sorted({int(p.name[4:]) for p in (part / "grpo").glob("seed*") if (part / "llds" / p.name).is_dir()})
    for i, seed in enumerate(range(20, 30)):
        if seed in have:
            continue
        src = have[i % len(have)]
        for arm in ("grpo", "llds"):
            shutil.copytree(part / arm / f"seed{src}", part / arm / f"seed{seed}", dirs_exist_ok=True)
            meta["meta"]["runs"][f"{arm}/seed{seed}"] = meta["meta"]["runs"][f"{arm}/seed{src}"]
    (part / "collapse.json").write_text(json.dumps(meta))
    full = conf.report(part)
    assert full["status"] == "complete" and len(full["runs"]) == 20
    g = [r for r in full["runs"] if r["arm"] == "grpo"]
    assert full["collapsed"]["grpo"] == sum(r["collapsed"] for r in g)
    # the hold-30 outcome of each run matches the runner's own summary at the registered hold
    runner = {(r["arm"], r["seed"]): r for r in json.loads((SET / "collapse.json").read_text())["runs"]}
    for r in full["runs"]:
        if (r["arm"], r["seed"]) in runner and r["seed"] in have:
            assert r["collapsed"] == runner[(r["arm"], r["seed"])]["collapsed_by_horizon"], (r["arm"], r["seed"])
    assert 0 < full["primary"]["p"] <= 1 and "rmst_difference" in full["secondary"]


def c2_outcomes(bound_collapsed_1e3: int = 0, shift: float = 0.0) -> dict:
    seeds = range(20, 25)
    safe = {s: dict(outcome(False, reward=0.3), lr_median=2.5e-4, updates_median=8.0) for s in seeds}
    # bound arms: rewards 0.4..0.8 (differences 0.1..0.5 against the safe rate's 0.3), minus ``shift``
    bound = {s: dict(outcome(False, reward=0.4 + 0.1 * i - shift), lr_median=3e-4, updates_median=3.0) for i, s in enumerate(seeds)}
    bound_1e3 = {s: dict(o, collapsed=i < bound_collapsed_1e3, time=400.0 if i < bound_collapsed_1e3 else 1100.0)
                 for i, (s, o) in enumerate(bound.items())}
    plain = {s: dict(outcome(True, reward=0.0), lr_median=5e-4, updates_median=8.0) for s in seeds}
    return {("bound", "5e-4"): bound, ("bound", "1e-3"): bound_1e3, ("grpo", "5e-4"): plain, ("grpo", "1e-3"): plain,
            ("grpo", "2.5e-4"): safe}


def test_c2_goal_by_hand(conf):
    """Differences 0.1, 0.2, 0.3, 0.4, 0.5: mean 0.3, sd sqrt(0.025) = 0.158114, half-width
    2.776 x 0.158114 / sqrt(5) = 0.196293 (worked by hand)."""
    rep = conf.c2_goal(c2_outcomes())
    d = rep["rates"]["5e-4"]["reward_vs_2.5e-4"]
    assert d["mean_diff"] == pytest.approx(0.3) and d["low"] == pytest.approx(0.103707, abs=1e-6) and d["high"] == pytest.approx(0.496293, abs=1e-6)
    assert rep["goal_met"] and rep["rates"]["1e-3"]["grpo_collapsed"] == 5
    assert rep["rates"]["5e-4"]["fisher_p_grpo_vs_bound"] == pytest.approx(1 / 252)  # 5 of 5 vs 0 of 5: 1 / C(10, 5)
    assert not conf.c2_goal(c2_outcomes(bound_collapsed_1e3=1))["goal_met"]  # one collapse at 1e-3
    assert not conf.c2_goal(c2_outcomes(shift=0.35))["goal_met"]  # mean difference -0.05 < 0


def test_c2_report_is_partial_until_every_arm_is_archived(conf, tmp_path):
    (tmp_path / "c1_5e-4").mkdir()
    rep = conf.c2_report(tmp_path)
    assert rep["status"] == "partial" and len(rep["missing"]) == 25 and "goal_met" not in rep


def test_a_set_without_its_report_is_named(conf, tmp_path):
    with pytest.raises(SystemExit, match=r"confirmatory: .*collapse\.json not found: --set must be a set's archive"):
        conf.main(["--set", str(tmp_path)])
    # --c2 reads the sets beside --set: a folder without any of them is named, and nothing is written there
    with pytest.raises(SystemExit, match=r"confirmatory: no C2 set .* in .*: with --c2, --set must be a set inside the lab's archive"):
        conf.main(["--c2", "--set", str(tmp_path / "missing" / "c1_5e-4")])
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("other, why", [("c2_2.5e-4", "lr 2.5e-4"), ("c2_1e-3", "arm bound"), ("final", "arm onpolicy")])
def test_another_sets_archive_is_not_reported_as_c1(conf, tmp_path, capsys, other, why):
    """Another set's archive was reported as C1 ("0 of 20 runs archived") and a c1.json written into it."""
    src = ROOT / "lab" / "archive" / "collapse" / other
    if not (src / "collapse.json").is_file():
        pytest.skip(f"{other} is not committed")
    shutil.copytree(src, tmp_path / other)
    with pytest.raises(SystemExit, match=rf"confirmatory: {tmp_path / other} is not C1's set \(.*{why}.*\)"):
        conf.main(["--set", str(tmp_path / other)])
    assert not (tmp_path / other / "c1.json").exists() and capsys.readouterr().out == ""


def test_json_into_a_directory_is_refused_before_the_analysis(conf, tmp_path, capsys):
    if not (SET / "collapse.json").is_file():
        pytest.skip("C1's archive is not in this checkout")
    shutil.copytree(SET, tmp_path / "c1_5e-4")
    for target, problem in ((tmp_path, "is a directory"), (tmp_path / "no" / "such" / "c1.json", "no such directory")):
        with pytest.raises(SystemExit, match=rf"confirmatory: --json {target}: {problem}"):
            conf.main(["--set", str(tmp_path / "c1_5e-4"), "--json", str(target)])
        assert capsys.readouterr().out == ""  # nothing analysed first


def test_c2_report_names_each_runs_machine_and_flags_pairs_across_machines(conf, tmp_path):
    """On copies of the committed C2 archives (and C1's, whose GRPO runs are C2's 5e-4 column):
    every archived run carries the machine kind its set recorded; a seed whose bound run and GRPO-at-
    2.5e-4 run ran on different machine kinds is flagged (the goal's pairs stay within a machine, as
    registered); a run with metrics but no record yet (its set still running) counts as missing; each
    run's CPU minutes are its recorded process CPU time."""
    lab = ROOT / "lab" / "archive" / "collapse"
    names = ["c1_5e-4", "c2_1e-3", "c2_5e-4", "c2_2.5e-4"]
    if not all((lab / n / "collapse.json").is_file() for n in names):
        pytest.skip("C2's first archives are not committed")
    for n in names:
        shutil.copytree(lab / n, tmp_path / n)
    rep = conf.c2_report(tmp_path)
    recorded = {n: json.loads((lab / n / "collapse.json").read_text())["meta"]["runs"] for n in names}
    for r in rep["runs"]:
        name, arm = conf.C2_SETS[(r["arm"], r["rate"])]
        k = recorded[name][f"{arm}/seed{r['seed']}"]["machine_kind"]
        assert r["machine_kind"][:2] == [k["cpu_model"], str(tuple(k["cpu_flags_simd"]))], r
        assert r["cpu_min"] * 60 == pytest.approx(recorded[name][f"{arm}/seed{r['seed']}"]["cpu_s"]), r  # CPU time per run, as registered
    assert rep["goal_pairs_across_machines"] == []
    seed = min(r["seed"] for r in rep["runs"] if r["arm"] == "bound")
    meta = json.loads((tmp_path / "c2_2.5e-4" / "collapse.json").read_text())
    meta["meta"]["runs"][f"grpo/seed{seed}"]["machine_kind"]["cpu_flags_simd"] = ["avx", "avx2"]
    (tmp_path / "c2_2.5e-4" / "collapse.json").write_text(json.dumps(meta))
    assert conf.c2_report(tmp_path)["goal_pairs_across_machines"] == [seed]
    assert f"Not as registered: seeds [{seed}] ran the bound arm and GRPO at 2.5e-4 on different machine kinds" in conf.c2_text(conf.c2_report(tmp_path))
    del meta["meta"]["runs"][f"grpo/seed{seed}"]
    (tmp_path / "c2_2.5e-4" / "collapse.json").write_text(json.dumps(meta))
    rep = conf.c2_report(tmp_path)
    assert f"c2_2.5e-4/grpo/seed{seed} (set unfinished)" in rep["missing"] and not any(r["rate"] == "2.5e-4" and r["seed"] == seed for r in rep["runs"])


def test_kind_label(conf):
    assert conf.kind_label(["AMD EPYC", "('avx', 'avx2', 'avx512_bf16', 'fma')"]) == "AMD EPYC, avx512_bf16"
    assert conf.kind_label(["AMD EPYC", "('avx', 'avx2', 'fma')"]) == "AMD EPYC, avx2 only"
    assert conf.kind_label(["Some CPU", "('neon',)"]) == "Some CPU, ('neon',)"


def test_c2_figure_draws_each_runs_metrics(conf, tmp_path):
    """The C2 figure draws, per bound run, the trailing-20 median of the rate it trained at, read
    here again with the csv module and a median written out; every archived run gets a reward line."""
    import csv
    import gzip
    import statistics

    lab = ROOT / "lab" / "archive" / "collapse"
    run = lab / "c2_1e-3" / "bound" / "seed20"
    if not (run / "metrics.csv.gz").is_file():
        pytest.skip("C2's first archives are not committed")
    drawn = conf.c2_figure(lab, tmp_path / "c2.png")
    assert (tmp_path / "c2.png").stat().st_size > 10_000
    with gzip.open(run / "metrics.csv.gz", "rt") as f:
        lr: dict[int, float] = {}
        for r in csv.DictReader(f):
            if r.get("step") and r.get("train/lr") and int(float(r["step"])) < conf.HORIZON:
                lr.setdefault(int(float(r["step"])), float(r["train/lr"]))
    values = [lr[s] for s in sorted(lr)]
    expected = [statistics.median(values[max(0, i - 19): i + 1]) for i in range(len(values))]
    assert drawn["lr"]["bound 1e-3 seed20"] == pytest.approx(expected)
    archived = sum(any((lab / name / arm / f"seed{s}").glob("metrics.csv*")) for name, arm in conf.C2_SETS.values() for s in conf.C2_SEEDS)
    assert len(drawn["reward"]) == archived and set(drawn["lr"]) == set(drawn["updates"])
    assert all(k.startswith("bound ") for k in drawn["lr"])

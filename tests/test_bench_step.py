"""The measuring pieces of benchmarks/step.py and friends: per-phase memory against a known
allocation, the step's work from row lengths, the profile's grouping on a real torch.profiler
trace, and host_overhead.py end to end on its 1-layer model."""
import json

import numpy as np
import pytest
import torch
from conftest import load_benchmark


@pytest.fixture(scope="module")
def step():
    return load_benchmark("step")


def test_phase_memory_sees_a_known_allocation_above_idle(step):
    import gc
    import mmap

    from lldslight.run import hostmem

    # Earlier tests' garbage freed during the measurement would lower the RSS under the idle
    # figure taken at begin() (in one full-suite run the 200 MiB read as 144): settle it first.
    gc.collect()
    hostmem.trim()
    mem = step.PhaseMemory()
    mem.begin()
    if mem.idle_mb != mem.idle_mb:  # NaN: no /proc/self/clear_refs here
        pytest.skip("VmHWM cannot be reset on this kernel")
    # 200 MiB of fresh pages, touched (an anonymous mmap: malloc cannot hand back pages already resident)
    block = mmap.mmap(-1, 200 * 2**20)
    np.frombuffer(block, dtype=np.uint8)[::4096] = 1
    block.close()
    mem.phase("big")
    mem.phase("small")  # nothing allocated since the last phase's end
    assert 195 <= mem.peaks["big"] <= 260
    assert mem.peaks["small"] < 50
    # The reset also clears getrusage's peak, so the process peak is kept across phases.
    assert mem.peak_mb >= mem.idle_mb + 195


def test_work_of_rows(step):
    w = step.work_of([10, 12], [5, 8])
    assert w == {"rows": 2, "tokens": 13, "decode_steps": 8, "context": 11 + 4, "lengths": [15, 20], "loss_tokens": 13}


def test_profile_groups_a_real_trace():
    prof_mod = load_benchmark("profiling")
    from lldslight.policy import LoRAConfig, PolicyConfig, load_policy

    model, _ = load_policy(PolicyConfig(precision="fp32", random_init={"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,
                                                                      "num_attention_heads": 2, "num_key_value_heads": 1},
                                        lora=LoRAConfig(r=2, alpha=4), gradient_checkpointing=False))
    lm = model.get_base_model()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, 1000, (2, 6))
    prof = prof_mod.StepProfiler(model)
    with prof.window():
        with prof_mod.label("rollout"), torch.no_grad():
            out = lm.model(input_ids=ids, use_cache=True)  # prefill
            logits = lm.lm_head(out.last_hidden_state[:, -1])
            tok = torch.multinomial(torch.softmax(logits, -1), 1)
            lm.model(input_ids=tok, past_key_values=out.past_key_values, use_cache=True)  # one decode step
        with prof_mod.label("update"):
            hidden = lm.model(input_ids=ids).last_hidden_state
            loss = torch.log_softmax(lm.lm_head(hidden), -1).mean()
            with prof_mod.label("backward"):
                loss.backward()
            opt.step()
    shares = prof.shares()
    groups = shares["groups"]
    for g in ("generation: prefill", "generation: decode matmuls", "generation: vocab projection", "generation: sampling",
              "update: log-prob forward (decoder)", "update: vocab projection", "update: vocab log-softmax/entropy",
              "update: backward (with recompute)", "update: optimiser"):
        assert g in groups and groups[g]["s"] > 0, g
    assert sum(v["share"] for v in groups.values()) == pytest.approx(1.0)
    # Hooks are gone after the window: a later forward is not labelled (no error, no region left open).
    lm.model(input_ids=ids)


def test_profile_grouping_rules():
    prof_mod = load_benchmark("profiling")
    g = prof_mod.group
    assert g(("step", "rollout", "decoder: 1 token"), "matmul") == "generation: decode matmuls"
    assert g(("step", "rollout", "decoder: 1 token"), "host") == "generation: decode host (module Python)"
    assert g(("step", "rollout"), "softmax") == "generation: sampling"
    assert g(("step", "rollout"), "other ops") == "generation: host bookkeeping"
    # TRL nests generation inside its scoring inside its training_step: generation wins.
    assert g(("step", "update", "log-probs", "rollout", "decoder: prefill"), "matmul") == "generation: prefill"
    assert g(("step", "update", "backward", "vocab projection"), "matmul") == "update: backward (with recompute)"
    assert g(("step",), "host") == "other (Lightning loop, callbacks)"


def test_host_overhead_runs_end_to_end(tmp_path):
    bench = load_benchmark("host_overhead")
    out = tmp_path / "h.json"
    report = bench.main(["--rounds", "1", "--new-tokens", "4", "--prompts", "1", "--group-size", "2", "--no-repeat", "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["sides"]["generate"]["steps"]["median"] == 4  # forced to the token count
    assert 1 <= saved["sides"]["engine"]["steps"]["median"] <= 4
    assert saved["sides"]["engine"]["tokens"]["median"] <= 2 * 4
    for a in saved["attempts"]:
        assert a["load"]["wall_s"] > 0 and a["metrics"]["ms_per_step"] > 0
    assert report["ratio"]["ratio_of_medians"] == pytest.approx(
        saved["sides"]["engine"]["ms_per_step"]["median"] / saved["sides"]["generate"]["ms_per_step"]["median"])


def test_closing_note_against_the_targets(step):
    """The note says how far each ratio is from 0.5x and each decode step from the physical limit."""
    quiet = {"quiet": True}
    report = {"precisions": {
        "fp32": {"threads": {"1": {"step_time_ratio": 0.8, "quiet": quiet,
                                   "fractions": {"lldslight": {"generation_fraction_of_bound": 0.12, "generation_fraction_of_blas": 0.9,
                                                               "update_fraction_of_ceiling": 0.3}}}}},
        "bf16": {"threads": {"1": {"step_time_ratio": 0.45, "step_time_ratio_auto": 0.4, "quiet": quiet,
                                   "fractions": {"lldslight": {"generation_fraction_of_bound": 0.41, "generation_fraction_of_blas": 0.95,
                                                               "update_fraction_of_ceiling": 0.5}}}}},
    }}
    fp32, bf16, last = step.closing_note(report)
    assert fp32.startswith("fp32, 1 thread(s): step ratio 0.800 = 1.60x the 0.5x target (missed);")
    assert "decode step at 12% of the physical limit, 90% of its matmuls alone" in fp32 and "target" not in fp32.split(";")[-1]
    assert "step ratio 0.450 = 0.90x the 0.5x target (met); step ratio (auto) 0.400 = 0.80x" in bf16
    assert "decode step at 41% of the physical limit (target 40%: met)" in bf16
    assert last == "quiet machine: every run"


def test_closing_note_reports_the_shared_prefix_on_and_off(step):
    """With --shared-prefix both: the unshared run's ratio to TRL and the on / off step ratio."""
    res = {"step_time_ratio": 0.6, "step_time_ratio_unshared": 0.8, "shared_prefix_ratio": 0.75, "quiet": {"quiet": True}}
    note = step.closing_note({"precisions": {"fp32": {"threads": {"2": res}}}})[0]
    assert "step ratio 0.600 = 1.20x the 0.5x target (missed); step ratio (shared prefix off) 0.800 = 1.60x" in note
    assert note.endswith("shared prefix on / off: step 0.750;")
    assert step.RATIO_SUFFIX.keys() == set(step.LLDSLIGHT_SIDES) and "lldslight-unshared" in step.SIDES


def test_shared_prefix_both_runs_the_unshared_side_and_reports_on_off(step, tmp_path, monkeypatch):
    """main() with --shared-prefix both (the default), workers faked: each lldslight run gets its
    shared_prefix setting, and the report holds the unshared run's ratio to TRL and the on / off
    ratios (here 3 s / 4 s per step, by construction)."""
    step_s = {"lldslight": 3.0, "lldslight-unshared": 4.0, "trl": 5.0}
    seen = {}

    def fake_worker(side, python, spec, timeout):
        seen[side] = spec.get("shared_prefix", True) and side != "lldslight-unshared"
        load = {"wall_s": 1.0, "other_cpu_s": 0.0, "own_cpu_s": 1.0, "steal_s": 0.0, "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]}
        figures = {k: 1.0 for k in step.PER_STEP + step.PEAKS}
        figures.update(step_s=step_s[side], rows=2, load=load, lengths=[10, 10], loss_tokens=8)
        return {"steps": [figures], "peak_rss_mb": 1.0, "wall_s": 1.0}

    monkeypatch.setattr(step, "run_worker", fake_worker)
    monkeypatch.setattr(step, "ensure_trl_venv", lambda python: "python")
    out = tmp_path / "step.json"
    step.main(["--rounds", "1", "--threads", "1", "--precision", "fp32", "--no-bounds", "--lldslight-checkpointing", "on",
               "--json", str(out)])
    assert seen == {"lldslight": True, "lldslight-unshared": False, "trl": True}
    res = json.loads(out.read_text())["precisions"]["fp32"]["threads"]["1"]
    assert res["step_time_ratio"] == pytest.approx(0.6) and res["step_time_ratio_unshared"] == pytest.approx(0.8)
    assert res["shared_prefix_ratio"] == pytest.approx(0.75)
    assert set(res["shared_prefix_ratios"]) == set(step.SHARED_PREFIX_KEYS)


def test_precisions_map_to_each_sides_setting(step):
    assert step.LLDSLIGHT_PRECISION == {"fp32": "fp32", "bf16": "bf16-mixed"}
    with pytest.raises(SystemExit, match="--precision must be"):
        step.main(["--precision", "fp16", "--only", "lldslight"])


def test_profiled_phases_are_on_the_libraries_code_path(step):
    """--profile labels functions the library has, on the path a training step takes (a renamed
    phase fails here instead of dropping out of the profile: GRPOModule.prepare_rollout did)."""
    import inspect

    from lldslight.update import train as update

    labels = load_benchmark("profiling").LABELS
    for module_name, path, name in step.LLDSLIGHT_LABELS:
        owner, attr = step.profiled_target(module_name, path)
        assert callable(getattr(owner, attr)) and name in labels
    # update.prepare is labelled by replacing the module's attribute: train_on_rollout calls it by that name.
    assert "prepare(module, traj" in inspect.getsource(update.train_on_rollout)
    with pytest.raises(AttributeError, match="update LLDSLIGHT_LABELS"):
        step.profiled_target("lldslight.module", "GRPOModule.prepare_rollout")


@pytest.mark.parametrize("shared", [True, False])
def test_lldslight_side_builds_the_module_it_says(step, shared):
    """The lldslight worker's arguments are GRPOModule's own (a renamed or regrouped key fails here,
    not an hour into a benchmark) and carry the spec: the shared prefix on / off, micro-batches, KL,
    precision."""
    from lldslight.module import GRPOModule

    spec = {"model_dir": "unused-until-setup", "precision": "bf16", "lora_r": 4, "micro_batch": 3, "beta": 0.0,
            "shared_prefix": shared, "micro_batch_tokens": 0, "logprob_chunk_size": 512}
    module = GRPOModule(**step.module_groups(spec))
    u = module.update_config
    assert (u.shared_prefix, u.micro_batch_size, u.micro_batch_tokens, u.kl_coef, u.updates_per_rollout) == (shared, 3, None, 0.0, 1)
    assert module.hparams["policy"].precision == "bf16-mixed" and module.hparams["policy"].lora.r == 4
    assert module.optim_config.lr == 1e-5 and module.hparams["logprob_chunk_size"] == 512


def test_machine_records_the_cpus_simd_flags(step):
    """Every figure carries the CPU it was measured on: the model and the SIMD flags, read here
    from /proc/cpuinfo by hand."""
    from pathlib import Path

    m = step.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines()
    flags = set(next(l for l in lines if l.startswith("flags")).split(":", 1)[1].split())
    assert m["cpu_flags_simd"] == sorted(f for f in flags if f.startswith(("avx", "amx", "fma", "sse4")))
    assert m["cpu_model"] == next(l for l in lines if l.startswith("model name")).split(":", 1)[1].strip()
    assert m["cpu_capability"] and m["cpu_bf16"]


def _doc() -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "docs" / "lab" / "speed.md").read_text()


def _committed_medians(name: str, precision: str, simd: str, lab: bool = False, lacks: str | None = None):
    """(threads, kept attempts, med) per thread count of a committed step.py JSON in benchmarks/results/
    (``lab``: its lab workload), made on a CPU whose recorded SIMD flags include ``simd`` (and not
    ``lacks``) and on a quiet machine; med(side, key) is statistics.median over the kept attempts, computed here, not the
    harness's summaries."""
    import statistics
    from pathlib import Path

    data = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / name).read_text())
    assert simd in data["machine"]["cpu_flags_simd"] and lacks not in data["machine"]["cpu_flags_simd"]
    for threads, res in (data["lab"] if lab else data)["precisions"][precision]["threads"].items():
        assert res["quiet"]["quiet"]
        kept = [a for a in res["attempts"] if a["kept"]]
        yield threads, kept, lambda side, key, kept=kept: statistics.median(a["metrics"][key] for a in kept if a["side"] == side)


def _committed_bf16_medians(name: str):
    """(threads, med) per thread count of a committed bf16 step.py JSON (AVX512-BF16 recorded)."""
    for threads, _, med in _committed_medians(name, "bf16", "avx512_bf16"):
        yield threads, med


def test_speed_doc_quotes_the_committed_bf16_json():
    """docs/lab/speed.md's 2026-12-04 tables, recomputed by hand from benchmarks/results/step_epyc_bf16.json's kept
    attempts (statistics.median per side, not the harness's summaries): the step per side, the
    ratios, and the split of the time saved."""
    doc = _doc()
    for threads, med in _committed_bf16_medians("step_epyc_bf16.json"):
        step = {s: med(s, "step_s") for s in ("lldslight", "lldslight-auto", "lldslight-unshared", "trl")}
        gen = {s: med(s, "generation_s") for s in ("lldslight", "trl")}
        upd = {s: med(s, "update_s") for s in ("lldslight", "lldslight-unshared", "trl")}
        row = (f"| {threads} | {step['lldslight']:.2f} / {step['lldslight-auto']:.2f} / {step['lldslight-unshared']:.2f} / {step['trl']:.2f} "
               f"| **{step['lldslight'] / step['trl']:.2f}** ({step['lldslight-auto'] / step['trl']:.2f}; {step['lldslight-unshared'] / step['trl']:.2f}) "
               f"| {gen['lldslight']:.2f} / {gen['trl']:.2f} | {upd['lldslight']:.2f} / {upd['lldslight-unshared']:.2f} / {upd['trl']:.2f} "
               f"| {step['lldslight'] / step['lldslight-unshared']:.2f}, {upd['lldslight'] / upd['lldslight-unshared']:.2f} |")
        assert row in doc, row
        saved = step["trl"] - step["lldslight"]
        parts = (gen["trl"] - gen["lldslight"], upd["lldslight-unshared"] - upd["lldslight"], upd["trl"] - upd["lldslight-unshared"])
        split = f"| {threads} | {saved:.2f} s | " + " | ".join(f"{p:.2f} s ({100 * p / saved:.0f}%)" for p in parts) + " |"
        assert split in doc, split


def test_report_names_no_home_folder(step):
    from pathlib import Path

    spec = {"model_dir": str(Path.home() / ".cache" / "lldslight" / "models" / "m"), "prompts": ["x"], "lora_r": 16}
    assert step.recorded(spec) == {"model_dir": "~/.cache/lldslight/models/m", "lora_r": 16}
    assert step.recorded({"model_dir": "/elsewhere/m"})["model_dir"] == "/elsewhere/m"
    # the lab's warm start and corpus live in the repository: recorded relative to it, with the prompts' ids
    lab = {"workload": "lab", "model_dir": str(step.ROOT / ".lldslight" / "w"), "prompts": [{"id": "q1"}, {"id": "q2"}],
           "retriever": {"class": "B", "corpus": str(step.ROOT / ".lldslight" / "c.jsonl"), "settings": {}}}
    assert step.recorded(lab) == {"workload": "lab", "model_dir": ".lldslight/w", "prompt_ids": ["q1", "q2"],
                                  "retriever": {"class": "B", "corpus": ".lldslight/c.jsonl", "settings": {}}}


def test_committed_lean_step_figures_recomputed_and_quoted():
    """docs/lab/speed.md's 2026-12-05 table, recomputed by hand from benchmarks/results/step_epyc_bf16_lean.json's
    kept attempts (statistics.median per side): step, ratio, generation and update per side."""
    doc = _doc()
    for threads, med in _committed_bf16_medians("step_epyc_bf16_lean.json"):
        step, gen, upd = ({s: med(s, key) for s in ("lldslight", "trl")} for key in ("step_s", "generation_s", "update_s"))
        row = (f"| {threads} | {step['lldslight']:.2f} / {step['trl']:.2f} | **{step['lldslight'] / step['trl']:.2f}** "
               f"| {gen['lldslight']:.2f} / {gen['trl']:.2f} | {upd['lldslight']:.2f} / {upd['trl']:.2f} |")
        assert row in doc, row


# -- the real-model lab's workload (--workload lab; benchmarks/step_lab.py) ------------------------------------------


def _trl_counts(kw: dict) -> dict:
    """TRL 1.16's own counting (GRPOConfig's docs, GRPOTrainer._prepare_inputs): a generation batch is
    per_device_train_batch_size x steps_per_generation rows, generated once and reused for
    steps_per_generation x num_iterations micro-steps; an optimiser step accumulates
    gradient_accumulation_steps micro-batches."""
    micro_steps = kw["steps_per_generation"] * kw["num_iterations"]
    return {"rows": kw["per_device_train_batch_size"] * kw["steps_per_generation"],
            "optimiser_steps": micro_steps // kw["gradient_accumulation_steps"],
            "rows_per_step": kw["per_device_train_batch_size"] * kw["gradient_accumulation_steps"],
            "passes_per_row": kw["num_iterations"]}


@pytest.mark.parametrize("rows,micro,updates", [(16, 4, 4), (8, 4, 1), (16, 2, 4), (16, 4, 2)])
def test_trl_trains_every_row_once_in_k_updates(step, rows, micro, updates):
    """lldslight's updates_per_rollout k: k optimiser steps per rollout batch, each on its own rows / k
    rows, every row once. TRL's settings must count the same (num_iterations = k would train every
    row k times: k passes over the whole batch)."""
    counts = _trl_counts(step.trl_batch_kwargs(rows, micro, updates))
    assert counts == {"rows": rows, "optimiser_steps": updates, "rows_per_step": rows // updates, "passes_per_row": 1}
    with pytest.raises(SystemExit, match="multiple of the micro-batch"):
        step.trl_batch_kwargs(16, 4, 3)


def test_lab_trl_side_gets_the_recipes_layers_and_updates(step):
    """From the lab's recipe as lldslight's CLI builds it: TRL's LoRA adapts the layers the recipe
    names (read here from the YAML), and its batch settings make the recipe's updates per rollout
    batch out of its 4 prompts x G rollouts."""
    import yaml

    lab = load_benchmark("step_lab")
    raw = yaml.safe_load((lab.ROOT / lab.lab_step.RECIPE).read_text())
    cli = lab.build_cli(True, "bf16", 0)
    spec = lab.settings(cli)
    spec["lora"]["linear_modules"] = ["q_proj", "v_proj"]  # spec() reads them from the warm start (test below)
    lora = lab.trl_lora_kwargs(spec)
    assert lora["layers_to_transform"] == raw["model"]["policy"]["lora"]["layers_to_transform"] == list(range(22, 30))
    assert (lora["r"], lora["lora_alpha"], lora["target_modules"]) == (16, 32, ["q_proj", "v_proj"])
    assert raw["model"]["policy"]["lora"].get("target_modules", "all-linear") == "all-linear"
    rollout = raw["trainer"]["callbacks"][0]["init_args"]["rollout"]
    rows = raw["data"]["batch_size"] * rollout["group_size"]
    counts = _trl_counts(step.trl_batch_kwargs(rows, spec["micro_batch"], spec["updates"]))
    assert counts["optimiser_steps"] == raw["model"]["update"]["updates_per_rollout"] == 4 and counts["rows"] == 16 == rows
    assert spec["rollout"]["max_turns"] == rollout["max_turns"] and spec["rollout"]["topk"] == rollout["topk"]
    assert spec["reward"]["class"] == "lldslight.rewards.ExactMatchReward"  # the recipe's reward: none given, exact match


def test_linear_names_spell_out_all_linear_as_the_policy_does():
    """peft refuses "all-linear" with layers_to_transform: TRL's side gets the names, which must be
    those of the adapter lldslight builds for the same config (its LoRA modules, read from a real
    policy here) and, for SmolLM2 (Llama), the 7 projections."""
    from lldslight.policy import LoRAConfig, PolicyConfig, load_policy, resolve_model_dir

    lab = load_benchmark("step_lab")
    model_dir = str(resolve_model_dir(PolicyConfig(model="smollm2-135m-instruct"), weights=False))
    names = lab.linear_names(model_dir)
    assert names == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    from conftest import TINY_DIMS

    model, _ = load_policy(PolicyConfig(model="smollm2-135m-instruct", precision="fp32", random_init=dict(TINY_DIMS, num_hidden_layers=3),
                                        lora=LoRAConfig(r=2, alpha=4, layers_to_transform=[2]), gradient_checkpointing=False))
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A") and ".layers.2." in n}
    assert adapted == set(names)


def test_workload_and_lab_rollout_arguments(step):
    assert step.lab_rollout_overrides(["greedy=true", "top_k=5"]) == {"greedy": True, "top_k": 5}
    with pytest.raises(SystemExit, match="expected KEY=VALUE"):
        step.lab_rollout_overrides(["greedy"])
    with pytest.raises(SystemExit, match="--lab-rollout no_such_setting: not a rollout setting"):
        step.lab_rollout_overrides(["no_such_setting=1"])
    with pytest.raises(SystemExit) as exit_:
        step.main(["--workload", "multi"])
    assert exit_.value.code == 2  # argparse's refusal of a value outside the choices
    with pytest.raises(SystemExit, match=r"the lab workload runs lldslight, lldslight-today, trl \(and lldslight-vllm\)"):
        step.main(["--workload", "lab", "--only", "lldslight-auto"])


def _fake_worker(step, step_s: dict, seen: list):
    def fake(side, python, spec, timeout):
        seen.append((spec.get("workload"), side))
        load = {"wall_s": 1.0, "other_cpu_s": 0.0, "own_cpu_s": 1.0, "steal_s": 0.0, "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]}
        figures = {k: 1.0 for k in step.PER_STEP + step.PEAKS}
        if spec.get("workload") == "lab":
            figures.update(searches=12, obs_tokens=900, retrieval_s=0.01)
        figures.update(step_s=step_s[(spec.get("workload"), side)], rows=16, load=load, lengths=[10] * 16, loss_tokens=8)
        return {"steps": [figures], "peak_rss_mb": 1.0, "wall_s": 1.0, "trainable_params": 1}
    return fake


def test_both_workloads_report_ratios_against_trl_and_today(step, tmp_path, monkeypatch):
    """--workload both, workers faked (3 s shipped, 6 s today, 8 s TRL on the lab; 2 s / 4 s on the
    single workload): the single workload's figures stay where they were, the lab's go under "lab"
    with its ratio to TRL and to today's lldslight, and the closing note says both against 0.5x."""
    step_s = {("single", "lldslight"): 2.0, ("single", "trl"): 4.0,
              ("lab", "lldslight"): 3.0, ("lab", "lldslight-today"): 6.0, ("lab", "trl"): 8.0}
    seen: list = []
    lab_spec = {"recipe": "r.yaml", "prompts": [{"id": str(i)} for i in range(4)], "group_size": 4, "updates": 4, "micro_batch": 4, "model_dir": "m",
                "rollout": {"max_turns": 1, "max_new_tokens": 40, "topk": 2, "max_response_tokens": 220},
                "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear", "layers_to_transform": [22, 29],
                         "linear_modules": ["q_proj"]}}
    monkeypatch.setattr(step, "run_worker", _fake_worker(step, step_s, seen))
    monkeypatch.setattr(step, "ensure_trl_venv", lambda python: "python")
    monkeypatch.setattr(step, "lab_spec", lambda args, precision, rollout: dict(lab_spec, workload="lab"))
    out = tmp_path / "step.json"
    step.main(["--workload", "both", "--rounds", "1", "--threads", "1", "--precision", "bf16", "--no-bounds",
               "--lldslight-checkpointing", "on", "--shared-prefix", "on", "--json", str(out)])
    assert seen == [("single", "lldslight"), ("single", "trl"), ("lab", "lldslight"), ("lab", "lldslight-today"), ("lab", "trl")]
    report = json.loads(out.read_text())
    assert report["precisions"]["bf16"]["threads"]["1"]["step_time_ratio"] == pytest.approx(0.5)
    lab = report["lab"]["precisions"]["bf16"]["threads"]["1"]
    assert lab["step_time_ratio"] == pytest.approx(3 / 8) and lab["today_ratio"] == pytest.approx(3 / 6)
    assert lab["step_time_ratio_today"] == pytest.approx(6 / 8)
    assert lab["sides"]["trl"]["searches"]["median"] == 12 and set(lab["today_ratios"]) == set(step.TODAY_KEYS)
    assert report["lab"]["trl"]["batch"]["num_iterations"] == 1 and report["lab"]["what_differs"]
    assert "cpu_flags_simd" in report["machine"]
    note = report["closing_note"]
    assert note[0].startswith("bf16, 1 thread(s): step ratio 0.500 = 1.00x the 0.5x target (met);")
    assert note[1] == ("lab, bf16, 1 thread(s): step ratio vs TRL 0.375 = 0.75x the 0.5x target (met); step ratio vs today's "
                       "lldslight 0.500 = 1.00x the 0.5x target (met); today's lldslight vs TRL 0.750;")


class _ScriptedRollout:
    """SearchR1Rollout with its decoder replaced by scripted turns (one list of texts per turn)."""

    @staticmethod
    def make(lab, spec, tokenizer, script):
        calls = []

        class Scripted(lab.SearchR1Rollout):
            def decode_turn(self, trainer, rows, budget):
                turn = script[len(calls)]
                calls.append((rows, budget))
                return [tokenizer(turn[i], add_special_tokens=False)["input_ids"] for i in range(len(rows))]

        return Scripted(spec, tokenizer), calls


def test_trl_search_loop_plays_the_protocol(synth_kb, bm25):
    """TRL's rollout_func on scripted turns: a search gets the retrieved passages and a second turn,
    an answer ends the rollout, anything else gets the invalid-action message and a second turn;
    passages and messages are masked out of the loss; the reward sees the model's actions only."""
    from lldslight.policy import PolicyConfig, load_tokenizer
    from lldslight.rollout.protocol import INVALID_ACTION, format_observation, observation_ids, prompt_token_ids

    lab = load_benchmark("step_lab")
    tok = load_tokenizer(PolicyConfig(model="smollm2-135m-instruct"))
    spec = {"rollout": {"max_turns": 1, "max_new_tokens": 40, "max_obs_tokens": 120, "max_response_tokens": 220, "topk": 2},
            "retriever": {"class": "lldslight.retrieval.bm25.BM25Retriever", "corpus": str(synth_kb["corpus"]), "settings": bm25.index_settings()},
            "reward": {"class": "lldslight.rewards.ExactMatchReward", "kwargs": {}}}
    from pathlib import Path

    entity = json.loads(Path(synth_kb["corpus"]).read_text().splitlines()[0])["contents"].split("\n")[0]  # a title BM25 finds
    turn1 = [f"<search> {entity} </search>", "<answer> Rome </answer>", "I think so."]
    turn2 = ["<answer> Paris </answer>", "<answer> Oslo </answer>"]  # for the rows still going: 0 and 2
    rollout, calls = _ScriptedRollout.make(lab, spec, tok, [turn1, turn2])
    prompts = [[{"role": "user", "content": f"question {i}"}] for i in range(3)]
    out = rollout(prompts, trainer=None)

    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    passages = observation_ids(tok, format_observation(bm25.search([entity], 2)[0]), 120)
    invalid = observation_ids(tok, INVALID_ACTION, 120)
    assert out["prompt_ids"] == [prompt_token_ids(tok, p) for p in prompts]
    assert out["completion_ids"][0] == ids(turn1[0]) + passages + ids(turn2[0])
    assert out["completion_ids"][1] == ids(turn1[1])
    assert out["completion_ids"][2] == ids(turn1[2]) + invalid + ids(turn2[1])
    assert out["env_mask"][0] == [1] * len(ids(turn1[0])) + [0] * len(passages) + [1] * len(ids(turn2[0]))
    assert out["env_mask"][2] == [1] * len(ids(turn1[2])) + [0] * len(invalid) + [1] * len(ids(turn2[1]))
    # the second turn continues the rows that did not answer, from prompt + first turn + observation
    assert calls[1][0] == [out["prompt_ids"][0] + ids(turn1[0]) + passages, out["prompt_ids"][2] + ids(turn1[2]) + invalid]
    assert calls[0][1] == calls[1][1] == 40
    assert rollout.stats["searches"] == 1 and rollout.stats["obs_tokens"] == len(passages) + len(invalid)
    reward = lab.trl_reward(spec)
    got = reward(None, out["actions"], [["Paris"], ["Rome"], ["Paris"]], ["q"] * 3, ["d"] * 3)
    assert got == [1.0, 1.0, 0.0]  # row 2 answered Oslo; the invalid-action message's own <answer> tags are not the model's


def test_turn_end_cuts_after_the_stop_tag_or_eos(synth_kb, bm25):
    from lldslight.policy import PolicyConfig, load_tokenizer

    lab = load_benchmark("step_lab")
    tok = load_tokenizer(PolicyConfig(model="smollm2-135m-instruct"))
    spec = {"rollout": {}, "retriever": {"class": "lldslight.retrieval.bm25.BM25Retriever", "corpus": str(synth_kb["corpus"]),
                                         "settings": bm25.index_settings()}}
    rollout = lab.SearchR1Rollout(spec, tok)
    ids = tok("<search> the river </search> and then more words", add_special_tokens=False)["input_ids"]
    cut = rollout.turn_end(ids)
    assert tok.decode(ids[:cut]).rstrip().endswith("</search>") and "</search>" not in tok.decode(ids[: cut - 1])
    assert rollout.turn_end(ids[:3] + [tok.eos_token_id] + ids[3:]) == 4
    plain = tok("no tags at all here", add_special_tokens=False)["input_ids"]
    assert rollout.turn_end(plain) == len(plain)




def _kept(name: str, lab: bool = False):
    """(kept attempts, med) of a committed fp32, 2-thread step.py JSON made on the AVX2-only EPYC."""
    runs = {threads: (kept, med) for threads, kept, med in _committed_medians(name, "fp32", "avx2", lab, lacks="avx512_bf16")}
    return runs["2"]


def _backends_doc() -> str:
    from pathlib import Path

    return (Path(__file__).resolve().parents[1] / "docs" / "generation_backends.md").read_text()


def _assert_table(doc: str, med, sides=("lldslight", "lldslight-vllm", "trl")) -> None:
    for label, key, fmt in (("step (s)", "step_s", ".2f"), ("generation (s)", "generation_s", ".2f"),
                            ("generation tokens/s", "gen_tokens_per_s", ".1f")):
        row = f"| {label} | " + " | ".join(format(med(s, key), fmt) for s in sides) + " |"
        assert row in doc, row


def test_generation_backends_doc_quotes_the_server_figures_at_the_demos_batch():
    """The demo's batch with vLLM serving the adapter (step_vllm_epyc_avx2.json): table, push, ratios."""
    doc = _backends_doc()
    _, med = _kept("step_vllm_epyc_avx2.json")
    _assert_table(doc, med)
    row = f"| adapter push per step (s) | | {med('lldslight-vllm', 'sync_s'):.3f} | |"
    assert row in doc, row
    r = {k: med("lldslight-vllm", k) / med("lldslight", k) for k in ("step_s", "generation_s", "gen_tokens_per_s")}
    quoted = (f"step took {r['step_s']:.2f}x the engine's (generation {r['generation_s']:.2f}x, tokens/s "
              f"{r['gen_tokens_per_s']:.2f}x) and\n{med('lldslight-vllm', 'step_s') / med('trl', 'step_s'):.2f}x TRL's")
    assert quoted in doc, quoted


def test_generation_backends_doc_quotes_the_merged_weight_figures():
    """vLLM in process with merged weights beside the engine and TRL (step_vllm_merged_epyc_avx2.json),
    and the two in-process pushes run one side a run (step_vllm_inprocess_{merged,lora}_epyc_avx2.json):
    tables, per-round ratios (each round's vLLM run over that round's engine run), the push costs."""
    doc = _backends_doc()
    kept, med = _kept("step_vllm_merged_epyc_avx2.json")
    _assert_table(doc, med)
    row = f"| weight push per step (s) | | {med('lldslight-vllm', 'sync_s'):.3f} | |"
    assert row in doc, row
    by_round = {(a["round"], a["side"]): a["metrics"]["step_s"] for a in kept}
    rounds = sorted({r for r, _ in by_round})
    per_round = ", ".join(f"{by_round[r, 'lldslight-vllm'] / by_round[r, 'lldslight']:.2f}" for r in rounds)
    quoted = (f"generation {med('lldslight-vllm', 'generation_s') / med('lldslight', 'generation_s'):.2f}x the engine's, the step "
              f"{med('lldslight-vllm', 'step_s') / med('lldslight', 'step_s'):.2f}x (per round {per_round}")
    assert " ".join(quoted.split()) in " ".join(doc.split()), quoted

    _, merged = _kept("step_vllm_inprocess_merged_epyc_avx2.json")
    _, lora = _kept("step_vllm_inprocess_lora_epyc_avx2.json")
    m = {k: merged("lldslight-vllm", k) for k in ("sync_s", "generation_s", "step_s")}
    a = {k: lora("lldslight-vllm", k) for k in ("sync_s", "generation_s", "step_s")}
    quoted = (f"merged {m['sync_s']:.3f} s a step against the adapter's {a['sync_s']:.3f} s, and generation {m['generation_s']:.2f} s "
              f"against {a['generation_s']:.2f} s, so the step {m['step_s']:.2f} s against {a['step_s']:.2f} s: "
              f"{m['sync_s'] - a['sync_s']:.2f} s more push saved {a['generation_s'] - m['generation_s']:.1f} s of sampling.")
    flat = " ".join(doc.split())
    assert quoted in flat, quoted
    assert f"made the step {a['step_s'] / m['step_s']:.2f}x as long" in flat
    assert f"the merged push costs {m['sync_s'] / a['sync_s']:.0f}x the adapter's ({m['sync_s']:.2f} s against {a['sync_s']:.2f} s" in flat


def test_generation_backends_doc_quotes_the_lab_batch_figures():
    """The real-model lab's batch (step_vllm_lab_epyc_avx2.json, --workload lab): table, ratios, and
    that no timed step pushed an adapter (the doc says so)."""
    doc = _backends_doc()
    kept, med = _kept("step_vllm_lab_epyc_avx2.json", lab=True)
    _assert_table(doc, med)
    assert [a["metrics"]["sync_s"] for a in kept if a["side"] == "lldslight-vllm"] == [0.0, 0.0, 0.0]
    r = {k: med("lldslight-vllm", k) / med("lldslight", k) for k in ("step_s", "generation_s", "gen_tokens_per_s")}
    quoted = (f"vLLM / engine: step {r['step_s']:.2f}x, generation {r['generation_s']:.2f}x, tokens/s {r['gen_tokens_per_s']:.2f}x; "
              f"vLLM / TRL step {med('lldslight-vllm', 'step_s') / med('trl', 'step_s'):.2f}x")
    assert quoted in " ".join(doc.split()), quoted
    assert "(`sync_s` 0 in every run)" in doc

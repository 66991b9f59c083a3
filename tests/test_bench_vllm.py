"""benchmarks/step.py's vLLM side (``--vllm on``: lldslight with its rollouts from a vLLM server):
its figures and ratios from faked workers against hand-computed values, and its real worker at
the tiniest size (correctness only: no timing is read)."""
from __future__ import annotations

import json

import pytest
from conftest import load_benchmark

from tests.test_vllm import VLLM_PYTHON, _vllm_unavailable


@pytest.fixture(scope="module")
def step():
    return load_benchmark("step")


def test_the_vllm_side_is_reported_beside_the_engine_and_trl(step, tmp_path, monkeypatch):
    """Workers faked: engine 2 s a step (generation 1 s), vLLM 3 s (generation 1.5 s, of which
    0.05 s pushing the adapter), TRL 4 s. By hand: vLLM / TRL 0.75, vLLM / engine 1.5 (generation
    1.5), push 0.05 s."""
    figures_of = {"lldslight": (2.0, 1.0), "lldslight-vllm": (3.0, 1.5), "trl": (4.0, 2.0)}
    seen = []

    def fake(side, python, spec, timeout):
        seen.append((side, spec["vllm_python"]))
        load = {"wall_s": 1.0, "other_cpu_s": 0.0, "own_cpu_s": 1.0, "steal_s": 0.0, "loadavg_start": [0, 0, 0], "loadavg_end": [0, 0, 0]}
        figures = {k: 1.0 for k in step.PER_STEP + step.PEAKS}
        step_s, generation_s = figures_of[side]
        figures.update(step_s=step_s, generation_s=generation_s, gen_tokens_per_s=8 / generation_s, rows=2, load=load,
                       lengths=[10, 10], loss_tokens=8)
        if side == "lldslight-vllm":
            figures["sync_s"] = 0.05
        return {"steps": [figures], "peak_rss_mb": 1.0, "wall_s": 1.0}

    monkeypatch.setattr(step, "run_worker", fake)
    monkeypatch.setattr(step, "ensure_trl_venv", lambda python: "python")
    python = tmp_path / "python"
    python.write_text("")
    out = tmp_path / "step.json"
    step.main(["--rounds", "1", "--threads", "1", "--precision", "fp32", "--no-bounds", "--lldslight-checkpointing", "on",
               "--shared-prefix", "on", "--vllm", "on", "--vllm-python", str(python), "--json", str(out)])
    assert [s for s, _ in seen] == ["lldslight", "lldslight-vllm", "trl"] and {p for _, p in seen} == {str(python)}
    report = json.loads(out.read_text())
    res = report["precisions"]["fp32"]["threads"]["1"]
    assert res["step_time_ratio_vllm"] == pytest.approx(0.75) and res["vllm_ratio"] == pytest.approx(1.5)
    assert res["vllm_ratios"]["generation_s"]["ratio_of_medians"] == pytest.approx(1.5)
    assert res["vllm_ratios"]["gen_tokens_per_s"]["ratio_of_medians"] == pytest.approx(1 / 1.5)
    assert res["vllm_sync_s"] == pytest.approx(0.05) and report["vllm_ratio"] == {"fp32": {"1": pytest.approx(1.5)}}
    assert "step ratio (rollouts from vLLM) 0.750" in report["closing_note"][0]
    assert "vLLM / engine: step 1.500, generation 1.500 (above 1: vLLM slower);" in report["closing_note"][0]


def test_the_lab_workload_gets_a_vllm_side_beside_the_shipped_run(step, tmp_path, monkeypatch):
    """--workload lab --vllm on, workers faked: the lab's shipped run 3 s a step (generation 1 s),
    with its rollouts from vLLM 4.5 s (generation 2 s, push 0.1 s), today's 6 s, TRL 8 s. By hand:
    vLLM / engine 1.5 (generation 2.0), vLLM / TRL 0.5625; TRL still runs last; the worker's spec
    names vLLM's interpreter, mode and weights."""
    from tests.test_bench_step import _fake_worker

    step_s = {("lab", "lldslight"): 3.0, ("lab", "lldslight-today"): 6.0, ("lab", "lldslight-vllm"): 4.5, ("lab", "trl"): 8.0}
    seen, specs = [], []
    fake_step = _fake_worker(step, step_s, seen)

    def fake(side, python, spec, timeout):
        specs.append(spec)
        result = fake_step(side, python, spec, timeout)
        result["steps"][0]["generation_s"] = {"lldslight-vllm": 2.0}.get(side, 1.0)
        if side == "lldslight-vllm":
            result["steps"][0]["sync_s"] = 0.1
        return result

    python = tmp_path / "python"
    python.write_text("")
    lab_spec = {"recipe": "r.yaml", "prompts": [{"id": str(i)} for i in range(4)], "group_size": 4, "updates": 4, "micro_batch": 4,
                "model_dir": "m", "rollout": {"max_turns": 1, "max_new_tokens": 40, "topk": 2, "max_response_tokens": 220},
                "lora": {"r": 16, "alpha": 32, "dropout": 0.0, "target_modules": "all-linear", "layers_to_transform": [22, 29],
                         "linear_modules": ["q_proj"]}}
    real_lab_spec = step.lab_spec
    monkeypatch.setattr(step, "run_worker", fake)
    monkeypatch.setattr(step, "ensure_trl_venv", lambda python: "python")
    monkeypatch.setattr(step._step_lab(), "spec", lambda precision, seed: dict(lab_spec))
    monkeypatch.setattr(step, "lab_spec", real_lab_spec)
    out = tmp_path / "step.json"
    step.main(["--workload", "lab", "--rounds", "1", "--threads", "1", "--precision", "fp32", "--vllm", "on",
               "--vllm-python", str(python), "--json", str(out)])
    assert [side for _, side in seen] == ["lldslight", "lldslight-today", "lldslight-vllm", "trl"]
    assert {(s["vllm_python"], s["vllm_mode"], s["vllm_weights"]) for s in specs} == {(str(python), "server", "lora")}
    lab = json.loads(out.read_text())["lab"]["precisions"]["fp32"]["threads"]["1"]
    assert lab["vllm_ratio"] == pytest.approx(1.5) and lab["step_time_ratio_vllm"] == pytest.approx(4.5 / 8)
    assert lab["vllm_ratios"]["generation_s"]["ratio_of_medians"] == pytest.approx(2.0) and lab["vllm_sync_s"] == pytest.approx(0.1)


def test_the_labs_vllm_run_samples_through_vllm_without_starting_it():
    """step_lab.lldslight_parts for the vLLM side: the recipe's own SearchRollout (its retriever,
    reward and rollout settings) with VLLMGenerate as its backend, the engine otherwise; built, not
    started (the server starts at the first rollout)."""
    from conftest import load_benchmark

    from lldslight.rollout import RolloutEngine, VLLMGenerate

    lab = load_benchmark("step_lab")
    spec = {"precision": "fp32", "seed": 0, "prompts": [], "vllm_python": "/x/python", "vllm_mode": "server", "vllm_weights": "lora"}
    _, rollout, _ = lab.lldslight_parts(spec, "lldslight-vllm", {})
    _, shipped, _ = lab.lldslight_parts(spec, "lldslight", {})
    assert rollout.backend.func is VLLMGenerate and rollout.backend.keywords == {"mode": "server", "python": "/x/python", "weights": "lora"}
    # the shipped run's backend as the CLI built it: RolloutEngine (jsonargparse wraps the class in a partial)
    assert rollout.sync_tolerance is None and RolloutEngine in (shipped.backend, *getattr(shipped.backend, "args", ()))
    assert rollout.config == shipped.config and type(rollout.retriever) is type(shipped.retriever)


def test_a_missing_vllm_environment_is_one_line(step, tmp_path):
    with pytest.raises(SystemExit, match=r"^--vllm-python: .*nowhere does not exist \(bash scripts/setup_vllm\.sh"):
        step.main(["--vllm", "on", "--vllm-python", str(tmp_path / "nowhere")])
    python = tmp_path / "python"
    python.write_text("")
    with pytest.raises(SystemExit, match=r"^--vllm-weights merged: needs --vllm-mode inprocess"):
        step.main(["--vllm", "on", "--vllm-python", str(python), "--vllm-weights", "merged"])


@pytest.mark.slow
@pytest.mark.skipif(bool(_vllm_unavailable()), reason=_vllm_unavailable() or "vLLM available")
def test_the_vllm_worker_runs_a_real_step_at_the_tiniest_size(step):
    """The real worker: SmolLM2-135M, 1 prompt x G=2, 4 new tokens, a vLLM server it starts and
    stops. Checked: the work it did and that the rollouts came through VLLMGenerate (the adapter
    push it records); the times are not read (a loaded machine proves nothing about them)."""
    from lldslight.policy import PolicyConfig, resolve_model_dir

    spec = {"model_dir": str(resolve_model_dir(PolicyConfig())), "prompts": step.PROMPTS[:1], "group_size": 2, "max_new_tokens": 4,
            "micro_batch": 2, "micro_batch_tokens": None, "logprob_chunk_size": None, "lora_r": 8, "activation_budget_mb": 256.0,
            "malloc": "lldslight", "shared_prefix": True, "beta": 0.0, "steps": 1, "warmup": 1, "seed": 0, "threads": 1,
            "precision": "fp32", "workload": "single", "vllm_python": str(VLLM_PYTHON)}
    result = step.run_worker("lldslight-vllm", __import__("sys").executable, spec, timeout=1500)
    (measured,) = result["steps"]
    assert measured["rows"] == 2 and 2 <= measured["tokens"] <= 8
    assert measured["sync_s"] > 0  # the adapter went to the server: rollouts from VLLMGenerate
    assert result["trainable_params"] > 0

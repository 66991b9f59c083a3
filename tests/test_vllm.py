"""The vLLM backend (lldslight/rollout/vllm_generate.py) against a real vLLM on this CPU.

vLLM runs from its own environment (.venv-vllm, made by scripts/setup_vllm.sh; scripts/test.sh
makes it once): a server lldslight starts, and ``vllm.LLM`` in process (a script run by that
environment's Python). The model: a tiny Llama trained here to follow the protocol (searches,
observations, answers), with 2 heads of 32 (vLLM's CPU attention takes no smaller head), saved as a
Hugging Face folder, a LoRA adapter on top. Checked against independent computations:

- greedy multi-turn episodes equal the engine's (RolloutEngine: its own cache, sampler and stop
  rule) token for token, field by field; sampled log-probs equal the trainer's forward over the
  packed rows; the same torch seed samples the same rollouts;
- after every adapter push the probe through vLLM equals the trainer's; a push skipped, or an
  adapter re-loaded without load_inplace (vLLM then serves the old one, silently), stops the run
  in one line naming the step;
- bad input, one line each: a URL that does not answer (before the first step, through the CLI),
  a server that is not vLLM, a server serving another model, an adapter rank above the server's
  maximum, vLLM absent or too old; a killed server.

Where vLLM's environment is missing or vLLM cannot run on this CPU, the tests that need it skip
with the reason; the bad-input tests that need no vLLM run everywhere.
"""
from __future__ import annotations

import csv
import functools
import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import pytest
import torch
import yaml

from lldslight.errors import ConfigError
from lldslight.rollout import RolloutConfig, RolloutEngine, VLLMGenerate, WeightSync
from lldslight.rollout.sync import SyncMismatch, probe_ids, token_logprobs
from lldslight.rollout.vllm_generate import VLLMError, check_vllm_version
from tests.conftest import ROOT, TINY_DIMS, tiny_policy_config, train_protocol_model
from tests.test_backends import _assert_same

VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# TINY_DIMS with 2 heads of 32: vLLM's CPU attention kernels take head sizes from 32 up.
VLLM_DIMS = {**TINY_DIMS, "num_attention_heads": 2, "num_key_value_heads": 1}
SIGILL = (-signal.SIGILL, 128 + signal.SIGILL)


@functools.lru_cache(maxsize=None)
def _vllm_unavailable() -> str:
    """Why vLLM's environment cannot be used here ('' when it can); asked once per session (an import of vLLM takes seconds)."""
    if not VLLM_PYTHON.is_file():
        return f"{VLLM_PYTHON.relative_to(ROOT)} is missing (bash scripts/test.sh, or bash scripts/setup_vllm.sh, makes it)"
    out = subprocess.run([str(VLLM_PYTHON), "-c", "import vllm; from vllm import LLM"], capture_output=True, text=True)
    if out.returncode in SIGILL:
        return f"vLLM cannot run on this CPU (illegal instruction at import; {_cpu()})"
    if out.returncode != 0:
        return f"vLLM does not import in .venv-vllm: {(out.stderr.strip().splitlines() or ['?'])[-1]}"
    return ""


def _cpu() -> str:
    from lldslight.policy import cpu_description

    return str(cpu_description())


needs_vllm = pytest.mark.skipif(bool(_vllm_unavailable()), reason=_vllm_unavailable() or "vLLM available")


def _config(**kw) -> RolloutConfig:
    base = dict(group_size=1, greedy=True, topk=1, max_turns=2, max_new_tokens=24, max_obs_tokens=200, max_response_tokens=400)
    return RolloutConfig(**{**base, **kw})


def _policy(folder, r: int = 4):
    from lldslight.policy import LoRAConfig, PolicyConfig, load_policy

    return load_policy(PolicyConfig(model=str(folder), precision="fp32", lora=LoRAConfig(r=r, alpha=2 * r), gradient_checkpointing=False))


def _move_adapter(model, seed: int, scale: float = 0.3) -> None:
    """An update of the adapter, as an optimiser step makes (large enough to change log-probs)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(torch.randn(p.shape, generator=gen) * scale)


@pytest.fixture(scope="module")
def vllm_model(protocol_examples, bm25, tmp_path_factory):
    """The protocol-trained tiny model with vLLM-sized heads, as a Hugging Face folder."""
    import dataclasses

    config = dataclasses.replace(tiny_policy_config(lora=False), random_init=dict(VLLM_DIMS))
    model, tok = train_protocol_model(protocol_examples, bm25, config)
    folder = tmp_path_factory.mktemp("vllm_model")
    model.save_pretrained(folder, safe_serialization=True)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def served(vllm_model, bm25):
    """A VLLMGenerate whose server lldslight started (from .venv-vllm), and its policy."""
    unavailable = _vllm_unavailable()
    if unavailable:
        pytest.skip(unavailable)
    model, tok = _policy(vllm_model)
    backend = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), python=str(VLLM_PYTHON))
    try:
        backend._start(model)
    except VLLMError as err:
        if "exit status -4" in str(err) or "exit status 132" in str(err):
            pytest.skip(f"vLLM cannot run on this CPU ({_cpu()}): {err}")
        raise
    yield backend, model, tok
    backend.close()


@needs_vllm
def test_greedy_episodes_equal_the_engines_token_for_token(served, protocol_examples, bm25):
    backend, model, tok = served
    _move_adapter(model, seed=1, scale=0.05)  # an adapter that is not zero, small enough to keep the protocol
    for config in (_config(), _config(max_new_tokens=6, max_obs_tokens=12, max_response_tokens=60)):  # and budgets
        backend.config = backend.rules.config = config
        served_traj = backend.generate(model, protocol_examples)
        engine = RolloutEngine(tok, bm25, lambda text, gold: 0.0, config).generate(model, protocol_examples)
        _assert_same(served_traj, engine)
        assert served_traj.extras["sampled_ids"] == engine.extras["sampled_ids"]
    first = RolloutEngine(tok, bm25, lambda text, gold: 0.0, _config()).generate(model, protocol_examples)
    assert int(first.num_searches.sum()) >= 1 and "answer" in first.finish_reason  # the comparison covered both paths
    backend.config = backend.rules.config = _config()


@needs_vllm
def test_sampled_log_probs_are_the_trainers_and_a_seed_repeats_them(served, protocol_examples):
    from lldslight.update.logprobs import token_logprobs as row_logprobs

    backend, model, _ = served
    backend.config = backend.rules.config = _config(group_size=3, greedy=False, temperature=0.7)
    try:
        torch.manual_seed(0)
        traj = backend.generate(model, protocol_examples[:2])
        torch.manual_seed(0)
        again = backend.generate(model, protocol_examples[:2])
    finally:
        backend.config = backend.rules.config = _config()
    assert len(traj) == 6 and torch.equal(traj.input_ids, again.input_ids)
    assert len({tuple(ids) for ids in traj.extras["sampled_ids"]}) > 2  # it sampled: rollouts of a group differ
    with torch.no_grad():
        logp, _ = row_logprobs(model, traj.input_ids, traj.attention_mask, traj.loss_mask, temperature=0.7)
    diff = (traj.sample_logp - logp.float()).abs()[traj.loss_mask]
    assert float(diff.max()) < 1e-3, float(diff.max())  # fp32 both; vLLM's kernels round differently


@needs_vllm
def test_the_probe_follows_every_push_and_a_skipped_push_stops_the_run(served):
    backend, model, tok = served
    ids = probe_ids(tok)
    sync = WeightSync(1e-4)
    sync.start(backend.probe_logprob, model, tok)
    for step in range(2):
        _move_adapter(model, seed=10 + step)
        before = backend.syncs
        metrics = sync.after_step(backend.probe_logprob, model, step)
        assert backend.syncs == before + 1  # one push per changed adapter
        assert abs(metrics["sync/backend_delta"] - metrics["sync/policy_delta"]) < 1e-3, metrics
        assert abs(metrics["sync/policy_delta"]) > 0.1
    served_now = torch.tensor(backend.client.prompt_logprobs(ids, backend.conn.adapter), dtype=torch.float64)
    assert float((served_now - token_logprobs(model, ids)).abs().max()) < 1e-3

    class SkippedPush(VLLMGenerate):
        def _sync(self, model):  # the push that did not happen
            pass

    skipped = SkippedPush(tok, backend.retriever, lambda text, gold: 0.0, backend.config, python=str(VLLM_PYTHON))
    skipped.conn = backend.conn  # the same server
    _move_adapter(model, seed=20)
    with pytest.raises(SyncMismatch, match=r"^weight sync failed after step 2: (vLLM's log-probs of the probe differ from the "
                                           r"trainer's by [0-9.]+ nats per token|the generation backend samples from old weights)"):
        sync.after_step(skipped.probe_logprob, model, 2)
    backend._sync(model)  # the server back on the policy's adapter for the tests after this one


@needs_vllm
def test_an_unchanged_adapter_is_pushed_again_only_when_marked_stale(served):
    """The push is skipped while the adapter equals the last one pushed; mark_stale (what the step
    benchmark calls before each timed step) makes the next one go out regardless."""
    backend, model, tok = served
    backend._sync(model)
    before = backend.syncs
    backend._sync(model)
    assert backend.syncs == before
    backend.mark_stale()
    backend._sync(model)
    assert backend.syncs == before + 1


@needs_vllm
def test_an_adapter_rank_above_the_servers_maximum_is_refused(served, vllm_model, bm25):
    backend, _, _ = served
    model, tok = _policy(vllm_model, r=16)  # the server was started for rank 4 (--max-lora-rank 8)
    wide = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), url=backend.client.url)
    with pytest.raises(VLLMError, match=r"^model\.policy\.lora\.r: vLLM refused the policy's adapter of rank 16: .*"
                                        r"--max-lora-rank >= 16") as err:
        wide.probe_logprob(model, probe_ids(tok))
    assert "\n" not in str(err.value)
    wide.close()


@needs_vllm
def test_a_server_serving_another_model_is_refused_before_the_first_step(served, vllm_model, bm25):
    import dataclasses

    from lldslight.policy import load_policy

    backend, _, _ = served
    other_cfg = dataclasses.replace(tiny_policy_config(), model=str(vllm_model), random_init=dict(VLLM_DIMS), init_seed=7)
    other, tok = load_policy(other_cfg)  # the same architecture, other weights
    attached = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), url=backend.client.url)
    with pytest.raises(SyncMismatch, match=r"^weight sync failed before the first step: vLLM's log-probs of the probe differ"
                                           r".*a server serving another model"):
        WeightSync(1e-4).start(attached.probe_logprob, other, tok)
    attached.close()
    backend._sync(_policy(vllm_model)[0])  # whatever it pushed, a policy's adapter is back on (the next tests push theirs)


@needs_vllm
def test_a_fit_samples_through_vllm_and_the_probe_follows_every_step(served, vllm_model, tmp_path, monkeypatch):
    """configs/vllm.yaml composed after a base config, attached to the running server: a real fit."""
    from lldslight.cli import main

    backend, _, _ = served
    base = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    base["model"]["policy"].update(model=str(vllm_model), gradient_checkpointing=False)
    base["model"]["policy"].pop("random_init")
    rollout = base["trainer"]["callbacks"][0]
    rollout["init_args"]["reward"] = {"class_path": "tests.test_signal.Alternate"}  # every group mixed: every step moves
    base["trainer"]["callbacks"] = [rollout]
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(base))
    shipped = yaml.safe_load((ROOT / "configs" / "vllm.yaml").read_text())
    options = shipped["trainer"]["callbacks+"][0]
    assert options["init_args"]["backend"]["class_path"] == "lldslight.rollout.VLLMGenerate"
    options["init_args"]["backend"]["init_args"]["url"] = backend.client.url  # attach: no second server
    (tmp_path / "vllm.yaml").write_text(yaml.safe_dump(shipped))
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    assert main(["fit", "--config", "fit.yaml", "--config", "vllm.yaml", "--trainer.max_steps", "2"]) == 0
    with open(tmp_path / "runs" / "tiny" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/reward")]
    assert len(rows) == 2
    for row in rows:
        policy, sampler = float(row["sync/policy_delta"]), float(row["sync/backend_delta"])
        assert abs(policy) > 1e-4 and abs(sampler - policy) < 1e-3, row


@needs_vllm
def test_in_process_vllm_matches_the_engine_and_catches_a_reload_without_load_inplace(vllm_model, synth_kb, tmp_path):
    """vllm.LLM in the trainer's process, in vLLM's environment (lldslight is installed there)."""
    out = tmp_path / "result.json"
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_inprocess_check.py"), str(vllm_model),
                          str(synth_kb["corpus"]), str(synth_kb["train_jsonl"]), str(out)],
                         capture_output=True, text=True, cwd=ROOT, timeout=1200)
    if run.returncode in SIGILL:
        pytest.skip(f"vLLM cannot run on this CPU ({_cpu()})")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["same_as_engine"] == [True, True], result  # greedy, before and after an adapter push
    assert result["searched"] and result["answered"], result
    assert result["probe_gap"] < 1e-3, result
    assert re.match(r"weight sync failed after step 0: (vLLM's log-probs of the probe differ|the generation backend samples "
                    r"from old weights)", result["reload_without_inplace"]), result


@needs_vllm
def test_in_process_merged_and_full_weights_reach_vllm(vllm_model, synth_kb, tmp_path):
    """weights: merged (in process): the adapter's merged weights, then a fully fine-tuned
    policy's weights, copied into vLLM's model; greedy episodes equal the engine's and the probe
    equals the trainer's after each push."""
    out = tmp_path / "result.json"
    run = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_inprocess_check.py"), str(vllm_model),
                          str(synth_kb["corpus"]), str(synth_kb["train_jsonl"]), str(out), "merged"],
                         capture_output=True, text=True, cwd=ROOT, timeout=1200)
    if run.returncode in SIGILL:
        pytest.skip(f"vLLM cannot run on this CPU ({_cpu()})")
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["same_as_engine"] == [True, True, True], result  # LoRA before and after a move, then full weights
    assert result["probe_gap"] < 1e-3 and result["full_probe_gap"] < 1e-3, result
    for served, trainer in (result["probe_moves"], result["full_probe_moves"]):  # each push moved vLLM as the trainer moved
        assert abs(trainer) > 0.01 and abs(served - trainer) < 1e-3, result


@needs_vllm
def test_a_killed_server_is_reported_in_one_line(served, protocol_examples):
    """Last of the tests on the server: it kills it."""
    backend, model, _ = served
    process = backend.client.process
    os.killpg(process.proc.pid, signal.SIGKILL)
    process.proc.wait(timeout=60)
    with pytest.raises(VLLMError, match=r"^the vLLM server lldslight started at http://127\.0\.0\.1:\d+ has exited \(status -9; "
                                        r"its log .*server\.log: .*\)$") as err:
        backend.generate(model, protocol_examples[:1])
    assert "\n" not in str(err.value)


# -- bad input that needs no vLLM ----------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_url_that_does_not_answer_is_one_line_before_the_first_step(tmp_path, monkeypatch, capsys):
    from lldslight.cli import main

    url = f"http://127.0.0.1:{_free_port()}"
    config = yaml.safe_load((ROOT / "configs" / "tiny.yaml").read_text())
    rollout = config["trainer"]["callbacks"][0]
    rollout["init_args"]["backend"] = {"class_path": "lldslight.rollout.VLLMGenerate", "init_args": {"url": url}}
    config["trainer"]["callbacks"] = [rollout]
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.chdir(tmp_path)
    assert main(["fit", "--config", "fit.yaml", "--trainer.max_steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.fullmatch(rf"lldslight fit: error: VLLMGenerate\.url: {re.escape(url)} does not answer \(ConnectError: .*\); "
                        r"start the server first .*", err[-1]), err[-3:]


class _NotVLLM(http.server.BaseHTTPRequestHandler):
    """An OpenAI-compatible server that is not vLLM (what llama.cpp's or a proxy's /v1/models looks like)."""

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "llamacpp"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_server_that_is_not_vllm_is_refused(tiny_policy, bm25):
    model, tok = tiny_policy
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotVLLM)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        backend = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), url=url)
        with pytest.raises(VLLMError, match=rf"^VLLMGenerate\.url: {re.escape(url)} is not a vLLM server \(GET /version -> "
                                            r"HTTP 404, GET /v1/models -> HTTP 200, owned_by \['llamacpp'\]\)$"):
            backend.probe_logprob(model, probe_ids(tok))
    finally:
        server.shutdown()


def test_vllm_absent_or_too_old_is_one_line(tiny_policy, bm25, tmp_path):
    model, tok = tiny_policy
    try:
        import vllm  # noqa: F401
        absent = False
    except ImportError:
        absent = True
    if absent:  # the main environment has no vLLM: in process, it says so and where to run it
        backend = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), mode="inprocess")
        with pytest.raises(VLLMError, match=r"^VLLMGenerate\.mode: 'inprocess' needs vLLM in this Python environment .*"
                                            r"use mode: server"):
            backend.generate(model, [])
    missing = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), python=str(tmp_path / "no-python"))
    with pytest.raises(VLLMError, match=r"^VLLMGenerate\.python: .*no-python does not exist \(bash scripts/setup_vllm\.sh"):
        missing._launch(str(tmp_path), "float32", 8, 512, tmp_path)
    with pytest.raises(VLLMError, match=r"^here: vLLM 0\.10\.1 is too old for VLLMGenerate \(it needs >= 0\.11\.0"):
        check_vllm_version("0.10.1", "here")
    check_vllm_version("0.32.0", "here")
    check_vllm_version("0.32.0+cpu", "here")


def test_settings_vllm_cannot_honour_are_refused_when_the_config_is_read(tiny_policy, bm25):
    _, tok = tiny_policy
    with pytest.raises(ConfigError, match=r"^rollout\.top_k / rollout\.top_p must be off .* with VLLMGenerate, got \(5, 1\.0\)"):
        VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(top_k=5))
    with pytest.raises(ConfigError, match=r"^VLLMGenerate\.max_lora_rank must be one of \(1, 8, 16"):
        VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), max_lora_rank=12)
    with pytest.raises(ConfigError, match=r"^VLLMGenerate\.url must be unset in mode 'inprocess'"):
        VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), mode="inprocess", url="http://127.0.0.1:1")
    with pytest.raises(ConfigError, match=r"^VLLMGenerate\.weights must be 'lora' in mode 'server', got 'merged'"):
        VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), weights="merged")


def test_full_fine_tuning_with_adapter_pushes_is_refused_before_vllm_starts(bm25):
    """No adapter to push: one line naming the setting and the way that works (weights: merged, in process)."""
    from lldslight.policy import load_policy

    model, tok = load_policy(tiny_policy_config(lora=False))
    backend = VLLMGenerate(tok, bm25, lambda text, gold: 0.0, _config(), python="/nonexistent/python")
    with pytest.raises(ConfigError, match=r"^model\.policy\.lora must be set with VLLMGenerate\(weights: lora\), got None: .*"
                                          r"weights: merged \(mode: inprocess\)"):
        backend.generate(model, [])

"""Bad input is caught before the policy loads and said once: ``lldslight <command>: error: ...``,
exit 2, no traceback (docs/errors_and_resume.md). Every case drives the real CLI on real files, a real
retrieval server, a dead port or a server that never answers.

"Before the policy loads" is shown with a model directory whose config and tokenizer are real and
whose weights file is garbage: loading it fails with its own error, so a test that sees the
expected message instead proves the check ran first.
"""
from __future__ import annotations

import contextlib
import copy
import csv
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from lldslight.cli import main
from tests.conftest import ROOT

TINY = ROOT / "configs" / "tiny.yaml"


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """One working directory per module: tiny.yaml's synthetic knowledge base is written once."""
    return tmp_path_factory.mktemp("badinput")


@pytest.fixture(scope="module")
def unloadable_model(work) -> Path:
    """A model directory with SmolLM2's real config.json and tokenizer, and a garbage weights file."""
    from lldslight.policy import DEMO_MODELS, PolicyConfig, load_policy, resolve_model_dir

    source = Path(resolve_model_dir(PolicyConfig(model=next(iter(DEMO_MODELS)))))
    out = work / "unloadable_model"
    out.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    (out / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not a safetensors header")
    with pytest.raises(Exception):  # loading it fails: a check that reports its own error ran first
        load_policy(PolicyConfig(model=str(out), precision="fp32", lora=None))
    return out


def tiny_config(path: Path, model: Path | None = None, rollout: dict | None = None, retriever: dict | None = None,
                callbacks_extra: list | None = None, model_args: dict | None = None) -> Path:
    """tiny.yaml with changes, written to ``path`` (lists are replaced whole by a later config)."""
    cfg = yaml.safe_load(TINY.read_text())
    search = cfg["trainer"]["callbacks"][0]["init_args"]
    search["rollout"].update(rollout or {})
    if retriever is not None:
        search["retriever"] = retriever
    cfg["trainer"]["callbacks"] += callbacks_extra or []
    if model is not None:
        cfg["model"]["policy"]["model"] = str(model)
        cfg["model"]["policy"]["random_init"] = None
    cfg["model"].update(model_args or {})
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_cli(args: list[str], cwd: Path, capsys) -> tuple[int, str]:
    """``lldslight ARGS`` in this process, from ``cwd``; (exit code, stderr)."""
    old, raise_exceptions = os.getcwd(), logging.raiseExceptions
    # Lightning's log handlers keep the stream of the test that imported it, which pytest has
    # closed since; without this, each of its INFO lines prints a "Logging error" traceback.
    logging.raiseExceptions = False
    os.chdir(cwd)
    try:
        try:
            code = main(args)
        except SystemExit as e:  # argparse / jsonargparse usage errors
            code = e.code
    finally:
        os.chdir(old)
        logging.raiseExceptions = raise_exceptions
    return code, capsys.readouterr().err


def assert_one_line_error(code: int, err: str, command: str, *needles: str) -> str:
    lines = [l for l in err.splitlines() if l.startswith(f"lldslight {command}: error:")]
    assert code == 2, err[-3000:]
    assert len(lines) == 1, err[-3000:]
    assert "Traceback" not in err and "usage:" not in err, err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def silent_server():
    """A TCP port that accepts connections and never answers (a hung retrieval server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"http://127.0.0.1:{s.getsockname()[1]}/retrieve"


def subprocess_cli(args: list[str], cwd: Path, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    full_env = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "lldslight.cli", *args], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout)


# --------------------------------------------------------------------------- item 6: knobs


@pytest.mark.parametrize(
    "rollout, model_args, extra, needles",
    [
        ({"group_size": 1}, {}, [], ["rollout.group_size must be >= 2 for training, got 1"]),
        ({"max_turns": -1}, {}, [], ["rollout.max_turns must be >= 0", "got -1"]),
        ({"max_new_tokens": 0}, {}, [], ["rollout.max_new_tokens must be >= 1, got 0"]),
        ({"temperature": 0.0}, {"logprob_temperature": 1.0}, [], ["rollout.temperature must be > 0 when sampling, got 0.0"]),
        ({}, {}, ["--model.optim.warmup_ratio", "0.1", "--trainer.max_steps", "-1", "--trainer.max_epochs", "1"],
         ["trainer.max_steps must be > 0 with model.optim.warmup_ratio > 0", "got -1"]),
        # issue 23: torch's traceback after the model loaded / trained as given / 4 of 10 updates silently
        ({}, {}, ["--model.optim.lr", "-1"], ["model.optim.lr must be > 0, got -1.0"]),
        ({}, {}, ["--model.update.clip_eps", "-0.2"], ["model.update.clip_eps must be > 0", "got -0.2"]),
        ({}, {}, ["--model.update.updates_per_rollout", "10"],
         ["model.update.updates_per_rollout must be <= the rollout rows per step and rank (data.batch_size 2 x "
          "rollout.group_size 2 = 4), got 10"]),
    ],
    ids=["group_size", "max_turns", "max_new_tokens", "temperature", "warmup_ratio", "lr", "clip_eps", "updates_per_rollout"],
)
def test_knob_out_of_range_is_one_line_before_the_model_loads(work, unloadable_model, capsys, rollout, model_args,
                                                               extra, needles):
    cfg = tiny_config(work / "knob.yaml", model=unloadable_model, rollout=rollout, model_args=model_args)
    runs = work / "runs_knobs"
    code, err = run_cli(["fit", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(runs), *extra],
                        work, capsys)
    assert_one_line_error(code, err, "fit", *needles)
    # a failed start leaves no empty runs/NAME/version_N behind (issue 23)
    assert not list(runs.glob("*/version_*")), sorted(runs.rglob("*"))


def test_group_size_one_is_fine_for_evaluation(work, capsys):
    """Evaluation samples one greedy rollout per prompt: the training-only check must not fire."""
    cfg = tiny_config(work / "eval_g1.yaml", rollout={"group_size": 1})
    code, err = run_cli(["validate", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(work / "runs")],
                        work, capsys)
    assert code == 0, err[-3000:]


# --------------------------------------------------------------------------- item 7: preflight


def test_missing_corpus_fails_before_the_model_loads(work, unloadable_model, capsys):
    missing = work / "no_such_corpus.jsonl"
    cfg = tiny_config(work / "corpus_missing.yaml", model=unloadable_model,
                      retriever={"class_path": "lldslight.retrieval.BM25Retriever", "init_args": {"corpus": str(missing)}})
    code, err = run_cli(["fit", "--config", str(cfg)], work, capsys)
    assert_one_line_error(code, err, "fit", f"corpus not found: {missing}")


def test_empty_corpus_fails_before_the_model_loads(work, unloadable_model, capsys):
    empty = work / "empty_corpus.jsonl"
    empty.write_text("\n")
    cfg = tiny_config(work / "corpus_empty.yaml", model=unloadable_model,
                      retriever={"class_path": "lldslight.retrieval.BM25Retriever", "init_args": {"corpus": str(empty)}})
    code, err = run_cli(["fit", "--config", str(cfg)], work, capsys)
    assert_one_line_error(code, err, "fit", str(empty), "no passages")


def test_malformed_corpus_names_the_line_before_the_model_loads(work, unloadable_model, capsys):
    bad = work / "bad_corpus.jsonl"
    bad.write_text('{"id": "1", "contents": "\\"A\\"\\ntext"}\n{"id": "2", "contents": \n')
    cfg = tiny_config(work / "corpus_bad.yaml", model=unloadable_model,
                      retriever={"class_path": "lldslight.retrieval.BM25Retriever", "init_args": {"corpus": str(bad)}})
    code, err = run_cli(["fit", "--config", str(cfg)], work, capsys)
    assert_one_line_error(code, err, "fit", f"{bad}:2", "malformed JSON")


def test_unreachable_retriever_url_fails_before_the_model_loads(work, unloadable_model, capsys):
    url = f"http://127.0.0.1:{dead_port()}/retrieve"
    cfg = tiny_config(work / "dead_url.yaml", model=unloadable_model,
                      retriever={"class_path": "lldslight.retrieval.HttpRetriever",
                                 "init_args": {"url": url, "retries": 1, "backoff": 0.01}})
    code, err = run_cli(["fit", "--config", str(cfg)], work, capsys)
    assert_one_line_error(code, err, "fit", f"retrieval server {url} unreachable", "ConnectError")


def test_topk_above_the_servers_limit_fails_before_the_model_loads(work, unloadable_model, bm25, capsys):
    from lldslight.retrieval import ServerLimits, start_server

    with start_server(bm25, limits=ServerLimits(max_topk=2, default_topk=2)) as server:
        cfg = tiny_config(work / "topk.yaml", model=unloadable_model, rollout={"topk": 3},
                          retriever={"class_path": "lldslight.retrieval.HttpRetriever", "init_args": {"url": server.url}})
        code, err = run_cli(["fit", "--config", str(cfg)], work, capsys)
    assert_one_line_error(code, err, "fit", "HTTP 422", "max_topk=2", "got 3", "rollout.topk=3")


@pytest.mark.parametrize("env, needle", [
    ({"HF_HUB_OFFLINE": "1"}, "the hub is offline (HF_HUB_OFFLINE=1)"),
    # HF_HUB_OFFLINE=0: other test modules set it to 1 in this process's environment.
    ({"HF_ENDPOINT": "http://127.0.0.1:{port}", "HF_HUB_OFFLINE": "0"}, "the hub (http://127.0.0.1:{port}) is unreachable"),
], ids=["offline", "unreachable"])
def test_model_not_on_disk_without_a_hub_is_one_line(work, env, needle, tmp_path):
    port = dead_port()
    env = {k: v.format(port=port) for k, v in env.items()}
    proc = subprocess_cli(["fit", "--config", str(TINY), "--model.policy.model", "lldslight-test/not-a-cached-model",
                           "--trainer.logger.init_args.save_dir", str(tmp_path)], work,
                          env={**env, "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert_one_line_error(proc.returncode, proc.stderr, "fit", "'lldslight-test/not-a-cached-model' not found locally",
                          needle.format(port=port))


# --------------------------------------------------------------------------- item 8: one rule, every command


def test_unknown_key_is_one_line_without_usage(work, capsys):
    bad = work / "typo.yaml"
    bad.write_text("model:\n  learning_rate_typo: 0.1\n")
    code, err = run_cli(["fit", "--config", str(TINY), "--config", str(bad)], work, capsys)
    assert_one_line_error(code, err, "fit", "learning_rate_typo")


def test_typo_inside_a_nested_class_is_one_line_with_its_path(work, capsys):
    cfg = yaml.safe_load(TINY.read_text())
    retriever = cfg["trainer"]["callbacks"][0]["init_args"]["retriever"]["init_args"]
    retriever["korpus"] = retriever.pop("corpus")
    typo = work / "typo_nested.yaml"
    typo.write_text(yaml.safe_dump(cfg))
    code, err = run_cli(["fit", "--config", str(typo)], work, capsys)
    assert_one_line_error(code, err, "fit", "trainer.callbacks: lldslight.callbacks.SearchRollout: retriever: "
                                            "lldslight.retrieval.BM25Retriever: Option 'korpus' is not accepted")


def test_class_init_error_is_dug_out_of_jsonargparse(work, capsys):
    """A callback's own ValueError, which jsonargparse wraps in a union-validation message."""
    extra = work / "llds_bad.yaml"
    extra.write_text("trainer:\n  callbacks+:\n    - class_path: lldslight.callbacks.LLDS\n      init_args: {coef: -1}\n")
    code, err = run_cli(["fit", "--config", str(TINY), "--config", str(extra)], work, capsys)
    assert_one_line_error(code, err, "fit", "LLDS.coef must be >= 0")
    assert "Union" not in err and "Given value" not in err


def test_bad_parquet_row_is_one_line(work, capsys, synth_kb):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(synth_kb["train"]).to_pylist()
    table[3]["reward_model"] = {"ground_truth": {"target": []}, "style": "rule"}
    table[3]["golden_answers"] = []
    bad = work / "bad_rows.parquet"
    pq.write_table(pa.Table.from_pylist(table, schema=pq.read_schema(synth_kb["train"])), bad)
    code, err = run_cli(["fit", "--config", str(TINY), "--data.train_files", f"[{bad}]"], work, capsys)
    assert_one_line_error(code, err, "fit", str(bad), "row 4,")  # table[3]: the 4th row, counted from 1 (issue 23)


def test_missing_data_file_is_an_error_not_a_traceback(work, capsys):
    code, err = run_cli(["fit", "--config", str(TINY), "--data.synthesize", "null", "--data.train_files",
                         "[missing_train.parquet]"], work, capsys)
    assert_one_line_error(code, err, "fit", "data file(s) not found")
    assert "missing_train.parquet" in err


def test_debug_flag_and_environment_raise_instead(work, capsys, monkeypatch):
    from lldslight.errors import ConfigError

    broken = work / "broken.yaml"
    broken.write_text("model: [unclosed\n")
    code, err = run_cli(["fit", "--config", str(broken)], work, capsys)
    assert_one_line_error(code, err, "fit", f"malformed YAML in {broken}, line 2")
    # --debug (or the variable) adds the traceback; the line and exit status 2 stay (issue 23: it was 1).
    for args, env in ((["--debug"], None), ([], "1")):
        if env:
            monkeypatch.setenv("LLDSLIGHT_DEBUG", env)
        code, err = run_cli(["fit", "--config", str(broken), *args], work, capsys)
        assert code == 2 and "Traceback" in err and "ConfigError: malformed YAML" in err, err[-2000:]
        assert err.strip().splitlines()[-1].startswith(f"lldslight fit: error: malformed YAML in {broken}")
    proc = subprocess_cli(["fit", "--config", str(broken), "--debug"], work)
    assert proc.returncode == 2 and "Traceback" in proc.stderr


def test_no_lightningcli_args_warning_from_the_command_line(work):
    proc = subprocess_cli(["fit", "--config", str(TINY), "--print_config"], work)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "args parameter" not in proc.stderr
    assert yaml.safe_load(proc.stdout)["model"]["policy"]["model"] == "smollm2-135m-instruct"


def test_tensorboard_logger_without_tensorboard_names_the_extra(work, capsys):
    import importlib.util

    if importlib.util.find_spec("tensorboard") or importlib.util.find_spec("tensorboardX"):
        pytest.skip("tensorboard is installed: TensorBoardLogger works")
    code, err = run_cli(["fit", "--config", str(TINY), "--trainer.logger", "lightning.pytorch.loggers.TensorBoardLogger",
                         "--trainer.logger.save_dir", str(work / "runs")], work, capsys)
    assert_one_line_error(code, err, "fit", "tensorboard", "pip install -e '.[tensorboard]'")
    extras = __import__("tomllib").loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert any(req.startswith("tensorboard") for req in extras["tensorboard"])


@pytest.mark.parametrize("command, args, needles", [
    ("data", ["inspect", "{work}/nope.parquet"], ["nope.parquet"]),
    ("index", ["--corpus", "{work}/nope.jsonl", "--out", "{work}/idx_nope"], ["corpus not found", "nope.jsonl"]),
    ("serve", ["--index", "{work}/no_index_here"], ["no index at", "no_index_here"]),
    ("sft", ["--data", "{work}/nope.jsonl", "--corpus", "{work}/nope_corpus.jsonl", "--out", "{work}/sft_out"], ["nope.jsonl"]),
    ("export", ["--ckpt", "{work}/nope.ckpt", "--out", "{work}/exported"], ["checkpoint not found", "nope.ckpt"]),
    ("plot", ["{work}/run_without_monitor"], ["configs/monitor.yaml"]),
], ids=["data", "index", "serve", "sft", "export", "plot"])
def test_every_tool_says_bad_input_in_one_line(work, capsys, command, args, needles):
    run = work / "run_without_monitor"
    run.mkdir(exist_ok=True)
    (run / "metrics.csv").write_text("step,train/reward,train/entropy,train/grad_norm\n0,0.5,1.0,0.1\n")
    code, err = run_cli([command, *[a.format(work=work) for a in args]], work, capsys)
    assert_one_line_error(code, err, command, *needles)


@pytest.mark.parametrize("command, args", [
    ("data", []), ("index", ["--out", "x"]), ("serve", ["--port", "abc"]), ("plot", []), ("sft", ["--out", "x"]),
    ("export", ["--ckpt", "x"]),
])
def test_every_tool_says_a_usage_error_in_one_line(work, capsys, command, args):
    code, err = run_cli([command, *args], work, capsys)
    assert code == 2 and err.strip().splitlines() == [err.strip()], err
    assert err.startswith(f"lldslight {command}: error: ") and f"lldslight {command} --help" in err


# --------------------------------------------------------------------------- item 9: checkpoints


def _checkpoints(directory: Path) -> dict[str, Path]:
    """Three real torch checkpoints written in order (oldest first), the newest one then truncated."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {}
    for i, name in enumerate(["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt", "last.ckpt"]):
        p = directory / name
        torch.save({"state_dict": {"w": torch.full((64, 64), float(i))}, "global_step": i + 1,
                    "pytorch-lightning_version": "2.6.0"}, p)
        os.utime(p, (1_000_000 + i, 1_000_000 + i))
        paths[name] = p
    data = paths["last.ckpt"].read_bytes()
    paths["last.ckpt"].write_bytes(data[: len(data) // 2])
    with pytest.raises(Exception):  # what torch makes of it
        torch.load(paths["last.ckpt"], weights_only=True)
    return paths


def test_truncated_checkpoint_is_named_and_the_newest_valid_one_offered(work, capsys):
    paths = _checkpoints(work / "ckpt_run" / "checkpoints")
    code, err = run_cli(["validate", "--config", str(TINY), "--ckpt_path", str(paths["last.ckpt"])], work, capsys)
    assert_one_line_error(code, err, "validate", f"checkpoint {paths['last.ckpt']} is truncated",
                          f"the newest valid checkpoint beside it is {paths['epoch=0-step=2.ckpt']}")


def test_corrupt_newest_sibling_is_skipped_when_offering_one(work, capsys):
    paths = _checkpoints(work / "ckpt_run2" / "checkpoints")
    step2 = paths["epoch=0-step=2.ckpt"]
    step2.write_bytes(b"PK\x03\x04 not a checkpoint")
    os.utime(step2, (1_000_001, 1_000_001))
    code, err = run_cli(["export", "--ckpt", str(paths["last.ckpt"]), "--out", str(work / "exp")], work, capsys)
    assert_one_line_error(code, err, "export", str(paths["last.ckpt"]),
                          f"the newest valid checkpoint beside it is {paths['epoch=0-step=1.ckpt']}")


def test_lightning_checkpoint_reader_names_a_damaged_file(work):
    from lldslight.run.checkpoint_io import AtomicCheckpointIO
    from lldslight.errors import CheckpointError

    paths = _checkpoints(work / "ckpt_run3" / "checkpoints")
    with pytest.raises(CheckpointError, match=r"epoch=0-step=2\.ckpt") as err:
        AtomicCheckpointIO().load_checkpoint(paths["last.ckpt"])
    assert str(paths["last.ckpt"]) in str(err.value)
    assert AtomicCheckpointIO().load_checkpoint(paths["epoch=0-step=2.ckpt"])["global_step"] == 2


# --------------------------------------------------------------------------- item 10: retries are said


def test_every_retry_is_logged_and_the_first_outage_warned_once(caplog):
    from lldslight.retrieval import UNAVAILABLE, HttpRetriever

    caplog.set_level(logging.WARNING, logger="lldslight.retrieval.http")
    with silent_server() as url:
        # breaker_failures=0: every request makes its whole retry cycle (the breaker: test_retrieval_faults.py)
        r = HttpRetriever(url=url, timeout=0.3, retries=2, backoff=0.01, on_unavailable="observe", breaker_failures=0)
        assert r.search(["a", "b"], 2) == [[UNAVAILABLE], [UNAVAILABLE]]
        assert r.search(["c"], 2) == [[UNAVAILABLE]]
    messages = [rec.getMessage() for rec in caplog.records]
    attempts = [m for m in messages if re.search(r"attempt \d/\d", m)]
    assert len(attempts) == 6, messages  # 3 attempts per request, each said as it fails
    assert all(url in m and "ReadTimeout" in m for m in attempts), attempts
    assert [m.split("attempt ")[1][:3] for m in attempts] == ["1/3", "2/3", "3/3"] * 2
    outages = [m for m in messages if "unavailable after 3 attempts" in m]
    assert len(outages) == 1 and "retrieval/unavailable" in outages[0]
    assert r.unavailable_count == 3


def test_observe_mode_logs_unavailable_queries_per_step(protocol_model, protocol_examples, bm25, tmp_path, caplog):
    """A real server answers the pre-flight probe and then goes away: each step's
    retrieval/unavailable equals the number of searches that step made (from train/searches)."""
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from lldslight.callbacks import SearchRollout
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.data.formats import write_searchr1_parquet
    from lldslight.module import GRPOModule
    from lldslight.update.optim import OptimConfig
    from lldslight.policy import PolicyConfig
    from lldslight.retrieval import HttpRetriever, start_server
    from lldslight.rollout import RolloutConfig
    from lldslight.update import UpdateConfig

    model, tok = protocol_model
    server = start_server(bm25)

    class StopServer(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            server.stop()

    train = write_searchr1_parquet(protocol_examples, tmp_path / "train.parquet")
    data = SearchQADataModule(train_files=[str(train)], batch_size=3, prompt_source="file", shuffle=False)
    module = GRPOModule(policy=PolicyConfig(lora=None, precision="fp32"), update=UpdateConfig(kl_coef=0.0, micro_batch_size=6),
                        optim=OptimConfig(lr=1e-6))
    module.policy, module.tokenizer = copy.deepcopy(model), tok
    retriever = HttpRetriever(url=server.url, retries=1, backoff=0.01, timeout=5, on_unavailable="observe")
    rollout = RolloutConfig(group_size=2, max_turns=1, max_new_tokens=24, max_obs_tokens=64, max_response_tokens=200, topk=1)
    trainer = pl.Trainer(max_steps=2, accelerator="cpu", logger=CSVLogger(tmp_path, name="obs"), enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0,
                         callbacks=[SearchRollout(retriever, rollout=rollout), StopServer()])
    caplog.set_level(logging.WARNING, logger="lldslight.retrieval.http")
    trainer.fit(module, data)
    with open(tmp_path / "obs" / "version_0" / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/searches")]
    assert len(rows) == 2
    for r in rows:
        searches = float(r["train/searches"]) * 6  # mean searches per rollout x 3 prompts x G=2
        assert searches > 0
        assert float(r["retrieval/unavailable"]) == pytest.approx(searches)
    assert sum("unavailable after 2 attempts" in rec.getMessage() for rec in caplog.records) == 1


# --------------------------------------------------------------------------- item 11: config lists


def _printed(args: list[str], cwd: Path, capsys) -> dict:
    old = os.getcwd()
    os.chdir(cwd)
    try:
        with pytest.raises(SystemExit) as done:
            main(["fit", *args, "--print_config"])
    finally:
        os.chdir(old)
    out = capsys.readouterr()
    assert done.value.code in (0, None), out.err
    return yaml.safe_load(out.out)


def test_a_plain_list_in_a_later_config_replaces_the_earlier_one(work, capsys):
    later = work / "later_callbacks.yaml"
    later.write_text(
        "trainer:\n  callbacks:\n"
        "    - class_path: lldslight.callbacks.RunSummary\n"
        "    - class_path: lightning.pytorch.callbacks.ModelCheckpoint\n"
        "      init_args: {every_n_train_steps: 7}\n"
    )
    # tiny.yaml has two callbacks too, its ModelCheckpoint with save_last: true
    base = yaml.safe_load(TINY.read_text())
    del base["trainer"]["callbacks"]
    no_callbacks = work / "tiny_without_callbacks.yaml"
    no_callbacks.write_text(yaml.safe_dump(base))
    composed = _printed(["--config", str(TINY), "--config", str(later)], work, capsys)["trainer"]["callbacks"]
    alone = _printed(["--config", str(no_callbacks), "--config", str(later)], work, capsys)["trainer"]["callbacks"]
    assert composed == alone
    assert composed[1]["init_args"]["every_n_train_steps"] == 7
    assert composed[1]["init_args"]["save_last"] is None


def test_plus_appends(work, capsys):
    more = work / "more_callbacks.yaml"
    more.write_text("trainer:\n  callbacks+:\n    - class_path: lldslight.callbacks.RunSummary\n")
    callbacks = _printed(["--config", str(TINY), "--config", str(more)], work, capsys)["trainer"]["callbacks"]
    assert [c["class_path"] for c in callbacks] == [
        "lldslight.callbacks.SearchRollout", "lightning.pytorch.callbacks.ModelCheckpoint", "lldslight.callbacks.RunSummary"]
    assert callbacks[1]["init_args"]["save_last"] is True


# --------------------------------------------------------------------------- issue 23: named files, nothing overwritten


def _model_dir(work: Path, name: str, source: Path) -> Path:
    """A copy of ``source``'s config and tokenizer files (no weights)."""
    out = work / name
    out.mkdir(exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, out / f.name)
    return out


def test_a_bad_safetensors_file_is_named_in_one_line(work, unloadable_model, capsys):
    from safetensors.torch import save_file

    # random bytes (the fixture's) and a real safetensors file cut short
    truncated = _model_dir(work, "truncated_model", unloadable_model)
    save_file({"w": torch.zeros(4096)}, str(truncated / "model.safetensors"))
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    for model, problem in ((unloadable_model, "not a safetensors file"), (truncated, "truncated")):
        cfg = tiny_config(work / "bad_weights.yaml", model=model)
        code, err = run_cli(["fit", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(work / "runs")],
                            work, capsys)
        assert_one_line_error(code, err, "fit", f"{model / 'model.safetensors'} is {problem}")


def test_a_config_json_that_is_not_json_is_named_in_one_line(work, unloadable_model, capsys):
    model = _model_dir(work, "bad_config_model", unloadable_model)
    (model / "config.json").write_text('{"model_type": "llama",\n  oops}\n')
    cfg = tiny_config(work / "bad_config.yaml", model=model)
    code, err = run_cli(["fit", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(work / "runs")], work, capsys)
    assert_one_line_error(code, err, "fit", f"{model / 'config.json'} is not valid JSON", "line 2")


def test_an_empty_train_file_fails_before_the_model_loads(work, unloadable_model, capsys):
    empty = work / "empty_train.jsonl"
    empty.write_text("")
    cfg = tiny_config(work / "empty_train.yaml", model=unloadable_model)
    code, err = run_cli(["fit", "--config", str(cfg), "--data.train_files", f"[{empty}]",
                         "--trainer.logger.init_args.save_dir", str(work / "runs")], work, capsys)
    assert_one_line_error(code, err, "fit", f"the training set ({empty}) has no examples")


METRICS = "step,train/reward,lld/logp_pos,lld/logp_neg,train/entropy,train/grad_norm\n0,0.5,-1.0,-1.2,1.0,0.1\n1,0.6,-0.9,-1.3,0.9,0.2\n"


def test_plot_out_an_existing_directory_writes_into_it(work, capsys):
    run = work / "plot_run"
    run.mkdir(exist_ok=True)
    (run / "metrics.csv").write_text(METRICS)
    figures = work / "figures"
    figures.mkdir(exist_ok=True)
    code, err = run_cli(["plot", str(run), "--out", str(figures)], work, capsys)
    assert code == 0, err
    assert (figures / "lld.png").is_file() and not (work / "figures.png").exists()


def test_plot_names_a_metrics_csv_that_is_not_utf8(work, capsys):
    run = work / "plot_binary"
    run.mkdir(exist_ok=True)
    (run / "metrics.csv").write_bytes(METRICS.encode().replace(b"0.5", b"0\xff5"))
    code, err = run_cli(["plot", str(run)], work, capsys)
    assert_one_line_error(code, err, "plot", f"{run / 'metrics.csv'}: not UTF-8 text", "b'\\xff'")


@pytest.fixture(scope="module")
def module_checkpoint(work) -> Path:
    """A checkpoint as GRPOModule writes it (trainable weights, hyper-parameters), of tiny.yaml's policy."""
    import dataclasses

    import lightning

    from lldslight.module import GRPOModule
    from lldslight.update.optim import OptimConfig
    from lldslight.update import UpdateConfig
    from tests.conftest import tiny_policy_config

    policy = tiny_policy_config()
    module = GRPOModule(policy=policy, optim=OptimConfig(lr=1e-3), update=UpdateConfig(updates_per_rollout=2, micro_batch_size=2))
    module.configure_model()
    checkpoint = {"state_dict": module.state_dict(), "global_step": 1, "pytorch-lightning_version": lightning.__version__,
                  # as the CLI saves them: plain values (dataclasses as dicts), loadable with weights_only
                  "hyper_parameters": {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
                                       for k, v in module.hparams.items()}}
    module.on_save_checkpoint(checkpoint)
    path = work / "module.ckpt"
    torch.save(checkpoint, path)
    return path


def test_export_never_overwrites_without_force(work, module_checkpoint, capsys):
    out = work / "export_here"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text('{"mine": true}')
    code, err = run_cli(["export", "--ckpt", str(module_checkpoint), "--out", str(out)], work, capsys)
    assert_one_line_error(code, err, "export", f"--out {out} is not empty (it holds config.json)", "--force")
    assert (out / "config.json").read_text() == '{"mine": true}'
    a_file = work / "export_file"
    a_file.write_text("x")
    code, err = run_cli(["export", "--ckpt", str(module_checkpoint), "--out", str(a_file)], work, capsys)
    assert_one_line_error(code, err, "export", f"--out {a_file} is a file, not a directory")
    code, err = run_cli(["export", "--ckpt", str(module_checkpoint), "--out", str(out), "--force"], work, capsys)
    assert code == 0, err[-2000:]
    assert "num_hidden_layers" in (out / "config.json").read_text() and (out / "lldslight_export.json").is_file()


def test_a_checkpoint_of_another_config_is_named_with_the_settings_it_brought(work, module_checkpoint, capsys):
    other = torch.load(module_checkpoint, weights_only=True)
    elsewhere = work / "elsewhere" / "model"
    other["hyper_parameters"]["policy"]["model"] = str(elsewhere)
    other["hyper_parameters"]["policy"]["random_init"] = None
    path = work / "other_config.ckpt"
    torch.save(other, path)
    code, err = run_cli(["fit", "--config", str(TINY), "--ckpt_path", str(path),
                         "--trainer.logger.init_args.save_dir", str(work / "runs_other")], work, capsys)
    line = assert_one_line_error(code, err, "fit", str(elsewhere), f"resuming from checkpoint {path}",
                                 f"model.policy.model='{elsewhere}'", "--resume_override all")
    said = [l for l in err.splitlines() if l.startswith("[lldslight] resuming from")]
    assert len(said) == 1 and f"model.policy.model='{elsewhere}' (yours: 'smollm2-135m-instruct')" in said[0], err[-2000:]


def test_ckpt_path_last_without_an_earlier_run_says_so(work, unloadable_model, capsys):
    cfg = tiny_config(work / "last_fresh.yaml", model=unloadable_model)
    runs = work / "runs_never"
    code, err = run_cli(["fit", "--config", str(cfg), "--ckpt_path", "last", "--trainer.logger.init_args.save_dir", str(runs)],
                        work, capsys)
    assert code == 2  # then the unloadable weights stop it, after the line
    said = [l for l in err.splitlines() if "--ckpt_path last" in l]
    assert said == [f"[lldslight] --ckpt_path last: no earlier run has a checkpoint ({runs}/tiny/*/checkpoints/last.ckpt "
                    "matches nothing); training from scratch"], err[-2000:]
    assert "save_last" not in err
    code, err = run_cli(["validate", "--config", str(TINY), "--ckpt_path", "last", "--trainer.logger.init_args.save_dir",
                         str(runs)], work, capsys)
    assert_one_line_error(code, err, "validate", "--ckpt_path last: no checkpoint matches", str(runs))

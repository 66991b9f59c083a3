"""The second round of bad input (docs/errors_and_resume.md): each case ends in one line naming the
file, key or value (exit 2), before the policy loads where the input allows; nothing the user made
is overwritten without ``--force``; sizes a user types are bounded by the model and the machine.

"Before the policy loads" uses tests/test_bad_input.py's model directory with real config.json and
tokenizer and a garbage weights file: a test that sees its own message proves its check ran first.
Faults of a real disk are made real with RLIMIT_FSIZE (the kernel refuses writes past it, as a full
disk does), in a child process; permission-based read-only directories cannot be made when the
tests run as root, so an unwritable location is a path through a regular file (the same OSError
path in the code).
"""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.conftest import ROOT
from tests.test_bad_input import (TINY, assert_one_line_error, module_checkpoint, run_cli,  # noqa: F401
                                  tiny_config, unloadable_model, work)

SMOLLM_CONFIG_FIELDS = ("max_position_embeddings", "vocab_size", "num_hidden_layers", "num_key_value_heads",
                        "num_attention_heads", "hidden_size")


def fit_args(cfg: Path, runs: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(runs), *extra]


def limited_fsize(nbytes: int):
    """preexec_fn: writes past ``nbytes`` fail with EFBIG, as on a full disk (SIGXFSZ ignored so
    the write returns the error instead of killing the process)."""
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, nbytes))
    return apply


def child(args: list[str], cwd: Path, nbytes: int | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lldslight.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, PYTHONPATH=str(ROOT), **(env or {})),
                          preexec_fn=limited_fsize(nbytes) if nbytes else None)


# --------------------------------------------------------------------------- run directories


def finished_run(root: Path) -> dict[Path, bytes]:
    """A version directory as a finished run leaves it; its files' bytes."""
    run = root / "tiny" / "version_0"
    (run / "checkpoints").mkdir(parents=True, exist_ok=True)
    files = {run / "metrics.csv": b"step,train/reward\n0,0.5\n", run / "config.yaml": b"seed_everything: 7\n",
             run / "checkpoints" / "last.ckpt": b"an earlier run's checkpoint"}
    for path, data in files.items():
        path.write_bytes(data)
    return files


def test_a_finished_run_is_not_overwritten_without_force(work, unloadable_model, capsys):
    cfg = tiny_config(work / "rerun.yaml", model=unloadable_model)
    runs = work / "runs_finished"
    files = finished_run(runs)
    code, err = run_cli(fit_args(cfg, runs, "--trainer.logger.init_args.version", "0"), work, capsys)
    assert_one_line_error(code, err, "fit", f"run directory {runs / 'tiny' / 'version_0'} already holds a run",
                          "checkpoints/last.ckpt", "metrics.csv", "--force")
    assert all(p.read_bytes() == data for p, data in files.items())
    # --force passes this check: the next one to fail is the unloadable weights'
    code, err = run_cli(fit_args(cfg, runs, "--trainer.logger.init_args.version", "0", "--force", "true"), work, capsys)
    assert_one_line_error(code, err, "fit", "model.safetensors")


def test_a_run_directory_another_process_writes_is_refused(work, unloadable_model, capsys, tmp_path):
    """The lock is taken by util-linux's flock(1), not by lldslight: the lock is the kernel's."""
    cfg = tiny_config(work / "locked.yaml", model=unloadable_model)
    run = tmp_path / "tiny" / "version_0"
    run.mkdir(parents=True)
    lock = tmp_path / "tiny" / ".version_0.lock"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "60"])
    try:
        for _ in range(100):  # until flock holds it
            if subprocess.run(["flock", "-n", str(lock), "true"]).returncode != 0:
                break
            __import__("time").sleep(0.05)
        code, err = run_cli(fit_args(cfg, tmp_path, "--trainer.logger.init_args.version", "0"), work, capsys)
    finally:
        holder.kill()
        holder.wait()
    assert_one_line_error(code, err, "fit", f"run directory {run} is being written by another process")


def test_an_unwritable_save_dir_is_one_line(work, unloadable_model, capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    cfg = tiny_config(work / "unwritable.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, blocker / "runs"), work, capsys)
    assert_one_line_error(code, err, "fit", "cannot write the run directory", str(blocker / "runs"), "save_dir")


# --------------------------------------------------------------------------- knobs and sizes


def smollm_config(unloadable_model: Path) -> dict:
    """The model's config.json, read here as plain JSON (not through transformers)."""
    return json.loads((unloadable_model / "config.json").read_text())


def test_negative_max_steps_is_one_line(work, unloadable_model, capsys, tmp_path):
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, tmp_path / "runs", "--trainer.max_steps", "-5"), work, capsys)
    assert_one_line_error(code, err, "fit", "max_steps", "-5")


def test_an_infinite_temperature_is_one_line(work, unloadable_model, capsys, tmp_path):
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model, rollout={"temperature": float("inf")})
    code, err = run_cli(fit_args(cfg, tmp_path / "runs"), work, capsys)
    assert_one_line_error(code, err, "fit", "rollout.temperature must be finite", "inf")


def test_max_new_tokens_past_the_models_context_is_refused(work, unloadable_model, capsys, tmp_path):
    context = smollm_config(unloadable_model)["max_position_embeddings"]
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model, rollout={"max_new_tokens": 100000})
    code, err = run_cli(fit_args(cfg, tmp_path / "runs"), work, capsys)
    assert_one_line_error(code, err, "fit", "rollout.max_new_tokens must be <= the model's context",
                          f"({context} positions", "got 100000")
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model, rollout={"max_new_tokens": context})
    code, err = run_cli(fit_args(cfg, tmp_path / "runs"), work, capsys)
    assert "rollout.max_new_tokens must be" not in err, err[-2000:]  # exactly the context passes this check
    assert "must be at most 0 tokens" in err  # and then leaves no room for a prompt, which is said


def test_a_huge_group_is_refused_before_it_fills_the_memory(work, unloadable_model, capsys, tmp_path):
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model, rollout={"group_size": 100000})
    code, err = run_cli(fit_args(cfg, tmp_path / "runs"), work, capsys)
    assert_one_line_error(code, err, "fit", "rollout.group_size must be <=", "with data.batch_size 2", "got 100000",
                          "GiB of the memory available on this machine")


def test_the_row_bound_by_hand():
    """check_rows against a hand-worked example: SmolLM2-135M's shape (30 layers, 3 KV heads of 64,
    49,152 tokens), fp32, 120 response tokens: 30*2*3*64*4 = 46,080 B a token, 5,529,600 B of
    KV cache + 196,608 B of logits = 5,726,208 B a row; 1 GiB holds 187 rows, so 93 per prompt at 2 prompts."""
    from types import SimpleNamespace

    from lldslight.rollout.bounds import ModelShape, check_rows
    from lldslight.errors import ConfigError

    cfg = SimpleNamespace(num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, hidden_size=576,
                          max_position_embeddings=8192, vocab_size=49152)
    shape = ModelShape.of(cfg, 4)
    assert shape.row_bytes(120) == 5_726_208
    rollout = SimpleNamespace(max_response_tokens=120)
    check_rows(186, 2, 93, rollout, shape, 2**30, "1 GiB")
    with pytest.raises(ConfigError, match=r"rollout.group_size must be <= 93 with data.batch_size 2, got 94"):
        check_rows(188, 2, 94, rollout, shape, 2**30, "1 GiB")


def test_a_question_longer_than_the_context_is_named(work, unloadable_model, capsys, tmp_path, synth_kb):
    rows = [json.loads(line) for line in Path(synth_kb["train_jsonl"]).read_text().splitlines()[:4]]
    rows[2]["question"] = "Who wrote " + "very " * 200_000 + "long books?"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, tmp_path / "runs", "--data.train_files", f"[{train}]"), work, capsys)
    assert_one_line_error(code, err, "fit", f"the prompt of train question {rows[2]['id']!r}", "must be at most",
                          "rollout.max_new_tokens 12", "Who wrote very very")


def test_a_directory_as_val_files_is_one_line(work, capsys, tmp_path):
    """A runs directory given by mistake: datasets reads its CSV files and fails on their columns."""
    folder = tmp_path / "runs_by_mistake"
    for version, text in (("version_0", "step,a\n0,1\n"), ("version_1", "step,b,c\n0,1,x\n")):
        (folder / version).mkdir(parents=True)
        (folder / version / "metrics.csv").write_text(text)
    code, err = run_cli(fit_args(TINY, tmp_path / "runs", "--data.val_files", f"[{folder}]"), work, capsys)
    assert_one_line_error(code, err, "fit", str(folder), "neither a dataset saved with save_to_disk")


def test_no_deprecated_key_in_a_shipped_config():
    """policy.dtype is deprecated (policy.precision replaced it; lldslight/policy/config.py warns)."""
    found = []
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        policy = ((yaml.safe_load(path.read_text()) or {}).get("model") or {}).get("policy") or {}
        if "dtype" in policy:
            found.append(str(path.relative_to(ROOT)))
    assert not found, found


# --------------------------------------------------------------------------- checkpoints


def test_a_checkpoints_directory_as_ckpt_path_is_named(work, capsys, tmp_path):
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    (ckpts / "last.ckpt").write_bytes(b"x")
    code, err = run_cli(["validate", "--config", str(TINY), "--ckpt_path", str(ckpts)], work, capsys)
    assert_one_line_error(code, err, "validate", f"--ckpt_path {ckpts} is a directory", f"--ckpt_path {ckpts / 'last.ckpt'}")


def test_a_plain_torch_save_file_is_not_a_checkpoint(work, capsys, tmp_path):
    plain = tmp_path / "weights.ckpt"
    torch.save({"w": torch.ones(3)}, plain)
    code, err = run_cli(["validate", "--config", str(TINY), "--ckpt_path", str(plain)], work, capsys)
    assert_one_line_error(code, err, "validate", str(plain), "not a Lightning checkpoint")


def test_the_offered_checkpoint_is_a_lightning_one(work, capsys, tmp_path):
    d = tmp_path / "checkpoints"
    d.mkdir()
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0"}, d / "epoch=0-step=1.ckpt")
    os.utime(d / "epoch=0-step=1.ckpt", (1_000_000, 1_000_000))
    torch.save({"w": torch.ones(3)}, d / "newer_plain.ckpt")  # newer, readable, not a Lightning checkpoint
    (d / "last.ckpt").write_bytes(b"PK\x03\x04 truncated")
    code, err = run_cli(["validate", "--config", str(TINY), "--ckpt_path", str(d / "last.ckpt")], work, capsys)
    assert_one_line_error(code, err, "validate", f"the newest valid checkpoint beside it is {d / 'epoch=0-step=1.ckpt'}")


def test_resume_override_takes_random_init_keys(work, module_checkpoint, capsys, tmp_path):
    """The keys the resume line suggests for a random_init that differs, including those your config
    does not set, are accepted (they were an NSKeyError traceback), and the line says they are yours.
    (validate: the fixture's checkpoint holds weights, not an optimiser state to resume.)"""
    cfg = tmp_path / "deeper.yaml"
    cfg.write_text("model:\n  policy:\n    random_init: {num_hidden_layers: 3}\n")
    base = ["validate", "--config", str(TINY), "--config", str(cfg), "--ckpt_path", str(module_checkpoint),
            "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")]
    code, err = run_cli(base + ["--model.policy.precision", "null"], work, capsys)
    said = [l for l in err.splitlines() if l.startswith("[lldslight] resuming from")]
    assert said, err[-2000:]
    suggested = said[0].rpartition("--resume_override ")[2].split(" ")[0]
    assert "model.policy.random_init.hidden_size" in suggested, said[0]  # a key your random_init does not have
    for keys in (suggested, "model.policy.random_init.hidden_size", "all"):
        code, err = run_cli(base + ["--model.policy.precision", "null", "--resume_override", keys], work, capsys)
        assert "Traceback" not in err and "KeyError" not in err, err[-3000:]
        said = [l for l in err.splitlines() if l.startswith("[lldslight] resuming from")]
        assert said and "yours by --resume_override: " in said[0], err[-2000:]
        assert code == 0 or len([l for l in err.splitlines() if l.startswith("lldslight validate: error:")]) == 1, err[-2000:]


# --------------------------------------------------------------------------- the other commands


def test_data_synth_does_not_replace_the_users_files(work, capsys, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "train.jsonl").write_text('{"question": "mine"}\n')
    code, err = run_cli(["data", "synth", "--out", str(out), "--entities", "30", "--dev", "2", "--test", "2"], work, capsys)
    assert_one_line_error(code, err, "data", str(out), "train.jsonl", "--force")
    assert (out / "train.jsonl").read_text() == '{"question": "mine"}\n'
    assert sorted(p.name for p in out.iterdir()) == ["train.jsonl"]
    code, err = run_cli(["data", "synth", "--out", str(out), "--entities", "30", "--dev", "2", "--test", "2", "--force"],
                        work, capsys)
    assert code == 0, err[-2000:]
    # a second synthesis with other settings replaces the first one's files: they are its own
    code, err = run_cli(["data", "synth", "--out", str(out), "--entities", "31", "--dev", "2", "--test", "2"], work, capsys)
    assert code == 0, err[-2000:]


def test_sft_does_not_overwrite_the_users_model_directory(work, capsys, tmp_path, synth_kb):
    from tests.conftest import TINY_DIMS

    out = tmp_path / "my_model"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}')
    args = ["sft", "--data", str(synth_kb["train_jsonl"]), "--corpus", str(synth_kb["corpus"]), "--out", str(out),
            "--limit", "2", "--random-init", json.dumps(TINY_DIMS), "--lora-r", "4"]
    code, err = run_cli(args, work, capsys)
    line = assert_one_line_error(code, err, "sft", f"--out {out} is not empty (it holds config.json)", "--force")
    assert "gold trajectories" not in err, "the check ran after the training set was built"
    assert (out / "config.json").read_text() == '{"mine": true}', line


def test_a_closed_pipe_ends_data_synth_quietly(tmp_path):
    """`lldslight data synth ... | head -c 1`: the reader leaves; no BrokenPipeError traceback."""
    for i in range(3):
        proc = subprocess.Popen(f"{sys.executable} -m lldslight.cli data synth --out {tmp_path / str(i)} --entities 30 "
                                f"--dev 2 --test 2 | head -c 1 >/dev/null; echo ${{PIPESTATUS[0]}} >&2",
                                shell=True, executable="/bin/bash", cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, PYTHONPATH=str(ROOT)))
        _, err = proc.communicate(timeout=300)
        assert "Traceback" not in err and "BrokenPipeError" not in err, err[-2000:]
        assert err.strip().splitlines()[-1] in ("0", "141"), err[-2000:]


def test_plot_out_names_an_unwritable_format_or_place(work, capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    columns = ("train/reward", "lld/logp_pos", "lld/logp_neg", "train/entropy", "train/grad_norm")  # what a plot needs
    (run / "metrics.csv").write_text("step," + ",".join(columns) + "\n" + "".join(f"{i},0.5,-1,-2,1,0.1\n" for i in range(3)))
    code, err = run_cli(["plot", str(run), "--out", str(tmp_path / "x.txt")], work, capsys)
    assert_one_line_error(code, err, "plot", "--out", "x.txt", "matplotlib cannot write .txt", ".png")
    blocker = tmp_path / "file"
    blocker.write_text("x")
    code, err = run_cli(["plot", str(run), "--out", str(blocker / "lld.png")], work, capsys)
    assert_one_line_error(code, err, "plot", "--out", f"cannot write {blocker / 'lld.png'}")


def test_a_bad_byte_in_metrics_csv_is_named_at_its_offset(work, capsys, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    text = b"step,train/reward\n" + b"".join(b"%d,0.5\n" % i for i in range(40))
    data = text[:200] + b"\xff" + text[200:]
    (run / "metrics.csv").write_bytes(data)
    line = data[:200].count(b"\n") + 1
    code, err = run_cli(["plot", str(run)], work, capsys)
    assert_one_line_error(code, err, "plot", "not UTF-8", "b'\\xff' at offset 200", f"line {line}")


def test_an_unwritable_model_cache_names_lldslight_cache(work, tmp_path):
    """HOME is a regular file, so ~/.cache cannot be made: the line names the cache and the
    variable that moves it."""
    home = tmp_path / "home_file"
    home.write_text("x")
    env = {k: v for k, v in os.environ.items() if k != "LLDSLIGHT_CACHE"}
    env.update(HOME=str(home), HF_HOME=str(tmp_path / "hf"), PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "lldslight.cli", "fit", "--config", str(TINY),
                           "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")], cwd=work, env=env,
                          capture_output=True, text=True, timeout=600)
    assert_one_line_error(proc.returncode, proc.stderr, "fit", "cannot write the model cache", str(home), "LLDSLIGHT_CACHE")


# --------------------------------------------------------------------------- a full disk


def test_a_full_disk_during_a_checkpoint_write_names_it(tmp_path):
    path = tmp_path / "checkpoints" / "last.ckpt"
    script = (
        "import sys, torch\n"
        "from pathlib import Path\n"
        "from lldslight.run.checkpoint_io import AtomicCheckpointIO\n"
        "from lldslight.errors import UserError\n"
        f"path = Path({str(path)!r})\n"
        "io = AtomicCheckpointIO()\n"
        "io.save_checkpoint({'step': 1}, path)\n"
        "try:\n"
        "    io.save_checkpoint({'step': 2, 'w': torch.ones(1_000_000)}, path)\n"
        "except UserError as e:\n"
        "    print(e)\n"
        "    sys.exit(2)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)), preexec_fn=limited_fsize(1_000_000))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"cannot write checkpoint {path}" in proc.stdout and "the previous last.ckpt is intact" in proc.stdout
    assert torch.load(path, weights_only=True) == {"step": 1}
    assert sorted(os.listdir(path.parent)) == ["last.ckpt"]


def test_a_full_disk_during_export_leaves_no_half_model(work, module_checkpoint, tmp_path):
    out = tmp_path / "exported"
    proc = child(["export", "--ckpt", str(module_checkpoint), "--out", str(out)], tmp_path, nbytes=2_000_000)
    assert_one_line_error(proc.returncode, proc.stderr, "export", f"cannot write {out}", "nothing was written there")
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


def test_a_full_disk_during_index_is_one_line(synth_kb, tmp_path):
    out = tmp_path / "index"
    proc = child(["index", "--corpus", str(synth_kb["corpus"]), "--out", str(out)], tmp_path, nbytes=4_000)
    assert_one_line_error(proc.returncode, proc.stderr, "index", str(out), "nothing was written there")
    assert sorted(os.listdir(tmp_path)) == [], os.listdir(tmp_path)


def test_an_unwritable_export_out_is_one_line_before_loading(work, module_checkpoint, capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, err = run_cli(["export", "--ckpt", str(module_checkpoint), "--out", str(blocker / "exported")], work, capsys)
    assert_one_line_error(code, err, "export", "--out", f"cannot write to {blocker}")
    assert "policy.precision" not in err  # said before the model was built (load_policy announces its precision)


@pytest.mark.parametrize("command", ["fit", "validate"])
def test_a_folder_of_data_files_is_not_read_as_a_dataset(work, unloadable_model, capsys, tmp_path, synth_kb, command):
    """A folder given as a data file, with a train.jsonl two levels down: datasets.load_dataset would
    read it as a dataset folder and train.jsonl would silently become the validation set."""
    import shutil

    folder = tmp_path / "somefolder"
    (folder / "a" / "b").mkdir(parents=True)
    shutil.copy(synth_kb["train_jsonl"], folder / "a" / "b" / "train.jsonl")
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model)
    args = fit_args(cfg, tmp_path / "runs", "--data.val_files", f"[{folder}]")
    code, err = run_cli([command, *args[1:]], work, capsys)
    assert_one_line_error(code, err, command, str(folder), "a directory", "save_to_disk", ".parquet, .jsonl or .json")


@pytest.mark.parametrize("overlay, extra, needles", [
    ("model: {update: null}\n", [], ["model.update must be a mapping of settings", "got None"]),
    ("model: {optim: [0.001]}\n", [], ["model.optim must be a mapping of settings", "got [0.001]", "lr"]),
    ("model: {policy: 3}\n", [], ["model.policy must be a mapping of settings", "got 3"]),
], ids=["update-null", "optim-list", "policy-scalar"])
def test_a_settings_group_given_as_a_value_is_one_line(work, capsys, tmp_path, overlay, extra, needles):
    """A group of model settings (model.update, model.optim, ...) written as null, a list or a
    scalar: jsonargparse's TypeError about functools.partial, after the config was read."""
    (tmp_path / "o.yaml").write_text(overlay)
    code, err = run_cli(["fit", "--config", str(TINY), "--config", str(tmp_path / "o.yaml"), *extra,
                         "--trainer.logger.init_args.save_dir", str(tmp_path / "runs")], work, capsys)
    assert_one_line_error(code, err, "fit", *needles)
    assert "functools.partial" not in err


@pytest.mark.parametrize("callback", [
    "{class_path: lldslight.callbacks.AdaptiveRate, init_args: {target_kl: 0.02}}",
    "{class_path: lldslight.callbacks.GradientSpikeGuard}",
], ids=["AdaptiveRate", "GradientSpikeGuard"])
def test_a_stateful_callback_given_twice_is_one_line(work, unloadable_model, capsys, tmp_path, callback):
    """Lightning keeps one state per stateful callback class in a checkpoint: its RuntimeError was
    33 lines; said once, before the model loads, with both entries."""
    cfg = tiny_config(tmp_path / "t.yaml", model=unloadable_model)
    (tmp_path / "o.yaml").write_text(f"trainer:\n  callbacks+:\n    - {callback}\n    - {callback}\n")
    code, err = run_cli(fit_args(cfg, tmp_path / "runs", "--config", str(tmp_path / "o.yaml")), work, capsys)
    name = callback.split("class_path: ")[1].split(",")[0].rstrip("}").rpartition(".")[2]
    assert_one_line_error(code, err, "fit", f"trainer.callbacks: {name} is given twice (entries 3 and 4)", "remove one")


def read_only_dir(tmp_path: Path) -> Path:
    """A directory this process cannot write: a mode-555 one, unless root ignores the mode; then
    sysfs, which refuses new entries to root too; else the test is skipped."""
    mine = tmp_path / "read_only"
    mine.mkdir()
    mine.chmod(0o555)
    for candidate in (mine, Path("/sys")):
        try:
            (candidate / "lldslight-write-probe").mkdir()
        except OSError:
            return candidate
        (candidate / "lldslight-write-probe").rmdir()
    pytest.skip("no directory here refuses this process's writes")


def test_data_synth_into_an_unwritable_place_is_one_line(work, capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    small = ["--entities", "30", "--dev", "2", "--test", "2"]
    code, err = run_cli(["data", "synth", "--out", str(blocker / "kb"), *small], work, capsys)
    assert_one_line_error(code, err, "data", f"cannot write to {blocker / 'kb'}", "--out")
    assert blocker.read_text() == "x"
    read_only = read_only_dir(tmp_path)
    code, err = run_cli(["data", "synth", "--out", str(read_only / "kb"), *small], work, capsys)
    assert_one_line_error(code, err, "data", f"cannot write to {read_only / 'kb'}")
    # from a read-only working directory: the config's relative out_dir is there
    code, err = run_cli(["data", "synth", "--config", str(ROOT / "configs" / "demo.yaml")], read_only, capsys)
    out_dir = yaml.safe_load((ROOT / "configs" / "demo.yaml").read_text())["data"]["synthesize"]["out_dir"]
    assert_one_line_error(code, err, "data", f"cannot write to {out_dir}", "data.synthesize.out_dir")


def test_serve_a_file_as_the_index_is_one_line(work, capsys, synth_kb):
    corpus = synth_kb["corpus"]
    code, err = run_cli(["serve", "--index", str(corpus)], work, capsys)
    assert_one_line_error(code, err, "serve", f"{corpus} is a file, not an index directory",
                          f"lldslight index --corpus {corpus}")


@pytest.mark.slow
def test_a_full_disk_at_a_later_checkpoint_names_the_earlier_ones(work, capsys, tmp_path, monkeypatch):
    """Step 2's checkpoint meets a full disk (ENOSPC while torch writes it); step 1's last.ckpt and
    epoch=0-step=1.ckpt are there: the line names them, not "no earlier checkpoint"."""
    import errno

    real_save = torch.save

    def full_disk_at_step_2(obj, f, *args, **kwargs):
        if "step=2" in str(getattr(f, "name", f)):
            f.write(b"\0" * 4096)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk_at_step_2)
    code, err = run_cli(fit_args(TINY, tmp_path / "runs", "--trainer.logger.init_args.version", "0"), work, capsys)
    checkpoints = tmp_path / "runs" / "tiny" / "version_0" / "checkpoints"
    line = assert_one_line_error(code, err, "fit", f"cannot write checkpoint {checkpoints / 'epoch=0-step=2.ckpt'}",
                                 "No space left on device", f"the checkpoints written before are intact, the newest "
                                 f"{checkpoints / 'last.ckpt'}: resume with --ckpt_path {checkpoints / 'last.ckpt'}")
    assert "no earlier checkpoint was there" not in line
    assert sorted(p.name for p in checkpoints.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]
    assert torch.load(checkpoints / "last.ckpt", weights_only=False)["global_step"] == 1

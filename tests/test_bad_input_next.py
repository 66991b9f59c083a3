"""The next round of bad input (docs/errors_and_resume.md): each case ends in one line naming the
file, key or value (exit 2), before the policy loads where the input allows, or does what the docs
promise; nothing the user made is lost or overwritten.

"Before the policy loads" uses tests/test_bad_input.py's model directory (SmolLM2's real config.json,
30 decoder layers, and a garbage weights file): a test that sees its own message proves its check
ran first.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.test_bad_input import assert_one_line_error, run_cli, tiny_config, unloadable_model, work  # noqa: F401


def fit_args(cfg: Path, runs: Path, *extra: str) -> list[str]:
    return ["fit", "--config", str(cfg), "--trainer.logger.init_args.save_dir", str(runs), *extra]


# --------------------------------------------------------------------------- the layers a config names


@pytest.mark.parametrize("layers, needles", [
    # peft read [] as "no restriction": every layer trained
    ("[]", ["model.policy.lora.layers_to_transform must be a non-empty list", "got []"]),
    ("[-1]", ["model.policy.lora.layers_to_transform must be decoder layer indices, integers >= 0", "got [-1]"]),
    ("[3, 3]", ["model.policy.lora.layers_to_transform must be a list of distinct layer indices"]),
    # SmolLM2-135M has 30 decoder layers: 30 is one past the last (peft's IndexError)
    ("[29, 30]", ["model.policy.lora.layers_to_transform must be layer indices in 0..29 (the model's 30 decoder layers)",
                  "got [29, 30]"]),
])
def test_lora_layers_are_checked_before_the_model_loads(work, unloadable_model, capsys, layers, needles):
    cfg = tiny_config(work / "layers.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_layers", "--model.policy.lora.layers_to_transform", layers), work, capsys)
    assert_one_line_error(code, err, "fit", *needles)


def test_frozen_layers_past_the_model_are_named_with_their_full_key_before_loading(work, unloadable_model, capsys):
    cfg = tiny_config(work / "freeze.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_freeze", "--model.policy.lora", "null",
                                 "--model.policy.freeze_bottom_layers", "30"), work, capsys)
    assert_one_line_error(code, err, "fit", "model.policy.freeze_bottom_layers must be < the model's 30 decoder layers, got 30")
    code, err = run_cli(fit_args(cfg, work / "runs_freeze", "--model.policy.freeze_bottom_layers", "2"), work, capsys)
    assert_one_line_error(code, err, "fit", "model.policy.freeze_bottom_layers must be 0 with model.policy.lora set, got 2")


# --------------------------------------------------------------------------- the drift bound's settings


def adaptive_rate(**init_args) -> str:
    """An overlay appending AdaptiveRate with ``init_args`` (YAML flow values)."""
    args = ", ".join(f"{k}: {v}" for k, v in {"target_kl": 0.001, **init_args}.items())
    return f"trainer:\n  callbacks+:\n    - class_path: lldslight.callbacks.AdaptiveRate\n      init_args: {{{args}}}\n"


@pytest.mark.parametrize("overlay, needles", [
    # step 0 trained at lr inf and saved every trainable weight non-finite
    (adaptive_rate(lr_min=".inf"), ["AdaptiveRate.lr_min/lr_max must be 0 < lr_min <= lr_max, lr_min finite", "got (inf, None)"]),
    # the configured rate is the ceiling (tiny.yaml: 1e-3): lr_min above it trained at 10x
    (adaptive_rate(lr_min="1.0e-2"), ["AdaptiveRate.lr_min must be <= the rate's ceiling, min(lr_max, max_scale x "
                                      "model.optim.lr) = 0.001, got 0.01"]),
    # failed after a whole step, naming the wrong metric
    (adaptive_rate(metric="drift/nosuch"), ["AdaptiveRate.metric must be a drift metric the update logs (",
                                            "drift/kl_k3_last", "got 'drift/nosuch'"]),
    # ranges that inf satisfies
    ("model:\n  update: {target_kl: 0.001, target_kl_factor: .inf}\n",
     ["model.update.target_kl_factor must be a finite number >= 1", "got inf"]),
    ("model:\n  update: {frozen_prefix_max_mb: .inf}\n", ["model.update.frozen_prefix_max_mb must be a finite number >= 0", "got inf"]),
])
def test_drift_bound_settings_are_one_line_before_the_model_loads(work, unloadable_model, capsys, overlay, needles):
    cfg = tiny_config(work / "drift.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_drift", "--config", overlay), work, capsys)
    assert_one_line_error(code, err, "fit", *needles)


def test_a_metric_no_step_logged_is_named_with_the_one_the_update_logs():
    from types import SimpleNamespace

    from lldslight.callbacks import AdaptiveRate
    from lldslight.errors import ConfigError

    rate = AdaptiveRate(target_kl=0.001, metric="train/nosuch")
    rate.base = [1e-3]
    module = SimpleNamespace(last_step_metrics={"drift/kl_k3_last": 0.002, "drift/signal": 1.0})
    with pytest.raises(ConfigError) as caught:
        rate.on_train_batch_end(None, module, None, None, 0)
    assert str(caught.value) == ("AdaptiveRate.metric must be a metric the step logged (GRPOModule's update logs "
                                 "'drift/kl_k3_last', the default), got 'train/nosuch'")


def test_the_drift_preset_with_heals_rate_remedy_is_refused_before_the_model_loads(work, unloadable_model, capsys):
    """docs/stability.md: AdaptiveRate is not to be combined with Heal's rate remedy (both set the base rate)."""
    from tests.conftest import ROOT

    cfg = tiny_config(work / "stable_heal.yaml", model=unloadable_model)
    configs = [str(ROOT / "configs" / name) for name in ("monitor.yaml", "stable.yaml", "heal.yaml")]
    code, err = run_cli(fit_args(cfg, work / "runs_stable_heal", *(a for c in configs for a in ("--config", c))), work, capsys)
    assert_one_line_error(code, err, "fit", "Heal's rate remedy (lr_factor 0.5, end_warmup True) with AdaptiveRate",
                          "lr_factor: null and end_warmup: false")
    # its other remedies combine
    code, err = run_cli(fit_args(cfg, work / "runs_stable_heal", *(a for c in configs for a in ("--config", c)), "--config",
                                 "trainer:\n  callbacks+:\n    - class_path: lldslight.callbacks.Heal\n"
                                 "      init_args: {lr_factor: null, end_warmup: false, kl_coef: 0.05}\n"), work, capsys)
    assert "rate remedy" not in err, err[-3000:]


@pytest.mark.slow
def test_a_resume_that_changes_only_the_controllers_target_is_refused(work, capsys):
    """A resume takes model.update.target_kl (the early stop) from the checkpoint and AdaptiveRate's
    target from the config: changing the target in both places moved the controller's only."""
    cfg = tiny_config(work / "target.yaml")
    runs = work / "runs_target"
    first = "model:\n  update: {target_kl: 0.001}\n" + adaptive_rate()
    code, err = run_cli(fit_args(cfg, runs, "--config", first, "--trainer.max_steps", "1",
                                 "--trainer.logger.init_args.version", "0"), work, capsys)
    assert code == 0, err[-3000:]
    changed = "model:\n  update: {target_kl: 0.002}\n" + adaptive_rate(target_kl=0.002)
    ckpt = str(runs / "tiny" / "version_0" / "checkpoints" / "last.ckpt")
    code, err = run_cli(fit_args(cfg, runs, "--config", changed, "--trainer.max_steps", "2", "--trainer.logger.init_args.version",
                                 "0", "--ckpt_path", ckpt), work, capsys)
    assert_one_line_error(code, err, "fit", "AdaptiveRate.target_kl changed since the checkpoint (0.001 -> 0.002) but "
                          "model.update.target_kl (the early stop) is still the checkpoint's 0.001",
                          "--resume_override model.update.target_kl")
    # changing both, as the line says, resumes
    code, err = run_cli(fit_args(cfg, runs, "--config", changed, "--trainer.max_steps", "2", "--trainer.logger.init_args.version",
                                 "0", "--ckpt_path", ckpt, "--resume_override", "model.update.target_kl"), work, capsys)
    assert code == 0, err[-3000:]


# --------------------------------------------------------------------------- composing configs


def test_an_overlay_given_before_its_base_is_refused(work, capsys):
    """configs/stable.yaml appends AdaptiveRate (`callbacks+:`) and sets model.update.target_kl; tiny.yaml
    after it writes `callbacks:`, which replaced the list: AdaptiveRate was dropped, the early stop kept."""
    from tests.conftest import ROOT

    stable, tiny = ROOT / "configs" / "stable.yaml", ROOT / "configs" / "tiny.yaml"
    code, err = run_cli(["fit", "--config", str(stable), "--config", str(tiny)], work, capsys)
    assert_one_line_error(code, err, "fit", f"{tiny}: `trainer.callbacks:` replaces the callbacks that {stable} appended "
                          f"with `callbacks+:` (AdaptiveRate)", f"give {tiny} before {stable}")


@pytest.mark.parametrize("package, logger, extra", [("tensorboard", "TensorBoardLogger", "tensorboard"),
                                                    ("wandb", "WandbLogger", "wandb")])
def test_a_logger_whose_package_is_missing_names_the_package_and_the_extra(work, capsys, monkeypatch, package, logger, extra):
    from tests.conftest import ROOT

    traces = ROOT / "configs" / "traces.yaml"
    hidden = (package, "tensorboardX") if package == "tensorboard" else (package,)
    for name in list(sys.modules):
        if name.split(".")[0] in hidden:
            monkeypatch.delitem(sys.modules, name)
    for name in hidden:
        monkeypatch.setitem(sys.modules, name, None)  # an import of it raises ImportError: as if not installed
    code, err = run_cli(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--config", str(traces)], work, capsys)
    assert_one_line_error(code, err, "fit", f"{traces}: trainer.logger+ {logger} needs the {package} package, which is not "
                          f"installed: pip install -e '.[{extra}]' in your lldslight clone")


SECOND_LOGGER = ("trainer:\n  logger+:\n    - class_path: lightning.pytorch.loggers.CSVLogger\n"
                 "      init_args: {save_dir: runs, name: second}\n")


@pytest.mark.slow
def test_logger_flags_set_the_first_logger_when_there_are_several(tmp_path, capsys):
    """With a second logger appended (as configs/traces.yaml appends two), the documented
    --trainer.logger.init_args.version/name went to the last one: the run directory kept the base's name."""
    cfg = tiny_config(tmp_path / "two_loggers.yaml")
    code, err = run_cli(fit_args(cfg, tmp_path / "runs", "--config", SECOND_LOGGER, "--trainer.max_steps", "1",
                                 "--trainer.logger.init_args.name", "mine", "--trainer.logger.init_args.version", "llds"),
                        tmp_path, capsys)
    assert code == 0, err[-3000:]
    assert (tmp_path / "runs" / "mine" / "llds" / "checkpoints" / "last.ckpt").is_file()
    assert (tmp_path / "runs" / "mine" / "llds" / "metrics.csv").is_file()
    assert sorted(p.name for p in (tmp_path / "runs" / "second").iterdir() if p.is_dir()) == ["version_0"]  # its own, as configured


@pytest.mark.slow
def test_ckpt_path_last_finds_the_checkpoint_with_a_second_logger(tmp_path, capsys):
    """Numbered versions and a second logger: --ckpt_path last found no checkpoint and trained from step 0."""
    import csv

    import torch

    cfg = tiny_config(tmp_path / "two_loggers.yaml")
    runs = tmp_path / "runs"
    code, err = run_cli(fit_args(cfg, runs, "--config", SECOND_LOGGER, "--trainer.max_steps", "1"), tmp_path, capsys)
    assert code == 0, err[-3000:]
    code, err = run_cli(fit_args(cfg, runs, "--config", SECOND_LOGGER, "--trainer.max_steps", "2", "--ckpt_path", "last"),
                        tmp_path, capsys)
    assert code == 0, err[-3000:]
    assert "no earlier run has a checkpoint" not in err, err[-3000:]
    resumed = runs / "tiny" / "version_1"
    assert torch.load(resumed / "checkpoints" / "last.ckpt", weights_only=False, map_location="cpu")["global_step"] == 2
    with open(resumed / "metrics.csv") as f:
        steps = {int(r["step"]) for r in csv.DictReader(f) if r.get("train/reward")}
    assert steps == {1}, steps  # one step trained, from the checkpoint's


# --------------------------------------------------------------------------- the per-turn tables


def trajectory_table(**init_args) -> str:
    args = ", ".join(f"{k}: {v}" for k, v in init_args.items())
    return f"trainer:\n  callbacks+:\n    - class_path: lldslight.callbacks.TrajectoryTable\n      init_args: {{{args}}}\n"


def test_a_table_folder_that_cannot_be_written_fails_before_the_model_loads(work, unloadable_model, capsys):
    in_the_way = work / "a_file"
    in_the_way.write_text("mine\n")
    cfg = tiny_config(work / "table.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_table", "--config", trajectory_table(out_dir=str(in_the_way / "tables"))),
                        work, capsys)
    assert_one_line_error(code, err, "fit", f"TrajectoryTable.out_dir: cannot write to {in_the_way / 'tables'}: Not a directory")
    assert in_the_way.read_text() == "mine\n"


def test_two_tables_writing_the_same_files_are_refused_before_the_model_loads(work, unloadable_model, capsys):
    cfg = tiny_config(work / "tables2.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_tables2", "--config", trajectory_table(every_n_steps=1), "--config",
                                 trajectory_table(every_n_steps=5, num_samples=2)), work, capsys)
    assert_one_line_error(code, err, "fit", "trainer.callbacks: two TrajectoryTable write the files step_NNNNNN.md in",
                          "give each its own out_dir and key")


def test_a_full_disk_leaves_no_partial_step_file(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from lldslight.callbacks.traces import TrajectoryTable
    from lldslight.errors import UserError

    real = Path.write_text

    def half_then_full(self, data, *args, **kwargs):  # what a full disk does: part of the text, then ENOSPC
        real(self, data[: len(data) // 2], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_full)
    table = TrajectoryTable(out_dir=str(tmp_path / "tables"))
    row = {c: "x" for c in ("step", "rollout", "group", "turn", "question", "gold", "action", "kind", "query", "observation",
                             "answer", "reward", "advantage", "finish")}
    with pytest.raises(UserError, match=r"TrajectoryTable: cannot write .*step_000003\.md: No space left on device"):
        table.write(SimpleNamespace(log_dir=str(tmp_path), loggers=[]), [row], 3)
    assert list((tmp_path / "tables").iterdir()) == []  # no 0-byte or half step file


def test_control_characters_from_the_data_are_shown_as_escapes():
    from lldslight.callbacks.traces import COLUMNS, TrajectoryTable

    row = dict.fromkeys(COLUMNS, "")
    row["question"] = "who\x1b[2J wrote\x07 it \u202eesrever"  # clear-screen, bell, right-to-left override
    text = TrajectoryTable().markdown([row])
    assert not any(c in text for c in "\x1b\x07\u202e")
    assert "who\\x1b[2J wrote\\x07 it \\u202eesrever" in text.splitlines()[2]


# --------------------------------------------------------------------------- data files


@pytest.mark.parametrize("name, text", [
    ("train.jsonl", b'{"question": "q1", "golden_answers": ["a"]}\n{"question": "caf\xe9", "golden_answers": ["b"]}\n'),
    ("train.json", b'[{"question": "q1", "golden_answers": ["a"]},\n {"question": "caf\xe9", "golden_answers": ["b"]}]\n'),
])
def test_a_data_file_that_is_not_utf8_is_named_with_its_line(work, unloadable_model, capsys, name, text):
    """A Latin-1 'é' in line 2: a traceback in fit, a line naming no file in `data inspect`."""
    from lldslight.data.cli import main as data_main

    bad = work / f"latin1_{name}"
    bad.write_bytes(text)
    needle = f"{bad}, line 2: not UTF-8 text (byte b'\\xe9' at column "
    assert data_main(["inspect", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lldslight data: error: ") and needle in err and len(err.strip().splitlines()) == 1, err
    cfg = tiny_config(work / "latin1.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_latin1", "--data.train_files", f"[{bad}]"), work, capsys)
    assert_one_line_error(code, err, "fit", needle)


# --------------------------------------------------------------------------- W&B online


WANDB_ONLINE = ("trainer:\n  logger+:\n    - class_path: lightning.pytorch.loggers.WandbLogger\n"
                "      init_args: {save_dir: runs, project: lldslight-test, offline: false}\n")


@pytest.fixture
def wandb_home(tmp_path, monkeypatch):
    """No W&B credentials anywhere wandb looks (environment, settings, netrc)."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "NETRC", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    yield tmp_path
    # wandb reads its settings once per process: without this a later test's offline run would still
    # ask this test's dead server for its resume status
    import wandb

    wandb.teardown()


def test_wandb_online_without_a_key_is_one_line_before_the_model_loads(work, unloadable_model, capsys, wandb_home):
    cfg = tiny_config(work / "wandb.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_wandb", "--config", WANDB_ONLINE), work, capsys)
    assert_one_line_error(code, err, "fit", "trainer.logger WandbLogger (offline: false): no W&B API key for ",
                          "set WANDB_API_KEY", "offline: true")


def test_wandb_online_with_its_server_out_of_reach_is_one_line_before_the_model_loads(work, unloadable_model, capsys,
                                                                                     wandb_home, monkeypatch):
    from tests.test_bad_input import dead_port

    url = f"http://127.0.0.1:{dead_port()}"
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef" * 5)
    monkeypatch.setenv("WANDB_BASE_URL", url)
    cfg = tiny_config(work / "wandb_dead.yaml", model=unloadable_model)
    code, err = run_cli(fit_args(cfg, work / "runs_wandb_dead", "--config", WANDB_ONLINE), work, capsys)
    assert_one_line_error(code, err, "fit", f"trainer.logger WandbLogger (offline: false): the W&B server {url} is out of reach (")


# --------------------------------------------------------------------------- the lab's scripts


@pytest.mark.parametrize("script, args, line", [
    ("collapse.py", ["--hold", "0", "--name", "x"], "collapse: --hold must be >= 1 (consecutive steps the collapse condition holds), got 0"),
    ("join_metrics.py", ["{tmp}/a.csv", "{tmp}/b.csv", "{tmp}/out.csv", "--from-step", "3"], "join_metrics: {tmp}/a.csv: no such file"),
    ("confirmatory.py", ["--c3", "--demo", "{tmp}/none"], "confirmatory: --demo {tmp}/none: no such directory; give "),
])
def test_a_lab_script_refusal_is_one_line_and_exit_2(tmp_path, script, args, line):
    """Run by path as the docs show: the refusal is the only line on stderr, exit 2 (bad input), as
    lldslight's own commands; nothing is written."""
    import subprocess

    args = [a.format(tmp=tmp_path) for a in args]
    done = subprocess.run([sys.executable, str(ROOT / "lab" / script), *args], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith(line.format(tmp=tmp_path)) and done.stderr.count("\n") == 1, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_script_main_turns_a_message_into_exit_2_and_keeps_other_exits(capsys):
    from lldslight.errors import script_main

    def refuses():
        raise SystemExit("tool: --x 3: not allowed")

    assert script_main(refuses) == 2 and capsys.readouterr().err == "tool: --x 3: not allowed\n"
    assert script_main(lambda: 0) == 0 and script_main(lambda: None) == 0 and script_main(lambda: 143) == 143
    with pytest.raises(SystemExit) as stop:
        script_main(lambda: sys.exit(130))
    assert stop.value.code == 130


@pytest.mark.parametrize("script", ["record.py", "drift_targets.py", "alarm_eval.py", "heal_eval.py", "calib_c.py"])
def test_a_lab_scripts_json_in_a_missing_folder_is_refused_before_the_work(tmp_path, script):
    """--json names a file written at the end: a missing folder is refused first (exit 2, one line), not
    after the analysis."""
    import subprocess

    target = tmp_path / "no" / "such" / "out.json"
    extra = {"drift_targets.py": ["--describe"], "alarm_eval.py": ["--calibrate", "a", "--test", "b"],
             "heal_eval.py": ["--healed", "a", "--unhealed", "b"]}.get(script, [])
    done = subprocess.run([sys.executable, str(ROOT / "lab" / script), *extra, "--json", str(target)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"{script[:-3]}: --json {target}: no such directory {target.parent}\n"
    assert done.stdout == ""

"""Per-turn traces where people read them (lldslight/callbacks/traces.py, configs/traces.yaml).

Everything is read back from the files the loggers wrote, with the loggers' own readers
(TensorBoard's EventAccumulator; an offline W&B run's ``.wandb`` records and table files,
tests/wandb_files.py), and compared with the rollouts themselves:

- the table's rows, a row per turn, against a rollout batch of the protocol-trained model
  (searches, observations, answers): each cell against the Trajectory's fields, the observation
  against the retriever's passages formatted by the protocol, in TensorBoard and in W&B alike;
- a real fit composed with configs/traces.yaml: the table at its step in both, its rows against
  the step's rollouts, and every per-step metric in both equal to metrics.csv's.
"""
from __future__ import annotations

import csv
import math
import re

import lightning.pytorch as pl

import pytest
import torch

from lldslight.callbacks.traces import COLUMNS, TrajectoryTable
from lldslight.rollout import RolloutConfig, RolloutEngine
from lldslight.rollout.protocol import format_observation
from tests import wandb_files
from tests.conftest import ROOT

pytest.importorskip("tensorboard")
pytest.importorskip("wandb")


@pytest.fixture
def offline_wandb(tmp_path, monkeypatch):
    """W&B offline, quiet, and writing nothing outside ``tmp_path``; afterwards the run finished and
    wandb torn down (its settings are read once per process: the next test's directories would
    otherwise be this one's)."""
    import wandb

    wandb.teardown()  # settings another test left in this process (they are read once) do not carry over
    for name, sub in (("WANDB_DIR", "wandb_dir"), ("WANDB_CACHE_DIR", "wandb_cache"), ("WANDB_CONFIG_DIR", "wandb_config"),
                      ("WANDB_DATA_DIR", "wandb_data")):
        monkeypatch.setenv(name, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    yield
    wandb.finish()
    wandb.teardown()


def tensorboard_tables(log_dir, key: str = "trajectories") -> dict[int, list[dict[str, str]]]:
    """The markdown tables a TensorBoardLogger's text tab holds, by step, as rows of cells."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    events.Reload()
    out = {}
    for event in events.Tensors(f"{key}/text_summary"):
        lines = event.tensor_proto.string_val[0].decode().splitlines()
        header = [c.strip() for c in lines[0].strip("|").split(" | ")]
        assert tuple(header) == COLUMNS and set(lines[1]) == {"|", "-"}
        # cells are split on " | " (an escaped pipe inside a cell is "\|", never " | ")
        out[event.step] = [dict(zip(COLUMNS, (c.strip() for c in line[2:-2].split(" | ")))) for line in lines[2:]]
    return out


def tensorboard_scalars(log_dir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: {s.step: s.value for s in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def squash(text: str) -> str:
    return " ".join(text.split())


def expected_turns(traj, picked: list[int]) -> list[tuple[int, int]]:
    """(rollout, turn) of every row, in order: a row per turn of each picked rollout."""
    return [(i, n) for i in picked for n in range(int(traj.num_actions[i]))]


def check_rows(rows: list[dict], traj, picked: list[int], step: int, bm25, topk: int, markdown: bool) -> None:
    """Each row's cells against the trajectory (``markdown``: the cell as TensorBoard shows it,
    whitespace squashed and possibly cut, else the full value)."""
    assert [(int(r["rollout"]), int(r["turn"])) for r in rows] == expected_turns(traj, picked)
    as_shown = squash if markdown else (lambda text: text)
    for row in rows:
        i, turn = int(row["rollout"]), traj.turns[int(row["rollout"])][int(row["turn"])]
        assert int(row["step"]) == step and int(row["group"]) == int(traj.group_id[i])
        assert row["question"] == as_shown(traj.questions[i]) and row["gold"] == " / ".join(traj.golden_answers[i])
        assert math.isclose(float(row["reward"]), float(traj.reward[i]), abs_tol=1e-3)
        assert math.isclose(float(row["advantage"]), float(traj.advantage[i]), abs_tol=1e-3)
        assert row["finish"] == traj.finish_reason[i]
        if turn.query is not None:
            # the query as the model wrote it between the tags
            written = re.search(r"<search>\s*(.*?)\s*</search>", turn.action, re.DOTALL).group(1)
            assert row["kind"] == "search" and row["query"] == as_shown(written)
            # the passages the retriever returns for the query, as the protocol formats them
            passages = format_observation(bm25.search([turn.query], topk)[0])
            cell = row["observation"].rstrip("…") if markdown else row["observation"]
            assert cell and as_shown(passages).startswith(as_shown(cell)), (cell, passages)
        else:
            assert row["query"] == ""
        if row["kind"] == "answer":
            assert row["answer"] and traj.answers[i] is not None
    # the final answer of each rollout that answered is its last turn's answer
    for i in picked:
        last = [r for r in rows if int(r["rollout"]) == i][-1]
        if traj.finish_reason[i] == "answer":
            assert last["kind"] == "answer" and last["answer"] == as_shown(traj.answers[i])


def test_the_table_reaches_tensorboard_and_wandb_row_for_row(protocol_model, protocol_examples, bm25, tmp_path, offline_wandb):
    model, tok = protocol_model
    config = RolloutConfig(group_size=2, greedy=True, topk=1, max_turns=2, max_new_tokens=24, max_obs_tokens=200, max_response_tokens=400)
    exact = lambda text, gold: float(any(g.lower() in text.lower() for g in gold))  # noqa: E731 (a reward with 0s and 1s)
    traj = RolloutEngine(tok, bm25, exact, config).generate(model, protocol_examples)
    assert int(traj.num_searches.sum()) >= 1 and "answer" in traj.finish_reason  # the rows cover searches and answers
    traj.advantage = torch.linspace(-1.0, 1.0, len(traj))  # any values: the table shows them as they are
    tb = pl.loggers.TensorBoardLogger(tmp_path, name="tb")
    wb = pl.loggers.WandbLogger(save_dir=str(tmp_path / "wb"), offline=True, project="lldslight-test")
    trainer = pl.Trainer(logger=[tb, wb], accelerator="cpu", devices=1, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path)
    table = TrajectoryTable(every_n_steps=1, num_samples=4, out_dir=str(tmp_path / "tables"))
    picked = table.pick(traj)
    assert sorted(int(traj.group_id[i]) for i in picked[:3]) == sorted(int(e.group_id) for e in protocol_examples)  # a group each first
    table.write(trainer, table.rows(traj, picked, tok, step=7), step=7)
    tb.experiment.flush()
    wb.experiment.finish()

    shown = tensorboard_tables(tb.log_dir)
    assert list(shown) == [7]
    check_rows(shown[7], traj, picked, 7, bm25, config.topk, markdown=True)
    run = wandb_files.run_dir(tmp_path / "wb")
    (logged,) = [r for r in wandb_files.history(run) if "trajectories/path" in r]
    assert logged["trainer/global_step"] == 7
    data = wandb_files.table(run, logged, "trajectories")
    assert tuple(data["columns"]) == COLUMNS
    check_rows([dict(zip(COLUMNS, r)) for r in data["data"]], traj, picked, 7, bm25, config.topk, markdown=False)
    # the file holds what TensorBoard shows
    assert table.written[0].read_text().splitlines()[2:] == table.markdown(table.rows(traj, picked, tok, 7)).splitlines()


class Captured(pl.Callback):
    """Saves each training step's rollouts as ``rollouts_<step>.pt`` in the working directory (the
    CLI imports this module apart from pytest's copy, so a file carries them to the test)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        torch.save(pl_module.last_rollout, f"rollouts_{trainer.global_step - 1}.pt")


def test_a_fit_with_the_traces_preset_logs_tables_and_metrics_to_both(tmp_path, monkeypatch, offline_wandb):
    from lldslight.cli import main

    capture = tmp_path / "capture.yaml"
    capture.write_text("trainer:\n  callbacks+:\n    - class_path: tests.test_traces.Captured\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))
    assert main(["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--config", str(ROOT / "configs" / "traces.yaml"),
                 "--config", str(capture), "--trainer.max_steps", "2"]) == 0
    import wandb

    wandb.finish()
    runs = tmp_path / "runs"
    with open(runs / "tiny" / "version_0" / "metrics.csv") as f:
        csv_rows = [r for r in csv.DictReader(f) if r.get("train/reward")]
    assert [int(r["step"]) for r in csv_rows] == [0, 1]
    keys = [k for k in csv_rows[0] if "/" in k]
    assert {"train/reward", "train/zero_var_groups", "train/loss", "time/rollout_s"} <= set(keys)

    # every per-step metric, in TensorBoard and in W&B, at its step, as metrics.csv has it
    scalars = tensorboard_scalars(runs / "tensorboard" / "version_0")
    run = wandb_files.run_dir(runs)
    history = wandb_files.history(run)
    for row in csv_rows:
        step = int(row["step"])
        (wb_row,) = [h for h in history if h.get("trainer/global_step") == step and "train/reward" in h]
        for key in keys:
            if row[key] == "":
                continue
            assert math.isclose(scalars[key][step], float(row[key]), rel_tol=1e-6, abs_tol=1e-6), key
            assert math.isclose(wb_row[key], float(row[key]), rel_tol=1e-9, abs_tol=1e-12), key

    # the preset logs the table every 10 steps: step 0's, with the rows of step 0's rollouts
    traj = torch.load(tmp_path / "rollouts_0.pt", weights_only=False)
    table = TrajectoryTable(num_samples=4)
    picked = table.pick(traj)
    shown = tensorboard_tables(runs / "tensorboard" / "version_0")
    assert list(shown) == [0]
    (logged,) = [h for h in history if "trajectories/path" in h]
    assert logged["trainer/global_step"] == 0
    data = wandb_files.table(run, logged, "trajectories")
    for rows, markdown in ((shown[0], True), ([dict(zip(COLUMNS, r)) for r in data["data"]], False)):
        assert [(int(r["rollout"]), int(r["turn"])) for r in rows] == expected_turns(traj, picked)
        for r in rows:
            i = int(r["rollout"])
            assert r["question"] == (squash if markdown else str)(traj.questions[i])
            assert math.isclose(float(r["reward"]), float(traj.reward[i]), abs_tol=1e-3)
            assert math.isclose(float(r["advantage"]), float(traj.advantage[i]), abs_tol=1e-3)
    assert sorted(p.name for p in (runs / "tiny" / "version_0" / "trajectories").iterdir()) == ["step_000000.md"]

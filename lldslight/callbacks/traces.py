"""TrajectoryTable: sample rollouts of a training step, a row per turn, every N steps, written
where a run's logs are read.

Each row is one turn of one rollout: the question and its gold answers, what the model wrote
(the action), the action's kind (search, answer, invalid), its search query, the observation that
came back (decoded from the rollout's own tokens), the turn's answer, and the rollout's reward,
advantage and finish reason (the same on each of its turns). The rows go to

- TensorBoard (``TensorBoardLogger``): a markdown table in the text tab, tag ``<key>``, at the step;
- Weights & Biases (``WandbLogger``, online or offline): a ``wandb.Table`` under ``<key>``,
  through the logger's ``log_table``, uncut;
- a markdown file per logged step, ``<log_dir>/trajectories/step_NNNNNN.md`` (``files: false``
  turns it off).

Other loggers (CSV) get nothing: a table is not a metric. The step is the rollout batch's, the
``step`` its ``train/*`` metrics are logged at (0-based), so a table and the scalars beside it
line up. Only rank 0 writes (its own rollouts; every rank's rows are alike in kind).

    trainer:
      callbacks+:
        - class_path: lldslight.callbacks.TrajectoryTable
          init_args: {every_n_steps: 10, num_samples: 4}

configs/traces.yaml composes it with a TensorBoard and an offline W&B logger (docs/traces.md).
"""
from __future__ import annotations

import os
import unicodedata
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl

from lldslight.errors import ConfigError, UserError, require
from lldslight.rollout.protocol import parse_action
from lldslight.run.writes import check_writable, write_failure

COLUMNS = ("step", "rollout", "group", "turn", "question", "gold", "action", "kind", "query", "observation", "answer",
           "reward", "advantage", "finish")
"""The table's columns, in order (docs/traces.md says what each holds)."""


class TrajectoryTable(pl.Callback):
    """Every ``every_n_steps`` training steps, ``num_samples`` rollouts of the step as a per-turn
    table, to TensorBoard, W&B and a markdown file.

    Args:
        every_n_steps: how often, in training steps (rollout batches); the first step is logged.
        num_samples: rollouts per table (one per group first, so the table shows different questions).
        key: the tag (TensorBoard) and key (W&B) of the table.
        files: also write ``step_NNNNNN.md`` under ``out_dir``.
        out_dir: where the files go; default ``<log_dir>/trajectories``.
        max_chars: cut each markdown cell (TensorBoard, files) to this many characters; W&B gets
            the full text.
    """

    def __init__(self, every_n_steps: int = 10, num_samples: int = 4, key: str = "trajectories", files: bool = True,
                 out_dir: Optional[str] = None, max_chars: int = 200) -> None:
        require(every_n_steps >= 1, "TrajectoryTable.every_n_steps", ">= 1", every_n_steps)
        require(num_samples >= 1, "TrajectoryTable.num_samples", ">= 1", num_samples)
        require(max_chars >= 8, "TrajectoryTable.max_chars", ">= 8", max_chars)
        require(bool(key), "TrajectoryTable.key", "a non-empty tag", key)
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.key = key
        self.files = files
        self.out_dir = out_dir
        self.max_chars = max_chars
        self.written: list[Path] = []  # the markdown files, in order

    def directory(self, trainer) -> Path:
        return Path(self.out_dir or Path(trainer.log_dir or ".") / "trajectories")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        # Two tables writing one folder's step files (or one tag) would overwrite each other's.
        for other in trainer.callbacks:
            if other is self or not isinstance(other, TrajectoryTable):
                continue
            same_files = self.files and other.files and self.directory(trainer).resolve() == other.directory(trainer).resolve()
            if same_files or other.key == self.key:
                what = f"the files step_NNNNNN.md in {self.directory(trainer)}" if same_files else f"the tag/key {self.key!r}"
                raise ConfigError(f"trainer.callbacks: two TrajectoryTable write {what}, each over the other's; give each "
                                  "its own out_dir and key")
        if self.files and trainer.is_global_zero:
            # Before the model loads (a file in the way or a read-only folder failed after a whole step).
            check_writable(self.directory(trainer), "TrajectoryTable.out_dir")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        traj = getattr(pl_module, "last_rollout", None)
        # GRPOModule counts the step inside training_step, so global_step is already the next one here.
        step = trainer.global_step - 1
        if traj is None or step % self.every_n_steps or not trainer.is_global_zero:
            return
        self.write(trainer, self.rows(traj, self.pick(traj), pl_module.tokenizer, step), step)

    # -- the rows ------------------------------------------------------------------------------------

    def pick(self, traj) -> list[int]:
        """The rollouts shown: the first of each group, then the others, ``num_samples`` in all."""
        firsts, seen = [], set()
        for i, g in enumerate(traj.group_id.tolist()):
            if g not in seen:
                seen.add(g)
                firsts.append(i)
        chosen = set(firsts)
        rest = [i for i in range(len(traj)) if i not in chosen]
        return (firsts + rest)[: self.num_samples]

    @staticmethod
    def rows(traj, picked: list[int], tokenizer, step: int) -> list[dict[str, Any]]:
        """A dict per turn of each picked rollout, keyed by COLUMNS."""
        out = []
        advantage = traj.advantage.tolist() if traj.advantage is not None else [None] * len(traj)
        for i in picked:
            for n, turn in enumerate(traj.turns[i]):
                kind, content = parse_action(turn.action)
                observation = ""
                if turn.observation_span is not None:
                    start, end = turn.observation_span
                    observation = tokenizer.decode(traj.input_ids[i, start:end].tolist(), skip_special_tokens=True)
                out.append({
                    "step": step, "rollout": i, "group": int(traj.group_id[i]), "turn": n,
                    "question": traj.questions[i] if traj.questions else "",
                    "gold": " / ".join(traj.golden_answers[i]) if traj.golden_answers else "",
                    "action": turn.action, "kind": kind or "invalid", "query": turn.query or "",
                    "observation": observation, "answer": content if kind == "answer" else "",
                    "reward": float(traj.reward[i]), "advantage": advantage[i], "finish": traj.finish_reason[i],
                })
        return out

    def markdown(self, rows: list[dict[str, Any]]) -> str:
        """The rows as one markdown table (cells on one line, ``|`` escaped, cut to ``max_chars``)."""
        lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
        for row in rows:
            lines.append("| " + " | ".join(self._cell(row[c]) for c in COLUMNS) + " |")
        return "\n".join(lines)

    def _cell(self, value: Any) -> str:
        if value is None:
            return "-"
        text = f"{value:.3f}" if isinstance(value, float) else str(value)
        text = " ".join(text.split()).replace("|", "\\|")
        # Control and format characters from the data (ESC sequences a terminal runs when the file is
        # shown, BEL, a right-to-left override that reverses what follows) are shown as escapes.
        text = "".join(c.encode("unicode_escape").decode("ascii") if unicodedata.category(c) in ("Cc", "Cf") else c
                       for c in text)
        return text if len(text) <= self.max_chars else text[: self.max_chars - 1] + "…"

    # -- the sinks -----------------------------------------------------------------------------------

    def write(self, trainer, rows: list[dict[str, Any]], step: int) -> None:
        """The rows to every logger that shows a table, and to the step's markdown file."""
        text = self.markdown(rows)
        if self.files:
            out = self.directory(trainer)
            path = out / f"step_{step:06d}.md"
            partial = out / f".{path.name}.tmp{os.getpid()}"
            try:  # whole or not at all: a full disk left a 0-byte step file
                out.mkdir(parents=True, exist_ok=True)
                partial.write_text(f"# Trajectories at step {step}\n\n{text}\n", encoding="utf-8")
                os.replace(partial, path)
            except OSError as err:
                partial.unlink(missing_ok=True)
                raise UserError(f"TrajectoryTable: cannot write {path}: {write_failure(err)}") from None
            self.written.append(path)
        for logger in trainer.loggers:
            if isinstance(logger, pl.loggers.TensorBoardLogger):  # its text tab renders markdown tables
                logger.experiment.add_text(self.key, text, step)
            elif isinstance(logger, pl.loggers.WandbLogger):
                logger.log_table(self.key, columns=list(COLUMNS), data=[[row[c] for c in COLUMNS] for row in rows], step=step)

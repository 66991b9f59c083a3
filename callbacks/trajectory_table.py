"""A worked example of a user callback: a table of sample trajectories every N steps.

It reads what GRPOModule exposes after each step (``pl_module.last_rollout``, a Trajectory) and
writes a markdown file per logged step: a row per trajectory (question, gold answers, the searches
the model issued, its answer, reward and advantage), then a row per turn (the action the model
wrote, its search query, the start of the observation that came back; ``Trajectory.turns``). With
a TensorBoardLogger the same tables go to TensorBoard's text tab (``trajectories``, at the step).
Plug it in from YAML:

    trainer:
      callbacks+:
        - class_path: callbacks.trajectory_table.TrajectoryTable
          init_args: {every_n_steps: 2, num_samples: 4}
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import lightning.pytorch as pl


class TrajectoryTable(pl.Callback):
    """Every ``every_n_steps`` training steps, write ``num_samples`` trajectories as a table.

    Args:
        every_n_steps: how often (in training steps = rollout batches).
        num_samples: rows per table (the first rollouts of the batch, one per group first).
        out_dir: where to write; default ``<log_dir>/trajectories``.
        max_chars: cut long cells to this many characters.
    """

    def __init__(self, every_n_steps: int = 5, num_samples: int = 4, out_dir: Optional[str] = None, max_chars: int = 80) -> None:
        if every_n_steps < 1 or num_samples < 1:
            raise ValueError("TrajectoryTable: every_n_steps and num_samples must be >= 1")
        self.every_n_steps = every_n_steps
        self.num_samples = num_samples
        self.out_dir = out_dir
        self.max_chars = max_chars
        self.written: list[Path] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        traj = getattr(pl_module, "last_rollout", None)
        step = trainer.global_step
        if traj is None or step % self.every_n_steps or not trainer.is_global_zero:
            return
        out = Path(self.out_dir or Path(trainer.log_dir or ".") / "trajectories")
        out.mkdir(parents=True, exist_ok=True)
        picked = self._pick(traj)
        lines = [f"# Trajectories at step {step}", "", *self.trajectory_rows(traj, picked), "", "## Turns", "",
                 *self.turn_rows(traj, picked, pl_module.tokenizer)]
        path = out / f"step_{step:06d}.md"
        path.write_text("\n".join(lines) + "\n")
        self.written.append(path)
        for logger in trainer.loggers:
            if isinstance(logger, pl.loggers.TensorBoardLogger):  # its text tab renders markdown tables
                logger.experiment.add_text("trajectories", "\n".join(lines[2:]), step)

    def trajectory_rows(self, traj, picked: list[int]) -> list[str]:
        """A markdown table, a row per picked trajectory."""
        lines = ["| # | question | gold | searches | answer | reward | advantage | finish |", "|---|---|---|---|---|---|---|---|"]
        for i in picked:
            searches = [t.query for t in traj.turns[i] if t.query is not None]  # the queries the model wrote
            adv = float(traj.advantage[i]) if traj.advantage is not None else float("nan")
            cells = [str(i), traj.questions[i], " / ".join(traj.golden_answers[i]), " ; ".join(searches) or "-",
                     traj.answers[i] or "-", f"{float(traj.reward[i]):.2f}", f"{adv:+.2f}", traj.finish_reason[i]]
            lines.append("| " + " | ".join(self._cell(c) for c in cells) + " |")
        return lines

    def turn_rows(self, traj, picked: list[int], tokenizer) -> list[str]:
        """A markdown table, a row per turn of each picked trajectory: the action, its query, and
        the observation that followed (decoded from its span of the row's tokens)."""
        lines = ["| # | turn | action | query | observation |", "|---|---|---|---|---|"]
        for i in picked:
            for n, turn in enumerate(traj.turns[i]):
                observation = "-"
                if turn.observation_span is not None:
                    start, end = turn.observation_span
                    observation = tokenizer.decode(traj.input_ids[i, start:end].tolist(), skip_special_tokens=True)
                cells = [str(i), str(n), turn.action, turn.query or "-", observation]
                lines.append("| " + " | ".join(self._cell(c) for c in cells) + " |")
        return lines

    def _pick(self, traj) -> list[int]:
        """One rollout per group first, so the table shows different questions."""
        firsts, seen = [], set()
        for i, g in enumerate(traj.group_id.tolist()):
            if g not in seen:
                seen.add(g)
                firsts.append(i)
        rest = [i for i in range(len(traj)) if i not in firsts]
        return (firsts + rest)[: self.num_samples]

    def _cell(self, text: str) -> str:
        text = " ".join(str(text).split()).replace("|", "\\|")
        return text if len(text) <= self.max_chars else text[: self.max_chars - 1] + "…"

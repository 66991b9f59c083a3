"""Test-only callbacks and a reward for the multi-process and resume tests, which run the real CLI
as a subprocess (PYTHONPATH=tests, so YAML names them as ``run_helpers.X``).

- ``ParityReward``: reward = parity of the response length, so a random tiny model gets groups
  with mixed rewards (non-zero advantages, real gradients) instead of all-zero rewards.
- ``RecordRollouts``: saves, per step and rank, the prompts, the RNG state before sampling and the
  trajectory the module trained on.
- ``ReplayRollouts``: one process trains on the trajectories a multi-rank run recorded (all ranks'
  rollouts of a step form one global batch, ordered so each global mini-batch is the union of the
  ranks' mini-batches); optionally it first re-samples step 0 from each rank's recorded prompts
  and RNG state with the unsharded policy and requires the very same tokens.
- ``KillAtStep``: SIGKILLs its own process in the middle of a step (after the rollout).
- ``KillBeforeRow``: a CSVLogger that SIGKILLs its process between a step's checkpoint and its row.
- ``SplitReward``: a reward that ties some prompts for good (dynamic sampling must drop them) and
  splits the others by response-length parity.
- ``CountGenerate``: records, per step and rank, every generate call's groups and rewards and the
  trajectory trained on (dynamic sampling's rank agreement).
- ``ConstantReward``, ``RaisingReward``, ``KeywordReward``, ``UntypedReward``, ``ResponseOnlyReward``:
  the rewards of the bad-reward tests (a value that is not a finite number, an exception, the
  keyword form of the docs, no type hints, a signature lldslight cannot call).
"""
from __future__ import annotations

import json
import os
import signal
import zlib
from pathlib import Path
from typing import Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger
import torch

from lldslight.retrieval.base import Retriever
from lldslight.rollout import RolloutConfig, RolloutEngine
from lldslight.trajectory import Trajectory


class ParityReward:
    def __call__(self, response: str, golden_answers: list[str]) -> float:
        return float(len(response) % 2)


class ConstantReward:
    """Returns ``value`` for every response: "nan", "inf" and other strings are read as floats;
    "none" returns None and "pair" a 2-element tensor (what a reward must never return)."""

    def __init__(self, value: Union[float, str] = 0.5) -> None:
        self.value = value

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        if self.value == "none":
            return None  # type: ignore[return-value]
        if self.value == "pair":
            return torch.tensor([0.0, 1.0])  # type: ignore[return-value]
        return float(self.value)


class RaisingReward:
    def __call__(self, response: str, golden_answers: list[str]) -> float:
        raise KeyError("golden_answers[1]")


class KeywordReward:
    """The keyword form docs/errors_and_resume.md documents; records what it was given."""

    seen: list[dict] = []

    def __call__(self, response, golden_answers, *, question, data_source, turns):
        KeywordReward.seen.append({"question": question, "data_source": data_source, "turns": len(turns)})
        return float(len(response) % 2)


class UntypedReward:
    def __call__(self, response, golden_answers):
        return float(len(response) % 2)


class ResponseOnlyReward:
    def __call__(self, response):
        return 0.0


class SplitReward:
    """0 for every response to a "tied" prompt (crc32 of its first gold answer divisible by
    ``tie_every``), else the parity of the response length: tied prompts can never form a group with
    mixed rewards, the others usually do. Only the model's words and the gold answers are seen."""

    def __init__(self, tie_every: int = 3) -> None:
        self.tie_every = tie_every

    def tied(self, golden_answers: list[str]) -> bool:
        return zlib.crc32(golden_answers[0].encode()) % self.tie_every == 0

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        return 0.0 if self.tied(golden_answers) else float(len(response) % 2)


class CountGenerate(pl.Callback):
    """Wraps ``RolloutEngine.generate`` (this process only) to record every call's group ids and
    rewards; writes ``step<N>_rank<R>.json`` with them and the trained trajectory's group ids."""

    def __init__(self, out_dir: str) -> None:
        self.out = Path(out_dir)
        self.calls: list[dict] = []
        self.steps: list[dict] = []
        self._original = None

    def setup(self, trainer, pl_module, stage) -> None:
        original = self._original = RolloutEngine.generate

        def counted(engine, model, examples, *args, **kwargs):
            traj = original(engine, model, examples, *args, **kwargs)
            if engine.config.group_size > 1:  # training rollouts, not evaluation
                self.calls.append({"group_id": traj.group_id.tolist(), "reward": traj.reward.tolist()})
            return traj

        RolloutEngine.generate = counted

    def teardown(self, trainer, pl_module, stage) -> None:
        if self._original is not None:
            RolloutEngine.generate, self._original = self._original, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.calls = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        traj = pl_module.last_rollout
        record = {"calls": self.calls, "rows": len(traj), "group_id": traj.group_id.tolist(), "reward": traj.reward.tolist(),
                  "input_ids": traj.input_ids.tolist()}
        self.steps.append(record)
        (self.out / f"step{trainer.global_step - 1}_rank{trainer.global_rank}.json").write_text(json.dumps(record))


class RecordRollouts(pl.Callback):
    """Put it first in trainer.callbacks (its batch-start hook must run before SearchRollout's)."""

    def __init__(self, out_dir: str) -> None:
        self.out = Path(out_dir)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._pending = {"examples": list(batch), "rng": torch.get_rng_state()}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = dict(self._pending, traj=pl_module.last_rollout.to("cpu"), metrics=dict(pl_module.last_step_metrics))
        torch.save(record, self.out / f"step{trainer.global_step - 1}_rank{trainer.global_rank}.pt")


def interleave(parts: list[Trajectory], chunks: int) -> Trajectory:
    """One trajectory from several ranks' ones: chunk c of every part, then chunk c + 1, ..."""
    pieces = [p.select(torch.tensor_split(torch.arange(len(p)), chunks)[c]) for c in range(chunks) for p in parts]
    out = Trajectory.concat(pieces)
    out.advantage = out.old_logp = out.ref_logp = None  # the replaying module computes its own
    return out


class ReplayRollouts(pl.Callback):
    def __init__(
        self,
        record_dir: str,
        world_size: int,
        chunks: int,
        retriever: Optional[Retriever] = None,
        rollout: Optional[RolloutConfig] = None,
        verify_generation: bool = False,
    ) -> None:
        self.dir = Path(record_dir)
        self.world_size = world_size
        self.chunks = chunks
        self.retriever = retriever
        self.rollout = rollout
        self.verify_generation = verify_generation

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        step = trainer.global_step
        records = [torch.load(self.dir / f"step{step}_rank{r}.pt", weights_only=False) for r in range(self.world_size)]
        if step == 0 and self.verify_generation:
            self._verify(pl_module, records)
        pl_module.rollout_batch = interleave([r["traj"] for r in records], self.chunks).to(pl_module.device)

    def _verify(self, pl_module, records) -> None:
        engine = RolloutEngine(pl_module.tokenizer, self.retriever, ParityReward(), self.rollout)
        state = torch.get_rng_state()
        for rank, rec in enumerate(records):
            torch.set_rng_state(rec["rng"])
            again = engine.generate(pl_module.policy, rec["examples"])
            if again.extras["sampled_ids"] != rec["traj"].extras["sampled_ids"]:
                raise AssertionError(f"rank {rank}: its sampling differs from one process sampling the same prompts with the same RNG")
        torch.set_rng_state(state)
        print("[replay] every rank's rollouts reproduced token for token by one unsharded process", flush=True)


class KillAtStep(pl.Callback):
    """SIGKILL after the rollout of step ``step`` (0-based), so that step never completes."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


# The head every tiny `lldslight fit` run of the tests starts with (a str.format template: steps,
# save_dir): CSV metrics every step, a SearchRollout over the tiny BM25 corpus; the test adds the
# rollout's reward and settings, then its callbacks.
TINY_RUN_HEAD = """trainer:
  max_steps: {steps}
  logger:
    class_path: lightning.pytorch.loggers.CSVLogger
    init_args: {{save_dir: {save_dir}, name: tiny, flush_logs_every_n_steps: 1}}
  callbacks:
    - class_path: lldslight.callbacks.SearchRollout
      init_args:
        retriever:
          class_path: lldslight.retrieval.BM25Retriever
          init_args: {{corpus: .lldslight/tiny_data/corpus.jsonl}}
"""
# A callback line that kills the run during training step ``step`` (format: step).
KILL = """    - class_path: run_helpers.KillAtStep
      init_args: {{step: {step}}}
"""


class KillBeforeRow(CSVLogger):
    """A CSVLogger that SIGKILLs the process when the training row of step ``kill_step`` (0-based)
    reaches it: after that step's checkpoint was renamed into place, before its row is written."""

    def __init__(self, *args, kill_step: int = 1, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.kill_step = kill_step

    def log_metrics(self, metrics, step=None) -> None:
        if step == self.kill_step and "train/loss" in metrics:
            os.kill(os.getpid(), signal.SIGKILL)
        super().log_metrics(metrics, step)

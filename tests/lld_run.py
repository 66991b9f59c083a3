"""One real tiny training run with LLDMonitor, shared by test_monitor.py and test_plots.py (a fit
costs most of their time budget, so it runs once per session)."""
from __future__ import annotations

from pathlib import Path
from lldslight.update import UpdateConfig
from lldslight.update.optim import OptimConfig

_CACHE: dict[str, object] = {}


class AlternatingReward:
    """A reward that splits every group (a random-init model never answers correctly): 1, 0, 1, ...
    in call order, so each group of >= 2 rollouts gets advantages of both signs and every lld/* set
    is non-empty."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, response: str, golden_answers: list[str]) -> float:
        self.calls += 1
        return float(self.calls % 2)


def monitored_run(tmp_path_factory, synth_kb, bm25) -> dict:
    """Fit the tiny model for 2 steps with LLDMonitor; returns run_dir, monitor, module, trainer."""
    if "run" in _CACHE:
        return _CACHE["run"]
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import CSVLogger

    from conftest import tiny_policy_config
    from lldslight.callbacks import LLDMonitor, SearchRollout
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.science.diagnostics import PhaseConfig
    from lldslight.module import GRPOModule
    from lldslight.rollout import RolloutConfig

    pl.seed_everything(0)
    root = tmp_path_factory.mktemp("lldrun")
    rollout = RolloutConfig(group_size=3, max_turns=1, max_new_tokens=6, max_obs_tokens=16, max_response_tokens=40, topk=1)
    monitor = LLDMonitor(phases=PhaseConfig(window=3, patience=1))
    module = GRPOModule(policy=tiny_policy_config(), update=UpdateConfig(updates_per_rollout=2, micro_batch_size=6, kl_coef=0.001), optim=OptimConfig(lr=1e-2))
    data = SearchQADataModule(
        train_files=[str(synth_kb["train"])], val_files=[str(synth_kb["dev"])], batch_size=2, eval_batch_size=3, limit_val=3
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=CSVLogger(str(root), name="tiny"),
        callbacks=[SearchRollout(retriever=bm25, reward=AlternatingReward(), rollout=rollout), monitor],
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        num_sanity_val_steps=0, log_every_n_steps=1, limit_val_batches=0,
    )
    trainer.fit(module, datamodule=data)
    _CACHE["run"] = {"run_dir": Path(trainer.log_dir), "monitor": monitor, "module": module, "trainer": trainer}
    return _CACHE["run"]

"""The ``lldslight`` command: LightningCLI's fit / validate / test, plus data, index, serve, plot
and export. Training runs are configured by YAML (``--config``, repeatable, later files win);
``lldslight fit --print_config`` shows every knob with its default."""
from __future__ import annotations

import importlib
import os
import sys
from typing import Optional

# name -> "module:function"; each takes argv (list[str]) and returns an exit code.
TOOLS = {
    "data": ("lldslight.data.cli:main", "synthesise or inspect data: lldslight data synth --out DIR"),
    "index": ("lldslight.retrieval.cli:index_main", "build a BM25 or dense index over a corpus jsonl"),
    "serve": ("lldslight.retrieval.cli:serve_main", "serve an index over Search-R1's HTTP API"),
    "plot": ("lldslight.plots:main", "plot the LLD diagnostics of one or more runs"),
    "sft": ("lldslight.sft:main", "supervised warm start on gold search trajectories (before GRPO)"),
    "export": ("lldslight.export:main", "merge the adapter of a checkpoint into a HF model directory"),
}


def _cli_class():
    from lightning.pytorch.cli import LightningCLI

    from lldslight.checkpoint import resolve_last_checkpoint
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.module import GRPOModule

    class CLI(LightningCLI):
        def before_instantiate_classes(self) -> None:
            # `--ckpt_path last`: the newest last.ckpt of the logger's earlier runs.
            if self.subcommand:
                resolve_last_checkpoint(self.config[self.subcommand])

    return CLI, GRPOModule, SearchQADataModule


TRAINER_DEFAULTS = {
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "lldslight"}},
    # The data module shards prompts per rank itself (groups never straddle ranks, eval keeps every example once).
    "use_distributed_sampler": False,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    # Crash-safe checkpoint writes (temp file, fsync, rename): a kill never leaves a corrupt last.ckpt.
    "plugins": [{"class_path": "lldslight.checkpoint.AtomicCheckpointIO"}],
}


def _quiet_known_warnings() -> None:
    import warnings

    # Manual optimisation checkpoints after the step by design; Lightning's advice does not apply.
    warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    # GRPOModule.on_after_batch_transfer (exact-resume RNG) is meant to run beside the datamodule's hooks.
    warnings.filterwarnings("ignore", message=".*overridden `on_after_batch_transfer` in `LightningModule`.*")


def _unreadable_config(argv: list[str]) -> Optional[str]:
    """jsonargparse reports YAML syntax errors without the file's name: check each --config first."""
    import yaml

    for flag, value in zip(argv, argv[1:]):
        if flag not in ("--config", "-c") or not os.path.isfile(value):
            continue
        try:
            with open(value) as f:
                yaml.safe_load(f)
        except yaml.YAMLError as err:
            return f"malformed YAML in {value}: {err}"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in TOOLS:
        target, _ = TOOLS[argv[0]]
        module_name, fn_name = target.split(":")
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except ModuleNotFoundError as err:
            print(f"lldslight {argv[0]}: not available in this installation ({err})", file=sys.stderr)
            return 2
        return int(fn(argv[1:]) or 0)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: lldslight {fit,validate,test} --config FILE.yaml [...]\n       lldslight {" + ",".join(TOOLS) + "} ...\n")
        print("  fit / validate / test   train or evaluate (LightningCLI; --help for every option)")
        for name, (_, text) in TOOLS.items():
            print(f"  {name:23s} {text}")
        return 0 if argv else 2
    bad = _unreadable_config(argv)
    if bad:
        print(f"lldslight: {bad}", file=sys.stderr)
        return 2
    _quiet_known_warnings()
    # Like `python -m`, make the working directory importable, so YAML can name your own
    # callbacks and reward functions by class_path (e.g. callbacks.trajectory_table.TrajectoryTable).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cli_class, module_cls, datamodule_cls = _cli_class()
    cli_class(
        module_cls,
        datamodule_cls,
        args=argv,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""LightningCLI for fit / validate / test: ``--config`` files that replace or append lists, the
checkpoint checked before its hyper-parameters are read, the run directory claimed, and an
error raised while the configured objects are built said as the configuration error it is.
"""
from __future__ import annotations

import inspect
import re
import sys
from pathlib import Path
from typing import Any, Optional

from lldslight.cli.checks import _check_wandb_online, _flags_to_first_logger, _plain_list_keys, _read_config, _refuse_flat_keys
from lldslight.cli.resume import resume_settings
from lldslight.cli.run_dirs import _claim_run_dirs, _remove_empty_run_dirs, _stopped


def _cli_class():
    from jsonargparse import ActionConfigFile
    from lightning.pytorch.cli import LightningCLI

    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.errors import UserError
    from lldslight.module import GRPOModule
    from lldslight.run import stopping
    from lldslight.run.checkpoint_io import check_checkpoint, resolve_last_checkpoint

    class ConfigFile(ActionConfigFile):
        """``--config`` where a list written ``key:`` replaces the list of an earlier config and
        ``key+:`` appends to it. (jsonargparse alone merges two lists of equal length item by
        item, so a second file's ``callbacks:`` would keep the first file's init_args.)"""

        @staticmethod
        def apply_config(parser, cfg, dest, value) -> None:
            tree = _read_config(value)
            _refuse_flat_keys(tree.get("model") if isinstance(tree, dict) else None, f"{value}: ")
            for key in _plain_list_keys(tree):
                if isinstance(cfg.get(key), list):
                    cfg[key] = None
            ActionConfigFile.apply_config(parser, cfg, dest, value)

    class CLI(LightningCLI):
        def init_parser(self, **kwargs: Any):
            import lightning.pytorch as pl

            kwargs.setdefault("dump_header", [f"lightning.pytorch=={pl.__version__}"])
            parser = self.parser_class(**kwargs)
            parser.add_argument("-c", "--config", action=ConfigFile,
                                help="Path to a configuration file in json or yaml format (repeatable; later files "
                                     "win, a list written `key:` replaces, `key+:` appends).")
            return parser

        def add_arguments_to_parser(self, parser) -> None:
            parser.add_argument(
                "--resume_override", type=Optional[str], default=None,
                help="With --ckpt_path: model settings to take from your config and command line instead of the "
                     "checkpoint's saved ones: comma-separated keys (e.g. model.optim.lr,model.update.clip_eps) or 'all'. "
                     "Without it a resume is exact: the checkpoint's settings win, and every one that differs "
                     "from yours is listed in one line at start (docs/errors_and_resume.md).")
            # nargs="?" and const: `--force` alone is the flag every refusal advises; `--force true`
            # (and `force: true` in YAML) work as before.
            parser.add_argument(
                "--force", type=bool, nargs="?", const=True, default=False,
                help="Replace the run a run directory already holds (a fixed trainer.logger.init_args.version whose "
                     "metrics.csv or checkpoints exist): its files are listed, then removed, before this run starts. "
                     "Not needed to resume that run (fit --ckpt_path last): its metrics are kept.")

        def parse_arguments(self, parser, args) -> None:
            words = sys.argv[1:] if args is None else args if isinstance(args, (list, tuple)) else []
            flags = [w.split("=", 1)[0][len("--model."):] for w in words if isinstance(w, str) and w.startswith("--model.")]
            _refuse_flat_keys(flags, "the command line: ")
            super().parse_arguments(parser, args)
            check_groups(parser, self.config)
            # Before LightningCLI reads the checkpoint's hyper-parameters (a corrupt file would end
            # there in a zip-reader traceback).
            if self.config.get("subcommand"):
                check_checkpoint(self.config[self.config.subcommand].get("ckpt_path"))

        def _parse_ckpt_path(self) -> None:
            # LightningCLI merges the checkpoint's hyper-parameters over the config here, silently.
            # `--ckpt_path last` is resolved first so that it gets the same treatment as a path.
            sub = self.config.get("subcommand")
            if not sub:
                return super()._parse_ckpt_path()
            resolve_last_checkpoint(self.config[sub], sub)
            check_checkpoint(self.config[sub].get("ckpt_path"))
            yours = self.config[sub].get("model")
            yours = yours.clone() if yours is not None else None
            self._merge_checkpoint_hparams(sub)
            self.resume = resume_settings(self.config, sub, yours)

        def _merge_checkpoint_hparams(self, sub: str) -> None:
            """LightningCLI's own merge of the checkpoint's hyper-parameters over the config (its
            _parse_ckpt_path), with the flat keys an earlier lldslight saved (set before the groups,
            null since) folded into the groups first: the parser knows the groups only."""
            import torch

            from lldslight.run import deprecated_keys

            ckpt_path = self.config[sub].get("ckpt_path")
            if not ckpt_path or not Path(ckpt_path).is_file():
                return
            hparams = torch.load(ckpt_path, weights_only=True, map_location="cpu").get("hyper_parameters", {})
            hparams.pop("_instantiator", None)
            if not hparams:
                return
            hparams = deprecated_keys.nested(hparams)
            if "_class_path" in hparams:
                hparams = {"class_path": hparams.pop("_class_path"), "dict_kwargs": hparams}
            try:
                self.config = self.parser.parse_object({sub: {"model": hparams}}, self.config)
            except SystemExit:
                sys.stderr.write("Parsing of ckpt_path hyperparameters failed!\n")
                raise

        def _run_subcommand(self, subcommand: str) -> None:
            from lldslight.run.run_dir import is_rank_zero

            sub = self.config[subcommand]
            locks = _claim_run_dirs(self.trainer, bool(sub.get("force")), sub.get("ckpt_path"), subcommand) if is_rank_zero() else []
            previous = stopping.install()
            try:
                _check_wandb_online(self.trainer)
                super()._run_subcommand(subcommand)
            except SystemExit as err:  # Lightning's graceful stop after Ctrl-C or SIGTERM
                raise _stopped(self.trainer, subcommand) or err
            except Exception as err:
                _remove_empty_run_dirs(self.trainer)
                if isinstance(err, UserError) and getattr(self, "resume", None) is not None:
                    raise self.resume.explain(err) from err
                raise
            finally:
                for lock in locks:
                    lock.release()
                stopping.restore(previous)

        def before_instantiate_classes(self) -> None:
            _flags_to_first_logger(self)

        def _instantiate_trainer(self, config: dict[str, Any], callbacks: list) -> Any:
            check_stateful_callbacks(list(config.get("callbacks") or []) + list(callbacks))
            return super()._instantiate_trainer(config, callbacks)

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except Exception as original:
                err = _instantiation_error(original)
                if isinstance(err, UserError) and getattr(self, "resume", None) is not None:
                    err = self.resume.explain(err)
                if err is original:
                    raise
                raise err from original

    return CLI, GRPOModule, SearchQADataModule


def _instantiation_error(err: Exception) -> Exception:
    """An error raised while building the configured objects: a UserError, a ValueError (Python's
    "bad value") or an ImportError (a missing optional package) raised by a class's ``__init__`` is
    a configuration error. jsonargparse wraps it,
    e.g. in "Does not validate against any of the Union subtypes" with every alternative's error;
    dig it out of the chain. Anything else stays what it is (a bug keeps its traceback)."""
    from lldslight.errors import ConfigError, UserError

    chain, e = [], err
    while e is not None and e not in chain:
        chain.append(e)
        e = e.__cause__ or e.__context__
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    for e in chain:
        if isinstance(e, UserError):
            return e
    for e in chain:
        if isinstance(e, MisconfigurationException):  # Lightning's word for a bad Trainer argument
            return ConfigError(re.sub(r"^`(\w+)`", r"trainer.\1", str(e).strip().splitlines()[0]))
    innermost = chain[-1]
    if isinstance(innermost, ValueError):
        return ConfigError(str(innermost))
    if isinstance(innermost, ImportError):  # an optional package the configured class needs
        hint = " (TensorBoardLogger: pip install -e '.[tensorboard]' in your lldslight clone)" if "tensorboard" in str(innermost) else ""
        return UserError(str(innermost).splitlines()[0] + hint)
    return err


def check_groups(parser: Any, config: Any) -> None:
    """Every group of settings (``model``, ``model.update``, ``model.optim``, ``data``, ...: a class
    or dataclass whose fields are keys) must be a mapping in the parsed config. jsonargparse keeps a
    null, a list or a scalar written in a group's place and fails later, when it builds the class, in
    a TypeError about functools.partial that names no key."""
    from lldslight.errors import ConfigError

    sub = config.get("subcommand")
    if sub:
        parser, config = parser._subcommands_action._name_parser_map[sub], config[sub]
    for key, group in sorted(parser.groups.items()):
        cls = getattr(group, "group_class", None)
        if cls is None or key not in config:
            continue
        value = config.get(key)
        if value is None or not hasattr(value, "as_dict"):  # a Namespace is a mapping of settings
            fields = [p.name for p in inspect.signature(cls).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD][:4]
            shown = f" ({cls.__name__}: {', '.join(fields)}, ...)" if fields else ""
            leaf = key.rpartition(".")[2]
            raise ConfigError(f"{key} must be a mapping of settings{shown}, got {value!r}"
                              + (f" (an empty `{leaf}:` line? leave it out for the defaults)" if value is None else ""))


def check_stateful_callbacks(callbacks: list) -> None:
    """Two callbacks Lightning would store under one checkpoint key (a stateful callback class given
    twice, Lightning's own rule: ``state_dict`` overridden, the same ``state_key``) are said in one
    line, before the trainer refuses them in a 33-line RuntimeError."""
    from lightning.pytorch import Callback
    from lightning.pytorch.utilities.model_helpers import is_overridden

    from lldslight.errors import ConfigError

    seen: dict[Any, int] = {}
    for i, callback in enumerate(callbacks, start=1):
        if not isinstance(callback, Callback) or not is_overridden("state_dict", instance=callback, parent=Callback):
            continue
        key = callback.state_key
        if key in seen:
            raise ConfigError(f"trainer.callbacks: {type(callback).__qualname__} is given twice (entries {seen[key]} and {i}); a checkpoint "
                              "keeps one state per stateful callback class, so Lightning runs only one: remove one "
                              "(the overlays composed with `callbacks+:` may each add it)")
        seen[key] = i


TRAINER_DEFAULTS = {
    "logger": {"class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "runs", "name": "lldslight"}},
    # The data module shards prompts per rank itself (groups never straddle ranks, eval keeps every example once).
    "use_distributed_sampler": False,
    "num_sanity_val_steps": 0,
    "log_every_n_steps": 1,
    # Crash-safe checkpoint writes (temp file, fsync, rename): a kill never leaves a corrupt last.ckpt.
    "plugins": [{"class_path": "lldslight.run.checkpoint_io.AtomicCheckpointIO"}],
}

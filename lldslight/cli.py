"""The ``lldslight`` command: LightningCLI's fit / validate / test, plus data, index, serve, plot
and export. Training runs are configured by YAML (``--config``, repeatable, later files win);
``lldslight fit --print_config`` shows every knob with its default.

One rule for bad input, every command: a configuration or data error (an unknown key, a value out
of range, a missing or malformed file, an unreachable retriever, a model that is not on disk)
prints ``lldslight <command>: error: <message>`` and exits with status 2, without a traceback.
``--debug`` (anywhere on the command line) or ``LLDSLIGHT_DEBUG=1`` shows the traceback instead.
"""
from __future__ import annotations

import importlib
import os
import re
import sys
from typing import Any, Optional

# name -> "module:function"; each takes argv (list[str]) and returns an exit code.
TOOLS = {
    "data": ("lldslight.data.cli:main", "synthesise or inspect data: lldslight data synth --out DIR"),
    "index": ("lldslight.retrieval.cli:index_main", "build a BM25 or dense index over a corpus jsonl"),
    "serve": ("lldslight.retrieval.cli:serve_main", "serve an index over Search-R1's HTTP API"),
    "plot": ("lldslight.plots:main", "plot the LLD diagnostics of one or more runs"),
    "sft": ("lldslight.sft:main", "supervised warm start on gold search trajectories (before GRPO)"),
    "export": ("lldslight.export:main", "merge the adapter of a checkpoint into a HF model directory"),
}
DEBUG_ENV = "LLDSLIGHT_DEBUG"


def _plain_list_keys(tree: Any, prefix: str = "") -> list[str]:
    """Dotted keys of a config mapping whose value is a list written without ``+``."""
    keys: list[str] = []
    if isinstance(tree, dict):
        for k, v in tree.items():
            if not isinstance(k, str) or k.endswith("+"):
                continue
            if isinstance(v, list):
                keys.append(prefix + k)
            elif isinstance(v, dict):
                keys.extend(_plain_list_keys(v, f"{prefix}{k}."))
    return keys


def _read_config(value: Any) -> Any:
    """The mapping a ``--config`` value holds (a file, or an inline YAML/JSON string)."""
    import yaml

    text = str(value)
    try:
        if os.path.isfile(text):
            with open(text) as f:
                return yaml.safe_load(f)
        return yaml.safe_load(text)
    except (OSError, yaml.YAMLError):
        return None  # jsonargparse reports it


def _cli_class():
    from jsonargparse import ActionConfigFile
    from lightning.pytorch.cli import LightningCLI

    from lldslight.checkpoint import resolve_last_checkpoint
    from lldslight.data.datamodule import SearchQADataModule
    from lldslight.module import GRPOModule
    from lldslight.preflight import check_checkpoint

    class ConfigFile(ActionConfigFile):
        """``--config`` where a list written ``key:`` replaces the list of an earlier config and
        ``key+:`` appends to it. (jsonargparse alone merges two lists of equal length item by
        item, so a second file's ``callbacks:`` would keep the first file's init_args.)"""

        @staticmethod
        def apply_config(parser, cfg, dest, value) -> None:
            for key in _plain_list_keys(_read_config(value)):
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

        def parse_arguments(self, parser, args) -> None:
            super().parse_arguments(parser, args)
            # Before LightningCLI reads the checkpoint's hyper-parameters (a corrupt file would end
            # there in a zip-reader traceback).
            if self.config.get("subcommand"):
                check_checkpoint(self.config[self.config.subcommand].get("ckpt_path"))

        def before_instantiate_classes(self) -> None:
            # `--ckpt_path last`: the newest last.ckpt of the logger's earlier runs.
            if self.subcommand:
                resolve_last_checkpoint(self.config[self.subcommand])
                check_checkpoint(self.config[self.subcommand].get("ckpt_path"))

        def instantiate_classes(self) -> None:
            try:
                super().instantiate_classes()
            except Exception as err:
                raise _instantiation_error(err) from err

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
    for e in chain:
        if isinstance(e, UserError):
            return e
    innermost = chain[-1]
    if isinstance(innermost, ValueError):
        return ConfigError(str(innermost))
    if isinstance(innermost, ImportError):  # an optional package the configured class needs
        hint = " (TensorBoardLogger: pip install 'lldslight[tensorboard]')" if "tensorboard" in str(innermost) else ""
        return UserError(str(innermost).splitlines()[0] + hint)
    return err


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


def _check_config_files(argv: list[str]) -> None:
    """jsonargparse reports YAML syntax errors without the file's name: check each --config first."""
    import yaml

    from lldslight.errors import ConfigError

    for flag, value in zip(argv, argv[1:]):
        if flag not in ("--config", "-c") or not os.path.isfile(value):
            continue
        try:
            with open(value) as f:
                yaml.safe_load(f)
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            problem = getattr(err, "problem", None) or str(err)
            raise ConfigError(f"malformed YAML in {value}{where}: {problem}") from None


def _jsonargparse_one_line(message: str) -> str:
    """jsonargparse explains a bad value inside a class (a typo in a callback's init_args) as every
    alternative of a Union, 15+ lines; keep the path to the first real problem:
    ``trainer.callbacks: lldslight.callbacks.SearchRollout: retriever: ...: Option 'korpus' is not accepted``."""
    lines = [line for line in message.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.strip().startswith("- Problem with given class_path")), None)
    if start is None or "Does not validate against any of the Union subtypes" not in message:
        return " ".join(line.strip() for line in lines)
    key = re.match(r'Parser key "([^"]+)":', lines[0].strip())
    parts = [key.group(1)] if key else []
    depth = len(lines[start]) - len(lines[start].lstrip())
    for i, line in enumerate(lines[start:]):
        if i and len(line) - len(line.lstrip()) <= depth:
            break  # the next alternative of the Union
        text = line.strip().removeprefix("- ")
        found = re.fullmatch(r"Problem with given class_path '([^']+)':|Parser key \"([^\"]+)\":", text)
        if found:
            parts.append(found.group(1) or found.group(2))
        elif not text.startswith(("Does not validate", "Subtypes:", "Errors:")):
            parts.append(text)
            break
    return ": ".join(parts)


def _usage() -> str:
    lines = ["usage: lldslight {fit,validate,test} --config FILE.yaml [...]",
             "       lldslight {" + ",".join(TOOLS) + "} ...", "",
             "  fit / validate / test   train or evaluate (LightningCLI; --help for every option)"]
    lines += [f"  {name:23s} {text}" for name, (_, text) in TOOLS.items()]
    lines += ["", f"  --debug                 show the traceback of a configuration or data error (or {DEBUG_ENV}=1)"]
    return "\n".join(lines) + "\n"


def _run(argv: list[str], from_command_line: bool) -> int:
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
        print(_usage())
        return 0 if argv else 2
    _check_config_files(argv)
    _quiet_known_warnings()
    # Like `python -m`, make the working directory importable, so YAML can name your own
    # callbacks and reward functions by class_path (e.g. callbacks.trajectory_table.TrajectoryTable).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cli_class, module_cls, datamodule_cls = _cli_class()
    cli_class(
        module_cls,
        datamodule_cls,
        # From the command line LightningCLI reads sys.argv itself (and DDP's launcher re-runs it).
        args=None if from_command_line else argv,
        trainer_defaults=TRAINER_DEFAULTS,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        auto_configure_optimizers=False,
        # Errors come back as exceptions and are printed once, by main, in one line.
        parser_kwargs={"exit_on_error": False},
    )
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if "--debug" in argv:
        argv, debug = [a for a in argv if a != "--debug"], True
        if from_command_line:
            sys.argv[1:] = argv  # what LightningCLI and DDP's launcher read
            os.environ[DEBUG_ENV] = "1"  # inherited by DDP's worker processes
    command = argv[0] if argv and not argv[0].startswith("-") else ""

    from jsonargparse import ArgumentError

    from lldslight.errors import UserError

    try:
        return _run(argv, from_command_line)
    except (UserError, ArgumentError) as err:
        if debug:
            raise
        message = _jsonargparse_one_line(str(err)) if isinstance(err, ArgumentError) else str(err)
        print(f"lldslight{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())

"""The front of the ``lldslight`` command: the tools (data, index, serve, plot, sft, export) and
LightningCLI's fit / validate / test dispatched, and every configuration or data error printed as
one line with exit status 2 (``--debug`` or ``LLDSLIGHT_DEBUG=1``: the traceback too).
"""
from __future__ import annotations

import importlib
import logging
import os
import re
import sys
import traceback
from typing import Optional

from lldslight.cli.checks import _check_config_files
from lldslight.cli.lightning import TRAINER_DEFAULTS, _cli_class


# name -> "module:function"; each takes argv (list[str]) and returns an exit code.
TOOLS = {
    "data": ("lldslight.data.cli:main", "synthesise or inspect data: lldslight data synth --out DIR"),
    "index": ("lldslight.retrieval.cli:index_main", "build a BM25 or dense index over a corpus jsonl"),
    "serve": ("lldslight.retrieval.cli:serve_main", "serve an index over Search-R1's HTTP API"),
    "plot": ("lldslight.science.plots:main", "plot the LLD diagnostics of one or more runs"),
    "sft": ("lldslight.sft:main", "supervised warm start on gold search trajectories (before GRPO)"),
    "export": ("lldslight.policy.export:main", "merge the adapter of a checkpoint into a HF model directory"),
}
DEBUG_ENV = "LLDSLIGHT_DEBUG"


def _quiet_known_warnings() -> None:
    import warnings

    # Manual optimisation checkpoints after the step by design; Lightning's advice does not apply.
    warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
    warnings.filterwarnings("ignore", message=".*isinstance.treespec, LeafSpec.*")
    # GRPOModule.on_after_batch_transfer (exact-resume RNG) is meant to run beside the datamodule's hooks.
    warnings.filterwarnings("ignore", message=".*overridden `on_after_batch_transfer` in `LightningModule`.*")
    # peft (PeftModel.__init__) reads transformers' deprecated is_gradient_checkpointing; lldslight does not.
    warnings.filterwarnings("ignore", message=".*`is_gradient_checkpointing` is deprecated.*")
    # Lightning advertises its cloud products ("Tip: ... try installing litlogger / litmodels") on every
    # run; a line that is not about the run.
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoProductTips) for f in logger.filters):
            logger.addFilter(_NoProductTips())


class _NoProductTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).lstrip().startswith("\U0001f4a1 Tip:")


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
    _quiet_known_warnings()
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
    # Like `python -m`, make the working directory importable, so YAML can name your own
    # callbacks and reward functions by class_path (e.g. callbacks.trajectory_table.TrajectoryTable).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    cli_class, module_cls, datamodule_cls = _cli_class()
    cli_class.argv = list(argv)  # what it parses (LightningCLI keeps no copy): read by _flags_to_first_logger
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
    if from_command_line:
        from lldslight.run.hostmem import reexec_with_malloc_tunables

        reexec_with_malloc_tunables()  # once, before anything is allocated (lldslight/run/hostmem.py)
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes", "on")
    if "--debug" in argv:
        argv, debug = [a for a in argv if a != "--debug"], True
        if from_command_line:
            sys.argv[1:] = argv  # what LightningCLI and DDP's launcher read
            os.environ[DEBUG_ENV] = "1"  # inherited by DDP's worker processes
    command = argv[0] if argv and not argv[0].startswith("-") else ""

    from jsonargparse import ArgumentError

    from lldslight.errors import EXIT_BROKEN_PIPE, Stopped, UserError

    try:
        code = _run(argv, from_command_line)
        sys.stdout.flush()  # here, so that a reader that left is seen below, not at interpreter exit
        return code
    except BrokenPipeError:
        # The reader of the output left (`lldslight data synth | head`): nothing more to say to it,
        # and nothing to report (a pipe's reader may stop early). Later writes go nowhere.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
    except Stopped as stop:
        print(f"lldslight{' ' + command if command else ''}: {stop}", file=sys.stderr)
        return stop.code
    except (UserError, ArgumentError) as err:
        if debug:  # the traceback, then the same line and exit status as without --debug
            traceback.print_exc()
        message = _jsonargparse_one_line(str(err)) if isinstance(err, ArgumentError) else str(err)
        print(f"lldslight{' ' + command if command else ''}: error: {message}", file=sys.stderr)
        return 2


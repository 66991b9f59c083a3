"""The ``lldslight`` command: LightningCLI's fit / validate / test, plus data, index, serve, plot,
sft and export. Training runs are configured by YAML (``--config``, repeatable, later files win);
``lldslight fit --print_config`` shows every knob with its default.

One rule for bad input, every command: a configuration or data error (an unknown key, a value out
of range, a missing or malformed file, an unreachable retriever, a model that is not on disk)
prints ``lldslight <command>: error: <message>`` and exits with status 2, without a traceback.
``--debug`` (anywhere on the command line) or ``LLDSLIGHT_DEBUG=1`` shows the traceback instead.

- command.py: ``main``, the front: the tools dispatched, errors said in one line;
- lightning.py: the LightningCLI of fit / validate / test, its trainer defaults;
- checks.py: what is refused before the run starts;
- resume.py: what a resume took from its checkpoint, and ``--resume_override``;
- run_dirs.py: the run directories claimed and locked, and the line a stopped run ends with.

``lldslight`` (the console script) and ``python -m lldslight.cli`` both run :func:`main`.
"""
from lldslight.cli.command import main

__all__ = ["main"]

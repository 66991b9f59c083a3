"""The errors a user fixes by changing a config, a file or the environment, not the code.

``lldslight`` prints them as one line, ``lldslight <command>: error: <message>`` (exit 2), without a
traceback; ``--debug`` or ``LLDSLIGHT_DEBUG=1`` shows it. Everything else is a bug and keeps its
traceback. The library's own error types (DataFormatError, RetrievalError, PolicyLoadError,
PlotInputError, ...) derive from :class:`UserError`; so can yours.
"""
from __future__ import annotations

import argparse
import sys
import typing
from pathlib import Path
from typing import Any, Callable, Optional


class UserError(Exception):
    """Bad configuration, data or environment; the message names the key, file or value."""


class ConfigError(UserError, ValueError):
    """A setting is out of its range or contradicts another one."""


class MissingFileError(UserError, FileNotFoundError):
    """A file or directory the configuration names does not exist."""


class CheckpointError(UserError, ValueError):
    """A checkpoint is missing, truncated or corrupt."""


def require(ok: bool, key: str, allowed: str, value: object, why: str = "") -> None:
    """Raise ``ConfigError("<key> must be <allowed>, got <value>[: why]")`` unless ``ok``."""
    if not ok:
        raise ConfigError(f"{key} must be {allowed}, got {value!r}" + (f": {why}" if why else ""))


def choices(options: Any) -> tuple:
    """The values of a ``Literal[...]`` type (or of any iterable): the one definition of a choice
    set, for signatures (jsonargparse checks them) and for :func:`require_choice` alike."""
    return typing.get_args(options) or tuple(options)


def one_of(options: Any) -> str:
    """``'a', 'b' or 'c'``: a choice set as the ``allowed`` text of :func:`require`."""
    shown = [repr(o) for o in choices(options)]
    return shown[0] if len(shown) == 1 else ", ".join(shown[:-1]) + " or " + shown[-1]


def require_choice(value: object, key: str, options: Any, why: str = "") -> None:
    """``require(value in options, key, "'a', 'b' or 'c'", value, why)`` for a ``Literal`` type or an
    iterable of choices."""
    allowed = choices(options)
    if value not in allowed:
        require(False, key, one_of(allowed), value, why)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for lldslight's tools: a usage error is one line, not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")


def script_main(main: Callable[[], Optional[int]]) -> int:
    """Run a script's ``main`` as a command: a refusal it raises as ``SystemExit("message")`` (the
    form its tests catch) or as a UserError prints that one line and exits 2, bad input, as
    lldslight's own commands do (a bare SystemExit with a message would exit 1, read as a failure)."""
    try:
        return int(main() or 0)
    except UserError as err:  # e.g. writes.check_out_file's: the script's name, then the message
        print(f"{Path(sys.argv[0]).stem}: {err}", file=sys.stderr)
        return 2
    except SystemExit as stop:
        if isinstance(stop.code, str):
            print(stop.code, file=sys.stderr)
            return 2
        raise


# Exit statuses of a command stopped by a signal, after Lightning's graceful shutdown: the shell's own
# convention, 128 + the signal's number (SIGINT 2, SIGTERM 15), so scripts and schedulers read them
# as "interrupted", not as a failure (1) or bad input (2).
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143
EXIT_BROKEN_PIPE = 141  # the reader of stdout left (`lldslight data synth | head`), as SIGPIPE would end a C tool


class Stopped(Exception):
    """A run stopped on request (Ctrl-C, SIGTERM): the CLI prints the message and exits with ``code``."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code

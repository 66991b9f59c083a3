"""The errors a user fixes by changing a config, a file or the environment, not the code.

``lldslight`` prints them as one line, ``lldslight <command>: error: <message>`` (exit 2), without a
traceback; ``--debug`` or ``LLDSLIGHT_DEBUG=1`` shows it. Everything else is a bug and keeps its
traceback. The library's own error types (DataFormatError, RetrievalError, PolicyLoadError,
PlotInputError, ...) derive from :class:`UserError`; so can yours.
"""
from __future__ import annotations

import argparse


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


class ArgumentParser(argparse.ArgumentParser):
    """argparse for lldslight's tools: a usage error is one line, not the whole usage text."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the options)\n")

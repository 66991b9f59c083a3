"""Package attributes imported from their submodule on first use (PEP 562).

A package's ``__init__`` that imports every submodule makes ``import pkg.small_module`` pay for all
of them (FastAPI, faiss, Lightning). With ``__getattr__, __dir__ = lazy_exports(__name__, {...})``,
``from pkg import Name`` and a config's ``class_path: pkg.Name`` still work, and nothing is
imported before it is asked for.
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable


def lazy_exports(package: str, where: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``where``: exported name -> submodule (relative to ``package``) that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{where[name]}"), name)
        setattr(sys.modules[package], name, value)  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__

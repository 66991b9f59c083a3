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


def moved_module(old: str, new: str) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A deprecated module path kept importable: ``__getattr__, __dir__ = moved_module(__name__,
    "pkg.new_name")``. Every name read through ``old`` (``from old import X``, a config's
    ``class_path: old.X``) comes from ``new``, with a DeprecationWarning that names the new path."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(new), name)  # AttributeError as the new module's
        import warnings

        warnings.warn(f"{old}.{name} moved to {new}.{name} ({old} is deprecated)",
                      DeprecationWarning, stacklevel=2)
        return value

    def __dir__() -> list[str]:
        return sorted(n for n in vars(importlib.import_module(new)) if not n.startswith("__"))

    return __getattr__, __dir__

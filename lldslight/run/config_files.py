"""YAML a user gives lldslight (``--config`` files, inline ``--config`` strings), checked before
anything reads it for real: a file is read once and fully, so its problems must be said by name.

- UTF-8 only: another encoding is refused with the file, the byte and its offset and line.
- A key written twice in one mapping (``lr:`` twice, two top-level ``model:`` blocks) is refused
  with both lines: YAML readers keep the later one silently. (``<<:`` merge keys are how YAML says
  "these keys, overridable", so keys that override a merge are fine.)
- Bounded, so a small file cannot exhaust the machine: the file's size and the number of nodes it
  expands to (an alias counts as a copy of its anchor: a few hundred bytes of nested aliases, the
  "billion laughs", expand to 10^9 nodes) against the memory available now, and its nesting depth
  against the interpreter's recursion limit (YAML's composer, jsonargparse and ``yaml.dump`` all
  recurse per level: 20,000 levels end in a RecursionError that names no file).
- An empty file, or one that is not a mapping of settings, is refused by name (jsonargparse says
  "Unexpected config:" and nothing more); so is a section (``model:``, ``data:``, ``trainer:``)
  given as null or a scalar.

The checks walk PyYAML's event stream, which is produced without recursion and without building
the document, so a hostile file costs its own size in time and memory, no more. PyYAML has no such
limits of its own (its safe loader only limits the types it builds).
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import yaml

from lldslight.errors import ConfigError
from lldslight.run.hostmem import available_memory

# The memory a parsed YAML node costs once lldslight's CLI holds it: PyYAML's node and Python object,
# jsonargparse's Namespace entry and its deep copies (the parser copies a config several times),
# about 1 KiB; a file's bytes cost the event stream's tokens and marks, about 64 bytes each.
NODE_BYTES = 1024
FILE_BYTE_COST = 64
# Of the memory available now, the share a config may take: the model, the data and the rollout
# need the rest.
MEMORY_SHARE = 4
# Stack frames a level of nesting costs in the deepest recursive reader of a config (PyYAML's
# composer and constructor, jsonargparse's merge and deepcopy, yaml.dump): a few each; 8 keeps
# every one of them well inside the interpreter's recursion limit.
FRAMES_PER_LEVEL = 8
SECTIONS = ("model", "data", "trainer")


def limits() -> dict[str, int]:
    """The bounds a config is checked against on this machine, now."""
    budget = available_memory() // MEMORY_SHARE
    return {"bytes": budget // FILE_BYTE_COST, "nodes": budget // NODE_BYTES,
            "depth": sys.getrecursionlimit() // FRAMES_PER_LEVEL}


def _decode(data: bytes, source: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ConfigError(f"{source}: not UTF-8 text (byte {data[err.start:err.start + 1]!r} at offset {err.start}, "
                          f"line {line}); save the config as UTF-8") from None


class _Node:
    """An open mapping or sequence while the event stream is walked."""

    __slots__ = ("mapping", "anchor", "size", "keys", "expect_key", "line")

    def __init__(self, mapping: bool, anchor: Optional[str], line: int):
        self.mapping, self.anchor, self.size, self.line = mapping, anchor, 1, line
        self.keys: dict[tuple[str, bool], int] = {}
        self.expect_key = mapping


def check_text(text: str, source: str) -> None:
    """Raise a ConfigError naming ``source`` (a file name or "--config '...'") and the line when
    ``text`` has a key twice, expands or nests past :func:`limits`, or is malformed YAML."""
    bound = limits()
    anchors: dict[str, int] = {}
    stack: list[_Node] = []
    total = 0

    def add(size: int, line: int, into_parent: bool = True) -> None:
        """``size`` more values in the expanded document (and in the open collection holding them)."""
        nonlocal total
        if stack and into_parent:
            stack[-1].size += size
        total += size
        if total > bound["nodes"]:
            raise ConfigError(f"{source}, line {line}: the config expands to more than {bound['nodes']:,} values "
                              f"(aliases count as copies of their anchors): more than a quarter of the "
                              f"{available_memory() / 2**30:.1f} GiB of memory available would hold it; is it a "
                              "config? (nested aliases, a 'billion laughs', are refused)")

    def key_seen(event: Any) -> None:
        """``event`` opens a node in the parent mapping's key position: a scalar key is recorded."""
        parent = stack[-1] if stack else None
        if parent is None or not parent.mapping:
            return
        if parent.expect_key and isinstance(event, yaml.ScalarEvent) and event.value != "<<":
            key = (event.value, event.implicit[0])
            line = event.start_mark.line + 1
            if key in parent.keys:
                raise ConfigError(f"{source}, line {line}: key {event.value!r} is given twice in one mapping (first at "
                                  f"line {parent.keys[key]}); YAML would keep only the later one: remove one")
            parent.keys[key] = line
        parent.expect_key = not parent.expect_key

    try:
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            line = event.start_mark.line + 1 if event.start_mark is not None else 0
            if isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent, yaml.CollectionStartEvent)):
                key_seen(event)
            if isinstance(event, yaml.ScalarEvent):
                add(1, line)
                if event.anchor:
                    anchors[event.anchor] = 1
            elif isinstance(event, yaml.AliasEvent):
                if event.anchor not in anchors:  # PyYAML's composer says it, with the line
                    continue
                add(anchors[event.anchor], line)
            elif isinstance(event, yaml.CollectionStartEvent):
                add(1, line, into_parent=False)  # the collection itself; the parent gets its size at its end
                stack.append(_Node(isinstance(event, yaml.MappingStartEvent), event.anchor, line))
                if len(stack) > bound["depth"]:
                    raise ConfigError(f"{source}, line {line}: nested more than {bound['depth']} levels deep (the "
                                      "interpreter's recursion limit allows no more for the readers of a config); "
                                      "is it a config?")
            elif isinstance(event, yaml.CollectionEndEvent):
                node = stack.pop()
                if node.anchor:
                    anchors[node.anchor] = node.size
                if stack:
                    stack[-1].size += node.size
    except yaml.YAMLError as err:
        raise malformed(err, source) from None


def malformed(err: yaml.YAMLError, source: str) -> ConfigError:
    mark = getattr(err, "problem_mark", None)
    where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or str(err)
    return ConfigError(f"malformed YAML in {source}{where}: {problem}")


def load_text(text: str, source: str, sections: bool = True) -> Any:
    """``text`` checked (:func:`check_text`) and loaded; with ``sections``, it must be a mapping
    whose ``model``, ``data`` and ``trainer`` (when given) are mappings."""
    check_text(text, source)
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise malformed(err, source) from None
    if value is None:
        raise ConfigError(f"{source} is empty: it holds no settings (remove it from the command line, or write "
                          "settings in it, e.g. `trainer: {max_steps: 10}`)")
    if not isinstance(value, dict):
        raise ConfigError(f"{source} must be a mapping of settings (key: value), got a {type(value).__name__}")
    if sections:
        for key in SECTIONS:
            if key in value and not isinstance(value[key], dict):
                raise ConfigError(f"{source}: {key} must be a mapping of settings, got {value[key]!r}"
                                  f"{' (an empty `' + key + ':` line?)' if value[key] is None else ''}")
    return value


def load_file(path: str | Path, sections: bool = True) -> Any:
    """A YAML config file, checked and loaded; one ConfigError naming the file for any problem."""
    path = Path(path)
    bound = limits()
    try:
        size = path.stat().st_size
        if size > bound["bytes"]:
            raise ConfigError(f"{path}: {size:,} bytes, more than a config read whole can take on this machine "
                              f"({bound['bytes']:,} bytes, from the {available_memory() / 2**30:.1f} GiB of memory "
                              "available); is it a config?")
        data = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"cannot read config {path}: {err.strerror or err}") from None
    return load_text(_decode(data, str(path)), str(path), sections)

"""Reading an offline W&B run back from its files, as a test needs it: the history rows (every
``log`` call's values) from the run's ``.wandb`` file, and the tables those rows point to.

The ``.wandb`` file is a LevelDB-format log of protobuf ``Record`` messages. wandb parses the
records with its own protobuf classes (used here), but since its core moved out of Python it ships
no reader of the log framing, so the framing is read by hand below (the layout is LevelDB's log
format, which wandb's own writer follows): a 7-byte file header (``:W&B``, magic 0xBEE1, version
0), then 32 KiB blocks of chunks, each a 7-byte header (CRC-32 of the type byte and the data,
length, type: 1 full, 2 first, 3 middle, 4 last) and its data; a block's tail shorter than a header
is zero padding. Every chunk's CRC is checked, so a misread fails here, not as a wrong value.
"""
from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path
from typing import Any, Iterator

BLOCK = 32768
HEADER = 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_dir(save_dir: Path) -> Path:
    """The one offline run under ``save_dir`` (``<save_dir>/wandb/offline-run-*``)."""
    runs = sorted((Path(save_dir) / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs
    return runs[0]


def records(path: Path) -> Iterator[Any]:
    """The ``wandb_internal_pb2.Record`` messages of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B" and struct.unpack("<HB", raw[4:7]) == (0xBEE1, 0), raw[:7]
    pos, parts = HEADER, []
    while pos + HEADER <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a chunk header: zero padding
            pos += left
            continue
        crc, length, kind = struct.unpack("<IHB", raw[pos:pos + HEADER])
        if (crc, length, kind) == (0, 0, 0):  # the unwritten rest of the last block
            break
        data = raw[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(data, zlib.crc32(bytes([kind]))) == crc, f"{path}: bad chunk at byte {pos}"
        pos += HEADER + length
        parts.append(data)
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record
        else:
            assert kind in (FIRST, MIDDLE), kind


def history(run: Path) -> list[dict[str, Any]]:
    """Each history row of the run (one per ``wandb.log`` call) as a flat dict of decoded values;
    a table's entry is its ``<key>/...`` fields (``<key>/path``: the table's file under ``files/``)."""
    (path,) = run.glob("*.wandb")
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item})
    return rows


def table(run: Path, row: dict[str, Any], key: str) -> dict[str, Any]:
    """The table ``key`` a history row logged: ``{"columns": [...], "data": [[...], ...]}``."""
    assert row[f"{key}/_type"] == "table-file", row
    return json.loads((run / "files" / row[f"{key}/path"]).read_text())

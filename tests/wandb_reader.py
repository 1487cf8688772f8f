"""Read the history of a wandb offline run (`run-*.wandb`) with wandb's own protobuf records.

The file is a LevelDB-style log (wandb's datastore): a 7-byte header (":W&B", magic, version), then
32 KiB blocks of records, each with a 7-byte header (crc32, length, type: full/first/middle/last).
"""
from __future__ import annotations

import json
from pathlib import Path

BLOCK, HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path):
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb datastore file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # block trailer: zero padding
            pos += BLOCK - pos % BLOCK
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + HEADER:pos + HEADER + length], pos + HEADER + length
        if kind == 0:
            continue
        pending += chunk
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def history(path: Path) -> list[dict]:
    """Every logged row: {key: value}; media (tables, html) come back as dicts of their fields."""
    rows = []
    for record in records(path):
        if not record.HasField("history"):
            continue
        row: dict = {}
        for item in record.history.item:
            keys = [item.key] if item.key else list(item.nested_key)
            target = row
            for key in keys[:-1]:
                target = target.setdefault(key, {})
            target[keys[-1]] = json.loads(item.value_json)
        rows.append(row)
    return rows

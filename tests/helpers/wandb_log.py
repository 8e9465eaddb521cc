"""The history rows of an offline W&B run, read from its transaction log (``run-<id>.wandb``) without W&B's service.

The log is LevelDB's log format behind a 7-byte W&B header (``:W&B``, a magic number, a version): 32 KiB blocks of
records, each a 7-byte header (CRC-32, length, type) and a payload; a record that does not fit a block is split
into FIRST, MIDDLE and LAST pieces, and a block's tail under 7 bytes is padding. Each whole payload is a serialised
``wandb_internal_pb2.Record``. W&B's service may still be writing the log when ``wandb.finish`` returns: a record cut
short at the end of the file is not read, and the run is whole once its ``exit`` record is there (:func:`finished`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path

BLOCK = 32768
HEADER = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def payloads(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pieces = 7, b""
    while pos + HEADER.size <= len(data):
        if BLOCK - pos % BLOCK < HEADER.size:
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = HEADER.unpack_from(data, pos)
        if kind == 0:
            return  # the zeroed rest of the last block
        if pos + HEADER.size + length > len(data):
            return  # a record still being written
        piece, pos = data[pos + HEADER.size : pos + HEADER.size + length], pos + HEADER.size + length
        if kind == FULL:
            yield piece
        elif kind == FIRST:
            pieces = piece
        elif kind == MIDDLE:
            pieces += piece
        elif kind == LAST:
            yield pieces + piece


def records(path: Path) -> Iterator:
    """The log's whole ``wandb_internal_pb2.Record`` messages, in order."""
    from wandb.proto import wandb_internal_pb2

    for payload in payloads(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        yield record


def finished(path: Path) -> bool:
    """Whether the run's ``exit`` record (its last) has been written."""
    return any(r.WhichOneof("record_type") == "exit" for r in records(path))


def history(path: Path) -> list[dict]:
    """Every ``wandb.log`` row of the run, its values decoded from JSON, in order."""
    return [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records(path)
        if r.WhichOneof("record_type") == "history"
    ]

"""Read the records of an offline W&B run (its `run-<id>.wandb` file) without a W&B server or wandb's own
reader (recent wandb releases ship none in Python): the file is a LevelDB-style log of protobuf records."""

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HEADER = struct.Struct("<4sHB")  # b":W&B", magic 0xBEE1, version
RECORD_HEADER = struct.Struct("<IHB")  # crc32, length, type
BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def raw_records(path: Path) -> list[bytes]:
    data = Path(path).read_bytes()
    ident, magic, _ = HEADER.unpack_from(data, 0)
    assert ident == b":W&B" and magic == 0xBEE1, path
    records, pending, pos = [], b"", HEADER.size
    while pos + RECORD_HEADER.size <= len(data):
        left_in_block = BLOCK - pos % BLOCK
        if left_in_block < RECORD_HEADER.size:  # the writer pads a block's tail too short for a header
            pos += left_in_block
            continue
        _, length, kind = RECORD_HEADER.unpack_from(data, pos)
        if kind == 0 and length == 0:
            break  # zero padding at the end of a file not closed
        body = data[pos + RECORD_HEADER.size : pos + RECORD_HEADER.size + length]
        pos += RECORD_HEADER.size + length
        if kind == FULL:
            records.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            records.append(pending + body)
            pending = b""
    return records


@dataclass
class OfflineRun:
    """What a test asserts about a run: its id, name, group, config and logged history rows."""

    run_id: str = ""
    name: str = ""
    group: str = ""
    config: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)


def read_offline_run(path: Path) -> OfflineRun:
    from wandb.proto import wandb_internal_pb2 as pb

    run = OfflineRun()
    for body in raw_records(path):
        record = pb.Record()
        record.ParseFromString(body)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.run_id, run.name, run.group = record.run.run_id, record.run.display_name, record.run.run_group
            for item in record.run.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in record.config.update:
                run.config[item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            run.history.append(row)
    return run


def offline_run_files(wandb_dir: Path) -> list[Path]:
    """Every offline run's `.wandb` file under a W&B dir (`<dir>/wandb/offline-run-*/run-*.wandb`)."""
    return sorted(Path(wandb_dir).glob("**/offline-run-*/run-*.wandb"))

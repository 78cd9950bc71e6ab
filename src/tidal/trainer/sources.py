"""Load chat conversations from a JSONL/parquet file, a Hugging Face dataset or a built-in generator."""

import json
from pathlib import Path
from typing import Any

from tidal.config.common import BuiltinDataset, FileDataset, HFDataset
from tidal.errors import UserError

Conversation = list[dict[str, Any]]
VALID_ROLES = {"system", "user", "assistant", "tool"}


def load_conversations(source: FileDataset | HFDataset | BuiltinDataset) -> list[Conversation]:
    if isinstance(source, BuiltinDataset):
        from tidal.envs import reverse_text

        return reverse_text.generate_conversations(source.split, source.num_examples, source.seed)
    if isinstance(source, FileDataset):
        rows = _read_file(source.path, source.num_examples)
        where = str(source.path)
    else:
        rows = _read_hf(source)
        where = f"hf:{source.id}"
    return [
        _check_messages(row, source.messages_field, f"{where}: row {i + 1}") for i, row in enumerate(rows)
    ]


def _read_file(path: Path, limit: int | None) -> list[dict[str, Any]]:
    if not path.is_file():
        raise UserError(f"{path}: dataset file not found")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
        rows = table.slice(0, limit).to_pylist() if limit else table.to_pylist()
        return rows
    if path.suffix not in (".jsonl", ".json"):
        raise UserError(f"{path}: unsupported dataset format (expected .jsonl or .parquet)")
    rows = []
    with path.open() as fh:
        for line_no, line in enumerate(fh, start=1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{line_no}: invalid JSON ({exc.msg})") from None
    return rows


def _read_hf(source: HFDataset) -> list[dict[str, Any]]:
    import datasets

    try:
        dataset = datasets.load_dataset(source.id, source.subset, split=source.split)
    except Exception as exc:  # datasets raises many types for "not found / no network"
        raise UserError(f"hf:{source.id}: cannot load dataset split {source.split!r}: {exc}") from None
    if source.num_examples is not None:
        dataset = dataset.select(range(min(source.num_examples, len(dataset))))
    return list(dataset)


def _check_messages(row: Any, field: str, where: str) -> Conversation:
    if not isinstance(row, dict) or field not in row:
        raise UserError(f"{where}: missing field {field!r}")
    messages = row[field]
    if not isinstance(messages, list) or not messages:
        raise UserError(f"{where}: {field!r} must be a non-empty list of messages")
    for j, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in VALID_ROLES:
            raise UserError(f"{where}: message {j}: role must be one of {sorted(VALID_ROLES)}")
        if not isinstance(message.get("content"), str):
            raise UserError(f"{where}: message {j}: content must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message to train on")
    return messages

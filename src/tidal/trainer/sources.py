"""Load chat conversations from a JSONL/parquet file, a Hugging Face dataset or a built-in generator."""

import json
from pathlib import Path
from typing import Any

from tidal.config.common import BuiltinDataset, FileDataset, HFDataset
from tidal.config.env_names import BUILTIN_ENVS
from tidal.errors import UserError, first_line

Conversation = list[dict[str, Any]]
ROLES = ("system", "user", "assistant", "tool")
VALID_ROLES = frozenset(ROLES)


def load_conversations(source: FileDataset | HFDataset | BuiltinDataset) -> list[Conversation]:
    if isinstance(source, BuiltinDataset):
        from tidal.envs.demonstrations import generate_demonstrations
        from tidal.envs.registry import refuse_images, resolve_env

        if source.name in BUILTIN_ENVS:  # an unknown name gets generate_demonstrations' own message
            refuse_images(source.name, resolve_env(source.name).factory)
        return generate_demonstrations(
            source.name, source.split, source.num_examples, source.seed, dict(source.kwargs)
        )
    if isinstance(source, FileDataset):
        rows = _read_file(source.path, source.num_examples)
        where = str(source.path)
    else:
        where = f"hf:{source.id}"
        rows = [(f"{where}: row {i + 1}", row) for i, row in enumerate(_read_hf(source))]
    if not rows:
        raise UserError(f"{where}: no conversations in it (an empty dataset)")
    return [_check_messages(row, source.messages_field, at) for at, row in rows]


Located = list[tuple[str, Any]]
"""Rows with where each is, as a user finds it: `data.jsonl:4` (its line, 1-based, blank lines counted) or
`data.parquet: row 3` (1-based)."""


def _read_file(path: Path, limit: int | None) -> Located:
    if not path.is_file():
        raise UserError(f"{path}: dataset file not found")
    try:
        if path.suffix == ".parquet":
            return _read_parquet(path, limit)
        if path.suffix not in (".jsonl", ".json"):
            raise UserError(f"{path}: unsupported dataset format (expected .jsonl or .parquet)")
        return _read_jsonl(path, limit)
    except OSError as exc:
        raise UserError(f"{path}: cannot read: {exc.strerror or first_line(exc)}") from None


def _read_parquet(path: Path, limit: int | None) -> Located:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow's ArrowInvalid & co. for a file that is not parquet
        raise UserError(f"{path}: not a readable parquet file ({first_line(exc)})") from None
    rows = table.slice(0, limit).to_pylist() if limit else table.to_pylist()
    return [(f"{path}: row {i + 1}", row) for i, row in enumerate(rows)]


def _read_jsonl(path: Path, limit: int | None) -> Located:
    rows: Located = []
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            if limit is not None and len(rows) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise UserError(
                    f"{path}:{line_no}: not UTF-8 text (byte {exc.start + 1} of the line)"
                ) from None
            if not line.strip():
                continue
            try:
                rows.append((f"{path}:{line_no}", json.loads(line)))
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
            role = message.get("role") if isinstance(message, dict) else None
            raise UserError(f"{where}: {field}[{j}].role: {role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise UserError(f"{where}: {field}[{j}].content must be a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message to train on")
    return messages

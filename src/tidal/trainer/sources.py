"""Load chat conversations from a JSONL/parquet file, a Hugging Face dataset or a built-in generator."""

import json
from pathlib import Path
from typing import Any

from tidal.config.common import BuiltinDataset, FileDataset, HFDataset
from tidal.envs.chat import IMAGE_PART_TYPES
from tidal.envs.tools import TOOLS_KEY
from tidal.errors import UserError, first_line

Conversation = list[dict[str, Any]]
ROLES = ("system", "user", "assistant", "tool")
VALID_ROLES = frozenset(ROLES)


def load_conversations(source: FileDataset | HFDataset | BuiltinDataset) -> list[Conversation]:
    if isinstance(source, BuiltinDataset):
        from tidal.envs.demonstrations import generate_demonstrations

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
    base = source.path.parent if isinstance(source, FileDataset) else None
    return [_with_pictures(_check_messages(row, source.messages_field, at), base, at) for at, row in rows]


def _with_pictures(messages: Conversation, base: Path | None, where: str) -> Conversation:
    """The conversation with every picture as a data URL: a part `{"type": "image", "path": …}` (relative to
    the data file's folder) is read in; a missing, broken or oversized picture is a one-line error."""
    from tidal.envs.chat import message_images

    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            continue
        for k, part in enumerate(content):
            if part.get("type") in IMAGE_PART_TYPES and "path" in part:
                content[k] = {
                    "type": "image_url",
                    "image_url": {"url": _read_picture(base, part["path"], where)},
                }
    try:
        message_images(messages)  # every picture readable, none over the size limit
    except ValueError as exc:
        raise UserError(f"{where}: {exc}") from None
    return messages


def _read_picture(base: Path | None, path: Any, where: str) -> str:
    """The picture file `path` (relative to `base`, the data file's folder) as a data URL."""
    import base64

    file = Path(str(path))
    if base is not None and not file.is_absolute():
        file = base / file
    try:
        data = file.read_bytes()
    except OSError as exc:
        raise UserError(f"{where}: picture {str(path)!r}: cannot read {file}: {exc.strerror}") from None
    suffix = file.suffix.lower().lstrip(".") or "png"
    kind = {"jpg": "jpeg"}.get(suffix, suffix)
    return f"data:image/{kind};base64," + base64.b64encode(data).decode("ascii")


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
        problem = _content_problem(message.get("content"))
        if problem is not None:
            raise UserError(f"{where}: {field}[{j}].content {problem}")
        if TOOLS_KEY in message:
            problem = (
                "go on the first message only (they describe the whole conversation)"
                if j
                else _tools_problem(message[TOOLS_KEY])
            )
            if problem is not None:
                raise UserError(f"{where}: {field}[{j}].{TOOLS_KEY} {problem}")
    if not any(m["role"] == "assistant" for m in messages):
        raise UserError(f"{where}: no assistant message to train on")
    return messages


def _tools_problem(tools: Any) -> str | None:
    """What is wrong with a conversation's tools (rendered as a rollout's prompt renders them,
    `tidal.envs.tools.conversation_template_inputs`): a list of OpenAI function schemas, each
    `{"type": "function", "function": {"name": …, "parameters": {…}}}`; None when they are fine."""
    if not isinstance(tools, list) or not tools:
        return "must be a non-empty list of function schemas"
    for k, schema in enumerate(tools):
        function = schema.get("function") if isinstance(schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            return f'[{k}]: a schema is {{"type": "function", "function": {{"name": …, "parameters": …}}}}'
        if not isinstance(function.get("parameters", {}), dict):
            return f"[{k}].function.parameters must be a JSON schema object"
    return None


def _content_problem(content: Any) -> str | None:
    """What is wrong with a message's content, which is a string, or a list of OpenAI content parts (text
    and pictures: `{"type": "image_url", "image_url": {"url": "data:image/png;base64,…"}}`, or an image
    path as `{"type": "image", "path": "pictures/1.png"}`); None when it is fine."""
    if isinstance(content, str):
        return None
    if not isinstance(content, list) or not content:
        return "must be a string or a non-empty list of content parts"
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            continue
        if kind not in IMAGE_PART_TYPES:
            return (
                f"part {k}: a content part is text or a picture ({', '.join(IMAGE_PART_TYPES)}), not {kind!r}"
            )
    return None

"""`<output_dir>/events.jsonl`: one JSON record per failure and recovery of a run's processes (issue 14),
written by the launcher (its children) and the orchestrator (its reward workers)."""

import json
import time
from pathlib import Path
from typing import Any


class EventLog:
    """Appends one JSON record per line: `event` (failure, recovery), `time` (Unix seconds), `role`, and
    what the event says (cause, exit code or signal, action, seconds)."""

    def __init__(self, output_dir: Path, node: str | None = None):
        self.path = Path(output_dir) / "events.jsonl"
        self.node = node

    def write(self, event: str, at: float | None = None, **fields: Any) -> dict[str, Any]:
        """Append one record; `at`: when it happened (Unix seconds; default now)."""
        record = {"time": round(time.time() if at is None else at, 3), "event": event, **fields}
        if self.node is not None:
            record["node"] = self.node
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # one write of one line in append mode: records of several writers (nodes, processes) never interleave
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")
        return record


def read_events(output_dir: Path) -> list[dict[str, Any]]:
    path = Path(output_dir) / "events.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

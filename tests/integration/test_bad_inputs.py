"""Bad inputs to a real `tidal sft` end in one line naming the file (and the line, as an editor counts it)
and a non-zero exit, never in a traceback: broken datasets, an output directory that cannot be created, a
disk that fills up while a checkpoint is written."""

import json
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO, run_tidal

CI_CONFIG = str(REPO / "configs" / "ci" / "sft_tiny.toml")
GOOD = json.dumps({"messages": [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "ba"}]})


def sft_error(tmp_path: Path, *args: str) -> str:
    result = run_tidal("sft", "@", CI_CONFIG, "--output-dir", str(tmp_path / "out"), *args)
    assert result.returncode != 0, result.stdout
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


def train_file(path: Path) -> list[str]:
    return ["--data.train", f'{{type = "file", path = "{path}"}}']


BAD_FILES = [
    # (file name, contents, the end of the error line with {path} for the file)
    ("empty.jsonl", b"", "{path}: no conversations in it (an empty dataset)"),
    ("blank.jsonl", b"\n\n", "{path}: no conversations in it (an empty dataset)"),
    (
        "latin1.jsonl",
        (GOOD + "\n").encode() + b'{"messages": "caf\xe9"}\n',
        "{path}:2: not UTF-8 text (byte 18 of the line)",
    ),
    ("text.parquet", b"this is not parquet\n", "{path}: not a readable parquet file"),
    # line 4 of the file (a blank line 2 counts, as in an editor): not "row 3"
    (
        "no_messages.jsonl",
        f'{GOOD}\n\n{GOOD}\n{{"text": 1}}\n'.encode(),
        "{path}:4: missing field 'messages'",
    ),
    ("bad_json.jsonl", f"{GOOD}\n{{oops\n".encode(), "{path}:2: invalid JSON"),
    (
        "robot.jsonl",
        json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(),
        "{path}:1: messages[0].role: 'robot' is not one of system, user, assistant, tool",
    ),
]


@pytest.mark.parametrize("name,data,expected", BAD_FILES, ids=[b[0] for b in BAD_FILES])
def test_bad_dataset_file_is_one_line_with_the_file_and_line(tmp_path, name, data, expected):
    path = tmp_path / name
    path.write_bytes(data)
    line = sft_error(tmp_path, *train_file(path))
    wanted = expected.format(path=path)
    assert line.startswith("tidal sft: error: ") and wanted in line, line


def test_output_dir_below_a_regular_file_names_the_path(tmp_path):
    """As root every directory is writable: a path below a regular file fails for root too."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    result = run_tidal("sft", "@", CI_CONFIG, "--output-dir", str(blocker / "out"))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip() == f"tidal sft: error: {blocker / 'out'}: Not a directory"


@pytest.fixture
def tiny_disk() -> Iterator[Path]:
    """A 64 KiB tmpfs (needs root): the tiny model's checkpoint does not fit."""
    mount = Path("/tmp") / f"tidal-full-{uuid.uuid4().hex[:8]}"
    mount.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        mount.rmdir()


def test_full_disk_while_checkpointing_names_the_checkpoint(tiny_disk):
    out = tiny_disk / "out"
    result = run_tidal(
        "sft", "@", CI_CONFIG, "--output-dir", str(out), "--max-steps", "6", "--ckpt.interval", "3"
    )
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"tidal sft: error: {out}/checkpoints/step_3.tmp: cannot write: no space left on device (0 bytes free)"
    )

"""`tidal inference @ configs/debug/inference.toml`: the official openai client can chat; SIGTERM leaves nothing
(examples/reverse_text/infer.toml differs in model, port and length only; tests/unit/test_inference_launch.py
builds its launch)."""

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import SERVER_STARTUP_TIMEOUT, free_port, non_loopback_ip

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DOC_PORT = 18431  # the port the example's docs use; another port if a parallel run holds it


def pick_port() -> int:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", DOC_PORT))
        except OSError:
            return free_port()
    return DOC_PORT


def descendants(root: int) -> set[int]:
    """Every process below `root`, found through /proc (the server runs in its own session)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_healthy(process: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + SERVER_STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        assert process.poll() is None, f"tidal inference exited early:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"not healthy in time:\n{log.read_text()[-3000:]}")


def test_cli_serves_openai_client_and_sigterm_stops_everything(
    perturbed_weights: Path, tmp_path: Path
) -> None:
    import openai

    log = tmp_path / "inference.log"
    port = pick_port()
    command = [
        *(sys.executable, "-m", "tidal", "inference", "@", "configs/debug/inference.toml"),
        *("--model.name", str(perturbed_weights), "--server.port", str(port), "--cpu.omp-threads-bind", "1"),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, url, log)
        started = descendants(process.pid)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model=str(perturbed_weights),
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=8,
            temperature=1.0,
            logprobs=True,
            top_logprobs=2,
        )
        tokens = reply.choices[0].logprobs.content  # type: ignore[union-attr]
        assert tokens and all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in tokens)
        ip = non_loopback_ip()
        if ip is not None:  # bound to loopback only: unreachable through the machine's network address
            with pytest.raises(httpx.ConnectError):
                httpx.get(f"http://{ip}:{port}/health", timeout=2)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
    assert len(started) >= 2, started  # the API server and vLLM's engine process at least
    deadline = time.monotonic() + 10
    while any(running(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in started if running(pid)], "processes left behind after SIGTERM"
    assert "serving" in log.read_text()

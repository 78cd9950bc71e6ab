"""Rollout transport: the orchestrator ships each rank's `TrainBatch` for step n; trainer rank r receives it.

- `filesystem`: `<output_dir>/rollouts/step_<n>/rank_<r>.json`, the step directory renamed into place only
  when every rank's file is written, so a reader never sees a partial batch. Works on one host or on a
  shared filesystem across nodes.
- `zmq`: the orchestrator binds a ROUTER socket and serves batches from memory; each trainer rank connects
  with a DEALER, asks for (step, rank) and blocks until it is there. For runs without shared storage.

Batches are JSON (no pickle: nothing received can execute code), written by msgspec, which holds the
orchestrator's event loop for a fraction of `json.dumps`'s time (`benchmarks/orchestrator_step_end.py`). JSON
has no NaN or infinity, which msgspec would write as null: a batch holding one (the trainer masks such
tokens) is written by `json.dumps`, as before, and read back by `json.loads`.
"""

import json
import math
import re
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import msgspec

from tidal.config.rl import FilesystemTransport, ZMQTransport
from tidal.types import TrainBatch

_STEP_DIR = re.compile(r"^step_(\d+)$")
_ENCODER = msgspec.json.Encoder()


def encode(batch: TrainBatch) -> bytes:
    data = batch.to_dict()
    if not all_finite(batch):
        return json.dumps(data, separators=(",", ":")).encode()  # NaN/Infinity, which msgspec cannot write
    return _ENCODER.encode(data)


def all_finite(batch: TrainBatch) -> bool:
    """Whether every float of `batch` is finite (a row's sum is finite only if each of its values is, and
    logprobs and advantages are far from overflowing a sum)."""
    rows = (row for m in batch.micro_batches for row in (*m.inference_logprobs, *m.advantages))
    return all(math.isfinite(sum(row)) for row in rows) and all(
        math.isfinite(v) for v in batch.metrics.values() if isinstance(v, float)
    )


def decode(data: bytes) -> TrainBatch:
    try:
        parsed = msgspec.json.decode(data)
    except msgspec.DecodeError:  # written by json.dumps: holds NaN or Infinity
        parsed = json.loads(data)
    return TrainBatch.from_dict(parsed)


class BatchSender(Protocol):
    """Orchestrator side."""

    def send(self, step: int, per_rank: list[TrainBatch]) -> None: ...

    def discard_from(self, step: int) -> None:
        """Forget batches of `step` and later (a resumed orchestrator regenerates them)."""

    def close(self) -> None: ...


class BatchReceiver(Protocol):
    """Trainer side: blocks until this rank's batch for `step` is there (or `should_stop()` turns true)."""

    def receive(self, step: int, should_stop: Callable[[], bool] = lambda: False) -> TrainBatch | None: ...

    def close(self) -> None: ...


class FilesystemSender:
    """Writes `rollouts/step_<n>/rank_<r>.json` atomically and keeps the newest `keep_last` steps, and every
    step from `keep_from()` on (the trainer's latest checkpoint: a restarted trainer trains those again;
    None: no such floor)."""

    def __init__(
        self,
        output_dir: Path,
        config: FilesystemTransport,
        keep_from: Callable[[], int | None] = lambda: None,
    ):
        self.root = Path(output_dir) / "rollouts"
        self.root.mkdir(parents=True, exist_ok=True)
        self.keep_last = config.keep_last
        self.keep_from = keep_from

    def send(self, step: int, per_rank: list[TrainBatch]) -> None:
        staging = self.root / f"step_{step}.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        for rank, batch in enumerate(per_rank):
            (staging / f"rank_{rank}.json").write_bytes(encode(batch))
        final = self.root / f"step_{step}"
        shutil.rmtree(final, ignore_errors=True)
        staging.rename(final)
        self._prune(step)

    def discard_from(self, step: int) -> None:
        for found, path in self._steps():
            if found >= step:
                shutil.rmtree(path, ignore_errors=True)

    def _steps(self) -> list[tuple[int, Path]]:
        return sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := _STEP_DIR.match(p.name)))

    def _prune(self, newest: int) -> None:
        if self.keep_last is None:
            return
        floor = self.keep_from()
        for found, path in self._steps():
            if found <= newest - self.keep_last and (floor is None or found < floor):
                shutil.rmtree(path, ignore_errors=True)

    def close(self) -> None:
        pass


class FilesystemReceiver:
    """Polls for `rollouts/step_<n>/rank_<r>.json`."""

    def __init__(self, output_dir: Path, config: FilesystemTransport, rank: int):
        self.root = Path(output_dir) / "rollouts"
        self.poll_interval = config.poll_interval
        self.rank = rank

    def receive(self, step: int, should_stop: Callable[[], bool] = lambda: False) -> TrainBatch | None:
        path = self.root / f"step_{step}" / f"rank_{self.rank}.json"
        while not path.exists():
            if should_stop():
                return None
            time.sleep(self.poll_interval)
        return decode(path.read_bytes())

    def close(self) -> None:
        pass


class ZMQSender:
    """Serves batches from memory on a ROUTER socket; a step is dropped once every rank has fetched it."""

    def __init__(self, config: ZMQTransport):
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(f"tcp://{config.host}:{config.port}")
        self._lock = threading.Lock()
        self._batches: dict[tuple[int, int], bytes] = {}
        self._waiting: list[tuple[bytes, int, int]] = []  # (peer identity, step, rank)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="zmq-batch-server", daemon=True)
        self._thread.start()

    def send(self, step: int, per_rank: list[TrainBatch]) -> None:
        with self._lock:
            for rank, batch in enumerate(per_rank):
                self._batches[(step, rank)] = encode(batch)

    def discard_from(self, step: int) -> None:
        with self._lock:
            for key in [k for k in self._batches if k[0] >= step]:
                del self._batches[key]

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._closed.is_set():
            if poller.poll(50):
                peer, payload = self._socket.recv_multipart()
                request = json.loads(payload)
                self._waiting.append((peer, int(request["step"]), int(request["rank"])))
            self._answer_waiting()

    def _answer_waiting(self) -> None:
        still = []
        for peer, step, rank in self._waiting:
            with self._lock:
                data = self._batches.pop((step, rank), None)
            if data is None:
                still.append((peer, step, rank))
            else:
                self._socket.send_multipart([peer, data])
        self._waiting = still

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=5)
        self._socket.close()
        self._context.term()


class ZMQReceiver:
    """Asks the orchestrator for (step, rank) and waits for the answer."""

    def __init__(self, config: ZMQTransport, rank: int):
        import zmq

        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(f"tcp://{config.host}:{config.port}")
        self.rank = rank

    def receive(self, step: int, should_stop: Callable[[], bool] = lambda: False) -> TrainBatch | None:
        import zmq

        self._socket.send(json.dumps({"step": step, "rank": self.rank}).encode())
        while not self._socket.poll(100, zmq.POLLIN):
            if should_stop():
                return None
        return decode(self._socket.recv())

    def close(self) -> None:
        self._socket.close()
        self._context.term()


def setup_sender(
    config: FilesystemTransport | ZMQTransport,
    output_dir: Path,
    keep_from: Callable[[], int | None] = lambda: None,
) -> BatchSender:
    """`keep_from`: see FilesystemSender (zmq hands each batch out once and keeps none)."""
    if isinstance(config, ZMQTransport):
        return ZMQSender(config)
    return FilesystemSender(output_dir, config, keep_from)


def setup_receiver(config: FilesystemTransport | ZMQTransport, output_dir: Path, rank: int) -> BatchReceiver:
    if isinstance(config, ZMQTransport):
        return ZMQReceiver(config, rank)
    return FilesystemReceiver(output_dir, config, rank)

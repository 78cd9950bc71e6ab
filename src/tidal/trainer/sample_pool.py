"""SFT conversations turned into samples in worker processes, ahead of the step that trains them.

A conversation with pictures costs the model's processor real CPU time (decode, resize, cut into tiles,
normalise: ~0.1-0.2 s a picture for SmolVLM's five 512-pixel tiles), which in the training process left the
GPU idle between steps. `SamplePool` prepares them in `spawn` worker processes, each with the run's own
tokenizer and processor (sent once, at start), while the training process trains the step before.
"""

import multiprocessing
import os
import signal
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import replace
from typing import Any

from tidal.config.deployment import usable_cores
from tidal.models.vision import PictureInputs
from tidal.process import exit_with_parent
from tidal.trainer.data import TokenizedSample, tokenize_conversation
from tidal.trainer.sources import Conversation
from tidal.types import Pictures

MAX_AUTO_WORKERS = 8
"""`data.picture_workers` unset: one worker per spare CPU core of this rank, at most this many."""


def prepare_sample(
    tokenizer: Any, pictures: PictureInputs | None, conversation: Conversation, images: list[str]
) -> TokenizedSample:
    """The conversation's ids and loss mask, its pictures' placeholders expanded into their image tokens
    (which never carry loss) and the pictures themselves; a ValueError for a picture that is broken or
    does not match its placeholders."""
    sample = tokenize_conversation(tokenizer, conversation)
    if not images:
        return sample
    if pictures is None:
        raise ValueError("the conversation has pictures, but the run has no picture processor")
    ids, mask, arrays = pictures.expand_masked(sample.input_ids, sample.loss_mask, images)
    return TokenizedSample(ids, mask, arrays)


def auto_workers(local_world_size: int, cpus: int | None = None) -> int:
    """Workers for one rank when `data.picture_workers` is unset: the host's cores shared among its ranks,
    one left to the rank itself, at least 1 and at most MAX_AUTO_WORKERS."""
    cpus = cpus if cpus is not None else len(usable_cores())
    return max(1, min(MAX_AUTO_WORKERS, cpus // max(1, local_world_size) - 1))


_worker: tuple[Any, PictureInputs | None] | None = None
"""In a worker process: the run's tokenizer and picture processor."""


def _start_worker(parent_pid: int, tokenizer: Any, pictures: PictureInputs | None) -> None:
    exit_with_parent(parent_pid)  # no worker outlives the training process, even a SIGKILLed one
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the run through its parent, not here
    import torch

    torch.set_num_threads(1)  # one core each (auto_workers counts one per core), none taken from the trainer
    global _worker
    _worker = (tokenizer, pictures)


def _started() -> None:
    """A task that only makes the executor start a worker (`SamplePool.__init__`)."""


def _prepare_in_worker(
    conversation: Conversation, images: list[str], shared_memory: bool = True
) -> TokenizedSample:
    assert _worker is not None, "a sample worker runs _start_worker first"
    tokenizer, pictures = _worker
    sample = prepare_sample(tokenizer, pictures, conversation, images)
    if sample.pictures is None or not shared_memory or not room_in_shared_memory(sample.pictures):
        return sample
    # the tiles go back through shared memory, without their base64 text: piped and unpickled, a step's
    # ~1.2 GB (32 SmolVLM conversations) held the training process's GIL for seconds
    return replace(sample, pictures=sample.pictures.text_free())


SHARED_MEMORY = "/dev/shm"
"""Where torch puts tensors it shares between processes (POSIX shared memory, a tmpfs on Linux)."""
SHARED_MEMORY_RESERVE = 256 * 2**20
"""Bytes left free in SHARED_MEMORY beyond a margin of four samples' pictures (eight workers write at once)."""


def room_in_shared_memory(pictures: Pictures, path: str = SHARED_MEMORY) -> bool:
    """Whether `path` has room for these pictures with a margin. Containers often mount 64 MB there, and a
    write past a tmpfs's size kills the writer (SIGBUS): without room a sample's pictures go through the
    pipe (slower for the training process, as `shared_memory=False`)."""
    try:
        stat = os.statvfs(path)
    except OSError:
        return False
    need = sum(array.to_numpy().nbytes for array in pictures.arrays().values())
    return stat.f_bavail * stat.f_frsize >= 4 * need + SHARED_MEMORY_RESERVE


class SamplePool:
    """`workers` processes preparing samples; `submit` returns at once, the future holds the sample (or the
    ValueError that `prepare_sample` raised)."""

    def __init__(
        self, workers: int, tokenizer: Any, pictures: PictureInputs | None, shared_memory: bool = True
    ):
        """`shared_memory=False` pipes each sample's pictures whole, text and all (the way before; kept as
        benchmarks/picture_prep.py's baseline)."""
        if workers < 1:
            raise ValueError("a sample pool needs at least one worker")
        self.workers = workers
        self.shared_memory = shared_memory
        self._pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),  # the training process holds CUDA: no fork
            initializer=_start_worker,
            initargs=(os.getpid(), tokenizer, pictures),
        )
        # every worker starts now, not at the first step's submits: a spawned worker's start (imports, the
        # processor) then overlaps whatever the training process does meanwhile (loading the model). The
        # executor starts one process per submit that finds no idle worker.
        for _ in range(workers):
            self._pool.submit(_started)

    def submit(self, conversation: Conversation, images: list[str]) -> Future[TokenizedSample]:
        return self._pool.submit(_prepare_in_worker, conversation, images, self.shared_memory)

    def pids(self) -> list[int]:
        """Process ids of the started workers (for tests and diagnostics)."""
        return sorted(self._pool._processes or {})

    def close(self) -> None:
        """Stop the workers, dropping what is still queued."""
        self._pool.shutdown(wait=True, cancel_futures=True)

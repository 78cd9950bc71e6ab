"""CUDA IPC weight transport (one GPU): trainer rank 0 shares one buffer of served weights with vLLM's workers.

`trainer.publish.type = "cuda_ipc"`, when inference and trainer rank 0 share a GPU:

- Trainer rank 0 allocates one flat buffer holding every parameter in the dtype inference serves
  (`plan_layout`, `slot_views`), exports its CUDA IPC handle once (`share_buffer`), and each step casts its
  master weights into it in place while it holds the run's buffer lock (`buffer_lock`), whose file then
  records which buffer holds which step.
- It announces `weights/step_<n>/cuda_ipc.json` (`IpcAnnouncement`: handle, layout, step); the orchestrator
  tells every server to load it (`/update_weights` with {"path": <announcement>}) as it would a filesystem
  step.
- A worker opens the buffer once per buffer id (`open_buffer`); each update takes the lock, loads the views
  through vLLM's weight loaders, waits for its copies and lets go: the trainer never overwrites the buffer
  while a server reads it, and no server reads a half-written step.

The lock is an `flock` on `weights/cuda_ipc.lock`: both sides run on one machine by construction, and the
kernel drops it when its holder dies. The handle is a pickle of torch's own `reduce_tensor` arguments, read
back with an unpickler that only accepts the torch types those arguments hold.

This module imports no torch at module level: the orchestrator and the launcher read it.
"""

import base64
import contextlib
import fcntl
import io
import json
import math
import os
import pickle
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from tidal.run_layout import weights_dir
from tidal.transport.nccl import TensorMeta
from tidal.transport.weights import finish_staged, list_published, step_dir

ANNOUNCEMENT = "cuda_ipc.json"
ENGINE_NAME = "tidal_cuda_ipc"
"""The weight-transfer engine `inference.weights.backend = "cuda_ipc"` starts vLLM with (tidal.inference.vllm_ext
registers it; vLLM's own `ipc` engine takes fresh handles with every update over HTTP instead)."""
LOAD_ENV = "TIDAL_CUDA_IPC_LOAD"
"""`inference.weights.load` for the workers (they inherit the server's environment)."""
LOCK_FILE = "cuda_ipc.lock"
ALIGNMENT = 256
"""Bytes each tensor's start is rounded up to: every dtype's views are aligned, copies can vectorise."""


@dataclass(frozen=True)
class Slot:
    """Where one tensor lives in the shared buffer."""

    name: str
    dtype: str
    """torch dtype without the `torch.` prefix."""
    shape: tuple[int, ...]
    offset: int
    """Bytes from the start of the buffer."""


def plan_layout(tensors: Iterable[TensorMeta]) -> tuple[tuple[Slot, ...], int]:
    """Each tensor's slot, in order and aligned, and the buffer's size in bytes."""
    import torch

    slots, offset = [], 0
    for meta in tensors:
        offset = -(-offset // ALIGNMENT) * ALIGNMENT
        slots.append(Slot(meta.name, meta.dtype, tuple(meta.shape), offset))
        offset += math.prod(meta.shape) * _dtype(torch, meta.dtype).itemsize
    return tuple(slots), offset


def slot_views(buffer: Any, slots: Iterable[Slot]) -> list[tuple[str, Any]]:
    """Each slot as a tensor of its dtype and shape over the flat uint8 `buffer` (no copies)."""
    import torch

    views = []
    for slot in slots:
        dtype = _dtype(torch, slot.dtype)
        size = math.prod(slot.shape) * dtype.itemsize
        views.append((slot.name, buffer[slot.offset : slot.offset + size].view(dtype).view(slot.shape)))
    return views


def _dtype(torch: Any, name: str) -> Any:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {name!r} in the cuda_ipc layout")
    return dtype


@dataclass(frozen=True)
class IpcAnnouncement:
    """`weights/step_<n>/cuda_ipc.json`: which buffer holds step n, where it is, and how to read it."""

    step: int
    buffer_id: str
    """New with every buffer the trainer allocates (a restarted trainer shares a new one)."""
    gpu_uuid: str
    """The GPU the buffer is on: a worker on another GPU cannot map it."""
    handle: str
    size: int
    slots: tuple[Slot, ...]

    def encode(self) -> str:
        rows = [[s.name, s.dtype, list(s.shape), s.offset] for s in self.slots]
        fields = {k: getattr(self, k) for k in ("step", "buffer_id", "gpu_uuid", "handle", "size")}
        return json.dumps({**fields, "slots": rows}) + "\n"

    @classmethod
    def decode(cls, text: str) -> "IpcAnnouncement":
        raw = json.loads(text)
        slots = tuple(
            Slot(name, dtype, tuple(shape), int(offset)) for name, dtype, shape, offset in raw["slots"]
        )
        return cls(
            step=int(raw["step"]),
            buffer_id=str(raw["buffer_id"]),
            gpu_uuid=str(raw["gpu_uuid"]),
            handle=str(raw["handle"]),
            size=int(raw["size"]),
            slots=slots,
        )


def announce_buffer(output_dir: Path, announcement: IpcAnnouncement) -> Path:
    """Publish `weights/step_<n>/` holding only `cuda_ipc.json`, atomically like a checkpoint."""
    target = step_dir(output_dir, announcement.step)
    staging = target.with_name(target.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    (staging / ANNOUNCEMENT).write_text(announcement.encode())
    return finish_staged(staging, target)


def is_buffer_announcement(directory: str | Path) -> bool:
    """A step published through a shared GPU buffer (rather than files inference loads)."""
    return (Path(directory) / ANNOUNCEMENT).is_file()


def read_announcement(directory: str | Path) -> IpcAnnouncement:
    path = Path(directory) / ANNOUNCEMENT
    if not path.is_file():
        raise ValueError(
            f"{directory} holds no {ANNOUNCEMENT}: not a step published by trainer.publish.type = 'cuda_ipc'"
        )
    return IpcAnnouncement.decode(path.read_text())


def drop_announcements_after(output_dir: Path, step: int) -> None:
    """Remove announcements of steps after `step`: a resumed trainer shares a new buffer, and theirs name one
    that died with the trainer before it."""
    import shutil

    for published, path in list_published(output_dir):
        if published > step and is_buffer_announcement(path):
            shutil.rmtree(path, ignore_errors=True)


def lock_path(output_dir: Path) -> Path:
    return weights_dir(output_dir) / LOCK_FILE


@dataclass(frozen=True)
class Held:
    """What the shared buffer holds, as the trainer recorded it under the lock."""

    buffer_id: str
    step: int


class LockedBuffer:
    """The lock file while this process holds the lock."""

    def __init__(self, file: IO[str]):
        self._file = file

    def held(self) -> Held | None:
        self._file.seek(0)
        text = self._file.read().strip()
        if not text:
            return None
        raw = json.loads(text)
        return Held(str(raw["buffer_id"]), int(raw["step"]))

    def record(self, held: Held) -> None:
        self._file.seek(0)
        self._file.truncate()
        self._file.write(json.dumps({"buffer_id": held.buffer_id, "step": held.step}) + "\n")
        self._file.flush()


@contextlib.contextmanager
def buffer_lock(path: Path) -> Iterator[LockedBuffer]:
    """Hold the buffer lock (blocking) for the block: the trainer while it writes, a worker while it reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as file:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX)
        try:
            yield LockedBuffer(file)
        finally:
            fcntl.flock(file.fileno(), fcntl.LOCK_UN)


# ---- CUDA: the buffer and its handle ---------------------------------------------------------------------


def allocate_shareable(size: int, device: Any) -> Any:
    """A flat uint8 buffer of `size` bytes that CUDA IPC can export.

    Segments of PyTorch's expandable allocator are exported as file descriptors that another process can only
    import with ptrace rights over this one (often refused in containers); a plain cudaMalloc'd block exports as
    a CUDA IPC handle, so the buffer is allocated with expandable segments off.
    """
    import torch

    expandable = (
        "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower()
    )
    if expandable and device.type == "cuda":
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        return torch.empty(size, dtype=torch.uint8, device=device)
    finally:
        if expandable and device.type == "cuda":
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def share_buffer(buffer: Any) -> tuple[str, str]:
    """The buffer's CUDA IPC handle (torch's `reduce_tensor` arguments, pickled, base64) and its GPU's UUID."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    gpu_uuid = str(torch.cuda.get_device_properties(buffer.device).uuid)
    return base64.b64encode(pickle.dumps(args)).decode(), gpu_uuid


def open_buffer(handle: str, device_index: int) -> Any:
    """Map the trainer's buffer into this process (device index as this process numbers its GPUs)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    args = list(load_handle(handle))
    args[6] = (
        device_index  # reduce_tensor's device: the trainer's numbering, which CUDA_VISIBLE_DEVICES may change
    )
    return rebuild_cuda_tensor(*args)


def load_handle(handle: str) -> tuple[Any, ...]:
    """Unpickle `reduce_tensor` arguments, refusing anything but the torch types they hold."""
    args = _HandleUnpickler(io.BytesIO(base64.b64decode(handle))).load()
    if not isinstance(args, tuple):
        raise ValueError("a cuda_ipc handle is a tuple of reduce_tensor arguments")
    return args


class _HandleUnpickler(pickle.Unpickler):
    _ALLOWED = {
        ("torch", "Tensor"),
        ("torch._tensor", "Tensor"),
        ("torch", "Size"),
        ("torch.storage", "TypedStorage"),
        ("torch.storage", "UntypedStorage"),
        ("torch", "TypedStorage"),
        ("torch", "UntypedStorage"),
    }

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"a cuda_ipc handle may not name {module}.{name}")

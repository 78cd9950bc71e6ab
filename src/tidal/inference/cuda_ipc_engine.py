"""Runs inside vLLM's workers: the `cuda_ipc` weight backend, loading from the trainer's buffer on this GPU.

`/update_weights` with {"path": <weights/step_<n> announcement>} (tidal.transport.cuda_ipc): the worker maps
the trainer's buffer the first time it sees its buffer id (then keeps the mapping), takes the buffer lock,
loads every tensor from its view of the buffer, waits for the copies and lets the lock go. Loading goes
through vLLM's layer-wise reload (`inference.weights.load = "layerwise"`, which re-runs each layer's post-load
processing) or straight through the model's `load_weights` into the served parameters (`"direct"`); either
way the tensors keep their storage, which CUDA graphs captured.

What the buffer holds is what the lock file says, which may be a newer step than the one announced when the
trainer published again before this server got to it: it loads that (newer) step and says so. A replay of
the step it holds (a server brought back into rotation) loads nothing. Hooks are start/update/finish, which
both vLLM releases tidal supports (0.26, 0.3x) call on the engine.
"""

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from tidal.inference.reload import retie_lm_head
from tidal.transport.cuda_ipc import (
    LOAD_ENV,
    LOCK_FILE,
    Held,
    IpcAnnouncement,
    buffer_lock,
    open_buffer,
    read_announcement,
    slot_views,
)

# under vLLM's logger, so that its handler (the server's output) shows the load times
logger = logging.getLogger("vllm.tidal.cuda_ipc")


@dataclass
class CudaIpcInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: each announcement carries the buffer's handle."""


@dataclass
class CudaIpcUpdateInfo(WeightTransferUpdateInfo):
    """The step's announcement directory (`weights/step_<n>/` holding cuda_ipc.json)."""

    path: str


class TidalCudaIpcEngine(WeightTransferEngine[CudaIpcInitInfo, CudaIpcUpdateInfo]):
    """No __init__ of its own: the base class's differs across vLLM releases (state is set lazily)."""

    init_info_cls = CudaIpcInitInfo
    update_info_cls = CudaIpcUpdateInfo
    _buffer_id: str | None = None
    _views: list[tuple[str, torch.Tensor]] | None = None
    _loaded: Held | None = None

    def init_transfer_engine(self, init_info: CudaIpcInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        # the reload starts in receive_weights, under the buffer lock, once the announcement checked out
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # receive_weights waits for its own copies (it must, before it lets the trainer write again)
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: CudaIpcUpdateInfo) -> None:
        directory = Path(update_info.path)
        announcement = read_announcement(directory)
        views = self._open(announcement)
        start = time.perf_counter()
        with buffer_lock(directory.parent / LOCK_FILE) as lock:
            held = lock.held()
            if held is None or held.buffer_id != announcement.buffer_id or held.step < announcement.step:
                raise ValueError(
                    f"{directory}: the trainer's buffer holds {held} now, not this announcement's step "
                    f"{announcement.step}: the announcement is stale (restart the run with --resume)"
                )
            if held == self._loaded:
                return  # a replay of what this worker serves already
            self._load(views)
            torch.cuda.synchronize(self.device)  # the trainer may overwrite the buffer once the lock is free
        self._loaded = held
        newer = f" (announced: step {announcement.step})" if held.step != announcement.step else ""
        logger.info(
            "tidal cuda_ipc: loaded step %d%s in %.1f ms",
            held.step,
            newer,
            1000 * (time.perf_counter() - start),
        )

    def _open(self, announcement: IpcAnnouncement) -> list[tuple[str, torch.Tensor]]:
        """The views of the announced buffer, mapping it the first time this buffer id is seen."""
        if announcement.buffer_id == self._buffer_id and self._views is not None:
            return self._views
        device_index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        gpu_uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        if gpu_uuid != announcement.gpu_uuid:
            raise ValueError(
                f"the trainer's buffer is on GPU {announcement.gpu_uuid}, this worker on {gpu_uuid}: cuda_ipc "
                "needs inference on trainer rank 0's GPU (use trainer.publish.type = 'nccl')"
            )
        self._views = None  # drop the mapping of a buffer a trainer before this one shared
        buffer = open_buffer(announcement.handle, device_index)
        if buffer.numel() != announcement.size:
            raise ValueError(
                f"the shared buffer has {buffer.numel()} bytes, the announcement says {announcement.size}"
            )
        self._views = slot_views(buffer, announcement.slots)
        self._buffer_id = announcement.buffer_id
        return self._views

    def _load(self, views: list[tuple[str, torch.Tensor]]) -> None:
        model: Any = self.model
        if os.environ.get(LOAD_ENV, "layerwise") == "direct":
            model.load_weights(iter(views))
            return
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        initialize_layerwise_reload(model)
        try:
            model.load_weights(iter(views))
        finally:
            # also after a failure: puts back the layers that got nothing and unwraps the loaders
            finalize_layerwise_reload(model, self.model_config)
        retie_lm_head(model, self.model_config)

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        self._views = None

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Abstract in vLLM 0.26's base class; the sender is tidal.trainer.publish.CudaIpcPublisher."""
        raise NotImplementedError(
            "publish weights with tidal.trainer.publish (trainer.publish.type = 'cuda_ipc')"
        )

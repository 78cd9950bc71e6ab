"""How the RL trainer hands each step's weights to inference: one small interface, three backends.

    publisher = setup_publisher(config.publish, output_dir, dtype, adapter_config)
    publisher.publish(step, model, tokenizer, info)     # every rank: a collective under FSDP
    publisher.close()

- `filesystem` (FilesystemPublisher): rank 0 writes `weights/step_<n>/` (HF safetensors, or a PEFT adapter
  with LoRA) and prunes old steps; the orchestrator tells every server to load the directory.
- `nccl` (NcclPublisher): rank 0 announces `weights/step_<n>/` (no weights), then broadcasts the step to
  every inference worker of every replica (tidal.transport.nccl); the orchestrator tells the servers to
  receive it, as it would to load a filesystem step, and `publish` returns once they all have it.
- `cuda_ipc` (CudaIpcPublisher): rank 0 keeps the served weights in one GPU buffer that the vLLM workers on
  its GPU mapped once (tidal.transport.cuda_ipc); each step it casts the master weights into it in place under
  the buffer lock and announces `weights/step_<n>/`; the orchestrator tells the servers to load it.

All publish in the dtype inference serves (fp32 master weights are cast first) and refuse NaN/inf weights
on every rank before anything leaves the trainer.
"""

import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

import torch

from tidal.config.rl import CudaIpcPublish, FilesystemPublish, NcclPublish, PublishConfig
from tidal.trainer.export import write_checkpoint
from tidal.trainer.lora import export_adapter
from tidal.trainer.moe import checkpoint_tensors, fused_expert_params
from tidal.trainer.parallel import DistInfo, barrier
from tidal.transport.cuda_ipc import (
    Held,
    IpcAnnouncement,
    allocate_shareable,
    announce_buffer,
    buffer_lock,
    drop_announcements_after,
    lock_path,
    plan_layout,
    share_buffer,
    slot_views,
)
from tidal.transport.nccl import BroadcastHeader, NcclBroadcaster, TensorMeta, announce
from tidal.transport.weight_checks import non_finite_tensors
from tidal.transport.weights import (
    check_keep_last,
    prune_published,
    refuse_non_finite,
    static_files,
    step_dir,
)


class Publisher(Protocol):
    """What the trainer needs of a weights backend."""

    def publish(self, step: int, model: torch.nn.Module, tokenizer: Any, info: DistInfo) -> Path:
        """Hand `model`'s weights to inference as policy version `step`; every rank calls it. Returns the
        step's directory under weights/ (what the orchestrator tells inference to load)."""
        ...

    def restore(self, step: int, model: torch.nn.Module, tokenizer: Any, info: DistInfo) -> None:
        """After a resume at `step`: make sure inference can reach that policy again."""
        ...

    def close(self) -> None: ...


class Broadcaster(Protocol):
    """Trainer rank 0's end of an NCCL group (tidal.transport.nccl.NcclBroadcaster; a fake in tests)."""

    rendezvous: dict[str, Any]
    """Where the workers join (written into each step's announcement for whoever reads the run dir)."""

    def open(self) -> None: ...

    def send(self, header: BroadcastHeader, tensors: Iterator[tuple[str, torch.Tensor]]) -> None: ...

    def close(self) -> None: ...


def setup_publisher(
    config: PublishConfig,
    output_dir: Path,
    dtype: torch.dtype | None,
    adapter_config: dict[str, Any] | None = None,
    info: DistInfo | None = None,
) -> Publisher:
    """The backend `config.type` names. `dtype`: what inference serves (None: as the trainer holds it)."""
    if isinstance(config, NcclPublish):
        if adapter_config is not None:  # RLConfig refuses it for `tidal rl`; a bare `tidal trainer` too
            raise ValueError("LoRA adapters are published through the filesystem; nccl carries full weights")
        is_sender = info is None or info.is_main
        broadcaster = (
            NcclBroadcaster(config.host, config.port, config.inference_world_size + 1) if is_sender else None
        )
        return NcclPublisher(output_dir, config.keep_last, dtype, broadcaster)
    if isinstance(config, CudaIpcPublish):
        if adapter_config is not None:
            raise ValueError(
                "LoRA adapters are published through the filesystem; cuda_ipc carries full weights"
            )
        return CudaIpcPublisher(output_dir, config.keep_last, dtype)
    assert isinstance(config, FilesystemPublish)
    return FilesystemPublisher(output_dir, config.keep_last, dtype, adapter_config)


class FilesystemPublisher:
    """Writes one HF checkpoint (or LoRA adapter) per step on rank 0 and prunes old ones (all ranks gather)."""

    def __init__(
        self,
        output_dir: Path,
        keep_last: int | None = 3,
        dtype: torch.dtype | None = None,
        adapter_config: dict[str, Any] | None = None,
    ):
        check_keep_last(keep_last)
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        # floating tensors are written in this dtype (None: as the model holds them)
        self.dtype = dtype
        # LoRA runs: publish only the adapter, with this adapter_config.json (see tidal.trainer.lora)
        self.adapter_config = adapter_config
        self._static: dict[str, bytes] | None = None

    def publish(self, step: int, model: torch.nn.Module, tokenizer: Any, info: DistInfo) -> Path:
        """Gather on every rank and write on rank 0; with an adapter config only the trainable LoRA tensors
        (PEFT format). Every rank checks its own shards for NaN/inf first and all refuse together."""
        refuse_non_finite(step, local_non_finite(model, info))
        target = step_dir(self.output_dir, step)
        if self.adapter_config is not None:
            export_adapter(target, model, self.adapter_config, info, self.dtype)
        else:
            tensors = served_checkpoint(model, self.dtype, keep=info.is_main)
            if info.is_main:
                if self._static is None:  # config and tokenizer do not change during a run
                    self._static = static_files(model.config, tokenizer, self.dtype)  # type: ignore[attr-defined]
                write_checkpoint(target, tensors, model, tokenizer, self.dtype, self._static)
            barrier(info)
        if info.is_main:
            prune_published(self.output_dir, self.keep_last)
        return target

    def restore(self, step: int, model: torch.nn.Module, tokenizer: Any, info: DistInfo) -> None:
        # the step's directory may have been pruned since the checkpoint; servers load it from disk
        if not step_dir(self.output_dir, step).exists():
            self.publish(step, model, tokenizer, info)

    def close(self) -> None:
        pass


class NcclPublisher:
    """Broadcasts each step from rank 0 to every inference worker; every rank takes part in the gathers.

    Order on rank 0: announce step n (the orchestrator then asks the servers to receive it), open the group
    at the first step (the workers join when their first update starts), broadcast header and tensors,
    return once the broadcast has left. The other ranks only gather their shards in the same order.
    """

    def __init__(
        self,
        output_dir: Path,
        keep_last: int | None,
        dtype: torch.dtype | None,
        broadcaster: Broadcaster | None,
    ):
        check_keep_last(keep_last)
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        self.dtype = dtype
        self.broadcaster = broadcaster  # None on every rank but 0
        self._opened = False

    def publish(self, step: int, model: torch.nn.Module, tokenizer: Any, info: DistInfo) -> Path:
        refuse_non_finite(step, local_non_finite(model, info))
        header = BroadcastHeader(step, tuple(served_metadata(model, self.dtype)))
        tensors = served_tensors(model, self.dtype)
        if self.broadcaster is None:
            for _ in tensors:  # the FSDP gathers rank 0 feeds its broadcast from are collectives
                pass
        else:
            announce(self.output_dir, step, header, self.broadcaster.rendezvous)
            prune_published(self.output_dir, self.keep_last)
            if not self._opened:
                self.broadcaster.open()
                self._opened = True
            self.broadcaster.send(header, tensors)
        barrier(info)
        return step_dir(self.output_dir, step)

    def restore(self, step: int, model: torch.nn.Module, tokenizer: Any, info: DistInfo) -> None:
        # servers start from the base model and keep nothing of an earlier run: send the step again
        self.publish(step, model, tokenizer, info)

    def close(self) -> None:
        if self.broadcaster is not None:
            self.broadcaster.close()


class CudaIpcPublisher:
    """Keeps the served weights in one buffer on rank 0's GPU, shared once with the vLLM workers there.

    The buffer, its views and the handle are made at the first publish; every later one only casts the
    master weights into the views (no allocation with one rank; with several, each parameter is gathered first,
    a collective every rank joins). Rank 0 writes under the buffer lock, waits for its copies, records the step
    in the lock file, then announces it; a server that is loading holds the lock, so a write waits for it.
    """

    def __init__(
        self,
        output_dir: Path,
        keep_last: int | None,
        dtype: torch.dtype | None,
        share: Callable[[torch.Tensor], tuple[str, str]] = share_buffer,
    ):
        check_keep_last(keep_last)
        self.output_dir = Path(output_dir)
        self.keep_last = keep_last
        self.dtype = dtype
        self.share = share  # the handle and GPU of a buffer (a fake in CPU tests)
        self.buffer: torch.Tensor | None = None
        self.views: list[tuple[str, torch.Tensor]] = []
        self.announcement: IpcAnnouncement | None = None

    def publish(self, step: int, model: torch.nn.Module, tokenizer: Any, info: DistInfo) -> Path:
        refuse_non_finite(step, local_non_finite(model, info))
        if not info.is_main:
            for _ in _whole_parameters(model, self.dtype):  # the gathers rank 0 fills its buffer from
                pass
            barrier(info)
            return step_dir(self.output_dir, step)
        if self.announcement is None:
            self._allocate(model, info.device)
        assert self.announcement is not None and self.buffer is not None
        with buffer_lock(lock_path(self.output_dir)) as lock:
            for (slot, view), (name, value) in zip(
                self.views, _whole_parameters(model, self.dtype), strict=True
            ):
                assert slot == name, f"parameter {name} where the buffer's layout has {slot}"
                view.copy_(value)  # casts fp32 masters to the served dtype in the copy
            if self.buffer.is_cuda:
                torch.cuda.current_stream(self.buffer.device).synchronize()  # before a server may read it
            lock.record(Held(self.announcement.buffer_id, step))
        announce_buffer(self.output_dir, replace(self.announcement, step=step))
        prune_published(self.output_dir, self.keep_last)
        barrier(info)
        return step_dir(self.output_dir, step)

    def _allocate(self, model: torch.nn.Module, device: torch.device) -> None:
        slots, size = plan_layout(served_metadata(model, self.dtype))
        self.buffer = allocate_shareable(size, device)
        self.views = slot_views(self.buffer, slots)
        handle, gpu_uuid = self.share(self.buffer)
        self.announcement = IpcAnnouncement(
            step=0, buffer_id=uuid.uuid4().hex, gpu_uuid=gpu_uuid, handle=handle, size=size, slots=slots
        )

    def restore(self, step: int, model: torch.nn.Module, tokenizer: Any, info: DistInfo) -> None:
        # the servers start from the base model, and later steps' announcements name the old trainer's buffer
        if info.is_main:
            drop_announcements_after(self.output_dir, step)
        self.publish(step, model, tokenizer, info)

    def close(self) -> None:
        self.views, self.buffer = [], None


def _whole_parameters(
    model: torch.nn.Module, dtype: torch.dtype | None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter whole, without a copy where this rank holds all of it (one rank: the DTensor's only
    shard); otherwise gathered, cast first so the gather moves the served size."""
    for name, param in model.named_parameters():
        value = param.detach()
        mesh = getattr(value, "device_mesh", None)
        if mesh is None:
            yield name, value
        elif mesh.size() == 1:
            yield name, _local(value)
        else:
            cast = value.to(dtype) if dtype is not None and value.is_floating_point() else value
            yield name, cast.full_tensor()  # type: ignore[attr-defined]  # a DTensor


def served_metadata(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[TensorMeta]:
    """Name, dtype and global shape of every tensor as it will be broadcast (no gather): HF checkpoint names,
    fused MoE experts split per expert as `served_tensors` sends them."""
    fused = fused_expert_params(model)
    for name, param in model.named_parameters():
        cast = dtype if dtype is not None and param.is_floating_point() else param.dtype
        shape_only = torch.empty(param.shape, device="meta")
        for served_name, part in checkpoint_tensors([(name, shape_only)], fused):
            yield TensorMeta(served_name, str(cast).removeprefix("torch."), tuple(part.shape))


def served_tensors(model: torch.nn.Module, dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each parameter whole and in `dtype`, one at a time, under HF checkpoint names (a fused MoE expert
    tensor as one tensor per expert); under FSDP each parameter is a collective. The shard is cast before
    the gather, so an fp32 master is gathered at the size it is sent in."""
    fused = fused_expert_params(model)
    for name, param in model.named_parameters():
        value = param.detach()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        full_tensor = getattr(value, "full_tensor", None)
        whole = full_tensor() if callable(full_tensor) else value
        for served_name, part in checkpoint_tensors([(name, whole)], fused):
            yield served_name, part.contiguous()


def served_checkpoint(
    model: torch.nn.Module, dtype: torch.dtype | None, keep: bool
) -> dict[str, torch.Tensor]:
    """What a filesystem step holds, on CPU: every parameter whole and in the served dtype (`served_tensors`:
    cast where the weights live before the gather and the copy to CPU) and the persistent buffers.

    The cast on the CPU of an fp32 state dict cost more than the write itself: 2.5-14 s for 135M values on
    a loaded 2-core machine with two torch threads, 0.3-0.6 s with one (the trainer shares its node with
    vLLM's CPU threads). A collective under FSDP: every rank calls it; only where `keep` are tensors kept."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in served_tensors(model, dtype):
        if keep:
            tensors[name] = tensor.to("cpu")
    if not keep:
        return tensors
    persistent = set(model.state_dict())
    for name, buffer in model.named_buffers():
        if name in persistent and name not in tensors:
            value = buffer.detach()
            tensors[name] = (
                value.to(dtype) if dtype is not None and value.is_floating_point() else value
            ).cpu()
    return tensors


def local_non_finite(model: torch.nn.Module, info: DistInfo) -> list[str]:
    """Non-finite parameters in this rank's shards; on a rank with none, the other ranks' count."""
    named = [(name, _local(param.detach())) for name, param in model.named_parameters()]
    bad = non_finite_tensors(named)
    if not info.distributed:
        return bad
    count = torch.tensor([len(bad)], dtype=torch.int64, device=info.device)
    torch.distributed.all_reduce(count)
    total = int(count.item())
    return bad or ([f"on another rank ({total} tensor(s))"] if total else [])


def _local(tensor: Any) -> Any:
    """The shard this rank holds of an FSDP (DTensor) parameter, or the tensor itself."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor

"""Process group, device placement and FSDP2 sharding: one `parallelize()` that composes the pieces."""

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, local rank and its device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto") -> DistInfo:
    """Join the torchrun process group when there is one (NCCL on GPU, gloo on CPU); else a single process."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if device == "cuda" and not torch.cuda.is_available():
        from tidal.errors import UserError

        raise UserError("device = 'cuda' but no CUDA device is available")
    if use_cuda:
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if use_cuda else "gloo", device_id=dev if use_cuda else None)
    return DistInfo(rank, world_size, local_rank, local_world_size, dev)


def set_num_threads(num_threads: int | None, info: DistInfo) -> int:
    """Give each process an explicit CPU thread budget; oversubscribed cores slow CPU training ~10x."""
    if num_threads is None:
        num_threads = max(1, (os.cpu_count() or 1) // info.local_world_size)
    torch.set_num_threads(num_threads)
    return num_threads


def parallelize(model: torch.nn.Module, info: DistInfo) -> torch.nn.Module:
    """Move to the device and, with several ranks, shard each decoder layer and then the root with FSDP2.

    On GPU the FSDP2 policy computes in bf16 and reduces gradients in fp32 (master weights stay fp32); a single
    GPU process uses autocast instead (see `autocast`). CPU trains in fp32.
    """
    model.to(info.device)
    if not info.distributed:
        return model
    mp = MixedPrecisionPolicy()  # no casting: fp32 on CPU
    if info.device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in _decoder_layers(model):
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find decoder layers at model.model.layers")
    return list(layers)


@contextlib.contextmanager
def autocast(info: DistInfo) -> Iterator[None]:
    """bf16 autocast for a single-GPU process; FSDP2's policy already covers the distributed GPU case."""
    if info.device.type == "cuda" and not info.distributed:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            yield
    else:
        yield


def all_reduce_sum(value: float, info: DistInfo) -> float:
    if not info.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(tensor)
    return float(tensor.item())


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if info.distributed and dist.is_initialized():
        dist.destroy_process_group()

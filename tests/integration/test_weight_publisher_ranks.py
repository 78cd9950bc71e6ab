"""Two gloo ranks: a NaN in one rank's parameters makes every rank refuse to publish (none waits in a gather)."""

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.slow


def _rank(rank: int, port: int, out: str) -> None:
    from tidal.errors import UserError
    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.publish import FilesystemPublisher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device("cpu"))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    if rank == 1:
        with torch.no_grad():
            model[1].weight[0, 0] = float("nan")
    try:
        FilesystemPublisher(Path(out)).publish(3, model, None, info)
        message = "published"
    except UserError as exc:
        message = str(exc)
    Path(out, f"rank{rank}.txt").write_text(message)
    dist.destroy_process_group()


def test_every_rank_refuses_when_one_holds_nan(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    rank0, rank1 = ((tmp_path / f"rank{r}.txt").read_text() for r in (0, 1))
    assert rank1.startswith("refusing to publish weights step_3: tensor 1.weight has NaN/inf"), rank1
    assert rank0.startswith("refusing to publish weights step_3: tensor on another rank (1 tensor(s))"), rank0


class _Recorder:
    """Rank 0's broadcaster, keeping what it would send (the NCCL transfer itself needs GPUs)."""

    rendezvous = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}

    def __init__(self, out: str):
        self.out = out

    def open(self) -> None:
        pass

    def send(self, header, tensors) -> None:  # type: ignore[no-untyped-def]
        torch.save({"header": header.encode(), "tensors": dict(tensors)}, Path(self.out, "sent.pt"))

    def close(self) -> None:
        pass


def _fsdp_rank(rank: int, port: int, out: str) -> None:
    from torch.distributed.fsdp import fully_shard

    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.publish import NcclPublisher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    info = DistInfo(rank=rank, world_size=2, local_rank=rank, local_world_size=2, device=torch.device("cpu"))
    torch.manual_seed(0)  # the same initial weights on both ranks, as from one checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Linear(4, 2))
    torch.save(model.state_dict(), Path(out, f"full{rank}.pt"))
    fully_shard(model[0])
    fully_shard(model)
    broadcaster = _Recorder(out) if rank == 0 else None
    NcclPublisher(Path(out), 3, torch.bfloat16, broadcaster).publish(1, model, None, info)
    # both ranks past every collective before either tears gloo down: on a loaded machine a rank torn down
    # while the other's last collective was still in flight aborted ("terminate called without an active
    # exception", SIGABRT) once in a full suite
    dist.barrier()
    dist.destroy_process_group()


def test_nccl_publish_gathers_fsdp_shards_on_every_rank_and_sends_whole_tensors(tmp_path: Path) -> None:
    from tidal.transport.nccl import BroadcastHeader

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_fsdp_rank, args=(port, str(tmp_path)), nprocs=2, join=True)
    sent = torch.load(tmp_path / "sent.pt")
    full = torch.load(tmp_path / "full0.pt")
    header = BroadcastHeader.decode(sent["header"])
    assert [t.name for t in header.tensors] == list(full) and {t.dtype for t in header.tensors} == {
        "bfloat16"
    }
    for name, value in full.items():
        assert torch.equal(sent["tensors"][name], value.to(torch.bfloat16)), name

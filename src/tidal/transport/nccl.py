"""NCCL weight transport (GPU): trainer rank 0 broadcasts to inference workers through vLLM's NCCL groups.

Two protocols over the same vLLM routes:

- `tidal rl` (`NcclBroadcaster`): one group spans trainer rank 0 and every worker of every replica (replica
  i's workers at ranks given by its `inference.weights.nccl`). Each step the trainer announces
  `weights/step_<n>/nccl.json` (no weights; `announce`), then broadcasts a header (step, names, dtypes,
  shapes; `BroadcastHeader`) and the tensors. The orchestrator, which owns pausing and versions, sees the
  announcement as it would a filesystem step and asks every server to load it (`/update_weights` with
  {"path": <announcement>}); the workers join the group at their first update and read the tensor list
  from the header, so nothing but the step's path travels over HTTP and no filesystem is shared with them.
- `NcclWeightSender` (benchmarks, GPU tests): vLLM's own four-call handshake against one server, driven by
  the sender; `AdminWeightSyncClient` is that client over tidal's token-guarded admin routes. One server per
  sender: vLLM places the receiving workers at NCCL ranks 1..N behind the single trainer rank 0.

vLLM 0.3x has a trainer-side engine (`WeightTransferTrainerFactory`); 0.26 has only the worker engine and a
static broadcast, so the sender drives the same routes itself there. The benchmark ran `NcclWeightSender`
on 0.26 (benchmarks/results/weight_update_nccl_h200x2_qwen3_0.6b.json); `NcclBroadcaster` has not run on
GPUs yet (tests/gpu/test_rl_nccl_gpu.py).
"""

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import httpx

from tidal.config.inference import TOKEN_HEADER
from tidal.transport.weights import finish_staged, step_dir


class AdminWeightSyncClient:
    """vLLM's four-call weight-sync protocol (plus pause/resume/version) over HTTP with the admin token."""

    def __init__(
        self,
        url: str,
        admin_token: str | None = None,
        timeout: float = 600.0,
        transport: httpx.BaseTransport | None = None,
    ):
        self.url = url.rstrip("/")
        headers = {TOKEN_HEADER: admin_token} if admin_token else {}
        self._http = httpx.Client(timeout=timeout, headers=headers, transport=transport)

    def _post(self, path: str, body: dict[str, Any] | None = None) -> None:
        response = self._http.post(self.url + path, json=body)
        if response.status_code >= 400:
            raise RuntimeError(f"{self.url}{path} answered {response.status_code}: {response.text[:300]}")

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("/start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("/finish_weight_update", {"weight_version": weight_version} if weight_version else None)

    def pause(self, mode: str = "wait") -> None:
        self._post(f"/pause?mode={mode}")

    def resume(self) -> None:
        self._post("/resume")

    def set_version(self, version: int) -> None:
        self._post("/update_weight_version", {"new_version": str(version)})


class NcclWeightSender:
    """Built on every trainer rank (FSDP gathers are collectives); only rank 0 talks to the server."""

    def __init__(
        self,
        model: Any,
        url: str,
        *,
        rank: int,
        master_address: str,
        master_port: int,
        inference_world_size: int,
        admin_token: str | None = None,
    ):
        self.client = AdminWeightSyncClient(url, admin_token)
        self.is_sender = rank == 0
        self.model = model
        rendezvous = {"master_address": master_address, "master_port": master_port}
        world_size = inference_world_size + 1  # the trainer's rank 0, then every inference worker
        if _has_trainer_engines():
            self._init_032(rank, world_size, rendezvous)
        else:
            self._init_026(world_size, rendezvous)

    def _init_032(self, rank: int, world_size: int, rendezvous: dict[str, Any]) -> None:
        """vLLM >= 0.3x: its trainer engine drives the handshake and the round trip."""
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        init_info = NCCLTrainerInitInfo(**rendezvous, world_size=world_size, rank=rank)
        self.engine: Any = WeightTransferTrainerFactory.trainer_init(
            init_info, client=self.client, source=ModuleSource(self.model)
        )
        self.group: Any = None

    def _init_026(self, world_size: int, rendezvous: dict[str, Any]) -> None:
        """vLLM 0.26: no trainer engine; open the NCCL group while the workers join it (both block)."""
        from concurrent.futures import ThreadPoolExecutor

        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        self.engine = None
        self.group = None
        if not self.is_sender:
            return
        with ThreadPoolExecutor(max_workers=1) as pool:
            joined = pool.submit(
                self.client.init_weight_transfer_engine,
                {**rendezvous, "rank_offset": 1, "world_size": world_size},
            )
            self.group = trainer_init({**rendezvous, "world_size": world_size})
            joined.result()

    def send(self, version: int) -> None:
        """Pause the server, broadcast every parameter, tag the version (where vLLM keeps one), resume."""
        if self.is_sender:
            self.client.pause()
        try:
            if self.engine is not None:
                self.engine.send_weights()
                if self.is_sender:
                    self.client.set_version(version)
            else:
                self._send_026()
        finally:
            if self.is_sender:
                self.client.resume()

    def _send_026(self) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

        params = [(name, _full(p)) for name, p in self.model.named_parameters()]  # a collective under FSDP
        if not self.is_sender:
            return
        info = {
            "names": [n for n, _ in params],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in params],
            "shapes": [list(t.shape) for _, t in params],
            "packed": True,
        }
        self.client.start_weight_update()
        with ThreadPoolExecutor(max_workers=1) as pool:
            received = pool.submit(self.client.update_weights, info)  # workers receive while we broadcast
            send = NCCLWeightTransferEngine.trainer_send_weights  # type: ignore[attr-defined]  # 0.26 only
            send(iter(params), {"group": self.group, "packed": True})
            received.result()
        self.client.finish_weight_update()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()


def _has_trainer_engines() -> bool:
    """vLLM 0.3x (a trainer-side NCCL engine and the packed-tensor helpers) rather than 0.26."""
    import vllm.distributed.weight_transfer.nccl_engine as nccl

    return hasattr(nccl, "NCCLTrainerInitInfo")


def _full(tensor: Any) -> Any:
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor.detach()


# ---- `tidal rl`: announcement, header, broadcaster -----------------------------------------------------

ANNOUNCEMENT = "nccl.json"
ENGINE_NAME = "tidal_nccl"
"""The weight-transfer engine `inference.weights.backend = "nccl"` starts vLLM with (tidal.inference.vllm_ext
registers it): vLLM's NCCL engine plus the `tidal rl` protocol above."""
RENDEZVOUS_ENV = "TIDAL_NCCL_RENDEZVOUS"
"""JSON of the server's `inference.weights.nccl`, for its workers (they inherit the server's environment)."""
_STEP_NAME = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    """torch dtype without the `torch.` prefix (what vLLM's update info calls a dtype name)."""
    shape: tuple[int, ...]


@dataclass(frozen=True)
class BroadcastHeader:
    """What the workers must know before the tensors arrive: the step, and each tensor in broadcast order."""

    step: int
    tensors: tuple[TensorMeta, ...]
    packed: bool = True

    def encode(self) -> bytes:
        rows = [[t.name, t.dtype, list(t.shape)] for t in self.tensors]
        return json.dumps({"step": self.step, "packed": self.packed, "tensors": rows}).encode()

    @classmethod
    def decode(cls, data: bytes) -> "BroadcastHeader":
        raw = json.loads(data)
        tensors = tuple(TensorMeta(name, dtype, tuple(shape)) for name, dtype, shape in raw["tensors"])
        return cls(step=int(raw["step"]), tensors=tensors, packed=bool(raw["packed"]))

    def update_info(self) -> dict[str, Any]:
        """vLLM's NCCL update info for these tensors (its dataclass takes the keys its release knows)."""
        return {
            "names": [t.name for t in self.tensors],
            "dtype_names": [t.dtype for t in self.tensors],
            "shapes": [list(t.shape) for t in self.tensors],
            "packed": self.packed,
        }


def announce(output_dir: Path, step: int, header: BroadcastHeader, rendezvous: dict[str, Any]) -> Path:
    """Publish `weights/step_<step>/` holding only `nccl.json` (atomically, like a checkpoint): the step the
    trainer is about to broadcast, and where."""
    target = step_dir(output_dir, step)
    staging = target.with_name(target.name + ".tmp")
    staging.mkdir(parents=True, exist_ok=True)
    summary = {"step": step, "tensors": len(header.tensors), **rendezvous}
    (staging / ANNOUNCEMENT).write_text(json.dumps(summary, indent=2) + "\n")
    return finish_staged(staging, target)


def is_announcement(directory: str | Path) -> bool:
    """A step published by NCCL broadcast (rather than files inference loads)."""
    return (Path(directory) / ANNOUNCEMENT).is_file()


def announced_step(path: str) -> int | None:
    """The step a `weights/step_<n>` path names (None for any other path)."""
    match = _STEP_NAME.match(Path(path).name)
    return int(match.group(1)) if match else None


def fields_of(cls: Any, values: dict[str, Any]) -> dict[str, Any]:
    """The entries of `values` that dataclass `cls` has fields for (vLLM releases differ in which they have)."""
    names = {f.name for f in fields(cls)}
    return {key: value for key, value in values.items() if key in names}


class NcclBroadcaster:
    """Trainer rank 0's end of the `tidal rl` group: open it once, then broadcast header + tensors per step."""

    def __init__(self, master_address: str, master_port: int, world_size: int):
        self.rendezvous = {
            "master_address": master_address,
            "master_port": master_port,
            "world_size": world_size,
        }
        self.group: Any = None

    def open(self) -> None:
        """Listen as rank 0 and wait until every inference worker joined (they join at their first update)."""
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        if self.group is None:
            self.group = trainer_init(dict(self.rendezvous))

    def send(self, header: BroadcastHeader, tensors: Iterable[tuple[str, Any]]) -> None:
        """Broadcast the header, then every tensor (CUDA, in the header's order and dtypes)."""
        import torch

        assert self.group is not None, "open() first"
        send_bytes(self.group, header.encode())
        # NCCL sends from device memory: a CPU-offloaded parameter travels through the GPU one at a time
        pairs = ((name, t if t.is_cuda else t.cuda()) for name, t in tensors)
        if _has_trainer_engines():
            from vllm.distributed.weight_transfer.packed_tensor import (
                DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                DEFAULT_PACKED_NUM_BUFFERS,
                packed_nccl_broadcast_producer,
            )

            packed_nccl_broadcast_producer(
                iterator=pairs,
                group=self.group,
                src=0,
                post_iter_func=lambda item: item[1],
                buffer_size_bytes=DEFAULT_PACKED_BUFFER_SIZE_BYTES,
                num_buffers=DEFAULT_PACKED_NUM_BUFFERS,
            )
        else:
            from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

            send = NCCLWeightTransferEngine.trainer_send_weights  # type: ignore[attr-defined]  # 0.26 only
            send(pairs, {"group": self.group, "packed": header.packed})
        torch.cuda.current_stream().synchronize()

    def close(self) -> None:
        if self.group is not None:
            destroy = getattr(self.group, "destroy", None)
            if callable(destroy):
                destroy()
            self.group = None


def send_bytes(group: Any, data: bytes) -> None:
    """Broadcast `data` from rank 0: its length, then the bytes (receivers size their buffer from the first)."""
    import torch

    stream = torch.cuda.current_stream()
    group.broadcast(torch.tensor([len(data)], dtype=torch.int64, device="cuda"), src=0, stream=stream)
    payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to("cuda")
    group.broadcast(payload, src=0, stream=stream)


def receive_bytes(group: Any, device: Any) -> bytes:
    """The other end of `send_bytes`."""
    import torch

    stream = torch.cuda.current_stream()
    length = torch.zeros(1, dtype=torch.int64, device=device)
    group.broadcast(length, src=0, stream=stream)
    payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    group.broadcast(payload, src=0, stream=stream)
    return bytes(payload.cpu().numpy().tobytes())

"""NCCL weight transport (GPU): trainer rank 0 broadcasts to a server's workers through vLLM's `nccl` engine.

The server runs with `weights.backend = "nccl"`. vLLM's trainer-side engine drives the handshake through a
`VLLMWeightSyncClient`; `AdminWeightSyncClient` is that client over tidal's token-guarded admin routes
(vLLM's own HTTP client sends no token). One server per sender: vLLM places the receiving workers at NCCL
ranks 1..N behind the single trainer rank 0, so several servers would need one group each.
vLLM 0.3x has a trainer-side engine (`WeightTransferTrainerFactory`); 0.26 has only the worker engine and a
static broadcast, so the sender drives the same routes itself there. Neither path has been run on GPUs yet.
"""

from typing import Any

import httpx

from tidal.inference.guard import TOKEN_HEADER


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
    import vllm.distributed.weight_transfer.nccl_engine as nccl

    return hasattr(nccl, "NCCLTrainerInitInfo")


def _full(tensor: Any) -> Any:
    gather = getattr(tensor, "full_tensor", None)
    return gather() if callable(gather) else tensor.detach()

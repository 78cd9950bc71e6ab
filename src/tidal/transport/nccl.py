"""NCCL weight transport (GPU): trainer rank 0 broadcasts to a server's workers through vLLM's `nccl` engine.

The server runs with `weights.backend = "nccl"`. vLLM's trainer-side engine drives the handshake through a
`VLLMWeightSyncClient`; `AdminWeightSyncClient` is that client over tidal's token-guarded admin routes
(vLLM's own HTTP client sends no token). One server per sender: vLLM places the receiving workers at NCCL
ranks 1..N behind the single trainer rank 0, so several servers would need one group each.
Written against vLLM 0.32's trainer API (`WeightTransferTrainerFactory`); not yet run on GPUs.
"""

from typing import Any

import httpx

from tidal.inference.guard import TOKEN_HEADER


class AdminWeightSyncClient:
    """vLLM's four-call weight-sync protocol (plus pause/resume/version) over HTTP with the admin token."""

    def __init__(self, url: str, admin_token: str | None = None, timeout: float = 600.0):
        self.url = url.rstrip("/")
        self._http = httpx.Client(timeout=timeout, headers={TOKEN_HEADER: admin_token} if admin_token else {})

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
        from vllm.distributed.weight_transfer import ModuleSource, WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self.client = AdminWeightSyncClient(url, admin_token)
        self.is_sender = rank == 0
        init_info = NCCLTrainerInitInfo(
            master_address=master_address,
            master_port=master_port,
            world_size=inference_world_size + 1,
            rank=rank,
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(
            init_info, client=self.client, source=ModuleSource(model)
        )

    def send(self, version: int) -> None:
        """Pause the server, broadcast every parameter, tag the version, resume."""
        if self.is_sender:
            self.client.pause()
        try:
            self.engine.send_weights()
            if self.is_sender:
                self.client.set_version(version)
        finally:
            if self.is_sender:
                self.client.resume()

    def close(self) -> None:
        self.engine.shutdown()

"""Runs inside vLLM's workers: the `nccl` weight backend, vLLM's NCCL engine plus `tidal rl`'s protocol.

With `inference.weights.nccl` set (`tidal rl` writes it; the workers read it from RENDEZVOUS_ENV), a worker
joins the trainer's group at its first update, and an `/update_weights` with {"path": <announcement>}
receives the step's header (names, dtypes, shapes) and then its tensors over NCCL
(tidal.transport.nccl). Without it the engine is vLLM's own: the sender calls `/init_weight_transfer_engine`
and names the tensors in the update info (NcclWeightSender).

Both ways a tied lm_head is pointed at the new embedding after the load (vLLM's layer-wise reload replaces
the embedding's Parameter; see tidal.inference.reload.retie_lm_head). Where the engine runs the reload
(vLLM 0.3x) it starts only once the header has arrived, so an update refused before (a wrong step, a
replay) leaves the model whole. Hooks are the parse/receive pair, which every release calls (0.26's worker
calls `receive_weights(info, load_weights)` itself, 0.3x's base `update_weights` calls `receive_weights`).
"""

import json
import os
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import WeightTransferUpdateInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from tidal.inference.reload import retie_lm_head
from tidal.transport.nccl import RENDEZVOUS_ENV, BroadcastHeader, announced_step, fields_of, receive_bytes


@dataclass
class AnnouncedUpdate(WeightTransferUpdateInfo):
    """A `tidal rl` update: the step's announcement; what to receive comes in the broadcast's header."""

    path: str


class TidalNcclEngine(NCCLWeightTransferEngine):
    """No __init__ of its own: the base class's differs across vLLM releases (state is set lazily)."""

    _received: str | None = None  # the announcement path of the step these workers hold
    _reloading = False

    def parse_update_info(self, update_dict: dict[str, Any]) -> Any:
        if _rendezvous() is None:
            return super().parse_update_info(update_dict)
        path = update_dict.get("path")
        if not isinstance(path, str):
            raise ValueError(
                "this server receives `tidal rl` broadcasts (inference.weights.nccl is set): "
                '/update_weights takes {"path": "<weights/step_<n> announcement>"}'
            )
        return AnnouncedUpdate(path)

    def start_weight_update(self) -> None:
        if _rendezvous() is None:
            super().start_weight_update()
        # tidal protocol: the reload starts in receive_weights, once the header says what comes

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # the base class's ends in torch.accelerator.synchronize(), which raises on a CPU-only host
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: Any, *args: Any, **kwargs: Any) -> None:
        if not isinstance(update_info, AnnouncedUpdate):
            super().receive_weights(update_info, *args, **kwargs)
            return
        if update_info.path == self._received:
            # A server the client took out of rotation (a missed health check) and brings back replays the
            # latest step; these workers hold it already, and no trainer is sending it again.
            return
        rendezvous = _rendezvous()
        assert rendezvous is not None  # parse_update_info makes an AnnouncedUpdate only with one
        self._join(rendezvous)
        device = getattr(self, "device", None) or torch.device("cuda", torch.cuda.current_device())
        header = BroadcastHeader.decode(receive_bytes(self.model_update_group, device))
        expected = announced_step(update_info.path)
        if expected is not None and header.step != expected:
            raise ValueError(
                f"asked to load {update_info.path} but the trainer broadcasts step {header.step}: "
                "the announcement is stale (restart the run with --resume)"
            )
        if _engine_reloads():
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self._reloading = True
        info = self.update_info_cls(**fields_of(self.update_info_cls, header.update_info()))
        super().receive_weights(info, *args, **kwargs)
        self._received = update_info.path

    def finish_weight_update(self) -> None:
        if _rendezvous() is None or self._reloading:
            self._reloading = False
            super().finish_weight_update()
        model = getattr(self, "model", None)
        if model is not None:
            retie_lm_head(model, getattr(self, "model_config", None))

    def _join(self, rendezvous: dict[str, Any]) -> None:
        """Join the trainer's group once; blocks until trainer rank 0 and every other worker are in."""
        if getattr(self, "model_update_group", None) is None:
            values = {**rendezvous, "packed": True}
            self.init_transfer_engine(self.init_info_cls(**fields_of(self.init_info_cls, values)))


def _engine_reloads() -> bool:
    """vLLM 0.3x: the engine's start/finish run the layer-wise reload (0.26: the worker runs it)."""
    return "start_weight_update" in vars(NCCLWeightTransferEngine)


def _rendezvous() -> dict[str, Any] | None:
    raw = os.environ.get(RENDEZVOUS_ENV)
    return json.loads(raw) if raw else None

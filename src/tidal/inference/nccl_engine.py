"""Runs inside vLLM's workers: the `nccl` weight backend, vLLM's NCCL engine plus `tidal rl`'s protocol.

With `inference.weights.nccl` set (`tidal rl` writes it; the workers read it from RENDEZVOUS_ENV), a worker
joins the trainer's group at its first update, and an `/update_weights` with {"path": <announcement>}
receives the step's header (names, dtypes, shapes) and then its tensors over NCCL
(tidal.transport.nccl). Without it the engine is vLLM's own: the sender calls `/init_weight_transfer_engine`
and names the tensors in the update info (NcclWeightSender).

Both ways a tied lm_head is pointed at the new embedding after the load (vLLM's layer-wise reload replaces
the embedding's Parameter; see tidal.inference.reload.retie_lm_head). The reload starts only once the
header has arrived, so an update that fails before (a wrong step, a replay) leaves the model whole.
"""

import json
import os
from typing import Any

import torch
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from tidal.inference.reload import retie_lm_head
from tidal.transport.nccl import RENDEZVOUS_ENV, BroadcastHeader, announced_step, fields_of, receive_bytes


class TidalNcclEngine(NCCLWeightTransferEngine):
    """No __init__ of its own: the base class's differs across vLLM releases (state is set lazily)."""

    _received: str | None = None  # the announcement path of the step these workers hold
    _reloading = False

    def start_weight_update(self) -> None:
        if _rendezvous() is None:
            super().start_weight_update()
        # tidal protocol: the reload starts in update_weights, once the header says what comes

    def update_weights(self, update_info: dict[str, Any]) -> None:
        rendezvous = _rendezvous()
        if rendezvous is None or "path" not in update_info:
            super().update_weights(update_info)
            return
        path = str(update_info["path"])
        if path == self._received:
            # A server the client took out of rotation (a missed health check) and brings back replays the
            # latest step; these workers hold it already, and no trainer is sending it again.
            return
        self._join(rendezvous)
        header = BroadcastHeader.decode(receive_bytes(self.model_update_group, self.device))
        expected = announced_step(path)
        if expected is not None and header.step != expected:
            raise ValueError(
                f"asked to load {path} but the trainer broadcasts step {header.step}: "
                "the announcement is stale (restart the run with --resume)"
            )
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)
        self._reloading = True
        info = self.update_info_cls(**fields_of(self.update_info_cls, header.update_info()))
        self.receive_weights(info)
        if torch.cuda.is_available():  # the loads are queued on the stream; the base class syncs the same way
            torch.cuda.synchronize()
        self._received = path

    def finish_weight_update(self) -> None:
        if _rendezvous() is None:
            super().finish_weight_update()
        elif self._reloading:
            self._reloading = False
            super().finish_weight_update()
        retie_lm_head(self.model, self.model_config)

    def _join(self, rendezvous: dict[str, Any]) -> None:
        """Join the trainer's group once; blocks until trainer rank 0 and every other worker are in."""
        if getattr(self, "model_update_group", None) is None:
            values = {**rendezvous, "packed": True}
            self.init_transfer_engine(self.init_info_cls(**fields_of(self.init_info_cls, values)))


def _rendezvous() -> dict[str, Any] | None:
    raw = os.environ.get(RENDEZVOUS_ENV)
    return json.loads(raw) if raw else None

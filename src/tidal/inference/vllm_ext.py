"""Runs inside vLLM's worker processes: registers tidal's weight-transfer engines, `filesystem` (here),
`tidal_nccl` (tidal.inference.nccl_engine, what `inference.weights.backend = "nccl"` starts vLLM with) and
`tidal_cuda_ipc` (tidal.inference.cuda_ipc_engine, for `"cuda_ipc"`).

vLLM imports the class named by `--worker-extension-cls` in every worker before it loads the model, so
importing this module is how the engine reaches the spawned workers without a plugin entry point. The
engine plugs into vLLM's own RL weight-transfer API (`/start_weight_update`, `/update_weights` with
`{"path": DIR}`, `/finish_weight_update`), so pausing, versioning and the HTTP routes stay vLLM's.

A load begins only after the files pass the header checks of `tidal.transport.weight_checks` (the server's
guard has run them and the value check already); a load that still fails midway reloads the weights served
before it, and says `WEIGHTS_BROKEN` (the guard then reports the server unhealthy) if that fails too.
"""

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)
from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

from tidal.inference.cuda_ipc_engine import TidalCudaIpcEngine
from tidal.inference.guard import REFERENCE_WEIGHTS_ENV
from tidal.inference.nccl_engine import TidalNcclEngine
from tidal.inference.reload import reset_cpu_moe_kernels, retie_lm_head
from tidal.transport.cuda_ipc import ENGINE_NAME as CUDA_IPC_ENGINE_NAME
from tidal.transport.nccl import ENGINE_NAME as NCCL_ENGINE_NAME
from tidal.transport.weight_checks import (
    Reference,
    load_or_restore,
    load_reference,
    local_checkpoint,
    update_problem,
)
from tidal.transport.weights import check_weights_dir

FILESYSTEM_BACKEND = "filesystem"
# under vLLM's logger, so that its handler (the server's output) shows the load times
logger = logging.getLogger("vllm.tidal.filesystem")


@dataclass
class FilesystemInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the trainer and the server share a filesystem."""


@dataclass
class FilesystemUpdateInfo(WeightTransferUpdateInfo):
    """Where the new HF-named safetensors are; the directory must be complete (written atomically)."""

    path: str


def iter_safetensors(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {directory}")
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                yield name, handle.get_tensor(name)


class FilesystemWeightTransferEngine(WeightTransferEngine[FilesystemInitInfo, FilesystemUpdateInfo]):
    """Loads HF checkpoint-format weights from a directory through vLLM's layer-wise reload.

    Layer-wise reload (not `model.load_weights` alone) is needed because vLLM post-processes weights after
    loading (on CPU the linear weights are repacked); it restores the checkpoint layout, loads, and
    re-runs that processing.
    """

    init_info_cls = FilesystemInitInfo
    update_info_cls = FilesystemUpdateInfo
    # per-instance once set (the base class's __init__ differs across vLLM releases, so no __init__ here)
    _served: Path | None = None
    _reference_cache: Reference | None = None
    _reference_loaded = False

    def init_transfer_engine(self, init_info: FilesystemInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        # Reload starts in receive_weights, after the directory is checked: a bad path found after
        # initialize_layerwise_reload would leave the model half torn down.
        pass

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class calls torch.accelerator.synchronize(), which raises on a CPU-only host.
        self.receive_weights(self.parse_update_info(update_info))
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def receive_weights(self, update_info: FilesystemUpdateInfo) -> None:
        directory = Path(update_info.path)
        # The server's guard checked the files already (values included); the cheap header checks again
        # here keep a request that bypassed it from tearing the model down over a bad file.
        reference = self._reference()
        problem = check_weights_dir(directory) or update_problem(directory, reference, check_finite=False)
        if problem:
            raise ValueError(problem)
        start = time.perf_counter()
        load_or_restore(self._load, directory, self._serving())
        self._served = directory
        logger.info("tidal filesystem: loaded %s in %.1f ms", directory, 1000 * (time.perf_counter() - start))

    def _load(self, directory: Path) -> None:
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        reset_cpu_moe_kernels(self.model)
        initialize_layerwise_reload(self.model)
        try:
            self.model.load_weights(iter_safetensors(directory))  # type: ignore[operator]  # vLLM models define it
        finally:
            # also after a failure: puts the layers that got nothing back and unwraps the loaders, so the
            # next reload (of the previous weights) starts from a whole model
            finalize_layerwise_reload(self.model, self.model_config)
        retie_lm_head(self.model, self.model_config)

    def _reference(self) -> Reference | None:
        if not self._reference_loaded:
            name = os.environ.get(REFERENCE_WEIGHTS_ENV)
            self._reference_cache = load_reference(name) if name else None
            self._reference_loaded = True
        return self._reference_cache

    def _serving(self) -> Path | None:
        """The weights served now: the last update (even if since pruned: then restoring fails, rather
        than silently serving older weights under the current version), else the checkpoint started from."""
        if self._served is not None:
            return self._served
        name = os.environ.get(REFERENCE_WEIGHTS_ENV)
        return local_checkpoint(name) if name else None

    def finish_weight_update(self) -> None:
        pass

    def shutdown(self) -> None:
        pass

    @staticmethod
    def trainer_send_weights(iterator: Any, trainer_args: Any) -> None:
        """Abstract in vLLM 0.26's base class; the filesystem 'sender' is the trainer writing a checkpoint."""
        raise NotImplementedError("publish weights with tidal.trainer.publish (or tidal.transport.weights)")


def register() -> None:
    """Idempotent: vLLM may import this module more than once per process."""
    engines: dict[str, type[WeightTransferEngine[Any, Any]]] = {
        FILESYSTEM_BACKEND: FilesystemWeightTransferEngine,
        NCCL_ENGINE_NAME: TidalNcclEngine,
        CUDA_IPC_ENGINE_NAME: TidalCudaIpcEngine,
    }
    for name, engine in engines.items():
        if name not in WeightTransferEngineFactory._registry:
            WeightTransferEngineFactory.register_engine(name, engine)


class TidalWorkerExtension:
    """Mixed into vLLM's worker class; importing it is what registers the engine (see module docstring)."""


register()

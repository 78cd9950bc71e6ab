"""Split one `tidal rl` config into the configs of its three processes (pure; tested without processes)."""

import os
from dataclasses import dataclass

from tidal.config.inference import InferenceConfig, VLLMConfig, WeightUpdateConfig
from tidal.config.lora import vllm_lora_rank
from tidal.config.rl import OrchestratorConfig, PublishConfig, RLConfig, RLTrainerConfig
from tidal.inference.server import client_url


@dataclass(frozen=True)
class RoleConfigs:
    """The per-process configs `tidal rl` writes to <output_dir>/configs/ and starts the processes with."""

    inference: InferenceConfig
    orchestrator: OrchestratorConfig
    trainer: RLTrainerConfig


def split_config(rl: RLConfig, on_gpu: bool, num_cpus: int | None = None) -> RoleConfigs:
    """Shared keys (output_dir, max_steps, seed, resume, model, async bound, transport) come from the top
    (RLConfig refuses them in the sub-tables, where they would be overwritten)."""
    num_cpus = num_cpus or os.cpu_count() or 1
    shared = {
        "output_dir": rl.output_dir,
        "max_steps": rl.max_steps,
        "seed": rl.seed,
        "resume": rl.resume,
        "model": rl.model,
    }
    inference = rl.inference.model_copy(
        update={"model": rl.model, "vllm": _vllm_for(rl), "weights": _weights_for(rl)}
    )
    if not on_gpu:
        inference = inference.model_copy(
            update={
                "cpu": inference.cpu.model_copy(update={"omp_threads_bind": _inference_cpus(rl, num_cpus)})
            }
        )
    url = client_url(inference.server.host, inference.server.port)
    orchestrator = rl.orchestrator.model_copy(
        update={
            **shared,
            "max_async_level": rl.max_async_level,
            "transport": rl.transport,
            "client": rl.orchestrator.client.model_copy(
                update={
                    "urls": [url],
                    "admin_token": rl.inference.server.admin_token or rl.orchestrator.client.admin_token,
                }
            ),
            "batch": rl.orchestrator.batch.model_copy(
                update={"num_trainer_ranks": rl.deployment.num_trainer_ranks}
            ),
        }
    )
    trainer_threads = None if on_gpu else _trainer_threads(rl, num_cpus)
    trainer = rl.trainer.model_copy(
        update={
            **shared,
            "transport": rl.transport,
            "temperature": rl.orchestrator.sampling.temperature,
            "num_threads": rl.trainer.num_threads or trainer_threads,
            "publish": _publish_for(rl),
        }
    )
    return RoleConfigs(inference, orchestrator, trainer)


def _publish_for(rl: RLConfig) -> PublishConfig:
    """Publish in the dtype inference serves, spelled out (`auto` would mean it too): the trainer's config
    then shows it beside its fp32 master weights (perf.master_dtype)."""
    publish = rl.trainer.publish
    if publish.dtype == "auto" and rl.model.dtype != "auto":
        publish = publish.model_copy(update={"dtype": rl.model.dtype})
    return publish


def _vllm_for(rl: RLConfig) -> VLLMConfig:
    """The run's seed, and with `trainer.lora` the LoRA flags the published adapters need."""
    update: dict[str, object] = {"seed": rl.seed}
    lora, vllm = rl.trainer.lora, rl.inference.vllm
    if lora.enabled:
        assert lora.rank is not None
        update["enable_lora"] = True
        update["max_lora_rank"] = max(vllm.max_lora_rank, vllm_lora_rank(lora.rank))
        # Each step is a new adapter; requests of the previous one may still run beside the new one's.
        update["max_loras"] = max(vllm.max_loras, 2)
    return vllm.model_copy(update=update)


def _weights_for(rl: RLConfig) -> WeightUpdateConfig:
    """`check_finite = auto` is off under `tidal rl`: its trainer refuses non-finite weights at publish."""
    weights = rl.inference.weights
    if weights.check_finite == "auto":
        return weights.model_copy(update={"check_finite": False})
    return weights


def _inference_cpus(rl: RLConfig, num_cpus: int) -> str:
    """vLLM's OpenMP threads get their own cores: on few cores, core 0; else the first half."""
    if rl.deployment.inference_cpus is not None:
        return rl.deployment.inference_cpus
    if num_cpus <= 2:
        return "0"
    return f"0-{num_cpus // 2 - 1}"


def _trainer_threads(rl: RLConfig, num_cpus: int) -> int:
    if rl.deployment.trainer_threads is not None:
        return rl.deployment.trainer_threads
    left = num_cpus - (1 if num_cpus <= 2 else num_cpus // 2)
    return max(1, left // rl.deployment.num_trainer_ranks)

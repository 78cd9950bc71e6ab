"""Split one `tidal rl` config into the configs of its processes (pure; tested without processes):
one per inference replica, the orchestrator, the trainer."""

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tidal import run_layout
from tidal.config.deployment import format_cpu_list, parse_cpu_list, share_cores, usable_cores
from tidal.config.inference import (
    ADMIN_TOKEN_ENV,
    InferenceConfig,
    NcclRendezvous,
    VLLMConfig,
    WeightUpdateConfig,
    is_loopback,
)
from tidal.config.lora import vllm_lora_rank
from tidal.config.rl import (
    CudaIpcPublish,
    NcclPublish,
    OrchestratorConfig,
    PublishConfig,
    RLConfig,
    RLRunConfig,
    RLTrainerConfig,
    RolloutTransport,
    TeacherConfig,
    ZMQTransport,
)
from tidal.errors import UserError
from tidal.inference.disagg import storage_of, with_roles
from tidal.inference.server import client_url
from tidal.launcher.plan import Placement, place
from tidal.launcher.restarts import max_restarts


@dataclass(frozen=True)
class RoleConfigs:
    """The per-process configs `tidal rl` writes to <output_dir>/configs/ and starts the processes with."""

    replicas: tuple[InferenceConfig, ...]
    """One `tidal inference` config per replica, on consecutive ports on each inference node."""
    orchestrator: OrchestratorConfig
    trainer: RLTrainerConfig
    replica_gpus: tuple[tuple[int, ...], ...] = ()
    """The GPU ids of each replica on its node (GPU runs; empty on CPU)."""
    replica_nodes: tuple[int, ...] = (0,)
    """The node index of each replica (see tidal.launcher.plan)."""
    replica_urls: tuple[str, ...] = ()
    """Where the orchestrator reaches each replica (with disaggregation, prefill and decode ones alike)."""
    teacher: InferenceConfig | None = None
    """The distillation teacher's `tidal inference` config, when `tidal rl` serves it (`[teacher_server]`)."""
    teacher_gpus: tuple[int, ...] = ()
    """Its GPU ids (GPU runs; empty on CPU)."""

    def node_replicas(self, node: int) -> list[int]:
        """Indexes (into `replicas`) of the replicas node `node` runs."""
        return [i for i, n in enumerate(self.replica_nodes) if n == node]

    @property
    def inference(self) -> InferenceConfig:
        """The first replica's config (the only one, unless deployment.num_replicas > 1)."""
        return self.replicas[0]


def split_config(
    rl: RLConfig, on_gpu: bool, num_cpus: int | None = None, addresses: Sequence[str] | None = None
) -> RoleConfigs:
    """Shared keys (output_dir, max_steps, seed, resume, model, async bound, transport) come from the top
    (RLConfig refuses them in the sub-tables, where they would be overwritten).

    `addresses`: on a cluster, each node's address by node index (tidal.launcher.plan): replicas then bind
    every interface (their admin routes need the token), the orchestrator reaches them at their node's
    address, and trainer ranks reach a zmq transport at the orchestrator node's. None: one machine, loopback.
    """
    cores = list(range(num_cpus)) if num_cpus else usable_cores()
    num_cpus = len(cores)
    placement = place(rl.deployment)
    if addresses is not None and len(addresses) != placement.num_nodes:
        raise UserError(f"deployment: {placement.num_nodes} nodes are needed, {len(addresses)} given")
    inference = _inference_for(rl, addresses)
    per_node = rl.deployment.num_replicas
    binds = [None] * per_node if on_gpu else _replica_cpus(rl, cores)
    trainer_host = "127.0.0.1" if addresses is None else addresses[placement.trainer_nodes[0]]
    publish = _publish_for(rl, on_gpu, trainer_host, per_node * len(placement.inference_nodes))
    replicas, urls, replica_nodes = _place_replicas(inference, binds, publish, placement, addresses)
    replicas = with_roles(replicas, run_layout.kv_store_dir(rl.output_dir))
    transport = rl.transport
    if addresses is not None and isinstance(transport, ZMQTransport):
        transport = transport.model_copy(update={"host": addresses[placement.orchestrator_node]})
    orchestrator = _orchestrator_for(rl, transport, replicas, urls)
    trainer = _trainer_for(rl, transport, publish, on_gpu, num_cpus)
    gpus = _replica_gpus(rl) * len(placement.inference_nodes) if on_gpu else ()
    teacher = None if rl.teacher_server is None else _teacher_for(rl, inference, replicas[0])
    if teacher is not None:
        orchestrator = orchestrator.model_copy(update={"teacher": _teacher_client(rl, teacher)})
    teacher_gpus = (
        tuple(rl.teacher_server.gpus or gpus[0]) if rl.teacher_server is not None and on_gpu else ()
    )
    return RoleConfigs(
        tuple(replicas), orchestrator, trainer, gpus, tuple(replica_nodes), tuple(urls), teacher, teacher_gpus
    )


def _teacher_for(rl: RLConfig, inference: InferenceConfig, first: InferenceConfig) -> InferenceConfig:
    """The teacher's server: the run's inference settings with its model and port, no LoRA and no weight
    updates (its weights never change), and on CPU the first replica's cores."""
    spec = rl.teacher_server
    assert spec is not None
    vllm: dict[str, object] = {"enable_lora": False}
    if spec.gpu_memory_utilization is not None:
        vllm["gpu_memory_utilization"] = spec.gpu_memory_utilization
    if spec.max_model_len is not None:
        vllm["max_model_len"] = spec.max_model_len
    log_file = inference.server.log_file
    server = inference.server.model_copy(
        update={
            "port": spec.port,
            "log_file": None if log_file is None else str(Path(log_file).with_name("teacher.log")),
        }
    )
    return inference.model_copy(
        update={
            "model": rl.model.model_copy(update={"name": spec.model}),
            "server": server,
            "vllm": inference.vllm.model_copy(update=vllm),
            "weights": WeightUpdateConfig(),
            "cpu": first.cpu,
            "disaggregation": None,
        }
    )


def _teacher_client(rl: RLConfig, teacher: InferenceConfig) -> TeacherConfig:
    spec = rl.teacher_server
    assert spec is not None
    url = client_url(teacher.server.host, teacher.server.port)
    return TeacherConfig(
        model=spec.model, urls=[url], kl_weight=spec.kl_weight, reward_weight=spec.reward_weight
    )


def _shared(rl: RLConfig) -> dict[str, object]:
    """The shared block (RLRunConfig's keys), which orchestrator and trainer take from the top of the run
    config (transport as it stands there: a cluster run's zmq transport gets its host after)."""
    return {key: getattr(rl, key) for key in RLRunConfig.model_fields}


def _inference_for(rl: RLConfig, addresses: Sequence[str] | None) -> InferenceConfig:
    """`[inference]` as every replica starts from, before its port, cores and weight backend."""
    # the admin token reaches the processes in their environment (`run_admin_token`), never in the config
    # files `tidal rl` writes to the output dir (or prints with --dry-run)
    server = rl.inference.server.model_copy(update={"admin_token": None})
    if addresses is not None and is_loopback(server.host):
        server = server.model_copy(update={"host": "0.0.0.0"})
    return rl.inference.model_copy(
        update={"model": rl.model, "server": server, "vllm": _vllm_for(rl), "weights": _weights_for(rl)}
    )


def _place_replicas(
    inference: InferenceConfig,
    cores: Sequence[str | None],
    publish: PublishConfig,
    placement: Placement,
    addresses: Sequence[str] | None,
) -> tuple[list[InferenceConfig], list[str], list[int]]:
    """Every replica of the run, node by node, with where the orchestrator reaches it and its node."""
    replicas: list[InferenceConfig] = []
    urls, replica_nodes = [], []
    for node in placement.inference_nodes:
        for index, core in enumerate(cores):
            replica = _replica(inference, index, len(cores), core)
            if isinstance(publish, NcclPublish):
                replica = _join_broadcast(replica, publish, len(replicas))
            elif isinstance(publish, CudaIpcPublish):
                weights = replica.weights.model_copy(update={"backend": "cuda_ipc"})
                replica = replica.model_copy(update={"weights": weights})
            host = replica.server.host if addresses is None else addresses[node]
            replicas.append(replica)
            urls.append(client_url(host, replica.server.port))
            replica_nodes.append(node)
    return replicas, urls, replica_nodes


def _orchestrator_for(
    rl: RLConfig, transport: RolloutTransport, replicas: list[InferenceConfig], urls: list[str]
) -> OrchestratorConfig:
    # disaggregated: the first replicas prefill (`with_roles`), the client decodes on the others
    num_prefill = rl.inference.disaggregation.num_prefill_replicas if rl.inference.disaggregation else 0
    kv_store = storage_of(replicas)
    return rl.orchestrator.model_copy(
        update={
            **_shared(rl),
            "max_async_level": rl.max_async_level,
            "routing_replay": rl.trainer.moe.routing_replay,
            "transport": transport,
            "client": rl.orchestrator.client.model_copy(
                update={
                    "urls": urls[num_prefill:],
                    "prefill_urls": urls[:num_prefill],
                    "kv_store": None if kv_store is None else str(kv_store),
                    "admin_token": None,
                    # a lost replica is restarted: requests and updates wait for it while no other serves
                    "recovery_timeout": rl.startup_timeout if max_restarts(rl) > 0 else 0.0,
                    # it starts while vLLM loads (launcher/supervisor.py): as long a wait as the launcher's own
                    "startup_timeout": rl.startup_timeout,
                }
            ),
            "batch": rl.orchestrator.batch.model_copy(
                update={"num_trainer_ranks": rl.deployment.total_trainer_ranks, "cp": rl.trainer.perf.cp}
            ),
        }
    )


def _trainer_for(
    rl: RLConfig, transport: RolloutTransport, publish: PublishConfig, on_gpu: bool, num_cpus: int
) -> RLTrainerConfig:
    trainer_threads = None if on_gpu else _trainer_threads(rl, num_cpus)
    return rl.trainer.model_copy(
        update={
            **_shared(rl),
            "transport": transport,
            "temperature": rl.orchestrator.sampling.temperature,
            "num_threads": rl.trainer.num_threads or trainer_threads,
            "publish": publish,
        }
    )


def run_admin_token(rl: RLConfig, environ: Mapping[str, str], shared: bool) -> str | None:
    """The admin token of a run's replicas, which `tidal rl` passes in the environment to them and to the
    orchestrator (the only process that calls their admin routes): the configured one
    (`inference.server.admin_token`, else `orchestrator.client.admin_token`), else TIDAL_ADMIN_TOKEN, else
    a new one for this run, so that no other process on the host can pause the servers or load weights
    into them. `shared`: the nodes of a cluster run must agree on it, so none is made
    up on one (the Slurm job and the Kubernetes Secret put one in every node's environment)."""
    configured = rl.inference.server.admin_token or rl.orchestrator.client.admin_token
    found = configured or environ.get(ADMIN_TOKEN_ENV) or None
    if found is not None or shared:
        return found
    return secrets.token_hex(32)


def _replica(base: InferenceConfig, index: int, count: int, cores: str | None) -> InferenceConfig:
    """Replica `index`: the next port, its own cores on CPU, its own vLLM log file if one is named."""
    server = base.server
    if count > 1:
        port = server.port + index
        if port > 65535:
            raise UserError(
                f"inference.server.port: {count} replicas need ports {server.port}-{server.port + count - 1}"
            )
        log_file = server.log_file
        if log_file is not None:
            path = Path(log_file)
            log_file = str(path.with_name(f"{path.stem}_{index}{path.suffix}"))
        server = server.model_copy(update={"port": port, "log_file": log_file})
    update: dict[str, object] = {"server": server}
    if cores is not None:
        update["cpu"] = base.cpu.model_copy(update={"omp_threads_bind": cores})
    return base.model_copy(update=update)


def _replica_cpus(rl: RLConfig, cores: list[int]) -> list[str]:
    """Each replica's share of the inference cores, in order; with fewer cores than replicas they share."""
    spec = _inference_cpus(rl, cores)
    count = rl.deployment.num_replicas
    if count == 1:
        return [spec]
    return share_cores(parse_cpu_list(spec), count)


def _replica_gpus(rl: RLConfig) -> tuple[tuple[int, ...], ...]:
    """`deployment.inference_gpus` in order, tensor_parallel_size × data_parallel_size per replica."""
    vllm, deploy = rl.inference.vllm, rl.deployment
    per_replica = vllm.tensor_parallel_size * vllm.data_parallel_size
    gpus = deploy.inference_gpus
    if len(gpus) != per_replica * deploy.num_replicas:
        raise UserError(
            f"deployment.inference_gpus: lists {len(gpus)} GPU(s) for {deploy.num_replicas} replica(s) of "
            f"{per_replica} GPU(s) each (inference.vllm.tensor_parallel_size × data_parallel_size); "
            f"list {per_replica * deploy.num_replicas}"
        )
    return tuple(tuple(gpus[i * per_replica : (i + 1) * per_replica]) for i in range(deploy.num_replicas))


def _publish_for(rl: RLConfig, on_gpu: bool, trainer_host: str, num_replicas: int) -> PublishConfig:
    """`trainer.publish` with what `tidal rl` derives: the dtype inference serves, spelled out (`auto` would
    mean it too: the trainer's config then shows it beside its fp32 master weights), and for `nccl` where
    the workers reach trainer rank 0 and how many of them there are."""
    publish = rl.trainer.publish
    publish = publish.model_copy(update={"dtype": rl.model.served_dtype(publish.dtype)})
    if isinstance(publish, CudaIpcPublish) and not on_gpu:
        raise UserError("trainer.publish.type = 'cuda_ipc' shares GPU memory; use 'filesystem' on CPU")
    if not isinstance(publish, NcclPublish):
        return publish
    if not on_gpu:
        raise UserError("trainer.publish.type = 'nccl' needs GPUs (NCCL); use 'filesystem' on CPU")
    workers = num_replicas * _workers_per_replica(rl.inference.vllm)
    return publish.model_copy(update={"host": trainer_host, "inference_world_size": workers})


def _workers_per_replica(vllm: VLLMConfig) -> int:
    """vLLM worker processes (one per GPU) of one replica: each is a rank of the NCCL group."""
    return vllm.tensor_parallel_size * vllm.data_parallel_size


def _join_broadcast(replica: InferenceConfig, publish: NcclPublish, index: int) -> InferenceConfig:
    """Replica `index` (over all nodes) receives `nccl` updates in the trainer's one group: rank 0 is the
    trainer, then each replica's workers in order."""
    rendezvous = NcclRendezvous(
        master_address=publish.host,
        master_port=publish.port,
        rank_offset=1 + index * _workers_per_replica(replica.vllm),
        world_size=1 + publish.inference_world_size,
    )
    weights = replica.weights.model_copy(update={"backend": "nccl", "nccl": rendezvous})
    return replica.model_copy(update={"weights": weights})


def _vllm_for(rl: RLConfig) -> VLLMConfig:
    """The run's seed, route return for routing replay, and with `trainer.lora` the LoRA flags the published
    adapters need."""
    update: dict[str, object] = {"seed": rl.seed, "return_routed_experts": rl.trainer.moe.routing_replay}
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


def _inference_cpus(rl: RLConfig, cores: list[int]) -> str:
    """vLLM's OpenMP threads get their own cores of the run's (`usable_cores`): on few cores, the first;
    else the first half."""
    if rl.deployment.inference_cpus is not None:
        return rl.deployment.inference_cpus
    if len(cores) <= 2:
        return str(cores[0])
    return format_cpu_list(cores[: len(cores) // 2])


def _trainer_threads(rl: RLConfig, num_cpus: int) -> int:
    if rl.deployment.trainer_threads is not None:
        return rl.deployment.trainer_threads
    left = num_cpus - (1 if num_cpus <= 2 else num_cpus // 2)
    return max(1, left // rl.deployment.num_trainer_ranks)

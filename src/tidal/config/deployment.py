"""Schema of `[deployment]`: which nodes and devices run inference, the trainer and the orchestrator."""

from typing import Literal

from pydantic import Field, model_validator

from tidal.config.base import Config, ConfigProblem


class DeploymentConfig(Config):
    """Where each process of `tidal rl` runs: which nodes, which devices. The same run config works under
    every `type`; only this table (and `[slurm]` / `[kubernetes]`) changes.

    Nodes are numbered inference nodes first, then trainer nodes: with `local` both roles share the one
    machine; on a cluster they are separate nodes."""

    type: Literal["local", "slurm", "kubernetes"] = "local"
    """`local`: start every process on this machine. `slurm`: render a batch script into
    <output_dir>/slurm/ and submit it with sbatch. `kubernetes`: render manifests into <output_dir>/k8s/."""
    num_inference_nodes: int = Field(default=1, gt=0)
    """Nodes running inference replicas (1 with `local`)."""
    num_trainer_nodes: int = Field(default=1, gt=0)
    """Nodes running trainer ranks, joined by torchrun's c10d rendezvous on the first one (1 with `local`)."""
    orchestrator_node: Literal["trainer", "inference"] = "trainer"
    """The orchestrator runs on the first node of this role (it needs no GPU)."""
    num_trainer_ranks: int = Field(default=1, gt=0)
    """Trainer processes per trainer node (torchrun when more than one in all)."""
    num_replicas: int = Field(default=1, gt=0)
    """Inference replicas per inference node: separate vLLM servers, replica i on port
    inference.server.port + i. The orchestrator's client sends each request to the least-loaded one (every
    turn of an episode to the same one) and each weight update to all of them."""
    inference_gpus: list[int] = Field(default=[0], min_length=1)
    """GPU ids for inference on each inference node (ignored on CPU), split in order among its replicas:
    each gets inference.vllm.tensor_parallel_size × data_parallel_size of them."""
    trainer_gpus: list[int] = Field(default=[0], min_length=1)
    """GPU ids for the trainer ranks on each trainer node (ignored on CPU); with `local` it may equal
    inference_gpus to share one GPU."""
    rendezvous_port: int = Field(default=29400, ge=1, le=65535)
    """Port of torchrun's c10d rendezvous on the first trainer node (more than one trainer node)."""
    inference_cpus: str | None = None
    """CPU cores for vLLM's threads on CPU runs, e.g. "0" or "0-3,6" (default: core 0 when there are few
    cores, else the first half), split in order among the replicas (fewer cores than replicas: they share)."""
    trainer_threads: int | None = Field(default=None, gt=0)
    """Torch threads per trainer rank on CPU runs (default: what is left after inference)."""

    @property
    def num_nodes(self) -> int:
        return 1 if self.type == "local" else self.num_inference_nodes + self.num_trainer_nodes

    @property
    def total_replicas(self) -> int:
        return self.num_replicas * self.num_inference_nodes

    @property
    def total_trainer_ranks(self) -> int:
        return self.num_trainer_ranks * self.num_trainer_nodes

    @model_validator(mode="after")
    def _check_local(self) -> "DeploymentConfig":
        if self.type == "local":
            for key in ("num_inference_nodes", "num_trainer_nodes"):
                if getattr(self, key) != 1:
                    raise ConfigProblem(key, 'more than one node needs type = "slurm" or "kubernetes"')
        return self

    @model_validator(mode="after")
    def _check_cpus(self) -> "DeploymentConfig":
        if self.inference_cpus is not None and "|" in self.inference_cpus:  # vLLM's per-TP-rank lists
            if self.num_replicas > 1:
                raise ConfigProblem(
                    "inference_cpus", "per-rank lists (`|`) are for one replica; give a plain core list"
                )
        elif self.inference_cpus is not None:
            try:
                parse_cpu_list(self.inference_cpus)
            except ValueError as exc:
                raise ConfigProblem("inference_cpus", str(exc)) from None
        return self


def parse_cpu_list(spec: str) -> list[int]:
    """`"0-2,5"` → [0, 1, 2, 5] (the form VLLM_CPU_OMP_THREADS_BIND takes for one process)."""
    cores: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        if not first.isdigit() or (last and not last.isdigit()) or (last and int(last) < int(first)):
            raise ValueError(f'{spec!r} is not a list of cores like "0-3,6"')
        cores.extend(range(int(first), int(last or first) + 1))
    if len(set(cores)) != len(cores):
        raise ValueError(f"{spec!r} names a core twice")
    return cores

"""Schema of `[deployment]`: which nodes and devices run the trainer (`tidal sft`), and inference, the trainer
and the orchestrator (`tidal rl`)."""

import os
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from tidal.config.base import Config, ConfigProblem
from tidal.errors import UserError


class TrainerDeployment(Config):
    """Where the trainer ranks run: the part of `[deployment]` that `tidal sft` and `tidal rl` share."""

    type: Literal["local", "slurm", "kubernetes"] = "local"
    """`local`: start every process on this machine. `slurm`: render a batch script into <output_dir>/slurm/
    and submit it with sbatch. `kubernetes`: render manifests into <output_dir>/k8s/."""
    num_trainer_nodes: int = Field(default=1, gt=0)
    """Nodes running trainer ranks, joined by torchrun's c10d rendezvous on the first one (1 with `local`)."""
    num_trainer_ranks: int = Field(default=1, gt=0)
    """Trainer processes per trainer node (torchrun when more than one in all)."""
    trainer_gpus: list[int] = Field(default=[0], min_length=1)
    """GPU ids for the trainer ranks on each trainer node (ignored on CPU); rank k of a node uses the k-th."""
    rendezvous_port: int = Field(default=29400, ge=1, le=65535)
    """Port of torchrun's c10d rendezvous on the first trainer node (more than one trainer node)."""
    trainer_threads: int | None = Field(default=None, gt=0)
    """Torch threads per trainer rank on CPU runs (default: `tidal rl`: what is left after inference;
    `tidal sft`: the cores divided among the node's ranks; the cores being those the process may use)."""

    NODE_KEYS: ClassVar[tuple[str, ...]] = ("num_trainer_nodes",)
    """The node counts that must be 1 with `type = "local"`."""

    @property
    def num_nodes(self) -> int:
        return 1 if self.type == "local" else self.num_trainer_nodes

    @property
    def total_trainer_ranks(self) -> int:
        return self.num_trainer_ranks * self.num_trainer_nodes

    @property
    def node_gpus(self) -> int:
        """GPUs one node of this deployment lists."""
        return len(self.trainer_gpus)

    def check_trainer_gpus(self) -> None:
        """On GPU nodes every rank needs its own listed GPU (a UserError naming the key otherwise)."""
        if len(self.trainer_gpus) < self.num_trainer_ranks:
            raise UserError(
                f"deployment.trainer_gpus: lists {len(self.trainer_gpus)} GPU(s) for {self.num_trainer_ranks} "
                "trainer rank(s) per node (deployment.num_trainer_ranks); list one per rank"
            )

    @model_validator(mode="after")
    def _check_local(self) -> "TrainerDeployment":
        if self.type == "local":
            for key in self.NODE_KEYS:
                if getattr(self, key) != 1:
                    raise ConfigProblem(key, 'more than one node needs type = "slurm" or "kubernetes"')
        return self


class DeploymentConfig(TrainerDeployment):
    """Where each process of `tidal rl` runs: which nodes, which devices. The same run config works under
    every `type`; only this table (and `[slurm]` / `[kubernetes]`) changes.

    Nodes are numbered inference nodes first, then trainer nodes: with `local` both roles share the one
    machine; on a cluster they are separate nodes."""

    num_inference_nodes: int = Field(default=1, gt=0)
    """Nodes running inference replicas (1 with `local`)."""
    orchestrator_node: Literal["trainer", "inference"] = "trainer"
    """The orchestrator runs on the first node of this role (it needs no GPU)."""
    num_replicas: int = Field(default=1, gt=0)
    """Inference replicas per inference node: separate vLLM servers, replica i on port
    inference.server.port + i. The orchestrator's client sends each request to the least-loaded one (every
    turn of an episode to the same one) and each weight update to all of them."""
    inference_gpus: list[int] = Field(default=[0], min_length=1)
    """GPU ids for inference on each inference node (ignored on CPU), split in order among its replicas:
    each gets inference.vllm.tensor_parallel_size × data_parallel_size of them. With `local` it may equal
    trainer_gpus to share one GPU."""
    inference_cpus: str | None = None
    """CPU cores for vLLM's threads on CPU runs, e.g. "0" or "0-3,6" (default: of the cores the run may use,
    its CPU affinity, the first when there are few, else the first half), split in order among the replicas
    (fewer cores than replicas: they share)."""

    NODE_KEYS: ClassVar[tuple[str, ...]] = ("num_inference_nodes", "num_trainer_nodes")

    @property
    def num_nodes(self) -> int:
        return 1 if self.type == "local" else self.num_inference_nodes + self.num_trainer_nodes

    @property
    def node_gpus(self) -> int:
        """GPUs one node lists: the larger of the inference and trainer lists (a node runs one role)."""
        return max(len(self.inference_gpus), len(self.trainer_gpus))

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


_SFT_KEYS = ", ".join(TrainerDeployment.model_fields)


class SFTDeploymentConfig(TrainerDeployment):
    """Where the ranks of `tidal sft` run. `local`: on this machine; with num_trainer_ranks > 1 `tidal sft`
    starts torchrun itself (under a torchrun you started, it trains as one of its ranks). `slurm`: a batch
    job of num_trainer_nodes nodes, torchrun on each, joined by a c10d rendezvous on the first. `kubernetes`:
    an Indexed Job of num_trainer_nodes pods, likewise. Only the trainer's keys: SFT runs no inference."""

    UNKNOWN_KEY_HINTS: ClassVar[dict[str, str]] = {
        key: f"`tidal sft` runs no inference or orchestrator; its [deployment] takes {_SFT_KEYS}"
        for key in DeploymentConfig.model_fields.keys() - TrainerDeployment.model_fields.keys()
    }


def check_table_used(config: Config, table: str, deployment_type: str) -> None:
    """A `[slurm]` / `[kubernetes]` table written for another deployment type would be ignored: refuse it."""
    if table in config.model_fields_set and deployment_type != table:
        raise ConfigProblem(
            table, f'[{table}] is only used with deployment.type = "{table}" (it is {deployment_type!r})'
        )


def usable_cores() -> list[int]:
    """The cores this process may run on (its CPU affinity: what Slurm, a container's cpuset or `taskset`
    gave it), in order; all of the machine's where the platform cannot say. Thread counts and vLLM's core
    binding start from these, not from os.cpu_count(): two runs side by side on their own cores would
    otherwise each take every core, and CPU training slows several-fold on oversubscribed cores."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


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


def share_cores(cores: list[int], count: int) -> list[str]:
    """`cores` split into `count` consecutive shares, in order, as VLLM_CPU_OMP_THREADS_BIND lists; with fewer
    cores than shares, each share gets one core, round robin."""
    if len(cores) < count:
        return [str(cores[i % len(cores)]) for i in range(count)]
    size, extra = divmod(len(cores), count)
    shares, start = [], 0
    for index in range(count):
        end = start + size + (1 if index < extra else 0)
        shares.append(format_cpu_list(cores[start:end]))
        start = end
    return shares


def format_cpu_list(cores: list[int]) -> str:
    """[0, 1, 2, 5] → "0-2,5"."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)

"""Schema of `[slurm]`: how `tidal rl` and `tidal sft` ask Slurm for the nodes of `[deployment]` (with
`type = "slurm"`)."""

from pydantic import Field, field_validator

from tidal.config.base import Config


class SlurmConfig(Config):
    """The batch job `tidal rl` renders into <output_dir>/slurm/ and submits with sbatch.

    The job asks for deployment.num_inference_nodes + num_trainer_nodes whole nodes, one task per node, and
    starts `tidal node` on each with one `srun`: every node learns its index from SLURM_NODEID and the
    others' addresses from the job's node list (`scontrol show node`: NodeAddr), then runs its roles. The
    output_dir must be on storage every node sees: weights, rollouts and checkpoints go through it. One
    node failing ends the job (srun --kill-on-bad-exit); a requeued job (node failure, preemption,
    `scontrol requeue`) resumes from the trainer's last checkpoint."""

    partition: str | None = None
    """`#SBATCH --partition` (default: the cluster's default partition)."""
    account: str | None = None
    """`#SBATCH --account` to charge the job to."""
    time: str | None = None
    """`#SBATCH --time` limit, e.g. "2-00:00:00" or "04:00:00" (default: the partition's)."""
    job_name: str = Field(default="tidal-rl", pattern=r"^[A-Za-z0-9._-]+$")
    """`#SBATCH --job-name`; also names the script (<output_dir>/slurm/<job_name>.sbatch) and its log
    (<output_dir>/slurm/<job_name>-<job id>.log, appended to by every restart of the job)."""
    gpus_per_node: int | None = Field(default=None, ge=0)
    """`#SBATCH --gpus-per-node`. Default: as many as the larger of deployment.inference_gpus and
    trainer_gpus lists (`tidal sft`: trainer_gpus); 0 asks for none (CPU nodes)."""
    exclusive: bool = True
    """`#SBATCH --exclusive`: whole nodes (every core and all memory go to this job's processes)."""
    requeue: bool = True
    """`#SBATCH --requeue`: Slurm may restart the job after a node failure or preemption; the restart
    resumes from the trainer's last checkpoint. False: `--no-requeue`."""
    extra_sbatch: list[str] = []
    """More batch options, one per item, e.g. ["--qos=high", "--mem=0"] (a leading `#SBATCH` is optional)."""
    setup: list[str] = []
    """Shell commands run on the batch node and on every node before tidal starts, in order, e.g.
    ["module load cuda/12.4", "source /shared/venv/bin/activate"]."""
    python: str | None = None
    """Python interpreter on the nodes that runs tidal (after `setup`). Default: the one rendering the job
    (the same path must exist on the nodes); "python" takes the first on PATH after `setup`."""
    srun_args: list[str] = []
    """More options for the one `srun` that starts the node agent (`tidal node`, `tidal sft-node`) on every
    node, e.g. ["--mpi=none"]."""

    @field_validator("extra_sbatch", "setup", "srun_args")
    @classmethod
    def _one_line_each(cls, items: list[str]) -> list[str]:
        for item in items:
            if "\n" in item or "\r" in item:
                raise ValueError(f"{item!r} spans several lines; give one item per line")
            if not item.strip():
                raise ValueError("an item is empty")
        return items

    @field_validator("extra_sbatch")
    @classmethod
    def _options(cls, items: list[str]) -> list[str]:
        options = []
        for item in items:
            option = item.strip().removeprefix("#SBATCH").strip()
            if not option.startswith("-"):
                raise ValueError(f"{item!r} is not an sbatch option like '--qos=high'")
            options.append(option)
        return options


class SFTSlurmConfig(SlurmConfig):
    """The batch job `tidal sft` renders into <output_dir>/slurm/ and submits with sbatch.

    The job asks for deployment.num_trainer_nodes whole nodes, one task per node, and starts
    `tidal sft-node` on each with one `srun`: every node learns its index from SLURM_NODEID and the first
    node's address from the job's node list (`scontrol show node`: NodeAddr), then runs torchrun with
    deployment.num_trainer_ranks ranks, joined by a c10d rendezvous on the first node. The output_dir must
    be on storage every node sees (checkpoints, metrics, final/). One node failing ends the job; a requeued
    job resumes from the last checkpoint."""

    job_name: str = Field(default="tidal-sft", pattern=r"^[A-Za-z0-9._-]+$")
    """`#SBATCH --job-name`; also names the script (<output_dir>/slurm/<job_name>.sbatch) and its log
    (<output_dir>/slurm/<job_name>-<job id>.log, appended to by every restart of the job)."""

"""Schema of `tidal sft`: supervised fine-tuning on chat conversations."""

from pathlib import Path

from pydantic import Field, model_validator

from tidal.config.base import Config, ConfigProblem
from tidal.config.common import (
    CheckpointConfig,
    DatasetConfig,
    ModelConfig,
    OptimConfig,
    SchedulerConfig,
    SFTLogConfig,
    TrainerRunConfig,
    WandbConfig,
)
from tidal.config.deployment import SFTDeploymentConfig, check_table_used
from tidal.config.kubernetes import SFTKubernetesConfig, check_pods
from tidal.config.lora import LoraConfig
from tidal.config.moe import MoEConfig
from tidal.config.perf import PerfConfig, check_cp, check_ep, check_fsdp
from tidal.config.slurm import SFTSlurmConfig
from tidal.types import PAD_MULTIPLE


class SFTDataConfig(Config):
    """Training data: which conversations, how many per step, how they are packed."""

    train: DatasetConfig
    """Training conversations (`type` = file | hf | builtin)."""
    batch_size: int = Field(default=64, gt=0)
    """Conversations per optimizer step, over all ranks."""
    seq_len: int = Field(default=2048, gt=1)
    """Length of a packed row in tokens; conversations are packed into rows without cross-attention."""
    micro_batch_size: int = Field(default=1, gt=0)
    """Packed rows per forward/backward pass on one rank (gradients accumulate over micro-batches)."""
    pad_multiple: int = Field(default=PAD_MULTIPLE, gt=0)
    """A micro-batch's rows are padded to its longest row rounded up to a multiple of this many tokens (at
    most seq_len), and a micro-batch has only the rows it needs, so compute follows the real tokens;
    seq_len: every row is seq_len wide (fixed shapes for compiled kernels, at the cost of computing the
    padding)."""
    shuffle: bool = True
    """Shuffle conversations each epoch (seeded)."""
    picture_workers: int | None = Field(default=None, ge=0)
    """Processes per rank that turn conversations with pictures into samples (the model's processor: decode,
    resize, tiles) while the step before trains; unset: one per spare CPU core of the rank, at most 8;
    0: in the training process, between steps. Only for data with pictures (an error otherwise)."""


class SFTEvalConfig(Config):
    """Held-out evaluation after training: greedy decoding, exact match of the last assistant message."""

    dataset: DatasetConfig | None = None
    """Held-out conversations; None skips evaluation."""
    num_examples: int = Field(default=200, gt=0)
    """Evaluate at most this many conversations."""
    max_new_tokens: int = Field(default=64, gt=0)
    """Generation budget per answer."""
    batch_size: int = Field(default=128, gt=0)
    """Conversations generated together."""


class SFTConfig(TrainerRunConfig):
    """`tidal sft`: fine-tune a causal LM on the assistant turns of chat conversations."""

    HELP_MAIN = (
        "output_dir",
        "max_steps",
        "seed",
        "resume",
        "device",
        "model.name",
        "data.train",
        "data.batch_size",
        "data.seq_len",
        "optim.lr",
        "scheduler",
        "lora.rank",
        "ckpt.interval",
        "deployment.type",
        "deployment.num_trainer_ranks",
        "wandb.enabled",
    )

    output_dir: Path = Path("outputs/sft")
    """Where metrics.jsonl, checkpoints/ and final/ (with LoRA also final_adapter/) are written."""
    model: ModelConfig = ModelConfig()
    data: SFTDataConfig
    optim: OptimConfig = OptimConfig()
    perf: PerfConfig = PerfConfig()
    moe: MoEConfig = MoEConfig()
    lora: LoraConfig = LoraConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    ckpt: CheckpointConfig = CheckpointConfig()
    eval: SFTEvalConfig = SFTEvalConfig()
    log: SFTLogConfig = SFTLogConfig()
    wandb: WandbConfig = WandbConfig()
    deployment: SFTDeploymentConfig = SFTDeploymentConfig()
    slurm: SFTSlurmConfig = SFTSlurmConfig()
    """The batch job of `deployment.type = "slurm"` (partition, account, time, setup commands, …)."""
    kubernetes: SFTKubernetesConfig = SFTKubernetesConfig()
    """Manifests of a Kubernetes run (deployment.type = "kubernetes" only)."""

    def cpu_threads(self) -> int | None:
        return self.num_threads or self.deployment.trainer_threads

    @model_validator(mode="after")
    def _check_deployment(self) -> "SFTConfig":
        check_table_used(self, "slurm", self.deployment.type)
        check_table_used(self, "kubernetes", self.deployment.type)
        if self.deployment.type == "kubernetes":
            check_kubernetes_run(self)
        if self.num_threads is not None and self.deployment.trainer_threads is not None:
            raise ConfigProblem(
                "deployment.trainer_threads", "sets what num_threads sets (threads per rank): set one of them"
            )
        return self

    @model_validator(mode="after")
    def _check_combinations(self) -> "SFTConfig":
        check_ep(self.perf, self.deployment.total_trainer_ranks)
        if self.moe.routing_replay or self.moe.replay_compare_interval is not None:
            raise ConfigProblem(
                "moe.routing_replay", "replays the experts inference routed RL rollouts to; SFT data has none"
            )
        check_cp(self.perf, self.deployment.total_trainer_ranks)
        check_fsdp(self.perf, self.deployment.total_trainer_ranks)
        if self.scheduler.warmup_steps > self.max_steps:
            raise ConfigProblem(
                "scheduler.warmup_steps",
                f"warmup ({self.scheduler.warmup_steps} steps) is longer than max_steps ({self.max_steps})",
                also=("max_steps",),
            )
        # an interval past max_steps is fine: the trainer also checkpoints the end of the run
        return self


def check_kubernetes_run(sft: SFTConfig) -> None:
    """Raise a ConfigProblem (key relative to the run config) for what a Kubernetes SFT run cannot do."""
    check_pods(sft.kubernetes, sft.output_dir, {"trainer_gpus": sft.deployment.trainer_gpus})

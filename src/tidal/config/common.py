"""Config nodes shared by several commands: model, datasets, optimizer, scheduler, logging, checkpoints."""

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from tidal.config.base import Config, ConfigProblem


class ModelConfig(Config):
    """Which model to load."""

    name: str = "tidal-testing/tiny-qwen3"
    """A Hugging Face hub id, a local directory in HF format, or `tidal-testing/tiny-qwen3` (built locally;
    `tidal-testing/tiny-qwen3-chat`: the same with a Qwen3-style chat template; `tidal-testing/tiny-qwen3-moe`:
    its mixture-of-experts variant)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """dtype inference serves (vLLM `--dtype`) and trainers publish weights in (`tidal sft`: final/); `auto`:
    the checkpoint's own for inference, fp32 for SFT's final/. The trainers' parameters are fp32 whatever
    this says (`perf.master_dtype`); their compute dtype is `perf.mixed_precision`."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel passed to transformers."""
    trust_remote_code: bool = False
    """Allow model code from the hub (only for models that need it)."""
    train_vision: bool = False
    """A vision-language model: train its vision tower too. By default it stays frozen (the language model
    and the connector train); a model without one refuses `true`."""

    def served_dtype(self, publish_dtype: str = "auto") -> str:
        """The one rule for the dtype weights are served and published in: an explicit publish dtype, else
        model.dtype; `auto` is the checkpoint's stored dtype (what vLLM serves under `--dtype auto`), which only
        the trainer, holding the checkpoint, resolves (tidal.trainer.model.served_dtype). Inference's `--dtype`
        is `served_dtype()`, `tidal rl` spells the trainer's publish dtype out with it (tidal.launcher.split)."""
        return publish_dtype if publish_dtype != "auto" else self.dtype


class FileDataset(Config):
    """A local JSONL or parquet file whose rows hold a `messages` list."""

    type: Literal["file"] = "file"
    path: Path
    """Path to a .jsonl or .parquet file."""
    messages_field: str = "messages"
    """Column that holds the chat messages."""
    num_examples: int | None = Field(default=None, gt=0)
    """Use only the first N rows."""


class HFDataset(Config):
    """A dataset from the Hugging Face hub (or its local cache) loaded with `datasets.load_dataset`."""

    type: Literal["hf"] = "hf"
    id: str
    """Dataset id, e.g. `HuggingFaceH4/ultrachat_200k`."""
    subset: str | None = None
    """Configuration name, if the dataset has several."""
    split: str = "train"
    """Split to load."""
    messages_field: str = "messages"
    """Column that holds the chat messages."""
    num_examples: int | None = Field(default=None, gt=0)
    """Use only the first N rows."""


class BuiltinDataset(Config):
    """Conversations generated deterministically from a built-in environment's own tasks: each task's prompt
    with every assistant turn right (`Environment.demonstration`; `tidal.envs.demonstrations`)."""

    type: Literal["builtin"] = "builtin"
    name: str = "reverse_text"
    """A built-in environment: reverse_text, alphabet_sort, math (its local generator: worked solutions, at
    its `level`), wordle (a fixed solver's games), tool_use (one tool call, its result, the answer), code
    (the reference solutions)."""
    split: Literal["train", "heldout"] = "train"
    """Which split, the environment's own `split`: the two never share a task (a text, the names to sort, a
    math question, a wordle word, a code task), and heldout is what `tidal rl` evaluates online."""
    num_examples: int | None = Field(default=None, gt=0)
    """Number of conversations, the split's first ones (fewer tasks than this: an error); None: every task
    of the split (the environment's `num_examples` of them; reverse_text: 10000)."""
    seed: int | None = None
    """Generator seed, the environment's `seed` argument (None: its default; reverse_text mixes in the
    split, so train and heldout differ)."""
    kwargs: dict[str, Any] = {}
    """Other arguments of the environment, as in `[[orchestrator.env]]`, e.g. {max_turns = 2}."""

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        from tidal.config.env_names import BUILTIN_ENVS  # imports no environment (nor torch)

        if name not in BUILTIN_ENVS:
            raise ValueError(
                f"unknown built-in dataset {name!r} (built-in: {', '.join(sorted(BUILTIN_ENVS))})"
            )
        return name


DatasetConfig = Annotated[FileDataset | HFDataset | BuiltinDataset, Field(discriminator="type")]


class OptimConfig(Config):
    """AdamW settings."""

    lr: float = Field(default=3e-4, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this value."""

    @model_validator(mode="after")
    def _check_betas(self) -> "OptimConfig":
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigProblem("betas", f"each beta must be in [0, 1), got {list(self.betas)}")
        return self


class SchedulerConfig(Config):
    """Learning-rate schedule: linear warmup, then constant, linear or cosine decay."""

    type: Literal["constant", "linear", "cosine"] = "cosine"
    """Shape after warmup."""
    warmup_steps: int = Field(default=0, ge=0)
    """Steps of linear warmup from 0 to the peak learning rate."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Final learning rate as a fraction of the peak (linear and cosine)."""


class CheckpointConfig(Config):
    """Full training-state checkpoints for `--resume`."""

    interval: int | None = Field(default=50, gt=0)
    """Save every N steps, so a run killed without warning (out of memory, a lost node) resumes from the last
    one; also when stopped by a signal (SIGTERM, SIGINT) and at the end (so `--resume` with a larger
    max_steps continues a finished run). None: only those two."""
    keep_last: int = Field(default=2, gt=0)
    """How many checkpoints to keep on disk."""


class WandbConfig(Config):
    """Weights & Biases logging."""

    enabled: bool = False
    """Log metrics to W&B as well as metrics.jsonl."""
    project: str = "tidal"
    """W&B project."""
    entity: str | None = None
    """W&B team or user that owns the project (default: your W&B default entity)."""
    name: str | None = None
    """Run name (default: the output directory's name)."""
    group: str | None = None
    """W&B group, to show related runs together (e.g. the runs of one sweep)."""
    tags: list[str] = []
    """W&B tags of the run."""
    mode: Literal["online", "offline"] = "offline"
    """`offline` writes under <output_dir>/wandb and needs no network; sync later with `wandb sync`."""

    @model_validator(mode="after")
    def _check_enabled(self) -> "WandbConfig":
        given = sorted(self.model_fields_set - {"enabled"})
        if given and "enabled" not in self.model_fields_set:
            # W&B settings without `enabled` would be ignored without a word
            raise ConfigProblem(
                "enabled", f"W&B settings are given ({', '.join(given)}) but W&B is off; set enabled = true"
            )
        return self


class LogConfig(Config):
    """What a process prints to its console (its log under `tidal rl`); metrics go to metrics.jsonl every step."""

    interval: int = Field(default=10, gt=0)
    """Print a one-line summary every N steps (and the first and last)."""

    def prints(self, step: int, max_steps: int) -> bool:
        """Whether step `step` (counted from 0) of a run of `max_steps` gets its summary line."""
        return step == 0 or (step + 1) % self.interval == 0 or step + 1 >= max_steps


class SFTLogConfig(LogConfig):
    """`tidal sft`'s console: step lines and, at a terminal, a progress bar."""

    progress_bar: bool = True
    """Show a progress bar when stderr is a terminal."""


class RunConfig(Config):
    """Keys every command that runs numbered steps shares (the RL processes get them from `tidal rl`)."""

    output_dir: Path = Path("outputs/run")
    """Run directory: metrics, checkpoints and exports are written below it."""
    max_steps: int = Field(default=100, gt=0)
    """Training steps (for the orchestrator: batches to produce)."""
    seed: int = 0
    """Seed for data order, sampling and anything else random."""
    resume: bool = False
    """Continue from the latest checkpoint in output_dir (a fresh start when there is none)."""


class TrainerRunConfig(RunConfig):
    """A run of a training process: where it computes and with how many CPU threads."""

    device: Literal["auto", "cpu", "cuda"] = "auto"
    """`auto` uses CUDA when available."""
    num_threads: int | None = Field(default=None, gt=0)
    """Torch CPU threads per process (default: CPU cores divided by local ranks)."""

    def cpu_threads(self) -> int | None:
        """Torch CPU threads each process of this run sets (None: CPU cores divided by local ranks)."""
        return self.num_threads

"""What the SFT and RL trainers share around their step: output-dir checks, resume, checkpoints, printing."""

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tidal import manifest
from tidal.config.rl import RLTrainerConfig
from tidal.config.sft import SFTConfig
from tidal.errors import UserError
from tidal.inference.tokenizer import load_tokenizer
from tidal.monitor.metrics import MetricsLogger
from tidal.run_layout import check_output_dir
from tidal.trainer import ckpt
from tidal.trainer.chunked import TokenScorer
from tidal.trainer.lora import apply_lora
from tidal.trainer.model import load_model, quiet_transformers
from tidal.trainer.optim import build_optimizer, build_scheduler, clip_and_step, resolve_state_dtype
from tidal.trainer.parallel import DistInfo, all_reduce_sum, parallelize, set_num_threads
from tidal.trainer.signals import StopSignal

Say = Callable[..., None]


@dataclass
class Trainer:
    """What a training process holds once set up: model (and its scorer), optimizer, schedule, sinks."""

    tokenizer: Any
    model: torch.nn.Module
    """The HF model (FSDP-sharded in place): what checkpoints and exports read."""
    scorer: TokenScorer
    """The model as trained: decoder + chunked head, returning target logprobs (and entropy)."""
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    logger: MetricsLogger | None
    """Rank 0's metrics sink; None on other ranks."""
    say: Say
    lora_modules: list[str]
    """Module paths that carry LoRA adapters (empty: full fine-tuning)."""


def open_trainer(
    config: SFTConfig | RLTrainerConfig,
    info: DistInfo,
    metrics_path: Path,
    ckpt_root: Path,
    before_gpu: Callable[[], None] | None = None,
    tokenizer: Any = None,
) -> Trainer:
    """Set up a trainer process the same way for SFT and RL: threads, seed, output-dir check, model → device
    → sharding, optimizer, schedule, metrics. Resuming is left to `maybe_resume` (it needs the data state).
    `before_gpu`: called once the model is loaded on the CPU, before it goes to the device. `tokenizer`: the
    model's, where the caller loaded it already (else loaded here)."""
    set_num_threads(config.cpu_threads(), info)
    quiet_transformers()
    torch.manual_seed(config.seed)
    check_output_dir(metrics_path, ckpt_root, config.resume)
    say = make_printer(info)
    if config.resume:  # before the model loads: a damaged checkpoint must not cost a minute of setup first
        verify_resume_checkpoint(ckpt_root, info, say)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
    model = load_model(config.model, config.perf.master_dtype)
    # before sharding: FSDP2 then groups each layer's frozen base and trainable adapters together
    lora_modules = apply_lora(model, config.lora)
    if before_gpu is not None:
        before_gpu()
    scorer = parallelize(model, info, config.perf, config.moe)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state_dtype = resolve_state_dtype(config.perf.optimizer_state, info.device, trainable)
    optimizer = build_optimizer(model, config.optim, state_dtype)
    scheduler = build_scheduler(optimizer, config.max_steps, config.scheduler)
    logger = None
    if info.is_main:
        logger = MetricsLogger(metrics_path, config.wandb, config.model_dump(mode="json"))
    if lora_modules:
        say(
            f"lora: rank {config.lora.rank} on {len(lora_modules)} modules, {trainable:,} trainable parameters"
        )
    return Trainer(tokenizer, model, scorer, optimizer, scheduler, logger, say, lora_modules)


@dataclass
class TrainState:
    """The objects a checkpoint covers, besides model and optimizer: the scheduler and the data position."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    data_state: Callable[[], dict[str, Any]]
    """Returns the data position to save (e.g. the sampler state); {} when the data comes from elsewhere."""


def verify_resume_checkpoint(ckpt_root: Path, info: DistInfo, say: Say) -> None:
    """Rank 0 checks the checkpoint a resume will use, every byte against its manifest, and moves newer
    damaged ones aside (one line each, see manifest.resume_checkpoint); the other ranks then pick the same.
    A UserError on every rank when checkpoints exist and none is usable."""
    error = None
    if info.is_main:
        try:
            manifest.resume_checkpoint(ckpt_root, say)
        except UserError as found:
            error = found
    if any_rank(error is not None, info):  # also the barrier before the other ranks look
        raise error or UserError(f"--resume: no usable checkpoint in {ckpt_root} (see rank 0)")


def make_printer(info: DistInfo) -> Say:
    """Print on rank 0 only, through the progress bar when one is shown."""

    def say(message: str, bar: Any = None) -> None:
        if not info.is_main:
            return
        if bar is not None and not bar.disable:
            bar.write(message)
        else:
            print(message, flush=True)

    return say


def maybe_resume(
    ckpt_root: Path,
    state: TrainState,
    info: DistInfo,
    logger: MetricsLogger | None,
    say: Say,
    resume: bool,
    *,
    first_record_step: int,
) -> tuple[int, dict[str, Any]]:
    """Restore the latest checkpoint when asked to; returns (completed steps, saved data state).
    `verify_resume_checkpoint` ran first, so the newest complete checkpoint is one whose files all match.

    The metrics records of the steps the run will redo are dropped: after n completed steps the records
    kept are the first n, numbered from `first_record_step` (SFT numbers a record by the steps completed
    with it, 1-based; RL by the index of the step, 0-based, as the orchestrator does).
    """
    if not resume:
        return 0, {}
    latest = ckpt.latest_checkpoint(ckpt_root)
    if latest is None:
        say(f"--resume: no checkpoint in {ckpt_root}, starting from step 0")
        return 0, {}
    saved = ckpt.load_checkpoint(latest, state.model, state.optimizer, info)
    state.scheduler.load_state_dict(saved["scheduler"])
    step = int(saved["step"])
    if logger:
        logger.truncate_after(first_record_step + step - 1)
    say(f"resumed from {latest} at step {step}")
    return step, saved.get("data", {})


def end_of_step(
    step: int,
    state: TrainState,
    ckpt_root: Path,
    interval: int | None,
    keep_last: int,
    stop: StopSignal,
    info: DistInfo,
    say: Say,
    bar: Any = None,
) -> bool:
    """Checkpoint when due or when a stop signal arrived on any rank; returns True if the loop must stop."""
    stopping = any_rank(stop.received is not None, info)
    if stopping or (interval and step % interval == 0):
        save(step, state, ckpt_root, keep_last, info, say, bar)
    if stopping:
        say(f"stopped by signal {stop.received} after step {step}; continue with --resume", bar)
    return stopping


def any_rank(flag: bool, info: DistInfo) -> bool:
    """Whether `flag` is true on at least one rank (a collective: every rank must call it)."""
    return all_reduce_sum(float(flag), info) > 0


def save(
    step: int, state: TrainState, ckpt_root: Path, keep_last: int, info: DistInfo, say: Say, bar: Any = None
) -> None:
    extra = {"scheduler": state.scheduler.state_dict(), "data": state.data_state()}
    path = ckpt.save_checkpoint(ckpt_root, step, state.model, state.optimizer, extra, info, keep_last)
    say(f"checkpoint saved: {path}", bar)


def save_unless_saved(
    step: int, state: TrainState, ckpt_root: Path, keep_last: int, info: DistInfo, say: Say
) -> None:
    """Checkpoint `step` completed steps on a stop between steps (a preemption's SIGTERM must never lose
    finished steps), unless that checkpoint exists already (the interval or the resume it started from)."""
    latest = ckpt.latest_checkpoint(ckpt_root)
    if step > 0 and (latest is None or latest.name != f"step_{step}"):
        save(step, state, ckpt_root, keep_last, info, say)


# what to change when a step does not fit, cheapest first (each trades speed or batch size for memory)
OOM_HINT = (
    "lower the tokens per micro-batch (orchestrator.batch.seq_len / micro_batch_size for RL, data.seq_len / "
    "data.micro_batch_size for SFT), or save memory with perf.activation_checkpointing = 'attention' or 'full', "
    "perf.optimizer_state = 'bf16', more GPUs (FSDP2 shards weights, gradients and optimizer state), "
    "lora.rank, or perf.cpu_offload = true"
)


@contextlib.contextmanager
def out_of_memory_as_user_error(step: int, info: DistInfo) -> Iterator[None]:
    """Turn a GPU out-of-memory in training step `step` into a one-line error with what to change.

    Checkpoints already written stay; `--resume` continues from the last one once the config fits.
    """
    try:
        yield
    except torch.OutOfMemoryError:
        where = f"step {step} on rank {info.rank}"
        if info.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(info.device) / 2**30
            total = torch.cuda.get_device_properties(info.device).total_memory / 2**30
            where += f" ({peak:.1f} GiB peak of {total:.1f} GiB)"
        raise UserError(f"GPU out of memory in training {where}: {OOM_HINT}") from None


def optimizer_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float,
) -> tuple[float, float]:
    """Clip the global gradient norm, step optimizer and schedule, clear gradients; returns (norm, lr used)."""
    lr = float(optimizer.param_groups[0]["lr"])
    grad_norm = clip_and_step(optimizer, model.parameters(), max_grad_norm)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # read the norm only now: reading it before the step would idle the GPU while the step's kernels launch
    return float(grad_norm), lr

"""`tidal sft`: supervised fine-tuning, readable top to bottom.

setup -> (resume) -> for each step: sample batch -> pack -> forward/backward per micro-batch -> clip -> step
      -> log -> (checkpoint) -> export final/ -> greedy held-out eval

With `lora`, only the adapters train; `final/` is then the merged model (a plain HF checkpoint, what
`tidal rl --model.name` and `tidal eval` load) and `final_adapter/` the adapter alone in PEFT format.
"""

import sys
import time
from concurrent.futures import Future
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tidal import run_layout
from tidal.config.sft import SFTConfig
from tidal.envs.chat import IMAGE_PART_TYPES, message_images
from tidal.errors import UserError
from tidal.inference.tokenizer import load_tokenizer
from tidal.models.vision import PictureInputs, setup_pictures, training_problem
from tidal.monitor.metrics import MetricsLogger
from tidal.trainer.chunked import TokenScorer
from tidal.trainer.data import (
    IGNORE_INDEX,
    EpochSampler,
    PackedRow,
    TokenizedSample,
    collate,
    collate_pictures,
    pack_samples,
    pad_rows,
    shard_rows,
)
from tidal.trainer.evaluate import greedy_exact_match
from tidal.trainer.export import export_model
from tidal.trainer.lora import export_adapter, export_merged, peft_config
from tidal.trainer.model import export_dtype
from tidal.trainer.parallel import (
    DistInfo,
    all_reduce_sum,
    all_reduce_tensor,
    compute_mode,
    init_distributed,
    micro_batches,
    shutdown,
)
from tidal.trainer.sample_pool import SamplePool, auto_workers, prepare_sample
from tidal.trainer.session import (
    TrainState,
    end_of_step,
    maybe_resume,
    open_trainer,
    optimizer_step,
    out_of_memory_as_user_error,
    save_unless_saved,
)
from tidal.trainer.signals import StopSignal
from tidal.trainer.sources import Conversation, load_conversations


@dataclass
class StepBatch:
    """One optimizer step's data for this rank, plus global counts used for normalisation and throughput."""

    micro_batches: list[list[PackedRow]]
    num_loss_tokens: int  # over all ranks: the loss is a mean over these
    num_tokens: int  # non-padding tokens over all ranks
    num_truncated: int
    num_real_tokens: int = 0  # tokens of the packed rows over all ranks, padding excluded (after truncation)


class SFTData:
    """Sampler + lazily tokenised conversations -> packed, rank-sharded batches. State: the sampler position
    of the batches handed out.

    Conversations with pictures are prepared by a `SamplePool` when one is given: the next step's samples
    are submitted as soon as this step's are handed out, so the workers prepare them while this step trains.
    Text samples are kept once tokenised; samples with pictures are not (tens of MB each), they are prepared
    again in a later epoch."""

    def __init__(
        self,
        config: SFTConfig,
        conversations: list[Conversation],
        tokenizer: Any,
        info: DistInfo,
        pictures: PictureInputs | None = None,
        pool: SamplePool | None = None,
    ):
        self.config = config
        self.conversations = conversations
        self.tokenizer = tokenizer
        self.info = info
        self.pictures = pictures
        """The model's processor, where conversations carry pictures (`setup_sft_pictures`)."""
        self.pool = pool
        self.sampler = EpochSampler(len(conversations), config.seed, config.data.shuffle)
        self.position = 0
        """Samples handed out (the sampler runs a step ahead with a pool)."""
        self._cache: dict[int, TokenizedSample] = {}
        self._ahead: tuple[list[int], list[Future[TokenizedSample] | None]] | None = None

    @property
    def epoch(self) -> float:
        return self.position / len(self.conversations)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.sampler.load_state_dict(state)
        self.position, self._ahead = self.sampler.position, None

    def _start(self, indices: list[int]) -> tuple[list[int], list[Future[TokenizedSample] | None]]:
        """Submit what is neither kept nor text-only to the pool (None: prepared here, when needed)."""
        pending: list[Future[TokenizedSample] | None] = []
        for index in indices:
            if self.pool is None or index in self._cache:
                pending.append(None)
                continue
            images = self._images(index)
            if not images:
                pending.append(None)
            else:
                pending.append(self.pool.submit(self.conversations[index], images))
        return indices, pending

    def _images(self, index: int) -> list[str]:
        """The conversation's pictures (checked: a UserError naming the conversation for a broken one)."""
        try:
            return message_images(self.conversations[index])
        except ValueError as exc:
            raise UserError(f"data.train: conversation {index}: {exc}") from None

    def _finish(self, index: int, pending: Future[TokenizedSample] | None) -> TokenizedSample:
        if index in self._cache:
            return self._cache[index]
        conversation = self.conversations[index]
        try:
            if pending is not None:
                sample = pending.result()
            else:
                sample = prepare_sample(self.tokenizer, self.pictures, conversation, self._images(index))
        except ValueError as exc:
            raise UserError(f"data.train: conversation {index}: {exc}") from None
        except BrokenProcessPool as exc:  # a worker killed (out of memory, a signal)
            raise UserError(f"data.picture_workers: a worker process died ({exc}); try fewer or 0") from None
        if sample.pictures is None:
            self._cache[index] = sample
        return sample

    def next_batch(self) -> StepBatch:
        data = self.config.data
        indices, pending = self._ahead or self._start(self.sampler.next_indices(data.batch_size))
        self.position = self.sampler.position
        # the next step's samples go to the workers now, to be ready when this step has trained
        self._ahead = self._start(self.sampler.next_indices(data.batch_size)) if self.pool else None
        samples = [self._finish(i, p) for i, p in zip(indices, pending, strict=True)]
        rows, num_truncated = pack_samples(samples, data.seq_len)
        # the ranks of a context-parallel group train the same rows (each a chunk of their sequence)
        micro = shard_rows(rows, self.info.dp_rank, self.info.dp_size, data.micro_batch_size)
        pad_id = self.tokenizer.pad_token_id
        return StepBatch(
            micro_batches=[pad_rows(m, data.seq_len, pad_id, data.pad_multiple) for m in micro],
            num_loss_tokens=sum(r.num_loss_tokens for r in rows),
            num_tokens=sum(len(s.input_ids) for s in samples),
            num_truncated=num_truncated,
            num_real_tokens=sum(r.num_real_tokens for r in rows),
        )


def main(config: SFTConfig) -> int:
    info = init_distributed(config.device, config.perf.cp)
    try:
        return train(config, info)
    finally:
        shutdown(info)


def train(config: SFTConfig, info: DistInfo) -> int:
    out = config.output_dir
    conversations = load_conversations(config.data.train)  # before the model: bad data fails fast
    pictures = setup_sft_pictures(config, conversations)
    # the picture workers start before the model loads, so that their start overlaps it
    tokenizer = load_tokenizer(config.model) if pictures is not None else None
    pool = setup_sample_pool(config, info, tokenizer, pictures)
    try:
        metrics, checkpoints = run_layout.sft_metrics_path(out), run_layout.trainer_checkpoints_dir(out)
        t = open_trainer(config, info, metrics, checkpoints, tokenizer=tokenizer)
        data = SFTData(config, conversations, t.tokenizer, info, pictures, pool)
        return _train(config, info, t, data)
    finally:
        if pool is not None:
            pool.close()


def _train(config: SFTConfig, info: DistInfo, t: Any, data: SFTData) -> int:
    out = config.output_dir
    ckpt_root = run_layout.trainer_checkpoints_dir(out)
    model, optimizer, scheduler = t.model, t.optimizer, t.scheduler
    scorer, logger, say = t.scorer, t.logger, t.say
    tokenizer = t.tokenizer
    state = TrainState(model, optimizer, scheduler, data.state_dict)
    # SFT records carry the number of steps completed with them: 1, 2, ...
    step, data_state = maybe_resume(ckpt_root, state, info, logger, say, config.resume, first_record_step=1)
    if data_state:
        data.load_state_dict(data_state)

    say(
        f"sft: {len(data.conversations)} conversations, {config.max_steps} steps, {info.world_size} rank(s) on "
        f"{info.device} ({compute_mode(scorer)})"
    )
    stop = StopSignal().install()
    show_bar = info.is_main and config.log.progress_bar and sys.stderr.isatty()
    bar = tqdm(total=config.max_steps, initial=step, disable=not show_bar)
    while step < config.max_steps:
        waited = time.perf_counter()
        batch = data.next_batch()
        waited = time.perf_counter() - waited  # preparing (or waiting for) this step's samples
        with out_of_memory_as_user_error(step + 1, info):  # SFT numbers steps from 1
            metrics = train_step(scorer, optimizer, scheduler, batch, info, config.optim.max_grad_norm)
        step += 1
        metrics["epoch"] = data.epoch
        metrics["time/data"] = waited
        bar.update(1)
        if logger:
            logger.log(step, metrics)
        if step % config.log.interval == 0 or step == config.max_steps:
            say(_summary(step, config.max_steps, metrics), bar)
        if end_of_step(
            step, state, ckpt_root, config.ckpt.interval, config.ckpt.keep_last, stop, info, say, bar
        ):
            return stop.exit_code
    bar.close()
    # the end is checkpointed too, so `--resume --max-steps <more>` continues a finished run
    save_unless_saved(step, state, ckpt_root, config.ckpt.keep_last, info, say)

    final = _export_final(config, out, model, tokenizer, t.lora_modules, info, say)
    if info.is_main and config.eval.dataset is not None:
        _evaluate(config, final, info, logger, step, say)
    if logger:
        logger.close()
    return 0


def setup_sample_pool(
    config: SFTConfig, info: DistInfo, tokenizer: Any, pictures: PictureInputs | None
) -> SamplePool | None:
    """The workers that prepare conversations with pictures (`data.picture_workers`); None for text data
    or 0 workers. A UserError when workers are asked for text data."""
    workers = config.data.picture_workers
    if pictures is None:
        if workers:
            raise UserError(
                f"data.picture_workers = {workers}: data.train has no pictures (leave it unset for text data)"
            )
        return None
    workers = auto_workers(info.local_world_size) if workers is None else workers
    return SamplePool(workers, tokenizer, pictures) if workers else None


def setup_sft_pictures(config: SFTConfig, conversations: list[Conversation]) -> PictureInputs | None:
    """The model's processor when a conversation carries pictures (a UserError naming the first such
    conversation where the model cannot train on them); None for text data."""
    with_pictures = next((i for i, c in enumerate(conversations) if _has_pictures(c)), None)
    if with_pictures is None:
        return None
    problem = training_problem(config.model.name)
    if problem is not None:
        raise UserError(f"data.train: conversation {with_pictures} has pictures, but {problem}")
    return setup_pictures(config.model.name, config.model.trust_remote_code)


def _has_pictures(conversation: Conversation) -> bool:
    return any(
        isinstance(m.get("content"), list) and any(p.get("type") in IMAGE_PART_TYPES for p in m["content"])
        for m in conversation
    )


def train_step(
    scorer: TokenScorer,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: StepBatch,
    info: DistInfo,
    max_grad_norm: float,
) -> dict[str, float]:
    """Mean token cross-entropy over the whole global batch, accumulated over micro-batches (plus, for an MoE
    model, the load-balancing loss: tidal.trainer.moe)."""
    start = time.perf_counter()
    scorer.train()
    # FSDP averages gradients over ranks; scaling by world_size turns that average into a global token mean
    # (with context parallelism too: each rank's backward carries only its chunk of its group's rows).
    scale = info.world_size / max(1, batch.num_loss_tokens)
    if scorer.moe is not None:  # every rank packed the whole batch: the global count is known here
        scorer.moe.start_step(batch.num_real_tokens, gradient_scale=info.world_size)
    nll_sums = []
    for rows in micro_batches(scorer, batch.micro_batches):
        inputs = {k: v.to(info.device) for k, v in collate(rows).items()}
        labels = inputs["labels"]  # [b, s]
        logprobs, _ = scorer(
            inputs["input_ids"], inputs["position_ids"], labels, token_mask=inputs["token_mask"],
            pictures=collate_pictures(rows, info.device),
        )  # fmt: skip  # [b, s]
        nll = -torch.where(labels != IGNORE_INDEX, logprobs, 0.0).sum()
        loss = nll * scale
        if scorer.moe is not None:
            loss = loss + scorer.moe.aux_loss()
        loss.backward()
        nll_sums.append(nll.detach())
    grad_norm, lr = optimizer_step(scorer, optimizer, scheduler, max_grad_norm)
    moe_metrics = {}
    if scorer.moe is not None:
        moe_metrics = scorer.moe.step_metrics(lambda t: all_reduce_tensor(t, info))
    # read the loss only after the optimizer step is queued: a read before it would idle the GPU meanwhile
    loss_sum = float(torch.stack(nll_sums).sum()) if nll_sums else 0.0
    elapsed = time.perf_counter() - start
    return {
        # every rank of a cp group holds its rows' whole loss: count it once per group
        "loss": all_reduce_sum(loss_sum, info) / info.cp / max(1, batch.num_loss_tokens),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": batch.num_tokens / elapsed,
        "num_tokens": batch.num_tokens,
        "num_loss_tokens": batch.num_loss_tokens,
        "num_truncated": batch.num_truncated,
        "time/step": elapsed,
        **moe_metrics,
    }


def _export_final(
    config: SFTConfig,
    out: Path,
    model: torch.nn.Module,
    tokenizer: Any,
    lora_modules: list[str],
    info: DistInfo,
    say: Any,
) -> Path:
    """`final/` as a plain HF model; with LoRA the adapters merged into it, and alone in `final_adapter/`."""
    dtype = export_dtype(config.model)  # model.dtype when set; the masters themselves are fp32
    if not lora_modules:
        final = export_model(out / "final", model, tokenizer, info, dtype)
        say(f"final model exported to {final}")
        return final
    adapter = export_adapter(
        out / "final_adapter", model, peft_config(config.lora, lora_modules, config.model.name), info
    )
    final = export_merged(out / "final", model, tokenizer, info, dtype)
    say(f"final LoRA adapter exported to {adapter}, merged model to {final}")
    return final


def _evaluate(
    config: SFTConfig, final: Path, info: DistInfo, logger: MetricsLogger | None, step: int, say: Any
) -> None:
    assert config.eval.dataset is not None
    conversations = load_conversations(config.eval.dataset)[: config.eval.num_examples]
    result = greedy_exact_match(
        final, conversations, config.eval.max_new_tokens, config.eval.batch_size, info.device
    )
    for prompt, reference, answer in result.examples[:3]:
        say(f"  eval example: {prompt!r} -> {answer!r} (reference {reference!r})")
    say(f"eval/exact_match = {result.exact_match:.3f} on {result.num_examples} held-out conversations")
    if logger:
        logger.log(step, {"eval/exact_match": result.exact_match, "eval/num_examples": result.num_examples})


def _summary(step: int, max_steps: int, m: dict[str, float]) -> str:
    return (
        f"step {step}/{max_steps} | loss {m['loss']:.4f} | lr {m['lr']:.2e} | grad_norm {m['grad_norm']:.3f}"
        f" | tok/s {m['tokens_per_s'] / 1e3:.1f}k"
    )

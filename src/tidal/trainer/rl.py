"""`tidal trainer`: the RL trainer. One optimizer step per batch from the orchestrator, then publish weights.

    wait for batch n → per micro-batch: forward → logprobs / T → loss vs inference logprobs → backward
    → clip → step → publish weights step_{n+1} (policy version n+1) → log → (checkpoint)

Weights go out through `trainer.publish` (tidal.trainer.publish: files under weights/, or an NCCL broadcast).
With `lora`, only the adapters train and step_{n+1} is a PEFT adapter directory, not the full weights.

Batch n is trained by the policy of version n; the weights it produces are version n + 1. SIGTERM/SIGINT
(Ctrl-C, a Slurm preemption) stops between steps, or while waiting for a batch, with a checkpoint of the
last completed step. Metrics are over all ranks' micro-batches, not rank 0's.
"""

import functools
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tidal import run_layout
from tidal.config.rl import RLTrainerConfig
from tidal.errors import UserError
from tidal.trainer.chunked import TokenScorer
from tidal.trainer.lora import peft_config
from tidal.trainer.loss import merge_loss_metrics, rl_loss
from tidal.trainer.model import served_dtype
from tidal.trainer.moe import Routes
from tidal.trainer.parallel import (
    DistInfo,
    all_gather_floats,
    all_reduce_sum,
    all_reduce_tensor,
    compute_mode,
    join_distributed,
    micro_batches,
    plan_distributed,
    shutdown,
)
from tidal.trainer.publish import setup_publisher
from tidal.trainer.session import (
    TrainState,
    any_rank,
    end_of_step,
    maybe_resume,
    open_trainer,
    optimizer_step,
    out_of_memory_as_user_error,
    save_unless_saved,
)
from tidal.trainer.signals import StopSignal
from tidal.transport.rollouts import BatchReceiver, setup_receiver
from tidal.types import MicroBatch, TrainBatch


def main(config: RLTrainerConfig) -> int:
    gate = os.environ.get(run_layout.TRAINER_GATE_ENV)
    info = plan_distributed(config.device, config.perf.cp)
    through_gate = functools.partial(_through_gate, gate, info)
    before_gpu = None
    if gate and info.world_size == 1:
        # one rank needs no process group to load: tokenizer and model load on the CPU while vLLM starts,
        # and the GPU is touched only past the gate
        before_gpu = through_gate
    else:
        # several ranks agree on the checkpoint to resume from before loading: through the gate first
        through_gate()
    try:
        return train(config, info, before_gpu)
    finally:
        shutdown(info)


def _through_gate(gate: str | None, info: DistInfo) -> None:
    wait_for_gate(gate)
    join_distributed(info)


def wait_for_gate(gate: str | None, poll_s: float = 0.1) -> float:
    """Before the first CUDA call: with a gate (`tidal rl` started this trainer while vLLM loads on its GPU),
    wait until the file exists; the seconds waited. Imports and the process's own start-up are done by then."""
    if not gate:
        return 0.0
    start = time.perf_counter()
    path = Path(gate)
    while not path.exists():
        time.sleep(poll_s)
    waited = time.perf_counter() - start
    print(f"trainer: waited {waited:.1f} s for vLLM to load on this GPU", flush=True)
    return waited


def train(config: RLTrainerConfig, info: DistInfo, before_gpu: Callable[[], None] | None = None) -> int:
    """`before_gpu`: run once the model is loaded on the CPU, before anything reaches the GPU (the gate)."""
    out = config.output_dir
    ckpt_root = run_layout.trainer_checkpoints_dir(out)
    t = open_trainer(config, info, run_layout.trainer_dir(out) / "metrics.jsonl", ckpt_root, before_gpu)
    model, optimizer, scheduler = t.model, t.optimizer, t.scheduler
    scorer, logger, say = t.scorer, t.logger, t.say
    state = TrainState(model, optimizer, scheduler, dict)
    # records carry the index of their step (0-based), as the orchestrator's do
    step, _ = maybe_resume(ckpt_root, state, info, logger, say, config.resume, first_record_step=0)
    adapter_config = None
    if t.lora_modules:  # publish adapters only; inference serves the base model plus the adapter
        adapter_config = peft_config(config.lora, t.lora_modules, config.model.name)
    dtype = served_dtype(config.model, config.publish.dtype)
    publisher = setup_publisher(config.publish, out, dtype, adapter_config, info)
    if step > 0:
        publisher.restore(step, model, t.tokenizer, info)  # inference must restart from this policy
    receiver = setup_receiver(config.transport, out, info.rank)
    stop = StopSignal().install()
    say(
        f"trainer: {config.max_steps} steps from step {step}, {info.world_size} rank(s) on {info.device} "
        f"({compute_mode(scorer)})"
    )
    try:
        while step < config.max_steps:
            wait_start = time.perf_counter()
            batch = next_batch(receiver, step, stop, info)
            if batch is None:
                save_unless_saved(step, state, ckpt_root, config.ckpt.keep_last, info, say)
                say(
                    f"stopped by signal {stop.received} while waiting for batch {step}; continue with --resume"
                )
                return stop.exit_code
            waited = time.perf_counter() - wait_start
            with out_of_memory_as_user_error(step, info):
                metrics = rl_step(scorer, optimizer, scheduler, batch, info, config)
            publish_start = time.perf_counter()
            publisher.publish(step + 1, model, t.tokenizer, info)
            metrics["time/publish"] = time.perf_counter() - publish_start
            metrics["time/wait_for_data"] = waited
            metrics["time/step"] = time.perf_counter() - wait_start
            if logger:
                logger.log(step, metrics)
            if config.log.prints(step, config.max_steps):
                say(_summary(step, metrics))
            step += 1
            if end_of_step(
                step, state, ckpt_root, config.ckpt.interval, config.ckpt.keep_last, stop, info, say
            ):
                return stop.exit_code
        # the end is checkpointed too, so `--resume --max-steps <more>` continues a finished run
        save_unless_saved(step, state, ckpt_root, config.ckpt.keep_last, info, say)
    finally:
        receiver.close()
        publisher.close()
        if logger:
            logger.close()
    return 0


def next_batch(receiver: BatchReceiver, step: int, stop: StopSignal, info: DistInfo) -> TrainBatch | None:
    """This rank's batch for `step`; None on every rank once any rank stopped waiting on a signal (a batch
    another rank already got is then left untrained: the resumed run redoes its step)."""
    batch = receiver.receive(step, should_stop=lambda: stop.received is not None)
    if batch is not None:  # before any collective: a rank the orchestrator made no batch for never gets one
        check_world_size(batch, info)
    return None if any_rank(batch is None, info) else batch


def rl_step(
    scorer: TokenScorer,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    batch: TrainBatch,
    info: DistInfo,
    config: RLTrainerConfig,
) -> dict[str, Any]:
    """One optimizer step on this rank's micro-batches; the loss is normalised by global counts."""
    start = time.perf_counter()
    scorer.train()
    # real (non-padding) tokens per micro-batch, from host data: no device sync
    num_tokens = [sum(i >= 0 for row in micro.sample_ids for i in row) for micro in batch.micro_batches]
    if scorer.moe is not None:  # the load-balancing loss weighs each micro-batch by its share of all tokens
        # the ranks of a cp group hold the same rows: count them once
        num_tokens_global = all_reduce_sum(sum(num_tokens), info) / info.cp
        scorer.moe.start_step(num_tokens_global, gradient_scale=info.world_size)
    routes_of = replay_routes(config, scorer)
    compare = compares_replay(config, batch.step)
    losses, parts, own_kl = forward_backward(scorer, batch, info, config, routes_of, compare)
    grad_norm, lr = optimizer_step(scorer, optimizer, scheduler, config.optim.max_grad_norm)
    moe_metrics = {}
    if scorer.moe is not None:
        moe_metrics = scorer.moe.step_metrics(lambda t: all_reduce_tensor(t, info))
    # read the loss only after the optimizer step is queued: a read before it would idle the GPU meanwhile
    loss_sum = float(torch.stack(losses).sum()) if losses else 0.0
    local = {
        **merge_loss_metrics(parts), "loss": loss_sum, "tokens": float(sum(num_tokens)),
        "elapsed": time.perf_counter() - start,
    }  # fmt: skip
    m = across_ranks(local, lambda values: all_gather_floats(values, info)[:: info.cp])
    if compare:
        moe_metrics |= without_replay_metrics(own_kl, info)
    return step_record(m, grad_norm, lr, info, moe_metrics)


def forward_backward(
    scorer: TokenScorer,
    batch: TrainBatch,
    info: DistInfo,
    config: RLTrainerConfig,
    routes_of: Callable[[MicroBatch, torch.device], Routes | None],
    compare: bool,
) -> tuple[list[torch.Tensor], list[dict[str, Any]], list[tuple[float, float]]]:
    """Forward and backward of every micro-batch, gradients accumulating: each one's loss (on the device,
    not read here), its loss metrics, and with `compare` its (KL sum, tokens) under the trainer's own routing."""
    losses, parts = [], []
    own_kl: list[tuple[float, float]] = []
    for micro in micro_batches(scorer, batch.micro_batches):
        t = micro.to_tensors(info.device)
        routes = routes_of(micro, info.device)
        if (
            compare
        ):  # on every rank and micro-batch alike: FSDP's and expert parallelism's collectives pair up
            own_kl.append(own_routing_kl(scorer, t, batch, config))
        # logprobs / T of the targets and the entropy [rows, seq], straight from hidden states (chunked head)
        logprobs, entropy = scorer(
            t["input_ids"], t["position_ids"], t["target_ids"], config.temperature, with_entropy=True,
            token_mask=t["sample_ids"] >= 0, routes=routes, pictures=micro.picture_tensors(info.device, once=True),
        )  # fmt: skip
        loss, metrics = rl_loss(
            logprobs, t["inference_logprobs"], t["advantages"], t["loss_mask"], t["sample_ids"], config.loss,
            batch.num_loss_tokens_global, batch.num_samples_global, entropy,
        )  # fmt: skip
        # FSDP averages gradients over ranks; the loss is already a global mean, so undo the average. With
        # context parallelism every rank of a cp group computes its rows' loss, and each rank's backward
        # carries only its chunk of the sequence (tidal.trainer.context_parallel): the same factor holds.
        backward = loss * info.world_size
        if scorer.moe is not None:
            backward = backward + scorer.moe.aux_loss()
        backward.backward()
        losses.append(loss.detach())
        parts.append(metrics)
    return losses, parts, own_kl


def step_record(
    m: dict[str, float], grad_norm: float, lr: float, info: DistInfo, moe_metrics: dict[str, float]
) -> dict[str, Any]:
    """The step's record from the metrics reduced over ranks (`m`), the optimizer's, memory and MoE ones."""
    return {
        "loss": m["loss"],
        "mismatch_kl/mean": m["mismatch_kl"],
        "masked_fraction": m["masked_fraction"],
        "ratio/mean": m["ratio_mean"],
        "ratio/max": m["ratio_max"],
        "entropy/mean": m.get("entropy", 0.0),
        "nonfinite_tokens": m["num_nonfinite"],
        "grad_norm": grad_norm,  # already global: the norm reduces over the shards
        "lr": lr,
        "tokens_per_s": m["tokens"] / m["elapsed"],
        "time/forward_backward": m["elapsed"],
        **peak_memory(info),
        **moe_metrics,
    }


def replay_routes(
    config: RLTrainerConfig, scorer: TokenScorer
) -> Callable[[MicroBatch, torch.device], Routes | None]:
    """How to get a micro-batch's routes for the forward: inference's (routing replay), else none. Replay
    on a model tidal runs no MoE layers of is refused where the layers are applied (tidal.trainer.moe)."""
    if not config.moe.routing_replay or scorer.moe is None:
        return lambda micro, device: None

    def routes(micro: MicroBatch, device: torch.device) -> Routes | None:
        found = micro.routes_tensors(device)
        return None if found is None else Routes(*found)

    return routes


def compares_replay(config: RLTrainerConfig, step: int) -> bool:
    """Whether this step also scores with the trainer's own routing (`moe.replay_compare_interval`)."""
    interval = config.moe.replay_compare_interval
    return config.moe.routing_replay and interval is not None and step % interval == 0


def own_routing_kl(
    scorer: TokenScorer, t: dict[str, torch.Tensor], batch: TrainBatch, config: RLTrainerConfig
) -> tuple[float, float]:
    """(mismatch KL × valid tokens, valid tokens) of one micro-batch scored with the trainer's own routing,
    without gradients: the mismatch routing replay removes, measured on the same weights and tokens."""
    with torch.no_grad():
        logprobs, _ = scorer(
            t["input_ids"], t["position_ids"], t["target_ids"], config.temperature,
            token_mask=t["sample_ids"] >= 0,
        )  # fmt: skip
        _, metrics = rl_loss(
            logprobs, t["inference_logprobs"], t["advantages"], t["loss_mask"], t["sample_ids"], config.loss,
            batch.num_loss_tokens_global, batch.num_samples_global,
        )  # fmt: skip
    valid = metrics["num_loss_tokens"] - metrics["num_nonfinite"]
    return metrics["mismatch_kl"] * valid, valid


def without_replay_metrics(own_kl: list[tuple[float, float]], info: DistInfo) -> dict[str, float]:
    """`mismatch_kl/without_replay`: the token mean over all ranks of what `own_routing_kl` measured."""
    local = [sum(kl for kl, _ in own_kl), sum(n for _, n in own_kl)]
    rows = all_gather_floats(local, info)
    total = sum(row[1] for row in rows)
    return {"mismatch_kl/without_replay": sum(row[0] for row in rows) / total} if total else {}


def peak_memory(info: DistInfo) -> dict[str, float]:
    """The largest peak GPU memory of any rank so far (a GPU shared with inference needs both sides' numbers)."""
    local = memory_metrics(info.device)
    if not local:
        return {}
    gathered = all_gather_floats(list(local.values()), info)
    return {key: max(row[i] for row in gathered) for i, key in enumerate(local)}


def memory_metrics(device: torch.device) -> dict[str, float]:
    """Peak GPU memory of this process so far."""
    if device.type != "cuda":
        return {}
    return {
        "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2**30,
        "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30,
    }


# what one rank sends the others of its step's metrics: rl_loss's (see merge_loss_metrics) and the step's own
RANK_METRICS = (
    "num_loss_tokens", "num_nonfinite", "masked_fraction", "mismatch_kl", "ratio_mean", "ratio_max", "entropy",
    "loss", "tokens", "elapsed",
)  # fmt: skip


def across_ranks(
    local: dict[str, float], gather: Callable[[list[float]], list[list[float]]]
) -> dict[str, float]:
    """This rank's step metrics combined with every rank's (`gather` returns each rank's values; with context
    parallelism one rank per cp group, whose ranks all hold the same rows' metrics): token means as if one
    rank had seen every micro-batch, counts and losses summed, the slowest rank's time (pure)."""
    rows = [
        dict(zip(RANK_METRICS, row, strict=True)) for row in gather([local.get(k, 0.0) for k in RANK_METRICS])
    ]
    merged = merge_loss_metrics(rows)
    merged["loss"] = sum(r["loss"] for r in rows)  # each rank's loss is its share of the global mean
    merged["tokens"] = sum(r["tokens"] for r in rows)
    merged["elapsed"] = max(r["elapsed"] for r in rows)
    if "entropy" not in local:
        merged.pop("entropy", None)
    return merged


def check_world_size(batch: TrainBatch, info: DistInfo) -> None:
    """The orchestrator split this step into `num_trainer_ranks` shards: another number of trainer ranks
    would silently drop shards (fewer ranks) or wait forever for them (more), and scale the loss wrong."""
    if batch.num_trainer_ranks != info.world_size:
        raise UserError(
            f"trainer: batch {batch.step} was split for {batch.num_trainer_ranks} trainer rank(s) "
            f"(orchestrator.batch.num_trainer_ranks) but this trainer runs {info.world_size} rank(s); "
            "make them equal (tidal rl sets both from deployment.num_trainer_ranks)"
        )
    if batch.cp != info.cp:  # other rows on the ranks of one cp group would train on a mix of both
        raise UserError(
            f"trainer: batch {batch.step} was laid out for cp = {batch.cp} (orchestrator.batch.cp) but the "
            f"trainer runs perf.cp = {info.cp}; make them equal (tidal rl sets both from trainer.perf.cp)"
        )


def _summary(step: int, m: dict[str, Any]) -> str:
    return (
        f"trainer step {step} | loss {m['loss']:+.4f} | mismatch_kl {m['mismatch_kl/mean']:.2e}"
        f" | grad_norm {m['grad_norm']:.3f} | {m['tokens_per_s'] / 1e3:.1f}k tok/s"
        f" | waited {m['time/wait_for_data']:.2f} s"
    )

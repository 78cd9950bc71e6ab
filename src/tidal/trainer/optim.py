"""AdamW and the learning-rate schedule (linear warmup, then constant / linear / cosine decay)."""

import math

import torch

from tidal.config.common import OptimConfig, SchedulerConfig


def lr_factor(step: int, total_steps: int, config: SchedulerConfig) -> float:
    """Multiplier of the peak lr for the update that follows `step` completed steps (pure, unit-tested)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.type == "constant":
        return 1.0
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    if config.type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


def build_optimizer(model: torch.nn.Module, config: OptimConfig) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(
        params,
        lr=config.lr,
        betas=config.betas,
        eps=config.eps,
        weight_decay=config.weight_decay,
        fused=fused or None,
    )


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: SchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))

"""RL loss: target logprobs and entropy from logits, and the importance-weighted policy gradient (pure torch)."""

from collections.abc import Sequence

import torch
from torch.utils.checkpoint import checkpoint

from tidal.config.loss import LossConfig
from tidal.trainer.chunked import chunk_scores

LOGITS_CHUNK = 1024  # tokens per chunk: one fp32 [chunk, vocab] slab lives at a time


def _target_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float) -> torch.Tensor:
    return chunk_scores(logits, targets, temperature, with_entropy=False)[0]  # [chunk]


def selective_log_softmax(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, chunk_size: int = LOGITS_CHUNK
) -> torch.Tensor:
    """fp32 logprobs of `targets` [...] under softmax(logits [..., vocab] / temperature).

    The temperature must be the sampling temperature, so that the result is comparable with the inference
    logprobs. Chunks are recomputed in backward (checkpoint), so autograd keeps no fp32 copy of the logits.
    """
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [tokens, vocab]
    flat_targets = targets.reshape(-1)  # [tokens]
    parts = []
    for start in range(0, flat_targets.numel(), chunk_size):
        chunk = (flat_logits[start : start + chunk_size], flat_targets[start : start + chunk_size])
        if torch.is_grad_enabled() and logits.requires_grad:
            parts.append(checkpoint(_target_logprobs, *chunk, temperature, use_reentrant=False))
        else:
            parts.append(_target_logprobs(*chunk, temperature))
    if not parts:
        return torch.zeros(targets.shape, dtype=torch.float32, device=logits.device)
    return torch.cat(parts).view(targets.shape)


@torch.no_grad()
def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: int = LOGITS_CHUNK
) -> torch.Tensor:
    """Entropy [...] of softmax(logits [..., vocab] / temperature), fp32; a metric, so no gradient."""
    flat_logits = logits.reshape(-1, logits.shape[-1])  # [tokens, vocab]
    parts = []
    for start in range(0, flat_logits.shape[0], chunk_size):
        logprobs = torch.log_softmax(flat_logits[start : start + chunk_size].float() / temperature, dim=-1)
        parts.append(-(logprobs.exp() * logprobs).sum(-1))  # [chunk]
    if not parts:
        return torch.zeros(logits.shape[:-1], dtype=torch.float32, device=logits.device)
    return torch.cat(parts).view(logits.shape[:-1])


def per_sample_sums(values: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    """Sum of `values` [batch, seq] per sample id → [batch * seq] (ids index it; unused slots are 0).

    Ids must be below batch·seq (micro-batch-local ids are). Padding (id −1) is folded into slot 0, so
    callers must zero padding in `values` first. One slot per token bounds the number of samples without a
    device sync.
    """
    flat_ids = sample_ids.clamp(min=0).flatten()  # [tokens]
    sums = torch.zeros(values.numel(), dtype=values.dtype, device=values.device)
    return sums.index_add(0, flat_ids, values.flatten())


def sequence_log_ratio(
    token_log_ratio: torch.Tensor, valid: torch.Tensor, sample_ids: torch.Tensor
) -> torch.Tensor:
    """GSPO: each token gets the mean log ratio over its sample's valid tokens ([batch, seq] → [batch, seq])."""
    weights = valid.to(token_log_ratio.dtype)  # [batch, seq]
    sums = per_sample_sums(token_log_ratio * weights, sample_ids)  # [tokens]
    counts = per_sample_sums(weights, sample_ids)  # [tokens]
    means = sums / counts.clamp(min=1)
    return means[sample_ids.clamp(min=0)]  # [batch, seq]


def prob_diff_keep(
    logprobs: torch.Tensor, inference_logprobs: torch.Tensor, config: LossConfig
) -> torch.Tensor:
    """Bool [batch, seq]: tokens the DPPO probability-difference rule keeps (|π − μ| ≤ max_prob_diff); per token."""
    if config.max_prob_diff is None:
        return torch.ones_like(logprobs, dtype=torch.bool)
    return (logprobs.exp() - inference_logprobs.exp()).abs() <= config.max_prob_diff


def ratio_keep(ratio: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Bool [batch, seq]: ratios inside the IcePop bounds [mask_low, mask_high]."""
    keep = torch.ones_like(ratio, dtype=torch.bool)
    if config.mask_low is not None:
        keep &= ratio >= config.mask_low
    if config.mask_high is not None:
        keep &= ratio <= config.mask_high
    return keep


def k3(log_ratio: torch.Tensor) -> torch.Tensor:
    """k3 estimator r − log r − 1 with r = π/μ: unbiased for KL(μ‖π) on tokens sampled from μ, always ≥ 0."""
    # expm1 keeps the x²/2 of a tiny log ratio that exp(x) − 1 rounds away; the clamp removes the last
    # rounding below 0 (an fp32 run with equal policies logged −1e-10), so the estimator stays ≥ 0 as it must
    return (torch.expm1(log_ratio) - log_ratio).clamp(min=0)


def normalise(
    per_token: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    config: LossConfig,
    num_loss_tokens_global: int,
    num_samples_global: int,
) -> torch.Tensor:
    """Reduce the per-token loss [batch, seq] (zero off the loss) to this micro-batch's share of the global loss."""
    if config.norm == "token":
        return per_token.sum() / max(1, num_loss_tokens_global)
    if config.norm == "sequence":
        sums = per_sample_sums(per_token, sample_ids)  # [tokens]
        counts = per_sample_sums(loss_mask.to(per_token.dtype), sample_ids)  # [tokens]
        return (sums / counts.clamp(min=1)).sum() / max(1, num_samples_global)
    assert config.norm_constant is not None  # the config validator guarantees it
    return per_token.sum() / config.norm_constant


def rl_loss(
    trainer_logprobs: torch.Tensor,
    inference_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    sample_ids: torch.Tensor,
    config: LossConfig,
    num_loss_tokens_global: int,
    num_samples_global: int,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Importance-weighted REINFORCE against the inference policy μ for one micro-batch; all inputs [batch, seq].

    Per loss token: −ratio·A (+ kl_coef·k3), ratio = exp(logπ − logμ) (token) or exp(mean over the sequence's
    tokens kept by max_prob_diff) (sequence), the gradient flowing through logπ, so ∇ = −ratio·A·∇logπ. Log
    ratios are clamped to ±max_abs_log_ratio before exp (a clamped token passes no gradient; the default
    trust region masks it anyway); tokens with a non-finite input get zero loss and are counted; tokens
    outside the trust region lose the −ratio·A term (not the KL term, unless kl_tokens = "trust_region")
    and are counted in masked_fraction (both stay in the normaliser, so masking never up-weights the rest).

    The normalisers are GLOBAL counts (every micro-batch of every rank): the trainer sums this loss over its
    micro-batches, and FSDP averages gradients over ranks, so the caller multiplies by world_size to make
    the gradient that of the global sum / global count. Metrics are means over this call's valid tokens
    (see `merge_loss_metrics` to combine calls).
    """
    mask = loss_mask.bool()  # [batch, seq]
    finite = trainer_logprobs.isfinite() & inference_logprobs.isfinite() & advantages.isfinite()
    valid = mask & finite  # [batch, seq]
    zeros = torch.zeros_like(trainer_logprobs)
    # where() passes no gradient to unselected entries, so NaN/inf there cannot poison the backward
    logprobs = torch.where(valid, trainer_logprobs, zeros)  # [batch, seq]
    mu = torch.where(valid, inference_logprobs.to(zeros.dtype), zeros).detach()  # [batch, seq]
    adv = torch.where(valid, advantages.to(zeros.dtype), zeros)  # [batch, seq]

    bound = config.max_abs_log_ratio
    token_log_ratio = (logprobs - mu).clamp(-bound, bound)  # [batch, seq]
    # the probability-difference rule is per token, so it comes first: GSPO's sequence ratio then averages
    # over the kept tokens only, and a masked token passes no gradient through its sequence's ratio
    prob_kept = valid & prob_diff_keep(logprobs.detach(), mu, config)  # [batch, seq]
    log_ratio = token_log_ratio
    if config.ratio_type == "sequence":
        log_ratio = sequence_log_ratio(logprobs - mu, prob_kept, sample_ids).clamp(-bound, bound)
    ratio = log_ratio.exp()  # [batch, seq], at most e^bound

    keep = prob_kept & ratio_keep(ratio.detach(), config)
    per_token = torch.where(keep, -ratio * adv, zeros)  # [batch, seq]
    if config.kl_coef > 0:
        # by default on every valid loss token: the trust region drops the policy-gradient term of a token
        # far from μ, and the pull back towards μ is what such a token needs most
        kl_tokens = keep if config.kl_tokens == "trust_region" else valid
        per_token = per_token + torch.where(kl_tokens, config.kl_coef * k3(token_log_ratio), zeros)
    loss = normalise(per_token, mask, sample_ids, config, num_loss_tokens_global, num_samples_global)
    metrics = _metrics(mask, valid, keep, ratio.detach(), token_log_ratio.detach(), entropy)
    return loss, metrics


def _metrics(
    mask: torch.Tensor,
    valid: torch.Tensor,
    keep: torch.Tensor,
    ratio: torch.Tensor,
    token_log_ratio: torch.Tensor,
    entropy: torch.Tensor | None,
) -> dict[str, float]:
    num_valid = valid.sum().clamp(min=1)
    weights = valid.to(ratio.dtype)  # [batch, seq]
    values = {
        "mismatch_kl": (k3(token_log_ratio) * weights).sum() / num_valid,
        "masked_fraction": (valid & ~keep).sum() / mask.sum().clamp(min=1),
        "ratio_mean": (ratio * weights).sum() / num_valid,
        "ratio_max": (ratio * weights).max() if ratio.numel() else ratio.new_zeros(()),
        "num_nonfinite": (mask & ~valid).sum(),
        "num_loss_tokens": mask.sum(),
    }
    if entropy is not None:
        values["entropy"] = torch.where(valid, entropy.to(ratio.dtype), 0.0).sum() / num_valid
    # one device sync for all metrics instead of one per .item()
    floats = torch.stack([v.to(torch.float64) for v in values.values()]).tolist()
    return dict(zip(values, floats, strict=True))


def merge_loss_metrics(metrics: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine `rl_loss` metrics of several micro-batches (or ranks' merged metrics) exactly.

    Means over valid tokens are weighted by num_loss_tokens − num_nonfinite, masked_fraction by
    num_loss_tokens; counts add up; ratio_max takes the max.
    """
    tokens = sum(m["num_loss_tokens"] for m in metrics)
    nonfinite = sum(m["num_nonfinite"] for m in metrics)
    merged = {"num_loss_tokens": tokens, "num_nonfinite": nonfinite}
    merged["ratio_max"] = max((m["ratio_max"] for m in metrics), default=0.0)
    num_masked = sum(m["masked_fraction"] * m["num_loss_tokens"] for m in metrics)
    merged["masked_fraction"] = num_masked / max(1, tokens)
    for key in ("mismatch_kl", "ratio_mean", "entropy"):
        if metrics and all(key in m for m in metrics):
            weighted = sum(m[key] * (m["num_loss_tokens"] - m["num_nonfinite"]) for m in metrics)
            merged[key] = weighted / max(1, tokens - nonfinite)
    return merged

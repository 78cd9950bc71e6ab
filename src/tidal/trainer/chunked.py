"""Token scores straight from hidden states: the output head runs in chunks, so [tokens, vocab] never exists.

`TokenScorer` wraps an HF causal LM and is the module the trainers call (and FSDP's root): its forward runs
the decoder, then the head chunk by chunk, and returns per-token logprobs of the targets (and the entropy
for RL). Each chunk is checkpointed, so in backward too only one fp32 [chunk, vocab] slab lives at a time.
With `compile_head`, the per-chunk softmax work (upcast, logsumexp, gather, and their backward) runs as
fused kernels: eager, it is ~6 passes over each fp32 slab (Qwen3-4B, 16k tokens, H200: ~80 ms a step).
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from tidal.trainer.attention import ATTN_NAME, document_bounds


def chunk_scores(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logprob of `targets` [chunk] under softmax(logits [chunk, vocab] / T), and the entropy (no grad)."""
    scaled = logits.float() / temperature  # [chunk, vocab]
    lse = torch.logsumexp(scaled, dim=-1)  # [chunk]
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [chunk]
    entropy = None
    if with_entropy:
        with torch.no_grad():  # a metric: H = lse − Σ p·z
            entropy = lse - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)  # [chunk]
    return picked - lse, entropy


ScoreFn = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


@functools.cache
def compiled_chunk_scores() -> ScoreFn:
    """`chunk_scores` under torch.compile, made once per process (every scorer shares its kernels)."""
    return torch.compile(chunk_scores)


def _head_chunk(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    score_fn: ScoreFn,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = torch.nn.functional.linear(hidden, weight, bias)  # [chunk, vocab], compute dtype
    return score_fn(logits, targets, temperature, with_entropy)


def chunked_head_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    score_fn: ScoreFn = chunk_scores,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropy) [...] of `targets` [...] from `hidden` [..., hidden] and the head weight [vocab, hidden].

    Targets outside the vocabulary (e.g. −100 for ignored labels) score against token 0; callers mask them.
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, hidden]
    flat_targets = targets.reshape(-1).clamp(0, weight.shape[0] - 1)  # [tokens]
    recompute = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    logprobs, entropies = [], []
    for start in range(0, flat_targets.numel(), chunk_size):
        args = (
            flat_hidden[start : start + chunk_size],
            weight,
            bias,
            flat_targets[start : start + chunk_size],
        )
        if recompute:
            lp, ent = checkpoint(_head_chunk, *args, temperature, with_entropy, score_fn, use_reentrant=False)
        else:
            lp, ent = _head_chunk(*args, temperature, with_entropy, score_fn)
        logprobs.append(lp)
        if ent is not None:
            entropies.append(ent)
    empty = torch.zeros(targets.shape, dtype=torch.float32, device=hidden.device)
    # clone: FSDP warns about returning views (an in-place op on one would skip its backward hook)
    out = torch.cat(logprobs).view(targets.shape).clone() if logprobs else empty
    entropy = torch.cat(entropies).view(targets.shape) if entropies else (empty if with_entropy else None)
    return out, entropy


class TokenScorer(torch.nn.Module):
    """An HF causal LM whose forward returns target logprobs [rows, seq] (and entropy), not logits.

    The wrapped model keeps its HF parameter names (checkpoints and exported weights use `self.lm`).
    """

    def __init__(self, lm: torch.nn.Module, chunk_size: int = 1024, compile_head: bool = False):
        super().__init__()
        self.lm = lm
        self.chunk_size = chunk_size
        self.score_fn: Any = compiled_chunk_scores() if compile_head else chunk_scores
        config = lm.config  # type: ignore[attr-defined]
        if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None):
            raise ValueError(
                f"{type(lm).__name__}: logit soft-capping / scaling is not supported by TokenScorer"
            )

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        targets: torch.Tensor,
        temperature: float = 1.0,
        with_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, position_ids, targets [rows, seq] → logprobs [rows, seq], entropy [rows, seq] or None."""
        kwargs = {}
        if self.lm.config._attn_implementation == ATTN_NAME:  # type: ignore[union-attr]
            kwargs = {
                "tidal_cu_seqlens": document_bounds(position_ids),
                "tidal_max_seqlen": input_ids.shape[1],
            }
        decoder = getattr(self.lm, str(self.lm.base_model_prefix))  # e.g. Qwen3ForCausalLM.model
        # use_cache=False: with a KV cache transformers ignores the position-id resets of packed rows
        hidden = decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)
        head = self.lm.get_output_embeddings()  # type: ignore[operator]
        return chunked_head_scores(
            hidden.last_hidden_state,
            head.weight,
            head.bias,
            targets,
            temperature,
            self.chunk_size,
            with_entropy,
            self.score_fn,
        )

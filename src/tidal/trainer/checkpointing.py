"""Activation checkpointing (full, selective, attention-only) and torch.compile for decoder layers.

Both replace a layer's `forward` on the instance rather than wrapping the module, so parameter names stay
the HF ones and FSDP2's hooks (registered on the module later) run outside the checkpointed region — the
order torchtitan uses: checkpoint, then compile, then shard.
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from tidal.trainer.flash4 import flash4_forward

aten = torch.ops.aten


def _attention_ops() -> set[Any]:
    """Attention kernels whose outputs selective checkpointing keeps (the costliest ops to recompute)."""
    names = [
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
    ]
    ops = {getattr(aten, name).default for name in names if hasattr(aten, name)}
    try:
        import torch.nn.attention.varlen  # noqa: F401  (registers torch_attn::_varlen_attn)

        ops.add(torch.ops.torch_attn._varlen_attn.default)
    except (ImportError, AttributeError):
        pass
    ops.add(flash4_forward._opoverload)  # tidal's FlashAttention-4 op (perf.attention_kernel)
    return ops


# matmuls whose outputs each mode keeps, by their order in a decoder layer's forward (1-based; a Qwen3/Llama
# layer runs q, k, v, o, gate, up, down). down's output is never needed by backward, so keeping it is waste.
SAVED_MATMULS = {
    "attention": frozenset(),
    "selective": frozenset({1, 3, 5, 7}),
    "projections": frozenset({1, 2, 3, 4}),
    "matmuls": frozenset({1, 2, 3, 4, 5, 6}),
}


class MatmulPicker:
    """Numbers a decoder layer's matmuls in order and says whether to keep each one's output (pure).

    A LoRA projection runs three matmuls (base, then x·Aᵀ, then ·Bᵀ); the low-rank two — inner or output
    dimension equal to `low_rank` — are not numbered (their outputs are tiny to recompute), so the numbers
    keep naming the base projections q, k, v, o, gate, up, down.
    """

    def __init__(self, saved: frozenset[int], low_rank: int | None = None):
        self.saved = saved
        self.low_rank = low_rank
        self.count = 0

    def keep(self, left_shape: Sequence[int], right_shape: Sequence[int]) -> bool:
        """For `left [M, K] @ right [K, N]`: whether this matmul's output is kept."""
        if self.low_rank is not None and self.low_rank in (left_shape[-1], right_shape[-1]):
            return False
        self.count += 1
        return self.count in self.saved


def selective_context(saved_matmuls: frozenset[int], low_rank: int | None = None) -> Callable[[], Any]:
    """A checkpoint `context_fn`: keep attention outputs and the outputs of the matmuls numbered in
    `saved_matmuls` (1-based order in the layer, LoRA's low-rank matmuls not counted); recompute the rest.

    Recomputation replays the same ops in the same order, so numbering matmuls separately in forward and in
    recompute makes both choose the same ones.
    """
    keep = _attention_ops()
    matmuls = {aten.mm.default, aten.addmm.default}

    def context_fn() -> Any:
        pickers = {phase: MatmulPicker(saved_matmuls, low_rank) for phase in (True, False)}  # by is_recompute

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op in keep:
                return CheckpointPolicy.MUST_SAVE
            # mm(left, right) and addmm(bias, left, right): the operands are the last two
            if op in matmuls and pickers[ctx.is_recompute].keep(args[-2].shape, args[-1].shape):
                return CheckpointPolicy.MUST_SAVE
            # MUST, not PREFER: under torch.compile the kept set is then exactly the one named above
            return CheckpointPolicy.MUST_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def lora_rank(layers: list[torch.nn.Module]) -> int | None:
    """The rank of the LoRA adapters in `layers` (tidal.trainer.lora's `lora_A` linears), None without LoRA."""
    ranks = {
        int(m.lora_A.out_features)  # type: ignore[union-attr,arg-type]
        for layer in layers
        for m in layer.modules()
        if isinstance(getattr(m, "lora_A", None), torch.nn.Linear)
    }
    return ranks.pop() if len(ranks) == 1 else None


def _checkpointed(forward: Callable[..., Any], context_fn: Callable[[], Any] | None) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


MLP_INPUT_MATMULS = frozenset({5, 6})  # gate and up: with both kept, backward recomputes no matmul


def apply_activation_checkpointing(
    layers: list[torch.nn.Module], mode: str, every: int = 1, save_mlp_layers: int = 0
) -> None:
    """Checkpoint every `every`-th layer: `full`, `selective`, `projections` or `attention` (see PerfConfig);
    `none` is a no-op. In the last `save_mlp_layers` layers selective modes also keep gate and up."""
    if mode == "none":
        return
    rank = lora_rank(layers)
    context_fn = None if mode == "full" else selective_context(SAVED_MATMULS[mode], rank)
    richer = context_fn
    if save_mlp_layers and mode != "full":
        richer = selective_context(SAVED_MATMULS[mode] | MLP_INPUT_MATMULS, rank)
    for index, layer in enumerate(layers):
        if index % every == 0:
            chosen = richer if index >= len(layers) - save_mlp_layers else context_fn
            layer.forward = _checkpointed(layer.forward, chosen)  # type: ignore[method-assign]


def apply_compile(layers: list[torch.nn.Module]) -> None:
    """Compile each layer's forward (after checkpointing, before sharding). All layers share one graph."""
    import torch._dynamo

    # one cache entry per layer in the worst case; the default limit (8) would silently fall back to eager
    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), len(layers) + 8))
    # MoE blocks record their routing statistics in forward (tidal.trainer.moe), a Python side effect that
    # dynamo refuses inside a checkpointed region unless told it need not replay it when backward recomputes
    # the layer; eager recomputation records nothing either (only the training forward collects), and without
    # this every MoE layer broke out of its compiled graph
    if hasattr(config, "skip_fwd_side_effects_in_bwd_under_checkpoint"):
        config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    for layer in layers:
        layer.forward = torch.compile(layer.forward)  # type: ignore[method-assign]

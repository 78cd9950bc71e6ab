"""Activation checkpointing (full, selective, attention-only) and torch.compile for decoder layers.

Both replace a layer's `forward` on the instance rather than wrapping the module, so parameter names stay
the HF ones and FSDP2's hooks (registered on the module later) run outside the checkpointed region — the
order torchtitan uses: checkpoint, then compile, then shard.
"""

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

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
    return ops


# matmuls whose outputs each mode keeps, by their order in a decoder layer's forward (1-based; a Qwen3/Llama
# layer runs q, k, v, o, gate, up, down). down's output is never needed by backward, so keeping it is waste.
SAVED_MATMULS = {
    "attention": frozenset(),
    "selective": frozenset({1, 3, 5, 7}),
    "projections": frozenset({1, 2, 3, 4}),
}


def selective_context(saved_matmuls: frozenset[int]) -> Callable[[], Any]:
    """A checkpoint `context_fn`: keep attention outputs and the outputs of the matmuls numbered in
    `saved_matmuls` (1-based order in the layer); recompute the rest.

    Recomputation replays the same ops in the same order, so counting matmuls separately in forward and in
    recompute makes both choose the same ones.
    """
    keep = _attention_ops()
    matmuls = {aten.mm.default, aten.addmm.default}

    def context_fn() -> Any:
        counts = {True: 0, False: 0}  # is_recompute -> matmuls seen

        def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
            if op in keep:
                return CheckpointPolicy.MUST_SAVE
            if op in matmuls:
                counts[ctx.is_recompute] += 1
                if counts[ctx.is_recompute] in saved_matmuls:
                    return CheckpointPolicy.MUST_SAVE
            # MUST, not PREFER: under torch.compile the kept set is then exactly the one named above
            return CheckpointPolicy.MUST_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    return context_fn


def _checkpointed(forward: Callable[..., Any], context_fn: Callable[[], Any] | None) -> Callable[..., Any]:
    @functools.wraps(forward)
    def run(*args: Any, **kwargs: Any) -> Any:
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def apply_activation_checkpointing(layers: list[torch.nn.Module], mode: str, every: int = 1) -> None:
    """Checkpoint every `every`-th layer: `full`, `selective`, `projections` or `attention` (see PerfConfig);
    `none` is a no-op."""
    if mode == "none":
        return
    context_fn = None if mode == "full" else selective_context(SAVED_MATMULS[mode])
    for index, layer in enumerate(layers):
        if index % every == 0:
            layer.forward = _checkpointed(layer.forward, context_fn)  # type: ignore[method-assign]


def apply_compile(layers: list[torch.nn.Module]) -> None:
    """Compile each layer's forward (after checkpointing, before sharding). All layers share one graph."""
    import torch._dynamo

    # one cache entry per layer in the worst case; the default limit (8) would silently fall back to eager
    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), len(layers) + 8))
    for layer in layers:
        layer.forward = torch.compile(layer.forward)  # type: ignore[method-assign]

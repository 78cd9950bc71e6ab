"""FlashAttention-4 (the optional `flash-attn-4` package: CuTe-DSL kernels for Hopper and Blackwell GPUs) as
torch custom ops, for tidal's varlen attention (`perf.attention_kernel`).

The package's own autograd function is plain Python that JIT-compiles kernels on first use; torch.compile
cannot trace it. Wrapped as two custom ops (forward → output and log-sum-exp, backward → dq, dk, dv) with
fake implementations, a compiled decoder layer treats each as one opaque kernel, as it does torch's own
varlen op. Everything here runs causal attention within the documents `cu_seqlens` delimits.
"""

import importlib.util

import torch

_OP_FORWARD = "tidal::flash4_forward"
_OP_BACKWARD = "tidal::flash4_backward"


def missing(device: torch.device) -> str | None:
    """Why FlashAttention-4 cannot run on `device` (a short reason), or None when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU (this run is on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"it needs compute capability 9.0 or newer (Hopper, Blackwell); this GPU has {major}.{minor}"
    if importlib.util.find_spec("flash_attn") is None or importlib.util.find_spec("flash_attn.cute") is None:
        return "the flash-attn-4 package is not installed (pip install flash-attn-4)"
    return None


@torch.library.custom_op(_OP_FORWARD, mutates_args=())
def flash4_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [tokens, heads, dim], k/v [tokens, kv_heads, dim] → (out [tokens, heads, dim], lse fp32 [heads, tokens])."""
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q,
        k,
        v,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
        softmax_scale=scale,
        causal=True,
        return_lse=True,  # backward needs it; without it the kernel may skip writing it
    )
    return out, lse


@flash4_forward.register_fake
def _forward_fake(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op(_OP_BACKWARD, mutates_args=())
def flash4_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of the causal varlen attention `flash4_forward` computed."""
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=scale,
        causal=True,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_seqlens,
        max_seqlen_q=max_seqlen,
        max_seqlen_k=max_seqlen,
    )[:3]
    return dq, dk, dv


@flash4_backward.register_fake
def _backward_fake(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx: torch.autograd.function.FunctionCtx, inputs: tuple, output: tuple) -> None:  # type: ignore[type-arg]
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale  # type: ignore[attr-defined]


def _backward(ctx: torch.autograd.function.FunctionCtx, dout: torch.Tensor, _dlse: torch.Tensor) -> tuple:  # type: ignore[type-arg]
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors  # type: ignore[attr-defined]
    dq, dk, dv = flash4_backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)  # type: ignore[attr-defined]
    return dq, dk, dv, None, None, None


flash4_forward.register_autograd(_backward, setup_context=_setup_context)


def flash4_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention within documents: q [tokens, heads, dim], k/v [tokens, kv_heads, dim] → [tokens, heads, dim].

    Grouped-query heads are handled by the kernel (kv_heads divides heads)."""
    return flash4_forward(query, key, value, cu_seqlens, max_seqlen, scale)[0]

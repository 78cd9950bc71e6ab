"""Variable-length causal attention over packed rows, registered with transformers as `tidal_varlen`.

A packed row holds several documents; a document starts where its position id is 0. The decoder gets the
document boundaries (`cu_seqlens`) as keyword arguments, and each attention layer attends within documents
only: on CUDA torch's kernels (cuDNN SDPA for rows of one document, flash varlen `torch.nn.attention.varlen`
for packed rows) or FlashAttention-4 (tidal.trainer.flash4, `perf.attention_kernel`); a per-document SDPA
loop elsewhere (the reference every kernel is checked against). No padding, no mask tensor, no attention
across documents.
"""

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from tidal.trainer.autocast import in_autocast_dtype
from tidal.trainer.flash4 import flash4_varlen, missing

ATTN_NAME = "tidal_varlen"
KERNELS = ("torch", "flash4")
_flash: dict[str, Any] = {"enabled": False, "kernel": "torch"}  # set once by `use_varlen`; read by every call
_varlen: dict[str, Any] = {}  # torch's varlen_attn and its calling convention, filled by `_load_varlen`


def document_bounds(position_ids: torch.Tensor) -> torch.Tensor:
    """Cumulative document starts (int32 [num_docs + 1]) of the flattened rows `position_ids` [rows, seq].

    A document starts at every position id 0 and at every row start (rows never share a document).
    """
    rows, seq = position_ids.shape
    starts = position_ids == 0  # [rows, seq]
    starts[:, 0] = True
    flat = starts.flatten().nonzero().flatten()  # [num_docs]
    end = torch.tensor([rows * seq], device=flat.device, dtype=flat.dtype)
    return torch.cat([flat, end]).to(torch.int32)


def reference_varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention per document with SDPA; q [tokens, heads, dim], k/v [tokens, kv_heads, dim]."""
    outputs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        q, k, v = (x[start:end].transpose(0, 1) for x in (query, key, value))  # [heads, len, dim]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        outputs.append(out.transpose(0, 1))  # [len, heads, dim]
    return torch.cat(outputs)


def _load_varlen() -> bool:
    """Find torch's varlen_attn and how to call it (its causal argument changed in 2.11); False if absent.

    Resolved once, outside any compiled region: inspecting signatures inside torch.compile breaks graphs.
    """
    if _varlen:
        return True
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    params = inspect.signature(varlen_attn).parameters
    _varlen["fn"] = varlen_attn
    _varlen["causal"] = {"window_size": (-1, 0)} if "window_size" in params else {"is_causal": True}
    _varlen["has_scale"] = "scale" in params
    _varlen["has_gqa"] = "enable_gqa" in params
    return True


def flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float,
) -> torch.Tensor:
    """torch's flash varlen kernel, causal within documents; the kernel handles grouped-query heads."""
    kwargs = dict(_varlen["causal"])
    if _varlen["has_scale"]:
        kwargs["scale"] = scale
    elif abs(scale - query.shape[-1] ** -0.5) > 1e-9:
        raise ValueError(f"this torch's varlen_attn has no scale argument; the model needs scale {scale}")
    if _varlen["has_gqa"] and key.shape[1] != query.shape[1]:
        kwargs["enable_gqa"] = True
    if _varlen.get("repeat_kv") and key.shape[1] != query.shape[1]:
        groups = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = _varlen["fn"](query, key, value, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    return out[0] if isinstance(out, tuple) else out


CHECK_SHAPE = (4, 2, 64)
"""(query heads, key/value heads, head dim) a kernel is checked with when no model's are given."""


def attention_shape(model: torch.nn.Module) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of `model`'s attention, from its HF config."""
    whole: Any = model.config
    config: Any = whole.get_text_config()  # a vision-language model's: its language model's
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, getattr(config, "num_key_value_heads", None) or heads, head_dim


def _matches_reference(kernel: Any, device: torch.device, shape: tuple[int, int, int] = CHECK_SHAPE) -> bool:
    """Whether `kernel` (flash_varlen's signature) matches the SDPA reference on two documents with `shape`'s
    heads (grouped where the key/value heads are fewer)."""
    heads, kv_heads, dim = shape
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(96, h, dim, device=device, dtype=torch.bfloat16, generator=gen)
        for h in (heads, kv_heads, kv_heads)
    )
    cu = torch.tensor([0, 40, 96], device=device, dtype=torch.int32)
    want = reference_varlen(q, k, v, cu, dim**-0.5).float()
    got = kernel(q, k, v, cu, 96, dim**-0.5)
    return torch.allclose(got.float(), want, atol=2e-2, rtol=2e-2)


def varlen_works(device: torch.device) -> bool:
    """Whether torch's flash varlen kernel runs here and matches the SDPA reference (GQA, two documents).

    If the kernel refuses grouped-query heads, it is tried once more with key/value heads repeated.
    """
    if device.type != "cuda" or not _load_varlen():
        return False
    for repeat_kv in (False, True):
        _varlen["repeat_kv"] = repeat_kv
        try:
            if _matches_reference(flash_varlen, device):
                return True
        except (RuntimeError, TypeError, ValueError):
            continue
    return False


def flash4_problem(device: torch.device, shape: tuple[int, int, int] = CHECK_SHAPE) -> str | None:
    """Why FlashAttention-4 cannot serve tidal_varlen on `device` for attention of `shape` (query heads,
    key/value heads, head dim: the model's, as head dims differ in what the kernels support), in one line;
    None when it runs and matches the SDPA reference. Its first call compiles the kernels (seconds)."""
    reason = missing(device)
    if reason is not None:
        return reason
    try:
        matches = _matches_reference(flash4_varlen, device, shape)
    except Exception as exc:  # noqa: BLE001 - a JIT-compiled kernel fails in many ways; each is a reason
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return f"its kernel failed here: {type(exc).__name__}: {first}"[:300]
    return None if matches else "its output differs from the SDPA reference here"


def unsupported_attention(model: torch.nn.Module) -> str | None:
    """What `model`'s attention needs that tidal_varlen does not do, e.g. "sliding_window = 4096"; None if nothing.

    Read from the HF config (sliding-window / non-full layer types, logit soft-capping, attention dropout)
    and the modules (attention sinks: GPT-OSS's `sinks`, passed to the kernel as `s_aux`).
    """
    config: Any = model.config
    found = []
    layer_types = set(getattr(config, "layer_types", None) or ())
    window = getattr(config, "sliding_window", None)
    if layer_types - {"full_attention"}:
        kinds = ", ".join(sorted(layer_types - {"full_attention"}))
        found.append(f"sliding_window = {window} ({kinds} layers)" if window else f"{kinds} layers")
    elif not layer_types and window and getattr(config, "use_sliding_window", True):
        found.append(f"sliding_window = {window}")
    if getattr(config, "attn_logit_softcapping", None):
        found.append(f"softcap = {config.attn_logit_softcapping} (attn_logit_softcapping)")
    if getattr(config, "attention_dropout", 0.0):
        found.append(f"dropout = {config.attention_dropout} (attention_dropout)")
    if any(isinstance(getattr(m, "sinks", None), torch.nn.Parameter) for m in model.modules()):
        found.append("s_aux (attention sinks)")
    if getattr(config, "vision_config", None) is not None:  # one attention setting covers both towers
        found.append("a vision tower (its attention is over a picture's patches, not packed documents)")
    return " and ".join(found) or None


def _refuse_unsupported(
    module: torch.nn.Module,
    dropout: float,
    sliding_window: int | None,
    softcap: float | None,
    s_aux: torch.Tensor | None,
    is_causal: bool | None,
) -> None:
    """A call that asks for what this kernel does not do fails here instead of silently running without it."""
    asked = {
        "sliding_window": sliding_window is not None,
        "softcap": bool(softcap),
        "s_aux": s_aux is not None,
        "dropout": bool(dropout),
        "is_causal": is_causal is False,
    }
    for name, present in asked.items():
        if present:
            from tidal.errors import UserError

            raise UserError(
                f"{type(module).__name__}: tidal_varlen attention does not support {name}; "
                "set perf.attention = 'hf'"
            )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tidal_cu_seqlens: torch.Tensor | None = None,
    tidal_max_seqlen: int | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface: q [b, heads, s, d], k/v [b, kv_heads, s, d] → out [b, s, heads, d].

    Arguments that change the attention (window, sinks, soft-capping, dropout, non-causal) are refused, not
    swallowed: `unsupported_attention` keeps such models off this path at load time, this is the backstop.
    """
    _refuse_unsupported(module, dropout, sliding_window, softcap, s_aux, is_causal)
    if tidal_cu_seqlens is None or tidal_max_seqlen is None:
        raise ValueError("tidal_varlen attention needs tidal_cu_seqlens / tidal_max_seqlen (see TokenScorer)")
    query, key, value = in_autocast_dtype(query, key, value)
    batch, heads, seq, dim = query.shape
    scale = scaling if scaling is not None else dim**-0.5
    half = query.dtype in (torch.bfloat16, torch.float16)
    flash4 = _flash["kernel"] == "flash4" and query.is_cuda and half
    if tidal_cu_seqlens.shape[0] == batch + 1 and not flash4:
        # every row is one document: plain causal SDPA, which may pick a faster kernel (cuDNN) than varlen's
        gqa = key.shape[1] != heads
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scale, enable_gqa=gqa)
        return out.transpose(1, 2), None
    q = query.transpose(1, 2).reshape(batch * seq, heads, dim)  # [tokens, heads, dim]
    k = key.transpose(1, 2).reshape(batch * seq, key.shape[1], dim)  # [tokens, kv_heads, dim]
    v = value.transpose(1, 2).reshape(batch * seq, value.shape[1], dim)  # [tokens, kv_heads, dim]
    # the flash kernel takes half precision only: fp32 compute (perf.mixed_precision = "off") on a GPU takes
    # the per-document SDPA loop instead of failing inside the kernel
    if flash4:
        out = flash4_varlen(q, k, v, tidal_cu_seqlens, tidal_max_seqlen, scale)
    elif _flash["enabled"] and q.is_cuda and half:
        out = flash_varlen(q, k, v, tidal_cu_seqlens, tidal_max_seqlen, scale)
    else:
        out = reference_varlen(q, k, v, tidal_cu_seqlens, scale)
    return out.view(batch, seq, heads, dim), None


def attention_kernel_name() -> str | None:
    """The GPU kernel tidal_varlen uses, for start-up lines ("FlashAttention-4", "torch's flash kernels");
    None when `use_varlen` has not chosen one (the model's own attention, or the CPU loop)."""
    if _flash["kernel"] == "flash4":
        return "FlashAttention-4"
    return "torch's flash kernels" if _flash["enabled"] else None


def register() -> None:
    """Make `tidal_varlen` a transformers attention implementation; it needs no mask, so none is built."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, varlen_attention_forward)


def use_varlen(model: torch.nn.Module, flash: bool, kernel: str = "torch") -> None:
    """Switch `model` to tidal_varlen; `flash` picks a CUDA kernel over the per-document SDPA loop, `kernel`
    which: torch's (cuDNN SDPA / flash varlen) or `flash4` (FlashAttention-4, checked by `flash4_problem`)."""
    assert kernel in KERNELS, kernel
    register()
    model.config._attn_implementation = ATTN_NAME  # type: ignore[attr-defined,union-attr]
    _flash["enabled"] = flash
    _flash["kernel"] = kernel

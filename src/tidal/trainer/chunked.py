"""Token scores straight from hidden states: the output head runs in chunks, so [tokens, vocab] never exists.

`TokenScorer` wraps an HF causal LM and is the module the trainers call (and FSDP's root): its forward runs
the decoder, then the head chunk by chunk, and returns per-token logprobs of the targets (and the entropy
for RL). The head is one autograd function (`HeadScores`): forward keeps each token's logsumexp and, with
`keep_logits` (`perf.keep_logits`), the logits themselves; backward takes a chunk's logits (recomputed
unless kept: one of the head's four matmuls saved for tokens × vocab elements of memory), turns them into
the logits' gradient in one pass, and accumulates the head weight's gradient inside the matmul (beta = 1),
so at most one [chunk, vocab] fp32 slab lives at a time and no per-chunk weight gradient is summed afterwards (Qwen3-4B, 16k tokens, H200: those adds were 9 ms a step).
The accumulator is fp32 even when the head computes in bf16, and is cast to the weight's dtype once.
With `compile_head`, the per-chunk softmax work runs as fused kernels: eager, it is ~6 passes over each fp32
slab (Qwen3-4B, 16k tokens, H200: ~80 ms).
"""

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch

from tidal.models.vision import QWEN_VL_TYPES, repeated_tower, rope_positions, split_repeats
from tidal.trainer.attention import ATTN_NAME, document_bounds
from tidal.trainer.context_parallel import CP_ATTN_NAME, ContextParallel
from tidal.trainer.moe import MoERouting, Routes


def chunk_scores(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logprob of `targets` [chunk] under softmax(logits [chunk, vocab] / T), and the entropy (no grad)."""
    logprobs, _, entropy = chunk_forward(logits, targets, temperature, with_entropy)
    return logprobs, entropy


def chunk_forward(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(logprobs of `targets`, logsumexp, entropy or None) [chunk] of softmax(logits [chunk, vocab] / T), fp32."""
    scaled = logits.float() / temperature  # [chunk, vocab]
    lse = torch.logsumexp(scaled, dim=-1)  # [chunk]
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # [chunk]
    entropy = None
    if with_entropy:
        with torch.no_grad():  # a metric: H = lse − Σ p·z
            entropy = lse - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)  # [chunk]
    return picked - lse, lse, entropy


def chunk_backward(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, grad: torch.Tensor, temperature: float
) -> torch.Tensor:
    """d(Σ grad · logprob)/d logits [chunk, vocab] in the logits' dtype: grad · (onehot(target) − p) / T."""
    probs = torch.exp(logits.float() / temperature - lse.unsqueeze(-1))  # [chunk, vocab]
    vocab = torch.arange(logits.shape[-1], device=logits.device)  # [vocab]
    onehot = (vocab == targets.unsqueeze(-1)).float()  # [chunk, vocab]
    return ((onehot - probs) * (grad / temperature).unsqueeze(-1)).to(logits.dtype)


class HeadFns:
    """The per-chunk forward and backward math, eager or compiled."""

    def __init__(self, forward: Callable[..., Any], backward: Callable[..., Any]):
        self.forward = forward
        self.backward = backward


EAGER_HEAD = HeadFns(chunk_forward, chunk_backward)


@functools.cache
def compiled_head() -> HeadFns:
    """The chunk math under torch.compile, made once per process (every scorer shares its kernels)."""
    return HeadFns(torch.compile(chunk_forward), torch.compile(chunk_backward))


class HeadScores(torch.autograd.Function):
    """(logprobs, entropy) [...] of `targets` [...] from hidden [tokens, hidden] and the head [vocab, hidden].

    Outputs have the targets' shape and are not views (FSDP's backward hook would be lost on a view)."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        fns: HeadFns,
        keep_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        targets_shape, targets = targets.shape, targets.reshape(-1)  # [tokens]
        logprobs = torch.empty(targets_shape, dtype=torch.float32, device=hidden.device)
        entropy = torch.zeros_like(logprobs)
        lse = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)  # [tokens]
        kept = None  # [tokens, vocab] in the compute dtype: exactly what backward would recompute
        if keep_logits and any(ctx.needs_input_grad[:3]):
            kept = hidden.new_empty((targets.numel(), weight.shape[0]))
        for start in range(0, targets.numel(), chunk_size):
            part = slice(start, start + chunk_size)
            logits = torch.nn.functional.linear(hidden[part], weight, bias)  # [chunk, vocab]
            if kept is not None:
                kept[part] = logits
            lp, chunk_lse, ent = fns.forward(logits, targets[part], temperature, with_entropy)
            logprobs.view(-1)[part], lse[part] = lp, chunk_lse
            if ent is not None:
                entropy.view(-1)[part] = ent
        ctx.save_for_backward(hidden, weight, bias, targets, lse, kept)
        ctx.setup = (temperature, chunk_size, fns)
        ctx.mark_non_differentiable(entropy)
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor, _entropy_grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        hidden, weight, bias, targets, lse, kept = ctx.saved_tensors
        temperature, chunk_size, fns = ctx.setup
        grad = grad.reshape(-1)  # [tokens]
        want_hidden, want_weight, want_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        # fp32 accumulators whatever the weight's dtype (bf16 under FSDP's bf16 compute): summing the chunks'
        # contributions in bf16 rounds once per chunk (32 chunks: ~4x the error of one rounding)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if want_weight else None
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if want_bias else None
        for start in range(0, targets.numel(), chunk_size):
            part = slice(start, start + chunk_size)
            if kept is None:
                logits = torch.nn.functional.linear(hidden[part], weight, bias)  # [chunk, vocab], recomputed
            else:
                logits = kept[part]
            grad_logits = fns.backward(logits, targets[part], lse[part], grad[part], temperature)
            del logits
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[part])
            if grad_weight is not None:
                accumulate_matmul(grad_weight, grad_logits.t(), hidden[part])
            if grad_bias is not None:
                grad_bias += grad_logits.sum(0, dtype=torch.float32)
        # cast once; autograd hands the weight a gradient of its own dtype
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        if grad_bias is not None:
            grad_bias = grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None, None


def accumulate_matmul(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b with `out` fp32, accumulated inside the matmul (beta = 1), for fp32 or bf16 `a`, `b`.

    On CUDA a bf16 matmul writes its fp32 result straight into `out` (cuBLAS keeps fp32 accumulators);
    elsewhere a bf16 product is upcast first (CPU has no mixed-dtype matmul).
    """
    if a.dtype == out.dtype:
        out.addmm_(a, b)
    elif out.is_cuda:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.addmm_(a.to(out.dtype), b.to(out.dtype))


def chunked_head_scores(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
    fns: HeadFns = EAGER_HEAD,
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropy) [...] of `targets` [...] from `hidden` [..., hidden] and the head weight [vocab, hidden].

    Targets outside the vocabulary (e.g. −100 for ignored labels) score against token 0; callers mask them.
    `keep_logits`: backward reads the logits forward computed instead of recomputing them (when a gradient
    is wanted; the same values, so the same gradients).
    """
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # [tokens, hidden]
    logprobs, entropy = HeadScores.apply(
        flat_hidden,
        weight,
        bias,
        targets.clamp(0, weight.shape[0] - 1),
        temperature,
        chunk_size,
        with_entropy,
        fns,
        keep_logits,
    )
    return logprobs, entropy if with_entropy else None


class TokenScorer(torch.nn.Module):
    """An HF causal LM whose forward returns target logprobs [rows, seq] (and entropy), not logits.

    The wrapped model keeps its HF parameter names (checkpoints and exported weights use `self.lm`).
    With `moe` (a mixture-of-experts model run by tidal.trainer.moe), each forward records its routing there.
    With `context_parallel` (set by `parallelize` for `perf.cp`), the rows are split along the sequence over
    the cp group, and the returned scores are the whole rows' (tidal.trainer.context_parallel).
    """

    def __init__(
        self,
        lm: torch.nn.Module,
        chunk_size: int = 1024,
        compile_head: bool = False,
        moe: MoERouting | None = None,
        keep_logits: bool = False,
    ):
        super().__init__()
        self.lm = lm
        self.moe = moe
        self.chunk_size = chunk_size
        self.keep_logits = keep_logits
        self.head_fns = compiled_head() if compile_head else EAGER_HEAD
        self.context_parallel: ContextParallel | None = None
        self.autocast_dtype: torch.dtype | None = None
        """None, or (set by `parallelize` for bf16 compute without FSDP2, `perf.fsdp`) the dtype the decoder
        computes in under autocast over the fp32 master weights; the embeddings enter it and the head runs in
        it too, as under FSDP2's bf16 policy."""
        self.accumulate_unsharded: bool | None = None
        """None, or (set by `parallelize` when micro-batches accumulate unsharded, `perf.accumulate_unsharded`)
        the layers' configured reshard-after-forward, restored for each step's last micro-batch."""
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
        token_mask: torch.Tensor | None = None,
        routes: Routes | None = None,
        pictures: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """input_ids, position_ids, targets [rows, seq] → logprobs [rows, seq], entropy [rows, seq] or None.

        token_mask [rows, seq] (True: a real token, False: padding) keeps padding out of MoE routing
        statistics and the load-balancing loss; None counts every token. `routes`: the experts inference
        routed these tokens to, which MoE layers then use (routing replay, tidal.trainer.moe). `pictures`:
        a vision-language model's inputs for the image tokens of the rows (`MicroBatch.picture_tensors`).
        """
        seq = input_ids.shape[1]
        cp = self.context_parallel
        full_positions = position_ids
        if cp is not None:  # this rank's chunk of the rows; attention still needs the whole rows' documents
            if self.moe is not None:  # before the split: the mask defaults to the whole rows' tokens
                token_mask = cp.split_token_mask(token_mask, input_ids)
                routes = None if routes is None else cp.split_routes(routes, input_ids.shape[0])
            input_ids, position_ids, targets, full_positions = cp.split(input_ids, position_ids, targets)
        kwargs: dict[str, Any] = {}
        if self.lm.config._attn_implementation in (ATTN_NAME, CP_ATTN_NAME):  # type: ignore[union-attr,operator]
            kwargs = {
                "tidal_cu_seqlens": document_bounds(full_positions),
                "tidal_max_seqlen": full_positions.shape[1],
            }
        if cp is not None:
            kwargs["tidal_cp_group"] = cp.group
        decoder = getattr(self.lm, str(self.lm.base_model_prefix))  # e.g. Qwen3ForCausalLM.model
        # use_cache=False: with a KV cache transformers ignores the position-id resets of packed rows
        assert routes is None or self.moe is not None, "routes given to a model without MoE layers"
        collect = self.moe.collect(token_mask, routes) if self.moe is not None else contextlib.nullcontext()
        pictures, tile_repeats = self._pictures(pictures)
        distinct_tiles = len(pictures["pixel_values"]) if tile_repeats is not None and pictures else 0
        position_ids = self._positions(decoder, input_ids, position_ids, pictures)
        with collect, self._compute(), repeated_tower(decoder, tile_repeats, distinct_tiles):
            inputs = self._inputs(decoder, input_ids, pictures)
            hidden = decoder(**inputs, position_ids=position_ids, use_cache=False, **kwargs)
        head = self.lm.get_output_embeddings()  # type: ignore[operator]
        states, weight, bias = self._in_compute_dtype(hidden.last_hidden_state, head.weight, head.bias)
        logprobs, entropy = chunked_head_scores(
            states,
            weight,
            bias,
            targets,
            temperature,
            self.chunk_size,
            with_entropy,
            self.head_fns,
            self.keep_logits,
        )
        if cp is None:
            return logprobs, entropy
        return cp.gather(logprobs, seq), None if entropy is None else cp.gather(entropy, seq)

    def _compute(self) -> Any:
        """Autocast to `autocast_dtype` for the decoder (without its cache: each layer casts the weights it
        uses inside its own forward, so activation checkpointing recomputes those casts instead of keeping a
        bf16 copy of the model alive until backward), or nothing."""
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        device = next(self.lm.parameters()).device.type
        return torch.autocast(device, dtype=self.autocast_dtype, cache_enabled=False)

    def _pictures(
        self, pictures: dict[str, torch.Tensor] | None
    ) -> tuple[dict[str, torch.Tensor] | None, Any]:
        """The model's picture inputs and the vision tower's repeat index (`split_repeats`), or as given."""
        if not pictures:
            return pictures, None
        return split_repeats(str(getattr(self.lm.config, "model_type", "")), pictures)

    def _positions(
        self,
        decoder: torch.nn.Module,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        pictures: dict[str, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The rows' text positions, or for a Qwen-VL model its multimodal RoPE positions of each sample
        with the text ones in front ([4, rows, seq]: tidal.models.vision.rope_positions)."""
        config: Any = self.lm.config
        if str(getattr(config, "model_type", "")) not in QWEN_VL_TYPES:
            return position_ids
        # apply_fsdp refuses perf.cp > 1 for these models in one line
        assert self.context_parallel is None, "context parallelism does not split multimodal RoPE positions"
        grid = (pictures or {}).get("image_grid_thw")
        return rope_positions(decoder, input_ids, position_ids, grid, int(config.image_token_id))

    def _inputs(
        self, decoder: torch.nn.Module, input_ids: torch.Tensor, pictures: dict[str, torch.Tensor] | None
    ) -> dict[str, torch.Tensor]:
        """The decoder's inputs: the token ids, or under autocast their embeddings in the compute dtype (an
        embedding lookup is not autocast: fp32 rows would make the whole residual stream fp32). A model that
        sees pictures takes the ids (it finds its image tokens by id) and the pictures' inputs."""
        if hasattr(self.lm.config, "vision_config"):
            from tidal.models.vision import forward_pictures

            kind = str(self.lm.config.model_type)  # type: ignore[union-attr]
            return {"input_ids": input_ids, **forward_pictures(kind, pictures or {})}
        assert not pictures, "pictures given to a model without a vision tower"
        if self.autocast_dtype is None:
            return {"input_ids": input_ids}
        embed = decoder.get_input_embeddings()  # type: ignore[operator]
        return {"inputs_embeds": embed(input_ids).to(self.autocast_dtype)}

    def _in_compute_dtype(self, *tensors: torch.Tensor | None) -> tuple[Any, ...]:
        """Under autocast the head's input, weight and bias cast to the compute dtype (autograd returns fp32
        gradients to the masters); the head itself runs outside autocast, its backward never under it."""
        dtype = self.autocast_dtype
        return tuple(t if t is None or dtype is None else t.to(dtype) for t in tensors)

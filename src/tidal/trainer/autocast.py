"""bf16 compute without FSDP2 (`perf.fsdp`, one GPU): autocast casts the fp32 master weights for the ops it
knows (linear, matmul, SDPA); these helpers cast for the kernels it does not (tidal's varlen flash attention,
the grouped expert matmuls), whose inputs would otherwise arrive in fp32."""

import torch


def in_autocast_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Under autocast the tensors in its dtype (a cast autograd follows: fp32 gradients flow back to fp32
    inputs), outside it as they are. E.g. a model's q/k norms multiply by fp32 master weights, so q and k
    reach the attention in fp32, and the flash varlen kernel takes half precision only."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(t.to(dtype) for t in tensors)

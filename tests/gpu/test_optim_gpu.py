"""The compiled AdamW update on CUDA against the eager one on CPU: same rounding noise, same moments."""

import pytest
import torch

from tidal.trainer import optim

pytestmark = [pytest.mark.gpu]


def _tensors(sizes: list[int]) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [
        [torch.randn(n, generator=gen) for n in sizes],  # params
        [torch.randn(n, generator=gen) for n in sizes],  # grads
        [torch.randn(n, generator=gen).to(torch.bfloat16) for n in sizes],  # exp_avg
        [torch.rand(n, generator=gen).to(torch.bfloat16) for n in sizes],  # exp_avg_sq
    ]


def test_compiled_cuda_update_matches_eager_cpu() -> None:
    scalars = torch.tensor([1e-3, 0.9, 0.999, 1e-8, 0.1, 0.1, 0.001, 0.5])
    seeds = torch.tensor([optim.rounding_seed(3, i, 0) for i in range(4)], dtype=torch.int32)
    for size in (4099, 1 << 20):  # two sizes through the same compiled graph (dynamic size)
        cpu = _tensors([size] * 4)
        cuda = [[t.cuda() for t in group] for group in cpu]
        optim.adamw_update_group_(*cpu, scalars, seeds)
        optim._compiled_update()(*cuda, scalars.cuda(), seeds.cuda())
        for ours, ref in zip(cuda[0], cpu[0], strict=True):
            torch.testing.assert_close(ours.cpu(), ref, rtol=1e-6, atol=1e-7)  # fp32 op order only
        for group in (2, 3):  # moments: same noise words, so the same roundings, except where the fp32
            # values differ by an ulp (fused multiply-add) right at a rounding threshold: ~2^-16 of them
            for a, b in zip(cuda[group], cpu[group], strict=True):
                assert (a.cpu() != b).float().mean() < 1e-3
    assert torch.equal(optim.hash_bits(1000, seeds[0].cuda()).cpu(), optim.hash_bits(1000, seeds[0]))

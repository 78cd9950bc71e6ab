"""The bf16 head on CUDA (FSDP's compute copy): its weight gradient accumulates in fp32 inside cuBLAS, cast once."""

import pytest
import torch

from tidal.trainer import chunked

pytestmark = [pytest.mark.gpu]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_bf16_head_gradient_over_32_chunks_has_about_one_rounding_of_error(compiled):
    gen = torch.Generator().manual_seed(0)
    tokens, hidden_size, vocab, chunk = 2048, 256, 4096, 64
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(torch.bfloat16).cuda()
    weight = (
        (torch.randn(vocab, hidden_size, generator=gen) * 0.05).to(torch.bfloat16).cuda().requires_grad_()
    )
    targets = torch.randint(0, vocab, (tokens,), generator=gen).cuda()
    upstream = torch.randn(tokens, generator=gen).cuda()
    fns = chunked.compiled_head() if compiled else chunked.EAGER_HEAD
    logprobs, _ = chunked.chunked_head_scores(hidden, weight, None, targets, chunk_size=chunk, fns=fns)
    (logprobs * upstream).sum().backward()
    w64 = weight.detach().double().requires_grad_()
    ref = torch.log_softmax(hidden.double() @ w64.t(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    (ref * upstream.double()).sum().backward()
    assert weight.grad is not None and w64.grad is not None
    one_rounding = ((w64.grad.to(torch.bfloat16).double() - w64.grad).norm() / w64.grad.norm()).item()
    error = ((weight.grad.double() - w64.grad).norm() / w64.grad.norm()).item()
    print(f"head grad relative error {error:.5f}, one bf16 rounding {one_rounding:.5f}")
    assert error < 1.6 * one_rounding

"""FlashAttention-4 under tidal's varlen attention (perf.attention_kernel = 'flash4') on a Hopper GPU: the
kernel against the fp32 reference, as close as torch's kernels, and a compiled trainer step through it."""

import pytest
import torch

from tidal.trainer.attention import (
    document_bounds,
    flash4_problem,
    flash_varlen,
    reference_varlen,
    varlen_works,
)
from tidal.trainer.flash4 import flash4_varlen

pytestmark = [pytest.mark.gpu]


def _needs_flash4() -> None:
    problem = flash4_problem(torch.device("cuda"))
    if problem is not None:
        pytest.skip(f"FlashAttention-4: {problem}")


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def test_flash4_matches_fp32_attention_within_documents_as_closely_as_torch_flash():
    """Three documents of a packed row, Qwen3's heads (16 query, 8 key/value, dim 128): outputs and q/k/v
    gradients in bf16 against the fp32 per-document reference, no further off than torch's flash varlen."""
    _needs_flash4()
    assert varlen_works(torch.device("cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = 1000
    cu = torch.tensor([0, 300, 301, tokens], dtype=torch.int32, device="cuda")
    base = [torch.randn(tokens, h, 128, device="cuda", generator=gen) for h in (16, 8, 8)]
    upstream = torch.randn(tokens, 16, 128, device="cuda", generator=gen)

    def run(kernel, dtype):
        q, k, v = (x.detach().clone().to(dtype).requires_grad_() for x in base)
        out = kernel(q, k, v, cu, 700, 128**-0.5)
        (out.float() * upstream).sum().backward()
        return [out, q.grad, k.grad, v.grad]

    want = run(lambda q, k, v, cu, _max_seqlen, scale: reference_varlen(q, k, v, cu, scale), torch.float32)
    errors = {}
    for name, kernel in (("flash4", flash4_varlen), ("torch", flash_varlen)):
        errors[name] = [_relative_error(g, w) for g, w in zip(run(kernel, torch.bfloat16), want, strict=True)]
    print(f"relative error out/dq/dk/dv: {errors}")
    for mine, theirs in zip(errors["flash4"], errors["torch"], strict=True):
        assert mine < max(1.5 * theirs, 1e-2)


def test_compiled_training_step_through_flash4_matches_torch_kernels():
    """A Qwen3-shaped model (2 layers, random init) compiled, bf16 over fp32 masters: logprobs and
    gradients with FlashAttention-4 equal those with torch's kernels within bf16 noise."""
    _needs_flash4()
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from tidal.config.perf import PerfConfig
    from tidal.trainer.parallel import DistInfo, parallelize

    info = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cuda", 0))
    config = Qwen3Config(
        vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, head_dim=128, tie_word_embeddings=True,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (1, 2048), generator=gen).cuda()
    positions = torch.cat([torch.arange(1500), torch.arange(548)]).unsqueeze(0).cuda()  # two documents
    targets = torch.roll(ids, -1, 1)
    results = []
    for kernel in ("torch", "flash4"):
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(config).float().cuda()
        scorer = parallelize(model, info, PerfConfig(attention_kernel=kernel, compile=True))
        assert model.config._attn_implementation == "tidal_varlen"
        logprobs, _ = scorer(ids, positions, targets)
        logprobs.sum().backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        results.append((logprobs.detach(), grads))
        assert document_bounds(positions).tolist() == [0, 1500, 2048]
        torch._dynamo.reset()
    (lp_torch, g_torch), (lp_flash4, g_flash4) = results
    lp_error = (lp_flash4 - lp_torch).abs().max().item()
    g_error = _relative_error(g_flash4, g_torch)
    print(f"flash4 vs torch kernels: logprob max diff {lp_error:.4f}, gradient relative diff {g_error:.4f}")
    assert lp_error < 0.05 and g_error < 0.03

"""Trainer performance features keep the numbers: varlen attention, chunked head, checkpointing, FSDP2 paths."""

import pytest
import torch
import torch.distributed as dist

from tests.unit.models import tiny_lm
from tidal.config.perf import PerfConfig
from tidal.errors import UserError
from tidal.trainer.attention import document_bounds, reference_varlen
from tidal.trainer.chunked import TokenScorer, chunked_head_scores
from tidal.trainer.export import full_state_dict
from tidal.trainer.optim import resolve_state_dtype
from tidal.trainer.parallel import (
    DistInfo,
    mesh_shape,
    parallelize,
    resolve_checkpointing,
    resolve_compile,
    shutdown,
    uses_fsdp,
)

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
DOC_LENGTHS = [5, 9, 3, 7]  # one packed row of 24 tokens


def packed_row(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, position_ids, targets [1, 24]: four documents with restarting positions."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (1, sum(DOC_LENGTHS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in DOC_LENGTHS]).unsqueeze(0)
    targets = torch.randint(0, 61, ids.shape, generator=gen)
    return ids, positions, targets


def plain_logprobs(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The obvious computation: full logits of one document, log_softmax, gather. [1, len]"""
    logits = model(input_ids=ids, use_cache=False).logits.float()  # [1, len, vocab]
    return torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def per_document_logprobs(model: torch.nn.Module, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    parts, start = [], 0
    for n in DOC_LENGTHS:
        parts.append(plain_logprobs(model, ids[:, start : start + n], targets[:, start : start + n]))
        start += n
    return torch.cat(parts, dim=1)  # [1, 24]


@pytest.mark.parametrize("attention", ["varlen", "hf"])
def test_packed_row_scores_equal_each_document_alone(attention):
    model = tiny_lm()
    ids, positions, targets = packed_row()
    with torch.no_grad():
        alone = per_document_logprobs(model, ids, targets)
        scorer = parallelize(model, CPU, PerfConfig(attention=attention, loss_chunk_tokens=7))
        packed, _ = scorer(ids, positions, targets)
        # the check can fail: attending across documents changes every document after the first
        crossed, _ = scorer(ids, torch.arange(ids.shape[1]).unsqueeze(0), targets)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)
    assert (crossed[:, DOC_LENGTHS[0] :] - alone[:, DOC_LENGTHS[0] :]).abs().max() > 1e-3


def test_rows_of_one_document_take_the_plain_causal_path_with_the_same_scores():
    model = tiny_lm()
    ids, _, targets = packed_row()
    positions = torch.arange(ids.shape[1]).expand(2, -1)  # two rows, one document each
    ids, targets = torch.cat([ids, ids.flip(1)]), torch.cat([targets, targets.flip(1)])
    with torch.no_grad():
        want = torch.cat([plain_logprobs(model, ids[i : i + 1], targets[i : i + 1]) for i in range(2)])
        got, _ = parallelize(model, CPU, PerfConfig(attention="varlen"))(ids, positions, targets)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_document_bounds_start_at_position_zero_and_at_each_row():
    positions = torch.tensor([[0, 1, 2, 0, 1], [3, 4, 0, 1, 2]])
    assert document_bounds(positions).tolist() == [0, 3, 5, 7, 10]


def test_reference_varlen_is_causal_attention_per_document_with_grouped_heads():
    q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    got = reference_varlen(q, k, v, torch.tensor([0, 2, 6]), 8**-0.5)
    second = torch.nn.functional.scaled_dot_product_attention(
        q[2:].transpose(0, 1), k[2:].repeat_interleave(2, 1).transpose(0, 1),
        v[2:].repeat_interleave(2, 1).transpose(0, 1), is_causal=True,
    ).transpose(0, 1)  # fmt: skip
    torch.testing.assert_close(got[2:], second)
    torch.testing.assert_close(got[0], v[0].repeat_interleave(2, 0))  # first token sees only itself


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("compile_head", [False, True], ids=["eager", "compiled"])
def test_chunked_head_gives_the_full_logits_values_entropy_and_gradients(tied, compile_head):
    reference, model = tiny_lm(tied=tied), tiny_lm(tied=tied)
    ids, positions, targets = packed_row()
    positions = torch.arange(ids.shape[1]).unsqueeze(0)  # one document: compare with a plain forward
    logits = reference(input_ids=ids, use_cache=False).logits / 0.7  # [1, 24, vocab]
    want = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    want_entropy = torch.distributions.Categorical(logits=logits).entropy()
    want.sum().backward()

    scorer = TokenScorer(model, chunk_size=5, compile_head=compile_head)
    got, entropy = scorer(ids, positions, targets, temperature=0.7, with_entropy=True)
    got.sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(entropy, want_entropy.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_chunked_head_keeps_no_full_logits_for_backward():
    hidden = torch.randn(64, 16, requires_grad=True)
    weight = torch.randn(1000, 16, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        logprobs, _ = chunked_head_scores(
            hidden, weight, None, torch.zeros(64, dtype=torch.long), chunk_size=8
        )
    assert max(saved) < 64 * 1000  # the [tokens, vocab] logits would be 64000 elements
    logprobs.sum().backward()
    assert hidden.grad is not None and weight.grad is not None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_logits_give_the_same_scores_and_gradients(dtype):
    """keep_logits: backward reads forward's logits, the values it would recompute, so nothing changes."""
    gen = torch.Generator().manual_seed(0)
    base_hidden, base_weight = torch.randn(64, 16, generator=gen), torch.randn(1000, 16, generator=gen) / 4
    targets = torch.randint(0, 1000, (64,), generator=gen)
    results = []
    for keep in (False, True):
        hidden = base_hidden.to(dtype).requires_grad_()
        weight = base_weight.to(dtype).requires_grad_()
        saved: list[int] = []

        def pack(t: torch.Tensor, saved: list[int] = saved) -> torch.Tensor:
            saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logprobs, entropy = chunked_head_scores(
                hidden, weight, None, targets, 0.8, chunk_size=8, with_entropy=True, keep_logits=keep
            )
        (logprobs * torch.linspace(-1, 1, 64)).sum().backward()
        results.append((logprobs, entropy, hidden.grad, weight.grad))
        assert (max(saved) == 64 * 1000) == keep  # the [tokens, vocab] logits, kept only when asked
    for want, got in zip(*results, strict=True):
        assert torch.equal(want, got)


def test_kept_logits_save_one_head_matmul_in_backward():
    """One chunk (24 tokens < loss_chunk_tokens): recomputing its logits is one backward matmul."""
    recomputed = count_backward_matmuls(PerfConfig(activation_checkpointing="none"))
    kept = count_backward_matmuls(PerfConfig(activation_checkpointing="none", keep_logits=True))
    assert kept == recomputed - 1


def test_flash4_kernel_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="attention_kernel"):
        PerfConfig(attention="hf", attention_kernel="flash4")
    with pytest.raises(UserError) as info:  # this machine has no GPU
        parallelize(tiny_lm(), CPU, PerfConfig(attention_kernel="flash4"))
    message = str(info.value)
    assert "perf.attention_kernel = 'flash4'" in message and "CUDA GPU" in message and "\n" not in message


def test_auto_attention_kernel_takes_flash4_only_where_it_is_installed_and_passes_its_check(
    monkeypatch, capsys
):
    """`auto`: torch's kernels on a CPU or without the package; FlashAttention-4 where the package is there and
    matches the reference; torch's again, with the reason on one line, where its check fails."""
    from tidal.trainer import parallel

    gpu = torch.device("cuda", 0)
    auto = PerfConfig()
    assert parallel.resolve_attention_kernel(auto, CPU.device) == "torch"
    monkeypatch.setattr(
        parallel, "flash4_missing", lambda device: "the flash-attn-4 package is not installed"
    )
    assert parallel.resolve_attention_kernel(auto, gpu) == "torch"
    monkeypatch.setattr(parallel, "flash4_missing", lambda device: None)
    checked = []
    monkeypatch.setattr(parallel, "flash4_problem", lambda device, shape: checked.append(shape))
    assert parallel.resolve_attention_kernel(auto, gpu) == "flash4"
    # the check runs with the model's heads and head dim (kernels support some head dims only)
    model = tiny_lm()
    shape = parallel.attention_shape(model)
    assert shape == (
        model.config.num_attention_heads,
        model.config.num_key_value_heads,
        model.config.head_dim,
    )
    assert parallel.resolve_attention_kernel(auto, gpu, shape) == "flash4" and checked[-1] == shape
    assert parallel.resolve_attention_kernel(PerfConfig(attention_kernel="torch"), gpu) == "torch"
    assert parallel.resolve_attention_kernel(PerfConfig(attention="hf"), gpu) == "torch"
    assert capsys.readouterr().out == ""
    monkeypatch.setattr(
        parallel, "flash4_problem", lambda device, shape: "its output differs from the SDPA reference"
    )
    assert parallel.resolve_attention_kernel(auto, gpu) == "torch"
    printed = capsys.readouterr().out
    assert "not FlashAttention-4 (its output differs" in printed and printed.count("\n") == 1
    with pytest.raises(UserError, match="differs from the SDPA reference"):
        parallel.resolve_attention_kernel(PerfConfig(attention_kernel="flash4"), gpu)


def test_flash4_ops_have_shapes_for_compiled_graphs():
    """torch.compile traces the FlashAttention-4 ops by their fake implementations (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tidal.trainer.flash4 import flash4_backward, flash4_forward

    with FakeTensorMode():
        q, k, v = (
            torch.empty(40, 8, 64, dtype=torch.bfloat16),
            *torch.empty(2, 40, 2, 64, dtype=torch.bfloat16),
        )
        cu = torch.tensor([0, 16, 40], dtype=torch.int32)
        out, lse = flash4_forward(q, k, v, cu, 24, 0.125)
        dq, dk, dv = flash4_backward(out, q, k, v, out, lse, cu, 24, 0.125)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (8, 40) and lse.dtype == torch.float32
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


@pytest.mark.parametrize(
    "perf",
    [
        PerfConfig(activation_checkpointing="full"),
        PerfConfig(activation_checkpointing="selective"),
        PerfConfig(activation_checkpointing="projections", attention="varlen"),
        PerfConfig(activation_checkpointing="attention", attention="varlen"),
        PerfConfig(activation_checkpointing="full", checkpoint_every=2, attention="varlen"),
        PerfConfig(activation_checkpointing="projections", attention="varlen", save_mlp_layers=2),
        PerfConfig(activation_checkpointing="matmuls", attention="varlen"),
    ],
    ids=["full", "selective", "projections", "attention", "every-2", "projections+mlp", "matmuls"],
)
def test_activation_checkpointing_keeps_gradients(perf):
    ids, positions, targets = packed_row()
    grads = []
    for config in (PerfConfig(activation_checkpointing="none", attention=perf.attention), perf):
        model = tiny_lm()
        logprobs, _ = parallelize(model, CPU, config)(ids, positions, targets)
        logprobs.sum().backward()
        grads.append([p.grad for p in model.parameters()])
    for plain, checkpointed in zip(*grads, strict=True):
        torch.testing.assert_close(checkpointed, plain)


def count_backward_matmuls(perf: PerfConfig) -> int:
    """Matmuls that the backward of one packed row runs under `perf` (its own and recomputed ones)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    count = [0]

    class CountMatmuls(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            count[0] += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
            return func(*args, **(kwargs or {}))

    ids, positions, targets = packed_row()
    logprobs, _ = parallelize(tiny_lm(), CPU, perf)(ids, positions, targets)
    with CountMatmuls():
        logprobs.sum().backward()
    return count[0]


def test_saving_mlp_inputs_removes_their_recomputation_in_the_last_layers():
    """Backward matmuls of a 3-layer model: `projections` recomputes gate and up in every layer;
    save_mlp_layers=2 recomputes them in the first layer only (2 × 2 fewer matmuls)."""
    counts = [
        count_backward_matmuls(
            PerfConfig(activation_checkpointing="projections", attention="varlen", save_mlp_layers=saved)
        )
        for saved in (0, 2)
    ]
    assert counts[0] - counts[1] == 4, counts


def test_matmuls_checkpointing_recomputes_no_matmul_in_backward():
    """`matmuls` keeps what `projections` keeps plus gate and up in every layer: backward runs exactly the
    matmuls of the run that keeps everything, while `projections` recomputes 2 per layer (3 layers)."""
    runs = {
        mode: count_backward_matmuls(PerfConfig(activation_checkpointing=mode, attention="varlen"))
        for mode in ("none", "matmuls", "projections")
    }
    assert runs["matmuls"] == runs["none"] and runs["projections"] - runs["none"] == 2 * 3, runs


def test_save_mlp_layers_with_a_mode_where_it_does_nothing_is_a_config_error():
    for mode in ("none", "full", "matmuls"):
        with pytest.raises(ValueError, match="save_mlp_layers"):
            PerfConfig(activation_checkpointing=mode, save_mlp_layers=2)


def gradients_and_logprobs(model: torch.nn.Module, perf: PerfConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [1, 24], every parameter's gradient flattened into one fp32 vector) of one packed row."""
    ids, positions, targets = packed_row()
    try:
        logprobs, _ = parallelize(model, CPU, perf)(ids, positions, targets)
        logprobs.sum().backward()
        grads = [getattr(p.grad, "full_tensor", lambda g=p.grad: g)() for p in model.parameters()]
    finally:
        shutdown(CPU)
    return logprobs.detach(), torch.cat([g.flatten() for g in grads])


@pytest.mark.parametrize("mode", ["projections", "none"])
def test_bf16_without_fsdp_trains_fp32_masters_as_closely_as_fsdp(mode):
    """perf.fsdp = false (one GPU's default), on CPU: autocast computes in bf16 over the fp32 masters, which
    keep their dtype, HF names and plain tensors, and the gradients are as close to fp32's as FSDP2's."""
    names = set(tiny_lm().state_dict())
    fp32_logprobs, fp32_grads = gradients_and_logprobs(tiny_lm(), PerfConfig(attention="varlen"))
    errors = {}
    for fsdp in (True, False):
        model = tiny_lm()
        perf = PerfConfig(
            mixed_precision="bf16", attention="varlen", fsdp=fsdp, activation_checkpointing=mode
        )
        logprobs, grads = gradients_and_logprobs(model, perf)
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
        if not fsdp:
            assert set(model.state_dict()) == names
            assert not any(hasattr(p, "to_local") for p in model.parameters())  # no DTensor: no FSDP2
        logprob_error = (logprobs - fp32_logprobs).abs().max().item()
        errors[fsdp] = ((grads - fp32_grads).norm() / fp32_grads.norm()).item()
        assert 0 < logprob_error < 0.05 and errors[fsdp] > 0  # it did compute in bf16
    # measured on this model: FSDP2 0.84%, autocast 0.81% relative gradient error
    assert errors[False] < 1.5 * errors[True], errors


def test_one_gpu_trains_without_fsdp_unless_it_is_needed():
    gpu = DistInfo(0, 1, 0, 1, torch.device("cuda", 0))
    two = DistInfo(0, 2, 0, 2, torch.device("cuda", 0))
    assert not uses_fsdp(PerfConfig(), gpu)
    assert uses_fsdp(PerfConfig(fsdp=True), gpu)
    assert uses_fsdp(PerfConfig(cpu_offload=True), gpu)
    assert uses_fsdp(PerfConfig(), two)
    assert uses_fsdp(PerfConfig(mixed_precision="bf16"), CPU) and not uses_fsdp(PerfConfig(), CPU)
    for perf, info, named in [
        (PerfConfig(fsdp=False), two, "2 trainer ranks"),
        (PerfConfig(fsdp=False, cpu_offload=True), gpu, "cpu_offload"),
        (PerfConfig(reshard_after_forward=False), gpu, "reshard_after_forward"),
    ]:
        with pytest.raises(UserError, match=named):
            uses_fsdp(perf, info)


def test_bf16_fsdp_on_one_rank_keeps_fp32_masters_and_hf_names():
    """The single-GPU path, on CPU: a 1-rank group, FSDP2 with bf16 compute, fp32 weights and gradients."""
    reference, model = tiny_lm(), tiny_lm()
    names = set(reference.state_dict())
    ids, positions, targets = packed_row()
    try:
        scorer = parallelize(model, CPU, PerfConfig(mixed_precision="bf16", attention="varlen"))
        assert dist.is_initialized() and dist.get_world_size() == 1
        logprobs, _ = scorer(ids, positions, targets)
        logprobs.sum().backward()
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
        state = full_state_dict(model)
    finally:
        shutdown(CPU)
    assert set(state) == names
    with torch.no_grad():
        want = per_document_logprobs(reference, ids, targets)
    error = (logprobs.detach() - want).abs().max().item()
    assert 0 < error < 0.1  # bf16 compute: close to fp32, but not bit-equal (it did run in bf16)


def test_bf16_moment_adamw_clips_and_steps_fsdp_parameters():
    """tidal's AdamW on FSDP2's DTensor parameters: the norm over all shards, clipped update, bf16 moments."""
    from tidal.trainer.optim import AdamW, clip_and_step

    model = tiny_lm()
    ids, positions, targets = packed_row()
    try:
        scorer = parallelize(model, CPU, PerfConfig(mixed_precision="bf16", attention="varlen"))
        optimizer = AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
        before = [p.detach().to_local().clone() for p in model.parameters()]
        logprobs, _ = scorer(ids, positions, targets)
        (-logprobs.sum() * 100).backward()
        want = torch.stack([p.grad.to_local().norm() for p in model.parameters()]).norm()
        norm = clip_and_step(optimizer, model.parameters(), max_norm=1.0)
        moments = [optimizer.state[p]["exp_avg"].to_local() for p in model.parameters()]
        after = [p.detach().to_local() for p in model.parameters()]
    finally:
        shutdown(CPU)
    assert not hasattr(norm, "to_local") and norm.item() == pytest.approx(want.item(), rel=1e-5)
    assert norm.item() > 1  # so the update ran with a clipping factor below one
    assert all(m.dtype == torch.bfloat16 for m in moments)
    # Adam's first step moves each weight by ~lr whatever the gradient's scale: all weights with a gradient
    moved = torch.cat([(a - b).abs().flatten() for a, b in zip(after, before, strict=True)])
    assert (moved > 5e-3).float().mean() > 0.9


def test_defaults_keep_cpu_runs_eager_in_fp32_without_checkpointing():
    assert resolve_checkpointing(PerfConfig(), CPU) == "none"
    assert not resolve_compile(PerfConfig(), CPU, 8_000_000_000)
    assert resolve_state_dtype(PerfConfig().optimizer_state, CPU.device, 8_000_000_000) == torch.float32
    gpu = DistInfo(0, 1, 0, 1, torch.device("cuda", 0))
    assert resolve_checkpointing(PerfConfig(), gpu) == "projections"
    assert resolve_compile(PerfConfig(), gpu, 4_000_000_000)
    # a small model starts eager: its first step would spend over a minute compiling sub-second steps
    assert not resolve_compile(PerfConfig(), gpu, 135_000_000)
    assert resolve_compile(PerfConfig(compile=True), gpu, 135_000_000)
    assert not resolve_compile(PerfConfig(compile=False), gpu, 4_000_000_000)
    assert resolve_state_dtype(PerfConfig().optimizer_state, gpu.device, 4_000_000_000) == torch.bfloat16
    # below 1B, bf16 moments save little and their compiled update made the first step 23 s longer
    assert resolve_state_dtype(PerfConfig().optimizer_state, gpu.device, 135_000_000) == torch.float32
    assert resolve_state_dtype("bf16", gpu.device, 135_000_000) == torch.bfloat16


def test_mesh_shape_for_fsdp_and_hsdp():
    assert mesh_shape(8, 1) == (8,)
    assert mesh_shape(8, 2) == (2, 4)
    with pytest.raises(ValueError, match="does not divide"):
        mesh_shape(6, 4)


def test_matmul_numbering_skips_lora_low_rank_matmuls():
    """`projections` keeps q, k, v, o also when each of them runs LoRA's two extra low-rank matmuls."""
    from tidal.trainer.checkpointing import SAVED_MATMULS, MatmulPicker

    hidden, rank = 64, 8
    base = ((32, hidden), (hidden, 96))  # [tokens, in] @ [in, out]
    lora = [((32, hidden), (hidden, rank)), ((32, rank), (rank, 96))]  # x·Aᵀ, then ·Bᵀ
    layer = [m for _ in range(7) for m in (base, *lora)]  # q, k, v, o, gate, up, down, each with LoRA
    picker = MatmulPicker(SAVED_MATMULS["projections"], low_rank=rank)
    kept = [i for i, (left, right) in enumerate(layer) if picker.keep(left, right)]
    assert kept == [0, 3, 6, 9]  # the base matmuls of q, k, v, o
    plain = MatmulPicker(SAVED_MATMULS["projections"])
    assert [i for i in range(7) if plain.keep(*base)] == [0, 1, 2, 3]


def test_lora_rank_is_found_in_adapted_layers():
    from tidal.config.lora import LoraConfig
    from tidal.trainer.checkpointing import lora_rank
    from tidal.trainer.lora import apply_lora

    model = tiny_lm()
    layers = list(model.model.layers)
    assert lora_rank(layers) is None
    apply_lora(model, LoraConfig(rank=4))
    assert lora_rank(layers) == 4


def test_out_of_memory_in_a_step_becomes_a_one_line_error_with_what_to_change():
    from tidal.errors import UserError
    from tidal.trainer.session import out_of_memory_as_user_error

    with pytest.raises(UserError) as caught, out_of_memory_as_user_error(7, CPU):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    message = str(caught.value)
    assert message.startswith("GPU out of memory in training step 7 on rank 0")
    assert "\n" not in message and "activation_checkpointing" in message and "seq_len" in message
    with pytest.raises(ValueError), out_of_memory_as_user_error(7, CPU):  # anything else passes through
        raise ValueError("not memory")


def sliding_qwen3(window: int = 4) -> torch.nn.Module:
    """The tiny Qwen3 with a sliding window of `window` tokens on every layer."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=61, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, use_sliding_window=True, sliding_window=window, max_window_layers=0,
        attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config)


def gpt_oss_like() -> torch.nn.Module:
    """A tiny GPT-OSS: attention sinks (s_aux) on every layer, a sliding window on every second one."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        vocab_size=61, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=4,
    )  # fmt: skip
    return GptOssForCausalLM(config)


@pytest.mark.parametrize(
    "make,named", [(sliding_qwen3, "sliding_window"), (gpt_oss_like, "s_aux")], ids=["qwen3-swa", "gpt-oss"]
)
def test_varlen_attention_refuses_a_model_whose_attention_it_cannot_do(make, named):
    """Before: the window / sinks went into **kwargs and the model trained with full attention."""
    from tidal.errors import UserError

    model = make()
    with pytest.raises(UserError) as info:
        parallelize(model, CPU, PerfConfig(attention="varlen"))
    message = str(info.value)
    assert named in message and type(model).__name__ in message and "perf.attention" in message
    assert "\n" not in message


def test_sliding_window_model_keeps_its_window_under_auto_attention():
    model = sliding_qwen3(window=4)
    ids, _, targets = packed_row()
    ids, targets = ids[:, :16], targets[:, :16]
    with torch.no_grad():
        want = plain_logprobs(model, ids, targets)  # HF's own sliding-window attention
        got, _ = parallelize(model, CPU, PerfConfig())(ids, torch.arange(16).unsqueeze(0), targets)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_auto_attention_picks_hf_for_models_varlen_cannot_do():
    from tidal.trainer.parallel import choose_attention

    assert choose_attention("auto", flash=True, unsupported=None) == "varlen"
    assert choose_attention("auto", flash=True, unsupported="sliding_window = 4") == "hf"
    assert choose_attention("auto", flash=False, unsupported=None) == "hf"
    assert choose_attention("hf", flash=True, unsupported=None) == "hf"


def test_varlen_attention_call_with_a_window_or_sinks_fails_instead_of_ignoring_them():
    from tidal.errors import UserError
    from tidal.trainer.attention import varlen_attention_forward

    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    bounds = torch.tensor([0, 2, 6], dtype=torch.int32)
    extra = {"tidal_cu_seqlens": bounds, "tidal_max_seqlen": 6}
    varlen_attention_forward(torch.nn.Module(), q, k, v, None, sliding_window=None, **extra)  # None: fine
    for name, value in [
        ("sliding_window", 4),
        ("s_aux", torch.zeros(4)),
        ("softcap", 30.0),
        ("dropout", 0.1),
    ]:
        with pytest.raises(UserError, match=name):
            varlen_attention_forward(torch.nn.Module(), q, k, v, None, **{name: value}, **extra)


def accumulated_gradients(accumulate_unsharded: bool) -> tuple[list[torch.Tensor], list[bool]]:
    """Three micro-batches of one step through FSDP2 on one rank (bf16 compute): the fp32 gradients at the
    end, and after each micro-batch whether the sharded parameters held a gradient yet."""
    from tidal.trainer.parallel import micro_batches

    model = tiny_lm()
    rows = [packed_row(seed) for seed in (1, 2, 3)]
    perf = PerfConfig(mixed_precision="bf16", attention="varlen", accumulate_unsharded=accumulate_unsharded)
    reduced = []
    try:
        scorer = parallelize(model, CPU, perf)
        for ids, positions, targets in micro_batches(scorer, rows):
            logprobs, _ = scorer(ids, positions, targets)
            (-logprobs.sum()).backward()
            reduced.append(all(p.grad is not None for p in model.parameters()))
        grads = [p.grad.to_local().clone() for p in model.parameters()]
        # the step's last micro-batch gave the layers back their resharding: the next forward gathers anew
        assert all(not m._get_fsdp_state()._fsdp_param_group.is_unsharded for m in scorer.lm.model.layers)
    finally:
        shutdown(CPU)
    return grads, reduced


def test_micro_batches_accumulated_unsharded_reduce_once_to_the_same_gradients():
    """perf.accumulate_unsharded: no gradient reduce (nor reshard) until the step's last micro-batch, and the
    fp32 gradients it then reduces are those of reducing after every micro-batch."""
    held, held_reduced = accumulated_gradients(True)
    every, every_reduced = accumulated_gradients(False)
    assert held_reduced == [False, False, True] and every_reduced == [True, True, True]
    for a, b in zip(held, every, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)  # both accumulate in fp32


def test_a_checkpoint_written_under_fsdp2_resumes_without_it(tmp_path):
    """One-GPU runs trained through FSDP2 before `perf.fsdp`: their checkpoints (DTensor state) load into the
    autocast path's plain tensors, weights and AdamW moments exactly."""
    from tidal.config.common import OptimConfig
    from tidal.trainer import ckpt
    from tidal.trainer.optim import build_optimizer

    ids, positions, targets = packed_row()
    model = tiny_lm()
    try:
        scorer = parallelize(model, CPU, PerfConfig(mixed_precision="bf16", fsdp=True))
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2))
        (-scorer(ids, positions, targets)[0].mean()).backward()
        optimizer.step()
        ckpt.save_checkpoint(tmp_path, 1, model, optimizer, {}, CPU, keep_last=1)
        want = [p.full_tensor().clone() for p in model.parameters()]
        moments = [optimizer.state[p]["exp_avg"].full_tensor().clone() for p in model.parameters()]
    finally:
        shutdown(CPU)
    resumed = tiny_lm()
    parallelize(resumed, CPU, PerfConfig(mixed_precision="bf16", fsdp=False))
    optimizer = build_optimizer(resumed, OptimConfig(lr=1e-2))
    assert ckpt.load_checkpoint(tmp_path / "step_1", resumed, optimizer, CPU)["step"] == 1
    for param, weight, moment in zip(resumed.parameters(), want, moments, strict=True):
        assert not hasattr(param, "to_local")
        torch.testing.assert_close(param.detach(), weight, rtol=0, atol=0)
        torch.testing.assert_close(optimizer.state[param]["exp_avg"], moment, rtol=0, atol=0)


def test_selective_checkpointing_keeps_flash4_attention_and_its_gradients_flow():
    """The FlashAttention-4 op (given a CPU kernel here: the SDPA reference) is kept like torch's attention
    kernels, so backward never reruns it (before: every selective mode recomputed it, 4B `matmuls` ran
    4% slower with it than with cuDNN); its autograd registration gives the reference's gradients."""
    from tidal.trainer.checkpointing import selective_context
    from tidal.trainer.flash4 import flash4_backward, flash4_forward, flash4_varlen

    calls = []

    def forward_cpu(q, k, v, cu_seqlens, max_seqlen, scale):
        calls.append(1)
        out = reference_varlen(q, k, v, cu_seqlens, scale)
        return out, q.new_zeros((q.shape[1], q.shape[0]))

    def backward_cpu(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
        _, vjp = torch.func.vjp(lambda *qkv: reference_varlen(*qkv, cu_seqlens, scale), q, k, v)
        return vjp(dout)

    flash4_forward.register_kernel("cpu", forward_cpu)
    flash4_backward.register_kernel("cpu", backward_cpu)
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(12, h, 8, generator=gen) for h in (4, 2, 2)]
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)

    def layer(q, k, v):
        return torch.nn.functional.gelu(flash4_varlen(q, k, v, cu, 7, 8**-0.5)).sum()

    grads = []
    for checkpointed in (True, False):
        qkv = [x.clone().requires_grad_() for x in base]
        if checkpointed:
            loss = torch.utils.checkpoint.checkpoint(
                layer, *qkv, use_reentrant=False, context_fn=selective_context(frozenset())
            )
        else:
            loss = torch.nn.functional.gelu(reference_varlen(*qkv, cu, 8**-0.5)).sum()
        loss.backward()
        grads.append([x.grad for x in qkv])
        if checkpointed:
            assert len(calls) == 1  # forward only: the output was kept for backward
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want)

"""Trainer throughput, MFU and peak memory: tidal's training step against a plain transformers step.

Random-init models with Qwen3 and Qwen3-MoE shapes (configs below, no hub access; `name:N` keeps the first N
decoder layers of a shape, e.g. `qwen3-30b-a3b:16`). For each model, in one process and on the same packed
row (documents of random lengths, positions restarting per document; or one document):

- `hf`: the plain transformers step — bf16 parameters, fused AdamW, SDPA (documents masked through the
  position-id resets), HF gradient checkpointing, the model's own loss on full logits; for an MoE model its
  default experts implementation (`grouped_mm` in transformers 5; `hf:eager` for its loop over experts) and
  its load-balancing loss (`output_router_logits`), as tidal adds the same loss;
- `hf+none`: the same without checkpointing; `liger` / `liger+ckpt`: the same with Liger's kernels (RoPE,
  RMSNorm, SwiGLU, and the fused linear cross-entropy that never builds full logits), without / with full
  checkpointing — what TRL users run for speed (`pip install liger-kernel`);
- `tidal`: `tidal.trainer.sft.train_step` after `parallelize` — bf16 compute over fp32 master weights (on
  one GPU by autocast, `+fsdp` variants through FSDP2 as with several GPUs), AdamW with bf16 moments, varlen
  flash attention, activation checkpointing as configured, chunked head, grad clipping.

`--docs rl`: tidal's RL step (`tidal.trainer.rl.rl_step`: logprobs, entropy, importance ratios, the RL loss)
on RL-shaped samples (groups of 8 completions of 32-256 tokens after 64-192-token prompts) packed as the
orchestrator packs them, tokens/s counting real tokens; compare it with `--docs single`.

MFU = (6·params + 6·layers·seq·heads·head_dim) · tokens/s ÷ 989e12 (H100/H200 dense bf16), as in NOTES.md;
for an MoE model `params` are the active ones, what one token's forward multiplies by (MOE_MFU_FORMULA).

    python benchmarks/trainer_mfu.py --models qwen3-4b --seq 16384 --out benchmarks/results/trainer_mfu_h200.json
    python benchmarks/trainer_mfu.py --device cpu --models tiny --seq 256 --steps 1 --warmup 1   # smoke test
    torchrun --nproc-per-node 2 benchmarks/trainer_mfu.py --impls tidal:default   # FSDP2 over 2 GPUs, per GPU
    python benchmarks/trainer_mfu.py --models qwen3-30b-a3b:16 --seq 16384 --docs packed,single \
        --impls hf,tidal:default,tidal:eager --out benchmarks/results/trainer_mfu_moe_h200.json
    python benchmarks/trainer_mfu.py --device cpu --models tiny-moe --seq 256 --steps 2 --warmup 1   # MoE smoke
"""

import argparse
import contextlib
import gc
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

PEAK_FLOPS = 989e12
MFU_FORMULA = (
    "(6·params + 6·layers·span·heads·head_dim) · tokens/s ÷ 989 TFLOP/s (H200 bf16 dense); span = "
    "sum(len²)/sum(len) over the row's documents (the row's length for one document)"
)
MOE_MFU_FORMULA = (
    "(6·active_params + 6·layers·span·heads·head_dim) · tokens/s ÷ 989 TFLOP/s (H200 bf16 dense); "
    "active_params = what one token's forward multiplies by: attention, norms, router, the top-k experts' MLPs "
    "(k of the E experts of each MoE layer) and the LM head, without the input embedding (a lookup) and the "
    "other E − k experts; span as for dense models"
)
QWEN3 = {"vocab_size": 151936, "head_dim": 128, "num_key_value_heads": 8, "tie_word_embeddings": True}
CONFIGS: dict[str, dict[str, Any]] = {
    # architecture fields of Qwen/Qwen3-*'s config.json
    "qwen3-0.6b": {**QWEN3, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16},
    "qwen3-1.7b": {**QWEN3, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16},
    "qwen3-4b": {**QWEN3, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32},
    "qwen3-8b": {**QWEN3, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "tie_word_embeddings": False},
    "tiny": {"vocab_size": 1000, "head_dim": 16, "num_key_value_heads": 2, "tie_word_embeddings": True,
             "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4},
    # architecture fields of Qwen/Qwen3-30B-A3B's config.json (48 layers; `qwen3-30b-a3b:N` keeps N of them)
    "qwen3-30b-a3b": {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48, "head_dim": 128,
                      "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False,
                      "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
                      "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "router_aux_loss_coef": 0.001, "rope_theta": 1_000_000.0,
                      "rms_norm_eps": 1e-6, "max_position_embeddings": 40960},
    # a CPU smoke test of the MoE paths: 8 experts, top-2, untied head like Qwen3-30B-A3B's
    "tiny-moe": {"vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2, "head_dim": 16,
                 "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
                 "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
                 "num_experts_per_tok": 2, "norm_topk_prob": True, "decoder_sparse_step": 1,
                 "mlp_only_layers": [], "router_aux_loss_coef": 0.001},
}  # fmt: skip
# tidal variants: name -> PerfConfig fields (the default is PerfConfig's defaults)
VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "full": {"activation_checkpointing": "full"},
    "selective": {"activation_checkpointing": "selective"},
    "attention": {"activation_checkpointing": "attention"},
    "every2": {"activation_checkpointing": "full", "checkpoint_every": 2},
    "none": {"activation_checkpointing": "none"},
    "compile": {"compile": True},
    "attention-compile": {"activation_checkpointing": "attention", "compile": True},
    "selective-compile": {"activation_checkpointing": "selective", "compile": True},
    "every2-compile": {"activation_checkpointing": "full", "checkpoint_every": 2, "compile": True},
    "none-compile": {"activation_checkpointing": "none", "compile": True},
    "projections-compile": {"activation_checkpointing": "projections", "compile": True},
    "eager": {"compile": False},
    "matmuls": {"activation_checkpointing": "matmuls"},
    # FSDP2 on one GPU, as every one-GPU run trained before perf.fsdp (auto: without FSDP2 on one GPU)
    "default+fsdp": {"fsdp": True},
    "matmuls+fsdp": {"activation_checkpointing": "matmuls", "fsdp": True},
    "none+fsdp": {"activation_checkpointing": "none", "fsdp": True},
    "default+nofsdp": {"fsdp": False},  # a mixture-of-experts model, which `auto` keeps under FSDP2
    # the head's logits kept for backward (perf.keep_logits) and FlashAttention-4 (perf.attention_kernel)
    "default+logits": {"keep_logits": True},
    "matmuls+logits": {"activation_checkpointing": "matmuls", "keep_logits": True},
    "none+logits": {"activation_checkpointing": "none", "keep_logits": True},
    "default+fa4": {"attention_kernel": "flash4"},
    "matmuls+fa4": {"activation_checkpointing": "matmuls", "attention_kernel": "flash4"},
    "none+fa4": {"activation_checkpointing": "none", "attention_kernel": "flash4"},
    "matmuls+fa4+logits": {
        "activation_checkpointing": "matmuls",
        "attention_kernel": "flash4",
        "keep_logits": True,
    },
    "none+fa4+logits": {
        "activation_checkpointing": "none",
        "attention_kernel": "flash4",
        "keep_logits": True,
    },
    "full+fa4": {"activation_checkpointing": "full", "attention_kernel": "flash4"},
}


def model_config(name: str) -> dict[str, Any]:
    """The architecture fields of `name`: a key of CONFIGS, or `key:N` for its first N decoder layers."""
    base, _, layers = name.partition(":")
    if base not in CONFIGS:
        raise SystemExit(f"unknown model {base!r}: one of {', '.join(CONFIGS)}, optionally as NAME:LAYERS")
    config = dict(CONFIGS[base])
    if layers:
        config["num_hidden_layers"] = int(layers)
    return config


def is_moe(config: dict[str, Any]) -> bool:
    return config.get("num_experts", 0) > 0


def build_model(
    name: str, dtype: torch.dtype, device: torch.device, seed: int, experts: str | None = None
) -> torch.nn.Module:
    """A random-init Qwen3 (or Qwen3-MoE) of `name`'s shape; `experts` is transformers' experts implementation
    for an MoE model (None: its default)."""
    fields = model_config(name)
    if is_moe(fields):
        from transformers import Qwen3MoeConfig as Config
        from transformers import Qwen3MoeForCausalLM as Model

        if experts is not None:
            fields["experts_implementation"] = experts
    else:
        from transformers import Qwen3Config as Config  # type: ignore[assignment]
        from transformers import Qwen3ForCausalLM as Model  # type: ignore[assignment]
    config = Config(**fields, attn_implementation="sdpa", use_cache=False)
    torch.manual_seed(seed)
    with device:  # initialise in place on the GPU: seconds, not minutes
        model = Model(config)
    return model.to(dtype)


def document_lengths(seq: int, layout: str, seed: int) -> list[int]:
    """`single`: one document; `packed`: random lengths in [seq/32, seq/4] filling the row exactly."""
    if layout == "single":
        return [seq]
    gen = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < seq:
        lengths.append(int(torch.randint(seq // 32, seq // 4 + 1, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - seq
    return lengths


def make_row(seq: int, vocab: int, lengths: list[int], seed: int) -> dict[str, list[int]]:
    """One packed row: ids, restarting positions, next-token targets within each document (−100 at its end)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (seq,), generator=gen).tolist()
    positions, targets, start = [], [], 0
    for n in lengths:
        positions += list(range(n))
        targets += ids[start + 1 : start + n] + [-100]
        start += n
    return {"input_ids": ids, "position_ids": positions, "targets": targets}


def model_flops_per_token(config: dict[str, Any], num_params: int, span: float) -> float:
    """Training FLOPs per token: 6 per parameter (per active parameter for an MoE model, `num_params` being
    all of them), plus causal attention over `span` keys on average (the forward's 2·2·span·heads·dim per
    layer for scores and values, halved by the causal mask, times 3 for the backward)."""
    params = active_params(config, num_params) if is_moe(config) else num_params
    attention = 6 * config["num_hidden_layers"] * span * config["num_attention_heads"] * config["head_dim"]
    return 6 * params + attention


def active_params(config: dict[str, Any], num_params: int) -> int:
    """An MoE model's parameters that one token's forward multiplies by (MOE_MFU_FORMULA): all `num_params`
    but the input embedding (a lookup; with tied weights the same matrix is the head, which counts) and, in
    every MoE layer, the E − k experts the token is not routed to (gate, up and down: 3·hidden·inter each)."""
    layers = config["num_hidden_layers"]
    sparse_step = config.get("decoder_sparse_step", 1)
    moe_layers = [
        i for i in range(layers) if i not in config.get("mlp_only_layers", []) and (i + 1) % sparse_step == 0
    ]  # as Qwen3-MoE's decoder layers choose a sparse block
    per_expert = 3 * config["hidden_size"] * config["moe_intermediate_size"]
    idle = len(moe_layers) * (config["num_experts"] - config["num_experts_per_tok"]) * per_expert
    embedding = 0 if config["tie_word_embeddings"] else config["vocab_size"] * config["hidden_size"]
    return num_params - embedding - idle


def attention_span(lengths: list[int]) -> float:
    """The attention term's `span` for packed documents: a token attends within its own document only, so
    the row costs sum(len²) and a token on average sum(len²)/sum(len) (the row's length for one document)."""
    return sum(n * n for n in lengths) / sum(lengths)


HF_IMPLS = {
    "hf": (False, True),
    "hf+none": (False, False),
    "liger": (True, False),
    "liger+ckpt": (True, True),
}
"""transformers baselines: name -> (Liger kernels, full gradient checkpointing)."""


@contextlib.contextmanager
def liger_patches() -> Any:
    """Liger replaces functions and classes of transformers' Qwen3 module for the whole process: put them
    back afterwards, so the runs after a Liger one (hf, tidal) measure what they claim to."""
    from transformers.models.qwen3 import modeling_qwen3

    names = ("apply_rotary_pos_emb", "Qwen3RMSNorm", "Qwen3MLP")
    saved = {n: getattr(modeling_qwen3, n) for n in names}
    saved_forward = modeling_qwen3.Qwen3ForCausalLM.forward
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(modeling_qwen3, n, value)
        modeling_qwen3.Qwen3ForCausalLM.forward = saved_forward  # type: ignore[method-assign]


def hf_runner(
    name: str,
    row: dict[str, list[int]],
    device: torch.device,
    seed: int,
    impl: str = "hf",
    experts: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """A transformers step (Liger kernels or not, checkpointing or not, as `HF_IMPLS[impl]` says; for an MoE
    model `experts` as its experts implementation, None: transformers' default, and its load-balancing loss
    added to the loss as the model's config weighs it); returns (step function returning the loss, facts)."""
    liger, checkpointing = HF_IMPLS[impl]
    moe = is_moe(model_config(name))
    if liger and moe:
        raise ValueError("the Liger baselines here patch dense Qwen3 only")
    model = build_model(name, torch.bfloat16, device, seed, experts if moe else None)
    facts: dict[str, Any] = {"num_params": sum(p.numel() for p in model.parameters())}
    # the model's load-balancing loss, which tidal adds too (router_aux_loss_coef; transformers computes it
    # only when asked for the router logits)
    extra = {"output_router_logits": True} if moe else {}
    if moe:
        import transformers

        hf_config: Any = model.config
        facts |= {
            "experts_implementation": hf_config._experts_implementation,  # what transformers resolved
            "transformers": transformers.__version__,
        }
    if liger:
        # rope, RMSNorm, SwiGLU, and the fused linear cross-entropy (no full logits) that Liger users run
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3

        apply_liger_kernel_to_qwen3(
            rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, model=model
        )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=device.type == "cuda")
    ids = torch.tensor([row["input_ids"]], device=device)  # [1, seq]
    positions = torch.tensor([row["position_ids"]], device=device)  # [1, seq]
    # HF shifts labels itself: label i is predicted at position i-1, so a document's first token is ignored
    labels = torch.where(positions == 0, -100, ids)  # [1, seq]

    def step() -> float:
        loss = model(input_ids=ids, position_ids=positions, labels=labels, use_cache=False, **extra).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, facts


def tidal_setup(
    name: str, info: Any, seed: int, overrides: dict[str, Any], optim: Any
) -> tuple[Any, Any, Any, dict[str, Any]]:
    """tidal's trainer as its runs build it: the model parallelized with `overrides` as its [perf] table, the
    optimizer and a constant schedule; returns (scorer, optimizer, scheduler, run facts)."""
    from tidal.config.common import SchedulerConfig
    from tidal.config.perf import PerfConfig
    from tidal.trainer.optim import build_optimizer, build_scheduler, resolve_state_dtype
    from tidal.trainer.parallel import parallelize, resolve_checkpointing, resolve_compile

    model = build_model(name, torch.float32, info.device, seed)
    num_params = sum(p.numel() for p in model.parameters())
    perf = PerfConfig(**overrides)
    scorer = parallelize(model, info, perf)
    state_dtype = resolve_state_dtype(perf.optimizer_state, info.device, num_params)
    facts = {
        "num_params": num_params,
        "attention": model.config._attn_implementation,
        "activation_checkpointing": resolve_checkpointing(perf, info),
        "compile": resolve_compile(perf, info, num_params),
        "optimizer_state": str(state_dtype).removeprefix("torch."),
    }
    if scorer.moe is not None:  # the model's own load-balancing loss weight, as transformers' step has it
        facts |= {"experts_kernel": scorer.moe.kernel, "aux_loss_coef": scorer.moe.aux_loss_coef}
    optimizer = build_optimizer(model, optim, state_dtype)
    scheduler = build_scheduler(optimizer, 1000, SchedulerConfig(type="constant"))
    return scorer, optimizer, scheduler, facts


def tidal_runner(
    name: str, row: dict[str, list[int]], info: Any, seed: int, overrides: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """tidal's SFT training step on the same row; returns (step function returning the loss, run facts)."""
    from tidal.config.common import OptimConfig
    from tidal.trainer.data import PackedRow
    from tidal.trainer.sft import StepBatch, train_step

    scorer, optimizer, scheduler, facts = tidal_setup(name, info, seed, overrides, OptimConfig(lr=1e-5))
    packed = PackedRow(row["input_ids"], row["position_ids"], row["targets"])
    num_loss = packed.num_loss_tokens * info.dp_size  # every data-parallel group has a row like it
    num_real = len(packed) * info.dp_size  # weighs an MoE model's load-balancing loss
    batch = StepBatch(
        [[packed]],
        num_loss_tokens=num_loss,
        num_tokens=len(packed),
        num_truncated=0,
        num_real_tokens=num_real,
    )

    def step() -> float:
        return train_step(scorer, optimizer, scheduler, batch, info, max_grad_norm=1.0)["loss"]

    return step, facts


def rl_samples(seq: int, vocab: int, seed: int) -> list[Any]:
    """RL-shaped data, the samples the orchestrator packs: groups of 8 completions of one prompt, prompts of
    64-192 tokens and completions of 32-256 (benchmarks/async_overlap.py samples up to 256 new tokens), loss
    and inference logprobs on the completion only, until the next sample would not fit one row of `seq`."""
    from tidal.types import TrainSample

    gen = torch.Generator().manual_seed(seed)

    def randint(low: int, high: int) -> int:
        return int(torch.randint(low, high + 1, (1,), generator=gen))

    samples: list[TrainSample] = []
    total = 0
    while True:
        prompt = torch.randint(0, vocab, (randint(64, 192),), generator=gen).tolist()
        for index in range(8):
            completion = torch.randint(0, vocab, (randint(32, 256),), generator=gen).tolist()
            if total + len(prompt) + len(completion) > seq:
                return samples
            logprobs = (-torch.rand(len(completion), generator=gen) * 3).tolist()
            samples.append(
                TrainSample(
                    input_ids=prompt + completion,
                    loss_mask=[0] * len(prompt) + [1] * len(completion),
                    inference_logprobs=[0.0] * len(prompt) + logprobs,
                    advantage=float(torch.randn(1, generator=gen)),
                    policy_version=0,
                    rollout_id=f"{len(samples)}/{index}",
                )
            )
            total += len(prompt) + len(completion)


def tidal_rl_runner(
    name: str, seq: int, rows: int, micro_rows: int, info: Any, seed: int, overrides: dict[str, Any]
) -> tuple[Any, dict[str, Any]]:
    """tidal's RL training step (`tidal.trainer.rl.rl_step`: logprobs, entropy, importance ratios, the RL
    loss) on one RL-shaped batch of about `rows` × `seq` tokens, packed as the orchestrator packs it into
    rows of `seq` (orchestrator.batch.seq_len), `micro_rows` rows per forward (orchestrator.batch.micro_batch_size);
    returns (step function, run facts)."""
    from tidal.config.common import OptimConfig
    from tidal.config.rl import RLTrainerConfig
    from tidal.orchestrator.batching import make_train_batches
    from tidal.trainer.rl import rl_step

    samples = rl_samples(seq * rows, model_config(name)["vocab_size"], seed + info.rank)
    [batch] = make_train_batches(0, samples, 1, seq, micro_rows, pad_id=0)  # each rank packs its own samples
    optim = OptimConfig(lr=1e-5)
    scorer, optimizer, scheduler, facts = tidal_setup(name, info, seed, overrides, optim)
    # the trainer's own config (defaults: temperature 1, the default loss), not a stand-in that new fields
    # rl_step reads would miss (routing replay's `moe` broke one)
    config = RLTrainerConfig(optim=optim)
    facts |= {
        "num_tokens": sum(len(s) for s in samples),
        "num_samples": len(samples),
        "num_micro_batches": len(batch.micro_batches),
        "rows_per_micro_batch": micro_rows,
        "attention_span": attention_span([len(s.input_ids) for s in samples]),
    }

    def step() -> float:
        return float(rl_step(scorer, optimizer, scheduler, batch, info, config)["loss"])

    return step, facts


def measure(
    make: Any, device: torch.device, warmup: int, steps: int, profile: bool = False
) -> dict[str, Any]:
    """Build, warm up, time `steps` steps (then profile one more if asked); tokens/s is filled in by the
    caller. Frees everything after. A failure (out of memory, or any error: a compile that fails, a kernel
    that does not run) becomes the result's `error`, so the runs after it in the same process still run."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    result: dict[str, Any] = {}
    stage = "build"
    try:
        start = time.perf_counter()
        step, facts = make()
        result["build_s"] = time.perf_counter() - start
        stage = "first step"
        start = time.perf_counter()
        first_loss = step()  # random init: close to ln(vocab) for both implementations
        result["first_step_s"] = time.perf_counter() - start  # compiles, if the run compiles
        stage = "steps"
        for _ in range(warmup - 1):
            step()
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(steps):
            last_loss = step()
        if cuda:
            torch.cuda.synchronize(device)
        elapsed = (time.perf_counter() - start) / steps
        peak = torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None
        result |= {
            "step_s": elapsed, "peak_mem_gib": peak, "first_loss": first_loss, "last_loss": last_loss, **facts
        }  # fmt: skip
        if profile and cuda:
            result["profile"] = profile_step(step, device)
    except torch.OutOfMemoryError:
        result["error"] = f"out of memory ({stage})"
    except Exception as exc:  # noqa: BLE001  (recorded; the next runs go on)
        import traceback

        traceback.print_exc()
        result["error"] = f"{stage}: {type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
    if "error" in result and cuda:
        result["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    step = None
    # always: a compiled layer's guards do not cover its checkpointing policy (a closure), so the next
    # variant would otherwise run this one's graph (seen: `projections` measured with `matmuls`' graph);
    # compiled graphs can also hold the last model's tensors
    torch._dynamo.reset()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        result["mem_left_gib"] = torch.cuda.memory_allocated(device) / 2**30
    return result


KERNEL_KINDS = [  # (kind, substrings of CUDA kernel names), first match wins
    ("attention", ("cudnn", "flash", "fmha", "attn")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "splitk", "grouped_mm")),
    ("optimizer", ("multi_tensor", "adam", "lerp")),  # tidal's compiled AdamW kernels fuse a lerp
    ("collective", ("nccl",)),
    # before copy: inductor names its fused kernels after their ops, `_to_copy` among them
    ("compiled", ("triton",)),
    ("copy", ("memcpy", "memset", "copy", "cat", "split_with_sizes")),
]


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    return next((kind for kind, keys in KERNEL_KINDS if any(k in lowered for k in keys)), "other")


def profile_step(step: Any, device: torch.device) -> dict[str, Any]:
    """GPU time of one step by kernel kind, and the top kernels (torch.profiler; ms)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize(device)
    wall = time.perf_counter() - start
    kinds: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        ms = getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0)) / 1e3
        if ms <= 0:
            continue
        kind = kernel_kind(event.key)
        kinds[kind] = kinds.get(kind, 0.0) + ms
        kernels.append((ms, event.count, event.key[:110]))
    kernels.sort(reverse=True)
    return {
        "wall_ms": wall * 1e3,
        "gpu_ms": sum(kinds.values()),
        "by_kind_ms": dict(sorted(kinds.items(), key=lambda kv: -kv[1])),
        "top_kernels": [{"ms": round(ms, 2), "calls": n, "name": name} for ms, n, name in kernels[:30]],
    }


def run_one(args: argparse.Namespace, name: str, layout: str, impl: str, info: Any) -> dict[str, Any]:
    """One measurement; under torchrun every data-parallel group trains its own row (FSDP2 sharded; with
    `--set cp=N` the N ranks of a group split one row)."""
    seed, device = 0, info.device
    config = model_config(name)
    lengths = document_lengths(args.seq, "packed" if layout == "rl" else layout, seed)
    row = make_row(args.seq, config["vocab_size"], lengths, seed + info.dp_rank)
    base_impl, _, suffix = impl.partition(":")  # tidal:<variant>, or hf:<experts implementation>
    if layout == "rl" and info.cp > 1:
        return {"model": name, "seq": args.seq, "impl": impl, "variant": impl, "docs": layout,
                "error": "the RL-shaped case runs without context parallelism"}  # fmt: skip
    if layout == "rl" and base_impl in HF_IMPLS:
        return {"model": name, "seq": args.seq, "impl": impl, "variant": impl, "docs": layout,
                "error": "the RL-shaped case runs tidal's RL step only"}  # fmt: skip
    if layout == "rl":
        options = {**VARIANTS[impl.removeprefix("tidal:")], **args.set}
        result = measure(
            lambda: tidal_rl_runner(name, args.seq, args.rows, args.micro_rows, info, seed, options),
            device,
            args.warmup,
            args.steps,
            args.profile,
        )
        lengths = []
    elif base_impl in HF_IMPLS:
        experts = suffix or None
        with liger_patches():
            result = measure(
                lambda: hf_runner(name, row, device, seed, base_impl, experts),
                device,
                args.warmup,
                args.steps,
                args.profile,
            )
        liger, checkpointing = HF_IMPLS[base_impl]
        options: dict[str, Any] = {
            "liger": liger,
            "activation_checkpointing": "full" if checkpointing else "none",
        }
        if is_moe(config):
            options["experts_implementation"] = experts or "transformers' default"
    else:
        options = {**VARIANTS[impl.removeprefix("tidal:")], **args.set}
        result = measure(
            lambda: tidal_runner(name, row, info, seed, options),
            device,
            args.warmup,
            args.steps,
            args.profile,
        )
    record: dict[str, Any] = {
        "model": f"{name}", "seq": args.seq, "impl": base_impl,
        "variant": impl if base_impl in HF_IMPLS else impl.split(":")[-1],
        "docs": layout, "num_docs": len(lengths), "gpus": info.world_size, "options": options,
        "layers": config["num_hidden_layers"], **result,
    }  # fmt: skip
    if info.world_size > 1 and result.get("peak_mem_gib") is not None:
        record["peak_mem_gib"] = max_over_ranks(result["peak_mem_gib"], device)
    if "step_s" in result:  # per GPU; the RL case counts its real tokens (its row is not quite full)
        record["tokens_per_s"] = result.get("num_tokens", args.seq) / result["step_s"] / info.cp
        record["cp"] = info.cp
        span = result.get("attention_span") or attention_span(lengths)
        flops = model_flops_per_token(config, result["num_params"], span)
        if is_moe(config):
            record["num_active_params"] = active_params(config, result["num_params"])
        record["mfu"] = flops * record["tokens_per_s"] / PEAK_FLOPS
    return record


def attention_kernels(seq: int, device: torch.device) -> list[dict[str, Any]]:
    """fwd+bwd time of the attention kernels on Qwen3-4B's heads (32 query, 8 kv, dim 128), bf16, one row."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tidal.trainer.attention import document_bounds, flash4_problem, flash_varlen, varlen_works
    from tidal.trainer.flash4 import flash4_varlen

    varlen_works(device)  # resolves the varlen calling convention
    q = torch.randn(1, 32, seq, 128, device=device, dtype=torch.bfloat16, requires_grad=True)
    k, v = (
        torch.randn(1, 8, seq, 128, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in "kv"
    )
    flat = [x.detach().transpose(1, 2)[0].contiguous().requires_grad_() for x in (q, k, v)]  # [seq, h, d]

    def causal_sdpa() -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    cases: dict[str, Any] = {}
    for layout in ("single", "packed"):
        positions = torch.tensor([make_row(seq, 2, document_lengths(seq, layout, 0), 0)["position_ids"]])
        cu = document_bounds(positions).to(device)
        cases[f"varlen/{layout}"] = (lambda cu=cu: flash_varlen(*flat, cu, seq, 128**-0.5), None)
    if flash4_problem(device) is None:  # the optional flash-attn-4 package, where installed
        for layout in ("single", "packed"):
            positions = torch.tensor([make_row(seq, 2, document_lengths(seq, layout, 0), 0)["position_ids"]])
            cu = document_bounds(positions).to(device)
            cases[f"flash4/{layout}"] = (lambda cu=cu: flash4_varlen(*flat, cu, seq, 128**-0.5), None)
    for name in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        cases[f"sdpa/{name.lower()}/single"] = (causal_sdpa, getattr(SDPBackend, name))
    cases["sdpa/default/single"] = (causal_sdpa, None)
    return [_time_kernel(label, fn, backend, sdpa_kernel, device) for label, (fn, backend) in cases.items()]


def _time_kernel(label: str, fn: Any, backend: Any, sdpa_kernel: Any, device: torch.device) -> dict[str, Any]:
    import contextlib

    try:
        with sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext():
            for _ in range(2):
                fn().sum().backward()
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(5):
                fn().sum().backward()
            torch.cuda.synchronize(device)
    except Exception as exc:  # noqa: BLE001 - a kernel that fails is a result, not the end of the run
        return {"kernel": label, "error": f"{type(exc).__name__}: {str(exc).strip()[:120]}"}
    return {"kernel": label, "fwd_bwd_ms": (time.perf_counter() - start) / 5 * 1e3}


def max_over_ranks(value: float, device: torch.device) -> float:
    import torch.distributed as dist

    tensor = torch.tensor([value], device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor.item())


def device_name(device: torch.device, world_size: int) -> str:
    if device.type != "cuda":
        return "cpu"
    return f"{torch.cuda.get_device_name(device)} ({world_size} GPU), torch {torch.__version__}"


def setup(device: str, cp: int = 1) -> Any:
    """This process's DistInfo: torchrun's ranks when launched by it (`cp` consecutive ranks share each row),
    else one process on GPU 0 or the CPU."""
    from tidal.trainer.parallel import DistInfo, init_distributed

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return init_distributed(device, cp)
    dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
    return DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=dev)


def summarise(results: list[dict[str, Any]]) -> list[str]:
    """One line per run, tidal lines with their ratio to the hf run of the same model, seq and layout."""
    base = {
        (r["model"], r["seq"], r["docs"]): r
        for r in results
        if r["variant"] == "hf" and "tokens_per_s" in r  # hf with transformers' default experts
    }  # tidal rows on several GPUs compare their per-GPU tokens/s with it
    liger: dict[tuple[Any, ...], float] = {}  # the fastest Liger run of each model, seq and layout
    for r in results:
        if r["impl"].startswith("liger") and "tokens_per_s" in r:
            key = (r["model"], r["seq"], r["docs"])
            liger[key] = max(liger.get(key, 0.0), r["tokens_per_s"])
    lines = [
        f"{'model':11} {'seq':>6} {'docs':9} {'impl':20} {'tok/s':>8} {'MFU':>6} {'peak GiB':>8} {'x hf':>5} "
        f"{'x best liger':>12}"
    ]
    for r in results:
        label = r["variant"] if r["impl"] in HF_IMPLS else f"tidal:{r['variant']}"
        micro = r.get("num_micro_batches", 1)
        # micro-batches per step (of `seq` tokens times rows_per_micro_batch)
        docs = (
            r["docs"]
            + (f" x{micro}" if micro > 1 else "")
            + (f"r{r['rows_per_micro_batch']}" if r.get("rows_per_micro_batch", 1) > 1 else "")
        )
        if r.get("gpus", 1) > 1:
            label += f" x{r['gpus']}gpu"
        if "tokens_per_s" not in r:
            lines.append(f"{r['model']:11} {r['seq']:>6} {docs:9} {label:20} {r.get('error')}")
            continue
        hf = base.get((r["model"], r["seq"], r["docs"]))
        ratio = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}" if hf else "-"
        best = liger.get((r["model"], r["seq"], r["docs"]))
        vs_liger = f"{r['tokens_per_s'] / best:.2f}" if best else "-"
        peak = f"{r['peak_mem_gib']:.1f}" if r["peak_mem_gib"] is not None else "-"
        lines.append(
            f"{r['model']:11} {r['seq']:>6} {docs:9} {label:20} {r['tokens_per_s']:>8.0f} "
            f"{r['mfu']:>6.1%} {peak:>8} {ratio:>5} {vs_liger:>12}"
        )
    singles = {
        (r["model"], r["seq"], r["variant"]): r["tokens_per_s"]
        for r in results
        if r["docs"] == "single" and r["impl"] == "tidal" and "tokens_per_s" in r
    }
    for r in results:  # the RL-shaped case against one document, same model, tokens per step and variant
        single = singles.get((r["model"], r["seq"], r["variant"]))
        if r["docs"] == "rl" and "tokens_per_s" in r and single and r.get("num_micro_batches", 1) == 1:
            lines.append(f"{r['model']} tidal:{r['variant']}: rl / single = {r['tokens_per_s'] / single:.2f}")
    return lines


def merge(paths: list[str], out: str) -> None:
    """Join result files of several runs (e.g. one process per GPU, or several device calls) into one."""
    parts = [json.loads(Path(p).read_text()) for p in paths]
    merged = {
        **{k: v for p in reversed(parts) for k, v in p.items()},  # the first file's facts win, none is lost
        "command": " ; ".join(p["command"] for p in parts),
        "results": [r for p in parts for r in p["results"]],
    }
    plans = {name: plan for p in parts for name, plan in p.get("memory_plan", {}).items()}
    if plans:
        merged["memory_plan"] = plans
    Path(out).write_text(json.dumps(merged, indent=2) + "\n")
    print("\n".join(summarise(merged["results"])))


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--models",
        default="qwen3-0.6b,qwen3-1.7b,qwen3-4b",
        help=f"comma-separated: {', '.join(CONFIGS)}; NAME:N keeps the first N decoder layers",
    )
    parser.add_argument("--seq", type=int, default=16384, help="tokens per step (one packed row)")
    parser.add_argument(
        "--docs",
        default="packed",
        help="layouts, comma-separated: packed, single, rl (RL-shaped samples through tidal's RL step)",
    )
    parser.add_argument(
        "--impls",
        default="hf,tidal:default",
        help="comma-separated: hf (full checkpointing), hf+none, liger, liger+ckpt (transformers + Liger "
        "kernels, without / with full checkpointing), hf:<experts> (an MoE model's experts implementation in "
        "transformers: grouped_mm, batched_mm, eager; hf alone: transformers' default), tidal:<variant>",
    )
    parser.add_argument(
        "--rows", type=int, default=1, help="rl layout: rows of --seq tokens per step (default 1)"
    )
    parser.add_argument(
        "--micro-rows",
        type=int,
        default=1,
        help="rl layout: rows per forward pass (micro_batch_size; default 1)",
    )
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps (at least 1)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--out", default=None, help="write results JSON here (appends to an existing file)")
    parser.add_argument("--merge", nargs="+", default=None, help="merge these result files into --out")
    parser.add_argument("--attention-kernels", action="store_true", help="time attention kernels, then exit")
    parser.add_argument(
        "--profile", action="store_true", help="profile one more step: GPU time by kernel kind"
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="FIELD=VALUE",
        help="PerfConfig fields for every tidal variant",
    )
    args = parser.parse_args(argv)
    args.set = dict(_field(item) for item in args.set)
    return args


def _field(item: str) -> tuple[str, Any]:
    """`name=value` → (name, value parsed as JSON when it parses, else the string)."""
    name, _, raw = item.partition("=")
    try:
        return name, json.loads(raw)
    except json.JSONDecodeError:
        return name, raw


def run_facts(models: list[str], device: torch.device) -> dict[str, Any]:
    """What a results file states besides its runs: the MFU formula(s), versions, and for MoE shapes cut to
    fewer layers why that many (`what`, `memory_plan`)."""
    import transformers

    moe = [name for name in models if is_moe(model_config(name))]
    formulas = ([MFU_FORMULA] if len(moe) < len(models) else []) + ([MOE_MFU_FORMULA] if moe else [])
    facts: dict[str, Any] = {
        "mfu": " | MoE: ".join(formulas) if len(formulas) == 2 else formulas[0],
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
    }
    total = torch.cuda.get_device_properties(device).total_memory / 2**30 if device.type == "cuda" else None
    plans = {name: memory_plan(name) for name in moe}
    if plans:
        facts["memory_plan"] = plans
        facts["what"] = " ".join(layers_reason(name, plan, total) for name, plan in plans.items())
    return facts


STATE_BYTES = {
    "tidal": 12,  # fp32 master weights and gradients, bf16 AdamW moments (perf.optimizer_state auto on GPU)
    "hf": 8,  # bf16 weights, gradients and AdamW moments
}
"""Bytes per parameter of the training state that lives through a step, by implementation."""


def param_count(config: dict[str, Any]) -> int:
    """Parameters of a model of this shape (built on the meta device: no memory, no time)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**config, use_cache=False))
    return sum(p.numel() for p in model.parameters())


def memory_plan(name: str) -> dict[str, Any]:
    """Training-state memory of an MoE shape at its layer count and one layer more, per implementation."""
    config = model_config(name)
    layers = config["num_hidden_layers"]
    plan: dict[str, Any] = {"layers": layers}
    for count in (layers, layers + 1):
        params = param_count({**config, "num_hidden_layers": count})
        plan[f"{count}_layers"] = {
            "params": params,
            "active_params": active_params({**config, "num_hidden_layers": count}, params),
            **{f"{impl}_state_gib": params * size / 2**30 for impl, size in STATE_BYTES.items()},
        }
    return plan


def layers_reason(name: str, plan: dict[str, Any], total_gib: float | None) -> str:
    base = name.partition(":")[0]
    layers = plan["layers"]
    now, more = plan[f"{layers}_layers"], plan[f"{layers + 1}_layers"]
    of = f" of this GPU's {total_gib:.1f} GiB" if total_gib else ""
    return (
        f"{name}: {base}'s shape with {layers} of its {CONFIGS[base]['num_hidden_layers']} decoder layers "
        f"({now['params'] / 1e9:.2f}B parameters, {now['active_params'] / 1e9:.2f}B active per token). "
        f"tidal's training state is {STATE_BYTES['tidal']} bytes per parameter (fp32 master weights and "
        f"gradients, bf16 AdamW moments): {now['tidal_state_gib']:.1f} GiB with {layers} layers, "
        f"{more['tidal_state_gib']:.1f} GiB with {layers + 1}{of}, before activations, the gathered bf16 "
        f"copies of a layer and of the embedding and head, and the expert dispatch buffers (see peak_mem_gib); "
        f"transformers' is {STATE_BYTES['hf']} bytes per parameter ({now['hf_state_gib']:.1f} GiB)."
    )


def main(argv: list[str], record: Any = None) -> None:
    """Run the measurements `argv` asks for; `record` (tests) also gets each result as it is made."""
    args = parse_args(argv)
    args.warmup = max(1, args.warmup)
    if args.merge:
        merge(args.merge, args.out)
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    from tidal.trainer.model import quiet_transformers

    quiet_transformers()
    info = setup(args.device, int(args.set.get("cp", 1)))
    device = info.device
    if info.world_size > 1 and {i.partition(":")[0] for i in args.impls.split(",")} & set(HF_IMPLS):
        raise SystemExit("under torchrun only tidal variants run (the hf baseline is single-GPU)")
    command = "python " + shlex.join(["benchmarks/trainer_mfu.py", *argv])
    if info.world_size > 1:
        command = f"torchrun --nproc-per-node {info.world_size} " + command.removeprefix("python ")
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        command = f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} {command}"
    say = print if info.is_main else (lambda *a, **k: None)
    if device.type == "cuda":
        from tidal.trainer.attention import varlen_works

        say(f"flash varlen attention works here: {varlen_works(device)}", flush=True)
        if args.attention_kernels:
            for line in attention_kernels(args.seq, device):
                say(json.dumps(line), flush=True)
            return
    models = args.models.split(",")
    head = run_facts(models, device)
    say(json.dumps(head), flush=True)
    results: list[dict[str, Any]] = []
    for name in models:
        for layout in args.docs.split(","):
            for impl in args.impls.split(","):
                result = run_one(args, name, layout, impl, info)
                say(json.dumps(result), flush=True)
                results.append(result)
                if record is not None:
                    record(result)
                if args.out and info.is_main:  # after every run, so a timeout keeps what was measured
                    where = device_name(device, info.world_size)
                    payload = {"command": command, "device": where, **head, "results": results}
                    Path(args.out).write_text(json.dumps(payload, indent=2) + "\n")
    say("\n".join(summarise(results)))
    if info.world_size > 1:
        from tidal.trainer.parallel import shutdown

        shutdown(info)


if __name__ == "__main__":
    main(sys.argv[1:])

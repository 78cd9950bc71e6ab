"""Trainer speed and memory knobs shared by `tidal sft` and the RL trainer (`[trainer.perf]`, `[perf]`)."""

from typing import Literal

from pydantic import Field, model_validator

from tidal.config.base import Config, ConfigProblem


class PerfConfig(Config):
    """How the trainer runs the model: precision, sharding, recomputation, attention kernel, loss chunking.

    The defaults suit most runs. On GPU: bf16 compute over fp32 master weights and reductions (FSDP2 with
    several ranks, autocast on one), bf16 AdamW
    moments, variable-length attention over packed rows, activation checkpointing that keeps attention and
    projection outputs, compiled decoder layers and head (models of 1B parameters and more). On CPU: fp32, eager, no recomputation.
    Measured speeds: benchmarks/results/trainer_mfu_one_gpu_h200.json (earlier: trainer_mfu_h200.json).
    """

    master_dtype: Literal["float32"] = "float32"
    """dtype of the trainer's parameters (master weights), gradients and optimizer update, whatever
    `model.dtype` is: `model.dtype` is the dtype inference serves and weights are published in (`tidal sft`:
    final/ is written in it). fp32 only, on purpose: bf16 masters round away small updates (100 AdamW steps
    at lr 1e-6 on weights of scale 0.02 moved 1.9% of bf16 elements against 100% in fp32), so there is no
    bf16 choice; bf16 compute comes from `mixed_precision`, bf16 optimizer moments from `optimizer_state`."""
    mixed_precision: Literal["auto", "bf16", "off"] = "auto"
    """`bf16`: compute in bf16 while master weights, gradients, optimizer state and gradient reductions stay
    fp32 (through FSDP2's policy, or autocast on one GPU: `fsdp`). `off`: compute in the master dtype (fp32).
    `auto`: bf16 on GPU, off on CPU."""
    activation_checkpointing: Literal[
        "auto", "none", "full", "selective", "projections", "matmuls", "attention"
    ] = "auto"
    """Recompute activations in backward to save memory. `full`: keep only each decoder layer's input.
    `attention`: also keep the attention outputs (attention is the costly op to recompute; on Qwen3-4B at 16k
    tokens it was 7–11% faster than `full` at the same peak memory on an H200). `selective`: attention
    outputs and every second matmul output (less recomputation, more memory). `projections`: attention
    outputs and the q/k/v/o projections' outputs (Qwen3-4B, 16k tokens: +4% tokens/s, +3.4 GiB over
    `attention`). `matmuls`: attention outputs and every matmul output that backward reads (all but the
    MLP's down projection), so backward recomputes no matmul, only norms, RoPE and the MLP activation: close to
    `none` in speed for much less memory (measured: benchmarks/results/trainer_mfu_one_gpu_h200.json). `none`: keep
    everything. `auto`: `projections` on GPU, `none` on CPU."""
    checkpoint_every: int = Field(default=1, ge=1)
    """Apply activation checkpointing to every N-th decoder layer only (1 = all layers); the other layers
    keep their activations, trading memory for less recomputation."""
    save_mlp_layers: int = Field(default=0, ge=0)
    """In this many decoder layers (the last ones), selective modes also keep the MLP's gate and up
    projection outputs, so backward recomputes no matmul there: spare GPU memory turned into speed
    (Qwen3-4B, 16k tokens: up to +0.6 GiB and ~2 ms less recomputation per layer; 3 layers measured +0.2%
    tokens/s on an H200 at an unchanged peak, which activations no longer set)."""
    compile: Literal["auto"] | bool = "auto"
    """`torch.compile` each decoder layer and the head's softmax work: fuses norms, RoPE, activations and
    the logsumexp (Qwen3-4B, 16k tokens, H200: +30% tokens/s); the first step compiles, new shapes
    recompile once. `auto`: on with a GPU for models of 1B parameters or more; off below (SmolLM2-135M on an
    H100: the first step took 76 s compiling and the next shape 6.5 s, for steps of 0.3 s; README,
    Performance) and on CPU (where compiling costs more than it saves on small models)."""
    attention: Literal["auto", "varlen", "hf"] = "auto"
    """Attention over packed rows. `varlen`: variable-length flash attention on the documents of a row (no
    padding, no attention across documents; on CPU a per-document SDPA loop; rows holding a single document
    use causal SDPA, whose cuDNN kernel is ~1.8x faster than flash varlen on an H200). `hf`: the model's
    `model.attn_implementation`, which masks documents by their position-id resets. `auto`: `varlen` where
    the flash varlen kernel works (CUDA) and the model needs nothing varlen lacks (sliding windows,
    attention sinks, logit soft-capping, attention dropout), else `hf`; `varlen` refuses such a model."""
    attention_kernel: Literal["auto", "torch", "flash4"] = "auto"
    """The GPU kernel under `varlen` attention. `torch`: cuDNN SDPA for rows of one document, torch's flash
    varlen (FlashAttention-2) for packed rows. `flash4`: FlashAttention-4 for both (the optional
    `flash-attn-4` package, Hopper and Blackwell GPUs; its first step compiles its kernels); a run where it
    is missing or fails its check against the reference is a one-line error. `auto`: `flash4` where the
    package is installed and passes that check on this GPU (Qwen3-4B, 16k tokens, H200: +3.8% tokens/s with
    the default checkpointing, +8.5% on RL-shaped rows; README, Performance), else `torch`."""
    loss_chunk_tokens: int = Field(default=1024, gt=0)
    """Tokens per chunk of the output head: its fp32 softmax work exists for one [chunk, vocab] slab at a
    time, forward and backward, and (unless `keep_logits`) so do the logits."""
    keep_logits: bool = False
    """Keep the head's logits from forward for backward instead of recomputing them chunk by chunk: one of
    the head's four [tokens, hidden] × [hidden, vocab] matmuls less per micro-batch, for tokens × vocab
    elements of memory in the compute dtype (16k tokens of Qwen3's 151,936-token vocabulary in bf16:
    4.6 GiB). The same values backward would recompute, so the same gradients."""
    optimizer_state: Literal["auto", "fp32", "bf16"] = "auto"
    """dtype of AdamW's two moments. `bf16`: stored in bf16 with stochastic rounding while the fp32 master
    weights update in fp32 — 12 instead of 16 bytes per parameter (Qwen3-4B: 45 instead of 60 GiB of
    weights, gradients and optimizer state). `auto`: bf16 on GPU for models of 1B trainable parameters or
    more; fp32 below (where bf16 saves under 4 GB and its compiled update made SmolLM2-135M's first step 23 s
    longer) and on CPU."""
    accumulate_unsharded: Literal["auto"] | bool = "auto"
    """Between the micro-batches of one optimizer step, keep each layer's gathered bf16 parameters and its
    unsharded gradient (accumulated in fp32, FSDP2's reduce dtype) instead of gathering, resharding and
    reducing in every micro-batch; the step's last backward reduces once. FSDP2's per-micro-batch work is
    host time that a GPU waits on when micro-batches are small (RL rows of a few thousand tokens). Costs up
    to 6 bytes per parameter at the peak (the bf16 copy and the fp32 accumulation) — with several ranks
    that is the whole model on every rank, not a shard. `auto`: on with one rank (without `cpu_offload`),
    off with several. Steps of one micro-batch are unchanged. Without FSDP2 (one GPU, `fsdp`) there is
    nothing to gather or reduce: gradients accumulate unsharded in fp32 whatever this says."""
    cpu_offload: bool = False
    """Keep parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy); the optimizer
    step runs on the CPU. Saves GPU memory at a large cost in speed."""
    replicate: int = Field(default=1, ge=1)
    """HSDP: replicate the model over this many groups of ranks and shard it within each (the world size
    must be a multiple). With replicate = number of nodes, all-gathers stay inside a node and only gradients
    cross nodes."""
    ep: int = Field(default=1, ge=1)
    """Expert parallelism for mixture-of-experts models: each MoE layer's experts are split over groups of
    this many ranks, and tokens go to the ranks of their experts by all-to-all and come back the same way;
    FSDP2 shards each rank's experts further over the other data-parallel ranks. 1: off (every rank runs
    all experts, FSDP2-sharded). Must divide the world size and the number of experts; not with
    `replicate` (HSDP) yet."""
    cp: int = Field(default=1, ge=1)
    """Context parallelism for long rows: groups of this many consecutive ranks get the same packed rows and
    split each along the sequence; attention exchanges sequence for heads by all-to-all (DeepSpeed-Ulysses),
    so each rank attends over the whole row for its share of the heads, documents masked as usual. FSDP2
    shards over all ranks (data parallel × cp). 1: off. Must divide the trainer ranks (per replica with
    `replicate`) and the model's attention heads (key/value heads are repeated where it does not divide
    theirs); runs tidal's varlen attention whatever `attention` says (`hf` is refused). Mixture-of-experts
    models too, with or without `ep` (the load-balancing loss counts the whole rows' tokens). See
    docs/parallelism.md."""
    fsdp: Literal["auto"] | bool = "auto"
    """Wrap the model in FSDP2. With one rank FSDP2 shards nothing, yet it still copies each layer's
    parameters into and out of its gather buffers (casting them to bf16) in forward and again in backward, and
    each gradient into its reduce buffer. Without it (one GPU), bf16 compute comes from autocast: each layer
    casts the fp32 master weights it multiplies by inside its own forward (recomputed with the layer under
    activation checkpointing), and the gradients reach the masters in fp32 directly; a mixture-of-experts
    block casts its input and expert weights the same way. `auto`: FSDP2 with several ranks, `cpu_offload`
    or on a CPU; without it on one GPU, dense and mixture-of-experts models alike (measured in the README's
    Performance section). `false` where FSDP2 is needed (several ranks, `cpu_offload`) is a one-line error."""
    reshard_after_forward: bool = True
    """Free each layer's gathered parameters after its forward (ZeRO-3 memory); False keeps them until
    backward (ZeRO-2-like). On one H200 with Qwen3-4B at 16k tokens False was within noise of True in
    speed (11.74k vs 11.70k tokens/s) for 6.4 GiB more peak memory. FSDP2 only: a run without it (`fsdp`)
    gathers nothing, and refuses False."""

    @model_validator(mode="after")
    def _check_save_mlp_layers(self) -> "PerfConfig":
        keeps = {
            "none": "keeps every activation already",
            "full": "keeps no matmul output",
            "matmuls": "keeps gate and up in every layer already",
        }.get(self.activation_checkpointing)
        if self.save_mlp_layers and keeps is not None:
            raise ConfigProblem(
                "save_mlp_layers",
                f"activation_checkpointing = '{self.activation_checkpointing}' {keeps}: leave save_mlp_layers at 0",
                also=("activation_checkpointing",),
            )
        return self

    @model_validator(mode="after")
    def _check_attention_kernel(self) -> "PerfConfig":
        if self.attention_kernel == "flash4" and self.attention == "hf":
            raise ConfigProblem(
                "attention_kernel",
                "'flash4' runs tidal's varlen attention; attention = 'hf' uses the model's own: set attention "
                "to 'auto' or 'varlen', or attention_kernel to 'auto'",
                also=("attention",),
            )
        return self

    @model_validator(mode="after")
    def _check_cp(self) -> "PerfConfig":
        if self.cp > 1 and self.attention == "hf":
            raise ConfigProblem(
                "cp",
                "context parallelism runs tidal's varlen attention between its all-to-alls; attention = 'hf' "
                "cannot be split: set attention to 'auto' or 'varlen'",
                also=("attention",),
            )
        return self


def check_ep(perf: PerfConfig, num_ranks: int, key: str = "perf.ep") -> None:
    """Expert parallelism must split the trainer's ranks into whole groups (config time, before any process
    starts; the expert count is checked when the model loads)."""
    if perf.ep > 1 and num_ranks % perf.ep:
        raise ConfigProblem(
            key, f"{perf.ep} ranks per expert group do not divide the {num_ranks} trainer rank(s)"
        )
    if perf.ep > 1 and perf.replicate > 1:
        raise ConfigProblem(key, "expert parallelism with replicate > 1 (HSDP) is not supported yet")


def check_cp(perf: PerfConfig, num_ranks: int, key: str = "perf.cp") -> None:
    """Context parallelism must split the trainer's ranks (each replica's, with HSDP) into whole groups
    (config time; combinations it does not run yet are refused by PerfConfig, the heads when the model
    loads)."""
    if perf.cp == 1:
        return
    if num_ranks % perf.cp:
        raise ConfigProblem(
            key, f"{perf.cp} ranks per context-parallel group do not divide the {num_ranks} trainer rank(s)"
        )
    if perf.replicate > 1 and (num_ranks // perf.replicate) % perf.cp:
        raise ConfigProblem(
            key,
            f"{perf.cp} ranks per group do not divide the {num_ranks // perf.replicate} ranks of each replica (perf.replicate)",
        )


def check_fsdp(perf: PerfConfig, num_ranks: int, key: str = "perf.fsdp") -> None:
    """`fsdp = false` with several trainer ranks, or with CPU offload (FSDP2's), cannot run: refused at config
    time, before any process starts (the model's own needs are checked when it loads)."""
    if perf.fsdp is not False:
        return
    if num_ranks > 1:
        raise ConfigProblem(
            key, f"{num_ranks} trainer ranks shard the model with FSDP2: set it to true or 'auto'"
        )
    if perf.cpu_offload:
        offload = key.rpartition(".")[0] + ".cpu_offload" if "." in key else "cpu_offload"
        raise ConfigProblem(
            key, "cpu_offload is FSDP2's offload policy: set it to true or 'auto'", also=(offload,)
        )

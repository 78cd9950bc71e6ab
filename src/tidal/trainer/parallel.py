"""Process group, device placement and FSDP2 sharding: one `parallelize()` that composes the pieces.

Rank layout with context parallelism (`perf.cp` = C): ranks r and r' hold the same rows when r // C ==
r' // C (a cp group of consecutive ranks); FSDP2 shards over every rank (data parallel × cp), as torchtitan
does, so the dense mesh is the same as without cp.
"""

import dataclasses
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard

from tidal.config.deployment import usable_cores
from tidal.config.moe import MoEConfig
from tidal.config.perf import PerfConfig
from tidal.trainer.attention import (
    CHECK_SHAPE,
    attention_kernel_name,
    attention_shape,
    flash4_problem,
    unsupported_attention,
    use_varlen,
    varlen_works,
)
from tidal.trainer.checkpointing import apply_activation_checkpointing, apply_compile
from tidal.trainer.chunked import TokenScorer
from tidal.trainer.context_parallel import ContextParallel, check_context_parallel, use_context_parallel
from tidal.trainer.expert_parallel import shard_experts
from tidal.trainer.flash4 import missing as flash4_missing
from tidal.trainer.moe import MoERouting, apply_moe, expert_modules

T = TypeVar("T")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global rank, world size, local rank and its device."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    cp: int = 1
    """Ranks per context-parallel group (`perf.cp`): consecutive ranks that split the same rows."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """Which rows this rank trains: its data-parallel index (its cp group's)."""
        return self.rank // self.cp

    @property
    def dp_size(self) -> int:
        """Data-parallel groups: how many ways a step's rows are split."""
        return self.world_size // self.cp

    @property
    def cp_rank(self) -> int:
        return self.rank % self.cp

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_distributed(device: str = "auto", cp: int = 1) -> DistInfo:
    """Join the torchrun process group when there is one (NCCL on GPU, gloo on CPU); else a single process.
    `cp`: ranks per context-parallel group (`perf.cp`), which must divide the world size."""
    info = plan_distributed(device, cp)
    join_distributed(info)
    return info


def plan_distributed(device: str = "auto", cp: int = 1) -> DistInfo:
    """This process's rank, world and device from torchrun's environment, without touching the GPU (no CUDA
    context, no process group yet: `join_distributed`)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    from tidal.errors import UserError

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("device = 'cuda' but no CUDA device is available")
    if world_size % cp:
        raise UserError(f"perf.cp = {cp} does not divide the {world_size} trainer rank(s) of this run")
    dev = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    return DistInfo(rank, world_size, local_rank, local_world_size, dev, cp)


def join_distributed(info: DistInfo) -> None:
    """Select this rank's GPU (its CUDA context starts here) and join torchrun's process group, if any."""
    use_cuda = info.device.type == "cuda"
    if use_cuda:
        torch.cuda.set_device(info.local_rank)
    if info.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo", device_id=info.device if use_cuda else None
        )


def set_num_threads(num_threads: int | None, info: DistInfo) -> int:
    """Give each process an explicit CPU thread budget; oversubscribed cores slow CPU training ~10x."""
    if num_threads is None:
        num_threads = max(1, len(usable_cores()) // info.local_world_size)
    torch.set_num_threads(num_threads)
    return num_threads


def parallelize(
    model: torch.nn.Module, info: DistInfo, perf: PerfConfig, moe: MoEConfig | None = None
) -> TokenScorer:
    """Wrap `model` in a TokenScorer and compose attention, MoE layers, activation checkpointing, compile and
    FSDP2.

    Returns the module to call for training; `model` keeps its HF parameter names for the optimizer,
    checkpoints and exported weights (the parameters are shared). On GPU, and with several ranks, FSDP2
    shards each decoder layer, then the root (embedding, final norm, head), and its policy computes in
    bf16 while master weights and gradient reductions stay fp32; a single process then uses a 1-rank group.
    """
    if perf.cpu_offload and info.device.type != "cuda":
        from tidal.errors import UserError

        raise UserError("perf.cpu_offload moves state from a GPU to the CPU; this run has no GPU")
    setup_attention(model, perf, info.device)
    routing = apply_moe(model, moe or MoEConfig(), info.device.type, compute_dtype(perf, info))
    check_moe_settings(routing is not None, perf, info)
    if perf.cp > 1:
        setup_context_parallel(model, perf, info)
    layers = _decoder_layers(model)
    apply_activation_checkpointing(
        layers, resolve_checkpointing(perf, info), perf.checkpoint_every, perf.save_mlp_layers
    )
    compiled = resolve_compile(perf, info, sum(p.numel() for p in model.parameters()))
    if compiled:
        apply_compile(layers)
    scorer = TokenScorer(
        model, perf.loss_chunk_tokens, compile_head=compiled, moe=routing, keep_logits=perf.keep_logits
    )
    if not uses_fsdp(perf, info):
        if uses_bf16(perf, info):
            scorer.autocast_dtype = torch.bfloat16
        return scorer.to(info.device)
    if not perf.cpu_offload:
        scorer.to(info.device)
    apply_fsdp(scorer, layers, info, perf, routing)
    if resolve_accumulate_unsharded(perf, info):
        scorer.accumulate_unsharded = perf.reshard_after_forward
    return scorer


def compute_mode(scorer: torch.nn.Module) -> str:
    """How the trainer computes, for its start-up line: FSDP2, bf16 autocast over fp32 masters, or as loaded;
    and the attention kernel where tidal's varlen attention runs on a GPU."""
    if isinstance(scorer, FSDPModule):
        mode = "FSDP2"
    else:
        dtype = getattr(scorer, "autocast_dtype", None)
        mode = (
            f"{str(dtype).removeprefix('torch.')} autocast over fp32 weights"
            if dtype
            else "no mixed precision"
        )
    kernel = attention_kernel_name()
    return f"{mode}, {kernel}" if kernel else mode


def check_moe_settings(is_moe: bool, perf: PerfConfig, info: DistInfo) -> None:
    """Perf settings that make no sense for this model: a one-line UserError instead of being ignored."""
    from tidal.errors import UserError

    if is_moe and perf.save_mlp_layers:
        raise UserError(
            "perf.save_mlp_layers keeps a dense MLP's gate and up projections; this model's MLPs are "
            "mixture-of-experts blocks: leave it at 0"
        )
    if is_moe and perf.activation_checkpointing == "matmuls":
        raise UserError(
            "perf.activation_checkpointing = 'matmuls' keeps a dense MLP's gate and up projections; this "
            "model's MLPs are mixture-of-experts blocks: use 'projections' (or 'auto') or 'none'"
        )
    if perf.ep > 1 and not is_moe:
        raise UserError(
            f"perf.ep = {perf.ep} splits experts, but this model has no mixture-of-experts layers"
        )
    if perf.ep > 1 and not info.distributed:
        raise UserError(f"perf.ep = {perf.ep} needs that many trainer ranks at least; this run has one")


def setup_context_parallel(model: torch.nn.Module, perf: PerfConfig, info: DistInfo) -> None:
    """Check that the model's attention splits over `perf.cp` ranks and switch it to tidal_cp; the cp
    group itself comes with the device mesh (`apply_fsdp`)."""
    from tidal.errors import UserError

    if info.cp != perf.cp:
        raise ValueError(f"perf.cp = {perf.cp} but the process group was set up for cp = {info.cp}")
    problem = check_context_parallel(model, perf.cp)
    if problem is not None:
        raise UserError(f"perf.cp = {perf.cp}: {type(model).__name__} cannot split its attention: {problem}")
    use_context_parallel(model)


def resolve_accumulate_unsharded(perf: PerfConfig, info: DistInfo) -> bool:
    """`auto`: with one rank, unless CPU offload asks for the GPU memory that gathered parameters would hold."""
    if perf.accumulate_unsharded == "auto":
        return info.world_size == 1 and not perf.cpu_offload
    return perf.accumulate_unsharded


def micro_batches(scorer: TokenScorer, items: Sequence[T]) -> Iterator[T]:
    """The step's micro-batches, FSDP2 set up before each: with `perf.accumulate_unsharded` every one but
    the last keeps its gathered parameters and unsharded gradients for the next, and the last reduces the
    gradients and reshards as configured. Without it (or without FSDP2) the items as they are."""
    layers_after_forward = scorer.accumulate_unsharded
    if layers_after_forward is None or not isinstance(scorer, FSDPModule):
        yield from items
        return
    layers = [m for m in scorer.modules() if isinstance(m, FSDPModule) and m is not scorer]
    for index, item in enumerate(items):
        last = index == len(items) - 1
        scorer.set_requires_gradient_sync(last)
        scorer.set_reshard_after_backward(last)
        for layer in layers:  # (the root never reshards after forward)
            layer.set_reshard_after_forward(layers_after_forward if last else False, recurse=False)
        yield item


def uses_fsdp(perf: PerfConfig, info: DistInfo) -> bool:
    """`perf.fsdp`, where `auto` means: FSDP2 with several ranks or CPU offload (which need it) and on a CPU
    with bf16 compute; one GPU trains without it (bf16 compute by autocast), dense and mixture-of-experts
    models alike. A plain fp32 CPU run needs neither. `false` where FSDP2 is needed, or FSDP2-only settings
    without it: UserError."""
    needs = [
        (info.distributed, f"this run has {info.world_size} trainer ranks"),
        (perf.cpu_offload, "perf.cpu_offload is FSDP2's offload policy"),
    ]
    reason = next((why for need, why in needs if need), None)
    if perf.fsdp == "auto":
        cpu_bf16 = info.device.type == "cpu" and perf.mixed_precision == "bf16"
        use = reason is not None or cpu_bf16
    else:
        use = perf.fsdp
    from tidal.errors import UserError

    if not use and reason is not None:
        raise UserError(f"perf.fsdp = false: {reason}; set perf.fsdp = true or 'auto'")
    if not use and not perf.reshard_after_forward:
        raise UserError(
            "perf.reshard_after_forward = false keeps FSDP2's gathered parameters, but this run trains "
            "without FSDP2 (perf.fsdp): remove the setting, or set perf.fsdp = true"
        )
    return use


def resolve_checkpointing(perf: PerfConfig, info: DistInfo) -> str:
    if perf.activation_checkpointing == "auto":
        return "projections" if info.device.type == "cuda" else "none"
    return perf.activation_checkpointing


COMPILE_MIN_PARAMS = 1_000_000_000
"""`perf.compile = "auto"` compiles on a GPU from this many parameters: below, the first step's compile
(tens of seconds to over a minute) costs more than it saves on steps that take a fraction of a second."""


def resolve_compile(perf: PerfConfig, info: DistInfo, num_params: int) -> bool:
    if perf.compile == "auto":
        return info.device.type == "cuda" and num_params >= COMPILE_MIN_PARAMS
    return perf.compile


def setup_attention(model: torch.nn.Module, perf: PerfConfig, device: torch.device) -> str:
    """Switch to tidal's varlen attention when asked (or, for `auto`, when a GPU kernel for it works here and
    the model needs nothing it lacks), with the kernel `perf.attention_kernel` picks; an explicit `varlen` for
    a model that needs more, or a `flash4` that cannot run here, is a one-line error."""
    choice = perf.attention
    unsupported = unsupported_attention(model)
    if choice == "varlen" and unsupported is not None:
        from tidal.errors import UserError

        path = getattr(model.config, "_name_or_path", "")  # type: ignore[union-attr]
        name = f"{type(model).__name__} ({path})" if path else type(model).__name__
        raise UserError(
            f"perf.attention = 'varlen': {name} uses {unsupported}, which tidal's "
            "variable-length attention does not implement; set perf.attention = 'hf' (or 'auto')"
        )
    kernel = resolve_attention_kernel(perf, device, attention_shape(model))
    flash = kernel == "flash4" or (varlen_works(device) if choice != "hf" else False)
    picked = choose_attention(choice, flash, unsupported)
    if picked == "varlen":
        use_varlen(model, flash, kernel)
    return picked


def resolve_attention_kernel(
    perf: PerfConfig, device: torch.device, shape: tuple[int, int, int] = CHECK_SHAPE
) -> str:
    """`torch` or `flash4` for perf.attention_kernel. `flash4` is checked on `device` first and is a one-line
    error where it cannot run; `auto` takes it where the package is installed and passes the same check
    (faster on Hopper: README, Performance), else torch's kernels, saying why when the check failed. The check
    runs with the model's attention `shape` (query heads, key/value heads, head dim)."""
    if perf.attention_kernel == "torch" or perf.attention == "hf":
        return "torch"
    if perf.attention_kernel == "auto":
        if flash4_missing(device) is not None:
            return "torch"  # no package, no GPU or an older one: nothing the user asked for
        problem = flash4_problem(device, shape)
        if problem is not None:
            print(
                f"perf.attention_kernel = 'auto': torch's kernels, not FlashAttention-4 ({problem})",
                flush=True,
            )
            return "torch"
        return "flash4"
    problem = flash4_problem(device, shape)
    if problem is not None:
        from tidal.errors import UserError

        raise UserError(
            f"perf.attention_kernel = 'flash4': FlashAttention-4 cannot run here: {problem}; "
            "set attention_kernel = 'auto'"
        )
    return "flash4"


def choose_attention(choice: str, flash: bool, unsupported: str | None) -> str:
    """`varlen` or `hf` for perf.attention = `choice`; `auto` takes varlen only with the flash kernel and a
    model whose attention it fully implements (`unsupported` is None)."""
    if choice == "auto":
        return "varlen" if flash and unsupported is None else "hf"
    return choice


def uses_bf16(perf: PerfConfig, info: DistInfo) -> bool:
    return perf.mixed_precision == "bf16" or (perf.mixed_precision == "auto" and info.device.type == "cuda")


def compute_dtype(perf: PerfConfig, info: DistInfo) -> torch.dtype:
    """The dtype layers compute in: bf16 under mixed precision, else the fp32 master dtype."""
    return torch.bfloat16 if uses_bf16(perf, info) else torch.float32


def mp_policy(perf: PerfConfig, info: DistInfo) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 reductions (master weights stay in their fp32 load dtype), or no casting."""
    if uses_bf16(perf, info):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def mesh_shape(world_size: int, replicate: int) -> tuple[int, ...]:
    """(shard,) for FSDP, (replicate, shard) for HSDP."""
    if world_size % replicate:
        raise ValueError(f"perf.replicate = {replicate} does not divide the world size {world_size}")
    return (world_size,) if replicate == 1 else (replicate, world_size // replicate)


@dataclass(frozen=True)
class Meshes:
    """FSDP2's mesh for the dense parameters and, with expert parallelism, the two halves of the expert
    mesh: `ep` (the ranks that split the experts) and `experts_dp` (the ranks holding the same slice); with
    context parallelism, `cp` (the ranks that split the same rows)."""

    dense: Any
    ep: Any = None
    experts_dp: Any = None
    cp: Any = None


def device_meshes(info: DistInfo, perf: PerfConfig) -> Meshes:
    """(shard,) for FSDP, (replicate, shard) for HSDP; with `perf.ep` a (experts_dp, ep) mesh whose
    flattening is the dense (shard,) mesh, so that FSDP2 composes the expert DTensors with it; with
    `perf.cp` these as without it (data parallel × cp ranks) and a (dp, cp) mesh of the cp groups: the cp
    groups need no mesh of their own for FSDP2 or the experts, whose exchanges are token by token."""
    meshes = expert_meshes(info, perf) if perf.ep > 1 else Meshes(dense_mesh(info, perf))
    if perf.cp == 1:
        return meshes
    shape = cp_mesh_shape(info.world_size, perf)
    cp_groups = init_device_mesh(info.device.type, shape, mesh_dim_names=("dp", "cp"))
    return dataclasses.replace(meshes, cp=cp_groups["cp"])


def expert_meshes(info: DistInfo, perf: PerfConfig) -> Meshes:
    """A (experts_dp, ep) mesh whose flattening is the dense (shard,) mesh, and its two halves."""
    mesh = init_device_mesh(
        info.device.type, ep_mesh_shape(info.world_size, perf), mesh_dim_names=("experts_dp", "ep")
    )
    return Meshes(mesh[("experts_dp", "ep")]._flatten("shard"), mesh["ep"], mesh["experts_dp"])


def dense_mesh(info: DistInfo, perf: PerfConfig) -> Any:
    """FSDP2's (shard,) mesh over every rank, or HSDP's (replicate, shard)."""
    shape = mesh_shape(info.world_size, perf.replicate)
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(info.device.type, shape, mesh_dim_names=names)


def cp_mesh_shape(world_size: int, perf: PerfConfig) -> tuple[int, int]:
    """(dp, cp) for `perf.cp` consecutive ranks per cp group; ValueError for what cannot be split so (with
    HSDP a group must lie within one replica, whose ranks are consecutive too)."""
    shard = mesh_shape(world_size, perf.replicate)[-1]
    if shard % perf.cp:
        raise ValueError(f"perf.cp = {perf.cp} does not divide the {shard} ranks that shard each replica")
    return world_size // perf.cp, perf.cp


def ep_mesh_shape(world_size: int, perf: PerfConfig) -> tuple[int, int]:
    """(experts_dp, ep) for `perf.ep` ranks per expert group; ValueError for what cannot be split so."""
    if perf.replicate > 1:
        raise ValueError("perf.ep with perf.replicate > 1 (HSDP) is not supported yet: set one of them to 1")
    if world_size % perf.ep:
        raise ValueError(f"perf.ep = {perf.ep} does not divide the world size {world_size}")
    return world_size // perf.ep, perf.ep


def apply_fsdp(
    root: TokenScorer,
    layers: list[torch.nn.Module],
    info: DistInfo,
    perf: PerfConfig,
    routing: MoERouting | None = None,
) -> None:
    """Shard each layer, then the root (which keeps its parameters gathered: the head needs them in backward).

    With `perf.ep`, each layer's experts are first split over the `ep` ranks, then sharded by FSDP2 over
    the ranks that hold the same slice (tidal.trainer.expert_parallel scales their gradients to match).
    With `perf.cp`, the scorer gets its cp group (tidal.trainer.context_parallel).
    """
    _ensure_process_group(info)
    try:
        meshes = device_meshes(info, perf)
    except ValueError as exc:
        from tidal.errors import UserError

        raise UserError(str(exc)) from None
    if meshes.cp is not None:
        from tidal.models.vision import QWEN_VL_TYPES

        kind = str(root.lm.config.model_type)  # type: ignore[union-attr]
        if kind in QWEN_VL_TYPES:
            from tidal.errors import UserError

            raise UserError(
                f"perf.cp = {perf.cp}: context parallelism does not split {kind}'s multimodal RoPE positions "
                "yet; use cp = 1"
            )
        cp_mesh = meshes.cp
        root.context_parallel = ContextParallel(cp_mesh.get_group(), cp_mesh.get_local_rank(), cp_mesh.size())
        if routing is not None:
            routing.cp_group = cp_mesh.get_group()
    common: dict[str, Any] = {"mp_policy": mp_policy(perf, info)}
    if perf.cpu_offload:
        common["offload_policy"] = CPUOffloadPolicy()
    if meshes.ep is not None:
        assert routing is not None, "parallelize refuses perf.ep for a model without MoE layers"
        experts = expert_modules(root)
        shard_experts(experts, meshes.ep)
        routing.ep_group = meshes.ep.get_group()
        for module in experts:
            fully_shard(
                module, mesh=meshes.experts_dp, reshard_after_forward=perf.reshard_after_forward, **common
            )
    for layer in layers:
        fully_shard(layer, mesh=meshes.dense, reshard_after_forward=perf.reshard_after_forward, **common)
    fully_shard(root, mesh=meshes.dense, reshard_after_forward=False, **common)


def _ensure_process_group(info: DistInfo) -> None:
    """FSDP2 needs a process group even for one rank: make a 1-rank group when torchrun did not."""
    if dist.is_initialized():
        return
    backend = "nccl" if info.device.type == "cuda" else "gloo"
    device_id = info.device if info.device.type == "cuda" else None
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, device_id=device_id)


LAYER_PATHS = ("model.layers", "model.text_model.layers", "model.language_model.layers")
"""Where a causal LM keeps its decoder layers: a text model's, Idefics3's and Qwen-VL's language model's."""


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    for path in LAYER_PATHS:
        found: Any = model
        for name in path.split("."):
            found = getattr(found, name, None)
        if found is not None:
            return list(found)
    raise ValueError(f"{type(model).__name__}: cannot find decoder layers at {' or '.join(LAYER_PATHS)}")


def all_reduce_sum(value: float, info: DistInfo) -> float:
    if not info.distributed:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=info.device)
    dist.all_reduce(tensor)
    return float(tensor.item())


def all_reduce_tensor(tensor: torch.Tensor, info: DistInfo) -> torch.Tensor:
    """The element-wise sum of `tensor` over ranks (a copy; fp64 on the rank's device for the reduction)."""
    total = tensor.detach().to(device=info.device, dtype=torch.float64)
    if info.distributed:
        dist.all_reduce(total)
    return total


def all_gather_floats(values: list[float], info: DistInfo) -> list[list[float]]:
    """Every rank's `values` (the same length on each), in rank order: one collective for many metrics."""
    if not info.distributed:
        return [list(values)]
    local = torch.tensor(values, dtype=torch.float64, device=info.device)
    gathered = [torch.empty_like(local) for _ in range(info.world_size)]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]


def barrier(info: DistInfo) -> None:
    if info.distributed:
        dist.barrier()


def shutdown(info: DistInfo) -> None:
    if dist.is_initialized():  # torchrun's group, or the 1-rank group FSDP needed
        dist.destroy_process_group()

"""AdamW (fp32 or bf16 moments) and the learning-rate schedule (linear warmup, then constant/linear/cosine).

With fp32 moments the optimizer is torch's fused/foreach AdamW. With bf16 moments it is `AdamW` below: the
fp32 master weights are updated in fp32, the two moments are stored in bf16 with stochastic rounding. Plain
round-to-nearest would not do: bf16 keeps 8 mantissa bits, so `exp_avg_sq`'s per-step change (1 − β2 = 0.1%
of its value) is below half an ulp (0.2%) and the average would freeze. Stochastic rounding keeps each
stored value an unbiased estimate of the fp32 one. This takes AdamW from 16 to 12 bytes per parameter
(fp32 master + fp32 gradient + 2 × bf16 moments): on Qwen3-4B, 60 → 45 GiB.

On GPU the update is one compiled kernel per tensor, launched a group of same-size tensors per Python call,
that also applies the gradient-clipping factor (`clip_and_step`); the rounding noise is a counter hash, not
Philox (Qwen3-4B, H200: the clip's separate multiply took 8.8 ms a step and the Philox-bound update 35 ms;
numbers in benchmarks/results/trainer_mfu_h200.json; now ~21 ms).
"""

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from tidal.config.common import OptimConfig, SchedulerConfig


def lr_factor(step: int, total_steps: int, config: SchedulerConfig) -> float:
    """Multiplier of the peak lr for the update that follows `step` completed steps (pure, unit-tested)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    if config.type == "constant":
        return 1.0
    decay_steps = max(1, total_steps - config.warmup_steps)
    progress = min(1.0, (step - config.warmup_steps) / decay_steps)
    if config.type == "linear":
        shape = 1.0 - progress
    else:
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * shape


BF16_STATE_MIN_PARAMS = 1_000_000_000
"""`perf.optimizer_state = "auto"` stores bf16 moments on a GPU from this many trainable parameters. Below,
they save under 4 GB, and their compiled update costs the first step tens of seconds of compiling
(SmolLM2-135M on an H100: the first step took 23.5 s against 1 s after; the list lengths of its tensor groups
hit torch's recompile limit), while torch's fused fp32 AdamW compiles nothing."""


def resolve_state_dtype(choice: str, device: torch.device, num_params: int) -> torch.dtype:
    """PerfConfig.optimizer_state → the moments' dtype: `auto` is bf16 on GPU for models of
    `BF16_STATE_MIN_PARAMS` trainable parameters or more, fp32 elsewhere."""
    if choice == "auto":
        big = num_params >= BF16_STATE_MIN_PARAMS
        return torch.bfloat16 if device.type == "cuda" and big else torch.float32
    return torch.bfloat16 if choice == "bf16" else torch.float32


def build_optimizer(
    model: torch.nn.Module, config: OptimConfig, state_dtype: torch.dtype = torch.float32
) -> torch.optim.Optimizer:
    params = [p for p in model.parameters() if p.requires_grad]
    hyper: dict[str, Any] = {
        "lr": config.lr, "betas": config.betas, "eps": config.eps, "weight_decay": config.weight_decay,
    }  # fmt: skip
    if state_dtype != torch.float32:
        return AdamW(params, state_dtype=state_dtype, **hyper)
    fused = all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(params, fused=fused or None, **hyper)


# Constants of the 32-bit integer hash below, as signed int32 (torch has no uint32 arithmetic).
_GOLDEN = -0x61C88647  # 0x9E3779B9: spreads consecutive indices over the 32-bit range
_MIX1 = -0x7A143595  # 0x85EBCA6B  } murmur3's finaliser: every input bit flips each output bit
_MIX2 = -0x3D4D51CB  # 0xC2B2AE35  } with probability ~1/2
GROUP_SIZE = 8  # tensors per compiled call (power-of-two tails, so at most 4 list lengths compile)


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int32 values (torch's `>>` is arithmetic: it copies the sign bit)."""
    return (x >> bits) & ((1 << (32 - bits)) - 1)


def hash_bits(count: int, seed: torch.Tensor) -> torch.Tensor:
    """`count` pseudo-random int32 words, a pure function of (index, `seed`) (0-d int32 tensor).

    Stochastic rounding needs noise independent of the values rounded, not cryptographic quality. A
    counter-based hash costs ~10 integer ops per element; a Philox draw (`torch.randint_like`) costs ~10x
    more and made the update kernel compute-bound on GPU (35 ms for Qwen3-4B instead of ~20 ms).
    """
    x = torch.arange(count, dtype=torch.int32, device=seed.device) * _GOLDEN + seed
    x = (x ^ _shift_right(x, 16)) * _MIX1
    x = (x ^ _shift_right(x, 13)) * _MIX2
    return x ^ _shift_right(x, 16)


def stochastic_round_(target: torch.Tensor, value: torch.Tensor, noise: torch.Tensor | None = None) -> None:
    """Write fp32 `value` into bf16 `target`, rounding up or down with probability given by the remainder.

    bf16 is fp32 with the low 16 bits dropped: adding uniform noise in [0, 2^16) to the bit pattern and then
    truncating rounds away from zero exactly when the noise exceeds the dropped bits' complement. `noise`
    (int32, in [0, 2^16)) may be given; by default it is drawn here.
    """
    bits = value.view(torch.int32)
    if noise is None:
        noise = torch.randint_like(bits, 0, 1 << 16)
    truncated = (bits + noise) & -65536  # 0xFFFF0000: the bits bf16 keeps
    target.copy_(truncated.view(torch.float32))  # exact: nothing below bf16's precision is left


def adamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    scalars: torch.Tensor,
    seed: torch.Tensor,
) -> None:
    """One AdamW update of fp32 `param` in place; moments read/written in their own dtype (1-D views).

    scalars = [lr, β1, β2, eps, weight decay, 1 − β1^t, 1 − β2^t, gradient scale] (a tensor, so a compiled
    kernel is not recompiled when the lr changes; the gradient scale is the clipping factor, applied here
    rather than in a separate pass over the gradients). `seed` (0-d int32) seeds bf16 moments' rounding.
    """
    lr, beta1, beta2, eps, decay, correction1, correction2, scale = scalars.unbind()
    g = grad.float() * scale
    m = exp_avg.float().lerp(g, 1 - beta1)
    v = exp_avg_sq.float() * beta2 + (1 - beta2) * g * g
    param.mul_(1 - lr * decay)
    param.sub_(lr / correction1 * m / (v.sqrt() / correction2.sqrt() + eps))
    if exp_avg.dtype == torch.bfloat16:
        noise = hash_bits(param.numel(), seed)  # one word: 16 bits for each moment
        stochastic_round_(exp_avg, m, noise & 0xFFFF)
        stochastic_round_(exp_avg_sq, v, _shift_right(noise, 16))
    else:
        exp_avg.copy_(m)
        exp_avg_sq.copy_(v)


def adamw_update_group_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    scalars: torch.Tensor,
    seeds: torch.Tensor,
) -> None:
    """`adamw_update_` over a group of same-size tensors: one compiled call launches all their kernels."""
    for i in range(len(params)):
        adamw_update_(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], scalars, seeds[i])


@functools.cache
def _compiled_update() -> Callable[..., None]:
    # dynamic: a group's tensors share one symbolic size (they are grouped by size), so one graph per
    # list length serves every layer shape
    return torch.compile(adamw_update_group_, dynamic=True)


def _update_fn(device: torch.device) -> Callable[..., None]:
    """The update: compiled on GPU, where each tensor's update fuses into one pass over param, grad and
    moments (~20 B/param moved) and a group costs one Python call, not one per tensor (398 for Qwen3-4B,
    ~60 µs each, which left the GPU waiting); eager elsewhere."""
    return _compiled_update() if device.type == "cuda" else adamw_update_group_


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard as a plain tensor (FSDP2 parameters, gradients and their states are DTensors)."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.view(-1)


def _scalars(group: dict[str, Any], step: float) -> list[float]:
    beta1, beta2 = group["betas"]
    return [
        float(group["lr"]),
        beta1,
        beta2,
        group["eps"],
        group["weight_decay"],
        1 - beta1**step,
        1 - beta2**step,
    ]


def rounding_seed(step: int, position: int, rank: int) -> int:
    """Seed (int32) of the bf16 rounding noise for one tensor at one step: distinct per step, tensor and
    rank, and reproducible, so a resumed run rounds as the uninterrupted one would."""
    mixed = (step * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + rank * 0x94D049BB133111EB) >> 17
    mixed &= 0xFFFFFFFF
    return mixed - (1 << 32) if mixed >= 1 << 31 else mixed


def split_group(items: list[Any], size: int = GROUP_SIZE) -> list[list[Any]]:
    """Consecutive chunks of `size`, the tail in decreasing powers of two (pure): list lengths are what a
    compiled group update specialises on, so only log2(size) + 1 of them ever occur."""
    chunks, start = [], 0
    while start < len(items):
        length = size
        while length > len(items) - start:
            length //= 2
        chunks.append(items[start : start + length])
        start += length
    return chunks


class AdamW(torch.optim.Optimizer):
    """AdamW over fp32 master weights with moments stored in `state_dtype` (bf16: stochastic rounding).

    State keys and layout match torch's AdamW (`step`, `exp_avg`, `exp_avg_sq`), so distributed checkpoints
    read and write it the same way; moments loaded from a checkpoint are cast back to `state_dtype`.
    `step(grad_scale=...)` multiplies the gradients by a device scalar on the way in (gradient clipping
    without a separate pass; see `clip_and_step`).
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor],
        lr: float,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        state_dtype: torch.dtype = torch.bfloat16,
    ):
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay})
        self.state_dtype = state_dtype
        self.rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self._views: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure: Callable[[], float] | None = None, grad_scale: torch.Tensor | None = None
    ) -> float | None:
        loss = closure() if closure is not None else None
        position = 0
        for group in self.param_groups:
            by_size: dict[tuple[Any, ...], list[tuple[int, torch.Tensor]]] = {}
            for param in group["params"]:
                position += 1
                if param.grad is None:
                    continue
                state = self._state(param)
                state["step"] += 1
                local_size = self._views[param][0].numel()  # this rank's shard: what the kernel sees
                key = (float(state["step"]), local_size, param.grad.dtype, param.device)
                by_size.setdefault(key, []).append((position, param))
            for (step, _, _, device), members in by_size.items():
                scalars = self._scalar_tensor(group, step, device, grad_scale)
                for chunk in split_group(members):
                    self._update(chunk, int(step), scalars, device)
        return loss

    def _update(
        self, members: list[tuple[int, torch.Tensor]], step: int, scalars: torch.Tensor, device: torch.device
    ) -> None:
        views = [self._views[param] for _, param in members]
        seeds = [rounding_seed(step, position, self.rank) for position, _ in members]
        _update_fn(device)(
            [v[0] for v in views],
            [_local(param.grad) for _, param in members],  # type: ignore[arg-type]
            [v[1] for v in views],
            [v[2] for v in views],
            scalars,
            torch.tensor(seeds, dtype=torch.int32).to(device, non_blocking=True),
        )

    @staticmethod
    def _scalar_tensor(
        group: dict[str, Any], step: float, device: torch.device, grad_scale: torch.Tensor | None
    ) -> torch.Tensor:
        """The kernel's scalars on `device`: one host-to-device copy per step count, not per tensor."""
        values = _scalars(group, step) + [1.0 if grad_scale is None else 0.0]
        scalars = torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)
        if grad_scale is not None:
            scalars[-1] = grad_scale  # a device scalar: copied on device, never read on the host
        return scalars

    def _state(self, param: torch.Tensor) -> dict[str, Any]:
        state = self.state[param]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(param, dtype=self.state_dtype)
            state["exp_avg_sq"] = torch.zeros_like(param, dtype=self.state_dtype)
        if param not in self._views:  # local views cached: to_local() on 4 DTensors per tensor adds up
            self._views[param] = (_local(param), _local(state["exp_avg"]), _local(state["exp_avg_sq"]))
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)  # casts moments to the parameters' dtype
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.state_dtype)
        self._views.clear()


def clip_and_step(
    optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor], max_norm: float
) -> torch.Tensor:
    """Clip the global gradient norm to `max_norm` and step; returns the norm before clipping (a device
    scalar: reading it is left to the caller, after the step's kernels are queued).

    torch's clipping multiplies every gradient in a separate pass (read + write 8 B/param in fp32); tidal's
    AdamW takes the factor as a kernel input instead. Factor as in `torch.nn.utils.clip_grad_norm_`.
    """
    grads: list[Any] = [p.grad for p in params if p.grad is not None]
    norm = global_norm(grads)
    factor = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    if isinstance(optimizer, AdamW):
        optimizer.step(grad_scale=factor)
        return norm
    # torch's clip_grad_norm_ cannot mix DTensors of different meshes (expert parallelism): scale the local
    # shards by the factor computed over all of them
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    if local:
        torch._foreach_mul_(local, factor.to(local[0].device))
    optimizer.step()
    return norm


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """L2 norm over `tensors` and, for FSDP2's DTensors, over all their shards: per group of tensors laid out
    alike (the dense parameters; with expert parallelism also the experts, on another mesh), one foreach
    norm of the local shards, then one all-reduce of the sum of squares over the mesh dimensions they are
    sharded on (replicated dimensions hold copies). Same value as `torch.nn.utils.get_total_norm`, whose
    DTensor dispatch op by op over hundreds of gradients costs milliseconds of CPU while the GPU waits."""
    if not tensors:
        return torch.zeros(())
    groups: dict[Any, list[torch.Tensor]] = {}
    for tensor in tensors:
        layout = (getattr(tensor, "device_mesh", None), tuple(getattr(tensor, "placements", ())))
        groups.setdefault(layout, []).append(tensor)
    total = None
    for (mesh, placements), group in groups.items():
        local = [t.to_local() if hasattr(t, "to_local") else t for t in group]
        squares = torch.stack(torch._foreach_norm(local)).float().square().sum()
        for dim, placement in enumerate(placements):
            if placement.is_shard() and mesh.size(dim) > 1:
                torch.distributed.all_reduce(squares, group=mesh.get_group(dim))
        total = squares if total is None else total + squares
    assert total is not None
    return total.sqrt()


def build_scheduler(
    optimizer: torch.optim.Optimizer, total_steps: int, config: SchedulerConfig
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, total_steps, config))

"""Expert parallelism: the ranks of an `ep` group each hold a slice of every MoE layer's experts, and tokens
travel to the ranks of their experts by all-to-all and come back the same way.

One MoE layer's forward on a rank of an `ep` group (every rank routes its own tokens):

    rows sorted by expert = by destination rank (each rank holds consecutive experts)
      → all-to-all of the row counts [ranks, local experts] → split sizes (one host sync)
      → all-to-all of the rows: what arrives is ordered by source rank, then expert
      → reordered expert-major → the local experts' grouped matmuls (tidal.trainer.experts)
      → the inverse order → all-to-all back: each row returns to its token's rank, in the order it left

Backward runs the same exchanges in reverse (`AllToAll`). The expert tensors are DTensors sharded on dim 0
over the `ep` mesh dimension (`shard_experts`); FSDP2 shards them further over the remaining data-parallel
ranks. Their gradients come out as the dense parameters' do, the mean over every rank's loss.
"""

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from tidal.trainer.experts import combine, dispatch, sorted_expert_mlp, sorted_rows, unpermute


class AllToAll(torch.autograd.Function):
    """rows [n, ...] → the rows other ranks send here; `send_splits[r]` rows go to rank r of `group`,
    `recv_splits[r]` come from it. The gradient goes back by the reverse exchange."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any
    ) -> torch.Tensor:
        ctx.exchange = (send_splits, recv_splits, group)
        return exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        send_splits, recv_splits, group = ctx.exchange
        return exchange(grad, recv_splits, send_splits, group), None, None, None


class ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `factor`."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, factor: float) -> torch.Tensor:  # type: ignore[override]
        ctx.factor = factor
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        return grad * ctx.factor, None


def exchange(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group: Any) -> torch.Tensor:
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv_splits, send_splits, group=group)
    return out


def expert_major_order(recv_counts: torch.Tensor) -> torch.Tensor:
    """The permutation that reorders received rows from (source rank, expert) order to (expert, source
    rank) order; recv_counts [sources, local experts] (pure)."""
    sources, experts = recv_counts.shape
    flat = recv_counts.reshape(-1)  # [sources·experts], in arrival order
    starts = torch.cumsum(flat, 0) - flat  # where each (source, expert) chunk starts on arrival
    chunk_order = torch.arange(sources * experts, device=flat.device).view(sources, experts).t().reshape(-1)
    sizes = flat[chunk_order]  # chunk sizes in expert-major order
    total = int(flat.sum())
    chunk_of_row = torch.repeat_interleave(chunk_order, sizes, output_size=total)  # [rows]
    first_row = torch.repeat_interleave(torch.cumsum(sizes, 0) - sizes, sizes, output_size=total)
    return starts[chunk_of_row] + torch.arange(total, device=flat.device) - first_row


def expert_mlp_ep(
    x: torch.Tensor,
    expert_index: torch.Tensor,
    routing_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    kernel: str,
    group: Any,
) -> torch.Tensor:
    """`tidal.trainer.experts.expert_mlp` with this rank's experts only: gate_up_proj / down_proj hold the
    local slice [experts / ep, …] of the experts, which `expert_index` numbers globally; x [tokens, hidden]
    → [tokens, hidden]."""
    ep = dist.get_world_size(group)
    local_experts = gate_up_proj.shape[0]
    # a local expert's gradient sums the tokens of all `ep` ranks, each scaled as its rank's loss is, while
    # FSDP2 averages it over only the world / ep ranks holding the same slice: 1 / ep makes it the global
    # mean (FSDP2's own divide factor would need a pre-multiplied reduce-scatter, which gloo lacks)
    gate_up_proj, down_proj = ScaleGrad.apply(gate_up_proj, 1 / ep), ScaleGrad.apply(down_proj, 1 / ep)
    plan = dispatch(expert_index, local_experts * ep)
    rows = sorted_rows(x, plan, expert_index.shape[1])  # [tokens·k, hidden] by expert = by rank
    send_counts = plan.counts.view(ep, local_experts)  # [destination rank, its local expert]
    recv_counts = torch.empty_like(send_counts)  # [source rank, my local expert]
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    splits = torch.cat([send_counts.sum(1), recv_counts.sum(1)]).tolist()  # the one host sync
    send_splits, recv_splits = splits[:ep], splits[ep:]
    received = AllToAll.apply(rows, send_splits, recv_splits, group)  # by source rank, then expert
    order = expert_major_order(recv_counts)
    local = sorted_expert_mlp(
        received.index_select(0, order), recv_counts.sum(0), gate_up_proj, down_proj, act, kernel
    )
    back = unpermute(local, order)  # arrival order again
    out = AllToAll.apply(back, recv_splits, send_splits, group)  # [tokens·k, hidden], as `rows` left
    return combine(out, plan, routing_weights, x.dtype)


def shard_experts(experts: list[torch.nn.Module], mesh: Any) -> None:
    """Replace each experts module's fused tensors by DTensors sharded on the expert dimension over `mesh`
    (the `ep` mesh dimension): every rank keeps its consecutive slice (no communication: every rank
    loaded the whole model)."""
    from torch.distributed.tensor import DTensor, Shard

    ep, rank = mesh.size(), mesh.get_local_rank()
    for module in experts:
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(module, name)
            if full.shape[0] % ep:
                raise ValueError(f"perf.ep = {ep} does not divide the {full.shape[0]} experts of each layer")
            size = full.shape[0] // ep
            local = full.detach()[rank * size : (rank + 1) * size].clone()
            sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(module, name, torch.nn.Parameter(sharded, requires_grad=full.requires_grad))

"""Expert MLPs of a mixture-of-experts layer as grouped matrix multiplies (pure tensor code, no modules).

Every token goes to `top_k` experts. The (token, expert) pairs are sorted by expert so that each expert's
rows are contiguous; both projections then run as one grouped matmul each over all experts:

    x [tokens, hidden] → rows [tokens·k, hidden] sorted by expert
      → rows @ gate_up[e]ᵀ per group → act(gate) · up → @ down[e]ᵀ per group → [tokens·k, hidden]
      → back in (token, k) order, times the routing weights, summed over k → [tokens, hidden]

Two kernels do the grouped matmul:

- `grouped_mm`: torch's grouped GEMM (`torch.nn.functional.grouped_mm`, or `torch._grouped_mm` in older
  releases) with cumulative group ends as offsets. It runs on Hopper GPUs in bf16, and recent CPU builds have
  a kernel too. No host sync, no padding.
- `padded`: each expert's rows are scattered into a [experts, capacity, hidden] buffer (capacity = the most
  rows any expert got) and one `torch.bmm` does every expert at once. It runs on any device and dtype and
  has no Python loop over experts, at the price of one host sync (the capacity) and the padding, which is
  at most `experts ×` the rows when routing is very uneven. It is the fallback where `grouped_mm` does not
  run (fp32 or pre-Hopper GPUs, old torch) and the reference `grouped_mm` is checked against.

The combine step un-sorts with a permutation and sums each token's k rows, and the dispatch's backward does
the same with the row gradients, so no atomic adds are involved and the result is deterministic on GPU too.
Nothing is ever dropped: every routed pair is computed.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

KERNELS = ("grouped_mm", "padded")
GROUPED_MM_ALIGN_BYTES = 16  # torch's grouped GEMM refuses row strides that are not a multiple of this


@dataclass(frozen=True)
class Dispatch:
    """Where each routed (token, expert) pair goes, for one layer's forward."""

    order: torch.Tensor
    """[tokens·k] long: the flat (token, k) pair at each sorted row (a permutation)."""
    counts: torch.Tensor
    """[experts] long: rows per expert."""


def dispatch(expert_index: torch.Tensor, num_experts: int) -> Dispatch:
    """Sort the pairs of `expert_index` [tokens, k] by expert (stable: within an expert, token order)."""
    flat = expert_index.reshape(-1)  # [tokens·k]
    order = torch.argsort(flat, stable=True)
    # a scatter-add of ones, not bincount: bincount's output size depends on the data, so on CUDA it syncs
    # with the host and under torch.compile it breaks the graph (and with it the layer's checkpoint region)
    counts = flat.new_zeros(num_experts).scatter_add(0, flat, torch.ones_like(flat))  # [experts]
    return Dispatch(order, counts)


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [n, in] sorted by group, weight [groups, in, out], offsets [groups] → [n, out] (torch's kernel)."""
    kernel = getattr(F, "grouped_mm", None) or torch._grouped_mm
    return kernel(rows, weight, offs=offsets)


def padded_mm(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """The same as `grouped_mm` through one bmm over [groups, capacity, in] (rows scattered, then gathered)."""
    groups, num_rows = weight.shape[0], rows.shape[0]
    group_of_row = torch.repeat_interleave(
        torch.arange(groups, device=rows.device), counts, output_size=num_rows
    )  # [n]
    starts = torch.cumsum(counts, 0) - counts  # [groups]
    slot = torch.arange(num_rows, device=rows.device) - starts[group_of_row]  # [n]: position in its group
    capacity = int(counts.max()) if num_rows else 0  # the one host sync
    buffer = rows.new_zeros(groups, capacity, rows.shape[1])  # [groups, capacity, in]
    buffer = buffer.index_put((group_of_row, slot), rows)
    return torch.bmm(buffer, weight)[group_of_row, slot]  # [n, out]


def group_matmul(rows: torch.Tensor, weight: torch.Tensor, counts: torch.Tensor, kernel: str) -> torch.Tensor:
    """rows [n, in] sorted by group with `counts` [groups] rows each, weight [groups, in, out] → [n, out]."""
    if kernel == "grouped_mm":
        return grouped_mm(rows, weight, torch.cumsum(counts, 0).to(torch.int32))
    return padded_mm(rows, weight, counts)


def sorted_expert_mlp(
    rows: torch.Tensor,
    counts: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    kernel: str,
) -> torch.Tensor:
    """Each expert's MLP on its rows: rows [n, hidden] sorted by expert, `counts` [experts] rows each;
    gate_up_proj [experts, 2·inter, hidden] (gate rows first, then up: HF's fused layout), down_proj
    [experts, hidden, inter] → [n, hidden]."""
    gate_up = group_matmul(rows, gate_up_proj.transpose(1, 2), counts, kernel)  # [n, 2·inter]
    gate, up = gate_up.chunk(2, dim=-1)
    return group_matmul(act(gate) * up, down_proj.transpose(1, 2), counts, kernel)  # [n, hidden]


def unpermute(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows in sorted order back in their original order: row i goes to position order[i] (a copy, no
    atomics; `order` is a permutation)."""
    return torch.index_copy(torch.empty_like(rows), 0, order, rows)


class _SortedRows(torch.autograd.Function):
    """x [tokens, hidden] → rows [tokens·k, hidden]: each token's row once per routed expert, in the plan's
    sorted order. `index_select` does the same forward, but its backward is an `index_add_` in which the k
    rows of a token collide: atomic adds, rounded to the activations' dtype (bf16) at each add, and the one
    slow kernel of the expert layer's backward on a GPU. Here the backward un-permutes the row gradients (a
    copy) and sums each token's k of them in one reduction."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, order: torch.Tensor, top_k: int) -> torch.Tensor:
        ctx.save_for_backward(order)
        ctx.top_k = top_k
        return x.index_select(0, order // top_k)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (order,) = ctx.saved_tensors
        unsorted = unpermute(grad, order)  # [tokens·k, hidden], (token, k) order
        return unsorted.view(-1, ctx.top_k, grad.shape[-1]).sum(1), None, None


def sorted_rows(x: torch.Tensor, plan: Dispatch, top_k: int) -> torch.Tensor:
    """x [tokens, hidden] → [tokens·k, hidden]: the row of each routed (token, expert) pair, sorted by expert."""
    return _SortedRows.apply(x, plan.order, top_k)


def combine(
    out: torch.Tensor, plan: Dispatch, routing_weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Sorted rows out [tokens·k, hidden] back in (token, k) order, weighted, summed over k → [tokens, hidden].

    The permutation's inverse is applied as a copy (no atomics, deterministic)."""
    num_tokens, top_k = routing_weights.shape
    unsorted = unpermute(out, plan.order)  # [tokens·k, hidden]
    weighted = unsorted.view(num_tokens, top_k, -1) * routing_weights.unsqueeze(-1).to(out.dtype)
    return weighted.sum(1).to(dtype)  # [tokens, hidden]


def expert_mlp(
    x: torch.Tensor,
    expert_index: torch.Tensor,
    routing_weights: torch.Tensor,
    gate_up_proj: torch.Tensor,
    down_proj: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
    kernel: str,
) -> torch.Tensor:
    """Σ_k w[t, k] · down[e]·(act(gate[e]·x[t]) ⊙ up[e]·x[t]) with e = expert_index[t, k], as grouped matmuls.

    x [tokens, hidden]; expert_index, routing_weights [tokens, k]; gate_up_proj, down_proj as in
    `sorted_expert_mlp` → [tokens, hidden].
    """
    plan = dispatch(expert_index, gate_up_proj.shape[0])
    rows = sorted_rows(x, plan, expert_index.shape[1])  # [tokens·k, hidden], sorted by expert
    out = sorted_expert_mlp(rows, plan.counts, gate_up_proj, down_proj, act, kernel)
    return combine(out, plan, routing_weights, x.dtype)


@functools.cache
def grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM runs here in `dtype`, forward and backward, and matches `padded_mm`
    (an empty group included). Probed once per device type and dtype, before any compiled region."""
    if not (hasattr(F, "grouped_mm") or hasattr(torch, "_grouped_mm")):
        return False
    device = torch.device(device_type)
    gen = torch.Generator(device=device).manual_seed(0)
    rows = torch.randn(24, 32, device=device, generator=gen).to(dtype).requires_grad_()
    weight = torch.randn(4, 32, 16, device=device, generator=gen).to(dtype).requires_grad_()
    counts = torch.tensor([5, 0, 11, 8], device=device)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    grad = torch.randn(24, 16, device=device, generator=gen).to(dtype)
    try:
        got = grouped_mm(rows, weight, offsets)
        got_grads = torch.autograd.grad(got, (rows, weight), grad)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    want = padded_mm(rows, weight, counts)
    want_grads = torch.autograd.grad(want, (rows, weight), grad)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    pairs = [(got, want), *zip(got_grads, want_grads, strict=True)]
    return all(torch.allclose(a.float(), b.float(), atol=tol, rtol=tol) for a, b in pairs)


def aligned_for_grouped_mm(dims: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Whether torch's grouped GEMM accepts these sizes: each of `dims` (hidden size and expert intermediate
    size) times the element size a multiple of GROUPED_MM_ALIGN_BYTES."""
    return all(dim * dtype.itemsize % GROUPED_MM_ALIGN_BYTES == 0 for dim in dims)


def resolve_kernel(choice: str, device_type: str, dtype: torch.dtype, dims: tuple[int, ...]) -> str:
    """`grouped_mm` or `padded` for the setting `choice`; `auto` takes `grouped_mm` when the expert sizes
    `dims` suit it and the probe passes on this device and dtype. An explicit `grouped_mm` that cannot run
    on these sizes is a ValueError."""
    aligned = aligned_for_grouped_mm(dims, dtype)
    if choice == "auto":
        return "grouped_mm" if aligned and grouped_mm_works(device_type, dtype) else "padded"
    if choice == "grouped_mm" and not aligned:
        raise ValueError(
            f"moe.experts = 'grouped_mm' needs expert sizes {dims} to be multiples of "
            f"{GROUPED_MM_ALIGN_BYTES // dtype.itemsize} "
            f"in {str(dtype).removeprefix('torch.')}; use 'padded' or 'auto'"
        )
    return choice

"""Context parallelism: the cp ranks of a group split each packed row along the sequence, and attention
exchanges heads for sequence by all-to-all (DeepSpeed-Ulysses).

One forward on a rank of a `cp` group of size C (every rank of the group gets the same rows):

    rows [rows, seq] → padded to a multiple of C → this rank's contiguous chunk [rows, seq / C]
      → embeddings, norms, q/k/v projections, RoPE (with the chunk's own position ids): token-local
      → attention: all-to-all q/k/v [rows, heads, seq / C, dim] → [rows, heads / C, seq, dim]: every rank
        now holds the whole sequence for 1/C of the heads, so tidal's varlen attention runs unchanged on
        the row's documents (boundaries from the full rows' position ids)
      → all-to-all back [rows, seq, heads / C, dim] → [rows, seq / C, heads, dim] → o_proj, MLP: token-local
      → the chunked head scores the chunk → logprobs all-gathered to [rows, seq]

Every rank of the group then holds the whole rows' logprobs and computes the same loss; the all-gather's
backward keeps only this rank's chunk of that loss's gradient, so the group's gradients sum to the whole
rows' gradient, and FSDP2 (which shards over data-parallel × cp ranks) averages them with the other
groups' as it averages data-parallel ranks: the trainers' loss scaling is unchanged.

Why all-to-all over heads rather than ring attention: packed documents need no new masking (each rank
sees the full sequence of its heads, so the per-document varlen/SDPA attention stays as it is), the work
splits evenly whatever the document lengths (a causal ring needs load-balanced chunk orders and
per-document masks across ring steps), and each layer exchanges q, k, v and the output once, whatever C is.
The limits: C must divide the number of attention heads (key/value heads that C does not divide are
repeated until it does), and a group's sequence is split at most `heads` ways.

Mixture-of-experts layers are token-local too: each rank routes its chunk's tokens. The token mask and
routing replay's routes are split like the tokens (`split_token_mask`, `split_routes`), and the router
statistics of the load-balancing loss are summed over the group (tidal.trainer.moe), so each rank's loss
is the whole rows' loss.
"""

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from tidal.trainer.attention import unsupported_attention, varlen_attention_forward
from tidal.trainer.moe import Routes

CP_ATTN_NAME = "tidal_cp"


@dataclass(frozen=True)
class ContextParallel:
    """This rank's place in its cp group: the group's process group, its rank there and the group's size."""

    group: Any
    rank: int
    size: int

    def split(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pad the rows [rows, seq] to a multiple of the group size; returns this rank's chunk of each
        ([rows, seq / size]) and the padded full position ids (the document boundaries attention needs)."""
        input_ids, position_ids, targets = pad_rows(input_ids, position_ids, targets, self.size)
        ids, positions, chunk_targets = (
            chunk_of(x, self.rank, self.size) for x in (input_ids, position_ids, targets)
        )
        return ids, positions, chunk_targets, position_ids

    def split_token_mask(self, token_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
        """This rank's chunk [rows, seq / size] of token_mask [rows, seq] (None: every token of input_ids is
        real), the split's padding marked False: it must stay out of the routing statistics."""
        mask = torch.ones_like(input_ids, dtype=torch.bool) if token_mask is None else token_mask.bool()
        return chunk_of(pad_seq(mask, self.size), self.rank, self.size)

    def split_routes(self, routes: Routes, rows: int) -> Routes:
        """This rank's tokens of `routes` (flattened [rows, seq] order), in its chunk's order; the split's
        padding has no routes."""
        experts = routes.experts.reshape(rows, -1, *routes.experts.shape[1:])  # [rows, seq, layers, k]
        mask = routes.mask.reshape(rows, -1)  # [rows, seq]
        experts, mask = (chunk_of(pad_seq(x, self.size), self.rank, self.size) for x in (experts, mask))
        return Routes(experts.flatten(0, 1), mask.flatten())

    def gather(self, local: torch.Tensor, seq: int) -> torch.Tensor:
        """Every rank's chunk [rows, chunk] in rank order, cut to the unpadded `seq` [rows, seq]. Autograd
        sees only this rank's chunk: the backward keeps that chunk's gradient (every rank of the group
        computes the same loss from the same gathered rows, so the chunks' gradients sum to the whole's)."""
        gathered = funcol.wait_tensor(funcol.all_gather_single(local.detach(), 1, self.group))
        parts = list(gathered.chunk(self.size, dim=1))  # [rows, chunk] each
        parts[self.rank] = local
        full = torch.cat(parts, dim=1)  # [rows, padded seq]
        # a copy, not a view: FSDP2 hooks the root's outputs for its backward
        return full if full.shape[1] == seq else full[:, :seq].clone()


def pad_rows(
    input_ids: torch.Tensor, position_ids: torch.Tensor, targets: torch.Tensor, multiple: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows [rows, seq] padded at the end to a multiple of `multiple` tokens (pure). The padding continues
    the last document's positions, as tidal's packers pad: causal attention keeps it out of every real
    token's view, and its scores are cut off after the gather."""
    seq = input_ids.shape[1]
    pad = -seq % multiple
    if pad == 0:
        return input_ids, position_ids, targets
    steps = torch.arange(1, pad + 1, device=position_ids.device)  # [pad]
    more_positions = position_ids[:, -1:] + steps  # [rows, pad]
    zeros = input_ids.new_zeros((input_ids.shape[0], pad))
    return (
        torch.cat([input_ids, zeros], dim=1),
        torch.cat([position_ids, more_positions], dim=1),
        torch.cat([targets, zeros.to(targets.dtype)], dim=1),
    )


def pad_seq(rows: torch.Tensor, multiple: int) -> torch.Tensor:
    """rows [rows, seq, ...] padded with zeros (False) at the end of dim 1 to a multiple of `multiple` (pure)."""
    pad = -rows.shape[1] % multiple
    if pad == 0:
        return rows
    return torch.cat([rows, rows.new_zeros((rows.shape[0], pad, *rows.shape[2:]))], dim=1)


def chunk_of(rows: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank `rank`'s contiguous chunk [rows, seq / size, ...] of `rows` [rows, seq, ...] (pure)."""
    return rows.chunk(size, dim=1)[rank].contiguous()


def repeat_kv_heads(key_or_value: torch.Tensor, size: int) -> torch.Tensor:
    """[b, kv_heads, s, d] with each head repeated until `size` divides their number (pure).

    Repeating each head r times keeps query head h on its key/value head (h // (heads / kv_heads) before,
    h // (heads / (kv_heads · r)) after), so after the all-to-all each rank's query heads find theirs.
    """
    kv_heads = key_or_value.shape[1]
    repeats = size // math.gcd(kv_heads, size)
    return key_or_value if repeats == 1 else key_or_value.repeat_interleave(repeats, dim=1)


def seq_to_heads(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[b, heads, s / size, d] (this rank's tokens, every head) → [b, heads / size, s, d] (every token,
    this rank's heads) by one all-to-all; its backward is the reverse exchange."""
    b, heads, chunk, d = x.shape
    send = (
        x.reshape(b, size, heads // size, chunk, d).transpose(0, 1).contiguous()
    )  # [size, b, h/size, chunk, d]
    recv = _all_to_all(send, group)  # [size (source = sequence chunk), b, h/size, chunk, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, heads // size, size * chunk, d)


def heads_to_seq(x: torch.Tensor, group: Any, size: int) -> torch.Tensor:
    """[b, s, heads / size, d] (every token, this rank's heads) → [b, s / size, heads, d] (this rank's
    tokens, every head): the inverse of `seq_to_heads` on attention's output layout."""
    b, seq, local_heads, d = x.shape
    chunk = seq // size
    send = (
        x.reshape(b, size, chunk, local_heads, d).transpose(0, 1).contiguous()
    )  # [size, b, chunk, h/size, d]
    recv = _all_to_all(send, group)  # [size (source = head group), b, chunk, h/size, d]
    return recv.permute(1, 2, 0, 3, 4).reshape(b, chunk, size * local_heads, d)


def _all_to_all(send: torch.Tensor, group: Any) -> torch.Tensor:
    """Equal chunks of dim 0: chunk j to rank j, chunk i of the result from rank i (autograd-aware)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(send, None, None, group))


def cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    tidal_cp_group: Any = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention interface over a cp group: q [b, heads, s / C, d], k/v [b, kv_heads, s / C, d]
    → out [b, s / C, heads, d], tidal_varlen attention in between on the whole sequence of heads / C heads.
    `kwargs` carry the full rows' document bounds (tidal_cu_seqlens / tidal_max_seqlen, see TokenScorer)."""
    if tidal_cp_group is None:
        raise ValueError("tidal_cp attention needs tidal_cp_group (see TokenScorer)")
    size = dist.get_world_size(tidal_cp_group)
    key, value = repeat_kv_heads(key, size), repeat_kv_heads(value, size)
    q, k, v = (seq_to_heads(x, tidal_cp_group, size) for x in (query, key, value))
    out, _ = varlen_attention_forward(module, q, k, v, attention_mask, **kwargs)  # [b, s, heads / C, d]
    return heads_to_seq(out, tidal_cp_group, size), None


def check_context_parallel(model: torch.nn.Module, cp: int) -> str | None:
    """Why `model` cannot split its attention over `cp` ranks, or None (read from its HF config)."""
    config: Any = model.config
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or 0
    if heads % cp:
        return f"its {heads} attention heads do not split over {cp} ranks"
    if kv_heads and heads % kv_heads:
        return f"its {heads} query heads do not group over {kv_heads} key/value heads"
    unsupported = unsupported_attention(model)
    if unsupported is not None:
        return f"it uses {unsupported}, which tidal's variable-length attention (what cp runs) lacks"
    return None


def use_context_parallel(model: torch.nn.Module) -> None:
    """Switch `model`'s attention to `tidal_cp` (tidal_varlen between two all-to-alls)."""
    from transformers import AttentionInterface

    AttentionInterface.register(CP_ATTN_NAME, cp_attention_forward)
    model.config._attn_implementation = CP_ATTN_NAME  # type: ignore[attr-defined,union-attr]

"""SFT data logic: tokenise conversations with an assistant-only loss mask, pack them, shard rows over ranks.

Rows are packed up to seq_len tokens but padded per micro-batch, only to its longest row (rounded up to
data.pad_multiple, `tidal.types.padded_width`), and a micro-batch has only the rows it needs: the forward
pass then costs what the real tokens cost, not micro_batch_size × seq_len.

Pure functions and small state; no torch here except `collate`, so it is unit-tested in isolation.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tidal.envs.tools import conversation_template_inputs
from tidal.types import PAD_MULTIPLE, Pictures, padded_width

IGNORE_INDEX = -100


@dataclass
class TokenizedSample:
    """One conversation as token ids; `loss_mask[i]` is 1 where token i is an assistant token to learn."""

    input_ids: list[int]
    loss_mask: list[int]
    pictures: Pictures | None = None
    """A vision-language model's conversation: its pictures, whose image tokens `input_ids` holds expanded."""


@dataclass
class PackedRow:
    """Several samples concatenated into one row; positions restart at 0 for each sample.

    `labels[i]` is the token that should follow position i, or IGNORE_INDEX (not an assistant token, the last
    token of a sample, or padding). Restarting positions is what tells the attention to stay inside a sample.
    """

    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    labels: list[int] = field(default_factory=list)
    num_padding: int = 0
    """Padding tokens at the row's end (not real tokens: MoE routing statistics leave them out)."""
    pictures: list[Pictures] = field(default_factory=list)
    """The pictures of the row's samples, in the order of their image tokens."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_real_tokens(self) -> int:
        return len(self.input_ids) - self.num_padding

    @property
    def num_loss_tokens(self) -> int:
        return sum(label != IGNORE_INDEX for label in self.labels)


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, Any]]) -> TokenizedSample:
    """Tokenise with the chat template; mark the tokens each assistant turn adds (up to its EOS) as trainable.
    A conversation that carries its tools (a tool environment's demonstration) has them described as in the
    rollout's prompt (`tidal.envs.tools.conversation_template_inputs`).

    The assistant span is found by rendering the conversation up to each assistant turn with and without it,
    which works for any template that renders a prefix of the conversation as a prefix of the text.
    """

    messages, template_kwargs = conversation_template_inputs(tokenizer, list(messages))

    def encode(msgs: Sequence[dict[str, Any]], add_generation_prompt: bool) -> list[int]:
        text = tokenizer.apply_chat_template(
            list(msgs), tokenize=False, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    full = encode(messages, add_generation_prompt=False)
    mask = [0] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        start = len(encode(messages[:i], add_generation_prompt=True))
        upto = encode(messages[: i + 1], add_generation_prompt=False)
        if full[: len(upto)] != upto or upto[:start] != full[:start]:
            raise ValueError("chat template does not render conversation prefixes as token prefixes")
        end = len(upto)
        eos = tokenizer.eos_token_id
        span = upto[start:end]
        if eos in span:  # template text after the EOS (e.g. a newline) is not the model's to learn
            end = start + len(span) - span[::-1].index(eos)
        mask[start:end] = [1] * (end - start)
    return TokenizedSample(full, mask)


def pack_samples(samples: Sequence[TokenizedSample], seq_len: int) -> tuple[list[PackedRow], int]:
    """First-fit pack samples into rows of at most `seq_len` tokens, unpadded (`pad_rows` pads a
    micro-batch's); returns rows and #samples truncated. A longer sample with pictures is left out instead
    (and counted): a cut could split a picture's image tokens from its features."""
    rows: list[PackedRow] = []
    num_truncated = 0
    for sample in samples:
        ids, mask = sample.input_ids, sample.loss_mask
        if len(ids) > seq_len:
            num_truncated += 1
            if sample.pictures is not None:
                continue
            ids, mask = ids[:seq_len], mask[:seq_len]
        row = next((r for r in rows if len(r) + len(ids) <= seq_len), None)
        if row is None:
            row = PackedRow()
            rows.append(row)
        row.input_ids += ids
        row.position_ids += list(range(len(ids)))
        # label of position i is token i+1, learned only if token i+1 is an assistant token
        row.labels += [ids[i + 1] if mask[i + 1] else IGNORE_INDEX for i in range(len(ids) - 1)] + [
            IGNORE_INDEX
        ]
        if sample.pictures is not None:
            row.pictures.append(sample.pictures)
    return rows, num_truncated


def pad_row(row: PackedRow, width: int, pad_id: int) -> PackedRow:
    """A copy of `row` padded at its end to `width` tokens.

    Padding continues the last sample's positions: it then counts as part of that sample, which is harmless
    (causal attention: no real token sees it; its labels are ignored) and leaves a row holding one sample
    free of the packed-sequence mask, so attention can take the plain causal fast path.
    """
    pad = width - len(row)
    last = row.position_ids[-1] + 1 if row.position_ids else 0
    return PackedRow(
        row.input_ids + [pad_id] * pad,
        row.position_ids + list(range(last, last + pad)),
        row.labels + [IGNORE_INDEX] * pad,
        row.num_padding + pad,
        row.pictures,
    )


def pad_rows(
    rows: Sequence[PackedRow], seq_len: int, pad_id: int, pad_multiple: int = PAD_MULTIPLE
) -> list[PackedRow]:
    """One micro-batch's rows padded to a common width: the longest rounded up to `pad_multiple`, at most
    `seq_len` (`padded_width`)."""
    width = padded_width(max((len(r) for r in rows), default=0), seq_len, pad_multiple)
    return [pad_row(r, width, pad_id) for r in rows]


def shard_rows(
    rows: Sequence[PackedRow], rank: int, world_size: int, micro_batch_size: int
) -> list[list[PackedRow]]:
    """This rank's micro-batches of up to `micro_batch_size` unpadded rows. Every rank gets the same number:
    where its rows run out, a micro-batch of one empty row (`pad_rows` pads it like any other), because
    FSDP runs collectives in every forward/backward and a rank with fewer passes would hang the others. No
    micro-batch is filled up with empty rows: padding rows cost the forward as much as real ones."""
    mine = list(rows[rank::world_size])
    per_rank = -(-len(rows) // world_size)
    num_micro = max(1, -(-per_rank // micro_batch_size))
    micro = [mine[i : i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
    return micro + [[PackedRow()] for _ in range(num_micro - len(micro))]


class EpochSampler:
    """Deterministic sample order: a seeded permutation per epoch; the state is one integer (samples consumed)."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool):
        if num_samples == 0:
            raise ValueError("dataset is empty")
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.position = 0

    def _order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.num_samples)
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def next_indices(self, count: int) -> list[int]:
        out: list[int] = []
        while len(out) < count:
            epoch, offset = divmod(self.position, self.num_samples)
            take = min(count - len(out), self.num_samples - offset)
            out += self._order(epoch)[offset : offset + take].tolist()
            self.position += take
        return out

    @property
    def epoch(self) -> float:
        return self.position / self.num_samples

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])


def collate(rows: Sequence[PackedRow]) -> dict[str, Any]:
    import torch

    return {
        "input_ids": torch.tensor([r.input_ids for r in rows], dtype=torch.long),  # [batch, seq]
        "position_ids": torch.tensor([r.position_ids for r in rows], dtype=torch.long),  # [batch, seq]
        "labels": torch.tensor([r.labels for r in rows], dtype=torch.long),  # [batch, seq]
        # True on real tokens, False on the padding at each row's end
        "token_mask": torch.tensor([[i < r.num_real_tokens for i in range(len(r))] for r in rows]),
    }


def collate_pictures(rows: Sequence[PackedRow], device: Any = "cpu") -> dict[str, Any]:
    """The picture inputs of a micro-batch's rows, in the order of their image tokens (rows in order), as
    tensors on `device` by forward argument name; {} for text."""
    return Pictures.join_tensors([p for r in rows for p in r.pictures], device)

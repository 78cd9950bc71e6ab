"""Turn scored groups into train samples and pack them into equal numbers of micro-batches per trainer rank.

A micro-batch's rows are padded only to its longest row (rounded up to `pad_multiple`, see
`tidal.types.padded_width`), not to seq_len: the trainer's forward then costs what the real tokens cost.
"""

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tidal.orchestrator.advantages import DEFAULT_EPS, AdvantageKind, group_advantages, usable_rollouts
from tidal.orchestrator.distill import DistillWeights, completion_advantages
from tidal.types import (
    PAD_MULTIPLE,
    Group,
    MicroBatch,
    Pictures,
    Rollout,
    RoutedExperts,
    TrainBatch,
    TrainSample,
    padded_width,
)


class ExpandPictures(Protocol):
    """The model's processor as batching uses it (tidal.models.vision.PictureInputs)."""

    @property
    def placeholder_id(self) -> int:
        """The token the chat template writes once per picture."""
        ...

    def expand(self, ids: Sequence[int], images: Sequence[str]) -> tuple[list[int], Pictures]:
        """(ids with picture placeholders, the pictures) → (the ids with each placeholder expanded into the
        picture's image tokens, the pictures' arrays)."""
        ...


def sample_from_rollout(
    rollout: Rollout,
    advantage: float,
    expand_pictures: ExpandPictures | None = None,
    distill: DistillWeights | None = None,
) -> TrainSample:
    """Concatenate prompt and completion; only the completion's trainable tokens carry loss and logprobs.
    A rollout with pictures gets its placeholders expanded as vLLM expanded them, the prompt's and those an
    environment's turns added (`expand_rollout`; ValueError without `expand_pictures`). With `distill`, each completion token gets its own advantage from the
    teacher's logprobs (tidal.orchestrator.distill)."""
    prompt, completion, pictures = rollout.prompt_ids, rollout.completion_ids, None
    columns: list[list[float]] = [
        [float(m) for m in rollout.completion_mask],
        [float(lp) for lp in rollout.completion_logprobs],
    ]
    if distill is not None:
        columns.append(completion_advantages(rollout, float(advantage), distill))
    if rollout.images:
        if expand_pictures is None:
            raise ValueError(
                f"rollout {rollout.task_id!r} has pictures, but the run has no picture processor"
            )
        prompt, completion, columns, pictures = expand_rollout(expand_pictures, rollout, columns)
    num_prompt = len(prompt)
    mask, logprobs, *more = columns
    return TrainSample(
        input_ids=prompt + completion,
        loss_mask=[0] * num_prompt + [int(m) for m in mask],
        inference_logprobs=[0.0] * num_prompt + logprobs,
        advantage=float(advantage),
        policy_version=rollout.policy_version,
        rollout_id=rollout.rollout_id,
        routed_experts=rollout.routed_experts,
        pictures=pictures,
        token_advantages=None if not more else [0.0] * num_prompt + more[0],
    )


def expand_rollout(
    expand: ExpandPictures, rollout: Rollout, columns: list[list[float]]
) -> tuple[list[int], list[int], list[list[float]], Pictures]:
    """A rollout's ids with every picture placeholder expanded as vLLM expanded it: the prompt's, and those
    an environment's later turns put in the completion (tokens with mask 0), whose per-token `columns`
    (mask, logprobs, …) get 0 on each picture's image tokens. The pictures come in the same order."""
    placeholder = expand.placeholder_id
    in_prompt = rollout.prompt_ids.count(placeholder)
    later = rollout.images[in_prompt:]
    if rollout.completion_ids.count(placeholder) != len(later):
        raise ValueError(
            f"rollout {rollout.task_id!r}: {len(rollout.images)} pictures for "
            f"{in_prompt + rollout.completion_ids.count(placeholder)} picture placeholders"
        )
    join = expand.join if isinstance(expand, _OncePerPrompt) else _joined
    prompt, parts = list(rollout.prompt_ids), []
    if in_prompt:
        prompt, first = expand.expand(rollout.prompt_ids, rollout.images[:in_prompt])
        parts.append(first)
    if not later:
        return prompt, list(rollout.completion_ids), columns, join(parts)
    completion: list[int] = []
    grown: list[list[float]] = [[] for _ in columns]
    pending = iter(later)
    for index, token in enumerate(rollout.completion_ids):
        if token != placeholder:
            completion.append(token)
            for out, column in zip(grown, columns, strict=True):
                out.append(column[index])
            continue
        tokens, picture = expand.expand([placeholder], [next(pending)])
        completion += tokens
        parts.append(picture)
        for out in grown:
            out += [0.0] * len(tokens)
    return prompt, completion, grown, join(parts)


def _joined(parts: list[Pictures]) -> Pictures:
    if len(parts) == 1:  # the expansion's own object: a group's samples share it, and it travels once
        return parts[0]
    joined = Pictures.concat(parts)
    assert joined is not None, "a rollout with pictures has at least one"
    return joined


def make_train_samples(
    groups: Sequence[Group],
    advantages: Sequence[Sequence[float]] | None = None,
    kind: AdvantageKind = "mean",
    eps: float = DEFAULT_EPS,
    expand_pictures: ExpandPictures | None = None,
    distill: DistillWeights | None = None,
) -> list[TrainSample]:
    """One sample per usable (not failed) rollout (`distill`: with per-token advantages from the teacher).

    `advantages[i][j]` for `groups[i].rollouts[j]` (as `filter_groups` returns them); when omitted they are
    computed per group with `kind` and `eps`, failed rollouts skipped. `expand_pictures` runs once per
    distinct prompt and pictures (a group's rollouts share them).
    """
    if expand_pictures is not None:
        expand_pictures = _once_per_prompt(expand_pictures)
    samples: list[TrainSample] = []
    for i, group in enumerate(groups):
        if advantages is None:
            pairs = zip(usable_rollouts(group), group_advantages(group, kind, eps), strict=True)
        else:
            pairs = zip(group.rollouts, advantages[i], strict=True)
        samples += [sample_from_rollout(r, a, expand_pictures, distill) for r, a in pairs if not r.failed]
    return samples


@dataclass
class _OncePerPrompt:
    """`expand` remembering what it expanded, and the pictures it joined: a group's rollouts share their
    prompt and its pictures."""

    inner: ExpandPictures
    done: dict[tuple[tuple[int, ...], tuple[str, ...]], tuple[list[int], Pictures]] = field(
        default_factory=dict
    )
    joined: dict[tuple[int, ...], Pictures] = field(default_factory=dict)

    @property
    def placeholder_id(self) -> int:
        return self.inner.placeholder_id

    def join(self, parts: list[Pictures]) -> Pictures:
        """`parts` as one, the same object for the same parts (remembered here, so alive): a group's
        episodes that saw the same pictures share them, and they travel once."""
        key = tuple(id(part) for part in parts)
        if key not in self.joined:
            self.joined[key] = _joined(parts)
        return self.joined[key]

    def expand(self, ids: Sequence[int], images: Sequence[str]) -> tuple[list[int], Pictures]:
        key = (tuple(ids), tuple(images))
        if key not in self.done:
            self.done[key] = self.inner.expand(ids, images)
        found, pictures = self.done[key]
        return list(found), pictures


def _once_per_prompt(expand: ExpandPictures) -> ExpandPictures:
    return _OncePerPrompt(expand)


def drop_too_long(samples: Sequence[TrainSample], seq_len: int) -> tuple[list[TrainSample], int]:
    """The samples that fit a packed row of `seq_len` tokens, and how many did not. A longer one is dropped
    rather than cut: the reward was earned by the whole completion, and a cut one would credit a part."""
    kept = [s for s in samples if len(s) <= seq_len]
    return kept, len(samples) - len(kept)


def balance_across_ranks(lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Sample indices per rank: longest first, each to the rank with the fewest tokens so far (ties: lowest rank).

    Each rank's list stays longest first, which makes the later first-fit packing first-fit *decreasing*.
    """
    loads = [0] * world_size
    assignment: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        rank = min(range(world_size), key=lambda r: (loads[r], r))
        assignment[rank].append(index)
        loads[rank] += lengths[index]
    return assignment


def first_fit(samples: Sequence[TrainSample], seq_len: int) -> list[list[TrainSample]]:
    """Rows of samples whose lengths add up to at most `seq_len`, each sample in the first row it fits."""
    rows: list[list[TrainSample]] = []
    used: list[int] = []
    for sample in samples:
        row = next((k for k, n in enumerate(used) if n + len(sample) <= seq_len), None)
        if row is None:
            rows.append([])
            used.append(0)
            row = len(rows) - 1
        rows[row].append(sample)
        used[row] += len(sample)
    return rows


@dataclass
class _Row:
    """One packed row under construction; the lists mirror the fields of MicroBatch."""

    input_ids: list[int] = field(default_factory=list)
    position_ids: list[int] = field(default_factory=list)
    target_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    inference_logprobs: list[float] = field(default_factory=list)
    advantages: list[float] = field(default_factory=list)
    sample_ids: list[int] = field(default_factory=list)

    def add(self, sample: TrainSample, sample_id: int, pad_id: int) -> None:
        num = len(sample)
        self.input_ids += sample.input_ids
        self.position_ids += range(num)
        # position i predicts token i + 1 of the same sample; the sample's last position predicts nothing
        self.target_ids += sample.input_ids[1:] + [pad_id]
        self.loss_mask += sample.loss_mask[1:] + [0]
        self.inference_logprobs += sample.inference_logprobs[1:] + [0.0]
        if sample.token_advantages is None:
            self.advantages += [sample.advantage] * num
        else:  # shifted like the logprobs: position i is scored on token i + 1
            self.advantages += sample.token_advantages[1:] + [0.0]
        self.sample_ids += [sample_id] * num

    def pad(self, width: int, pad_id: int) -> None:
        # positions continue the last sample's (see trainer/data.py pad_rows); sample id −1 marks padding
        num = width - len(self.input_ids)
        start = self.position_ids[-1] + 1 if self.position_ids else 0
        self.input_ids += [pad_id] * num
        self.position_ids += range(start, start + num)
        self.target_ids += [pad_id] * num
        self.loss_mask += [0] * num
        self.inference_logprobs += [0.0] * num
        self.advantages += [0.0] * num
        self.sample_ids += [-1] * num


def pack_routes(
    rows: Sequence[Sequence[TrainSample]], width: int
) -> tuple[RoutedExperts | None, list[list[int]]]:
    """The samples' routes laid out as `_Row` lays out their tokens: (routes of every position [rows ·
    width], zeros where there is none; mask [rows][width], 1 where there is one). (None, []) when no
    sample has routes. A sample's routes cover its first tokens (all but the last one, from vLLM)."""
    given = [s.routed_experts for samples in rows for s in samples if s.routed_experts is not None]
    if not given:
        return None, []
    shape = given[0]
    if not all(r.same_shape(shape) for r in given):
        raise ValueError("routed experts of one micro-batch differ in layers, top-k or id size")
    token_bytes = shape.token_bytes
    data, mask = bytearray(), []
    for samples in rows:
        row_mask: list[int] = []
        for sample in samples:
            raw = b"" if sample.routed_experts is None else sample.routed_experts.raw()
            covered = min(len(raw) // token_bytes, len(sample))
            data += raw[: covered * token_bytes] + bytes((len(sample) - covered) * token_bytes)
            row_mask += [1] * covered + [0] * (len(sample) - covered)
        data += bytes((width - len(row_mask)) * token_bytes)
        mask.append(row_mask + [0] * (width - len(row_mask)))
    return RoutedExperts.from_raw(bytes(data), shape.num_layers, shape.top_k, shape.itemsize), mask


def build_micro_batch(
    rows: Sequence[Sequence[TrainSample]], seq_len: int, pad_id: int, pad_multiple: int = PAD_MULTIPLE
) -> MicroBatch:
    """Pack rows of samples into one micro-batch of shape [len(rows), width]: width is the longest row
    rounded up to `pad_multiple` tokens, at most `seq_len`. Sample ids count up across rows."""
    width = padded_width(
        max((sum(len(s) for s in samples) for samples in rows), default=0), seq_len, pad_multiple
    )
    built: list[_Row] = []
    num_samples = 0
    for samples in rows:
        row = _Row()
        for sample in samples:
            row.add(sample, num_samples, pad_id)
            num_samples += 1
        row.pad(width, pad_id)
        built.append(row)
    routed_experts, routed_mask = pack_routes(rows, width)
    pictures = [s.pictures for samples in rows for s in samples if s.pictures is not None]
    return MicroBatch(
        input_ids=[r.input_ids for r in built],
        position_ids=[r.position_ids for r in built],
        target_ids=[r.target_ids for r in built],
        loss_mask=[r.loss_mask for r in built],
        inference_logprobs=[r.inference_logprobs for r in built],
        advantages=[r.advantages for r in built],
        sample_ids=[r.sample_ids for r in built],
        num_samples=num_samples,
        rollout_ids=[sample.rollout_id for samples in rows for sample in samples],
        routed_experts=routed_experts,
        routed_mask=routed_mask,
        pictures=pictures,
    )


def _check_args(
    samples: Sequence[TrainSample], world_size: int, seq_len: int, micro_batch_size: int, pad_multiple: int
) -> None:
    if min(world_size, seq_len, micro_batch_size, pad_multiple) < 1:
        raise ValueError(
            "world_size, seq_len, micro_batch_size and pad_multiple must be >= 1, got "
            f"{world_size}, {seq_len}, {micro_batch_size}, {pad_multiple}"
        )
    longest = max((len(s) for s in samples), default=0)
    if longest > seq_len:
        raise ValueError(
            f"a sample has {longest} tokens (prompt + completion) but seq_len is {seq_len}; raise the trainer's "
            "seq_len to at least the longest prompt plus max_tokens, or lower max_tokens"
        )


def pack_for_ranks(
    samples: Sequence[TrainSample],
    world_size: int,
    seq_len: int,
    micro_batch_size: int,
    pad_id: int,
    pad_multiple: int = PAD_MULTIPLE,
) -> list[list[MicroBatch]]:
    """Micro-batches per rank: tokens balanced greedily across ranks, then first-fit packed into rows.

    A micro-batch holds up to `micro_batch_size` rows of at most `seq_len` tokens, padded to its longest row
    rounded up to `pad_multiple`. Every rank gets the same number of micro-batches (at least one), the
    missing ones a single all-padding row, because FSDP runs collectives in every forward/backward and a
    rank with fewer passes would hang the others. Empty samples are skipped.
    """
    _check_args(samples, world_size, seq_len, micro_batch_size, pad_multiple)
    samples = [s for s in samples if len(s) > 0]
    per_rank: list[list[MicroBatch]] = []
    for indices in balance_across_ranks([len(s) for s in samples], world_size):
        rows = first_fit([samples[i] for i in indices], seq_len)
        chunks = [rows[k : k + micro_batch_size] for k in range(0, len(rows), micro_batch_size)]
        per_rank.append([build_micro_batch(chunk, seq_len, pad_id, pad_multiple) for chunk in chunks])
    num_micro = max(1, *(len(m) for m in per_rank))
    for micro_batches in per_rank:
        while len(micro_batches) < num_micro:
            micro_batches.append(build_micro_batch([[]], seq_len, pad_id, pad_multiple))
    return per_rank


def num_trainable_samples(samples: Sequence[TrainSample]) -> int:
    """Samples with at least one loss target (a sample's first token is never a target): the sequence normaliser."""
    return sum(1 for s in samples if any(s.loss_mask[1:]))


def make_train_batches(
    step: int,
    samples: Sequence[TrainSample],
    world_size: int,
    seq_len: int,
    micro_batch_size: int,
    pad_id: int,
    metrics: dict[str, float] | None = None,
    cp: int = 1,
    pad_multiple: int = PAD_MULTIPLE,
) -> list[TrainBatch]:
    """One TrainBatch per rank for optimizer step `step`, carrying the global normalisers of the loss.

    With context parallelism (`cp` ranks per group, consecutive), the step is split into world_size / cp
    shards and each group's ranks get the same one: they split its rows along the sequence. The normalisers
    count samples and loss tokens, never padding, so they do not depend on `pad_multiple`.
    """
    per_group = pack_for_ranks(samples, world_size // cp, seq_len, micro_batch_size, pad_id, pad_multiple)
    num_loss_tokens = sum(mb.num_loss_tokens for micro_batches in per_group for mb in micro_batches)
    num_samples = num_trainable_samples(samples)
    return [
        TrainBatch(step, micro_batches, num_loss_tokens, num_samples, dict(metrics or {}), world_size, cp)
        for micro_batches in per_group
        for _ in range(cp)
    ]

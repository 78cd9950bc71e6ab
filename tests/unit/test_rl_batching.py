"""RL samples and packing: alignment of targets/logprobs, per-sample positions, rank balance, message round trips."""

import dataclasses
import json
import math
import random

import pytest
import torch

from tidal.orchestrator.batching import (
    balance_across_ranks,
    drop_too_long,
    make_train_batches,
    make_train_samples,
    pack_for_ranks,
)
from tidal.transport.rollouts import decode, encode
from tidal.types import Group, MicroBatch, Rollout, RoutedExperts, TrainBatch, TrainSample

PAD = 0


def rollout(prompt, completion, logprobs, mask, reward, version=0, failed=False) -> Rollout:
    return Rollout(prompt, completion, logprobs, mask, reward, version, version, "test", "t", {}, failed)


def sample(ids, mask=None, logprobs=None, advantage=1.0) -> TrainSample:
    mask = mask if mask is not None else [0] + [1] * (len(ids) - 1)
    logprobs = logprobs if logprobs is not None else [0.0] + [-0.1] * (len(ids) - 1)
    return TrainSample(list(ids), mask, logprobs, advantage, 0)


def test_make_train_samples_concatenates_and_aligns():
    g = Group(
        "t",
        "test",
        [
            rollout([1, 2], [3, 4, 5], [-0.1, -0.2, -0.3], [1, 0, 1], reward=1.0, version=7),
            rollout([1, 2], [6], [-0.4], [1], reward=0.0, version=6),
        ],
    )
    first, second = make_train_samples([g])
    assert first.input_ids == [1, 2, 3, 4, 5]
    assert first.loss_mask == [0, 0, 1, 0, 1]
    assert first.inference_logprobs == [0.0, 0.0, -0.1, -0.2, -0.3]  # entry i is the logprob of token i
    assert (first.advantage, second.advantage) == (0.5, -0.5)
    assert (first.policy_version, second.policy_version) == (7, 6)


def test_make_train_samples_skips_failed_and_takes_given_advantages():
    g = Group(
        "t",
        "test",
        [
            rollout([1], [2], [-0.1], [1], reward=1.0),
            rollout([1], [3], [-0.1], [1], reward=0.0, failed=True),
            rollout([1], [4], [-0.1], [1], reward=0.0),
        ],
    )
    assert [s.advantage for s in make_train_samples([g])] == [0.5, -0.5]  # failed one not in the mean
    given = make_train_samples([g], advantages=[[2.0, 9.0, -2.0]])
    assert [(s.input_ids[-1], s.advantage) for s in given] == [(2, 2.0), (4, -2.0)]


def test_rollout_rejects_misaligned_lists():
    with pytest.raises(ValueError, match="logprobs"):
        rollout([1], [2, 3], [-0.1], [1, 1], reward=0.0)


def test_pack_one_row_by_hand():
    a = TrainSample([10, 11, 12], [0, 1, 1], [0.0, -0.5, -0.25], 1.0, 0)
    b = TrainSample([20, 21], [0, 1], [0.0, -1.0], -2.0, 0)
    [[mb]] = pack_for_ranks([b, a], world_size=1, seq_len=6, micro_batch_size=1, pad_id=PAD)
    # longest first: a, then b, then one pad token that continues b's positions
    assert mb.input_ids == [[10, 11, 12, 20, 21, PAD]]
    assert mb.position_ids == [[0, 1, 2, 0, 1, 2]]
    assert mb.target_ids == [[11, 12, PAD, 21, PAD, PAD]]  # a's last token does not predict b's first
    assert mb.loss_mask == [[1, 1, 0, 1, 0, 0]]
    assert mb.inference_logprobs == [[-0.5, -0.25, 0.0, -1.0, 0.0, 0.0]]
    assert mb.advantages == [[1.0, 1.0, 1.0, -2.0, -2.0, 0.0]]
    assert mb.sample_ids == [[0, 0, 0, 1, 1, -1]]
    assert mb.num_samples == 2
    assert mb.num_loss_tokens == 3


def test_balance_across_ranks_by_hand():
    # 5→r0, 4→r1, 3→r1 (4 < 5), 3→r0 (5 < 7), 1→r1 (7 < 8): loads 8 and 8
    assert balance_across_ranks([5, 4, 3, 3, 1], world_size=2) == [[0, 3], [1, 2, 4]]


def test_rows_fill_first_fit_decreasing_and_split_into_micro_batches():
    samples = [sample(range(100 * k, 100 * k + n)) for k, n in enumerate([4, 3, 2, 2, 1])]
    [micro_batches] = pack_for_ranks(samples, world_size=1, seq_len=5, micro_batch_size=2, pad_id=PAD)
    # rows: [4, 1], [3, 2], [2]  → micro-batches of 2 rows and 1 row
    assert [len(mb.input_ids) for mb in micro_batches] == [2, 1]
    assert [row[0] for mb in micro_batches for row in mb.input_ids] == [0, 100, 300]
    assert micro_batches[0].sample_ids == [[0, 0, 0, 0, 1], [2, 2, 2, 3, 3]]  # ids count up across rows
    assert micro_batches[1].sample_ids == [[0, 0, -1, -1, -1]]


def random_samples(seed: int, num: int, max_len: int) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for k in range(num):
        n = rng.randint(1, max_len)
        prompt = rng.randint(0, n - 1)
        ids = [1000 * (k + 1) + i for i in range(n)]  # token values name their sample and offset
        mask = [0] * prompt + [rng.randint(0, 1) for _ in range(n - prompt)]
        logprobs = [0.0] * prompt + [-rng.random() for _ in range(n - prompt)]
        samples.append(TrainSample(ids, mask, logprobs, rng.uniform(-1, 1), 0))
    return samples


def unpack(per_rank: list[list[MicroBatch]]) -> dict[int, dict[str, list]]:
    """Rebuild each sample from the rows, checking row invariants on the way."""
    found: dict[int, dict[str, list]] = {}
    for micro_batches in per_rank:
        for mb in micro_batches:
            for r, ids in enumerate(mb.input_ids):
                for i, token in enumerate(ids):
                    sid = mb.sample_ids[r][i]
                    if sid < 0:
                        assert mb.loss_mask[r][i] == 0 and mb.advantages[r][i] == 0.0
                        if i > 0:  # padding continues the previous positions
                            assert mb.position_ids[r][i] == mb.position_ids[r][i - 1] + 1
                        continue
                    key = token // 1000 - 1
                    entry = found.setdefault(key, {"ids": [], "pos": [], "targets": [], "mask": [], "lp": []})
                    entry["ids"].append(token)
                    entry["pos"].append(mb.position_ids[r][i])
                    entry["targets"].append(mb.target_ids[r][i])
                    entry["mask"].append(mb.loss_mask[r][i])
                    entry["lp"].append(mb.inference_logprobs[r][i])
    return found


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_packing_keeps_samples_whole_and_targets_inside_them(world_size):
    samples = random_samples(seed=world_size, num=40, max_len=12)
    per_rank = pack_for_ranks(samples, world_size, seq_len=16, micro_batch_size=2, pad_id=PAD)
    found = unpack(per_rank)
    # every sample exactly once (a sample split or repeated would show as wrong ids below)
    assert sorted(found) == list(range(len(samples)))
    for k, s in enumerate(samples):
        got = found[k]
        assert got["ids"] == s.input_ids
        assert got["pos"] == list(range(len(s)))  # positions restart per sample
        assert got["targets"][:-1] == s.input_ids[1:]  # never a token of another sample
        assert got["mask"] == s.loss_mask[1:] + [0]
        assert got["lp"] == s.inference_logprobs[1:] + [0.0]


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_get_equal_micro_batch_counts_and_balanced_tokens(world_size):
    samples = random_samples(seed=10 + world_size, num=23, max_len=12)
    per_rank = pack_for_ranks(samples, world_size, seq_len=16, micro_batch_size=1, pad_id=PAD)
    assert len(per_rank) == world_size
    assert len({len(m) for m in per_rank}) == 1
    loads = [sum(sid >= 0 for mb in mbs for row in mb.sample_ids for sid in row) for mbs in per_rank]
    assert sum(loads) == sum(len(s) for s in samples)
    # greedy longest-first: the spread is at most one sample
    assert max(loads) - min(loads) <= max(len(s) for s in samples)


def test_short_ranks_get_all_padding_micro_batches():
    per_rank = pack_for_ranks([sample([1, 2, 3])], world_size=2, seq_len=4, micro_batch_size=4, pad_id=PAD)
    assert [len(m) for m in per_rank] == [1, 1]
    [filler] = per_rank[1]
    assert filler.input_ids == [[PAD] * 4] and filler.position_ids == [[0, 1, 2, 3]]
    assert filler.loss_mask == [[0] * 4] and filler.sample_ids == [[-1] * 4] and filler.num_samples == 0


def test_no_samples_still_gives_every_rank_one_micro_batch():
    per_rank = pack_for_ranks([], world_size=3, seq_len=4, micro_batch_size=2, pad_id=PAD)
    assert [len(m) for m in per_rank] == [1, 1, 1]
    assert all(mb.num_loss_tokens == 0 for m in per_rank for mb in m)


def test_sample_longer_than_seq_len_is_a_clear_error():
    with pytest.raises(ValueError, match="seq_len is 4"):
        pack_for_ranks([sample([1, 2, 3, 4, 5])], world_size=1, seq_len=4, micro_batch_size=1, pad_id=PAD)


def test_make_train_batches_carries_global_counts():
    samples = [sample([1, 2, 3], mask=[0, 1, 1]), sample([4, 5], mask=[0, 1]), sample([6, 7], mask=[1, 0])]
    batches = make_train_batches(3, samples, world_size=2, seq_len=4, micro_batch_size=1, pad_id=PAD)
    assert [b.step for b in batches] == [3, 3]
    assert {b.num_loss_tokens_global for b in batches} == {3}  # 2 + 1 + 0 (a first token is never a target)
    assert {b.num_samples_global for b in batches} == {2}  # the third sample has nothing to learn
    assert sum(mb.num_loss_tokens for b in batches for mb in b.micro_batches) == 3


def test_context_parallel_groups_get_the_same_rows_and_the_counts_stay_global():
    samples = [sample([1, 2, 3], mask=[0, 1, 1]), sample([4, 5], mask=[0, 1]), sample([6, 7], mask=[1, 0])]
    batches = make_train_batches(3, samples, world_size=4, seq_len=4, micro_batch_size=1, pad_id=PAD, cp=2)
    assert len(batches) == 4 and {(b.num_trainer_ranks, b.cp) for b in batches} == {(4, 2)}
    assert batches[0] == batches[1] and batches[2] == batches[3] and batches[0] != batches[2]
    assert {b.num_loss_tokens_global for b in batches} == {3}  # counted once, not once per cp rank
    two_groups = make_train_batches(3, samples, world_size=2, seq_len=4, micro_batch_size=1, pad_id=PAD)
    assert [b.micro_batches for b in batches[::2]] == [b.micro_batches for b in two_groups]


def test_micro_batch_tensors_have_one_shape_and_the_right_dtypes():
    [[mb]] = pack_for_ranks([sample([1, 2, 3]), sample([4, 5])], 1, seq_len=4, micro_batch_size=2, pad_id=PAD)
    tensors = mb.to_tensors()
    assert {t.shape for t in tensors.values()} == {torch.Size([2, 4])}
    assert tensors["loss_mask"].dtype == torch.bool
    assert tensors["inference_logprobs"].dtype == torch.float32
    assert tensors["input_ids"].dtype == tensors["sample_ids"].dtype == torch.long


def test_messages_round_trip_through_dicts_and_torch_save(tmp_path):
    g = Group("t", "test", [rollout([1], [2, 3], [-0.1, -0.2], [1, 0], reward=0.5, version=2)])
    assert Group.from_dict(g.to_dict()) == g
    batch = make_train_batches(1, make_train_samples([g], [[1.0]]), 1, 4, 1, PAD, {"reward/mean": 0.5})[0]
    wire = batch.to_dict()  # the wire format, without asdict's deep copies
    assert wire.pop("pictures") == []  # the batch's pictures, each once
    assert [m.pop("picture_order") for m in wire["micro_batches"]] == [[]]  # which picture each sample has
    assert [m.pop("pictures") for m in wire["micro_batches"]] == [None]  # (in the batch's)
    wire["micro_batches"][0]["pictures"] = []
    assert wire == dataclasses.asdict(batch)
    assert g.to_dict() == dataclasses.asdict(g) and g.rollouts[0].to_dict() == dataclasses.asdict(
        g.rollouts[0]
    )
    routed = dataclasses.replace(g.rollouts[0], routed_experts=RoutedExperts.from_raw(b"\x01\x02", 1, 2, 1))
    assert routed.to_dict() == dataclasses.asdict(routed) and Rollout.from_dict(routed.to_dict()) == routed
    assert decode(encode(batch)) == batch
    assert json.loads(encode(batch)) == json.loads(
        json.dumps(batch.to_dict())
    )  # msgspec writes what json did
    torch.save(batch.to_dict(), tmp_path / "b.pt")
    loaded = TrainBatch.from_dict(torch.load(tmp_path / "b.pt", weights_only=True))
    assert loaded == batch
    assert isinstance(loaded.micro_batches[0], MicroBatch)


def test_samples_longer_than_seq_len_are_dropped_and_counted_not_cut():
    short, exact, long = sample([1, 2]), sample([1, 2, 3, 4]), sample([1, 2, 3, 4, 5])
    kept, dropped = drop_too_long([short, long, exact], seq_len=4)
    assert kept == [short, exact] and dropped == 1
    [[mb]] = pack_for_ranks(kept, world_size=1, seq_len=4, micro_batch_size=2, pad_id=PAD)  # packs, no error
    assert mb.num_loss_tokens == short.loss_mask[1:].count(1) + exact.loss_mask[1:].count(1)


def test_a_batch_with_nan_or_infinity_still_round_trips():
    """msgspec writes JSON, which has no NaN or infinity (it would write null, which the trainer cannot
    read); such a batch is written by json.dumps, and the trainer masks those tokens."""
    g = Group("t", "test", [rollout([1], [2, 3], [-0.1, float("-inf")], [1, 1], reward=0.5)])
    batch = make_train_batches(1, make_train_samples([g], [[float("nan")]]), 1, 4, 1, PAD)[0]
    back = decode(encode(batch))
    assert math.isinf(back.micro_batches[0].inference_logprobs[0][1])
    assert math.isnan(back.micro_batches[0].advantages[0][0])
    assert b"NaN" in encode(batch) and b"-Infinity" in encode(batch)

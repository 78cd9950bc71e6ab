"""Micro-batch padding: rows are padded to the micro-batch's longest row (rounded up), not to seq_len, and no
micro-batch is filled up with all-padding rows; the loss and gradients are those of the old seq_len-wide
layout (SFT and RL, dense and MoE)."""

import copy
import random

import pytest
import torch

from tests.unit.models import tiny_lm
from tests.unit.test_moe import tiny_moe_lm
from tidal.config.loss import LossConfig
from tidal.config.moe import MoEConfig
from tidal.config.perf import PerfConfig
from tidal.config.rl import RLTrainerConfig
from tidal.orchestrator.batching import build_micro_batch, make_train_batches, pack_for_ranks
from tidal.trainer.data import IGNORE_INDEX, PackedRow, TokenizedSample, pack_samples, pad_rows, shard_rows
from tidal.trainer.parallel import DistInfo, parallelize
from tidal.trainer.rl import rl_step
from tidal.trainer.sft import StepBatch, train_step
from tidal.types import RoutedExperts, TrainSample, padded_width

CPU = DistInfo(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
PAD = 0


def test_padded_width_rounds_the_longest_row_up_and_never_passes_seq_len():
    assert padded_width(83, seq_len=128, multiple=16) == 96
    assert padded_width(96, seq_len=128, multiple=16) == 96
    assert padded_width(120, seq_len=125, multiple=16) == 125  # not 128: rows never outgrow seq_len
    assert padded_width(0, seq_len=128, multiple=16) == 16  # an all-padding micro-batch still has a token
    assert padded_width(5, seq_len=128, multiple=1) == 5
    assert padded_width(5, seq_len=128, multiple=128) == 128  # multiple = seq_len: the fixed shape


# --- SFT -------------------------------------------------------------------------------------------------


def sft_samples(seed: int, lengths: list[int], vocab: int = 61) -> list[TokenizedSample]:
    rng = random.Random(seed)
    samples = []
    for n in lengths:
        prompt = rng.randint(1, n - 1)
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        samples.append(TokenizedSample(ids, [0] * prompt + [1] * (n - prompt)))
    return samples


def test_sft_micro_batch_of_short_rows_is_as_wide_as_its_longest_row_not_seq_len():
    rows, _ = pack_samples(sft_samples(0, [5, 3, 11]), seq_len=64)
    assert [len(r) for r in rows] == [19]  # one row, unpadded
    [micro] = shard_rows(rows, rank=0, world_size=1, micro_batch_size=4)
    assert len(micro) == 1  # no all-padding rows up to micro_batch_size
    [row] = pad_rows(micro, seq_len=64, pad_id=PAD, pad_multiple=8)
    assert len(row) == 24 and row.num_padding == 5 and row.num_real_tokens == 19
    assert row.input_ids[19:] == [PAD] * 5 and row.labels[19:] == [IGNORE_INDEX] * 5
    assert row.position_ids[8:] == list(range(16))  # padding continues the last sample's positions
    # pad_multiple = seq_len: every row seq_len wide (fixed shapes)
    assert [len(r) for r in pad_rows(micro, seq_len=64, pad_id=PAD, pad_multiple=64)] == [64]


def test_sft_rows_of_one_micro_batch_share_its_longest_rows_width():
    rows, _ = pack_samples(sft_samples(1, [30, 30, 12]), seq_len=32)
    assert [len(r) for r in rows] == [30, 30, 12]
    padded = pad_rows(rows, seq_len=32, pad_id=PAD, pad_multiple=16)
    assert [len(r) for r in padded] == [32, 32, 32]  # 30 rounds up to 32 = seq_len
    assert [r.num_padding for r in padded] == [2, 2, 20]
    assert [len(r) for r in pad_rows(rows[2:], seq_len=32, pad_id=PAD, pad_multiple=16)] == [16]


def test_sft_ranks_short_of_rows_get_one_empty_row_per_missing_micro_batch():
    rows, _ = pack_samples([TokenizedSample([1, 2, 3], [0, 1, 1])] * 5, seq_len=3)
    shards = [shard_rows(rows, r, 3, micro_batch_size=1) for r in range(3)]
    assert [len(s) for s in shards] == [2, 2, 2]
    assert [[len(mb) for mb in s] for s in shards] == [[1, 1], [1, 1], [1, 1]]
    [[filler]] = shards[2][1:]
    assert len(filler) == 0
    [padded] = pad_rows([filler], seq_len=3, pad_id=PAD, pad_multiple=16)
    assert (
        padded.input_ids == [PAD] * 3 and padded.labels == [IGNORE_INDEX] * 3 and padded.num_real_tokens == 0
    )


def old_sft_layout(rows: list[PackedRow], micro_batch_size: int, seq_len: int) -> list[list[PackedRow]]:
    """The layout before padding followed the tokens: every micro-batch `micro_batch_size` rows of seq_len
    (empty rows filling the last one), as `shard_rows` + padding to seq_len made it."""
    micro = shard_rows(rows, 0, 1, micro_batch_size)
    filled = [m + [PackedRow()] * (micro_batch_size - len(m)) for m in micro]
    return [pad_rows(m, seq_len, PAD, pad_multiple=seq_len) for m in filled]


def sgd_step_delta(model: torch.nn.Module, run_step) -> tuple[dict, dict[str, torch.Tensor]]:
    """(the step's metrics, -gradient per parameter) from one SGD step of lr 1 without clipping."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)
    metrics = run_step(optimizer, scheduler)
    return metrics, {n: p.detach() - before[n] for n, p in model.named_parameters()}


def assert_same_step(old: tuple[dict, dict], new: tuple[dict, dict], keys: list[str]) -> None:
    for key in keys:
        assert new[0][key] == pytest.approx(old[0][key], rel=1e-5, abs=1e-7), key
    for name, delta in old[1].items():
        torch.testing.assert_close(new[1][name], delta, atol=1e-6, rtol=1e-5, msg=name)
    assert any(d.abs().max() > 1e-4 for d in old[1].values())  # the step did move the weights


@pytest.mark.parametrize("moe", [False, True])
def test_sft_step_is_the_same_on_the_old_seq_len_layout_and_the_token_layout(moe):
    torch.manual_seed(0)
    reference = tiny_moe_lm() if moe else tiny_lm()
    seq_len, micro_batch_size = 48, 4
    # 30-token samples: one per row of 48, then rows of 11–20-token samples, some two to a row
    samples = sft_samples(2, [30, 30, 12, 20, 11, 17, 13, 30, 16])
    rows, _ = pack_samples(samples, seq_len)
    new = [pad_rows(m, seq_len, PAD, pad_multiple=8) for m in shard_rows(rows, 0, 1, micro_batch_size)]
    old = old_sft_layout(rows, micro_batch_size, seq_len)
    assert sum(len(r) for m in new for r in m) < 0.6 * sum(len(r) for m in old for r in m)  # the point
    results = []
    for micro in (old, new):
        model = copy.deepcopy(reference)
        scorer = parallelize(model, CPU, PerfConfig(), MoEConfig() if moe else None)
        batch = StepBatch(
            micro, sum(r.num_loss_tokens for r in rows), sum(len(s.input_ids) for s in samples), 0,
            sum(r.num_real_tokens for r in rows),
        )  # fmt: skip

        def run(optimizer, scheduler, scorer=scorer, batch=batch):
            return train_step(scorer, optimizer, scheduler, batch, CPU, max_grad_norm=1e9)

        results.append(sgd_step_delta(model, run))
    # with MoE the routing statistics (and the load-balancing loss) leave the padding out in both layouts
    keys = ["loss", "grad_norm"] + (
        ["moe/aux_loss", "moe/load_max", "moe/tokens_per_expert/0"] if moe else []
    )
    assert_same_step(results[0], results[1], keys)


# --- RL --------------------------------------------------------------------------------------------------


def rl_samples(seed: int, lengths: list[int], vocab: int = 61) -> list[TrainSample]:
    rng = random.Random(seed)
    samples = []
    for n in lengths:
        prompt = rng.randint(1, n - 2)
        ids = [rng.randrange(1, vocab) for _ in range(n)]
        mask = [0] * prompt + [1] * (n - prompt)
        logprobs = [0.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(n - prompt)]
        samples.append(TrainSample(ids, mask, logprobs, rng.uniform(-1, 1), 0))
    return samples


def test_rl_micro_batch_of_short_samples_is_not_seq_len_wide():
    samples = rl_samples(0, [7, 5, 9])
    [[mb]] = pack_for_ranks(samples, world_size=1, seq_len=64, micro_batch_size=2, pad_id=PAD, pad_multiple=8)
    assert [len(row) for row in mb.input_ids] == [24]  # 21 tokens in one row, rounded up to 8
    # longest first: the 5-token sample ends the row, and the padding continues its positions
    assert mb.sample_ids[0][21:] == [-1] * 3 and mb.position_ids[0][21:] == [5, 6, 7]
    assert {t.shape for t in mb.to_tensors().values()} == {torch.Size([1, 24])}
    # the default multiple (16) and the fixed shape
    [[default]] = pack_for_ranks(samples, world_size=1, seq_len=64, micro_batch_size=2, pad_id=PAD)
    assert len(default.input_ids[0]) == 32
    [[fixed]] = pack_for_ranks(samples, 1, seq_len=64, micro_batch_size=2, pad_id=PAD, pad_multiple=64)
    assert len(fixed.input_ids[0]) == 64


def test_rl_all_padding_micro_batch_of_a_short_rank_is_one_small_row():
    per_rank = pack_for_ranks(rl_samples(1, [9]), world_size=2, seq_len=64, micro_batch_size=4, pad_id=PAD)
    [filler] = per_rank[1]
    assert filler.input_ids == [[PAD] * 16] and filler.sample_ids == [[-1] * 16] and filler.num_samples == 0


def test_rl_routes_are_laid_out_at_the_micro_batch_width():
    raw = bytes(range(2 * 4))  # 4 tokens, 1 layer, top-2
    first = TrainSample([1, 2, 3, 4, 5], [0, 1, 1, 1, 1], [0.0] + [-0.1] * 4, 1.0, 0, "a")
    first.routed_experts = RoutedExperts.from_raw(raw, 1, 2, 1)
    micro = build_micro_batch([[first]], seq_len=64, pad_id=PAD, pad_multiple=8)
    experts, mask = micro.routes_tensors()
    assert experts.shape == (8, 1, 2) and mask.tolist() == [True] * 4 + [False] * 4


@pytest.mark.parametrize(
    "loss", [LossConfig(), LossConfig(ratio_type="sequence", norm="sequence")], ids=["token", "sequence"]
)
def test_rl_step_is_the_same_on_the_old_seq_len_layout_and_the_token_layout(loss):
    reference = tiny_lm()
    seq_len = 96
    samples = rl_samples(3, [30, 12, 9, 25, 7, 14, 6, 18])  # rows of 96 and 25 tokens
    results = []
    layouts = {"old": seq_len, "new": 1}
    widths = {}
    for name, multiple in layouts.items():
        [batch] = make_train_batches(0, samples, 1, seq_len, 1, PAD, pad_multiple=multiple)
        widths[name] = sum(len(row) for mb in batch.micro_batches for row in mb.input_ids)
        model = copy.deepcopy(reference)
        scorer = parallelize(model, CPU, PerfConfig())
        config = RLTrainerConfig(loss=loss)
        config.optim.max_grad_norm = 1e9

        def run(optimizer, scheduler, scorer=scorer, batch=batch, config=config):
            return rl_step(scorer, optimizer, scheduler, batch, CPU, config)

        results.append(sgd_step_delta(model, run))
    assert (widths["old"], widths["new"]) == (2 * 96, 96 + 25)
    assert_same_step(results[0], results[1], ["loss", "mismatch_kl/mean", "ratio/mean", "entropy/mean"])

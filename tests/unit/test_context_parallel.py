"""Context parallelism: the pure row and head bookkeeping, and cp = 2 on gloo ranks against one process
(cp = 1) on packed rows of several documents: per-token logprobs, entropy, the RL loss and every gradient."""

import itertools
import os
import sys
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.ranks import run_ranks
from tidal.trainer.context_parallel import chunk_of, pad_rows, repeat_kv_heads

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo process group")

# fp32 everywhere: the split changes only the order of float sums (attention, FSDP's gradient reduction)
TOLERANCE = 1e-5


def test_rows_pad_by_continuing_the_last_document_and_split_into_contiguous_chunks():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    positions = torch.tensor([[0, 1, 0, 1, 2]])
    targets = torch.tensor([[6, 7, 8, 9, 3]])
    ids, positions, targets = pad_rows(ids, positions, targets, 4)
    assert ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0]]
    assert positions.tolist() == [[0, 1, 0, 1, 2, 3, 4, 5]]
    assert targets.tolist() == [[6, 7, 8, 9, 3, 0, 0, 0]]
    assert chunk_of(positions, 1, 2).tolist() == [[2, 3, 4, 5]]
    unchanged = pad_rows(ids, positions, targets, 2)
    assert all(a is b for a, b in zip(unchanged, (ids, positions, targets), strict=True))


def test_repeated_kv_heads_keep_every_query_head_on_its_key_value_head():
    heads, cp = 8, 4
    for kv_heads in (1, 2, 4, 8):
        kv = torch.arange(kv_heads).view(1, kv_heads, 1, 1).float()  # head i holds the value i
        repeated = repeat_kv_heads(kv, cp)
        assert repeated.shape[1] % cp == 0
        # query head h reads key/value head h // (heads / kv_heads); after repeating the same one
        group = heads // repeated.shape[1]
        assert [int(repeated[0, h // group]) for h in range(heads)] == [
            h // (heads // kv_heads) for h in range(heads)
        ]


def test_models_whose_attention_cannot_split_are_refused_when_they_load():
    from tests.unit.models import tiny_lm
    from tests.unit.test_moe import tiny_moe_lm
    from tidal.config.perf import PerfConfig
    from tidal.errors import UserError
    from tidal.trainer.parallel import DistInfo, parallelize

    def refused(model: torch.nn.Module, cp: int) -> str:
        info = DistInfo(0, cp, 0, cp, torch.device("cpu"), cp=cp)
        with pytest.raises(UserError) as error:  # before any process group is needed
            parallelize(model, info, PerfConfig(cp=cp))
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "its 4 attention heads do not split over 3 ranks" in refused(tiny_lm(), 3)
    windowed = tiny_lm()
    windowed.config.sliding_window, windowed.config.layer_types = 4, ["sliding_attention"] * 3
    assert "sliding_window = 4" in refused(windowed, 2)
    assert "its 4 attention heads do not split over 8 ranks" in refused(tiny_moe_lm(num_experts=4), 8)


def test_a_batch_laid_out_for_another_cp_is_refused_and_metrics_count_each_group_once():
    from tidal.errors import UserError
    from tidal.trainer.parallel import DistInfo
    from tidal.trainer.rl import across_ranks, check_world_size
    from tidal.types import TrainBatch

    info = DistInfo(0, 4, 0, 4, torch.device("cpu"), cp=2)
    assert (info.dp_rank, info.dp_size, info.cp_rank) == (0, 2, 0)
    check_world_size(TrainBatch(0, [], 1, 1, num_trainer_ranks=4, cp=2), info)
    with pytest.raises(UserError, match="laid out for cp = 1"):
        check_world_size(TrainBatch(0, [], 1, 1, num_trainer_ranks=4), info)
    # four ranks, two cp groups: each group's ranks report the same numbers; the trainer keeps one per group
    rows = [[1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 10.0, 1.0]] * 2 + [
        [3.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.25, 30.0, 2.0]
    ] * 2
    merged = across_ranks({}, lambda values: rows[:: info.cp])
    assert (merged["loss"], merged["tokens"], merged["num_loss_tokens"]) == (0.75, 40.0, 4.0)


# three packed rows of 13 tokens, several documents each (position ids restart at 0); 13 is no multiple of
# the cp size, so the split pads. Data-parallel group g trains rows ROWS_OF_GROUP[g].
DOCUMENTS = [[5, 3, 5], [7, 6], [2, 4, 4, 3]]
SEQ = 13
ROWS_OF_GROUP = [[0, 1], [2, 0]]


def packed_rows(rows: list[int]) -> dict[str, torch.Tensor]:
    """RL micro-batch tensors [rows, seq] for the given rows of DOCUMENTS (the same on every rank)."""
    generator = torch.Generator().manual_seed(7)
    every = {
        "input_ids": torch.randint(0, 61, (3, SEQ), generator=generator),
        "target_ids": torch.randint(0, 61, (3, SEQ), generator=generator),
        "inference_logprobs": -torch.rand(3, SEQ, generator=generator) * 5,
        "advantages": torch.randn(3, SEQ, generator=generator),
        "loss_mask": torch.rand(3, SEQ, generator=generator) < 0.7,
    }
    positions, sample_ids = [], []
    for lengths in DOCUMENTS:
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        sample_ids.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    every["position_ids"], every["sample_ids"] = torch.stack(positions), torch.stack(sample_ids)
    return {key: value[rows] for key, value in every.items()}


def rl_loss_of(
    scorer: Any, batch: dict[str, torch.Tensor], loss_config: Any, num_loss_tokens: int, num_samples: int
):
    from tidal.trainer.loss import rl_loss

    logprobs, entropy = scorer(
        batch["input_ids"], batch["position_ids"], batch["target_ids"], 1.0, with_entropy=True
    )
    loss, _ = rl_loss(
        logprobs, batch["inference_logprobs"], batch["advantages"], batch["loss_mask"], batch["sample_ids"],
        loss_config, num_loss_tokens, num_samples, entropy,
    )  # fmt: skip
    return logprobs, entropy, loss


def global_counts(num_groups: int) -> tuple[int, int]:
    """The step's loss tokens and samples over every data-parallel group (what the orchestrator sends)."""
    batches = [packed_rows(ROWS_OF_GROUP[g]) for g in range(num_groups)]
    tokens = sum(int(b["loss_mask"].sum()) for b in batches)
    samples = sum(len(DOCUMENTS[r]) for g in range(num_groups) for r in ROWS_OF_GROUP[g])
    return tokens, samples


def reference(
    num_groups: int, kv_heads: int, loss_config: Any
) -> tuple[list[tuple[torch.Tensor, ...]], dict]:
    """cp = 1 in this process alone (transformers' own SDPA attention, masked by the position-id resets):
    each group's (logprobs, entropy, loss) and the gradients of the summed loss of all groups."""
    from tests.unit.models import tiny_lm
    from tidal.trainer.chunked import TokenScorer

    model = tiny_lm(kv_heads=kv_heads)
    scorer = TokenScorer(model, chunk_size=5)
    counts = global_counts(num_groups)
    outputs = [
        rl_loss_of(scorer, packed_rows(ROWS_OF_GROUP[g]), loss_config, *counts) for g in range(num_groups)
    ]
    torch.stack([loss for _, _, loss in outputs]).sum().backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()}
    return [tuple(t.detach() for t in out) for out in outputs], grads


def context_parallel(
    info: Any, kv_heads: int, loss_config: Any, **perf: Any
) -> tuple[tuple[torch.Tensor, ...], dict]:
    """This rank's group's (logprobs, entropy, loss) with perf.cp = info.cp, and the full gradients after a
    backward of loss × world size (what `tidal trainer` does)."""
    from tests.unit.models import tiny_lm
    from tidal.config.perf import PerfConfig
    from tidal.trainer.parallel import parallelize

    model = tiny_lm(kv_heads=kv_heads)
    config = PerfConfig(cp=info.cp, mixed_precision="off", **perf)
    scorer = parallelize(model, info, config, None)
    assert scorer.context_parallel is not None and scorer.context_parallel.size == info.cp
    counts = global_counts(info.dp_size)
    out = rl_loss_of(scorer, packed_rows(ROWS_OF_GROUP[info.dp_rank]), loss_config, *counts)
    (out[2] * info.world_size).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return tuple(t.detach() for t in out), grads


# (perf settings, key/value heads, loss): varlen and auto attention; 2 key/value heads split over cp = 2,
# 1 is repeated; the chunked head scores a rank's chunk in several pieces (and one); activation
# checkpointing recomputes the all-to-alls in backward; GSPO's sequence ratio and
# sequence normalisation span both halves of a row
CASES = [
    ({"attention": "auto", "loss_chunk_tokens": 3}, 2, {}),
    (
        {"attention": "varlen", "activation_checkpointing": "full"},
        1,
        {"ratio_type": "sequence", "norm": "sequence"},
    ),
]


def compare_worker(
    rank: int, world: int, cp: int, replicates: tuple[int, ...], port: int, failures: "mp.Queue[str]"
) -> None:
    from tidal.config.loss import LossConfig
    from tidal.trainer.parallel import DistInfo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    info = DistInfo(rank, world, rank, world, torch.device("cpu"), cp=cp)
    try:
        for (perf, kv_heads, loss), replicate in itertools.product(CASES, replicates):
            loss_config = LossConfig(**loss)
            want_outputs, want = reference(info.dp_size, kv_heads, loss_config)
            got_outputs, got = context_parallel(info, kv_heads, loss_config, replicate=replicate, **perf)
            for name, got_t, want_t in zip(
                ("logprobs", "entropy", "loss"), got_outputs, want_outputs[info.dp_rank], strict=True
            ):
                torch.testing.assert_close(
                    got_t, want_t, atol=TOLERANCE, rtol=TOLERANCE, msg=f"{perf} replicate {replicate} {name}"
                )
            assert sorted(got) == sorted(want)
            for name in want:
                torch.testing.assert_close(
                    got[name],
                    want[name],
                    atol=TOLERANCE,
                    rtol=TOLERANCE,
                    msg=f"{perf} replicate {replicate} {name}",
                )
    except BaseException:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
    finally:
        torch.distributed.destroy_process_group()


def run_cp_ranks(world: int, cp: int, replicates: tuple[int, ...] = (1,)) -> None:
    """Every case of CASES under each replicate setting, all in one spawn of `world` ranks (a spawn of four
    ranks costs ~10 s of imports on one core)."""
    run_ranks(compare_worker, world, cp, replicates)


@pytest.mark.slow  # spawns gloo ranks
def test_cp2_matches_cp1_logprobs_loss_and_gradients_on_packed_rows():
    """Two ranks, one cp group: each rank runs half of every row, attention over all of it for half the
    heads; logprobs, entropy, the RL loss and every gradient equal one process's to fp32 reordering."""
    run_cp_ranks(world=2, cp=2)


@pytest.mark.slow
def test_cp2_with_two_data_parallel_groups_matches_cp1():
    """Four ranks: two cp groups training different rows, FSDP2-sharded over all four (replicate = 1), then
    HSDP, replicated over the groups and sharded within each (replicate = 2)."""
    run_cp_ranks(world=4, cp=2, replicates=(1, 2))

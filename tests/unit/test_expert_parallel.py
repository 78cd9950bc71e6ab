"""Expert parallelism on two gloo ranks: the token exchange's reordering, and ep = 2 against ep = 1 (every
rank running every expert) on the same data: logprobs, the load-balancing loss and every gradient, also with
routing replay (inference's experts given for every token)."""

import os
import sys
import traceback

import pytest
import torch
import torch.multiprocessing as mp

from tests.ranks import run_ranks
from tidal.trainer.expert_parallel import expert_major_order

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo process group")


def test_received_rows_are_reordered_expert_major():
    # arrival: (source 0: expert 0 ×2, expert 2 ×1), (source 1: expert 0 ×1, expert 1 ×3)
    recv_counts = torch.tensor([[2, 0, 1], [1, 3, 0]])
    assert expert_major_order(recv_counts).tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert expert_major_order(torch.zeros(2, 3, dtype=torch.long)).tolist() == []


def given_routes(
    generator: torch.Generator, num_tokens: int, num_layers: int, num_experts: int
) -> torch.Tensor:
    """[tokens, layers, 2] random pairs of distinct experts: routes as inference might have chosen them."""
    first = torch.randint(0, num_experts, (num_tokens, num_layers), generator=generator)
    second = (
        first + torch.randint(1, num_experts, (num_tokens, num_layers), generator=generator)
    ) % num_experts
    return torch.stack([first, second], dim=-1)


def train_step(
    ep: int, mixed_precision: str, rank: int, world: int, replay: bool = False
) -> tuple[torch.Tensor, float, dict[str, torch.Tensor]]:
    """One forward/backward of the tiny MoE on this rank's data: (logprobs, aux term, full gradients)."""
    from tests.unit.test_moe import tiny_moe_lm
    from tidal.config.moe import MoEConfig
    from tidal.config.perf import PerfConfig
    from tidal.trainer.moe import Routes
    from tidal.trainer.parallel import DistInfo, parallelize

    info = DistInfo(rank, world, rank, world, torch.device("cpu"))
    model = tiny_moe_lm(num_experts=4)
    perf = PerfConfig(ep=ep, mixed_precision=mixed_precision, activation_checkpointing="full")
    scorer = parallelize(model, info, perf, MoEConfig(aux_loss_coef=0.1))
    generator = torch.Generator().manual_seed(rank)  # each rank its own tokens
    ids, targets = (torch.randint(0, 61, (2, 12), generator=generator) for _ in range(2))
    positions = torch.arange(12).repeat(2, 1)
    routes = None
    if replay:
        routes = Routes(given_routes(generator, 24, 2, 4), torch.ones(24, dtype=torch.bool))
    scorer.moe.start_step(num_tokens_global=24.0 * world, gradient_scale=world)
    mask = torch.ones(2, 12, dtype=torch.bool)
    logprobs, _ = scorer(ids, positions, targets, token_mask=mask, routes=routes)
    aux = scorer.moe.aux_loss()
    (logprobs.sum() * world + aux).backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return logprobs.detach(), float(aux), grads


def compare_worker(rank: int, world: int, port: int, failures: "mp.Queue[str]") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    try:
        for mixed_precision, tol, replay in (
            ("off", 1e-5, False),
            ("bf16", 2e-2, False),
            ("off", 1e-5, True),
        ):
            want_lp, want_aux, want = train_step(1, mixed_precision, rank, world, replay)
            got_lp, got_aux, got = train_step(2, mixed_precision, rank, world, replay)
            torch.testing.assert_close(got_lp, want_lp, atol=tol, rtol=tol)
            assert abs(got_aux - want_aux) <= tol * abs(want_aux), (got_aux, want_aux)
            assert sorted(got) == sorted(want)
            for name in want:
                label = f"{mixed_precision}{' replay' if replay else ''} {name}"
                torch.testing.assert_close(got[name], want[name], atol=tol, rtol=tol, msg=label)
    except BaseException:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # spawns gloo ranks
@pytest.mark.parametrize("world", [2, 4])
def test_ep2_matches_ep1_logprobs_loss_and_gradients(world: int):
    """Two ranks: the experts split over both; four: split over pairs, each slice FSDP-sharded over two
    ranks. fp32: equal to float reordering; bf16 compute: equal to bf16 rounding."""
    run_ranks(compare_worker, world)

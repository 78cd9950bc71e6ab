"""Context parallelism on a mixture-of-experts model: cp = 2 on gloo ranks against one process (cp = 1) on
packed rows of several documents with padding: per-token logprobs, the load-balancing loss, the router
metrics and every gradient, also with routing replay (inference's routes given for most tokens) and with
expert parallelism over the same ranks."""

import os
import sys
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from tests.ranks import run_ranks
from tests.unit.test_context_parallel import ROWS_OF_GROUP, SEQ, packed_rows
from tests.unit.test_expert_parallel import given_routes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="gloo process group")

# fp32 everywhere: the split changes only the order of float sums (attention, the statistics' all-reduce)
TOLERANCE = 1e-5
NUM_EXPERTS, NUM_LAYERS, AUX_COEF = 4, 2, 0.1

# (perf settings, routing replay) per world size: activation checkpointing recomputes the MoE layers in
# backward, where the split token mask and routes must still be the forward's; with `ep` the ranks also split
# the experts and exchange their chunks' tokens (with four ranks, across the two cp groups)
CASES = {
    2: [
        ({"attention": "auto", "loss_chunk_tokens": 3}, False),
        ({"attention": "varlen", "activation_checkpointing": "full"}, True),
        ({"ep": 2, "activation_checkpointing": "full"}, True),
    ],
    4: [({"attention": "auto"}, False), ({"ep": 4, "activation_checkpointing": "full"}, True)],
}


def step_inputs(group: int, replay: bool) -> dict[str, Any]:
    """Data-parallel group `group`'s rows, a token mask with padding at the end of a row, a loss weight per
    token and (replay) routes for most real tokens (the same on every rank of the group)."""
    rows = ROWS_OF_GROUP[group]
    batch = packed_rows(rows)
    mask = torch.ones(len(rows), SEQ, dtype=torch.bool)
    mask[0, -3:] = False
    generator = torch.Generator().manual_seed(11 + group)
    weights = torch.rand(len(rows), SEQ, generator=generator) * mask
    routes = None
    if replay:
        from tidal.trainer.moe import Routes

        tokens = len(rows) * SEQ
        has_routes = mask.flatten() & (torch.rand(tokens, generator=generator) < 0.8)
        routes = Routes(given_routes(generator, tokens, NUM_LAYERS, NUM_EXPERTS), has_routes)
    return {**batch, "token_mask": mask, "weights": weights, "routes": routes}


def step_tokens(num_groups: int) -> float:
    """The step's real tokens over every data-parallel group (what `start_step` is given)."""
    return float(sum(int(step_inputs(g, False)["token_mask"].sum()) for g in range(num_groups)))


def forward_backward(scorer: Any, inputs: dict[str, Any], world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One micro-batch as the trainers run it: (logprobs, aux term / gradient scale)."""
    logprobs, _ = scorer(
        inputs["input_ids"], inputs["position_ids"], inputs["target_ids"], 1.0,
        token_mask=inputs["token_mask"], routes=inputs["routes"],
    )  # fmt: skip
    aux = scorer.moe.aux_loss()
    (-(logprobs * inputs["weights"]).sum() * world + aux).backward()
    return logprobs.detach(), aux.detach() / world


def reference(num_groups: int, replay: bool) -> tuple[list[tuple[torch.Tensor, ...]], dict, dict]:
    """cp = 1 in this process alone (transformers' SDPA attention, masked by the position-id resets), each
    group's rows a micro-batch of one step: per group (logprobs, aux term), the step's metrics, gradients."""
    from tests.unit.test_moe import tiny_moe_lm
    from tidal.config.moe import MoEConfig
    from tidal.trainer.chunked import TokenScorer
    from tidal.trainer.moe import apply_moe

    model = tiny_moe_lm(num_experts=NUM_EXPERTS)
    routing = apply_moe(model, MoEConfig(aux_loss_coef=AUX_COEF), "cpu", torch.float32)
    scorer = TokenScorer(model, chunk_size=5, moe=routing)
    assert routing is not None
    routing.start_step(step_tokens(num_groups))
    outputs = [forward_backward(scorer, step_inputs(g, replay), 1) for g in range(num_groups)]
    metrics = routing.step_metrics(lambda t: t.double())
    return outputs, metrics, {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def context_parallel(info: Any, perf: dict, replay: bool) -> tuple[tuple[torch.Tensor, ...], dict, dict]:
    """The same step with perf.cp = 2, FSDP2 over every rank: this rank's group's (logprobs, aux term),
    the step's metrics, the full gradients."""
    from tests.unit.test_moe import tiny_moe_lm
    from tidal.config.moe import MoEConfig
    from tidal.config.perf import PerfConfig
    from tidal.trainer.parallel import all_reduce_tensor, parallelize

    model = tiny_moe_lm(num_experts=NUM_EXPERTS)
    config = PerfConfig(cp=info.cp, mixed_precision="off", **perf)
    scorer = parallelize(model, info, config, MoEConfig(aux_loss_coef=AUX_COEF))
    assert scorer.context_parallel is not None and scorer.moe is not None
    assert (scorer.moe.ep_group is not None) == (config.ep > 1)
    scorer.moe.start_step(step_tokens(info.dp_size), gradient_scale=info.world_size)
    out = forward_backward(scorer, step_inputs(info.dp_rank, replay), info.world_size)
    metrics = scorer.moe.step_metrics(lambda t: all_reduce_tensor(t, info))
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return out, metrics, grads


def compare(got: tuple[Any, ...], want: tuple[Any, ...], what: str) -> None:
    """The two runs' (per-group outputs, metrics, gradients) agree to TOLERANCE."""
    close = {"atol": TOLERANCE, "rtol": TOLERANCE}
    for name, got_t, want_t in zip(("logprobs", "aux loss"), got[0], want[0], strict=True):
        torch.testing.assert_close(got_t, want_t, **close, msg=f"{what} {name}")
    assert sorted(got[1]) == sorted(want[1]), what
    for key, value in want[1].items():
        assert got[1][key] == pytest.approx(value, rel=TOLERANCE, abs=TOLERANCE), f"{what} {key}"
    assert sorted(got[2]) == sorted(want[2])
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, **close, msg=f"{what} {name}")


def compare_worker(rank: int, world: int, port: int, failures: "mp.Queue[str]") -> None:
    from tidal.trainer.parallel import DistInfo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    info = DistInfo(rank, world, rank, world, torch.device("cpu"), cp=2)
    try:
        for perf, replay in CASES[world]:
            outputs, metrics, grads = reference(info.dp_size, replay)
            got = context_parallel(info, perf, replay)
            compare(got, (outputs[info.dp_rank], metrics, grads), f"{perf} replay={replay}")
            if replay:
                assert got[1]["moe/replayed"] > 0, "no token was replayed"
    except BaseException:
        failures.put(f"rank {rank}: {traceback.format_exc()}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow  # spawns gloo ranks
def test_cp2_moe_matches_cp1_logprobs_aux_loss_metrics_and_gradients():
    """Two ranks, one cp group: each routes half of every row's tokens; the load-balancing loss, its
    gradient and the router metrics count the whole rows' tokens, padding excluded."""
    run_ranks(compare_worker, 2)


@pytest.mark.slow
def test_cp2_moe_with_two_data_parallel_groups_matches_cp1():
    """Four ranks, two cp groups training different rows: the statistics sum within a group only, the
    step's token count and metrics span both, and with ep = 4 tokens travel between the groups."""
    run_ranks(compare_worker, 4)

"""Routing replay in the trainer's MoE layers: given routes are the experts that compute (their weights by the
router's rule, with gradients to the router), routes equal to the router's own top-k change nothing, tokens
without routes route themselves, and the agreement metric counts what it says."""

import copy

import pytest
import torch

from tests.unit.test_moe import CPU, one_thread, patched_block, tiny_moe_lm  # noqa: F401 - fixture
from tidal.config.moe import MoEConfig
from tidal.config.perf import PerfConfig
from tidal.trainer.experts import expert_mlp
from tidal.trainer.moe import MoERouting, Routes, replay_metrics, replay_weights, same_experts
from tidal.trainer.parallel import parallelize


def own_routes(model: torch.nn.Module, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[tokens, layers, k]: the experts transformers' own forward routes each token to, per decoder layer."""
    out = model(input_ids=ids, position_ids=positions, output_router_logits=True)
    k = model.config.num_experts_per_tok
    return torch.stack([logits.topk(k, dim=-1).indices for logits in out.router_logits], dim=1)


def batch(seed: int = 1, rows: int = 2, seq: int = 8) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 61, (rows, seq), generator=gen)
    return ids, torch.arange(seq).repeat(rows, 1), torch.randint(0, 61, (rows, seq), generator=gen)


@pytest.mark.parametrize("checkpointing", ["none", "full"])
def test_routes_equal_to_the_routers_own_change_nothing(checkpointing):
    """Replaying the router's own top-k gives the same logprobs and gradients (router included) as routing,
    and an agreement of 1 over every (token, layer) pair."""
    reference = tiny_moe_lm()
    ids, positions, targets = batch()
    with torch.no_grad():
        routes = Routes(
            own_routes(reference, ids, positions).to(torch.uint8), torch.ones(16, dtype=torch.bool)
        )
    perf = PerfConfig(activation_checkpointing=checkpointing)
    plain = parallelize(copy.deepcopy(reference), CPU, perf, MoEConfig(aux_loss_coef=0.1))
    replayed = parallelize(copy.deepcopy(reference), CPU, perf, MoEConfig(aux_loss_coef=0.1))
    mask = torch.ones(2, 8, dtype=torch.bool)
    results = []
    for scorer, given in ((plain, None), (replayed, routes)):
        scorer.moe.start_step(16.0)
        logprobs, _ = scorer(ids, positions, targets, token_mask=mask, routes=given)
        (logprobs.sum() + scorer.moe.aux_loss()).backward()
        results.append((logprobs, scorer.moe.step_metrics(lambda t: t)))
    (want, plain_metrics), (got, metrics) = results
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    for (name, mine), theirs in zip(replayed.named_parameters(), plain.parameters(), strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=1e-6, rtol=1e-5, msg=name)
    assert metrics["moe/route_agreement"] == 1.0 and metrics["moe/replayed"] == 16 * 2  # tokens × layers
    assert "moe/route_agreement" not in plain_metrics


def test_given_routes_are_the_experts_that_compute_and_the_router_still_learns():
    """A block given other experts for some tokens computes exactly those experts with the router's
    renormalised probabilities of them; tokens without routes keep the router's choice; the router's
    weight gets the gradient through those probabilities; agreement counts only the replayed tokens."""
    reference = tiny_moe_lm().model.layers[0].mlp
    block = patched_block(reference, "padded")
    routing: MoERouting = block.forward.args[2]
    x = torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits, own_weights, own = reference.gate(x.view(-1, 32))
    given = (own + 1) % 6  # [6, 2]: different experts for every token (still two distinct ones)
    mask = torch.tensor([True, True, True, False, True, False])
    routing.start_step(6.0)
    with routing.collect(None, Routes(given.unsqueeze(1), mask)):
        out = block(x)
    used = torch.where(mask.unsqueeze(-1), given, own)
    weights = replay_weights(logits, used, normalize=True)
    experts = reference.experts
    want = expert_mlp(
        x.view(-1, 32), used, weights, experts.gate_up_proj, experts.down_proj, experts.act_fn, "padded"
    )
    torch.testing.assert_close(out.view(-1, 32), want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(weights[~mask], own_weights[~mask])  # no route: the router's own weights
    assert not torch.allclose(out, reference(x), atol=1e-4)  # the routes changed what the block computes

    out.square().sum().backward()
    assert block.gate.weight.grad is not None and block.gate.weight.grad.abs().sum() > 0
    routing.aux_loss()  # books the forward's statistics, as the trainers do
    metrics = routing.step_metrics(lambda t: t)
    assert metrics["moe/replayed"] == 4 and metrics["moe/route_agreement"] == 0.0


@pytest.mark.parametrize("normalize", [True, False])
def test_replay_weights_of_the_routers_own_experts_are_its_weights(normalize):
    reference = tiny_moe_lm(norm_topk_prob=normalize).model.layers[0].mlp.gate
    logits, weights, index = reference(torch.randn(5, 32))
    torch.testing.assert_close(replay_weights(logits, index, normalize), weights)
    # the order of the k given experts does not matter to the set they name
    assert same_experts(index, index.flip(-1)).all() and not same_experts(index, (index + 1) % 6).any()


def test_routes_are_read_by_decoder_layer_index_with_dense_layers_between():
    """vLLM numbers a token's routes by decoder layer, dense layers included: with layer 0 dense, the one MoE
    block reads routes[:, 1]; what stands in routes[:, 0] does not matter."""
    reference = tiny_moe_lm(mlp_only_layers=[0])
    ids, positions, targets = batch(rows=1)
    with torch.no_grad():
        own = own_routes(reference, ids, positions)  # [8, 1, 2]: the one MoE layer
    routes = torch.zeros(8, 2, 2, dtype=torch.uint8)
    routes[:, 1] = own[:, 0]
    routes[:, 0] = 5  # junk where no MoE layer reads
    scorer = parallelize(copy.deepcopy(reference), CPU, PerfConfig(), MoEConfig())
    mask = torch.ones(8, dtype=torch.bool)
    got, _ = scorer(ids, positions, targets, routes=Routes(routes, mask))
    want, _ = scorer(ids, positions, targets)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    routes[:, 1] = (own[:, 0] + 1) % 6
    moved, _ = scorer(ids, positions, targets, routes=Routes(routes, mask))
    assert not torch.allclose(moved, want, atol=1e-4)


def test_replay_metrics_are_absent_without_replayed_tokens():
    assert replay_metrics(0.0, 0.0) == {}
    assert replay_metrics(8.0, 6.0) == {"moe/route_agreement": 0.75, "moe/replayed": 8.0}


def test_routes_of_another_model_are_refused():
    reference = tiny_moe_lm()
    ids, positions, targets = batch(rows=1)
    scorer = parallelize(copy.deepcopy(reference), CPU, PerfConfig(), MoEConfig())
    three = Routes(torch.zeros(8, 2, 3, dtype=torch.long), torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="routes hold 2 layers × top-3, but decoder layer 0 routes"):
        scorer(ids, positions, targets, routes=three)
    one_layer = Routes(torch.zeros(8, 1, 2, dtype=torch.long), torch.ones(8, dtype=torch.bool))
    with pytest.raises(ValueError, match="decoder layer 1"):
        scorer(ids, positions, targets, routes=one_layer)

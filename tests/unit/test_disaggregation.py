"""Prefill/decode disaggregation without vLLM: config checks, per-replica flags, the two requests of one
generation, and weight updates that pause every server and empty the KV store (client against local HTTP
servers answered by test functions)."""

import asyncio
import contextlib
import json
from pathlib import Path

import pytest
from aiohttp import web

from tests.unit.http_servers import Seen, make_client, reply, serving
from tidal.config.eval import EvalConfig
from tidal.config.inference import InferenceConfig
from tidal.config.loader import load_config
from tidal.config.rl import ClientConfig, RLConfig
from tidal.errors import UserError
from tidal.inference.disagg import Prefill, decode_body, empty_store, prefill_body, with_roles
from tidal.inference.server import build_launch
from tidal.inference.types import GenerateRequest, SamplingParams
from tidal.launcher.split import split_config

DISAGG = [("inference.disaggregation.block_size", 16)]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def rl_error(*overrides: tuple[str, object]) -> str:
    with pytest.raises(UserError) as info:
        load_config(RLConfig, [], list(overrides))
    message = str(info.value)
    assert "\n" not in message and info.value.exit_code == 2
    return message


def test_replicas_get_roles_flags_and_one_store() -> None:
    base = InferenceConfig.model_validate({"disaggregation": {"num_prefill_replicas": 2, "block_size": 16}})
    ports = [
        base.model_copy(update={"server": base.server.model_copy(update={"port": 8000 + i})})
        for i in range(3)
    ]
    replicas = with_roles(ports, Path("/run/kv_store"))
    assert [r.disaggregation.role for r in replicas if r.disaggregation] == ["prefill", "prefill", "decode"]
    argv = build_launch(replicas[2], "/models/tiny", "cpu").argv
    transfer = json.loads(flag(argv, "--kv-transfer-config"))
    assert transfer == {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/run/kv_store"},
    }
    assert flag(argv, "--block-size") == "16"
    # ExampleConnector stores a prompt's KV in its first step: never a chunked prefill, on GPUs either
    assert "--no-enable-chunked-prefill" in build_launch(replicas[0], "/models/tiny", "cuda").argv


def test_nixl_replicas_get_their_own_side_channel_and_other_connectors_their_side() -> None:
    nixl = InferenceConfig.model_validate(
        {"server": {"port": 8001}, "disaggregation": {"connector": "NixlConnector", "role": "decode"}}
    )
    launch = build_launch(nixl, "/m", "cuda")
    assert launch.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "9001"
    assert launch.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"
    assert json.loads(flag(launch.argv, "--kv-transfer-config"))["kv_role"] == "kv_both"
    other = InferenceConfig.model_validate(
        {"disaggregation": {"connector": "MooncakeConnector", "role": "prefill"}}
    )
    assert (
        json.loads(flag(build_launch(other, "/m", "cuda").argv, "--kv-transfer-config"))["kv_role"]
        == "kv_producer"
    )
    alone = InferenceConfig.model_validate({"disaggregation": {}})
    with pytest.raises(UserError, match="disaggregation.role"):
        build_launch(alone, "/m", "cpu")


def test_rl_splits_replicas_into_a_prefill_pool_and_a_decode_pool(tmp_path: Path) -> None:
    overrides = [*DISAGG, ("deployment.num_replicas", 3), ("output_dir", str(tmp_path))]
    roles = split_config(load_config(RLConfig, [], overrides), on_gpu=False, num_cpus=4)
    client = roles.orchestrator.client
    # the shared store needs a drained update: `auto` waits here, as it keeps requests without a store
    assert (
        client.weight_update_pause == "auto"
        and client.pause_mode(roles.orchestrator.max_async_level) == "wait"
    )
    assert roles.orchestrator.max_async_level > 0
    assert client.prefill_urls == ["http://127.0.0.1:8000"]
    assert client.urls == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert client.kv_store == str((tmp_path / "kv_store").absolute())
    assert roles.replica_urls == ("http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002")
    assert [r.cpu.omp_threads_bind for r in roles.replicas] == ["0", "1", "0"]


def test_rl_refuses_what_it_cannot_keep_correct_across_weight_updates() -> None:
    assert "leave none to decode" in rl_error(*DISAGG)
    two = [*DISAGG, ("deployment.num_replicas", 2)]
    assert "supports ExampleConnector and NixlConnector" in rl_error(
        *two, ("inference.disaggregation.connector", "LMCacheConnectorV1")
    )
    assert "LoRA" in rl_error(*two, ("trainer.lora.rank", 8))
    assert "'keep'" in rl_error(*two, ("orchestrator.client.weight_update_pause", "keep"))
    assert "orchestrator.client.prefill_urls" in rl_error(
        *two, ("orchestrator.client.prefill_urls", ["http://x"])
    )
    load_config(
        RLConfig,
        [],
        [*two, ("inference.disaggregation.connector", "NixlConnector"), ("trainer.lora.rank", 8)],
    )


def test_weight_update_pause_auto_keeps_requests_only_where_an_update_can_meet_them() -> None:
    auto = ClientConfig()
    assert auto.pause_mode(0) == "wait"  # nothing runs during a synchronous run's update
    assert auto.pause_mode(1) == "keep" and auto.pause_mode(2) == "keep"
    assert ClientConfig(kv_store="/run/kv").pause_mode(2) == "wait"
    assert ClientConfig(weight_update_pause="wait").pause_mode(2) == "wait"
    assert ClientConfig(weight_update_pause="keep").pause_mode(0) == "keep"


def test_eval_and_inference_refuse_bad_combinations() -> None:
    def error(schema: type, *overrides: tuple[str, object]) -> str:
        with pytest.raises(UserError) as info:
            load_config(schema, [], list(overrides))
        return str(info.value)

    assert "server_url" in error(EvalConfig, *DISAGG, ("num_replicas", 2), ("server_url", "http://h:1"))
    assert "num_replicas" in error(EvalConfig, *DISAGG)
    assert "--kv-transfer-config" in error(
        InferenceConfig, ("disaggregation.role", "decode"), ("vllm.extra_args", ["--kv-transfer-config={}"])
    )
    assert "LoRA" in error(InferenceConfig, ("disaggregation.role", "decode"), ("vllm.enable_lora", True))
    assert "chunked" in error(
        InferenceConfig, ("disaggregation.role", "decode"), ("vllm.chunked_prefill", True)
    )
    assert "names no connector" in error(InferenceConfig, ("disaggregation.connector", " "))


def test_prefill_asks_for_one_token_and_decode_takes_its_kv_only_from_the_same_weights() -> None:
    body = {"model": "m", "prompt": [1, 2], "n": 4, "max_tokens": 9, "min_tokens": 3, "logprobs": 0}
    prefill = prefill_body(body)
    assert prefill["max_tokens"] == 1 and prefill["n"] == 1 and prefill["min_tokens"] == 0
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True and body["max_tokens"] == 9
    params = {"remote_block_ids": [3], "do_remote_prefill": True}
    assert decode_body(body, Prefill("p", 2, params), 2) == {**body, "kv_transfer_params": params}
    assert decode_body(body, Prefill("p", 2, params), 3) is body  # weights changed in between: prefill again
    assert (
        decode_body(body, Prefill("p", 2, None), 2) is body
    )  # ExampleConnector: the store, found by content


def test_empty_store_keeps_the_directory(tmp_path: Path) -> None:
    (tmp_path / "abc").mkdir()
    (tmp_path / "abc" / "model.layers.0.safetensors").write_bytes(b"kv")
    (tmp_path / "stray").write_text("x")
    assert empty_store(tmp_path) == 2 and tmp_path.is_dir() and not any(tmp_path.iterdir())
    assert empty_store(tmp_path / "missing") == 0


class TwoPools:
    """Prefill server `p` and decode server `d` speaking vLLM's routes: versions, pause, weight loads; `p`
    answers `kv_transfer_params` naming the version that computed them; every call is logged in order."""

    def __init__(self, store: Path, fail_load_on: str = ""):
        self.store, self.fail_load_on = store, fail_load_on
        self.calls: list[str] = []
        self.version = {"p": 0, "d": 0}
        self.bodies: dict[str, list[dict]] = {"p": [], "d": []}
        self.store_entries_at_load: list[int] = []

    def __call__(self, seen: Seen) -> web.Response:
        self.calls.append(f"{seen.server}{seen.path}")
        if seen.path == "/v1/completions":
            self.bodies[seen.server].append(seen.json())
            choice = {
                "index": 0, "text": "", "token_ids": [7], "prompt_token_ids": [1, 2],
                "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length",
            }  # fmt: skip
            params = {"computed_by": self.version["p"]} if seen.server == "p" else None
            (self.store / f"prompt_{len(self.calls)}").mkdir()  # as ExampleConnector writes
            return reply(200, {"choices": [choice], "kv_transfer_params": params})
        if seen.path == "/update_weights":
            self.store_entries_at_load.append(len(list(self.store.iterdir())))
            if seen.server == self.fail_load_on:
                return reply(500, {"error": "load failed"})
        if seen.path == "/finish_weight_update":
            self.version[seen.server] = int(seen.json()["weight_version"])
        return reply(200, {"weight_version": str(self.version[seen.server])})


@contextlib.asynccontextmanager
async def pools(handler: TwoPools, store: Path):
    async with serving(handler, ("p", "d")) as urls:
        client = make_client(
            [urls["d"]], prefill_urls=[urls["p"]], kv_store=str(store), model="m", backoff=0.0
        )
        async with contextlib.aclosing(client):
            yield client, urls


REQUEST = GenerateRequest(prompt_token_ids=(1, 2), n=2, sampling=SamplingParams(max_tokens=4))


def test_a_generation_is_prefilled_on_one_pool_and_decoded_on_the_other(tmp_path: Path) -> None:
    handler = TwoPools(tmp_path)

    async def go() -> None:
        async with pools(handler, tmp_path) as (client, urls):
            generation = await client.generation.generate(REQUEST, session_id="s")
            assert generation.server == urls["d"] and generation.weight_version == 0
            assert client.pool.servers[urls["p"]].requests == 1 and client.pool.prefills_redone == 0

    asyncio.run(go())
    (prefill,), (decode,) = handler.bodies["p"], handler.bodies["d"]
    assert (
        prefill["max_tokens"] == 1 and prefill["n"] == 1 and prefill["kv_transfer_params"]["do_remote_decode"]
    )
    assert (
        decode["max_tokens"] == 4 and decode["n"] == 2 and decode["kv_transfer_params"] == {"computed_by": 0}
    )


def test_weight_updates_pause_both_pools_empty_the_store_then_load(tmp_path: Path) -> None:
    handler = TwoPools(tmp_path)

    async def go() -> None:
        async with pools(handler, tmp_path) as (client, urls):
            await client.generation.generate(REQUEST)
            assert any(tmp_path.iterdir())
            handler.calls.clear()
            report = await client.weights.load_step("/run/weights/step_1", 1)
            assert report.all_ok and [s.url for s in report.servers] == [urls["p"], urls["d"]]
            await client.generation.generate(REQUEST)
            assert handler.bodies["d"][-1]["kv_transfer_params"] == {"computed_by": 1}

    asyncio.run(go())
    order = [c for c in handler.calls if c[1:] in ("/pause", "/update_weights", "/resume")]
    assert sorted(order[:2]) == ["d/pause", "p/pause"] and sorted(order[-2:]) == ["d/resume", "p/resume"]
    assert handler.store_entries_at_load == [0, 0]  # nothing computed by the old weights is left to find


def test_a_decode_server_on_other_weights_than_the_prefill_prefills_itself(tmp_path: Path) -> None:
    handler = TwoPools(tmp_path)

    async def go() -> None:
        async with pools(handler, tmp_path) as (client, urls):
            client.pool.servers[
                urls["d"]
            ].version = 5  # as after an update between the prefill and the decode
            generation = await client.generation.generate(REQUEST)
            assert generation.weight_version == 5 and client.pool.prefills_redone == 1

    asyncio.run(go())
    assert "kv_transfer_params" not in handler.bodies["d"][0]


def test_a_server_that_fails_the_update_leaves_rotation_until_it_catches_up(tmp_path: Path) -> None:
    handler = TwoPools(tmp_path, fail_load_on="p")

    async def go() -> None:
        async with pools(handler, tmp_path) as (client, urls):
            report = await client.weights.load_step("/run/weights/step_1", 1)
            by_url = {s.url: s for s in report.servers}
            assert not by_url[urls["p"]].ok and by_url[urls["d"]].ok and by_url[urls["d"]].version == 1
            assert not client.pool.servers[urls["p"]].healthy  # it must not prefill with the old weights
            assert "p/resume" in handler.calls  # nor stay paused
            handler.fail_load_on = ""
            await client.pool.check_health()  # the watch brings it to the latest weights before it returns
            assert client.pool.servers[urls["p"]].healthy and client.pool.servers[urls["p"]].version == 1

    asyncio.run(go())


def test_roles_are_set_by_the_command_not_the_file() -> None:
    message = rl_error(*DISAGG, ("deployment.num_replicas", 2), ("inference.disaggregation.role", "decode"))
    assert "inference.disaggregation.num_prefill_replicas" in message
    with pytest.raises(UserError, match="num_prefill_replicas"):
        load_config(
            EvalConfig, [], [*DISAGG, ("num_replicas", 2), ("inference.disaggregation.role", "decode")]
        )

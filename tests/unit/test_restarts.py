"""Restarting what dies (issue 14): the restart policy, events.jsonl, which batches a restart needs, and the
orchestrator side that keeps a run going while a replica is down (real local HTTP servers, no vLLM)."""

import asyncio
import json
import shutil
import signal
from pathlib import Path

import pytest
from aiohttp import web

from tests.unit.http_servers import Seen, client_over, reply
from tidal.config.loader import load_config
from tidal.config.rl import FilesystemTransport, OrchestratorConfig, RLConfig
from tidal.errors import UserError
from tidal.inference.errors import NoHealthyServer
from tidal.inference.types import GenerateRequest, SamplingParams
from tidal.launcher.restarts import Recovery, RestartPolicy, how_it_ended, max_restarts, missing_batches
from tidal.launcher.split import split_config
from tidal.monitor.events import EventLog, read_events
from tidal.orchestrator.loop import own_resume_step
from tidal.orchestrator.policy import PolicyWatcher
from tidal.transport.rollouts import FilesystemSender

REQUEST = GenerateRequest(prompt_token_ids=(1, 2), sampling=SamplingParams(max_tokens=2, temperature=1.0))


def test_a_role_restarts_up_to_the_limit_within_the_window_then_again_once_it_has_passed() -> None:
    policy = RestartPolicy(limit=2, window=100.0)
    assert policy.allow("trainer", 0.0) and policy.allow("trainer", 10.0)
    assert policy.allow("inference_1", 20.0)  # each role counts on its own
    assert not policy.allow("trainer", 50.0)
    assert "restarted 2 time(s) within 100 s" in policy.refusal("trainer")
    assert policy.allow("trainer", 105.0)  # the failure at 0 is out of the window now
    assert policy.count("trainer") == 2 and not policy.allow("trainer", 106.0)


def test_no_restarts_refuses_the_first_failure() -> None:
    policy = RestartPolicy(limit=0, window=100.0)
    assert not policy.allow("orchestrator", 0.0)
    assert "restarts.max_restarts = 0" in policy.refusal("orchestrator")


def config_problem(schema: type[RLConfig] | type[OrchestratorConfig], **overrides: object) -> str:
    with pytest.raises(UserError) as found:
        load_config(schema, [], list(overrides.items()))
    return str(found.value)


def test_nccl_runs_never_restart_and_refuse_a_number_set_for_them() -> None:
    nccl = ("trainer.publish.type", "nccl")
    assert max_restarts(load_config(RLConfig, [], [nccl])) == 0
    assert max_restarts(RLConfig()) == 3
    problem = config_problem(RLConfig, **dict([nccl, ("restarts.max_restarts", 2)]))
    assert "restarts.max_restarts" in problem and "broadcast group" in problem


def test_tidal_rl_lets_requests_wait_for_a_restarted_replica_only_when_it_restarts_them() -> None:
    assert (
        split_config(RLConfig(startup_timeout=120.0), on_gpu=False).orchestrator.client.recovery_timeout
        == 120
    )
    off = load_config(RLConfig, [], [("restarts.max_restarts", 0)])
    assert split_config(off, on_gpu=False).orchestrator.client.recovery_timeout == 0
    problem = config_problem(RLConfig, **{"orchestrator.client.recovery_timeout": 5.0})
    assert "orchestrator.client.recovery_timeout" in problem and "startup_timeout" in problem


def test_resume_from_latest_needs_batches_that_outlive_the_orchestrator() -> None:
    problem = config_problem(OrchestratorConfig, resume_from="latest", **{"transport.type": "zmq"})
    assert "resume_from" in problem and "zmq" in problem


def test_how_a_process_ended() -> None:
    assert how_it_ended(-signal.SIGKILL) == {"signal": "SIGKILL"}
    assert how_it_ended(1) == {"exit_code": 1} and how_it_ended(None) == {}


def test_events_are_one_json_record_per_line(tmp_path: Path) -> None:
    log = EventLog(tmp_path, node="node 1 (n2)")
    log.write("failure", at=1000.0, role="trainer", cause="trainer was killed by signal 9", signal="SIGKILL")
    recovery = Recovery("trainer", failed_at=10.0, back_at=22.5, next_step_at=22.5, next_step=4)
    log.write("recovery", **recovery.record())
    failure, recovered = read_events(tmp_path)
    assert failure == {
        "time": 1000.0, "event": "failure", "role": "trainer", "cause": "trainer was killed by signal 9",
        "signal": "SIGKILL", "node": "node 1 (n2)",
    }  # fmt: skip
    assert recovered["seconds_lost"] == 12.5 and recovered["seconds_to_next_step"] == 12.5
    assert recovered["next_step"] == 4 and recovered["event"] == "recovery"
    assert all(json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines())


def test_a_trainer_restart_needs_every_batch_from_its_checkpoint_that_was_sent() -> None:
    # the orchestrator's newest state is 7: batches 0..5 were sent, 6 may be on its way
    assert missing_batches(4, 7, [2, 3, 4, 5, 6]) == []
    assert missing_batches(4, 7, [4, 5]) == []
    assert missing_batches(2, 7, [3, 4, 5]) == [2]  # pruned before the checkpoint at 2 was written
    assert missing_batches(0, 0, []) == []  # nothing made yet
    assert missing_batches(0, 5, [3, 4]) == [0, 1, 2]  # no checkpoint: batch 0 is long gone


def test_an_orchestrator_restart_continues_after_its_last_sent_batch() -> None:
    assert own_resume_step([], set()) == 0
    assert own_resume_step([3, 4, 5], {2, 3, 4}) == 5  # batch 4 was sent after state 5 was saved
    assert own_resume_step([3, 4, 5], {2, 3}) == 4  # it died between saving state 5 and sending batch 4
    assert own_resume_step([1], set()) == 0


def test_the_sender_keeps_every_batch_from_the_trainer_checkpoint_on(tmp_path: Path) -> None:
    checkpoint: list[int | None] = [None]
    sender = FilesystemSender(tmp_path, FilesystemTransport(keep_last=2), keep_from=lambda: checkpoint[0])
    on_disk = lambda: sorted(int(p.name.split("_")[1]) for p in (tmp_path / "rollouts").iterdir())  # noqa: E731
    for step in range(4):
        sender.send(step, [])
    assert on_disk() == [2, 3]  # no checkpoint: only keep_last
    checkpoint[0] = 3
    for step in range(4, 7):
        sender.send(step, [])
    assert on_disk() == [3, 4, 5, 6]  # a trainer restarted from step 3 reads them again
    checkpoint[0] = 6
    sender.send(7, [])
    assert on_disk() == [6, 7]


def servers_with_health(
    up: dict[str, bool], versions: dict[str, str] | None = None
) -> tuple[list[str], object]:
    """A handler: /health answers as `up` says, weight routes succeed (recording the version loaded in
    `versions`: clear it for a server that restarts), completions answer."""
    calls: list[str] = []
    versions = {} if versions is None else versions

    def handler(request: Seen) -> web.Response:
        calls.append(f"{request.server}{request.path}")
        if request.path == "/health":
            return reply(200 if up[request.server] else 503)
        if not up[request.server]:
            return reply(503)
        if request.path == "/weight_info":
            return reply(200, {"weight_version": versions.get(request.server, "default")})
        if request.path.startswith("/finish_weight_update"):
            version = request.json().get("weight_version")
            if version is not None:
                versions[request.server] = version
        if request.path == "/v1/completions":
            choice = {
                "index": 0, "text": "x", "token_ids": [7], "prompt_token_ids": [1, 2],
                "logprobs": {"token_logprobs": [-0.5]}, "finish_reason": "length",
            }  # fmt: skip
            return reply(200, {"choices": [choice]})
        return reply(200, {})

    return calls, handler


def test_with_every_server_down_a_request_waits_for_one_to_come_back() -> None:
    up = {"a": False}
    _, handler = servers_with_health(up)

    async def go() -> None:
        watched = client_over(handler, ("a",), recovery_timeout=10.0, health_interval=0.05)
        async with watched as (client, urls), client:  # the health watch runs
            client.pool.mark_down(client.pool.servers[urls["a"]], "test")
            request = asyncio.create_task(client.generation.generate(REQUEST))
            await asyncio.sleep(0.3)
            assert not request.done()  # waiting, not failed
            up["a"] = True  # the restarted replica answers: the health watch takes it back
            generation = await asyncio.wait_for(request, 5)
            assert generation.server == urls["a"]
        async with client_over(handler, ("a",), recovery_timeout=0.2, health_interval=30.0) as (client, urls):
            up["a"] = False
            client.pool.mark_down(client.pool.servers[urls["a"]], "test")
            with pytest.raises(NoHealthyServer):  # bounded
                await client.generation.generate(REQUEST)

    asyncio.run(go())


def publish(root: Path, step: int) -> Path:
    target = root / "weights" / f"step_{step}"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / ".complete").touch()
    return target


def test_a_weight_update_goes_on_without_a_replica_that_is_down_which_catches_up_on_return(
    tmp_path: Path,
) -> None:
    up = {"a": True, "b": False}
    calls, handler = servers_with_health(up)

    async def go() -> None:
        async with client_over(handler, health_interval=0.05) as (client, urls), client:
            watcher = PolicyWatcher(client, tmp_path, poll_interval=0.01)
            await watcher.start()
            publish(tmp_path, 1)
            assert await asyncio.wait_for(watcher.wait_for(1), 5) >= 0  # not failed on b
            assert "a/update_weights" in calls and "b/update_weights" not in calls
            up["b"] = True  # b is back: brought to step 1 before it serves again
            for _ in range(100):
                if client.pool.servers[urls["b"]].healthy:
                    break
                await asyncio.sleep(0.05)
            assert client.pool.servers[urls["b"]].healthy and "b/update_weights" in calls
            assert await client.weights.versions() == {urls["a"]: 1, urls["b"]: 1}
            await watcher.stop()

    asyncio.run(go())


def test_with_its_only_replica_down_an_update_waits_for_it(tmp_path: Path) -> None:
    up = {"a": False}
    calls, handler = servers_with_health(up)

    async def go() -> None:
        watched = client_over(handler, ("a",), recovery_timeout=10.0, health_interval=0.05)
        async with watched as (client, urls), client:
            client.pool.mark_down(client.pool.servers[urls["a"]], "test")
            watcher = PolicyWatcher(client, tmp_path, poll_interval=0.01)
            await watcher.start()
            publish(tmp_path, 1)
            waiting = asyncio.create_task(watcher.wait_for(1))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            up["a"] = True
            await asyncio.wait_for(waiting, 5)
            assert await client.weights.versions() == {urls["a"]: 1}
            await watcher.stop()

    asyncio.run(go())


def test_an_update_that_skipped_a_server_back_in_rotation_since_is_tried_again(tmp_path: Path) -> None:
    """Both replicas were out of rotation at the fan-out; one is back by the health check that follows and
    catches up to this very step: the update counts as done, not failed, and is not sent to it again."""
    up = {"a": False, "b": True}
    calls, handler = servers_with_health(up)

    async def go() -> None:
        async with client_over(handler, recovery_timeout=10.0, health_interval=30.0) as (client, urls):
            for url in urls.values():
                client.pool.mark_down(client.pool.servers[url], "test")
            watcher = PolicyWatcher(client, tmp_path, poll_interval=0.01)
            publish(tmp_path, 1)
            await watcher.check_once()
            assert watcher.version == 1 and calls.count("b/update_weights") == 1
            assert (await client.weights.versions())[urls["b"]] == 1

    asyncio.run(go())


def test_each_trained_sample_names_its_rollout_on_whichever_rank_it_lands() -> None:
    from tidal.orchestrator.batching import make_train_batches, make_train_samples
    from tidal.rollout.sampler import rollout_id
    from tidal.types import Group, Rollout

    def one(position: int, index: int, length: int, failed: bool = False) -> Rollout:
        made = Rollout([1, 2], [3] * length, [-1.0] * length, [1] * length, float(index), 0, 0, "e", "t")
        made.failed, made.rollout_id = failed, rollout_id(position, index)
        return made

    groups = [
        Group("t", "e", [one(p, i, 2 + i + p, failed=(p, i) == (5, 1)) for i in range(3)]) for p in (4, 5)
    ]
    batches = make_train_batches(7, make_train_samples(groups), 2, seq_len=32, micro_batch_size=1, pad_id=0)
    ids = [i for batch in batches for micro in batch.micro_batches for i in micro.rollout_ids]
    assert sorted(ids) == ["4/0", "4/1", "4/2", "5/0", "5/2"]  # the failed 5/1 is not trained
    for batch in batches:
        for micro in batch.micro_batches:
            assert len(micro.rollout_ids) == micro.num_samples


def test_an_update_while_every_server_is_out_of_rotation_is_what_they_load_on_return(tmp_path: Path) -> None:
    """The trainer goes on publishing while no replica is up (async level > 0): a returning replica must load
    the newest weights, not the last ones a server took (pruned from disk by then: its catch-up would fail
    for ever, and the run wait for ever)."""
    up = {"a": False}
    calls, handler = servers_with_health(up)

    async def go() -> None:
        async with client_over(handler, ("a",), health_interval=30.0) as (client, urls):
            client.pool.mark_down(client.pool.servers[urls["a"]], "test")
            report = await client.weights.load_step("/run/weights/step_9", 9)
            assert not report.servers[0].ok
            up["a"] = True
            assert await client.pool.check_health() == {urls["a"]: True}
            assert await client.weights.versions() == {urls["a"]: 9}

    asyncio.run(go())


def test_a_lora_policy_update_goes_on_without_a_replica_that_is_down(tmp_path: Path) -> None:
    up = {"a": True, "b": False}
    calls, handler = servers_with_health(up)
    adapter = tmp_path / "weights" / "step_1"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text("{}")
    (adapter / ".complete").touch()

    async def go() -> None:
        async with client_over(handler, health_interval=30.0, recovery_timeout=10.0) as (client, urls):
            client.pool.mark_down(client.pool.servers[urls["b"]], "test")
            watcher = PolicyWatcher(client, tmp_path)
            await asyncio.wait_for(watcher.check_once(), 5)
            assert watcher.version == 1 and calls.count("a/v1/load_lora_adapter") == 1
            assert "b/v1/load_lora_adapter" not in calls and client.weights.loaded_adapters() == [
                "policy-step-1"
            ]

    asyncio.run(go())


def test_a_replica_that_died_during_the_update_comes_back_to_that_step(tmp_path: Path) -> None:
    """The last replica in rotation dies as the update to step 2 reaches it (it was asked, and failed) and
    step 1 is pruned meanwhile: it must come back on step 2, not be stuck replaying the missing step 1."""
    up, versions = {"a": True}, dict[str, str]()
    calls, handler = servers_with_health(up, versions)
    pauses: list[str] = []

    def dying(request: Seen) -> web.Response:
        if request.path == "/pause":
            pauses.append(request.server)
            if len(pauses) == 2:
                up["a"] = False  # dies as the second update starts
        if request.path == "/update_weights" and not Path(request.json()["update_info"]["path"]).exists():
            return reply(400, {"error": "no such directory"})
        return handler(request)  # type: ignore[operator]

    async def go() -> None:
        watched = client_over(dying, ("a",), recovery_timeout=10.0, health_interval=0.05)
        async with watched as (client, urls), client:
            watcher = PolicyWatcher(client, tmp_path)
            first = publish(tmp_path, 1)
            await watcher.check_once()
            publish(tmp_path, 2)
            updating = asyncio.create_task(watcher.check_once())
            await asyncio.sleep(0.5)
            assert not updating.done() and not client.pool.servers[urls["a"]].healthy
            shutil.rmtree(first)  # the trainer's publisher keeps the newest few
            versions.clear()  # restarted: it serves the base model
            up["a"] = True
            await asyncio.wait_for(updating, 5)
            assert watcher.version == 2 and await client.weights.versions() == {urls["a"]: 2}

    asyncio.run(go())

"""How many groups and requests the orchestrator keeps in flight: the launch rule (pure) and a step of a
two-turn environment against a simulated server whose requests take time, with refills of dropped groups
and a weight update in the middle of the step.

Before `tidal.orchestrator.inflight`, a step started only the groups it still lacked and cancelled the rest
at its end: the server ran dry over the step's tail and nothing ran between steps. These tests pin that down.
"""

import asyncio
import json
import math
import time
from pathlib import Path

import pytest

from tidal.config.rl import OrchestratorConfig
from tidal.envs.base import Episode, Task
from tidal.envs.multiturn import MultiTurnEnv
from tidal.inference.types import GenerateRequest, Generation
from tidal.models.tiny import build_tokenizer
from tidal.orchestrator.inflight import KeepRate, LaunchRule
from tidal.orchestrator.loop import Orchestrator
from tidal.orchestrator.policy import PolicyWatcher

from .test_orchestrator_loop import FakeClient

RULE = LaunchRule(num_prompts=8, max_in_flight=32, max_async_level=1, limit=32)


def test_synchronous_runs_start_only_what_the_step_lacks():
    sync = LaunchRule(num_prompts=8, max_in_flight=32, max_async_level=0, limit=32)
    assert sync.room(step=3, version=3, kept=0, in_flight=0, drawn=0) == 8
    assert sync.room(step=3, version=3, kept=5, in_flight=2, drawn=7) == 1
    assert sync.room(step=3, version=3, kept=5, in_flight=2, drawn=32) == 0  # the step's refills are spent
    assert not sync.may_carry(launched=3, next_step=4)


def test_groups_for_the_next_steps_start_as_far_as_the_policy_allows():
    # at step 3 under policy 2 (the trainer still on batch 2): only step 3's own groups
    assert RULE.room(step=3, version=2, kept=0, in_flight=0, drawn=0) == 8
    # policy 3 arrives mid-step: a group started now may train step 4 too, so a whole step more may start
    assert RULE.steps_ahead(step=3, version=3) == 1
    assert RULE.room(step=3, version=3, kept=6, in_flight=2, drawn=8) == 8
    # in flight counts against the demand whichever step it will train
    assert RULE.room(step=3, version=3, kept=6, in_flight=10, drawn=16) == 0
    assert RULE.room(step=3, version=3, kept=0, in_flight=0, drawn=0) == 16
    # never past max_in_flight
    wide = LaunchRule(num_prompts=8, max_in_flight=5, max_async_level=4, limit=32)
    assert wide.room(step=0, version=0, kept=0, in_flight=3, drawn=3) == 2
    # a group started under policy 2 may train step 3 at level 1, not step 4
    assert RULE.may_carry(launched=2, next_step=3) and not RULE.may_carry(launched=2, next_step=4)
    # max_off_policy_steps = 2: it still carries into step 4, though nothing starts further ahead for it
    patient = LaunchRule(num_prompts=8, max_in_flight=32, max_async_level=1, limit=32, max_off_policy_steps=2)
    assert patient.may_carry(launched=2, next_step=4) and not patient.may_carry(launched=2, next_step=5)
    assert patient.steps_ahead(step=3, version=3) == RULE.steps_ahead(step=3, version=3) == 1


def test_unset_max_in_flight_lets_the_async_bound_decide():
    # issue 34's config: 32 prompts, level 1, 4 in 5 groups kept; policy v arrived at the start of step v, so
    # the step's own groups and the next step's may run: 80 groups, where the former default cap of 64
    # held 16 of the next step's back until this step's groups ended
    uncapped = LaunchRule(num_prompts=32, max_in_flight=None, max_async_level=1, limit=64)
    assert uncapped.room(step=5, version=5, kept=0, in_flight=0, drawn=0, keep_rate=0.8) == 80
    capped = LaunchRule(num_prompts=32, max_in_flight=64, max_async_level=1, limit=64)
    assert capped.room(step=5, version=5, kept=0, in_flight=0, drawn=0, keep_rate=0.8) == 64
    # the demand still bounds it: nothing more once the groups the bound allows are running
    assert uncapped.room(step=5, version=5, kept=0, in_flight=80, drawn=80, keep_rate=0.8) == 0
    # at the keep rate's floor it would ask for 4x (256): the step's draw budget (limit, plus a step ahead) binds
    assert uncapped.room(step=5, version=5, kept=0, in_flight=0, drawn=0, keep_rate=KeepRate().floor) == 96


def test_nothing_starts_for_a_step_past_the_last():
    ending = LaunchRule(num_prompts=8, max_in_flight=32, max_async_level=2, limit=32, last_step=4)
    assert ending.steps_ahead(step=3, version=3) == 1  # step 4 is the last: not 2 ahead
    assert ending.room(step=4, version=4, kept=0, in_flight=0, drawn=0) == 8  # the last step's own only
    assert ending.room(step=4, version=4, kept=6, in_flight=2, drawn=8) == 0


def test_groups_a_step_will_drop_are_started_with_it_at_the_recent_keep_rate():
    # 8 groups wanted and 3 in 4 kept lately: 11 start at once, not 8 and then a refill after each drop
    assert RULE.room(step=3, version=2, kept=0, in_flight=0, drawn=0, keep_rate=0.75) == 11
    # running and waiting groups count at their expected yield: 2 more wanted, 2 pending -> 1 more
    assert RULE.room(step=3, version=2, kept=6, in_flight=1, drawn=9, waiting=1, keep_rate=0.75) == 1
    # the rate also covers the look-ahead, and the refill budget still bounds the draws
    assert RULE.room(step=3, version=3, kept=0, in_flight=0, drawn=0, keep_rate=0.5) == 32
    assert RULE.room(step=3, version=3, kept=0, in_flight=0, drawn=40, keep_rate=0.5) == 0


def test_the_keep_rate_is_the_recent_steps_share_bounded_below():
    rate = KeepRate(window=2, floor=0.25)
    assert rate.value == 1.0  # nothing seen: as before
    rate.observe(kept=8, taken=12)
    assert rate.value == 8 / 12
    rate.observe(kept=8, taken=8)
    rate.observe(kept=8, taken=16)  # the first step leaves the window
    assert rate.value == 16 / 24
    rate.observe(kept=0, taken=0)  # a step that took nothing says nothing
    assert rate.value == 16 / 24
    rate.observe(kept=1, taken=40)
    rate.observe(kept=0, taken=40)
    assert rate.value == 0.25


def test_every_group_dropped_still_ends_the_step_after_the_refill_budget_and_look_ahead():
    drawn, in_flight = 0, 0
    for _ in range(1000):  # each round: start what the rule allows, then every group ends, dropped
        started = RULE.room(step=3, version=3, kept=0, in_flight=in_flight, drawn=drawn)
        if started == 0:
            break
        drawn += started
    assert drawn == RULE.limit + RULE.num_prompts  # own refills plus one step ahead, then nothing


class SimulatedServer(FakeClient):
    """The fake client's answers after a delay of 20-60 ms (by the request's seed), counting the requests in
    flight at every change."""

    def __init__(self) -> None:
        super().__init__()
        self.in_flight = 0
        self.trace: list[tuple[float, int]] = []
        self.started = time.perf_counter()

    async def generate(self, request: GenerateRequest, session_id: str | None = None) -> Generation:
        self._count(+1)
        try:
            await asyncio.sleep(0.02 + 0.001 * ((request.sampling.seed or 0) % 40))
        finally:
            self._count(-1)
        return await super().generate(request, session_id)

    def _count(self, change: int) -> None:
        self.in_flight += change
        self.trace.append((time.perf_counter() - self.started, self.in_flight))


class TwoTurns(MultiTurnEnv):
    """Two model turns per episode; every third task is zero-signal (one reward for all), so it is refilled."""

    name = "two_turns"
    max_turns = 2

    def __init__(self) -> None:
        super().__init__(rewards=[(self.reward, 1.0)])
        self._samples: dict[str, int] = {}

    def num_tasks(self) -> int:
        return 10_000

    def task(self, index: int) -> Task:
        return Task(task_id=f"t/{index}", messages=[{"role": "user", "content": "hi"}])

    async def env_response(self, task: Task, episode: Episode) -> list[dict] | None:
        return [{"role": "user", "content": "again"}]

    def reward(self, task: Task, episode: Episode) -> float:
        sample = self._samples.get(task.task_id, 0)
        self._samples[task.task_id] = sample + 1
        return 0.0 if int(task.task_id.split("/")[1]) % 3 == 0 else float(sample % 2)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


def orchestrator(tmp_path: Path, tokenizer_dir: Path, max_async_level: int) -> Orchestrator:
    config = OrchestratorConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "model": {"name": str(tokenizer_dir)},
            "max_async_level": max_async_level,
            "batch": {"num_prompts": 8, "group_size": 4, "seq_len": 128},
            "client": {"max_in_flight": 32},
            "transport": {"type": "filesystem", "keep_last": max_async_level + 1},
        }
    )
    orch = Orchestrator(config)
    orch.env = TwoTurns()
    return orch


async def publish(policy: PolicyWatcher, server: SimulatedServer, version: int) -> None:
    """What the watcher does once inference loaded new weights."""
    server.version = version
    async with policy._changed:
        policy.version = version
        policy._changed.notify_all()


def run_two_steps(orch: Orchestrator, update_after: float) -> tuple[SimulatedServer, list[int], list[list]]:
    """Steps 0 and 1 back to back, the policy moving to 1 `update_after` seconds into step 0, or before
    step 1 where that step needs it. Returns the server, the requests in flight just after each step, and
    the groups each step trained."""
    server = SimulatedServer()

    async def main() -> tuple[list[int], list[list]]:
        policy = PolicyWatcher(server, orch.out)  # type: ignore[arg-type]
        update = asyncio.get_running_loop().call_later(
            update_after, lambda: asyncio.ensure_future(publish(policy, server, 1))
        )
        carried, trained = [], []
        try:
            for step in (0, 1):
                needed = step - orch.config.max_async_level
                if (
                    policy.version < needed
                ):  # what `_one_step` waits for: the trainer's weights of step - level
                    await publish(policy, server, needed)
                groups, _, _ = await orch._collect(server, policy, step)  # type: ignore[arg-type]
                trained.append(groups)
                await asyncio.sleep(0.005)  # cancelled requests end now; carried ones take 20 ms or more
                carried.append(server.in_flight)
        finally:
            update.cancel()
            orch.pool.cancel_all()
        return carried, trained

    carried, trained = asyncio.run(asyncio.wait_for(main(), timeout=30))
    return server, carried, trained


def test_after_a_weight_update_the_next_steps_groups_run_through_the_tail_and_carry_over(
    tmp_path, tokenizer_dir
):
    orch = orchestrator(tmp_path, tokenizer_dir, max_async_level=1)
    server, carried, trained = run_two_steps(orch, update_after=0.03)
    assert [len(groups) for groups in trained] == [8, 8]
    # groups started ahead were still running when step 0 had its 8: carried into step 1, not cancelled
    assert carried[0] > 0
    assert orch.state.requeued == []
    # the server never ran dry between the update and the end of step 1: more than one group's requests
    # (group_size = 4) stayed in flight up to the last stretch
    step_end = max(t for t, _ in server.trace)
    update_seen = next(t for t, _ in server.trace if t >= 0.03)
    window = [n for t, n in server.trace if update_seen <= t <= step_end * 0.8]
    assert window and min(window) > 4, window
    # whatever ran ahead trained within the bound: step 1 trains groups of policy ≥ 0 and its own
    assert all(g.rollouts[0].policy_version >= 0 for g in trained[1])


def test_synchronous_runs_run_nothing_ahead_and_requeue_what_a_step_did_not_need(tmp_path, tokenizer_dir):
    orch = orchestrator(tmp_path, tokenizer_dir, max_async_level=0)
    server, carried, trained = run_two_steps(orch, update_after=10.0)  # step 1 starts once policy 1 serves
    assert carried == [0, 0]
    assert [len(groups) for groups in trained] == [8, 8]
    # one step's groups at most (each of 4 requests), with the refills the keep rate expects
    assert max(n for _, n in server.trace) <= math.ceil(8 / orch.keep_rate.value) * 4
    assert orch.keep_rate.value < 1  # every third group had no signal


def test_a_state_saved_while_groups_run_ahead_starts_them_again_on_resume(tmp_path, tokenizer_dir):
    orch = orchestrator(tmp_path, tokenizer_dir, max_async_level=1)
    running: list[int] = []

    async def main() -> None:
        server = SimulatedServer()
        policy = PolicyWatcher(server, orch.out)  # type: ignore[arg-type]
        await publish(policy, server, 1)  # the next step's groups may start at once
        await orch._collect(server, policy, 1)  # type: ignore[arg-type]
        running.extend(orch.pool.positions())
        orch.state.step = 2
        orch._save_state()
        orch.pool.cancel_all()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert running  # groups for step 2 were in flight at the save
    saved = json.loads((orch.state_dir / "step_2.json").read_text())
    assert saved["requeued"][: len(running)] == running
    assert orch.state.requeued == []  # the live run does not start them twice


class LongAndShort(TwoTurns):
    """Even tasks take four model turns, odd ones one; every group has a learning signal."""

    max_turns = 4

    async def env_response(self, task: Task, episode: Episode) -> list[dict] | None:
        long = int(task.task_id.split("/")[1]) % 2 == 0
        return [{"role": "user", "content": "again"}] if long else None

    def reward(self, task: Task, episode: Episode) -> float:
        sample = self._samples.get(task.task_id, 0)
        self._samples[task.task_id] = sample + 1
        return float(sample % 2)


def test_a_step_trains_the_groups_it_started_first_not_the_ones_that_ended_first(tmp_path, tokenizer_dir):
    """Short episodes started for the next step end before the long ones of this step: the step still
    trains its own (start order), and the next step the ones after them."""
    orch = orchestrator(tmp_path, tokenizer_dir, max_async_level=1)
    orch.env = LongAndShort()
    _, _, trained = run_two_steps(orch, update_after=0.0)
    assert [g.task_id for g in trained[0]] == [f"t/{i}" for i in range(8)]
    assert [g.task_id for g in trained[1]] == [f"t/{i}" for i in range(8, 16)]


def test_a_step_starts_the_refills_it_will_need_before_its_first_group_ends(tmp_path, tokenizer_dir):
    """Every third task is zero-signal: after a step has shown that, the next starts its expected refills at
    once instead of one group's latency after each drop (before, the server then held 8 groups, 32
    requests, and ran a few refills through two more turns on their own)."""
    orch = orchestrator(tmp_path, tokenizer_dir, max_async_level=0)
    server = SimulatedServer()
    peaks: list[int] = []

    async def main() -> None:
        policy = PolicyWatcher(server, orch.out)  # type: ignore[arg-type]
        for step in (0, 1):
            await publish(policy, server, step)
            first = len(server.trace)
            groups, _, _ = await orch._collect(server, policy, step)  # type: ignore[arg-type]
            assert len(groups) == 8
            peaks.append(max(n for _, n in server.trace[first:]))
        orch.pool.cancel_all()

    asyncio.run(asyncio.wait_for(main(), timeout=30))
    assert peaks[0] == 8 * 4  # nothing known yet: the step's own 8 groups
    assert 0.6 <= orch.keep_rate.value < 0.8
    assert peaks[1] >= 11 * 4, peaks  # ceil(8 / keep rate) groups of 4 requests at once

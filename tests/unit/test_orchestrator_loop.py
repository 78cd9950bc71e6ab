"""The orchestrator's step loop on fakes: a fake inference client and small environments, no processes.

The client answers every request with the same completion; the environments decide the rewards, so a test
can make every group zero-signal, failing or NaN and watch what the loop does with it.
"""

import asyncio
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from tidal.config.rl import CurriculumConfig, OrchestratorConfig
from tidal.envs.base import Episode, SingleTurnEnv, Task
from tidal.envs.multiturn import MultiTurnEnv
from tidal.errors import UserError
from tidal.inference.types import Completion, GenerateRequest, Generation
from tidal.models.tiny import build_tokenizer
from tidal.orchestrator.curriculum import Curriculum
from tidal.orchestrator.loop import Orchestrator
from tidal.orchestrator.policy import PolicyWatcher


class FakeClient:
    """Answers each request with `n` copies of one completion, from policy `version`."""

    def __init__(self, version: int = 0):
        self.version = version
        self.num_requests = 0
        self.generation = self  # the orchestrator's rollouts use InferenceClient.generation

    async def generate(self, request: GenerateRequest, session_id: str | None = None) -> Generation:
        self.num_requests += 1
        done = Completion(token_ids=(5, 6), logprobs=(-0.5, -0.5), text="ab", finish_reason="stop")
        return Generation(
            prompt_token_ids=request.prompt_token_ids,
            completions=(done,) * request.n,
            server="fake",
            weight_version=self.version,
        )

    def end_session(self, session_id: str) -> None:
        pass

    async def context_limit(self) -> int | None:
        return None


class ScriptedEnv(SingleTurnEnv):
    """Tasks 0..n-1; the reward of a rollout is `reward(task index, sample index)` (or raises)."""

    name = "scripted"

    def __init__(self, reward):
        self._reward = reward
        self._count: dict[str, int] = {}
        super().__init__(rewards=[(self.scripted_reward, 1.0)])

    def num_tasks(self) -> int:
        return 1000

    def task(self, index: int) -> Task:
        return Task(task_id=f"scripted/{index}", messages=[{"role": "user", "content": "hi"}])

    def scripted_reward(self, task: Task, episode: Episode) -> float:
        sample = self._count.get(task.task_id, 0)
        self._count[task.task_id] = sample + 1
        return self._reward(int(task.task_id.split("/")[1]), sample)


class RenderFails(ScriptedEnv):
    """Fails before any model call (the prompt cannot be rendered)."""

    async def rollout_group(self, task, sampler, n):
        raise KeyError("no chat template for this message")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer().save_pretrained(path)
    return path


def orchestrator(tmp_path: Path, tokenizer_dir: Path, env, **batch) -> Orchestrator:
    """Synchronous (max_async_level 0): a step draws only its own tasks, as these tests count them; groups
    started ahead for later steps are tests/unit/test_inflight.py's."""
    config = OrchestratorConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "model": {"name": str(tokenizer_dir)},
            "max_async_level": 0,
            "batch": {"num_prompts": 4, "group_size": 2, "seq_len": 64, **batch},
            "client": {"max_in_flight": 4},
        }
    )
    orch = Orchestrator(config)
    orch.env = env
    return orch


def collect(orch: Orchestrator, client: FakeClient, step: int = 0):
    policy = PolicyWatcher(client, orch.out)  # type: ignore[arg-type]  # not started: serves version 0
    return asyncio.run(asyncio.wait_for(orch._collect(client, policy, step), timeout=10))


def test_all_zero_signal_stops_with_a_one_line_error_instead_of_refilling_forever(tmp_path, tokenizer_dir):
    orch = orchestrator(tmp_path, tokenizer_dir, ScriptedEnv(lambda task, sample: 0.0), max_tasks_factor=3)
    client = FakeClient()
    with pytest.raises(UserError) as info:
        collect(orch, client, step=3)
    message = str(info.value)
    assert "\n" not in message and "step 3" in message and "zero-signal" in message
    assert "max_tasks_factor" in message
    assert client.num_requests == 12  # 3 × num_prompts tasks drawn, then it stopped


def test_all_failed_names_the_failure_causes(tmp_path, tokenizer_dir):
    def raises(task: int, sample: int) -> float:
        raise TimeoutError("slow judge")

    orch = orchestrator(tmp_path, tokenizer_dir, ScriptedEnv(raises), max_tasks_factor=2)
    with pytest.raises(UserError) as info:
        collect(orch, FakeClient(), step=3)
    assert str(info.value).startswith("all 16 rollouts of step 3 failed: TimeoutError × 16")


def test_a_few_groups_with_signal_are_trained_on_when_the_limit_is_reached(tmp_path, tokenizer_dir, capsys):
    # only tasks 0 and 5 have signal: sample 0 earns 1, sample 1 earns 0
    orch = orchestrator(
        tmp_path,
        tokenizer_dir,
        ScriptedEnv(lambda task, sample: float(task in (0, 5) and sample == 0)),
        max_tasks_factor=2,
    )
    groups, advantages, stats = collect(orch, FakeClient())
    assert sorted(g.task_id for g in groups) == ["scripted/0", "scripted/5"]
    assert advantages == [[0.5, -0.5], [0.5, -0.5]]
    assert stats.num_groups_run == 8 and stats.num_zero_signal == 6
    assert "only 2 of 4 groups" in capsys.readouterr().out


def test_a_rollout_that_fails_before_any_model_call_counts_as_failed_not_stale(tmp_path, tokenizer_dir):
    orch = orchestrator(tmp_path, tokenizer_dir, RenderFails(lambda task, sample: 1.0), max_tasks_factor=1)
    orch.tracker.max_async_level = 0
    with pytest.raises(UserError) as info:
        collect(orch, FakeClient(version=5), step=5)  # policy 5 serves step 5: nothing can be stale
    assert str(info.value).startswith("all 8 rollouts of step 5 failed: KeyError × 8")
    assert orch.tracker.num_dropped_rollouts == 0


def test_nan_reward_fails_the_rollout_and_metrics_stay_finite(tmp_path, tokenizer_dir, caplog):
    # task 0's second sample is NaN; every other group has signal
    def reward(task: int, sample: int) -> float:
        return math.nan if (task, sample) == (0, 1) else float(sample == 0)

    orch = orchestrator(tmp_path, tokenizer_dir, ScriptedEnv(reward))
    groups, _, stats = collect(orch, FakeClient())
    assert stats.num_failed_rollouts == 1
    assert all(math.isfinite(r.reward) for g in groups for r in g.rollouts)
    assert "scripted" in caplog.text and "scripted_reward" in caplog.text and "nan" in caplog.text
    metrics = logged_metrics(orch, 0, groups, stats)
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def test_the_orchestrator_tokenizer_falls_back_to_eos_for_padding(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    tokenizer.save_pretrained(tmp_path / "tok")
    config = OrchestratorConfig(output_dir=tmp_path / "run", model={"name": str(tmp_path / "tok")})
    loaded = Orchestrator(config).tokenizer
    assert loaded.pad_token_id is not None and loaded.pad_token_id == loaded.eos_token_id


def logged_metrics(orch: Orchestrator, step: int, groups, stats) -> dict:
    client = SimpleNamespace(weights=SimpleNamespace(phase_seconds={}))  # no update has run yet
    orch._log(step, groups, stats, PolicyWatcher(client, orch.out), 1.0, 0.0, {})  # type: ignore[arg-type]
    orch.metrics.close()
    lines = (orch.out / "orchestrator" / "metrics.jsonl").read_text().splitlines()
    return json.loads(lines[-1])


def test_env_reward_mean_and_batch_reward_mean_both_leave_failed_rollouts_out(tmp_path, tokenizer_dir):
    def reward(task: int, sample: int) -> float:
        if sample == 3:
            raise RuntimeError("judge down")
        return float(sample != 1)

    orch = orchestrator(tmp_path, tokenizer_dir, ScriptedEnv(reward), group_size=4)
    groups, _, stats = collect(orch, FakeClient())
    metrics = logged_metrics(orch, 0, groups, stats)
    assert metrics["reward/mean"] == pytest.approx(2 / 3)
    assert metrics["env/scripted/reward/mean"] == pytest.approx(2 / 3)  # failed rollouts are not zeros
    assert metrics["env/scripted/rollouts/failed_frac"] == 0.25 and metrics["rollouts/failed_frac"] == 0.25


def test_the_headline_reward_counts_the_dropped_zero_signal_groups_and_the_batch_mean_does_not(
    tmp_path, tokenizer_dir
):
    # tasks 0 and 5 have signal (1 and 0); the other six groups earn 0 twice and are dropped
    orch = orchestrator(
        tmp_path,
        tokenizer_dir,
        ScriptedEnv(lambda task, sample: float(task in (0, 5) and sample == 0)),
        max_tasks_factor=2,
    )
    groups, _, stats = collect(orch, FakeClient())
    metrics = logged_metrics(orch, 0, groups, stats)
    assert metrics["reward/batch_mean"] == pytest.approx(2 / 4)  # the two kept groups
    assert metrics["reward/mean"] == pytest.approx(2 / 16)  # every rollout run: 8 groups of 2
    assert metrics["reward/mean"] == metrics["env/scripted/reward/mean"]


def test_online_eval_by_default_evaluates_the_environment_the_run_trains_on(tmp_path, tokenizer_dir):
    config = OrchestratorConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "model": {"name": str(tokenizer_dir)},
            "env": [{"name": "wordle", "kwargs": {"num_examples": 100}}],
            "online_eval": {"interval": 10, "num_tasks": 2},
            "sampling": {"max_tokens": 8},
        }
    )
    metrics = asyncio.run(Orchestrator(config)._online_eval(FakeClient(), step=0, version=0))
    assert metrics["eval/wordle/num_tasks"] == 2 and "eval/wordle/avg@1" in metrics
    assert not any("reverse_text" in key for key in metrics)


def test_a_reward_that_holds_the_event_loop_shows_in_the_lag_metrics_and_a_warning(
    tmp_path, tokenizer_dir, capsys
):
    import time

    from tidal.orchestrator.lag import lag_metrics, percentile

    assert percentile([0.3, 0.1, 0.2, 0.4], 50) == 0.2 and percentile([0.3, 0.1, 0.2, 0.4], 99) == 0.4
    assert math.isnan(percentile([], 50)) and lag_metrics([]) == {}

    def blocking(task: int, sample: int) -> float:
        if task == 0 and sample == 0:
            time.sleep(0.4)  # a CPU-heavy reward run on the loop holds every request behind it
        return float(sample)

    orch = orchestrator(tmp_path, tokenizer_dir, ScriptedEnv(blocking))
    orch.config = orch.config.model_copy(update={"loop_lag_warn": 0.3})

    async def step() -> tuple[list, list, object]:
        orch.lag.start()
        await asyncio.sleep(0.2)  # some samples of an idle loop first
        try:
            client = FakeClient()
            return await orch._collect(client, PolicyWatcher(client, tmp_path), 0)  # type: ignore[arg-type]
        finally:
            await orch.lag.stop()

    groups, _, stats = asyncio.run(asyncio.wait_for(step(), timeout=10))
    samples = orch.lag.take()
    orch.lag._samples = samples  # _log takes them again
    assert max(samples) >= 0.3, samples
    assert percentile(samples, 50) < 0.3, samples  # most wake-ups were on time
    policy = SimpleNamespace(version=0, update_seconds=0.0, num_updates=0, phase_seconds={})
    orch._log(0, groups, stats, policy, elapsed=1.0, waited=0.0, extra={})  # type: ignore[arg-type]
    logged = [
        json.loads(line) for line in (tmp_path / "orchestrator" / "metrics.jsonl").read_text().splitlines()
    ]
    assert logged[-1]["event_loop/lag_max_s"] >= 0.3
    assert "step 0: the event loop was held" in capsys.readouterr().out


def test_the_lag_monitor_times_gc_pauses_while_it_runs_and_not_after():
    import gc

    from tidal.orchestrator.lag import LoopLagMonitor

    monitor = LoopLagMonitor()

    async def collect_twice() -> dict[str, float]:
        monitor.start()
        for _ in range(2):
            garbage: list = [[] for _ in range(200_000)]
            for i in range(len(garbage) - 1):
                garbage[i].append(garbage[i + 1])  # a chain that only the collector frees
            garbage[-1].append(garbage)
            del garbage
            gc.collect()
        await monitor.stop()
        return monitor.take_gc()

    seen = asyncio.run(collect_twice())
    assert 0 < seen["event_loop/gc_max_s"] < seen["event_loop/gc_s"], seen  # two pauses, the longest < sum
    gc.collect()  # after stop(): not counted
    assert monitor.take_gc() == {"event_loop/gc_s": 0.0, "event_loop/gc_max_s": 0.0}


def test_rollouts_longer_than_seq_len_warn_and_stop_the_run_only_when_none_is_left(
    tmp_path, tokenizer_dir, capsys
):
    orch = orchestrator(tmp_path, tokenizer_dir, ScriptedEnv(lambda task, sample: 0.0), seq_len=8)
    orch._warn_too_long(3, dropped=0, kept=5)
    assert capsys.readouterr().out == ""
    orch._warn_too_long(3, dropped=2, kept=5)
    out = capsys.readouterr().out
    assert "step 3: dropped 2 rollout(s) longer than orchestrator.batch.seq_len (8 tokens" in out
    with pytest.raises(UserError, match="step 4: every rollout is longer than orchestrator.batch.seq_len"):
        orch._warn_too_long(4, dropped=6, kept=0)


def test_online_eval_rollouts_are_kept_for_the_first_and_final_eval_by_default(tmp_path):
    from tidal.eval.runner import RolloutRecord, write_rollouts
    from tidal.orchestrator.loop import keeps_rollouts

    assert keeps_rollouts("first_and_final", 0, False) and keeps_rollouts("first_and_final", 30, True)
    assert not keeps_rollouts("first_and_final", 10, False)
    assert keeps_rollouts("all", 10, False) and not keeps_rollouts("none", 0, False)
    path = tmp_path / "orchestrator" / "online_eval_rollouts" / "step_0.jsonl"
    records = [
        RolloutRecord("math", "math/3", 3, 0, reward=1.0, messages=[{"role": "assistant", "content": "7"}])
    ]
    write_rollouts(path, records)
    [line] = path.read_text().splitlines()
    assert json.loads(line)["task_id"] == "math/3" and json.loads(line)["messages"][0]["content"] == "7"


class TwoTurns(MultiTurnEnv):
    """Two model turns an episode (the environment answers the first once); every rollout scores 1."""

    name = "two_turns"
    max_turns = 2

    def __init__(self):
        super().__init__(rewards=[(lambda task, episode: 1.0, 1.0)])

    def num_tasks(self) -> int:
        return 1000

    def task(self, index: int) -> Task:
        return Task(task_id=f"two_turns/{index}", messages=[{"role": "user", "content": f"task {index}"}])

    async def env_response(self, task, episode):
        return [{"role": "user", "content": "and again"}]


class UpdatedAfterFirstCall(FakeClient):
    """Serves version 1 for its first request, then version 2: the first episode spans an update."""

    async def generate(self, request: GenerateRequest, session_id: str | None = None) -> Generation:
        self.version = 1 if self.num_requests == 0 else 2
        return await super().generate(request, session_id)


@pytest.mark.parametrize("max_off_policy_steps", [None, 2])
def test_an_episode_whose_oldest_turn_is_past_the_bound_is_dropped_and_counted(
    tmp_path, tokenizer_dir, max_off_policy_steps
):
    """Step 3 at max_async_level 1: an episode of the first group had its turns from versions [1, 2]. Its
    oldest token is two versions old, past the exact bound (1): the group is dropped and counted, and the
    step refills. With max_off_policy_steps = 2 it trains."""
    config = OrchestratorConfig.model_validate(
        {
            "output_dir": str(tmp_path),
            "model": {"name": str(tokenizer_dir)},
            "max_async_level": 1,
            "max_off_policy_steps": max_off_policy_steps,
            "batch": {"num_prompts": 2, "group_size": 2, "seq_len": 128, "zero_signal": "keep"},
            "client": {"max_in_flight": 1},  # one group at a time: the first one meets the update
        }
    )
    orch = Orchestrator(config)
    orch.env = TwoTurns()
    client = UpdatedAfterFirstCall()
    policy = PolicyWatcher(client, orch.out)  # type: ignore[arg-type]  # not started
    policy.version = 2  # step 3 may start: 3 − 1 ≤ 2
    groups, _, stats = asyncio.run(asyncio.wait_for(orch._collect(client, policy, 3), timeout=10))
    versions = {g.task_id: sorted(r.policy_versions for r in g.rollouts) for g in groups}
    if max_off_policy_steps is None:  # the whole group goes: its advantages need every member
        assert versions == {"two_turns/1": [[2, 2], [2, 2]], "two_turns/2": [[2, 2], [2, 2]]}
        assert stats.num_stale_rollouts == 2 and orch.tracker.num_dropped_groups == 1
    else:
        assert versions == {"two_turns/0": [[1, 2], [2, 2]], "two_turns/1": [[2, 2], [2, 2]]}
        spanning = min(groups[0].rollouts, key=lambda r: r.policy_version)
        assert (spanning.policy_version, spanning.policy_version_max) == (1, 2)
        assert stats.num_stale_rollouts == 0 and orch.tracker.num_dropped_groups == 0


def test_max_off_policy_steps_below_max_async_level_is_one_line_before_anything_starts(
    tmp_path, tokenizer_dir
):
    from tidal.config.loader import load_config
    from tidal.config.rl import RLConfig
    from tidal.orchestrator.loop import staleness_bound

    with pytest.raises(
        UserError, match=r"orchestrator\.max_off_policy_steps: 1 is below max_async_level \(2\)"
    ):
        load_config(RLConfig, [], [("max_async_level", 2), ("orchestrator.max_off_policy_steps", 1)])
    alone = OrchestratorConfig.model_validate(
        {"model": {"name": str(tokenizer_dir)}, "max_async_level": 2, "max_off_policy_steps": 1}
    )
    with pytest.raises(UserError, match="max_off_policy_steps: 1 is below max_async_level") as info:
        staleness_bound(alone)
    assert info.value.exit_code == 2
    assert staleness_bound(alone.model_copy(update={"max_off_policy_steps": None})) == 2


class EightTasks(ScriptedEnv):
    def num_tasks(self) -> int:
        return 8


def curriculum_orchestrator(
    tmp_path: Path, tokenizer_dir: Path, env, curriculum: dict | None
) -> Orchestrator:
    orch = orchestrator(tmp_path, tokenizer_dir, env)
    if curriculum is not None:
        orch.config = orch.config.model_copy(update={"curriculum": CurriculumConfig(**curriculum)})
        orch.curriculum = Curriculum(orch.config.curriculum, env.num_tasks(), orch.config.seed)
    return orch


@pytest.mark.parametrize("with_curriculum", [False, True])
def test_the_curriculum_stops_drawing_solved_tasks_and_its_state_is_saved_and_restored(
    tmp_path, tokenizer_dir, with_curriculum
):
    """Tasks 0-3 are solved by every sample, 4-7 by every other one. Step 0 learns that (its first four groups
    dropped zero-signal); in step 1 the curriculum draws only tasks with signal, uniform order draws 0-3 again."""
    env = EightTasks(lambda task, sample: 1.0 if task < 4 or sample % 2 == 0 else 0.0)
    setting = {"skip_after": 1} if with_curriculum else None
    orch = curriculum_orchestrator(tmp_path, tokenizer_dir, env, setting)
    client = FakeClient()

    async def two_steps():
        policy = PolicyWatcher(client, orch.out)  # type: ignore[arg-type]  # not started: serves version 0
        steps = []
        for step in (0, 1):
            client.version = step  # each step's rollouts come from its own policy (max_async_level 0)
            steps.append(await orch._collect(client, policy, step))  # type: ignore[arg-type]
        return steps

    (_, _, first), (groups, _, second) = asyncio.run(asyncio.wait_for(two_steps(), timeout=10))
    assert first.num_zero_signal == 4
    assert second.num_zero_signal == (0 if with_curriculum else 4)
    assert second.num_completion_tokens == second.num_groups_run * 2 * 2  # groups × samples × tokens
    metrics = logged_metrics(orch, 1, groups, second)
    assert metrics["rollouts/tokens_per_kept_group"] == second.num_completion_tokens / 4
    if not with_curriculum:
        assert "curriculum/tasks_seen" not in metrics
        return
    assert metrics["curriculum/tasks_seen"] == 8 and metrics["curriculum/tasks_skipped"] == 4
    orch._save_state()
    saved = json.loads((orch.state_dir / "step_0.json").read_text())["curriculum"]
    assert saved == orch.curriculum.state_dict() and len(saved["tasks"]) == 8
    resumed = curriculum_orchestrator(tmp_path / "again", tokenizer_dir, env, setting)
    resumed._load_state(orch.state_dir / "step_0.json")
    assert resumed.curriculum is not None and resumed.curriculum.state_dict() == saved
    assert [resumed.curriculum.pick(p) for p in range(50, 70)] == [
        orch.curriculum.pick(p) for p in range(50, 70)
    ]

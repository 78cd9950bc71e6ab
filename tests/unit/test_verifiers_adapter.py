"""The verifiers adapter with scripted model replies: rewards, metrics, tokens and failures map to tidal."""

import asyncio
from pathlib import Path

import pytest

from tests.unit.test_envs_multiturn import ContextLimitedSampler, ScriptedSampler
from tidal.envs.base import ContextFull, NonFiniteReward, Turn, run_episode
from tidal.envs.registry import load_env
from tidal.errors import UserError

pytest.importorskip("verifiers.v1")

from tidal.envs.verifiers_adapter import VerifiersRolloutFailed, episode_from_turns  # noqa: E402

VF_ENVS = str(Path(__file__).parents[1] / "integration" / "vf_envs")


@pytest.fixture(autouse=True)
def vf_envs_on_path(monkeypatch):
    monkeypatch.syspath_prepend(VF_ENVS)


def test_verifiers_env_rewards_metrics_and_tokens():
    env = load_env("vf:vf_reverse_words", num_examples=3, taskset={"seed": 1})
    assert env.name == "vf:vf_reverse_words" and env.num_tasks() == 3
    task = env.task(0)
    assert task.messages[0] == {"role": "system", "content": "Reverse the text character by character."}
    word = task.messages[1]["content"]
    assert task.answer == word[::-1]  # the taskset's own answer field, kept for rollout records

    async def go():
        try:
            right = ScriptedSampler([word[::-1]])
            wrong = ScriptedSampler(["?"])
            results = await asyncio.gather(run_episode(env, task, right), run_episode(env, task, wrong))
            return results, right
        finally:
            await env.aclose()

    (good, bad), sampler = asyncio.run(go())
    assert good.reward == 1.0 and good.metrics["reward/exact"] == 1.0
    assert good.metrics["vf/reply_chars"] == len(word)
    assert bad.reward == 0.0
    assert good.prompt_ids == sampler.prompts[0]  # rendered with the model's chat template
    assert good.completion_ids == sampler.sampled[0] and all(good.completion_mask)
    assert good.messages[-1] == {"role": "assistant", "content": word[::-1]}


def run_with(env, task, sampler):
    async def go():
        try:
            return await run_episode(env, task, sampler)
        finally:
            await env.aclose()

    return asyncio.run(go())


def test_a_verifiers_episode_that_outgrows_the_context_ends_truncated_and_is_scored():
    env = load_env("vf:vf_follow_ups", num_examples=2)
    task = env.task(0)
    replies = ["one", "two", "three", "four"]
    full_sampler = ScriptedSampler(replies)
    full = run_with(env, task, full_sampler)
    assert full.num_turns == 4 and full.reward == 1.0 and "truncated" not in full.info
    # room for the first two turns' prompts, not the third's
    sampler = ContextLimitedSampler(replies, limit=len(full_sampler.prompts[2]))
    episode = run_with(env, task, sampler)
    assert episode.info["truncated"] is True
    assert episode.num_turns == 2 and len(sampler.prompts) == 2
    assert episode.reward == 0.5  # the environment's own reward on the turns it had
    assert episode.context_ids == sampler.prompts[1] + sampler.sampled[1]
    assert episode.messages[-1] == {"role": "assistant", "content": "two"}


def test_a_verifiers_task_whose_prompt_does_not_fit_fails_its_rollout_with_context_full():
    env = load_env("vf:vf_follow_ups", num_examples=2)
    with pytest.raises(ContextFull, match="vf:vf_follow_ups/0"):
        run_with(env, env.task(0), ContextLimitedSampler(["one"], limit=5))


def test_verifiers_reward_exceptions_fail_the_rollout():
    env = load_env("vf:vf_broken_reward")
    with pytest.raises(VerifiersRolloutFailed, match="reward bug"):
        run_with(env, env.task(0), ScriptedSampler(["hi"]))


def test_episodes_from_turns_need_one_token_sequence():
    first = Turn([1, 2], [3, 4], [-0.1, -0.2], "x")
    second = Turn([1, 2, 3, 4, 9, 9], [5], [-0.3], "y")
    episode = episode_from_turns([first, second], [])
    assert episode.prompt_ids == [1, 2]
    assert episode.completion_ids == [3, 4, 9, 9, 5]
    assert episode.completion_mask == [1, 1, 0, 0, 1]
    assert episode.completion_logprobs == [-0.1, -0.2, 0.0, 0.0, -0.3]
    with pytest.raises(VerifiersRolloutFailed, match="rewrote"):
        episode_from_turns([first, Turn([1, 7], [5], [-0.3], "y")], [])
    with pytest.raises(VerifiersRolloutFailed):
        episode_from_turns([], [])


def test_unknown_verifiers_env_is_a_user_error():
    with pytest.raises(UserError, match="not installed"):
        load_env("vf:no_such_env_here")


def test_verifiers_nan_reward_fails_the_rollout_naming_env_and_reward():
    env = load_env("vf:vf_nan_reward")
    with pytest.raises(
        NonFiniteReward, match="'not_a_number' of environment 'vf:vf_nan_reward' returned nan"
    ):
        run_with(env, env.task(0), ScriptedSampler(["hi"]))

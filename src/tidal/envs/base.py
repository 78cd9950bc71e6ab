"""The environment protocol: tasks in; a rollout (one or more model turns) out, with exact tokens and a reward.

An environment talks to the model only through a `Sampler` (token ids in, sampled ids + logprobs out), so
multi-turn episodes keep the exact tokens of every model turn, and only model tokens are trained on
(`completion_mask`). An environment also owns its group strategy (`rollout_group`: how the n rollouts of
one task are sampled). The caller (`tidal.rollout`) owns the sampler (routing, seeds, policy versions), the
timeout and the failure accounting: an exception or a timeout fails that rollout only.
"""

import functools
import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol

from tidal.envs.chat import message_images, token_ids
from tidal.types import RoutedExperts


@dataclass(frozen=True)
class Task:
    """One prompt to roll out: chat messages plus hidden information the reward needs."""

    task_id: str
    messages: list[dict[str, Any]]
    answer: str = ""
    info: dict[str, Any] = field(default_factory=dict)


@dataclass
class Turn:
    """One sampled model turn: the prompt ids it continued, its ids, their sampling logprobs, its text."""

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str | None = None
    routed_experts: RoutedExperts | None = None
    """The experts an MoE model routed prompt and completion to (all but the last token), when inference
    returned them (routing replay)."""


class ContextFull(Exception):
    """The prompt leaves no room for a single new token in the served model's context: no turn can follow.

    Raised by the sampler before it sends the request; a multi-turn episode ends there (truncated), while a
    first prompt that does not fit fails its rollout."""


class Sampler(Protocol):
    """What an environment uses to query the policy. `tokenizer` renders prompts (HF tokenizer)."""

    tokenizer: Any

    async def complete(self, prompt_ids: list[int], images: Sequence[str] = ()) -> Turn:
        """One sample. `images`: the prompt's pictures in order (data or http URLs), one per image
        placeholder that the chat template wrote into `prompt_ids` (`message_images`)."""
        ...

    async def complete_n(self, prompt_ids: list[int], n: int, images: Sequence[str] = ()) -> list[Turn]:
        """n independent samples of one prompt in one request (one prefill): how single-turn groups run."""
        ...


class GroupSampler(Sampler, Protocol):
    """The sampler of a whole group (`Environment.rollout_group`): one request for all of it, or a fork per
    independent rollout."""

    def fork(self, index: int) -> Sampler:
        """The sampler of the group's `index`-th independent rollout: its own seed and server session."""
        ...


@dataclass
class Episode:
    """A finished rollout. `completion_*` cover every token after the first prompt: model turns (mask 1,
    sampling logprobs) and text the environment inserted between them (mask 0, logprob 0)."""

    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    completion_logprobs: list[float] = field(default_factory=list)
    completion_mask: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation as text (prompt, model turns, environment turns), for evaluation logs."""
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    num_turns: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    """What a multi-turn environment tracked during the rollout (game state, tool calls) for its rewards."""

    images: list[str] = field(default_factory=list)
    """The episode's pictures in order (data or http URLs), one per image placeholder in its ids: the task
    prompt's, then those the environment's later turns added (in its tokens of the completion, mask 0)."""
    routed_experts: RoutedExperts | None = None
    """Routes of the last model turn when it continued exactly this episode's context (they then cover every
    token up to that turn's last one); None otherwise."""

    def add_model_turn(self, turn: Turn) -> None:
        # the turn's routes describe its own prompt + completion: the episode's tokens only when that prompt
        # is exactly the context so far (as tidal.envs.chat.continue_prompt builds it)
        continues = turn.routed_experts is not None and turn.prompt_ids == self.context_ids
        self.completion_ids += turn.completion_ids
        self.completion_logprobs += turn.logprobs
        self.completion_mask += [1] * len(turn.completion_ids)
        self.num_turns += 1
        self.routed_experts = turn.routed_experts if continues else None

    def add_env_tokens(self, ids: list[int]) -> None:
        self.completion_ids += ids
        self.completion_logprobs += [0.0] * len(ids)
        self.completion_mask += [0] * len(ids)

    @property
    def context_ids(self) -> list[int]:
        """Everything the model has seen and said so far."""
        return self.prompt_ids + self.completion_ids

    def summary_metrics(self) -> dict[str, float]:
        """The environment's metrics plus turn count and model-token count, as RL and eval log them."""
        return {
            **self.metrics,
            "num_turns": float(self.num_turns),
            "completion_len": float(sum(self.completion_mask)),
        }


RewardFn = Callable[[Task, Episode], float | Awaitable[float]]
EpisodeWork = Callable[[], Awaitable[Episode]]
"""A rollout not sampled yet: called (once) under the caller's timeout, it samples the episode."""


class NonFiniteReward(ValueError):
    """A reward function returned NaN or ±inf: that rollout fails (a NaN would poison the group's advantages)."""


def check_reward(value: float, env: str, fn: str) -> float:
    """`value` if it is finite; else `NonFiniteReward` naming the environment and the reward function."""
    if not math.isfinite(value):
        raise NonFiniteReward(f"reward function {fn!r} of environment {env!r} returned {value}")
    return value


def reward_name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", "fn")


class RewardRunner(Protocol):
    """Runs synchronous reward functions somewhere other than the event loop (`tidal.envs.reward_pool`)."""

    async def run(self, fn: RewardFn, task: Task, episode: Episode) -> float: ...


# A context variable rather than an argument: every asyncio task started inside `rewards_run_by` inherits
# it, so environments that override `score` and call `super().score` (or a mix's member) need no new
# parameter, and user environments keep the protocol they were written against.
_reward_runner: ContextVar[RewardRunner | None] = ContextVar("tidal_reward_runner", default=None)


@contextmanager
def rewards_run_by(runner: RewardRunner | None) -> Iterator[None]:
    """Inside the block, and in every asyncio task started from it, `call_reward` hands synchronous reward
    functions to `runner` (None: they run inline, on the event loop)."""
    token = _reward_runner.set(runner)
    try:
        yield
    finally:
        _reward_runner.reset(token)


def reward_runner() -> RewardRunner | None:
    """What runs plain reward functions here (set by `rewards_run_by`); None: they run inline."""
    return _reward_runner.get()


def is_async_reward(fn: RewardFn) -> bool:
    """`async def` functions (also behind functools.partial or an async `__call__`) run on the event loop."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def call_reward(fn: RewardFn, task: Task, episode: Episode) -> float:
    """Reward functions may be plain or async; plain ones go to the reward runner when one is set."""
    runner = _reward_runner.get()
    if runner is not None and not is_async_reward(fn):
        return await runner.run(fn, task, episode)
    return await call_inline(fn, task, episode)


async def call_inline(fn: RewardFn, task: Task, episode: Episode) -> float:
    """The reward of `fn`, computed here (on the event loop for a plain function)."""
    value = fn(task, episode)
    if inspect.isawaitable(value):
        value = await value
    return float(value)  # type: ignore[arg-type]


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of a chat prompt with the generation prompt appended (rendered once, never re-rendered)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return token_ids(tokenizer, str(text))


class Environment(ABC):
    """Base of every environment: a deterministic task list, a rollout, weighted reward functions."""

    name: str = "env"
    gives_images: bool = False
    """Its prompts (or its later turns) carry pictures (image content parts): `tidal eval`, `tidal rl` and
    `tidal sft` send them to a vision-language model and train on them, and refuse a model that cannot
    (docs/vlm.md)."""

    def __init__(self, rewards: list[tuple[RewardFn, float]] | None = None):
        self.rewards = rewards if rewards is not None else self.default_rewards()

    def default_rewards(self) -> list[tuple[RewardFn, float]]:
        return []

    @abstractmethod
    def num_tasks(self) -> int: ...

    @abstractmethod
    def task(self, index: int) -> Task: ...

    @abstractmethod
    async def rollout(self, task: Task, sampler: Sampler) -> Episode:
        """Run the episode; `score` is called by the caller afterwards (see `run_episode`)."""

    async def rollout_group(self, task: Task, sampler: GroupSampler, n: int) -> list[Episode | EpisodeWork]:
        """The group's n rollouts of `task`, unscored: each an `Episode` sampled already, or an `EpisodeWork`
        that samples it. The caller runs each work under the rollout timeout and scores every episode; a
        work that raises fails its rollout only, an exception raised here fails the whole group.

        Default: n independent `rollout`s, the i-th through `sampler.fork(i)` (its own seed and session),
        which the caller runs concurrently. `SingleTurnEnv` samples all n in one request instead.
        """
        return [functools.partial(self.rollout, task, sampler.fork(index)) for index in range(n)]

    def demonstration(self, task: Task) -> list[dict[str, Any]] | None:
        """A correct conversation of `task` for SFT warm-ups: its prompt, then every assistant turn right and,
        for a multi-turn environment, what the environment answers between them, in the messages its
        rollout builds. None where this task has no correct conversation. Environments without
        demonstrations leave this default, which raises NotImplementedError
        (`tidal.envs.demonstrations` turns that into a one-line error)."""
        raise NotImplementedError(f"environment {self.name!r} has no demonstrations")

    def env_of(self, task: Task) -> "Environment":
        """The environment that rolls out and scores `task`: this one (a mix: the member it came from)."""
        return self

    async def score(self, task: Task, episode: Episode) -> None:
        """Weighted sum of the reward functions; each one is also logged as a metric under its name.

        Where the caller runs reward workers (the orchestrator and `tidal eval`: `reward_workers`), each
        plain module-level reward function runs in one of those processes, on a copy of the task and the
        episode (what it changes there is lost: return the reward, keep state in `episode.info` during
        the rollout). `async def` rewards, and an override of `score` that does not come here (verifiers
        scores inside its rollout), run on the event loop: anything slow they do holds every rollout in
        flight.
        """
        total = 0.0
        for fn, weight in self.rewards:
            value = check_reward(await call_reward(fn, task, episode), self.name, reward_name(fn))
            episode.metrics[f"reward/{reward_name(fn)}"] = value
            total += weight * value
        episode.reward = total


class SingleTurnEnv(Environment):
    """One model turn answering the task's messages."""

    async def rollout(self, task: Task, sampler: Sampler) -> Episode:
        prompt, images = render_prompt(sampler.tokenizer, task.messages), message_images(task.messages)
        return self.episode(task, prompt, await sampler.complete(prompt, images), images)

    async def rollout_group(self, task: Task, sampler: GroupSampler, n: int) -> list[Episode | EpisodeWork]:
        """A whole group from one request: the prompt is prefilled once for all n samples."""
        prompt, images = render_prompt(sampler.tokenizer, task.messages), message_images(task.messages)
        turns = await sampler.complete_n(prompt, n, images)
        return [self.episode(task, prompt, turn, images) for turn in turns]

    def episode(self, task: Task, prompt: list[int], turn: Turn, images: list[str]) -> Episode:
        """The episode of one sampled answer to the task's messages (`images`: their pictures, checked once
        per rollout or group by `message_images`)."""
        episode = Episode(
            prompt_ids=prompt,
            messages=[*task.messages, {"role": "assistant", "content": turn.text}],
            images=images,
        )
        episode.add_model_turn(turn)
        return episode


def completion_text(episode: Episode) -> str:
    """The answer of the last assistant message of the episode, reasoning removed ('' if none)."""
    for message in reversed(episode.messages):
        if message["role"] == "assistant":
            return answer_text(str(message["content"]))
    return ""


def answer_text(reply: str) -> str:
    """A reply without its reasoning: the text after the last `</think>`; '' while a `<think>` block it opens
    is unfinished (cut at max_tokens). Thinking models (Qwen3 by default) write their drafts there, and a
    reward that parsed them would score the drafts (alphabet_sort would read `<think>` as a name)."""
    if "</think>" in reply:
        return reply.rsplit("</think>", 1)[1]
    return "" if reply.lstrip().startswith("<think>") else reply


async def score_episode(env: Environment, task: Task, episode: Episode) -> Episode:
    """`env.score`, then the total checked too: an environment may override `score` (verifiers does)."""
    await env.score(task, episode)
    check_reward(episode.reward, env.name, "score")
    return episode


async def run_episode(env: Environment, task: Task, sampler: Sampler) -> Episode:
    return await score_episode(env, task, await env.rollout(task, sampler))

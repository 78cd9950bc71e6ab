"""Run environments written for `verifiers` (>= 0.4, `verifiers.v1`) in tidal, unchanged.

How a verifiers rollout reaches a model: the environment's harness program talks to a per-rollout
"interception" endpoint (OpenAI-compatible), and the interception server hands each request to a
`verifiers.v1.Client`. This adapter loads the environment as `vf.load_environment` does (by taskset id),
serves it once per event loop, and registers for each rollout a `SamplerClient`: a `Client` that renders
the request with the model's chat template, extends the exact token ids of earlier turns
(`continue_prompt`), samples through tidal's `Sampler` (so RL gets its seeds, versions and logprobs) and
answers the harness with an OpenAI chat completion. The environment's own rewards score the rollout
(`trace.rewards`, weighted as the task declares); tidal's Episode gets the recorded token ids, logprobs and
mask (0 for every token the harness or environment added between turns).

Defaults chosen for tidal: the `tidal_vf_chat` harness (in-process, see `vf_chat_harness`) and the
subprocess runtime; pass `harness="null"` (needs `uv`) or another id to use verifiers' own harnesses.
"""

import asyncio
import contextlib
import sys
import time
import uuid
from typing import Any

from tidal.envs.base import (
    ContextFull,
    Environment,
    Episode,
    Sampler,
    Task,
    Turn,
    check_reward,
    render_prompt,
)
from tidal.envs.chat import continue_prompt
from tidal.errors import UserError, first_line
from tidal.inference.types import ChatMessage

try:
    import verifiers.v1 as vf
    from verifiers.v1.clients.train import serialize_completion
    from verifiers.v1.dialects.chat import FINISH_REASONS
    from verifiers.v1.interception import InterceptionServer
    from verifiers.v1.types import content_text
except ImportError:  # the optional extra: only this module needs it
    vf = None

if vf is not None:
    from tidal.envs import vf_chat_harness

    # verifiers resolves a harness id to a top-level module exporting the Harness via __all__
    sys.modules.setdefault(vf_chat_harness.HARNESS_ID, vf_chat_harness)


DEFAULT_HARNESS = "tidal_vf_chat"  # vf_chat_harness.HARNESS_ID, without importing verifiers


class VerifiersRolloutFailed(RuntimeError):
    """The verifiers episode did not complete (its own error is in the message)."""


class SamplerClient(vf.Client if vf is not None else object):  # type: ignore[misc]
    """A verifiers model client for one rollout: OpenAI chat requests in, tidal sampler turns out."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self.turns: list[Turn] = []
        self.history: list[ChatMessage] = []
        """The last request's messages plus the reply: what `context` encodes."""
        self.context: list[int] = []
        self.context_full = False
        """A later turn's prompt did not fit the served context (the episode ended there)."""
        self.first_prompt_too_long = False

    async def get_response(self, dialect, body, sampling, session_id=None, turn=None, headers=None):  # type: ignore[no-untyped-def]
        request = dialect.parse_request(body)
        messages = [ChatMessage(role=m.role, content=content_text(m.content) or "") for m in request.messages]
        prompt_ids = self.prompt_ids(messages)
        try:
            sampled = await self.sampler.complete(prompt_ids)
        except ContextFull:
            if not self.turns:
                self.first_prompt_too_long = True  # the rollout fails with this, not the harness's error
                raise
            if turn is None:  # no trace to stop (called without the prepared turn): the rollout fails
                raise
            # No turn can follow: end the exchange as verifiers ends one at a token limit. The stopped trace
            # makes the harness's failed request an expected exit, and the rollout is finalized and scored
            # on the turns it has (what tidal's own multi-turn environments do); the episode is marked
            # truncated in `VerifiersEnv.rollout`.
            self.context_full = True
            turn.trace.stop("max_input_tokens")
            raise
        self.turns.append(sampled)
        self.history = [*messages, ChatMessage(role="assistant", content=sampled.text)]
        self.context = [*prompt_ids, *sampled.completion_ids]
        response = vf.Response(
            id=f"tidal-{uuid.uuid4().hex[:12]}",
            created=int(time.time()),
            model=str(body.get("model", "")),
            message=vf.AssistantMessage(content=sampled.text),
            finish_reason=sampled.finish_reason if sampled.finish_reason in FINISH_REASONS else None,
            usage=vf.Usage(prompt_tokens=len(prompt_ids), completion_tokens=len(sampled.completion_ids)),
            tokens=vf.TurnTokens(
                prompt_ids=prompt_ids,
                completion_ids=sampled.completion_ids,
                completion_logprobs=sampled.logprobs,
            ),
        )
        response.raw = serialize_completion(response, response.model)
        return response

    def prompt_ids(self, messages: list[ChatMessage]) -> list[int]:
        """Continue the exact ids when the request extends the last conversation; else render afresh."""
        n = len(self.history)
        if n and len(messages) > n and messages[:n] == self.history:
            return continue_prompt(self.sampler.tokenizer, self.context, self.history, messages[n:])
        return render_prompt(self.sampler.tokenizer, [m.model_dump() for m in messages])


def episode_from_turns(turns: list[Turn], messages: list[dict[str, Any]]) -> Episode:
    """One token sequence from the sampled turns; ids between turns are the environment's (mask 0)."""
    if not turns:
        raise VerifiersRolloutFailed("the verifiers episode made no model call")
    episode = Episode(prompt_ids=list(turns[0].prompt_ids), messages=messages)
    for turn in turns:
        context = episode.context_ids
        if turn.prompt_ids[: len(context)] != context:
            raise VerifiersRolloutFailed(
                "the harness rewrote earlier turns (a prompt does not extend the previous one); "
                "tidal trains on one token sequence per rollout"
            )
        episode.add_env_tokens(list(turn.prompt_ids[len(context) :]))
        episode.add_model_turn(turn)
    return episode


class VerifiersEnv(Environment):
    """A verifiers environment (taskset id, as `vf.load_environment` takes it) as a tidal Environment."""

    def __init__(
        self,
        env_id: str,
        num_examples: int | None = None,
        harness: str = DEFAULT_HARNESS,
        taskset: dict[str, Any] | None = None,
        env: dict[str, Any] | None = None,
    ):
        if vf is None:
            raise UserError(
                "verifiers environments need the `verifiers` extra: pip install 'tidal[verifiers]'"
            )
        super().__init__(rewards=[])
        self.name = f"vf:{env_id}"
        self.vf_env = vf.load_environment(env_config(env_id, harness, taskset or {}, env or {}))
        tasks = self.vf_env.taskset if num_examples is None else self.vf_env.taskset.take(num_examples)
        self.tasks = list(tasks)
        if not self.tasks:
            raise UserError(f"verifiers environment {env_id!r} has no tasks")
        self._serving: tuple[asyncio.AbstractEventLoop, contextlib.AsyncExitStack] | None = None
        self._starting: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def num_tasks(self) -> int:
        return len(self.tasks)

    def task(self, index: int) -> Task:
        data = self.tasks[index].data
        messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            messages.append({"role": "user", "content": data.prompt})
        else:
            messages += [
                {"role": m.role, "content": content_text(getattr(m, "content", ""))}
                for m in data.prompt or []
            ]
        answer = getattr(data, "answer", None)  # a field of the taskset's own TaskData, when it has one
        return Task(
            task_id=f"{self.name}/{index}",
            messages=messages,
            answer="" if answer is None else str(answer),
            info={"vf_index": index},
        )

    async def rollout(self, task: Task, sampler: Sampler) -> Episode:
        interception = await self._interception()
        client = SamplerClient(sampler)
        config = vf.EvalClientConfig(base_url=f"http://tidal-rollout-{uuid.uuid4().hex}.invalid/v1")
        key = config.model_dump_json()
        interception.clients[key] = client  # the interception server's client for this rollout's config
        try:
            ctx = vf.ModelContext(model="tidal", client=config)
            result = await self.vf_env.run_episode(self.tasks[task.info["vf_index"]], ctx)
        finally:
            interception.clients.pop(key, None)
        if not result.ok and client.first_prompt_too_long:
            raise ContextFull(
                f"{task.task_id}: the task's prompt leaves no room for a reply in the served context"
            )
        if not result.ok:
            error = result.last_error or next((t.last_error for t in result.traces if t.last_error), None)
            raise VerifiersRolloutFailed(f"{error.type}: {error.message}" if error else "episode not ok")
        messages = [*task.messages, *({"role": "assistant", "content": t.text} for t in client.turns)]
        episode = episode_from_turns(client.turns, messages)
        episode.info["vf_traces"] = result.traces
        if client.context_full:
            episode.info["truncated"] = True  # the request no turn could follow is left out
        return episode

    async def score(self, task: Task, episode: Episode) -> None:
        """The environment scored itself during the rollout; copy its rewards and metrics (a non-finite
        reward fails the rollout, naming the reward function that returned it)."""
        traces = episode.info.get("vf_traces", [])
        for trace in traces:
            for name, reward in trace.rewards.items():
                if reward is not None:
                    episode.metrics[f"reward/{name}"] = check_reward(float(reward.score), self.name, name)
        episode.reward = sum(t.reward for t in traces) / max(1, len(traces))
        for trace in traces:
            for name, value in trace.metrics.items():
                if value is not None:
                    episode.metrics[f"vf/{name}"] = float(value)

    async def _interception(self) -> "InterceptionServer":
        """Serve the environment (shared tools, interception) once per event loop."""
        loop = asyncio.get_running_loop()
        if self._starting is None or self._starting[0] is not loop:
            self._starting = (loop, asyncio.Lock())
        async with self._starting[
            1
        ]:  # concurrent first rollouts must share one server, not race to start two
            if self._serving is None or self._serving[0] is not loop:
                stack = contextlib.AsyncExitStack()
                await stack.enter_async_context(self.vf_env.serving())
                self._serving = (loop, stack)
        interception = self.vf_env._interception  # set by serving(); verifiers has no public accessor
        if not isinstance(interception, InterceptionServer):
            raise UserError("verifiers adapter: set interception.type = 'server' for the environment")
        return interception

    async def aclose(self) -> None:
        if self._serving is not None and self._serving[0] is asyncio.get_running_loop():
            await self._serving[1].aclose()
        self._serving = None


def env_config(env_id: str, harness: str, taskset: dict[str, Any], env: dict[str, Any]) -> Any:
    """The verifiers EnvConfig: every agent seat runs `harness` in the local subprocess runtime."""
    cls = vf.env_config_type(env_id)
    seats = {
        name: {"harness": {"id": harness}, "runtime": {"type": "subprocess"}} for name in _seat_names(cls)
    }
    data = {"taskset": {"id": env_id, **taskset}, "interception": {"type": "server"}, **seats, **env}
    try:
        return vf.resolve_env_config(data)
    except (ValueError, TypeError) as exc:
        raise UserError(f"verifiers environment {env_id!r}: {exc}".splitlines()[0]) from None


def _seat_names(cls: Any) -> list[str]:
    return [name for name, field in cls.model_fields.items() if isinstance(field.default, vf.AgentConfig)]


def resolve_verifiers_env(env_id: str) -> type[VerifiersEnv]:
    """`VerifiersEnv` once the taskset `env_id` is known to load: its module imports and exports one
    environment; each failure is a one-line `UserError` (nothing of the taskset runs beyond its import)."""
    if vf is None:
        raise UserError("verifiers environments need the `verifiers` extra: pip install 'tidal[verifiers]'")
    name = f"vf:{env_id}"
    try:
        module = vf.import_taskset(env_id)
    except ModuleNotFoundError as exc:
        if _missing_is_taskset(exc, env_id):
            raise UserError(
                f"environment {name!r}: verifiers environment {env_id!r} is not installed "
                "(pip install it, or put its module on PYTHONPATH)"
            ) from None
        raise UserError(f"environment {name!r}: importing it failed: {_described(exc)}") from None
    except Exception as exc:  # noqa: BLE001 - the taskset's own import may raise anything
        raise UserError(f"environment {name!r}: importing it failed: {_described(exc)}") from None
    try:
        vf.taskset_config_type(env_id)  # the module exports one Taskset (what `env_config` needs)
        vf.env_config_type(env_id)
    except Exception as exc:  # noqa: BLE001 - verifiers reports a malformed module with several types
        raise UserError(f"environment {name!r}: {module.__name__}: {first_line(exc)}") from None
    return VerifiersEnv


def _missing_is_taskset(exc: ModuleNotFoundError, env_id: str) -> bool:
    """Whether the module that was not found is the taskset itself, not one its code imports."""
    cause = exc.__cause__
    missing = getattr(cause, "name", None) or ""
    module = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    return missing in (module, f"verifiers.v1.tasksets.{module}") or module.startswith(missing + ".")


def _described(exc: BaseException) -> str:
    cause = exc.__cause__ if isinstance(exc, ModuleNotFoundError) and exc.__cause__ else exc
    return f"{type(cause).__name__}: {first_line(cause)}"

"""Tool calling: OpenAI-style tool schemas, robust parsing of the model's calls, and `ToolEnv`.

Tools are described to the model as OpenAI function schemas (`{"type": "function", "function": {...}}`).
Templates that know tools (Qwen3, Hermes-style) render them themselves; for those that ignore `tools=`
the description goes into the system message. The model calls a tool by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (what Qwen3 and Hermes models emit); `arguments`
may also be a JSON-encoded string, as in the OpenAI wire format. Results come back as `tool` messages.
"""

import asyncio
import inspect
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.envs.base import Episode, RewardFn, Sampler, Task, answer_text
from tidal.envs.multiturn import Message, MultiTurnEnv

ToolFn = Callable[..., Any | Awaitable[Any]]
MAX_TOOL_OUTPUT = 2000
_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    """A function the model may call, with its OpenAI schema."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: ToolFn

    def schema(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }


@dataclass(frozen=True)
class ToolCall:
    """A parsed call; `error` is set (and name/arguments may be empty) when the call could not be parsed."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """Every `<tool_call>` block of `text`, in order; malformed ones come back with `error` set."""
    return [_parse_one(raw.strip()) for raw in _CALL_RE.findall(text)]


def _parse_one(raw: str) -> ToolCall:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall("", error=f"invalid JSON in tool call: {exc.msg}")
    if not isinstance(data, dict):
        return ToolCall("", error="a tool call must be a JSON object with `name` and `arguments`")
    if "function" in data and isinstance(data["function"], dict):  # the OpenAI wire shape
        data = data["function"]
    name, arguments = data.get("name"), data.get("arguments", {})
    if not isinstance(name, str) or not name:
        return ToolCall("", error="tool call has no `name`")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            return ToolCall(name, error=f"invalid JSON in `arguments`: {exc.msg}")
    if not isinstance(arguments, dict):
        return ToolCall(name, error="`arguments` must be a JSON object")
    return ToolCall(name, arguments)


def render_tool_prompt(tokenizer: Any, messages: list[Message], tools: list[Tool]) -> list[int]:
    """Prompt ids with the tools described: by the chat template if it renders them, else in the system message."""
    schemas = [t.schema() for t in tools]
    plain = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=schemas, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - a template that rejects `tools=` is the same as one that ignores them
        text = plain
    if text == plain:
        text = tokenizer.apply_chat_template(
            with_tool_system_prompt(messages, schemas), tokenize=False, add_generation_prompt=True
        )
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def with_tool_system_prompt(messages: list[Message], schemas: list[dict[str, Any]]) -> list[Message]:
    """The tools as one compact line each (`name(arg, ...): description`): a fraction of the schemas' tokens."""
    lines = []
    for schema in schemas:
        function = schema["function"]
        arguments = ", ".join(function.get("parameters", {}).get("properties", {}))
        lines.append(f"- {function['name']}({arguments}): {function.get('description', '')}")
    note = (
        "Tools:\n" + "\n".join(lines) + "\n"
        'Call one with <tool_call>{"name": "...", "arguments": {...}}</tool_call>.'
    )
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


async def call_tool(tool: Tool, arguments: dict[str, Any], timeout: float) -> str:
    """Run one tool; any exception or bad argument becomes the text the model sees (never the rollout's failure)."""
    try:
        inspect.signature(tool.fn).bind(**arguments)
    except TypeError as exc:
        return f"error: bad arguments for {tool.name}: {exc}"
    try:
        result = tool.fn(**arguments)
        if inspect.isawaitable(result):
            result = await asyncio.wait_for(result, timeout)
    except TimeoutError:
        return f"error: {tool.name} timed out after {timeout:g} s"
    except Exception as exc:  # noqa: BLE001 - tool errors are observations for the model
        return f"error: {type(exc).__name__}: {exc}"
    return truncate(str(result))


def truncate(text: str, limit: int = MAX_TOOL_OUTPUT) -> str:
    return text if len(text) <= limit else text[:limit] + f"\n... [{len(text) - limit} characters cut]"


class ToolEnv(MultiTurnEnv):
    """The model calls tools until it answers without a call (or runs out of turns).

    `episode.info` counts `num_tool_calls` and `num_tool_errors` (unparseable calls, unknown tools, bad
    arguments, tool exceptions), which become metrics.
    """

    tool_timeout: float = 10.0

    def __init__(self, tools: list[Tool], rewards: list[tuple[RewardFn, float]] | None = None):
        super().__init__(rewards)
        self.tools = {t.name: t for t in tools}

    def initial_prompt(self, task: Task, sampler: Sampler) -> list[int]:
        return render_tool_prompt(sampler.tokenizer, task.messages, list(self.tools.values()))

    def setup_episode(self, task: Task, episode: Episode) -> None:
        episode.info.update(num_tool_calls=0, num_tool_errors=0)

    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        calls = parse_tool_calls(answer_text(str(episode.messages[-1]["content"])))
        if not calls:
            return None
        replies = []
        for call in calls:
            result = await self._run(call)
            episode.info["num_tool_calls"] += 1
            episode.info["num_tool_errors"] += result.startswith("error:")
            replies.append({"role": "tool", "content": result})
        return replies

    async def _run(self, call: ToolCall) -> str:
        if call.error is not None:
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            return f"error: unknown tool {call.name!r} (tools: {', '.join(self.tools)})"
        return await call_tool(tool, call.arguments, self.tool_timeout)

    async def score(self, task: Task, episode: Episode) -> None:
        await super().score(task, episode)
        for key in ("num_tool_calls", "num_tool_errors"):
            episode.metrics[f"tools/{key}"] = float(episode.info.get(key, 0))

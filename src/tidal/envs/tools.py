"""Tool calling: OpenAI-style tool schemas, robust parsing of the model's calls, and `ToolEnv`.

Tools are described to the model as OpenAI function schemas (`{"type": "function", "function": {...}}`).
Templates that know tools (Qwen2.5, Qwen3, Hermes-style) render them themselves; for those that ignore
`tools=` the description goes into the system message. A call is a JSON object with a `name` and its
`arguments` (also `parameters`, and the OpenAI wire shape `{"function": {...}}`); `arguments` may also be a
JSON-encoded string. What real models write, and what `parse_tool_calls` accepts, in this order:
`<tool_call>{...}</tool_call>` (what Qwen and Hermes templates ask for), else calls in fenced code blocks
(```json ... ```: Qwen2.5-Coder-0.5B wrote most of its calls this way despite its template), else bare
call objects in the text. Results come back as `tool` messages.
"""

import asyncio
import inspect
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.envs.base import Episode, RewardFn, Sampler, Task, answer_text
from tidal.envs.multiturn import Message, MultiTurnEnv

ToolFn = Callable[..., Any | Awaitable[Any]]
MAX_TOOL_OUTPUT = 2000
_CALL_RE = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|tool_call)?[ \t]*\n(.*?)```", re.DOTALL)
_ANY_FENCE_RE = re.compile(r"```.*?(?:```|$)", re.DOTALL)
_ARGUMENT_KEYS = frozenset({"arguments", "parameters"})


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
    """The calls of a reply, in order: every `<tool_call>` block (malformed ones come back with `error`
    set); where there is none, the call objects of its ```json (or bare ```) blocks; where there is none
    either, the call objects in its text outside code blocks. Outside `<tool_call>` tags only an object
    with a `name` and `arguments` (or `parameters`) is a call: other JSON in a reply (a result) is not."""
    tagged = _CALL_RE.findall(text)
    if tagged:
        return [_parse_one(raw.strip()) for raw in tagged]
    fenced = [call for block in _FENCE_RE.findall(text) for call in _fenced_calls(block)]
    prose = _ANY_FENCE_RE.sub("", text)  # a dict in a ```python block is code, not a call
    return fenced or [_call_of(data) for data in _json_objects(prose) if _looks_like_call(data)]


def _parse_one(raw: str) -> ToolCall:
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ToolCall("", error=f"invalid JSON in tool call: {exc.msg}")
    return _call_of(data)


def _call_of(data: Any) -> ToolCall:
    if not isinstance(data, dict):
        return ToolCall("", error="a tool call must be a JSON object with `name` and `arguments`")
    if "function" in data and isinstance(data["function"], dict):  # the OpenAI wire shape
        data = data["function"]
    name = data.get("name")
    arguments = data.get("arguments", data.get("parameters", {}))
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


def _looks_like_call(data: Any) -> bool:
    """A JSON value that is meant as a call: an object with a string `name` and `arguments`/`parameters`."""
    if isinstance(data, dict) and isinstance(data.get("function"), dict):
        data = data["function"]
    return (
        isinstance(data, dict) and isinstance(data.get("name"), str) and _ARGUMENT_KEYS & data.keys() != set()
    )


def _fenced_calls(block: str) -> list[ToolCall]:
    """The calls of one fenced block: an object or a list of them; a block that does not parse but names a
    `name` and `arguments` is a malformed call (the model meant one, and learns why it failed)."""
    try:
        data = json.loads(block)
    except json.JSONDecodeError as exc:
        meant = '"name"' in block and any(f'"{key}"' in block for key in _ARGUMENT_KEYS)
        return [ToolCall("", error=f"invalid JSON in tool call: {exc.msg}")] if meant else []
    items = data if isinstance(data, list) else [data]
    return [_call_of(item) for item in items if _looks_like_call(item)]


def _json_objects(text: str) -> list[Any]:
    """Every JSON object that starts at a `{` of `text` outside an earlier one, in order."""
    decoder, found, position = json.JSONDecoder(), [], text.find("{")
    while position != -1:
        try:
            data, end = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            position = text.find("{", position + 1)
            continue
        found.append(data)
        position = text.find("{", end)
    return found


def render_tool_prompt(tokenizer: Any, messages: list[Message], tools: list[Tool]) -> list[int]:
    """Prompt ids with the tools described: by the chat template if it renders them, else in the system message."""
    shown, kwargs = tool_template_inputs(tokenizer, messages, [t.schema() for t in tools])
    text = tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tokenizer(str(text), add_special_tokens=False)["input_ids"])


def tool_template_inputs(
    tokenizer: Any, messages: list[Message], schemas: list[dict[str, Any]]
) -> tuple[list[Message], dict[str, Any]]:
    """The messages and `apply_chat_template` arguments that describe the tools the way a rollout's prompt
    does: `tools=` where the template renders them (Qwen's `# Tools` block), else the tools in the system
    message (`with_tool_system_prompt`; the tiny models' ChatML ignores `tools=`). Decided on the messages
    before the first reply, so a whole conversation (SFT) and its prompt (a rollout) get the same answer."""
    prompt = []
    for message in messages:
        if message["role"] == "assistant":
            break
        prompt.append(message)
    plain = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    try:
        text = tokenizer.apply_chat_template(
            prompt, tools=schemas, tokenize=False, add_generation_prompt=True
        )
    except Exception:  # noqa: BLE001 - a template that rejects `tools=` is the same as one that ignores them
        text = plain
    if text == plain:
        return with_tool_system_prompt(messages, schemas), {}
    return messages, {"tools": schemas}


TOOLS_KEY = "tools"
"""A demonstration's tool schemas ride on its first message under this key (`with_tools`), and SFT renders
them as the rollout's prompt does (`conversation_template_inputs`): the warm-up then trains on the very
prompt that RL and eval sample from. Before, demonstrations always listed the tools in the system message,
and a template that renders `tools=` itself (Qwen2.5) showed the model another prompt at RL time: after a
40-step swe warm-up Qwen2.5-Coder-0.5B called `bash` with `path` instead of `command` in every held-out episode."""


def with_tools(messages: list[Message], schemas: list[dict[str, Any]]) -> list[Message]:
    """The conversation carrying its tools (on its first message) for SFT to render."""
    first, *rest = messages
    return [{**first, TOOLS_KEY: schemas}, *rest]


def conversation_template_inputs(
    tokenizer: Any, messages: list[Message]
) -> tuple[list[Message], dict[str, Any]]:
    """The messages and `apply_chat_template` arguments of an SFT conversation: one that carries tools
    (`with_tools`) gets them described as the rollout's prompt describes them; any other is left as it is."""
    if not messages or TOOLS_KEY not in messages[0]:
        return list(messages), {}
    first = {key: value for key, value in messages[0].items() if key != TOOLS_KEY}
    return tool_template_inputs(tokenizer, [first, *messages[1:]], messages[0][TOOLS_KEY])


def with_tool_system_prompt(messages: list[Message], schemas: list[dict[str, Any]]) -> list[Message]:
    """The tools as one compact line each (`name(arg, ...): description`): a fraction of the schemas' tokens,
    then how to call one, with a real call as the example where a schema gives example values."""
    lines = []
    for schema in schemas:
        function = schema["function"]
        arguments = ", ".join(function.get("parameters", {}).get("properties", {}))
        lines.append(f"- {function['name']}({arguments}): {function.get('description', '')}")
    example = example_call(schemas)
    how = (
        f"Call one like {example}"
        if example is not None
        else 'Call a tool by writing <tool_call>{"name": <tool name>, "arguments": {<argument>: <value>}}</tool_call>.'
    )
    note = "Tools:\n" + "\n".join(lines) + "\n" + how
    if messages and messages[0]["role"] == "system":
        return [{"role": "system", "content": f"{messages[0]['content']}\n{note}"}, *messages[1:]]
    return [{"role": "system", "content": note}, *messages]


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """A call as a model writes it in the Qwen/Hermes format: `<tool_call>{"name": …, "arguments": …}</tool_call>`
    (prompt examples and demonstrations)."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


_ANSWER = re.compile(r"<answer>\s*([^<]*?)\s*</answer>", re.IGNORECASE)


def tagged_answer(text: str) -> str | None:
    """The content of a reply's last `<answer>…</answer>`, stripped (the final answer of a tool environment's
    episode); None without one."""
    found = _ANSWER.findall(text)
    return found[-1] if found else None


def example_call(schemas: list[dict[str, Any]]) -> str | None:
    """A well-formed `<tool_call>` of the first tool whose required arguments all have JSON-schema `examples`
    (a prompt's example is copied by small models: it must be a call that works); None if no tool has."""
    for schema in schemas:
        function = schema["function"]
        parameters = function.get("parameters", {})
        properties = parameters.get("properties", {})
        required = parameters.get("required", list(properties))
        if required and all(properties.get(name, {}).get("examples") for name in required):
            arguments = {name: properties[name]["examples"][0] for name in required}
            return tool_call_text(function["name"], arguments)
    return None


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
    arguments, tool exceptions) and the seconds the calls took (`tool_seconds`, `tool_seconds_max`), which
    become metrics (`tools/...`, per rollout in `samples.jsonl` and eval's `rollouts.jsonl`).
    """

    tool_timeout: float = 10.0

    def __init__(self, tools: list[Tool], rewards: list[tuple[RewardFn, float]] | None = None):
        super().__init__(rewards)
        self.tools = {t.name: t for t in tools}

    def initial_prompt(self, task: Task, sampler: Sampler) -> list[int]:
        return render_tool_prompt(sampler.tokenizer, task.messages, list(self.tools.values()))

    def setup_episode(self, task: Task, episode: Episode) -> None:
        episode.info.update(num_tool_calls=0, num_tool_errors=0, tool_seconds=0.0, tool_seconds_max=0.0)

    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        calls = parse_tool_calls(answer_text(str(episode.messages[-1]["content"])))
        if not calls:
            return None
        replies = []
        for call in calls:
            started = time.perf_counter()
            result = await self.run_call(call, episode)
            took = time.perf_counter() - started
            episode.info["tool_seconds"] += took
            episode.info["tool_seconds_max"] = max(episode.info["tool_seconds_max"], took)
            episode.info["num_tool_calls"] += 1
            episode.info["num_tool_errors"] += result.startswith("error:")
            replies.append({"role": "tool", "content": result})
        return replies

    async def run_call(self, call: ToolCall, episode: Episode) -> str:
        """One call's result text (an environment whose tools act on the episode's state overrides this)."""
        return await self._run(call)

    async def _run(self, call: ToolCall) -> str:
        if call.error is not None:
            return f"error: {call.error}"
        tool = self.tools.get(call.name)
        if tool is None:
            listed = ", ".join(
                f"{name}({', '.join(t.parameters.get('properties', {}))})" for name, t in self.tools.items()
            )
            return f"error: unknown tool {call.name!r}; the tools are {listed}"
        return await call_tool(tool, call.arguments, self.tool_timeout)

    async def score(self, task: Task, episode: Episode) -> None:
        await super().score(task, episode)
        for key in ("num_tool_calls", "num_tool_errors", "tool_seconds", "tool_seconds_max"):
            episode.metrics[f"tools/{key}"] = float(episode.info.get(key, 0))

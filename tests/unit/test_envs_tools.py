"""Tool calling: parsing (bad JSON included), calculator bounds, the Python sandbox's limits, tool_use rollouts."""

import asyncio
import json
import time

import pytest

from tests.unit.test_envs_multiturn import check_token_invariants, roll
from tidal.envs.sandbox import PythonSandbox, calculate
from tidal.envs.tool_use import SYSTEM_PROMPT, ToolUseEnv, generate_question, parse_answer
from tidal.envs.tools import ToolCall, example_call, parse_tool_calls, render_tool_prompt
from tidal.models.tiny import build_tokenizer


def call(name: str, **arguments) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_parse_tool_calls_accepts_openai_shapes_and_reports_bad_ones():
    text = (
        call("calculator", expression="1+2")
        + '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}</tool_call>'
        + '<tool_call>{"type": "function", "function": {"name": "calculator", "arguments": {"expression": "3"}}}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "1+2"}),
        ToolCall("python", {"code": "print(1)"}),
        ToolCall("calculator", {"expression": "3"}),
    ]
    bad = parse_tool_calls(
        "<tool_call>{not json</tool_call><tool_call>[1, 2]</tool_call>"
        '<tool_call>{"arguments": {}}</tool_call><tool_call>{"name": "x", "arguments": "{oops"}</tool_call>'
        '<tool_call>{"name": "x", "arguments": 3}</tool_call><tool_call>{"name": "calculator"'
    )
    assert [c.error is not None for c in bad] == [True] * 6
    assert "invalid JSON" in (bad[0].error or "") and "name" in (bad[2].error or "")
    assert parse_tool_calls("no calls here") == []
    assert parse_tool_calls("") == []


# What Qwen2.5-Coder-0.5B-Instruct wrote to tool_use questions (greedy), its template asking for <tool_call>
QWEN_FENCED = '```json\n{\n  "name": "calculator",\n  "arguments": {\n    "expression": "(80784 * 1299) - 4792"\n  }\n}\n```'
QWEN_BARE = '{"name": "calculator", "arguments": {"expression": "80784 * 1299 - 4792"}}'
QWEN_UNKNOWN_TOOL = (
    '```json\n{\n  "name": "prime_count",\n  "arguments": {\n    "expression": "1766"\n  }\n}\n```'
)


def test_calls_in_json_fences_and_bare_json_objects_are_calls():
    assert parse_tool_calls(QWEN_FENCED) == [ToolCall("calculator", {"expression": "(80784 * 1299) - 4792"})]
    assert parse_tool_calls(QWEN_BARE) == [ToolCall("calculator", {"expression": "80784 * 1299 - 4792"})]
    assert parse_tool_calls(QWEN_UNKNOWN_TOOL) == [ToolCall("prime_count", {"expression": "1766"})]
    several = (
        'First {"name": "calculator", "parameters": {"expression": "2*3"}}, then '
        '{"type": "function", "function": {"name": "python", "arguments": "{\\"code\\": \\"print({1: 2})\\"}"}}'
    )
    assert parse_tool_calls(several) == [
        ToolCall("calculator", {"expression": "2*3"}),
        ToolCall("python", {"code": "print({1: 2})"}),
    ]
    listed = '```json\n[{"name": "calculator", "arguments": {"expression": "1"}}, {"name": "python", "arguments": {"code": "print(2)"}}]\n```'
    assert [c.name for c in parse_tool_calls(listed)] == ["calculator", "python"]
    # a fenced call that does not parse is a call gone wrong (the model is told why); prose JSON is no call
    (broken,) = parse_tool_calls('```json\n{"name": "calculator", "arguments": {"expression": "1+"\n```')
    assert broken.error is not None and "invalid JSON" in broken.error
    for not_a_call in [
        'The result is {"value": 42}.',
        '```json\n{"name": "Ada", "age": 3}\n```',
        '{"name": "calculator"}',
        '```python\nprint({"name": "calculator", "arguments": {}})\n```',
        "{not json at all",
    ]:
        assert parse_tool_calls(not_a_call) == [], not_a_call
    # <tool_call> tags win: JSON elsewhere in a reply with tags is not a second call
    assert parse_tool_calls(call("python", code="print(1)") + QWEN_BARE) == [
        ToolCall("python", {"code": "print(1)"})
    ]


def test_calculator_is_bounded():
    assert calculate("(3 + 4) * 12") == "84"
    assert calculate("7 / 2") == "3.5"
    assert calculate("2 ** 10") == "1024"
    for bad in ["9 ** 9 ** 9", "__import__('os')", "1 +", "x" * 500, "10 ** 200", "'a' * 3"]:
        with pytest.raises(ValueError):
            calculate(bad)
    with pytest.raises(ZeroDivisionError):
        calculate("1 / 0")


@pytest.mark.parametrize("mode", ["process", "auto"])
def test_python_sandbox_limits(mode):
    box = PythonSandbox(timeout=2, memory_mb=256, mode=mode)

    async def run_all():
        return await asyncio.gather(
            box.run("print(sum(range(10)))"),
            box.run("while True: pass"),
            box.run("x = bytearray(2 * 10**9)"),
            box.run("import socket; socket.create_connection(('1.1.1.1', 80), timeout=1)"),
            box.run("import os; print(os.getcwd())"),
            box.run("print('y' * 100000)"),
            box.run(""),
        )

    start = time.monotonic()
    ok, spin, memory, network, cwd, huge, empty = asyncio.run(run_all())
    assert time.monotonic() - start < 10
    assert ok.strip() == "45"
    assert "timed out" in spin or "killed by signal" in spin
    assert "MemoryError" in memory
    assert "disabled" in network or "Network is unreachable" in network or "Errno" in network
    assert ("tidal-sandbox-" in cwd) if box.mode == "process" else cwd.strip() == "/tmp"
    assert memory.startswith("error:") and network.startswith("error:") and spin.startswith("error:")
    assert len(huge) < 5000 and "characters cut" in huge
    assert empty == "(no output)"


def test_tools_go_into_the_system_prompt_when_the_template_ignores_them():
    tok = build_tokenizer()
    env = ToolUseEnv(num_examples=5)
    text = tok.decode(render_tool_prompt(tok, env.task(0).messages, list(env.tools.values())))
    assert "- calculator(expression):" in text and "<tool_call>" in text
    assert text.count("<|im_start|>system") == 1
    # the example call is one that works: small models copy examples
    example = example_call([t.schema() for t in env.tools.values()])
    assert example is not None and example in text
    (parsed,) = parse_tool_calls(example)
    assert parsed == ToolCall("calculator", {"expression": "(3 + 4) * 12"})
    assert example_call([{"function": {"name": "f", "parameters": {"properties": {"x": {}}}}}]) is None


def test_the_prompt_asks_for_a_tool_first_and_never_forbids_calls():
    # "... reply <answer>number</answer> without a tool call" read as "do not call tools"; an answer
    # format first, or an example answer, made Qwen2.5-Coder-0.5B guess at once in 8 of 8 tasks
    assert SYSTEM_PROMPT.startswith("Use the tools to compute the answer.")
    assert "without a tool call" not in SYSTEM_PROMPT and "<answer>number</answer>" in SYSTEM_PROMPT


def test_tool_aware_templates_render_the_tools_themselves():
    tok = build_tokenizer()
    tok.chat_template = (
        "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n{% endif %}"
        + tok.chat_template
    )
    env = ToolUseEnv(num_examples=5)
    text = tok.decode(render_tool_prompt(tok, env.task(0).messages, list(env.tools.values())))
    assert "TOOLS:calculator;python;" in text and "Tools:" not in text


def test_tool_use_questions_are_deterministic_and_correct():
    assert generate_question(3, 0) == generate_question(3, 0)
    q, a = next(
        generate_question(i, 0) for i in range(50) if generate_question(i, 0)[0].startswith("What is")
    )
    left, c = q.removeprefix("What is ").removesuffix("?").split(" - ")
    x, y = left.split(" * ")
    assert int(a) == int(x) * int(y) - int(c)
    assert parse_answer("so <answer>1,234</answer>") == "1234"
    assert parse_answer("1234") is None


def test_tool_use_rollout_calls_tools_and_scores():
    env = ToolUseEnv(num_examples=20)
    index = next(i for i in range(20) if env.task(i).messages[1]["content"].startswith("What is"))
    task = env.task(index)
    expression = task.messages[1]["content"].removeprefix("What is ").removesuffix("?")
    replies = [call("calculator", expression=expression), f"<answer>{task.answer}</answer>"]
    episode, sampler = roll(env, task, replies)
    assert episode.reward == pytest.approx(1.2) and episode.num_turns == 2
    assert episode.messages[3] == {"role": "tool", "content": task.answer}
    assert episode.metrics["tools/num_tool_calls"] == 1 and episode.metrics["tools/num_tool_errors"] == 0
    assert 0.0 < episode.metrics["tools/tool_seconds_max"] == episode.metrics["tools/tool_seconds"]
    assert episode.metrics["reward/tool_computed_answer"] == 1.0
    check_token_invariants(episode, sampler)


def test_a_fenced_call_is_run_and_computing_the_answer_earns_partial_credit():
    """Qwen2.5-Coder-0.5B's rollouts: a fenced call computes the answer, then it calls the calculator again
    with the result instead of answering. Computing it is worth 0.2; guessing the answer without a tool 1.0."""
    env = ToolUseEnv(num_examples=20)
    index = next(i for i in range(20) if env.task(i).messages[1]["content"].startswith("What is"))
    task = env.task(index)
    expression = task.messages[1]["content"].removeprefix("What is ").removesuffix("?")
    fenced = QWEN_FENCED.replace("(80784 * 1299) - 4792", expression)
    again = QWEN_FENCED.replace("(80784 * 1299) - 4792", task.answer)
    episode, _ = roll(env, task, [fenced] + [again] * 10)
    assert episode.num_turns == env.max_turns and episode.metrics["tools/num_tool_calls"] == env.max_turns
    assert episode.messages[3] == {"role": "tool", "content": task.answer}
    assert episode.reward == pytest.approx(0.2)
    wrong, _ = roll(env, task, [fenced.replace(expression, "1 + 1"), "<answer>2</answer>"])
    assert wrong.reward == 0.0
    guessed, _ = roll(env, task, [f"<answer>{task.answer}</answer>"])
    assert guessed.reward == 1.0 and guessed.metrics["reward/tool_computed_answer"] == 0.0


def test_an_unknown_tool_is_told_which_tools_there_are():
    env = ToolUseEnv(num_examples=5)
    episode, _ = roll(env, env.task(0), [QWEN_UNKNOWN_TOOL, "<answer>1</answer>"])
    assert episode.messages[3] == {
        "role": "tool",
        "content": "error: unknown tool 'prime_count'; the tools are calculator(expression), python(code)",
    }
    assert episode.metrics["tools/num_tool_errors"] == 1


def test_tool_use_splits_are_disjoint_and_hold_200_distinct_questions():
    train = ToolUseEnv(num_examples=2000)
    heldout = ToolUseEnv(num_examples=200, split="heldout")
    held = [heldout.task(i).messages[1]["content"] for i in range(200)]
    assert len(set(held)) == 200
    assert not set(held) & {train.task(i).messages[1]["content"] for i in range(2000)}
    assert heldout.task(7) == ToolUseEnv(num_examples=200, split="heldout").task(7)


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "z" * 100_000,
        "<tool_call>{bad json</tool_call>",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>',
        '<tool_call>{"name": "calculator", "arguments": {"expression": "9**9**9"}}</tool_call>',
    ],
)
def test_tool_use_adversarial_replies_never_fail_the_rollout(reply):
    env = ToolUseEnv(num_examples=5)
    episode, _ = roll(env, env.task(0), [reply] * 10)
    assert episode.reward == 0.0
    assert episode.num_turns <= env.max_turns
    if "tool_call" in reply:
        assert episode.metrics["tools/num_tool_errors"] == episode.metrics["tools/num_tool_calls"] > 0
        assert episode.messages[3]["role"] == "tool" and episode.messages[3]["content"].startswith("error:")


TOOL_AWARE_PREFIX = (
    "{% if tools %}<|im_start|>system\nTOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}"
)


def tool_env(name: str):  # type: ignore[no-untyped-def]
    from tidal.envs.search import SearchEnv
    from tidal.envs.swe import SweEnv

    return {
        "tool_use": lambda: ToolUseEnv(num_examples=5),
        "search": lambda: SearchEnv(corpus_size=30),
        "swe": lambda: SweEnv(num_examples=2, sandbox="process"),
    }[name]()


@pytest.mark.parametrize("tool_aware", [False, True])
@pytest.mark.parametrize("name", ["tool_use", "search", "swe"])
def test_a_demonstration_trains_on_the_prompt_its_rollout_samples_from(name: str, tool_aware: bool) -> None:
    """SFT of a tool environment's demonstration starts with the very ids of the rollout's prompt, whether
    the chat template renders `tools=` itself (Qwen2.5) or not (the tools then go in the system message),
    and its first trained token is the first reply's. Before, the demonstrations always listed the tools in
    the system message, which a tool-aware template never shows at RL time."""
    from tidal.trainer.data import tokenize_conversation
    from tidal.trainer.evaluate import prompt_text

    tok = build_tokenizer()
    if tool_aware:
        tok.chat_template = TOOL_AWARE_PREFIX + tok.chat_template
    env = tool_env(name)
    task = env.task(0)
    demonstration = env.demonstration(task)
    prompt = render_tool_prompt(tok, task.messages, list(env.tools.values()))
    sample = tokenize_conversation(tok, demonstration)
    assert sample.input_ids[: len(prompt)] == prompt
    assert sample.loss_mask.index(1) == len(prompt)
    shown = tok.decode(prompt)
    assert ("TOOLS:" in shown) == tool_aware and ("Tools:\n" in shown) != tool_aware
    # SFT's held-out exact-match eval prompts the model the same way
    assert tok(prompt_text(tok, demonstration[:2]), add_special_tokens=False)["input_ids"] == prompt


def test_sft_data_carries_tools_on_its_first_message_and_bad_tools_are_one_line_errors(tmp_path) -> None:
    from tidal.config.common import FileDataset
    from tidal.errors import UserError
    from tidal.trainer.data import tokenize_conversation
    from tidal.trainer.sources import load_conversations

    env = ToolUseEnv(num_examples=5)
    schemas = [tool.schema() for tool in env.tools.values()]
    messages = [
        {"role": "user", "content": "What is 2 + 2?", "tools": schemas},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "2 + 2"}}</tool_call>'},
        {"role": "tool", "content": "4"},
        {"role": "assistant", "content": "<answer>4</answer>"},
    ]  # fmt: skip
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": messages}) + "\n")
    (loaded,) = load_conversations(FileDataset(path=data))
    tok = build_tokenizer()  # plain ChatML: the tools go in a system message, as in a rollout's prompt
    prompt = render_tool_prompt(
        tok, [{"role": "user", "content": "What is 2 + 2?"}], list(env.tools.values())
    )
    assert tokenize_conversation(tok, loaded).input_ids[: len(prompt)] == prompt
    for bad, problem in [
        ("calculator", "must be a non-empty list"),
        ([{"name": "calculator"}], r"\[0\]: a schema is"),
        ([{"function": {"name": "f", "parameters": []}}], r"\[0\].function.parameters must be"),
    ]:
        data.write_text(json.dumps({"messages": [messages[0] | {"tools": bad}, *messages[1:]]}) + "\n")
        with pytest.raises(UserError, match=rf"train.jsonl:1: messages\[0\].tools {problem}") as caught:
            load_conversations(FileDataset(path=data))
        assert "\n" not in str(caught.value)
    data.write_text(json.dumps({"messages": [*messages[:3], messages[3] | {"tools": schemas}]}) + "\n")
    with pytest.raises(UserError, match=r"messages\[3\].tools go on the first message only"):
        load_conversations(FileDataset(path=data))

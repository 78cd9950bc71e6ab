"""Continuing a conversation from sampled token ids: the tiny model's ChatML template, Qwen3's template
(hand-written and as vLLM ships it) and a harmony-style one, all of which but ChatML re-render history."""

from importlib.util import find_spec
from pathlib import Path

import pytest

from tidal.envs.chat import TemplateMismatch, continue_prompt, render
from tidal.inference.types import ChatMessage
from tidal.models.templates import QWEN3_STYLE_TEMPLATE
from tidal.models.tiny import CHAT_TEMPLATE, build_tokenizer
from tidal.testing.templates import harmony_style_tokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_tokenizer()


def ids(tokenizer, messages, generation_prompt):  # type: ignore[no-untyped-def]
    out = tokenizer.apply_chat_template(
        [m.model_dump() for m in messages], add_generation_prompt=generation_prompt
    )
    return list(out if isinstance(out, list) else out["input_ids"])


SYSTEM = ChatMessage(role="system", content="be brief")
USER = ChatMessage(role="user", content="abc")
NEXT = [ChatMessage(role="user", content="de")]


def test_reply_ending_in_eos_continues_like_a_fresh_render(tokenizer) -> None:  # type: ignore[no-untyped-def]
    reply = ChatMessage(role="assistant", content="cba")
    context = ids(tokenizer, [USER], True) + tokenizer("cba", add_special_tokens=False)["input_ids"]
    context.append(tokenizer.eos_token_id)
    assert continue_prompt(tokenizer, context, [USER, reply], NEXT) == ids(
        tokenizer, [USER, reply, *NEXT], True
    )


def test_reply_cut_at_max_tokens_gets_its_turn_closed(tokenizer) -> None:  # type: ignore[no-untyped-def]
    context = ids(tokenizer, [USER], True) + tokenizer("cb", add_special_tokens=False)["input_ids"]
    out = continue_prompt(tokenizer, context, [USER, ChatMessage(role="assistant", content="cb")], NEXT)
    assert out[: len(context)] == context
    assert (
        tokenizer.decode(out[len(context) :])
        == "<|im_end|>\n<|im_start|>user\nde<|im_end|>\n<|im_start|>assistant\n"
    )


def test_special_tokens_sampled_inside_the_reply_are_kept(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The text of such a reply (special tokens skipped) re-tokenises to other ids; the sampled ids must stay.
    sampled = [
        tokenizer.convert_tokens_to_ids("c"),
        tokenizer.pad_token_id,
        tokenizer.convert_tokens_to_ids("b"),
    ]
    context = ids(tokenizer, [USER], True) + sampled
    out = continue_prompt(tokenizer, context, [USER, ChatMessage(role="assistant", content="cb")], NEXT)
    assert out[: len(context)] == context


def test_history_must_end_with_the_reply(tokenizer) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="assistant"):
        continue_prompt(tokenizer, [1, 2], [USER], NEXT)


# ---- templates that render history differently once more turns follow -------------------------------

QWEN3_FAMILY = ["qwen3_style", "qwen3_shipped_by_vllm"]


def qwen3_family_template(name: str) -> str:
    """The hand-written Qwen3-style template, or Qwen3's chat template as vLLM ships it for MiniCPM-V 4.5
    (a Qwen3-based model; the one difference: thinking off unless asked) loaded from the installed package."""
    if name == "qwen3_style":
        return QWEN3_STYLE_TEMPLATE
    vllm = find_spec("vllm")  # located, not imported (importing vllm takes seconds)
    path = (
        Path(vllm.origin or "").parent / "transformers_utils/chat_templates/template_minicpmv45.jinja"
        if vllm
        else None
    )
    if path is None or not path.is_file():
        pytest.skip("this vllm build ships no MiniCPM-V 4.5 template")
    return path.read_text()


@pytest.fixture(scope="module", params=QWEN3_FAMILY)
def qwen3_tokenizer(request):  # type: ignore[no-untyped-def]
    return build_tokenizer(chat_template=qwen3_family_template(request.param))


def text_ids(tokenizer, text: str) -> list[int]:  # type: ignore[no-untyped-def]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer, messages) -> list[int]:  # type: ignore[no-untyped-def]
    """How environments render the first prompt (generation prompt appended, template defaults)."""
    return text_ids(tokenizer, render(tokenizer, messages, add_generation_prompt=True))


def appended(tokenizer, context, out) -> str:  # type: ignore[no-untyped-def]
    assert out[: len(context)] == context  # the model's ids stay exactly as sampled
    return str(tokenizer.decode(out[len(context) :]))


def generation_prompt(tokenizer) -> str:  # type: ignore[no-untyped-def]
    return render(tokenizer, [USER], True)[len(render(tokenizer, [USER], False)) :]


@pytest.mark.parametrize("stopped", [True, False], ids=["eos", "cut"])
def test_qwen3_template_user_reply_appends_only_the_new_turn(qwen3_tokenizer, stopped) -> None:  # type: ignore[no-untyped-def]
    # Qwen3 renders `<think>\n\n</think>\n\n` before the last assistant reply only: the old prefix check
    # failed here for every user reply (wordle, alphabet_sort).
    tok = qwen3_tokenizer
    sampled = text_ids(tok, "<think>\nplan\n</think>\n\n<guess>crane</guess>") + [tok.eos_token_id] * stopped
    context = prompt_ids(tok, [USER]) + sampled
    reply = ChatMessage(role="assistant", content="<think>\nplan\n</think>\n\n<guess>crane</guess>")
    out = continue_prompt(tok, context, [USER, reply], NEXT)
    turn_end = "\n" if stopped else "<|im_end|>\n"
    assert (
        appended(tok, context, out) == f"{turn_end}<|im_start|>user\nde<|im_end|>\n{generation_prompt(tok)}"
    )


def test_qwen3_template_tool_replies_share_one_user_turn(qwen3_tokenizer) -> None:  # type: ignore[no-untyped-def]
    tok = qwen3_tokenizer
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    context = prompt_ids(tok, [SYSTEM, USER]) + text_ids(tok, call) + [tok.eos_token_id]
    tools = [ChatMessage(role="tool", content="6"), ChatMessage(role="tool", content="error: x")]
    out = continue_prompt(tok, context, [SYSTEM, USER, ChatMessage(role="assistant", content=call)], tools)
    assert appended(tok, context, out) == (
        "\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\nerror: x\n"
        f"</tool_response><|im_end|>\n{generation_prompt(tok)}"
    )


def test_qwen3_template_three_turns_keep_every_sampled_reasoning(qwen3_tokenizer) -> None:  # type: ignore[no-untyped-def]
    # The template would strip the reasoning of earlier turns; the model saw (and the trainer trains on) it.
    tok = qwen3_tokenizer
    history: list[ChatMessage] = [SYSTEM, USER]
    context = prompt_ids(tok, history)
    new_turns = [[ChatMessage(role="tool", content="6")], [ChatMessage(role="user", content="again")], NEXT]
    for i, new in enumerate(new_turns):
        text = f"<think>step {i}</think>answer {i}"
        context = context + text_ids(tok, text) + [tok.eos_token_id]
        history = [*history, ChatMessage(role="assistant", content=text)]
        longer = continue_prompt(tok, context, history, new)
        assert longer[: len(context)] == context
        context, history = longer, [*history, *new]
    decoded = tok.decode(context)
    assert all(f"<think>step {i}</think>answer {i}" in decoded for i in range(3))
    assert decoded.endswith(f"<|im_start|>user\nde<|im_end|>\n{generation_prompt(tok)}")


def test_harmony_style_template_final_message_marker_is_the_models_stop_token() -> None:
    # The last assistant message ends in <|return|> (EOS), earlier ones in <|end|>: another re-rendering.
    tok = harmony_style_tokenizer()
    context = prompt_ids(tok, [USER]) + text_ids(tok, "<think>hm</think>cba") + [tok.eos_token_id]
    reply = ChatMessage(role="assistant", content="<think>hm</think>cba")
    out = continue_prompt(tok, context, [USER, reply], NEXT)
    # the sampled <|return|> closes the turn in place of the template's <|end|>
    assert appended(tok, context, out) == "<|start|>user<|message|>de<|end|><|start|>assistant<|message|>"
    cut = prompt_ids(tok, [USER]) + text_ids(tok, "<think>h")
    out = continue_prompt(tok, cut, [USER, ChatMessage(role="assistant", content="<think>h")], NEXT)
    assert appended(tok, cut, out) == "<|end|><|start|>user<|message|>de<|end|><|start|>assistant<|message|>"


def test_a_template_that_drops_a_new_message_is_refused(tokenizer) -> None:  # type: ignore[no-untyped-def]
    # e.g. a template without a `tool` role: the model would never see the tool's answer
    tok = build_tokenizer(
        chat_template=CHAT_TEMPLATE.replace(
            "{% for message in messages %}", "{% for message in messages if message['role'] != 'tool' %}"
        )
    )
    context = prompt_ids(tok, [USER]) + text_ids(tok, "cb")
    with pytest.raises(TemplateMismatch, match="tool"):
        continue_prompt(
            tok,
            context,
            [USER, ChatMessage(role="assistant", content="cb")],
            [ChatMessage(role="tool", content="42")],
        )


def test_a_template_that_drops_the_reply_is_refused() -> None:
    tok = build_tokenizer(
        chat_template=CHAT_TEMPLATE.replace(
            "message['content']", "(message['content'] if message['role'] != 'assistant' else '')"
        )
    )
    context = prompt_ids(tok, [USER]) + text_ids(tok, "cb")
    with pytest.raises(TemplateMismatch, match="reply"):
        continue_prompt(tok, context, [USER, ChatMessage(role="assistant", content="cb")], NEXT)


def test_token_ids_through_the_rust_backend_are_the_tokenizers_own(tokenizer):  # type: ignore[no-untyped-def]
    """The fast path (`backend_tokenizer.encode`) gives the ids `tokenizer(text)` gives, special tokens included."""
    from tidal.envs.base import render_prompt
    from tidal.envs.chat import token_ids

    messages = [{"role": "system", "content": "Reverse."}, {"role": "user", "content": "tidal <|im_end|> x"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    want = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert tokenizer.backend_tokenizer is not None
    assert token_ids(tokenizer, text) == want == render_prompt(tokenizer, messages)
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") in want  # the specials were matched, not spelled

"""Continuing a conversation from sampled token ids with the tiny model's ChatML template."""

import pytest

from tidal.inference.chat import continue_prompt
from tidal.inference.types import ChatMessage
from tidal.testing.tiny import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    return build_tokenizer()


def ids(tokenizer, messages, generation_prompt):  # type: ignore[no-untyped-def]
    out = tokenizer.apply_chat_template(
        [m.model_dump() for m in messages], add_generation_prompt=generation_prompt
    )
    return list(out if isinstance(out, list) else out["input_ids"])


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

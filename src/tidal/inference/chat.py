"""Multi-turn conversations as token ids: extend the exact tokens of earlier turns, never re-tokenise them.

Rendering the grown message list again and tokenising it can give different ids for the model's own
earlier reply (BPE merges across the boundary, templates that strip reasoning, a reply cut at max_tokens),
and the trainer would then learn from tokens the model never sampled. `continue_prompt` keeps the ids
that were sampled verbatim and tokenises only the text the chat template adds after them.
"""

from collections.abc import Sequence
from typing import Any

from tidal.inference.types import ChatMessage


class TemplateMismatch(ValueError):
    """The chat template does not render the conversation so far as a prefix of the longer one."""


def render(tokenizer: Any, messages: Sequence[ChatMessage], add_generation_prompt: bool) -> str:
    return str(
        tokenizer.apply_chat_template(
            [m.model_dump() for m in messages], tokenize=False, add_generation_prompt=add_generation_prompt
        )
    )


def continue_prompt(
    tokenizer: Any,
    context_ids: Sequence[int],
    messages: Sequence[ChatMessage],
    new_messages: Sequence[ChatMessage],
) -> list[int]:
    """Prompt ids for the next turn: `context_ids` unchanged, then the template's text for `new_messages`.

    `context_ids` are the last prompt's ids followed by the sampled completion ids (EOS included if it was
    sampled); `messages` is the conversation they encode (the last one being the model's reply, as text).
    """
    seen = tokenizer.decode(list(context_ids), skip_special_tokens=False)
    full = render(tokenizer, [*messages, *new_messages], add_generation_prompt=True)
    if not full.startswith(seen):
        raise TemplateMismatch(
            "the chat template does not extend the previous turn's text "
            f"(previous ends {seen[-40:]!r}, re-rendered has {full[max(0, len(seen) - 40) : len(seen)]!r} there); "
            "build the next prompt from token ids instead"
        )
    suffix = tokenizer(full[len(seen) :], add_special_tokens=False)["input_ids"]
    return [*context_ids, *suffix]

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


# Stands in for the model's reply when rendering, so the sampled text (which may hold special tokens or
# be cut at max_tokens) never goes through the template or the tokenizer again.
_REPLY = "\x00tidal-reply\x00"


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
    """Prompt ids for the next turn: `context_ids` unchanged, then the template's text that follows them.

    `context_ids` are the last prompt's ids followed by the sampled completion ids (EOS included if it was
    sampled). `messages` is the conversation they encode, ending with the model's reply, whose content is
    not used (see _REPLY). What is appended: the rest of the reply's turn (the end-of-turn marker unless
    the model sampled it) and the new messages with the generation prompt.
    """
    if not messages or messages[-1].role != "assistant":
        raise ValueError("messages must end with the assistant turn that context_ids end with")
    history = [*messages[:-1], ChatMessage(role="assistant", content=_REPLY)]
    closed = render(tokenizer, history, add_generation_prompt=False)
    full = render(tokenizer, [*history, *new_messages], add_generation_prompt=True)
    if not full.startswith(closed) or closed.count(_REPLY) != 1:
        raise TemplateMismatch("the chat template does not render earlier turns as a prefix of later ones")
    turn_end = closed[closed.index(_REPLY) + len(_REPLY) :]
    eos = tokenizer.eos_token
    if context_ids and context_ids[-1] == tokenizer.eos_token_id and eos and turn_end.startswith(eos):
        turn_end = turn_end[len(eos) :]
    suffix = tokenizer(turn_end + full[len(closed) :], add_special_tokens=False)["input_ids"]
    return [*context_ids, *suffix]

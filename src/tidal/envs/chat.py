"""Multi-turn conversations as token ids: extend the exact tokens of earlier turns, never re-tokenise them.

Rendering the grown message list again and tokenising it can give different ids for the model's own
earlier reply (BPE merges across the boundary, templates that strip reasoning, a reply cut at max_tokens),
and the trainer would then learn from tokens the model never sampled. `continue_prompt` keeps the ids
that were sampled verbatim and tokenises only the text the chat template adds after them.

Where that text is: the conversation is rendered with a placeholder standing for the model's last reply
and the new messages after it, and what follows the placeholder is appended. Only the text after the
last reply is taken from the template, so templates that render history differently once more turns
follow it are handled: Qwen3's, which puts `<think>\\n\\n</think>\\n\\n` before the final assistant reply
only and strips the reasoning of turns before the last user query; harmony-style ones, which end the final assistant message
with the stop token and earlier ones with another marker. When the model stopped with the special token
that the template's text after the reply starts with (ChatML's `<|im_end|>`), or with the one the template
ends a final reply with (harmony's `<|return|>`, where history has `<|end|>`), the sampled token closes
the turn and the template's end-of-turn token is not added again.

Whatever the template would now render differently *before* the reply (reasoning dropped, `<think>`
blocks added or removed, an earlier turn's end marker swapped) is left as it was sampled, on purpose:
the context is what the model saw when it generated, and the trainer must score exactly those tokens.
The cost is a context that differs from a fresh render of the same conversation (Qwen3 keeps the
reasoning of earlier turns that its template would strip); a model then sees its own full history, as
when it generated it. Still refused (`TemplateMismatch`): a template that renders the reply's content
not exactly once, or a new message not after the reply (dropped, or put earlier, e.g. into the system
turn). Not detectable: text before the reply that depends on later turns (a turn counter in the system
prompt); it is not added, for the same reason. The template is called with its defaults (no
`enable_thinking`, as for the first prompt), so every generation prompt is the same, and without `tools=`:
Qwen3's tool list is in the system turn, before any reply, so that changes nothing that is appended.
"""

import base64
import binascii
import io
from collections.abc import Sequence
from typing import Any

from tidal.inference.types import ChatMessage


class TemplateMismatch(ValueError):
    """The chat template does not render the new messages as text that follows the model's last reply."""


# Stands in for the model's reply when rendering, so the sampled text (which may hold special tokens or
# be cut at max_tokens) never goes through the template or the tokenizer again.
_REPLY = "\x00tidal-reply\x00"


RenderMessage = ChatMessage | dict[str, Any]
"""A message to render: a ChatMessage, or a plain message whose content is a list of parts (pictures)."""


def render(tokenizer: Any, messages: Sequence[RenderMessage], add_generation_prompt: bool) -> str:
    plain = [m.model_dump() if isinstance(m, ChatMessage) else m for m in messages]
    return str(
        tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=add_generation_prompt)
    )


def continue_prompt(
    tokenizer: Any,
    context_ids: Sequence[int],
    messages: Sequence[ChatMessage],
    new_messages: Sequence[RenderMessage],
) -> list[int]:
    """Prompt ids for the next turn: `context_ids` unchanged, then the template's text that follows them.

    `context_ids` are the last prompt's ids followed by the sampled completion ids (EOS included if it was
    sampled). `messages` is the conversation they encode, ending with the model's reply, whose content is
    not used (see _REPLY). What is appended: the rest of the reply's turn (the end-of-turn marker unless
    the model sampled a stop token) and the new messages with the generation prompt.
    """
    if not messages or messages[-1].role != "assistant":
        raise ValueError("messages must end with the assistant turn that context_ids end with")
    history = [*messages[:-1], ChatMessage(role="assistant", content=_REPLY)]
    suffix = text_after_reply(render(tokenizer, [*history, *new_messages], add_generation_prompt=True))
    check_new_messages_follow(suffix, new_messages)
    ids = token_ids(tokenizer, suffix)
    if context_ids and ids:
        final_end = token_ids(
            tokenizer, text_after_reply(render(tokenizer, history, add_generation_prompt=False))
        )
        if closes_turn(tokenizer, context_ids[-1], ids[0], final_end[:1]):
            ids = ids[1:]
    return [*context_ids, *ids]


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids of `text` without added special tokens. A fast tokenizer's Rust backend is called directly:
    the same ids without transformers' per-call Python work, which is most of a prompt's encoding time
    on the orchestrator's event loop (every group renders and encodes one)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.encode(text, add_special_tokens=False).ids)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def text_after_reply(rendered: str) -> str:
    """The rendered text after the placeholder reply, which must appear exactly once."""
    if rendered.count(_REPLY) != 1:
        raise TemplateMismatch(
            f"the chat template renders the model's reply {rendered.count(_REPLY)} times, not once"
        )
    return rendered[rendered.index(_REPLY) + len(_REPLY) :]


def text_parts(content: Any) -> list[str]:
    """A message content's text: the string itself, or the text of each `text` part (pictures left out)."""
    if isinstance(content, list):
        return [str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text"]
    return [str(content)]


def check_new_messages_follow(suffix: str, new_messages: Sequence[RenderMessage]) -> None:
    """Every new message's content (stripped: templates may trim it; each text part of one with parts) must
    be in the text after the reply."""
    for message in new_messages:
        if isinstance(message, ChatMessage):
            role, texts = message.role, [message.content]
        else:
            role, texts = message["role"], text_parts(message["content"])
        if any(text.strip() not in suffix for text in texts):
            raise TemplateMismatch(
                f"the chat template does not render the new {role} message after the model's reply"
            )


def closes_turn(tokenizer: Any, last_id: int, first_id: int, final_end: list[int]) -> bool:
    """Whether the sampled `last_id` already ends the reply's turn, so the suffix's `first_id` is not added.

    Yes if both are special tokens and the model sampled that very token (ChatML's `<|im_end|>`), or
    sampled the token the template ends a *final* reply with (`final_end`, the start of the text after
    the reply when nothing follows it) while a non-final reply ends with another (harmony: `<|return|>`
    sampled, `<|end|>` in history). A special token the template puts after a final reply too (a role
    marker of a template without end-of-turn markers) is kept.
    """
    if not (is_special(tokenizer, last_id) and is_special(tokenizer, first_id)):
        return False
    return last_id == first_id or final_end == [last_id]


def is_special(tokenizer: Any, token_id: int) -> bool:
    added = tokenizer.added_tokens_decoder.get(token_id)
    return token_id in tokenizer.all_special_ids or (added is not None and added.special)


IMAGE_PART_TYPES = ("image_url", "image", "input_image")
"""Content-part types that carry a picture: OpenAI chat's `image_url`, transformers' `image`, OpenAI
responses' `input_image`."""


def message_images(messages: Sequence[dict[str, Any]]) -> list[str]:
    """The pictures of `messages` in order, as URLs (data or http): one per image content part, which is
    one image placeholder in what a vision-language model's chat template renders. A picture given as an
    image object (PIL) becomes a PNG data URL. A part whose picture is missing is a ValueError."""
    found: list[str] = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES:
                found.append(check_picture(_picture_url(part), len(found) + 1))
    return found


MAX_PICTURE_BYTES = 16 * 2**20
"""The largest picture a prompt may carry inline (a data URL's decoded bytes)."""


def check_picture(url: str, number: int) -> str:
    """`url` unchanged if it is an http(s) URL (the server fetches it) or a data URL holding a readable picture
    of at most MAX_PICTURE_BYTES; else a ValueError naming picture `number` and what is wrong with it."""
    if not url.startswith("data:"):
        if url.startswith(("http://", "https://")):
            return url
        raise ValueError(f"picture {number}: {url[:40]!r} is neither a data URL nor an http(s) URL")
    header, _, payload = url.partition(",")
    if not header.startswith("data:image/") or not header.endswith(";base64"):
        raise ValueError(
            f"picture {number}: a data URL must be data:image/<type>;base64,…, not {header[:40]!r}"
        )
    if len(payload) * 3 // 4 > MAX_PICTURE_BYTES:
        raise ValueError(
            f"picture {number}: {len(payload) * 3 / 4 / 2**20:.1f} MiB, over the {MAX_PICTURE_BYTES // 2**20} MiB "
            "limit for a picture in a prompt"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except binascii.Error:
        raise ValueError(f"picture {number}: its data URL is not valid base64") from None
    from PIL import Image, UnidentifiedImageError

    try:
        Image.open(io.BytesIO(data)).verify()
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise ValueError(f"picture {number}: cannot be read as an image ({exc})") from None
    return url


def png_data_url(png: bytes) -> str:
    """PNG bytes as the data URL a content part carries."""
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _picture_url(part: dict[str, Any]) -> str:
    value: Any = part.get("image_url") or part.get("url") or part.get("image")
    if isinstance(value, dict):
        value = value.get("url")
    if isinstance(value, str) and value:
        return value
    if value is not None and hasattr(value, "save"):  # a PIL image
        out = io.BytesIO()
        value.save(out, format="PNG")
        return png_data_url(out.getvalue())
    raise ValueError(f"an {part.get('type')} content part without a picture (no url or image in it)")

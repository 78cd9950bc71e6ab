"""Multi-turn environments: the model speaks, the environment answers, until the environment says done.

Every turn continues the exact ids of the conversation so far (`continue_prompt`): the model's sampled ids
are never re-tokenised, and the text the environment adds between turns enters the episode with mask 0.
"""

from abc import abstractmethod
from typing import Any

from tidal.envs.base import ContextFull, Environment, Episode, Sampler, Task, answer_text, render_prompt
from tidal.envs.chat import IMAGE_PART_TYPES, continue_prompt, message_images, text_parts
from tidal.inference.types import ChatMessage

Message = dict[str, Any]


class MultiTurnEnv(Environment):
    """Subclasses implement `env_response`: the messages to answer the model's last turn with, or None to stop."""

    max_turns: int = 8
    """Model turns at most; the episode ends after this many whatever the environment says."""
    max_context_tokens: int | None = None
    """Stop before a turn whose prompt would exceed this many tokens (None: no limit)."""

    @abstractmethod
    async def env_response(self, task: Task, episode: Episode) -> list[Message] | None:
        """Called after each model turn (its text is `episode.messages[-1]`); `episode.info` is free state."""

    def setup_episode(self, task: Task, episode: Episode) -> None:
        """Initialise `episode.info` before the first turn (default: nothing)."""

    def initial_prompt(self, task: Task, sampler: Sampler) -> list[int]:
        return render_prompt(sampler.tokenizer, task.messages)

    async def rollout(self, task: Task, sampler: Sampler) -> Episode:
        prompt = self.initial_prompt(task, sampler)
        episode = Episode(
            prompt_ids=prompt, messages=[dict(m) for m in task.messages], images=message_images(task.messages)
        )
        self.setup_episode(task, episode)
        context, reply = prompt, None
        pictures: list[str] = []  # the pending reply's, sent with the turn it asks for
        for _ in range(self.max_turns):
            try:  # every turn sends all the pictures its ids hold
                turn = await sampler.complete(context, [*episode.images, *pictures])
            except ContextFull:
                if reply is None:
                    raise  # the task's own prompt does not fit: the rollout fails
                episode.info["truncated"] = True  # the reply is left out: no turn could follow it
                break
            if reply is not None:  # the environment's turn enters the episode once a model turn follows it
                episode.add_env_tokens(context[len(episode.context_ids) :])
                episode.messages.extend(reply)
                episode.images += pictures  # its pictures' placeholders follow the episode's in the ids
            episode.add_model_turn(turn)
            episode.messages.append({"role": "assistant", "content": turn.text})
            reply = await self.env_response(task, episode)
            if not reply or episode.num_turns >= self.max_turns:
                break
            context, pictures = next_context(sampler.tokenizer, episode, reply), message_images(reply)
            if self.max_context_tokens is not None and len(context) > self.max_context_tokens:
                episode.info["truncated"] = True
                break
        return episode


def next_context(tokenizer: Any, episode: Episode, reply: list[Message]) -> list[int]:
    """The episode's ids, the environment's reply and the next generation prompt (the episode is unchanged).
    The reply's pictures are rendered as the template renders a picture part (its image placeholder)."""
    history = [_chat_message(m) for m in episode.messages]
    new = [_new_message(m) for m in reply]
    return continue_prompt(tokenizer, episode.context_ids, history, new)


def _new_message(message: Message) -> ChatMessage | Message:
    """A new message as continuation renders it: text as a ChatMessage; content parts as a plain message
    whose picture parts are bare `image` parts (the template writes a placeholder; the picture itself
    travels beside the ids)."""
    content = message.get("content") or ""
    if not isinstance(content, list) or not message_images([message]):
        return _chat_message(message)
    parts = [
        {"type": "image"}
        if part.get("type") in IMAGE_PART_TYPES
        else {"type": "text", "text": str(part.get("text", ""))}
        for part in content
        if isinstance(part, dict)
    ]
    return {"role": message["role"], "content": parts}


def _chat_message(message: Message) -> ChatMessage:
    """A message as continuation renders it. A history message with content parts keeps its text parts: only
    the text after the model's reply is used, so its pictures need not be rendered again."""
    return ChatMessage(role=message["role"], content="".join(text_parts(message.get("content") or "")))


def model_replies(episode: Episode) -> list[str]:
    """The answer of every assistant turn (reasoning removed: `answer_text`), in order."""
    return [answer_text(str(m["content"])) for m in episode.messages if m["role"] == "assistant"]

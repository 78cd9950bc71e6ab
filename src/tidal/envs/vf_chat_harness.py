"""An in-process verifiers harness: one chat completion through the rollout's interception endpoint.

verifiers' own tool-less chat harness (`null`) is a PEP 723 script that `uv` installs and runs in a
subprocess, which needs `uv` and a package index at run time. This harness does the same exchange in the
calling process (verifiers allows it: the contract is that every model call goes through the interception
endpoint with the rollout's secret), so verifiers tasksets run offline, on CPU CI and on GPU nodes alike.
Resumed segments (a user simulator answering) relaunch it on the whole conversation, as `null` does.
"""

from typing import Any

import httpx
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire

HARNESS_ID = "tidal_vf_chat"


class TidalChatHarnessConfig(vf.HarnessConfig):
    """No options: sampling is tidal's (the rollout's sampler), not the harness's."""


class TidalChatHarness(vf.Harness[TidalChatHarnessConfig]):
    """Sends the task's conversation to the model once and returns; tools are not offered."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(
        self,
        ctx: vf.ModelContext,
        trace: vf.Trace,
        runtime: vf.Runtime,
        endpoint: str,
        secret: str,
        mcp_urls: dict[str, str],
        data: vf.TaskData,
        tool_interception_url: str | None = None,
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        else:
            messages += [message_to_wire(m) for m in prompt or []]
        async with httpx.AsyncClient(timeout=None) as http:  # the rollout's own deadlines bound it
            reply = await http.post(
                endpoint.rstrip("/") + "/chat/completions",
                json={"model": ctx.model, "messages": messages},
                headers={"Authorization": f"Bearer {secret}"},
            )
        if reply.status_code != 200:
            return vf.ProgramResult(
                exit_code=1, stdout="", stderr=f"HTTP {reply.status_code}: {reply.text[:2000]}"
            )
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["TidalChatHarness"]

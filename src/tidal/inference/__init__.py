"""Inference: a real vLLM OpenAI server with RL routes (pause, weight updates, versions) and its client."""

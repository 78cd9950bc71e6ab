"""Orchestrator: samples tasks, runs rollouts against inference, scores them, batches them for the trainer."""

"""Monitoring: metrics as JSON lines, console summaries and optional Weights & Biases."""

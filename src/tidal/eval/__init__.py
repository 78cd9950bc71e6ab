"""Evaluation: `tidal eval` runs environments against a model and reports avg@k / pass@k with intervals."""

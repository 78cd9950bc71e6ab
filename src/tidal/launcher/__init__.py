"""The launcher process role: `tidal rl` starts inference, orchestrator and trainer and supervises them."""

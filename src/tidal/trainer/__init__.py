"""The trainer process role: model loading, parallelism, SFT (and later RL) training loops, checkpoints."""

"""Environments: task generators and reward functions (the full environment protocol arrives with RL)."""

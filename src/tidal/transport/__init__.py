"""How data crosses processes: weights from the trainer to inference (filesystem, NCCL)."""

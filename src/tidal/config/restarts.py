"""Schema of `[restarts]`: what `tidal rl` does when one of its processes dies."""

from pydantic import Field

from tidal.config.base import Config


class RestartsConfig(Config):
    """A process of the run that dies (an inference replica or its vLLM server, the trainer, the
    orchestrator) is restarted in place while the others go on; `tidal node` does the same on each node of a
    cluster run. Past `max_restarts` the run stops with a one-line reason. Every failure and recovery is a
    line of the launcher's output and a record in <output_dir>/events.jsonl (README, "Failures")."""

    max_restarts: int = Field(default=3, ge=0)
    """Restarts each role may have within `window` (each inference replica counts on its own); the next
    failure stops the run. 0: the first failure stops the run, naming the process that failed. Runs that
    publish weights by NCCL broadcast or CUDA IPC never restart (a broadcast group cannot take a process back;
    a restarted trainer's shared buffer is a new one)."""
    window: float = Field(default=3600.0, gt=0)
    """Seconds over which a role's restarts are counted: failures further apart never stop the run."""

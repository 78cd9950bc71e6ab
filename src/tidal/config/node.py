"""Schemas of the node agents, `tidal node` and `tidal sft-node`: a cluster run's config plus which node this
is and where the others are."""

from typing import Any

from pydantic import Field, field_validator

from tidal.config.base import Config
from tidal.config.rl import RLConfig
from tidal.config.sft import SFTConfig


class NodeFields(Config):
    """Which node of a cluster run this is; without these flags the agent reads Slurm's variables."""

    node_index: int | None = Field(default=None, ge=0)
    """This node's index (inference nodes first, then trainer nodes). Default: SLURM_NODEID."""
    addresses: list[str] | None = None
    """Every node's address by index, e.g. "10.0.0.1,10.0.0.2" (or a TOML list). Default: the NodeAddr
    of each node of SLURM_JOB_NODELIST, from `scontrol` (node names need not resolve as host names)."""
    run_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9._-]+$")
    """Names this run among restarts (torchrun's rendezvous id, the done markers). Default:
    slurm-<SLURM_JOB_ID>-<SLURM_RESTART_COUNT>."""

    @field_validator("addresses", mode="before")
    @classmethod
    def _split_commas(cls, value: Any) -> Any:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",")]
        return value

    @field_validator("addresses")
    @classmethod
    def _no_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or any(not a for a in value)):
            raise ValueError("give every node's address, comma-separated")
        return value


class NodeConfig(NodeFields, RLConfig):
    """`tidal node @ <output_dir>/slurm/rl.toml`: run this node's share of a cluster `tidal rl` (its
    inference replicas, its trainer ranks, the orchestrator if placed here). The Slurm job starts it on
    every node; it is not meant to be started by hand. Without the flags below it reads Slurm's variables."""


class SFTNodeConfig(NodeFields, SFTConfig):
    """`tidal sft-node @ <output_dir>/slurm/sft.toml`: run this node's share of a cluster `tidal sft`:
    torchrun with deployment.num_trainer_ranks ranks, joined by a c10d rendezvous on the first node. The
    Slurm job (or each pod) starts it on every node; it is not meant to be started by hand. Without the
    flags below it reads Slurm's variables."""

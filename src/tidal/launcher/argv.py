"""The command lines the launchers start: `python -m tidal <command>` and torchrun around it (pure)."""

import sys
from pathlib import Path


def tidal_argv(command: str, config_path: Path) -> list[str]:
    return [sys.executable, "-m", "tidal", command, "@", str(config_path)]


def torchrun_argv(
    command: str,
    config_path: Path,
    num_ranks: int,
    num_nodes: int = 1,
    rendezvous: str | None = None,
    run_id: str = "tidal",
    local_addr: str | None = None,
    is_host: bool | None = None,
) -> list[str]:
    """torchrun starting `num_ranks` processes of `tidal <command> @ config_path` on this node. One node:
    standalone. Several: every node's torchrun joins the c10d rendezvous at `rendezvous` (host:port on the
    first trainer node) under `run_id`, and the rendezvous numbers nodes and ranks (a node rank given to
    torchrun would be ignored: it only counts for its static rendezvous). `local_addr`: the address the
    other nodes reach this one at (else torchrun uses the host name, which may not resolve there);
    `is_host`: whether this node hosts the rendezvous store (else torchrun guesses from the host name)."""
    if num_nodes == 1:
        where = ["--standalone"]
    else:
        assert rendezvous is not None, "several trainer nodes need a rendezvous endpoint"
        where = ["--nnodes", str(num_nodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", rendezvous,
                 "--rdzv-id", run_id]  # fmt: skip
        if local_addr is not None:
            where += ["--local-addr", local_addr]
        if is_host is not None:
            where += ["--rdzv-conf", f"is_host={int(is_host)}"]
    return [
        sys.executable, "-m", "torch.distributed.run", *where, "--nproc-per-node", str(num_ranks),
        "-m", "tidal", command, "@", str(config_path),
    ]  # fmt: skip


def trainer_argv(
    config_path: Path,
    num_ranks: int,
    num_nodes: int = 1,
    rendezvous: str | None = None,
    run_id: str = "tidal",
    local_addr: str | None = None,
    is_host: bool | None = None,
) -> list[str]:
    """`tidal rl`'s trainer: `tidal trainer` itself for one rank, else torchrun with `num_ranks` per node
    (`torchrun_argv`: on several nodes joined by a c10d rendezvous)."""
    if num_ranks == 1 and num_nodes == 1:
        return tidal_argv("trainer", config_path)
    return torchrun_argv(
        "trainer", config_path, num_ranks, num_nodes, rendezvous, run_id, local_addr, is_host
    )

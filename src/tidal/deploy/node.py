"""`tidal node` and `tidal sft-node`: one node's share of a cluster `tidal rl` / `tidal sft` run, started on
every node by the Slurm job (or in every pod).

The node learns which it is and where the others are — from its flags, else from Slurm: its index is
SLURM_NODEID, the addresses are the NodeAddr of each node of SLURM_JOB_NODELIST as `scontrol` reports them
(node names need not resolve as host names) — and runs its roles with the launcher's own supervision
(tidal.launcher.node.NodeLauncher; for SFT, torchrun joined at the first node: tidal.launcher.sft.run_node).
The parsing of scontrol's output is pure and tested without Slurm.
"""

import ipaddress
import os
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence

from tidal.config.deployment import DeploymentConfig
from tidal.config.node import NodeConfig, SFTNodeConfig
from tidal.errors import UserError
from tidal.launcher.node import NodeLauncher
from tidal.launcher.plan import ClusterNode, place
from tidal.launcher.sft import run_node

Scontrol = Callable[[Sequence[str]], str]
"""Runs `scontrol <args>` and returns its stdout (replaced by canned output in tests)."""


def run_scontrol(args: Sequence[str]) -> str:
    try:
        result = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise UserError(
            "scontrol not found: run the node agent inside a Slurm job, or pass --addresses"
        ) from None
    if result.returncode != 0:
        raise UserError(f"scontrol {' '.join(args)} failed: {result.stderr.strip() or result.stdout.strip()}")
    return result.stdout


def parse_hostnames(text: str) -> list[str]:
    """`scontrol show hostnames n[1-2]` → ["n1", "n2"] (the job's node order: SLURM_NODEID indexes it)."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def parse_node_addrs(text: str) -> dict[str, str]:
    """`scontrol -o show node LIST` (one line per node) → {NodeName: NodeAddr}."""
    addrs = {}
    for line in text.splitlines():
        fields = dict(part.split("=", 1) for part in line.split() if "=" in part)
        if "NodeName" in fields:
            addrs[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    return addrs


def as_ip(addr: str, node: str, resolve: Callable[[str], str] = socket.gethostbyname) -> str:
    """An IP address for a NodeAddr: itself if it is one, else what it resolves to here."""
    try:
        return str(ipaddress.ip_address(addr))
    except ValueError:
        pass
    try:
        return resolve(addr)
    except OSError:
        raise UserError(
            f"node {node}: its NodeAddr {addr!r} does not resolve here; set NodeAddr in slurm.conf to an IP "
            f"address or pass --addresses"
        ) from None


def slurm_addresses(
    nodelist: str, scontrol: Scontrol = run_scontrol, resolve: Callable[[str], str] = socket.gethostbyname
) -> tuple[list[str], list[str]]:
    """(node names, their IP addresses) of a job's node list, in SLURM_NODEID order."""
    names = parse_hostnames(scontrol(["show", "hostnames", nodelist]))
    addrs = parse_node_addrs(scontrol(["-o", "show", "node", nodelist]))
    missing = [name for name in names if name not in addrs]
    if missing:
        raise UserError(f"scontrol show node did not report node(s) {', '.join(missing)}")
    return names, [as_ip(addrs[name], name, resolve) for name in names]


def resolve_node(
    config: NodeConfig | SFTNodeConfig, env: Mapping[str, str], scontrol: Scontrol = run_scontrol,
    resolve: Callable[[str], str] = socket.gethostbyname,
) -> ClusterNode:  # fmt: skip
    """This node's index, every node's address and name, and the run id: from the flags, else from Slurm."""
    deploy = config.deployment
    num_nodes = deploy.num_nodes
    if isinstance(deploy, DeploymentConfig):
        counts = f"{deploy.num_inference_nodes} inference + {deploy.num_trainer_nodes} trainer"
    else:
        counts = f"{deploy.num_trainer_nodes} trainer"
    index = config.node_index
    if index is None:
        if "SLURM_NODEID" not in env:
            raise UserError("node_index: not given and SLURM_NODEID is not set (not inside a Slurm job?)")
        index = int(env["SLURM_NODEID"])
    if config.addresses is not None:
        names = addresses = list(config.addresses)
    elif "SLURM_JOB_NODELIST" in env:
        names, addresses = slurm_addresses(env["SLURM_JOB_NODELIST"], scontrol, resolve)
    else:
        raise UserError("addresses: not given and SLURM_JOB_NODELIST is not set (not inside a Slurm job?)")
    if len(addresses) != num_nodes:
        raise UserError(f"deployment needs {num_nodes} nodes ({counts}), the job has {len(addresses)}")
    if index >= num_nodes:
        raise UserError(f"node_index: {index} is not below the number of nodes ({num_nodes})")
    run_id = config.run_id
    if run_id is None:
        job = env.get("SLURM_JOB_ID")
        run_id = f"slurm-{job}-{env.get('SLURM_RESTART_COUNT', '0')}" if job else "tidal"
    return ClusterNode(index=index, addresses=tuple(addresses), name=names[index], run_id=run_id)


def main(config: NodeConfig) -> int:
    if config.deployment.type == "local":
        raise UserError(
            'deployment.type: `tidal node` runs one node of a cluster run; "local" runs use `tidal rl`'
        )
    node = resolve_node(config, os.environ)
    roles = place(config.deployment).roles(node.index)
    print(
        f"tidal {node.label}: {', '.join(roles)}; nodes {', '.join(node.addresses)}; run {node.run_id}"
        + ("; resuming" if config.resume else ""),
        flush=True,
    )
    return NodeLauncher(config, node).run()


def sft_main(config: SFTNodeConfig) -> int:
    if config.deployment.type == "local":
        raise UserError(
            'deployment.type: `tidal sft-node` runs one node of a cluster run; "local" runs use `tidal sft`'
        )
    node = resolve_node(config, os.environ)
    print(
        f"tidal {node.label}: trainer, {config.deployment.num_trainer_ranks} rank(s); nodes "
        f"{', '.join(node.addresses)}; run {node.run_id}" + ("; resuming" if config.resume else ""),
        flush=True,
    )
    return run_node(config, node)

"""One node's roles of a cluster `tidal rl` run, under the supervision a local run has
(tidal.launcher.supervisor): its inference replicas, its trainer node's torchrun (joined to the other trainer
nodes' by a c10d rendezvous), the orchestrator if placed there. `tidal node` (tidal.deploy.node) starts it on
every node of the job.

Logs and configs are named `<name>_node<K>`, lines and errors start with the node's label. A node with the
trainer or the orchestrator ends when they have, marking itself done in the output dir; a node with
replicas serves until every such node has marked itself done in this run.
"""

from pathlib import Path

from tidal import run_layout
from tidal.config.rl import RLConfig
from tidal.launcher.argv import trainer_argv
from tidal.launcher.plan import ORCHESTRATOR, ClusterNode
from tidal.launcher.supervisor import Supervisor


class NodeLauncher(Supervisor):
    """The roles `node` runs of a cluster run; `run()` returns the exit code of `tidal node`."""

    def __init__(self, config: RLConfig, node: ClusterNode):
        super().__init__(
            config, node.index, f"tidal {node.label}", f"_node{node.index}", node.label, node.addresses
        )
        self.node = node
        self.started = 0.0
        """When this node started the run, as the output dir's storage stamps it."""
        self._marked_done = False

    def _begin(self) -> None:
        self.started = run_layout.mark_node(self.out, self.index, "started", self.node.run_id)

    def _trainer_argv(self, config_path: Path) -> list[str]:
        deploy, node = self.config.deployment, self.node
        first = self.placement.trainer_nodes[0]
        return trainer_argv(
            config_path,
            deploy.num_trainer_ranks,
            num_nodes=len(self.placement.trainer_nodes),
            rendezvous=f"{node.addresses[first]}:{deploy.rendezvous_port}",
            run_id=node.run_id,
            local_addr=node.addresses[self.index],
            is_host=self.index == first,
        )

    def _started_line(self, num_replicas: int, local: list[int], started: list[str], roles: str) -> str:
        if started:
            return roles + (f" ({num_replicas} inference replicas up)" if ORCHESTRATOR in self.here else "")
        return f"{len(local)} inference replica(s) up; serving until the run ends"

    def _may_end(self) -> bool:
        """Once its trainer or orchestrator ended well, the node marks itself done; a node with replicas
        serves on until every node with the trainer or the orchestrator has."""
        if self.children.main() and not self._marked_done:
            run_layout.mark_node(self.out, self.index, "done", self.node.run_id)
            self._marked_done = True
        return not self.children.replicas or self._main_nodes_done()

    def _main_nodes_done(self) -> bool:
        """Whether every node with the trainer or the orchestrator has finished this run."""
        nodes = {*self.placement.trainer_nodes, self.placement.orchestrator_node}
        return all(run_layout.node_done(self.out, n, self.node.run_id, self.started) for n in nodes)

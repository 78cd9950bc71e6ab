"""Which node runs which role, from `[deployment]` alone (pure; every backend renders from this).

Nodes are numbered inference nodes first, then trainer nodes; with `type = "local"` there is one node and
it runs everything. The orchestrator joins the first node of `deployment.orchestrator_node`'s role.
`tidal sft` has trainer nodes only, numbered from 0. `ClusterNode` is which node of a cluster run this
process runs, and where the others are.
"""

from dataclasses import dataclass

from tidal.config.deployment import DeploymentConfig
from tidal.config.rl import RLConfig
from tidal.config.sft import SFTConfig

INFERENCE, TRAINER, ORCHESTRATOR = "inference", "trainer", "orchestrator"

ClusterRun = RLConfig | SFTConfig
"""A run config the cluster backends render: `tidal rl`'s or `tidal sft`'s."""


@dataclass(frozen=True)
class RunKind:
    """What differs between the cluster jobs of `tidal rl` and `tidal sft`."""

    command: str
    """`tidal <command>` renders and submits the job."""
    agent: str
    """`tidal <agent>` runs one node's share of it inside the job."""
    roles: tuple[str, ...]
    """The roles that get nodes of their own, in node order."""

    @property
    def config_file(self) -> str:
        """Name of the run config the job's nodes load."""
        return f"{self.command}.toml"


RL_RUN = RunKind(command="rl", agent="node", roles=(INFERENCE, TRAINER))
SFT_RUN = RunKind(command="sft", agent="sft-node", roles=(TRAINER,))


def kind_of(config: ClusterRun) -> RunKind:
    return SFT_RUN if isinstance(config, SFTConfig) else RL_RUN


def role_nodes(config: ClusterRun, role: str) -> int:
    """How many nodes of a cluster run have `role` (inference or trainer)."""
    deploy = config.deployment
    if role == INFERENCE:
        assert isinstance(deploy, DeploymentConfig)
        return deploy.num_inference_nodes
    return deploy.num_trainer_nodes


@dataclass(frozen=True)
class Placement:
    """Node indexes of each role."""

    inference_nodes: tuple[int, ...]
    trainer_nodes: tuple[int, ...]
    orchestrator_node: int

    @property
    def num_nodes(self) -> int:
        return len({*self.inference_nodes, *self.trainer_nodes, self.orchestrator_node})

    def roles(self, node: int) -> tuple[str, ...]:
        """The roles node `node` runs, in start order (inference first: the others wait for it)."""
        roles = []
        if node in self.inference_nodes:
            roles.append(INFERENCE)
        if node in self.trainer_nodes:
            roles.append(TRAINER)
        if node == self.orchestrator_node:
            roles.append(ORCHESTRATOR)
        return tuple(roles)

    def trainer_node_rank(self, node: int) -> int:
        """torchrun's node rank of a trainer node (0 on the one that hosts the rendezvous)."""
        return self.trainer_nodes.index(node)


@dataclass(frozen=True)
class ClusterNode:
    """The node a launcher runs in a cluster run (`tidal node`, `tidal sft-node`): its index, every node's
    address by index, its name for messages, and the run's id (torchrun's rendezvous id; the done markers of
    one run are told from an earlier one's by it)."""

    index: int
    addresses: tuple[str, ...]
    name: str
    run_id: str

    @property
    def label(self) -> str:
        return f"node {self.index} ({self.name})"


def place(deployment: DeploymentConfig) -> Placement:
    if deployment.type == "local":
        return Placement(inference_nodes=(0,), trainer_nodes=(0,), orchestrator_node=0)
    inference = tuple(range(deployment.num_inference_nodes))
    trainer = tuple(range(len(inference), len(inference) + deployment.num_trainer_nodes))
    orchestrator = trainer[0] if deployment.orchestrator_node == TRAINER else inference[0]
    return Placement(inference_nodes=inference, trainer_nodes=trainer, orchestrator_node=orchestrator)

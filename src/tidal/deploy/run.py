"""`tidal rl` and `tidal sft`: where the run goes, by `deployment.type`.

`local` runs here under tidal.launcher (rl.main, sft.main); `slurm` renders and submits a batch job
(tidal.deploy.slurm), `kubernetes` renders and applies manifests (tidal.deploy.kubernetes). A rank inside
torchrun is always local: its `tidal sft` trains. This is the one place that chooses, so the launcher, which
the cluster's node agents (tidal.deploy.node) also run, never imports deploy. Each command imports only its
own launcher module (and a backend only when it is chosen), as when the launcher chose.
"""

import os

from tidal.config.rl import RLConfig
from tidal.config.sft import SFTConfig


def _submit_to_cluster(config: RLConfig | SFTConfig) -> int | None:
    """Submit to the cluster `deployment.type` names; None for a local run."""
    if config.deployment.type == "slurm":
        from tidal.deploy import slurm

        return slurm.submit(config)
    if config.deployment.type == "kubernetes":  # its output_dir is on a volume of its own, not read here
        from tidal.deploy import kubernetes

        return kubernetes.launch(config)
    return None


def _cluster_dry_run(config: RLConfig | SFTConfig) -> str | None:
    """What the cluster's dry run shows (Slurm: the batch script and the config it submits; Kubernetes: the
    manifests, written and listed); None for a local run."""
    if config.deployment.type == "slurm":
        from tidal.deploy import slurm

        return slurm.dry_run(config)
    if config.deployment.type == "kubernetes":
        from tidal.deploy import kubernetes

        return kubernetes.dry_run(config)
    return None


def rl_main(config: RLConfig) -> int:
    from tidal.launcher import rl

    if config.deployment.type == "slurm" and rl.say_if_complete(config):
        return 0
    submitted = _submit_to_cluster(config)
    return rl.main(config) if submitted is None else submitted


def rl_dry_run(config: RLConfig) -> str:
    """The resolved config of every process `tidal rl` would start, as the TOML files it would write;
    on a cluster, what its dry run shows."""
    shown = _cluster_dry_run(config)
    if shown is not None:
        return shown
    from tidal.launcher import rl

    return rl.dry_run(config)


def sft_main(config: SFTConfig) -> int:
    from tidal.launcher import sft

    submitted = None if sft.in_torchrun(os.environ) else _submit_to_cluster(config)
    return sft.main(config) if submitted is None else submitted


def sft_dry_run(config: SFTConfig) -> str:
    """The resolved config (and the torchrun a local run with several ranks starts); on a cluster, what its
    dry run shows."""
    shown = _cluster_dry_run(config)
    if shown is not None:
        return shown
    from tidal.launcher import sft

    return sft.dry_run(config)

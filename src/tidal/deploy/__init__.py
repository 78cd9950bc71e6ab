"""Where `tidal rl` and `tidal sft` run (run.py): here under tidal.launcher, or on a cluster: Slurm batch
scripts, Kubernetes manifests, and each node's share of the run (node.py)."""

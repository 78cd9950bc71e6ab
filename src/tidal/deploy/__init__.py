"""Running `tidal rl` on a cluster: role placement, Slurm batch scripts, Kubernetes manifests."""

"""`tidal sft`: train in this process or start torchrun for several ranks on this machine; and the torchrun of
one cluster node (`tidal sft-node`, tidal.deploy.node). A Slurm or Kubernetes run is handed over by
tidal.deploy.run before this module is reached.

Inside torchrun (RANK or LOCAL_RANK set: a torchrun someone started by hand, or ours) `tidal sft` is one of
its ranks and trains. Otherwise (`deployment.type = "local"`) it trains here with one rank, and with several
starts `python -m torch.distributed.run --nproc-per-node N -m tidal sft @ <output_dir>/configs/sft.toml`
(the resolved config) and supervises it: its output is ours, its exit code is ours, SIGTERM or SIGINT reach
every rank as SIGTERM (each finishes its step and checkpoints), and no process of it is left when `tidal sft`
returns.
"""

import contextlib
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from tidal import run_layout
from tidal.config.deployment import usable_cores
from tidal.config.node import NodeFields
from tidal.config.sft import SFTConfig
from tidal.errors import UserError
from tidal.launcher.argv import torchrun_argv
from tidal.process import ManagedProcess

if TYPE_CHECKING:
    from tidal.launcher.plan import ClusterNode

RANKS_STOP_GRACE = 45.0
"""Seconds the ranks get after SIGTERM (to finish the step and checkpoint) before SIGKILL: longer than the
30 s torchrun itself gives its workers after its own SIGTERM, so torchrun ends by itself first."""
POLL_SECONDS = 0.5


def in_torchrun(env: Mapping[str, str]) -> bool:
    return "RANK" in env or "LOCAL_RANK" in env


def main(config: SFTConfig) -> int:
    if in_torchrun(os.environ):
        check_world_size(config, os.environ)
        return _train(config)
    from tidal.models import prepare_model_files

    # once, before torchrun's ranks start (each would wait on the lock of the one converting)
    prepare_model_files(config.model.name, lambda line: print(f"tidal sft: {line}", flush=True))
    if config.deployment.num_trainer_ranks == 1:
        if "trainer_gpus" in config.deployment.model_fields_set:  # before anything initialises CUDA here
            os.environ["CUDA_VISIBLE_DEVICES"] = _devices(config.deployment.trainer_gpus)
        return _train(config)
    return run_local(config)


def _train(config: SFTConfig) -> int:
    from tidal.trainer.sft import main as train

    return train(config)


def check_world_size(config: SFTConfig, env: Mapping[str, str]) -> None:
    """A rank whose torchrun started another number of ranks than `[deployment]` says stops (on every rank):
    the setting would be ignored otherwise. Under a torchrun started by hand without those keys it decides."""
    deploy = config.deployment
    if not {"num_trainer_ranks", "num_trainer_nodes"} & deploy.model_fields_set:
        return
    world = int(env.get("WORLD_SIZE", "1"))
    if world != deploy.total_trainer_ranks:
        raise UserError(
            f"deployment: {deploy.num_trainer_nodes} node(s) × {deploy.num_trainer_ranks} rank(s) = "
            f"{deploy.total_trainer_ranks} trainer ranks, but this torchrun runs {world}; make them agree (or "
            "leave num_trainer_nodes / num_trainer_ranks unset under a torchrun you start yourself)"
        )


def run_local(config: SFTConfig) -> int:
    """Several ranks on this machine: torchrun, supervised; returns its exit code."""
    out, deploy = config.output_dir, config.deployment
    # here, once, rather than from every rank
    run_layout.check_output_dir(
        run_layout.sft_metrics_path(out), run_layout.trainer_checkpoints_dir(out), config.resume
    )
    on_gpu = uses_gpus(config)
    if on_gpu:
        deploy.check_trainer_gpus()
    path = write_text(local_config_path(config), resolved_toml(config))
    argv = torchrun_argv("sft", path, deploy.num_trainer_ranks)
    env = rank_env(config, on_gpu)
    where = (
        f"GPUs {env['CUDA_VISIBLE_DEVICES']}" if on_gpu else f"CPU, {env['OMP_NUM_THREADS']} thread(s) each"
    )
    print(f"tidal sft: torchrun with {deploy.num_trainer_ranks} ranks ({where}); config {path}", flush=True)
    ended = supervise(argv, env, "tidal sft")
    if ended.signal is None and ended.code != 0:
        print(f"tidal sft: torchrun exited with code {ended.code}", file=sys.stderr, flush=True)
    return ended.code


def run_node(config: SFTConfig, node: "ClusterNode") -> int:
    """One node of a cluster run: torchrun with this node's ranks, joined at the first node's address.
    A torchrun that fails is a UserError naming the node (the job then stops the other nodes)."""
    deploy = config.deployment
    on_gpu = uses_gpus(config)
    if on_gpu:
        deploy.check_trainer_gpus()
    path = run_layout.configs_dir(config.output_dir) / f"sft_node{node.index}.toml"
    write_text(path, rank_config_toml(config))
    argv = torchrun_argv(
        "sft",
        path,
        deploy.num_trainer_ranks,
        num_nodes=deploy.num_trainer_nodes,
        rendezvous=f"{node.addresses[0]}:{deploy.rendezvous_port}",
        run_id=node.run_id,
        local_addr=node.addresses[node.index],
        is_host=node.index == 0,
    )
    ended = supervise(argv, rank_env(config, on_gpu), f"tidal {node.label}")
    if ended.signal is None and ended.code != 0:
        raise UserError(f"{node.label}: trainer (torchrun, config {path}) exited with code {ended.code}")
    return ended.code


@dataclass(frozen=True)
class Ended:
    """How a supervised torchrun ended: its exit code (128 + the signal when a signal stopped it)."""

    code: int
    signal: int | None = None
    """The signal we received and passed on as SIGTERM, if that is why it ended."""


def supervise(argv: Sequence[str], env: dict[str, str], prefix: str) -> Ended:
    """Run `argv` (torchrun) in its own session with our stdout and stderr until it ends or we get SIGTERM /
    SIGINT; then every process of it gets SIGTERM (its ranks run in sessions of their own: they are
    tracked as they appear) and SIGKILL after RANKS_STOP_GRACE. Nothing of it runs when this returns."""
    child = ManagedProcess("trainer", argv, None, env)
    received: list[int] = []

    def on_signal(signum: int, frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        child.start()
        assert child.process is not None
        while not received and child.poll() is None:
            child.adopt_descendants()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.process.wait(POLL_SECONDS)
        if received:
            print(
                f"{prefix}: signal {received[0]}: stopping the ranks (each checkpoints its last step)",
                file=sys.stderr,
                flush=True,
            )
            child.adopt_descendants()
            child.stop(RANKS_STOP_GRACE)
            return Ended(128 + received[0], received[0])
        code = child.poll()
        assert code is not None
        return Ended(128 - code if code < 0 else code)
    finally:
        child.stop()  # what a torchrun that ended by itself left behind
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def uses_gpus(config: SFTConfig) -> bool:
    if config.device != "auto":
        return config.device == "cuda"
    if "+cpu" in metadata.version("torch"):  # a CPU build sees no GPU, and importing it takes seconds
        return False
    import torch  # only here: the launcher itself needs no torch

    return torch.cuda.is_available()


def threads_per_rank(config: SFTConfig, num_cpus: int | None = None) -> int:
    """Each rank's share of this node's cores on CPU runs (what the ranks set themselves too)."""
    cores = num_cpus or len(usable_cores())
    return config.cpu_threads() or max(1, cores // config.deployment.num_trainer_ranks)


def rank_env(config: SFTConfig, on_gpu: bool) -> dict[str, str]:
    """torchrun's environment: the node's trainer GPUs on GPU runs; on CPU none, and each rank's threads
    (torchrun would set OMP_NUM_THREADS=1 otherwise)."""
    env = {"PYTHONUNBUFFERED": "1"}
    if on_gpu:
        env["CUDA_VISIBLE_DEVICES"] = _devices(config.deployment.trainer_gpus)
    else:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(threads_per_rank(config)))
    return env


def _devices(gpus: Sequence[int]) -> str:
    return ",".join(map(str, gpus))


def resolved_toml(config: SFTConfig) -> str:
    """Every key of the config resolved (what --dry-run prints, and the ranks of a local run load), without
    the cluster tables that do not apply (the schema refuses them for another deployment type)."""
    import tomli_w

    unused = {"slurm", "kubernetes"} - {config.deployment.type}
    return tomli_w.dumps(config.model_dump(mode="json", exclude_none=True, exclude=unused))


def rank_config_toml(config: SFTConfig) -> str:
    """What a cluster node's ranks load: the keys that were set (as in the job's own config, plus this node's
    `--resume`), without the node agent's own flags."""
    import tomli_w

    data = config.model_dump(
        mode="json", exclude_unset=True, exclude_none=True, exclude=set(NodeFields.model_fields)
    )
    return tomli_w.dumps(data)


def local_config_path(config: SFTConfig) -> Path:
    return run_layout.configs_dir(config.output_dir) / "sft.toml"


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def dry_run(config: SFTConfig) -> str:
    """The resolved config and the torchrun a local run with several ranks starts (a cluster run's:
    tidal.deploy.run)."""
    text = resolved_toml(config)
    ranks = config.deployment.num_trainer_ranks
    if ranks > 1:
        argv = torchrun_argv("sft", local_config_path(config), ranks)
        text = f"# tidal sft starts: {shlex.join(argv)}\n{text}"
    return text

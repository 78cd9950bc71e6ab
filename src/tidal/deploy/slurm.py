"""`tidal rl` and `tidal sft` with `deployment.type = "slurm"`: render one batch script and submit it with
sbatch.

`render_script` is pure (tested on the examples); `write_job` puts the script and the resolved run config it
runs into <output_dir>/slurm/; `submit` hands the script to `sbatch --parsable`. Inside the job one `srun`
starts the node agent (tidal.deploy.node: `tidal node` for RL, `tidal sft-node` for SFT) on every node;
everything else happens there.
"""

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from tidal import run_layout
from tidal.config.rl import RLConfig
from tidal.errors import UserError
from tidal.launcher.plan import ClusterRun, kind_of, place

NODE_SCRIPT_END = "TIDAL_NODE"


@dataclass(frozen=True)
class JobFiles:
    """Where a run's job lives: <output_dir>/slurm/."""

    script: Path
    config: Path
    log: Path
    """The job's log, with `%j` for the job id (sbatch's pattern)."""

    @classmethod
    def of(cls, config: ClusterRun) -> "JobFiles":
        root = Path(config.output_dir) / "slurm"
        name = config.slurm.job_name
        config_file = root / kind_of(config).config_file
        return cls(script=root / f"{name}.sbatch", config=config_file, log=root / f"{name}-%j.log")

    def log_of(self, job_id: str) -> Path:
        return self.log.with_name(self.log.name.replace("%j", job_id))


def gpus_per_node(config: ClusterRun) -> int:
    """`slurm.gpus_per_node`, else the larger of the deployment's per-node GPU lists."""
    if config.slurm.gpus_per_node is not None:
        return config.slurm.gpus_per_node
    return config.deployment.node_gpus


def job_config(config: ClusterRun, workdir: Path) -> ClusterRun:
    """The run config the job runs: the output dir made absolute (the nodes start in `workdir`, but the
    path is printed and compared across nodes)."""
    out = Path(config.output_dir)
    return config.model_copy(update={"output_dir": out if out.is_absolute() else (workdir / out).resolve()})


def config_toml(config: ClusterRun) -> str:
    """The run config as TOML with only what was set (defaults stay defaults, and keys that `tidal rl` sets
    from the top stay unset in the sub-tables, as its validation requires)."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_unset=True, exclude_none=True))


def _placement_comment(config: ClusterRun) -> list[str]:
    deploy = config.deployment
    if not isinstance(config, RLConfig):
        return [
            f"# {deploy.num_trainer_nodes} node(s), one `tidal sft-node` on each (SLURM_NODEID is the node index):",
            f"#   torchrun with {deploy.num_trainer_ranks} rank(s) each, c10d rendezvous on node 0 at port "
            f"{deploy.rendezvous_port}",
        ]
    plan = place(config.deployment)

    def span(nodes: tuple[int, ...]) -> str:
        return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"

    return [
        f"# {plan.num_nodes} nodes, one `tidal node` on each (SLURM_NODEID is the node index):",
        f"#   inference: {span(plan.inference_nodes)}, {config.deployment.num_replicas} vLLM replica(s) each",
        f"#   trainer:   {span(plan.trainer_nodes)}, {config.deployment.num_trainer_ranks} rank(s) each",
        f"#   orchestrator: node {plan.orchestrator_node}",
    ]


def _environment(config: ClusterRun) -> list[str]:
    """Script lines that set what every node's processes need in their environment (srun passes it on)."""
    if not isinstance(config, RLConfig):
        return ["export PYTHONUNBUFFERED=1"]
    return [
        "# The replicas' admin routes (weight updates) listen on every interface: they need a token. A new one",
        "# for each start of the job, in its environment only (srun passes it to every node).",
        'if [ -z "${TIDAL_ADMIN_TOKEN:-}" ]; then',
        "    TIDAL_ADMIN_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')",
        "fi",
        "export TIDAL_ADMIN_TOKEN PYTHONUNBUFFERED=1",
    ]


def render_script(config: ClusterRun, files: JobFiles, python: str, workdir: Path) -> str:
    """The batch script (pure). `config` is the job's (absolute output_dir)."""
    slurm, num_nodes, kind = config.slurm, config.deployment.num_nodes, kind_of(config)
    options = [
        f"--job-name={slurm.job_name}",
        f"--nodes={num_nodes}",
        "--ntasks-per-node=1",
    ]
    if slurm.exclusive:
        options.append("--exclusive")
    gpus = gpus_per_node(config)
    if gpus:
        options.append(f"--gpus-per-node={gpus}")
    for key in ("partition", "account", "time"):
        value = getattr(slurm, key)
        if value is not None:
            options.append(f"--{key}={value}")
    options += [
        f"--output={files.log}",
        "--open-mode=append",
        "--requeue" if slurm.requeue else "--no-requeue",
        f"--chdir={workdir}",
        *slurm.extra_sbatch,
    ]
    py = shlex.quote(python)
    setup = list(slurm.setup)
    srun = [
        "srun", f"--nodes={num_nodes}", f"--ntasks={num_nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "--export=ALL",
        *slurm.srun_args,
    ]  # fmt: skip
    lines = [
        "#!/bin/bash",
        f"# `tidal {kind.command}` on Slurm, rendered from the run config {files.config}",
        *_placement_comment(config),
        f"# Log: {files.log} (%j: the job id). Stop: scancel <job id>.",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
    ]
    if setup:
        lines += ["", "# setup: here, and on every node before tidal starts (below)", *setup]
    lines += [
        "",
        *_environment(config),
        "",
        "# A requeued job (node failure, preemption, scontrol requeue) resumes from the last checkpoint.",
        'resume=""',
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume="--resume"; fi',
        'echo "tidal: job $SLURM_JOB_ID (start ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST $resume"',
        "",
        f"read -r -d '' node_script <<'{NODE_SCRIPT_END}' || true",
        "set -euo pipefail",
        *setup,
        f'exec {py} -m tidal {kind.agent} @ {shlex.quote(str(files.config))} "$@"',
        NODE_SCRIPT_END,
        f'{shlex.join(srun)} bash -c "$node_script" tidal-node $resume',
    ]
    return "\n".join(lines) + "\n"


def _check(config: ClusterRun) -> None:
    """What the job would find wrong only on the nodes: for RL the per-process split, with stand-in
    addresses; for SFT a GPU per rank on GPU nodes."""
    if isinstance(config, RLConfig):
        from tidal.launcher.split import split_config

        num_nodes = place(config.deployment).num_nodes
        addresses = [f"node{i}" for i in range(num_nodes)]
        split_config(config, on_gpu=gpus_per_node(config) > 0, addresses=addresses)
    elif gpus_per_node(config) > 0:
        config.deployment.check_trainer_gpus()
    if NODE_SCRIPT_END in "\n".join(config.slurm.setup):
        raise UserError(f"slurm.setup: a command may not contain {NODE_SCRIPT_END!r}")


def render(config: ClusterRun, workdir: Path | None = None) -> tuple[ClusterRun, JobFiles, str]:
    """The job's config, its files and the script, checked."""
    workdir = (workdir or Path.cwd()).resolve()
    job = job_config(config, workdir)
    _check(job)
    files = JobFiles.of(job)
    return job, files, render_script(job, files, config.slurm.python or sys.executable, workdir)


def dry_run(config: ClusterRun) -> str:
    job, files, script = render(config)
    return f"# ---- {files.script} ----\n{script}\n# ---- {files.config} ----\n{config_toml(job)}"


def write_job(config: ClusterRun) -> JobFiles:
    job, files, script = render(config)
    files.script.parent.mkdir(parents=True, exist_ok=True)
    files.config.write_text(config_toml(job))
    files.script.write_text(script)
    return files


def _check_fresh(config: ClusterRun) -> None:
    """A run in output_dir is continued only with --resume (else the job would fail on the nodes)."""
    out = config.output_dir
    if not isinstance(config, RLConfig):
        run_layout.check_output_dir(
            run_layout.sft_metrics_path(out), run_layout.trainer_checkpoints_dir(out), config.resume
        )
    elif not config.resume and (run_layout.orchestrator_dir(out) / "metrics.jsonl").exists():
        raise UserError(f"output_dir {out} already holds a run; pass --resume or choose another --output-dir")


def submit(config: ClusterRun) -> int:
    _check_fresh(config)
    files = write_job(config)
    prefix = f"tidal {kind_of(config).command}"
    print(f"{prefix}: batch script {files.script}", flush=True)
    try:
        result = subprocess.run(
            ["sbatch", "--parsable", str(files.script)], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise UserError("sbatch not found: submit from a Slurm login node (--dry-run only renders)") from None
    if result.returncode != 0:
        raise UserError(f"sbatch failed: {(result.stderr or result.stdout).strip()}")
    job_id = result.stdout.strip().split(";")[0]
    print(f"{prefix}: submitted job {job_id}", flush=True)
    follow = f"  follow: tail -f {files.log_of(job_id)}"
    if isinstance(config, RLConfig):
        follow += f"   (each process: {files.script.parent.parent / 'logs'}/)"
    print(follow)
    print(f"  stop:   scancel {job_id}")
    return 0

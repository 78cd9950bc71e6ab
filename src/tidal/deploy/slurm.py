"""`tidal rl` with `deployment.type = "slurm"`: render one batch script and submit it with sbatch.

`render_script` is pure (tested on the examples); `write_job` puts the script and the resolved run config it
runs into <output_dir>/slurm/; `submit` hands the script to `sbatch --parsable`. Inside the job one `srun`
starts `tidal node` (tidal.deploy.node) on every node; everything else happens there.
"""

import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import tomli_w

from tidal import run_layout
from tidal.config.rl import RLConfig
from tidal.deploy.plan import place
from tidal.errors import UserError

NODE_SCRIPT_END = "TIDAL_NODE"


@dataclass(frozen=True)
class JobFiles:
    """Where a run's job lives: <output_dir>/slurm/."""

    script: Path
    config: Path
    log: Path
    """The job's log, with `%j` for the job id (sbatch's pattern)."""

    @classmethod
    def of(cls, config: RLConfig) -> "JobFiles":
        root = Path(config.output_dir) / "slurm"
        name = config.slurm.job_name
        return cls(script=root / f"{name}.sbatch", config=root / "rl.toml", log=root / f"{name}-%j.log")

    def log_of(self, job_id: str) -> Path:
        return self.log.with_name(self.log.name.replace("%j", job_id))


def gpus_per_node(config: RLConfig) -> int:
    """`slurm.gpus_per_node`, else the larger of the deployment's per-node GPU lists."""
    if config.slurm.gpus_per_node is not None:
        return config.slurm.gpus_per_node
    return max(len(config.deployment.inference_gpus), len(config.deployment.trainer_gpus))


def job_config(config: RLConfig, workdir: Path) -> RLConfig:
    """The run config the job runs: the output dir made absolute (the nodes start in `workdir`, but the
    path is printed and compared across nodes)."""
    out = Path(config.output_dir)
    return config.model_copy(update={"output_dir": out if out.is_absolute() else (workdir / out).resolve()})


def config_toml(config: RLConfig) -> str:
    """The run config as TOML with only what was set (defaults stay defaults, and keys that `tidal rl` sets
    from the top stay unset in the sub-tables, as its validation requires)."""
    return tomli_w.dumps(config.model_dump(mode="json", exclude_unset=True, exclude_none=True))


def _placement_comment(config: RLConfig) -> list[str]:
    plan, deploy = place(config.deployment), config.deployment

    def span(nodes: tuple[int, ...]) -> str:
        return f"node {nodes[0]}" if len(nodes) == 1 else f"nodes {nodes[0]}-{nodes[-1]}"

    return [
        f"# {plan.num_nodes} nodes, one `tidal node` on each (SLURM_NODEID is the node index):",
        f"#   inference: {span(plan.inference_nodes)}, {deploy.num_replicas} vLLM replica(s) each",
        f"#   trainer:   {span(plan.trainer_nodes)}, {deploy.num_trainer_ranks} rank(s) each",
        f"#   orchestrator: node {plan.orchestrator_node}",
    ]


def render_script(config: RLConfig, files: JobFiles, python: str, workdir: Path) -> str:
    """The batch script (pure). `config` is the job's (absolute output_dir)."""
    slurm, num_nodes = config.slurm, place(config.deployment).num_nodes
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
        f"# `tidal rl` on Slurm, rendered from the run config {files.config}",
        *_placement_comment(config),
        f"# Log: {files.log} (%j: the job id). Stop: scancel <job id>.",
        *(f"#SBATCH {option}" for option in options),
        "set -euo pipefail",
    ]
    if setup:
        lines += ["", "# setup: here, and on every node before tidal starts (below)", *setup]
    lines += [
        "",
        "# The replicas' admin routes (weight updates) listen on every interface: they need a token. A new one",
        "# for each start of the job, in its environment only (srun passes it to every node).",
        'if [ -z "${TIDAL_ADMIN_TOKEN:-}" ]; then',
        "    TIDAL_ADMIN_TOKEN=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \\n')",
        "fi",
        "export TIDAL_ADMIN_TOKEN PYTHONUNBUFFERED=1",
        "",
        "# A requeued job (node failure, preemption, scontrol requeue) resumes from the last checkpoint.",
        'resume=""',
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then resume="--resume"; fi',
        'echo "tidal: job $SLURM_JOB_ID (start ${SLURM_RESTART_COUNT:-0}) on $SLURM_JOB_NODELIST $resume"',
        "",
        f"read -r -d '' node_script <<'{NODE_SCRIPT_END}' || true",
        "set -euo pipefail",
        *setup,
        f'exec {py} -m tidal node @ {shlex.quote(str(files.config))} "$@"',
        NODE_SCRIPT_END,
        f'{shlex.join(srun)} bash -c "$node_script" tidal-node $resume',
    ]
    return "\n".join(lines) + "\n"


def _check(config: RLConfig) -> None:
    """What `tidal rl` would find wrong only on the nodes: the per-process split, with stand-in addresses."""
    from tidal.launcher.split import split_config

    num_nodes = place(config.deployment).num_nodes
    split_config(config, on_gpu=gpus_per_node(config) > 0, addresses=[f"node{i}" for i in range(num_nodes)])
    if NODE_SCRIPT_END in "\n".join(config.slurm.setup):
        raise UserError(f"slurm.setup: a command may not contain {NODE_SCRIPT_END!r}")


def render(config: RLConfig, workdir: Path | None = None) -> tuple[RLConfig, JobFiles, str]:
    """The job's config, its files and the script, checked."""
    workdir = (workdir or Path.cwd()).resolve()
    job = job_config(config, workdir)
    _check(job)
    files = JobFiles.of(job)
    return job, files, render_script(job, files, config.slurm.python or sys.executable, workdir)


def dry_run(config: RLConfig) -> str:
    job, files, script = render(config)
    return f"# ---- {files.script} ----\n{script}\n# ---- {files.config} ----\n{config_toml(job)}"


def write_job(config: RLConfig) -> JobFiles:
    job, files, script = render(config)
    files.script.parent.mkdir(parents=True, exist_ok=True)
    files.config.write_text(config_toml(job))
    files.script.write_text(script)
    return files


def submit(config: RLConfig) -> int:
    metrics = run_layout.orchestrator_dir(config.output_dir) / "metrics.jsonl"
    if not config.resume and metrics.exists():
        raise UserError(
            f"output_dir {config.output_dir} already holds a run; pass --resume or choose another --output-dir"
        )
    files = write_job(config)
    print(f"tidal rl: batch script {files.script}", flush=True)
    try:
        result = subprocess.run(
            ["sbatch", "--parsable", str(files.script)], capture_output=True, text=True, timeout=120
        )
    except FileNotFoundError:
        raise UserError("sbatch not found: submit from a Slurm login node (--dry-run only renders)") from None
    if result.returncode != 0:
        raise UserError(f"sbatch failed: {(result.stderr or result.stdout).strip()}")
    job_id = result.stdout.strip().split(";")[0]
    print(f"tidal rl: submitted job {job_id}", flush=True)
    print(
        f"  follow: tail -f {files.log_of(job_id)}   (each process: {files.script.parent.parent / 'logs'}/)"
    )
    print(f"  stop:   scancel {job_id}")
    return 0

"""`tidal rl`: start inference (every replica) and, while it loads, the orchestrator and a trainer that shares
no GPU with it; once every replica is healthy, a trainer that does; supervise, restarting what dies; stop all
cleanly.

Each child runs in its own process group with its output in `<output_dir>/logs/<name>.log`. The launcher
prints one line per step from the metrics files. A child that fails (the vLLM server under each
`tidal inference` is watched too) is restarted in place, within `[restarts]`: a replica on its port (the
orchestrator's client routes around it meanwhile and brings it to the latest weights on return), the
trainer from its latest checkpoint (the batches since are still on disk), the orchestrator from its own
state; each failure and recovery is one line here and a record in `<output_dir>/events.jsonl`. Past the
limit, or on Ctrl-C / SIGTERM, every child is stopped (process groups, grandchildren included) and the
launcher exits non-zero naming the culprit: the process that ended first.

This module is the local run (`LocalLauncher`) and what `tidal rl` shows before one (`--dry-run`, `--help`'s
defaults, a finished run's one line). The supervision it shares with a cluster node's launcher
(tidal.launcher.node) is tidal.launcher.supervisor's; the processes, the restarts and what the run reports
are tidal.launcher.children's, .restarter's and .report's.
"""

import sys
import time
from pathlib import Path

import tomli_w
from pydantic import BaseModel

from tidal import run_layout
from tidal.config.rl import RLConfig
from tidal.launcher.argv import trainer_argv
from tidal.launcher.split import split_config
from tidal.launcher.supervisor import TEACHER, Supervisor, gpu_run, replica_name
from tidal.monitor.console import clock


class LocalLauncher(Supervisor):
    """Every role of a `tidal rl` run on this machine; the run ends when the trainer and the orchestrator
    have."""

    def __init__(self, config: RLConfig):
        super().__init__(config, index=0, prefix="tidal rl", suffix="")

    def _begin(self) -> None:
        """Nothing to mark: no other node waits for this one."""

    def _trainer_argv(self, config_path: Path) -> list[str]:
        return trainer_argv(config_path, self.config.deployment.num_trainer_ranks)

    def _started_line(self, num_replicas: int, local: list[int], started: list[str], roles: str) -> str:
        are = "are" if len(local) > 1 else "is"
        what = f"{len(local)} inference replicas" if len(local) > 1 else "inference"
        return f"{what} {are} up; {roles}"

    def _may_end(self) -> bool:
        return True


def _on_gpu() -> bool:
    # a name of this module's own: scripts/config_reference.py replaces it to show a CPU machine's defaults
    return gpu_run()


def as_run(config: RLConfig) -> RLConfig:
    """The config with the [inference], [orchestrator] and [trainer] tables each process of a local run gets
    (split_config's derived values, e.g. `inference.weights.check_finite = "auto"` resolved): what --help
    shows as defaults. Cluster runs split on their nodes; their config is returned as it is."""
    if config.deployment.type != "local":
        return config
    roles = split_config(config, _on_gpu())
    update = {"inference": roles.inference, "orchestrator": roles.orchestrator, "trainer": roles.trainer}
    return config.model_copy(update=update)


def dry_run(config: RLConfig) -> str:
    """The resolved config of every process a local `tidal rl` would start, as the TOML files it would write
    (a cluster run's: tidal.deploy.run)."""
    roles = split_config(config, _on_gpu())
    count = len(roles.replicas)
    named: list[tuple[str, BaseModel]] = [(replica_name(i, count), r) for i, r in enumerate(roles.replicas)]
    if roles.teacher is not None:
        named.append((TEACHER, roles.teacher))
    named += [("orchestrator", roles.orchestrator), ("trainer", roles.trainer)]
    parts = []
    for name, role in named:
        body = tomli_w.dumps(role.model_dump(mode="json", exclude_none=True))
        parts.append(f"# ---- {config.output_dir}/configs/{name}.toml ----\n{body}")
    return "\n".join(parts)


def already_complete(config: RLConfig) -> str | None:
    """With --resume, the line saying that the run has nothing left to do (then nothing is started, not
    even vLLM), else None. Kubernetes runs keep output_dir on a volume of their own, not read from here."""
    if not config.resume or config.deployment.type == "kubernetes":
        return None
    online = config.orchestrator.online_eval
    final_eval = online.interval is not None and online.final
    found = run_layout.finished_checkpoint(config.output_dir, config.max_steps, final_eval)
    if found is None:
        return None
    step, path = found
    return (
        f"the run in {config.output_dir} is already complete at step {step} (max_steps {config.max_steps}; "
        f"checkpoint {path}): nothing to resume (a larger --max-steps trains on)"
    )


def say_if_complete(config: RLConfig) -> bool:
    """Print the line of `already_complete` and return True when there is one."""
    complete = already_complete(config)
    if complete is not None:
        print(f"{clock()} tidal rl: {complete}", flush=True)
    return complete is not None


def check_teacher(config: RLConfig) -> None:
    """A distillation teacher of another tokenizer: one line before anything starts (the orchestrator
    checks it again when it starts alone)."""
    served, named = config.teacher_server, config.orchestrator.teacher
    if served is not None:
        model, key = served.model, "teacher_server.model"
    elif named is not None:
        model, key = named.model, "orchestrator.teacher.model"
    else:
        return
    from tidal.inference.tokenizer import load_tokenizer
    from tidal.orchestrator.distill import check_teacher as check

    check(config.orchestrator.env, load_tokenizer(config.model), model, config.model.trust_remote_code, key)


def main(config: RLConfig) -> int:
    """A local `tidal rl` (a cluster run is submitted by tidal.deploy.run instead)."""
    if say_if_complete(config):
        return 0
    from tidal.envs.registry import check_envs

    # a wrong name, import or argument: one line before any server starts, not a traceback after vLLM's startup
    check_envs(
        [(f"orchestrator.{key}", spec) for key, spec in config.orchestrator.environments()], config.model.name
    )
    check_teacher(config)
    from tidal.models import prepare_model_files

    prepare_model_files(config.model.name, lambda line: print(f"{clock()} tidal rl: {line}", flush=True))
    start = time.perf_counter()
    launcher = LocalLauncher(config)
    code = 1
    try:
        code = launcher.run()
    finally:
        # a failed or stopped run gets its plot too: the steps it made are what one looks at then
        plot = final_plot(config.output_dir)
        took = f"done in {time.perf_counter() - start:.0f} s" if code == 0 else "steps so far"
        if plot is not None:
            launcher.report.console.say(f"tidal rl: {took}; plot: {plot}")
    return code


def final_plot(output_dir: Path) -> Path | None:
    """plots/rl.png of what the run logged; None when it logged no step (or drawing failed: said why)."""
    from tidal.monitor.plot import plot_rl_run

    if not (run_layout.orchestrator_dir(output_dir) / "metrics.jsonl").exists():
        return None
    try:
        return plot_rl_run(output_dir)
    except Exception as exc:  # the plot must not hide how the run ended
        print(f"tidal rl: warning: could not draw the plot: {exc!r}", file=sys.stderr)
        return None

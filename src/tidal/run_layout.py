"""Where each process of a run reads and writes under `<output_dir>` (one place, so they agree)."""

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from tidal import manifest
from tidal.errors import UserError

_STATE_FILE = re.compile(r"^step_(\d+)\.json$")


def rollouts_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "rollouts"


def trainer_checkpoints_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "checkpoints"


def configs_dir(output_dir: Path) -> Path:
    """The config files the launchers start their processes with."""
    return Path(output_dir) / "configs"


def sft_metrics_path(output_dir: Path) -> Path:
    return Path(output_dir) / "metrics.jsonl"


def online_eval_path(output_dir: Path) -> Path:
    """Every online eval of a `tidal rl` run (each environment's report, intervals included), one per line."""
    return orchestrator_dir(output_dir) / "online_eval.jsonl"


def online_eval_rollouts_path(output_dir: Path, step: int, final: bool) -> Path:
    """The rollouts of one online eval (`online_eval.save_rollouts`), one per line as `tidal eval` writes
    them: what the model answered, its reward and metrics."""
    name = f"step_{step}_final.jsonl" if final else f"step_{step}.jsonl"
    return orchestrator_dir(output_dir) / "online_eval_rollouts" / name


def samples_path(output_dir: Path) -> Path:
    """Sampled rollouts as text (the orchestrator's `samples` setting), one JSON record per rollout."""
    return Path(output_dir) / "samples.jsonl"


def plot_path(output_dir: Path) -> Path:
    return Path(output_dir) / "plots" / "rl.png"


def wandb_run_file(output_dir: Path) -> Path:
    """The id of the run's W&B run and its last step logged: a resumed `tidal rl` continues that run."""
    return Path(output_dir) / "wandb" / "tidal_run.json"


def check_output_dir(metrics_path: Path, ckpt_root: Path, resume: bool) -> None:
    """Refuse to mix two runs in one directory: earlier checkpoints and metrics are not overwritten silently."""
    if resume:
        return
    if manifest.checkpoint_dirs(ckpt_root) or metrics_path.exists():
        out = metrics_path.parent
        raise UserError(
            f"{out} already holds a run; pass --resume to continue it or choose another --output-dir"
        )


def orchestrator_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "orchestrator"


def trainer_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "trainer"


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """`step_<n>` directories under root (rollouts, weights or checkpoints; complete ones: staging names never
    match), oldest first. One listing for all three: tidal.manifest's."""
    return manifest.checkpoint_dirs(root)


def trainer_resume_step(output_dir: Path) -> int:
    """The step a resumed trainer continues from: its newest complete checkpoint (0 without one). Once
    `prepare_resume` ran (`tidal rl --resume` does, before starting anyone) that checkpoint is verified."""
    return manifest.latest_complete_step(trainer_checkpoints_dir(output_dir)) or 0


def trainer_checkpoint_step(output_dir: Path) -> int | None:
    """The trainer's newest complete checkpoint (None without one): a restarted trainer trains the batches
    from there on again, so the orchestrator keeps them."""
    return manifest.latest_complete_step(trainer_checkpoints_dir(output_dir))


def oldest_trainer_checkpoint_step(output_dir: Path) -> int:
    """The oldest trainer checkpoint still on disk (0 without one): a resume may fall back as far as it when
    the newer ones turn out damaged, so what it needs must be kept from there on."""
    found = manifest.checkpoint_dirs(trainer_checkpoints_dir(output_dir))
    return found[0][0] if found else 0


def verified_resume_step(output_dir: Path, report: Callable[[str], None]) -> int:
    """The step of the trainer checkpoint a resume will use, every byte checked (damaged newer ones
    reported and moved aside; a UserError when checkpoints exist and none is usable); 0 without one."""
    chosen = manifest.resume_checkpoint(trainer_checkpoints_dir(output_dir), report)
    return chosen[0] if chosen is not None else 0


def finished_checkpoint(output_dir: Path, max_steps: int, final_eval: bool) -> tuple[int, Path] | None:
    """The trainer's newest complete checkpoint (step, path) when the run in `output_dir` has nothing left
    to do for `max_steps`: that checkpoint is at max_steps or past it and, when the run ends with a final
    online eval (`final_eval`), that eval was logged (a run stopped during it is not finished). Else None."""
    found = manifest.complete_checkpoints(trainer_checkpoints_dir(output_dir))
    if not found or found[-1][0] < max_steps:
        return None
    if final_eval and not _final_eval_logged(online_eval_path(output_dir), max_steps):
        return None
    return found[-1]


def _final_eval_logged(path: Path, max_steps: int) -> bool:
    """Whether online_eval.jsonl holds the final eval of step `max_steps` (or later); a line a killed writer
    left half-written counts as none."""
    if not path.is_file():
        return False
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and step >= max_steps and record.get("final") is True:
            return True
    return False


def orchestrator_states_dir(output_dir: Path) -> Path:
    """`states/step_<n>.json`: the orchestrator's state once it has made batches 0 … n − 1."""
    return orchestrator_dir(output_dir) / "states"


def saved_state_steps(output_dir: Path) -> list[int]:
    """The steps of the orchestrator states on disk (unsorted)."""
    found = orchestrator_states_dir(output_dir).glob("step_*.json")
    return [int(m.group(1)) for p in found if (m := _STATE_FILE.match(p.name))]


def prepare_resume(output_dir: Path, report: Callable[[str], None]) -> int:
    """Before any process of a resumed run starts: verify the trainer checkpoint it will use (damaged newer
    ones reported and moved aside, a UserError when none is usable), then `discard_after_checkpoint`."""
    manifest.resume_checkpoint(trainer_checkpoints_dir(output_dir), report)
    return discard_after_checkpoint(output_dir)


TRAINER_GATE_ENV = "TIDAL_TRAINER_GATE"
"""Set by `tidal rl` for a trainer it starts while vLLM loads on the trainer's GPU: a file whose existence
lets the trainer touch the GPU (see `trainer_gate`)."""


def trainer_gate(output_dir: Path, node_suffix: str = "") -> Path:
    """The file `tidal rl` creates once every vLLM replica on the trainer's GPU is up: a trainer started
    while they load waits for it before its first CUDA call, so that it allocates nothing while vLLM sizes
    its KV cache from the memory free (its imports and start-up overlap vLLM's meanwhile). One per node
    (`node_suffix`: the node's config-file suffix on a cluster)."""
    return trainer_dir(output_dir) / f"gpu_gate{node_suffix}"


def kv_store_dir(output_dir: Path) -> Path:
    """ExampleConnector's KV files under prefill/decode disaggregation (emptied at every weight update)."""
    return output_dir / "kv_store"


def weights_dir(output_dir: Path) -> Path:
    return Path(output_dir) / "weights"


def discard_after_checkpoint(output_dir: Path) -> int:
    """Before a resume: drop what a killed run produced past the trainer's latest checkpoint; returns its step.

    Batches of that step and later (`rollouts/step_<n>`, n ≥ step), weights published after it
    (`weights/step_<n>`, n > step) and the orchestrator's states past it belong to steps the resumed run
    does again. This must happen before trainer and orchestrator start: a resumed trainer that found an old
    batch would train it at once and publish weights that the orchestrator's own clean-up then deleted, and
    both would wait for ever; an orchestrator restarted from its newest state would take a stale one.
    """
    step = trainer_resume_step(output_dir)
    stale = [p for n, p in step_dirs(rollouts_dir(output_dir)) if n >= step]
    stale += [p for n, p in step_dirs(weights_dir(output_dir)) if n > step]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    for state in saved_state_steps(output_dir):
        if state > step:
            (orchestrator_states_dir(output_dir) / f"step_{state}.json").unlink(missing_ok=True)
    return step


def node_marker(output_dir: Path, node: int, what: str) -> Path:
    """`nodes/node_<K>.started` / `.done`: a cluster node's start and end of the run (tidal.launcher.node)."""
    return Path(output_dir) / "nodes" / f"node_{node}.{what}"


def mark_node(output_dir: Path, node: int, what: str, run_id: str) -> float:
    """Write a node's marker (atomically); returns its modification time as the shared storage keeps it."""
    path = node_marker(output_dir, node, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(run_id)
    tmp.rename(path)
    return path.stat().st_mtime


def node_done(output_dir: Path, node: int, run_id: str, since: float) -> bool:
    """Whether node `node` finished run `run_id`: its done marker names the run and is not older than
    `since` (the asking node's own start marker, stamped by the same storage). An earlier run's marker
    fails one or the other, even where every restart has the same run id."""
    path = node_marker(output_dir, node, "done")
    try:
        return path.read_text() == run_id and path.stat().st_mtime >= since
    except OSError:
        return False

"""Clean-up before a resume: what a killed run left past the trainer's checkpoint is dropped, nothing else."""

from pathlib import Path

from tidal import run_layout
from tidal.trainer import manifest


def _make(root: Path, steps: list[int]) -> None:
    for step in steps:
        (root / f"step_{step}").mkdir(parents=True)


def _make_checkpoints(root: Path, steps: list[int]) -> None:
    """Complete trainer checkpoints as far as run_layout can tell: a file and its manifest."""
    _make(root, steps)
    for step in steps:
        (root / f"step_{step}" / "state").write_text(str(step))
        manifest.write_manifest(root / f"step_{step}", step)


def _left(root: Path) -> list[int]:
    return [step for step, _ in run_layout.step_dirs(root)]


def test_discard_after_checkpoint_drops_batches_from_and_weights_after_the_checkpoint(tmp_path):
    _make_checkpoints(run_layout.trainer_checkpoints_dir(tmp_path), [1, 2])
    _make(run_layout.rollouts_dir(tmp_path), [1, 2, 3])
    _make(run_layout.weights_dir(tmp_path), [1, 2, 3, 4])
    (run_layout.weights_dir(tmp_path) / "step_5.tmp").mkdir()  # a half-written publish is not a step

    states = run_layout.orchestrator_states_dir(tmp_path)
    states.mkdir(parents=True)
    for step in (1, 2, 3, 4):
        (states / f"step_{step}.json").write_text("{}")

    assert run_layout.discard_after_checkpoint(tmp_path) == 2
    assert _left(run_layout.rollouts_dir(tmp_path)) == [1]  # batch 2 is produced again
    # the resumed orchestrator starts from state 2; a restart of it from its newest state must not find 4
    assert sorted(run_layout.saved_state_steps(tmp_path)) == [1, 2]
    assert _left(run_layout.weights_dir(tmp_path)) == [1, 2]  # step 2's weights serve the resumed step 2
    assert _left(run_layout.trainer_checkpoints_dir(tmp_path)) == [1, 2]


def test_a_checkpoint_without_its_manifest_is_not_the_step_resumed_from(tmp_path):
    _make_checkpoints(run_layout.trainer_checkpoints_dir(tmp_path), [1])
    _make(run_layout.trainer_checkpoints_dir(tmp_path), [2])  # killed before its manifest
    _make(run_layout.rollouts_dir(tmp_path), [1, 2])
    assert run_layout.discard_after_checkpoint(tmp_path) == 1
    assert _left(run_layout.rollouts_dir(tmp_path)) == []


def test_discard_without_a_checkpoint_starts_from_step_0(tmp_path):
    _make(run_layout.rollouts_dir(tmp_path), [0, 1])
    _make(run_layout.weights_dir(tmp_path), [0, 1])
    assert run_layout.discard_after_checkpoint(tmp_path) == 0
    assert _left(run_layout.rollouts_dir(tmp_path)) == []
    assert _left(run_layout.weights_dir(tmp_path)) == [0]

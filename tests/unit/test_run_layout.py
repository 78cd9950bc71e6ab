"""Before a resume: what a killed run left past the trainer's checkpoint is dropped, nothing else; a run that
has nothing left to do is told apart."""

from pathlib import Path

from tidal import manifest, run_layout


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


def _final_eval(output_dir: Path, *records: str) -> None:
    path = run_layout.online_eval_path(output_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in records))


def test_a_run_is_finished_once_its_last_step_is_checkpointed_and_its_final_eval_logged(tmp_path):
    checkpoints = run_layout.trainer_checkpoints_dir(tmp_path)
    assert run_layout.finished_checkpoint(tmp_path, 4, final_eval=False) is None  # nothing trained yet
    _make_checkpoints(checkpoints, [2, 4])
    assert run_layout.finished_checkpoint(tmp_path, 4, final_eval=False) == (4, checkpoints / "step_4")
    assert run_layout.finished_checkpoint(tmp_path, 3, final_eval=False) == (4, checkpoints / "step_4")
    assert run_layout.finished_checkpoint(tmp_path, 6, final_eval=False) is None  # --max-steps raised
    # stopped during the final online eval: the resume still has that to do
    assert run_layout.finished_checkpoint(tmp_path, 4, final_eval=True) is None
    _final_eval(tmp_path, '{"step": 0, "final": false}', '{"step": 4, "fin')  # half-written by a kill
    assert run_layout.finished_checkpoint(tmp_path, 4, final_eval=True) is None
    _final_eval(tmp_path, '{"step": 0, "final": false}', '{"step": 4, "final": true, "envs": {}}')
    assert run_layout.finished_checkpoint(tmp_path, 4, final_eval=True) == (4, checkpoints / "step_4")


def test_a_last_checkpoint_without_its_manifest_does_not_finish_the_run(tmp_path):
    checkpoints = run_layout.trainer_checkpoints_dir(tmp_path)
    _make_checkpoints(checkpoints, [2])
    _make(checkpoints, [4])  # killed while writing it: no manifest
    assert run_layout.finished_checkpoint(tmp_path, 4, final_eval=False) is None


def test_resuming_a_finished_run_says_so_in_one_line_and_starts_nothing(tmp_path, capsys):
    """Issue 34: `tidal rl --resume` of a run that had trained and checkpointed every step started vLLM for
    nothing. (The model does not exist: a run started past the check would fail within seconds.)"""
    from tidal.config.rl import RLConfig
    from tidal.launcher.rl import already_complete, main

    base = {"output_dir": str(tmp_path), "max_steps": 4, "model": {"name": "/nonexistent/model"}}
    _make_checkpoints(run_layout.trainer_checkpoints_dir(tmp_path), [2, 4])
    assert already_complete(RLConfig.model_validate(base)) is None  # without --resume: the usual refusal
    run = RLConfig.model_validate({**base, "resume": True})
    assert main(run) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].endswith(
        f"tidal rl: the run in {tmp_path} is already complete at step 4 (max_steps 4; checkpoint "
        f"{run_layout.trainer_checkpoints_dir(tmp_path) / 'step_4'}): nothing to resume (a larger --max-steps "
        "trains on)"
    )
    assert not (tmp_path / "logs").exists() and not (tmp_path / "configs").exists()
    more = RLConfig.model_validate({**base, "resume": True, "max_steps": 6})
    assert already_complete(more) is None
    with_eval = {**base, "resume": True, "orchestrator": {"online_eval": {"interval": 2}}}
    assert already_complete(RLConfig.model_validate(with_eval)) is None  # its final eval is not logged

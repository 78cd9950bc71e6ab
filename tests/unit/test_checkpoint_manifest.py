"""Checkpoints that cannot be half-read: a damaged or incomplete newest checkpoint is reported in one line and
the previous one is used; the trainer state is plain data, so a planted pickle is refused, never run."""

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.unit.models import tiny_lm
from tests.unit.test_trainer_resume import CPU, _state  # one tiny train state for both files
from tidal import manifest, run_layout
from tidal.errors import UserError
from tidal.trainer import ckpt
from tidal.trainer.session import TrainState, maybe_resume, verify_resume_checkpoint


def _save(root: Path, steps: list[int], keep_last: int = 5) -> TrainState:
    state = _state()
    for step in steps:
        extra = {"scheduler": state.scheduler.state_dict(), "data": {"position": step}}
        ckpt.save_checkpoint(root, step, state.model, state.optimizer, extra, CPU, keep_last)
    return state


def _distcp(path: Path) -> Path:
    return next((path / "model_optim").glob("*.distcp"))


def _truncate(path: Path) -> str:
    target = _distcp(path)
    target.write_bytes(target.read_bytes()[:100])
    return "model_optim/__0_0.distcp is 100 bytes"


def _remove_state(path: Path) -> str:
    ckpt.state_file(path, 0).unlink()
    return "trainer_state_rank0.json is missing"


def _remove_manifest(path: Path) -> str:
    (path / manifest.MANIFEST).unlink()
    return "no manifest.json: the checkpoint is incomplete"


def _flip_a_byte(path: Path) -> str:  # same size: only the hash can tell
    target = _distcp(path)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))
    return "model_optim/__0_0.distcp does not match its sha256"


@pytest.mark.parametrize("damage", [_truncate, _remove_state, _remove_manifest, _flip_a_byte])
def test_a_damaged_newest_checkpoint_is_reported_in_one_line_and_the_previous_one_used(tmp_path, damage):
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    expected = damage(root / "step_2")
    lines: list[str] = []

    chosen = manifest.resume_checkpoint(root, lines.append)

    assert chosen == (1, root / "step_1")
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "step_2" in lines[0] and expected in lines[0], lines
    # moved aside: every later reader (orchestrator restore, pruning, the other ranks) now agrees on step 1
    assert [s for s, _ in manifest.checkpoint_dirs(root)] == [1]
    assert (root / "step_2.unusable").is_dir()
    assert ckpt.latest_checkpoint(root) == root / "step_1"


def test_resume_after_the_check_restores_the_previous_checkpoint(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    _truncate(root / "step_2")
    lines: list[str] = []
    verify_resume_checkpoint(root, CPU, lines.append)
    step, data = maybe_resume(root, _state(), CPU, None, lines.append, True, first_record_step=1)
    assert (step, data) == (1, {"position": 1})
    assert lines[-1] == f"resumed from {root / 'step_1'} at step 1"


def test_only_broken_checkpoints_are_a_one_line_error_naming_the_newest(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    _truncate(root / "step_1")
    _remove_manifest(root / "step_2")
    with pytest.raises(UserError) as error:
        manifest.resume_checkpoint(root, lambda _: None)
    message = str(error.value)
    assert "\n" not in message and "none of the 2 checkpoint(s)" in message and "step_2" in message


def test_no_checkpoint_at_all_is_not_an_error(tmp_path):
    assert manifest.resume_checkpoint(tmp_path / "checkpoints", lambda _: None) is None


def test_a_save_killed_before_its_manifest_leaves_nothing_a_reader_uses(tmp_path):
    """What a kill mid-save leaves: the staging directory (never a candidate), or, written by hand or by a
    copy, a step directory with files but no manifest (skipped)."""
    root = tmp_path / "checkpoints"
    _save(root, [1, 2])
    (root / "step_2").rename(root / "step_3.tmp")
    assert manifest.resume_checkpoint(root, lambda _: None) == (1, root / "step_1")
    _save(root, [2])
    _remove_manifest(root / "step_2")
    assert ckpt.latest_checkpoint(root) == root / "step_1"  # the cheap check agrees
    _save(root, [3])
    assert not (root / "step_3.tmp").exists()  # a later save cleans an interrupted one up


def test_files_are_hashed_only_when_every_size_matches():
    expected = {"a": {"size": 3, "sha256": "x"}, "b": {"size": 5, "sha256": "y"}}

    def no_hashing(names: list[str]) -> list[str]:
        raise AssertionError("hashed although a size already differs")

    assert (
        manifest.files_problem(expected, {"a": 3, "b": 4}, no_hashing) == "b is 4 bytes, the manifest says 5"
    )
    assert manifest.files_problem(expected, {"a": 3, "b": None}, no_hashing) == "b is missing"
    assert manifest.files_problem(expected, {"a": 3, "b": 5}, lambda n: ["x", "y"]) is None
    assert "a does not match" in str(manifest.files_problem(expected, {"a": 3, "b": 5}, lambda n: ["z", "y"]))


def test_manifest_lists_every_file_with_size_and_sha256(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [1])
    listed = json.loads((root / "step_1" / manifest.MANIFEST).read_text())["files"]
    on_disk = sorted(
        p.relative_to(root / "step_1").as_posix() for p in (root / "step_1").rglob("*") if p.is_file()
    )
    assert sorted(listed) == [name for name in on_disk if name != manifest.MANIFEST]
    assert {"model_optim/.metadata", "trainer_state_rank0.json"} <= listed.keys()
    name = "trainer_state_rank0.json"
    assert listed[name]["sha256"] == manifest.sha256_of(root / "step_1" / name)


class _RunsCode:
    """What a planted pickle does on load: call something of the attacker's choosing."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


def test_a_planted_pickle_state_is_refused_and_never_run(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [1])
    path = root / "step_1"
    marker = tmp_path / "code-ran"
    ckpt.state_file(path, 0).unlink()
    (path / "trainer_state_rank0.pt").write_bytes(pickle.dumps({"step": 1, "x": _RunsCode(marker)}))
    manifest.write_manifest(path, 1)  # whoever plants the file can write a matching manifest too
    with pytest.raises(UserError, match="is a pickle, which is not loaded"):
        ckpt.load_checkpoint(path, *_model_and_optimizer(), CPU)
    assert not marker.exists()


def test_a_checkpoint_of_an_older_tidal_is_named_as_such(tmp_path):
    old = tmp_path / "checkpoints" / "step_4"
    (old / "model_optim").mkdir(parents=True)
    (old / "trainer_state_rank0.pt").write_bytes(b"pickle")
    with pytest.raises(UserError) as error:
        manifest.resume_checkpoint(tmp_path / "checkpoints", lambda _: None)
    assert "before checkpoint manifests" in str(error.value) and "\n" not in str(error.value)


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = tiny_lm(layers=1)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def test_rng_states_survive_the_plain_data_round_trip(tmp_path):
    saved = json.loads(json.dumps(ckpt.rng_state(CPU)))
    first = (torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random())
    ckpt.set_rng_state(saved, CPU)
    assert (torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random()) == first


def test_pruning_keeps_the_checkpoint_just_written_and_leaves_newer_leftovers_alone():
    # resumed from step 2 of a run that had written 5 and 6; now step 4 was saved (3 is a broken leftover)
    found = [(1, True), (2, True), (3, False), (4, True), (5, True), (6, True)]
    assert manifest.prune_plan(found, saved=4, keep_last=2) == [1, 3]
    assert manifest.prune_plan(found, saved=4, keep_last=1) == [1, 2, 3]
    assert manifest.prune_plan([(1, True), (2, False), (3, True)], saved=3, keep_last=3) == [2]


def test_save_never_prunes_the_checkpoint_it_wrote_when_newer_ones_are_left_over(tmp_path):
    root = tmp_path / "checkpoints"
    _save(root, [5, 6])
    _save(root, [2], keep_last=1)  # the old rule (keep the newest names) deleted step_2 at once
    assert [s for s, _ in manifest.checkpoint_dirs(root)] == [2, 5, 6]


def test_prepare_resume_discards_from_the_checkpoint_it_falls_back_to(tmp_path):
    checkpoints = run_layout.trainer_checkpoints_dir(tmp_path)
    _save(checkpoints, [2, 4])
    _truncate(checkpoints / "step_4")
    for step in range(6):
        (run_layout.rollouts_dir(tmp_path) / f"step_{step}").mkdir(parents=True)
    lines: list[str] = []
    assert run_layout.prepare_resume(tmp_path, lines.append) == 2
    assert [s for s, _ in run_layout.step_dirs(run_layout.rollouts_dir(tmp_path))] == [0, 1]
    assert run_layout.trainer_resume_step(tmp_path) == 2  # what the orchestrator's restore reads
    assert run_layout.oldest_trainer_checkpoint_step(tmp_path) == 2  # its state pruning keeps from here
    assert len(lines) == 1 and "step_4" in lines[0]

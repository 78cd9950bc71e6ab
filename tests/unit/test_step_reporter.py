"""The launcher's one-line-per-step summary follows metrics files through a resume's rewrite."""

import json
from pathlib import Path

from tidal import run_layout
from tidal.monitor.metrics import MetricsLogger
from tidal.monitor.progress import StepReporter


def _trainer_record(step: int) -> dict:
    return {"loss": 0.1 * step, "tokens_per_s": 1000.0, "time/wait_for_data": 0.0}


def _step(line: str) -> str:
    """`step 3 [4/6]` of a console line `12:00:00 step 3 [4/6] | ...` (its time left out)."""
    return line.split(" | ")[0].split(" ", 1)[1]


def _loggers(out: Path) -> tuple[MetricsLogger, MetricsLogger]:
    orch = MetricsLogger(run_layout.orchestrator_dir(out) / "metrics.jsonl")
    trainer = MetricsLogger(run_layout.trainer_dir(out) / "metrics.jsonl")
    return orch, trainer


def _log_step(orch: MetricsLogger, trainer: MetricsLogger, step: int) -> None:
    orch.log(step, {"reward/mean": step / 10, "off_policy/max": 0})
    trainer.log(step, _trainer_record(step))


def test_prints_each_step_once_and_follows_a_resumed_rewrite(tmp_path, capsys):
    orch, trainer = _loggers(tmp_path)
    for step in range(4):  # the first run got to step 3; its checkpoint is at step 2
        _log_step(orch, trainer, step)

    reporter = StepReporter(tmp_path, max_steps=6)
    reporter.poll()
    assert capsys.readouterr().out == ""  # the earlier run's steps were printed by that run

    trainer.truncate_after(2)  # the resumed trainer drops the step it will redo
    orch.truncate_after(2)
    reporter.poll()
    assert capsys.readouterr().out == ""

    for step in (3, 4):
        _log_step(orch, trainer, step)
    reporter.poll()
    lines = capsys.readouterr().out.splitlines()
    assert [_step(line) for line in lines] == ["step 3 [4/6]", "step 4 [5/6]"]
    assert "reward 0.400" in lines[1]


def test_a_half_written_or_foreign_line_is_skipped(tmp_path, capsys):
    orch, trainer = _loggers(tmp_path)
    reporter = StepReporter(tmp_path, max_steps=3)
    _log_step(orch, trainer, 0)
    with trainer.path.open("a") as fh:
        fh.write('{"step": 1, "loss"\n["not", "a record"]\n')
    trainer.log(2, _trainer_record(2))
    with trainer.path.open("a") as fh:
        fh.write('{"step": 3')  # no newline yet: the writer is mid-line
    reporter.poll()
    assert [_step(line) for line in capsys.readouterr().out.splitlines()] == ["step 0 [1/3]", "step 2 [3/3]"]


def test_truncate_keeps_earlier_steps_and_drops_a_torn_line(tmp_path):
    logger = MetricsLogger(tmp_path / "metrics.jsonl")
    for step in range(3):
        logger.log(step, {"x": step})
    with logger.path.open("a") as fh:
        fh.write('{"step": 3, "x"')
    logger.truncate_after(1)
    records = [json.loads(line) for line in logger.path.read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]


def test_a_redone_step_logged_before_the_next_poll_is_still_reported(tmp_path, capsys):
    """The resumed trainer may rewrite its file and log the first redone step between two polls: that step
    is new (it differs from the record it replaces), not kept history."""
    orch, trainer = _loggers(tmp_path)
    reporter = StepReporter(tmp_path, max_steps=6)
    for step in range(4):
        _log_step(orch, trainer, step)
    reporter.poll()
    assert len(capsys.readouterr().out.splitlines()) == 4
    trainer.truncate_after(1)  # resumed from the checkpoint at step 2
    trainer.log(2, {**_trainer_record(2), "loss": 9.0})
    reporter.poll()
    assert [_step(line) for line in capsys.readouterr().out.splitlines()] == ["step 2 [3/6]"]

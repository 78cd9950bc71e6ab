"""Monitoring of a `tidal rl` run: the W&B step merge, the samples, the console's step lines, `tidal plot`."""

import io
import json
import os

import pytest

from tests.wandb_files import offline_run_files, read_offline_run
from tidal import run_layout
from tidal.cli import COMMANDS, run_command
from tidal.config.common import WandbConfig
from tidal.config.rl import RLConfig
from tidal.monitor.console import Console, StepClock, duration, step_line
from tidal.monitor.metrics import MetricsLogger
from tidal.monitor.plot import moving_average, plot_rl_run, read_records, reward_limits
from tidal.monitor.progress import StepReporter
from tidal.monitor.wandb_run import StepMerger, WandbRun, sample_rows
from tidal.orchestrator.samples import pick_rollouts, sample_record
from tidal.types import Group, Rollout


def _rollout(task: str, i: int, reward: float = 0.5) -> Rollout:
    return Rollout([1, 2], [3, 4, 5], [0.0] * 3, [1] * 3, reward, 0, 1, "env", task, {"exact": reward})


def test_samples_take_one_rollout_per_group_first_and_read_as_text():
    groups = [Group(t, "env", [_rollout(t, i) for i in range(3)]) for t in ("a", "b")]
    picked = pick_rollouts(groups, 3)
    assert [r.task_id for r in picked] == ["a", "b", "a"]
    record = sample_record(picked[0], lambda ids: " ".join(f"t{i}" for i in ids))
    assert record["prompt"] == "t1 t2" and record["completion"] == "t3 t4 t5"
    assert record["metrics"] == {"exact": 0.5} and record["policy_version_max"] == 1


def test_merger_logs_each_step_once_in_order_when_the_trainer_has_it():
    merger = StepMerger()
    merger.add_orchestrator({"step": 0, "reward/mean": 0.1, "eval/env/avg@1": 0.3, "tokens_per_s": 5.0})
    merger.add_orchestrator({"step": 1, "reward/mean": 0.2})  # the orchestrator runs ahead
    merger.add_sample({"step": 0, "prompt": "p", "completion": "c"})
    [zero] = merger.add_trainer({"step": 0, "loss": 1.0, "tokens_per_s": 9.0, "grad_norm": "nan"})
    assert zero.step == 0 and zero.samples == [{"step": 0, "prompt": "p", "completion": "c"}]
    assert zero.metrics["orchestrator/reward/mean"] == 0.1 and zero.metrics["eval/env/avg@1"] == 0.3
    assert zero.metrics["orchestrator/tokens_per_s"] == 5.0 and zero.metrics["trainer/tokens_per_s"] == 9.0
    assert zero.metrics["trainer/grad_norm"] != zero.metrics["trainer/grad_norm"]  # NaN again, not "nan"
    # a restarted trainer redoes step 0: W&B has it already
    assert merger.add_trainer({"step": 0, "loss": 2.0}) == []
    merger.add_orchestrator({"step": 2, "reward/mean": 0.3})
    assert [e.step for e in merger.add_trainer({"step": 2, "loss": 0.5})] == [1, 2]  # 1 was never trained
    merger.add_orchestrator({"step": 3, "reward/mean": 0.4})
    [last] = merger.flush()
    assert last.step == 3 and "trainer/loss" not in last.metrics


def test_sample_table_has_a_column_per_reward_metric():
    columns, rows = sample_rows(
        [{"step": 0, "reward": 1.0, "metrics": {"a": 1.0}}, {"step": 0, "reward": 0.0, "metrics": {"b": 2.0}}]
    )
    assert columns[-2:] == ["metric/a", "metric/b"]
    assert rows[0][-2:] == [1.0, None] and rows[1][-2:] == [None, 2.0]


def test_console_lines_count_steps_from_zero_with_step_time_and_eta():
    clock = StepClock()
    for at in (0.0, 2.0, 4.0):
        clock.finished(at)
    line = step_line(2, 10, clock, "reward 0.500", at=0.0)
    assert " step 2 [3/10] | 2.0 s/step | ETA 14 s | reward 0.500" in line
    assert duration(3725) == "1:02:05" and duration(125) == "2:05" and duration(None) == "?"
    out = io.StringIO()  # not a terminal: plain lines, whatever the mode says for terminals
    console = Console(3, "auto", out)
    console.say("tidal rl: hello")
    console.step(0, {"reward/mean": 0.25}, {"loss": 0.1})
    first, second = out.getvalue().splitlines()
    assert first.endswith(" tidal rl: hello") and first[2] == ":"  # HH:MM:SS first
    assert " step 0 [1/3] | first step | ETA ? | reward 0.250 " in second


def test_console_bar_counts_done_steps(tmp_path):
    out = io.StringIO()
    console = Console(4, "bar", out)
    console.step(1, {"reward/mean": 0.5}, {})
    console.close()
    assert "2/4" in out.getvalue() and "step 1 | reward 0.500" in out.getvalue()


def _write_run(out, steps: int, torn: bool = False) -> None:
    orch = MetricsLogger(run_layout.orchestrator_dir(out) / "metrics.jsonl")
    trainer = MetricsLogger(run_layout.trainer_dir(out) / "metrics.jsonl")
    for step in range(steps):
        orch.log(step, {
            "reward/mean": 0.1 * step, "off_policy/max": step % 2, "off_policy/mean": 0.5, "tokens_per_s": 300.0,
            "time/step": 2.0, "time/wait_for_policy": 0.5, "time/weight_updates_total": 0.2 * step,
            **({"eval/env/avg@1": 0.2} if step % 2 == 0 else {}),
        })  # fmt: skip
        trainer.log(step, {
            "loss": 0.1, "mismatch_kl/mean": 1e-4, "entropy/mean": 2.0, "tokens_per_s": 1000.0,
            "time/forward_backward": 1.0, "time/publish": 0.1, "time/wait_for_data": 0.3,
        })  # fmt: skip
    if torn:  # the writer was killed mid-line
        with trainer.path.open("a") as fh:
            fh.write(f'{{"step": {steps}, "loss"')


def test_plot_of_a_run_killed_mid_line_writes_the_png(tmp_path):
    _write_run(tmp_path, 5, torn=True)
    assert [r["step"] for r in read_records(run_layout.trainer_dir(tmp_path) / "metrics.jsonl")] == list(
        range(5)
    )
    assert run_command("plot", COMMANDS["plot"], [str(tmp_path)]) == 0
    png = run_layout.plot_path(tmp_path)
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size > 20_000


def test_plot_of_a_run_without_a_trainer_step_and_of_an_empty_dir(tmp_path, capsys):
    MetricsLogger(run_layout.orchestrator_dir(tmp_path) / "metrics.jsonl").log(0, {"reward/mean": 0.0})
    assert plot_rl_run(tmp_path).exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    assert run_command("plot", COMMANDS["plot"], [str(empty)]) == 1
    assert "holds no step yet" in capsys.readouterr().err


def test_reward_axis_is_fixed_to_0_1_when_rewards_are_in_it():
    assert reward_limits([0.0, 0.2, 1.0]) == (-0.02, 1.02)
    assert reward_limits([-1.0, 0.5]) is None
    assert moving_average([1.0, 3.0, 5.0], 2) == [1.0, 2.0, 4.0]


def test_rl_wandb_table_is_accepted_and_trainer_wandb_is_refused():
    config = RLConfig.model_validate(
        {"wandb": {"enabled": True, "project": "p", "group": "g", "entity": "e"}}
    )
    assert config.wandb.group == "g" and not config.trainer.wandb.enabled
    with pytest.raises(ValueError, match="set that instead"):
        RLConfig.model_validate({"trainer": {"wandb": {"enabled": True}}})
    with pytest.raises(ValueError, match="W&B is off"):
        WandbConfig.model_validate({"project": "p"})


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    return tmp_path


def test_one_offline_wandb_run_across_a_resumed_launcher(wandb_env):
    """The reporter of one launcher logs steps 0-2 (with samples at step 0); a resumed launcher continues
    the same W&B run id and does not log the steps the first one logged again."""
    out = wandb_env / "run"
    config = WandbConfig(enabled=True, group="grp")
    reporter = StepReporter(
        out, 4, Console(4, "lines", io.StringIO()), WandbRun(config, out, {"max_steps": 4})
    )
    _write_run(out, 3)
    samples = MetricsLogger(run_layout.samples_path(out))
    samples.log(0, {"prompt": "say hi", "completion": "hi", "reward": 1.0, "metrics": {"exact": 1.0}})
    assert reporter.poll() == [0, 1, 2]
    reporter.close(0)

    trainer = MetricsLogger(run_layout.trainer_dir(out) / "metrics.jsonl")
    trainer.truncate_after(1)  # the resumed run redoes step 2, then step 3
    resumed = StepReporter(
        out, 4, Console(4, "lines", io.StringIO()), WandbRun(config, out, {"max_steps": 4})
    )
    for step in (2, 3):
        MetricsLogger(run_layout.orchestrator_dir(out) / "metrics.jsonl").log(step, {"reward/mean": 0.9})
        trainer.log(step, {"loss": 0.2})
    resumed.poll()
    resumed.close(0)

    runs = [read_offline_run(f) for f in offline_run_files(out / "wandb")]
    assert len(runs) == 2 and len({r.run_id for r in runs}) == 1  # one W&B run, in two offline parts
    assert runs[0].name == "run" and runs[0].group == "grp" and runs[0].config["max_steps"] == 4
    steps = [row["_step"] for run in runs for row in run.history]
    assert steps == [0, 1, 2, 3]
    first = runs[0].history[0]
    assert first["trainer/loss"] == 0.1 and first["orchestrator/reward/mean"] == 0.0
    assert first["samples/_type"] == "table-file" and first["samples/nrows"] == 1
    table = next((out / "wandb").glob("offline-run-*/files/" + first["samples/path"]))
    assert json.loads(table.read_text())["data"][0][3] == "say hi"
    assert runs[1].history[0]["orchestrator/reward/mean"] == 0.9
    assert os.environ["WANDB_MODE"] == "offline"


def test_waiting_for_inference_reports_what_it_still_waits_for(unused_url):
    from tidal.process import wait_healthy

    seen: list[list[str]] = []
    left = wait_healthy({unused_url: None}, timeout=1.0, poll=0.2, on_poll=lambda w: seen.append(list(w)))
    assert list(left) == [unused_url] and seen and all(w == [unused_url] for w in seen)


@pytest.fixture
def unused_url() -> str:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"  # closed again: nothing answers there

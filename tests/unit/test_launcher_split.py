"""The `tidal rl` launcher as issue 35 split it: one supervision (tidal.launcher.supervisor) under a local
and a cluster-node launcher that differ only in their hooks, the processes (children), the restarts
(restarter) and what the run reports (report). Real child processes, no model: a few seconds."""

import sys
from pathlib import Path

import pytest

from tidal import run_layout
from tidal.config.rl import RLConfig
from tidal.errors import UserError
from tidal.launcher.node import NodeLauncher
from tidal.launcher.plan import ClusterNode
from tidal.launcher.rl import LocalLauncher
from tidal.monitor.events import read_events
from tidal.process import ManagedProcess


def _cluster(tmp_path: Path) -> RLConfig:
    """Node 0: inference; nodes 1 and 2: the trainer, node 1 the orchestrator too."""
    deployment = {"type": "slurm", "num_inference_nodes": 1, "num_trainer_nodes": 2}
    return RLConfig.model_validate({"output_dir": str(tmp_path), "deployment": deployment})


def test_the_local_launcher_runs_every_role_and_ends_with_trainer_and_orchestrator(tmp_path):
    local = LocalLauncher(RLConfig(output_dir=tmp_path))
    assert local.here == ("inference", "trainer", "orchestrator")
    assert (local.report.prefix, local.children.suffix, local.addresses) == ("tidal rl", "", None)
    assert local._trainer_argv(Path("t.toml"))[-4:] == ["tidal", "trainer", "@", "t.toml"]
    both = ["trainer", "orchestrator"]
    assert local._started_line(1, [0], both, "R") == "inference is up; R"
    assert local._started_line(2, [0, 1], both, "R") == "2 inference replicas are up; R"
    assert local._may_end()


def test_a_node_launcher_names_its_node_joins_the_rendezvous_and_serves_until_the_main_nodes_are_done(
    tmp_path,
):
    config = _cluster(tmp_path)
    addresses = ("10.0.0.1", "10.0.0.2", "10.0.0.3")
    nodes = [NodeLauncher(config, ClusterNode(i, addresses, f"n{i}", "run7")) for i in range(3)]
    replicas, main, trainer = nodes
    assert [node.here for node in nodes] == [("inference",), ("trainer", "orchestrator"), ("trainer",)]
    assert (main.report.prefix, main.children.suffix) == ("tidal node 1 (n1)", "_node1")
    assert main.addresses == addresses
    argv = trainer._trainer_argv(Path("t.toml"))
    assert argv[argv.index("--rdzv-endpoint") + 1].startswith("10.0.0.2:")  # node 1 hosts the rendezvous
    assert argv[argv.index("--local-addr") + 1] == "10.0.0.3" and "is_host=0" in argv
    assert main._started_line(2, [], ["trainer", "orchestrator"], "R") == "R (2 inference replicas up)"
    assert trainer._started_line(2, [], ["trainer"], "R") == "R"
    assert (
        replicas._started_line(2, [0, 1], [], "") == "2 inference replica(s) up; serving until the run ends"
    )

    for node in nodes:
        node._begin()
    replicas.children.replicas.append(ManagedProcess("inference", ["true"], None))  # one it serves
    for node in (main, trainer):
        assert not replicas._may_end()  # not every node with the trainer or the orchestrator is done
        node.children.trainer = ManagedProcess("trainer", ["true"], None)
        assert node._may_end()  # it serves no replica: done once its roles are, marked done
        assert run_layout.node_done(tmp_path, node.index, "run7", node.started)
    assert replicas._may_end()


def test_a_failed_role_restarts_within_the_budget_then_stops_the_run_with_one_error(tmp_path, capsys):
    launcher = LocalLauncher(RLConfig(output_dir=tmp_path, restarts={"max_restarts": 1}))
    children, restarts = launcher.children, launcher.restarts
    fails = [sys.executable, "-c", "import sys; print('boom', sys.argv[1:]); sys.exit(7)"]
    try:
        children.orchestrator = children.start("orchestrator", fails, {})
        restarts.up.add("orchestrator")  # it had logged a step: a restart may help
        children.orchestrator.process.wait(timeout=60)
        failure = children.first_failure()
        assert failure is not None and failure.cause == "orchestrator exited with code 7"
        restarts.recover(failure)
        assert (
            "orchestrator exited with code 7; restarting it from its own state (restart 1 of 1 within 3600 s)"
            in (capsys.readouterr().out)
        )
        children.orchestrator.process.wait(timeout=60)
        with pytest.raises(UserError) as stopped:
            restarts.recover(children.first_failure())
    finally:
        children.stop_all()
        children.close()
    log = tmp_path / "logs" / "orchestrator.log"
    assert str(stopped.value) == (
        "orchestrator exited with code 7 and is not restarted: it was restarted 1 time(s) within 3600 s already "
        f"(restarts.max_restarts = 1, restarts.window); last lines of {log}:\n"
        "boom []\nboom ['--resume', '--resume-from', 'latest']"
    )
    events = read_events(tmp_path)
    assert [(e["event"], e["role"], e.get("exit_code"), e.get("action")) for e in events] == [
        ("failure", "orchestrator", 7, "restarting it from its own state"),
        ("failure", "orchestrator", 7, "stop"),
        ("recovery", "orchestrator", None, None),  # the restart had not recovered yet
    ]
    assert events[0]["restart"] == 1 and "reason" in events[1] and events[2]["complete"] is False


def test_every_key_a_role_shares_by_name_with_the_top_is_taken_from_the_top_and_refused_in_the_sub_table(
    tmp_path,
):
    from tidal.config.rl import SET_FROM_THE_TOP
    from tidal.launcher.split import split_config

    top = {
        "output_dir": str(tmp_path / "run"),
        "max_steps": 7,
        "seed": 11,
        "resume": False,
        "max_async_level": 2,
        "model": {"name": "some/model", "dtype": "float32"},
        "wandb": {"enabled": True, "project": "p7", "mode": "offline"},
    }
    rl = RLConfig.model_validate(top)
    roles = split_config(rl, on_gpu=False)
    shared = {k: v for k, v in SET_FROM_THE_TOP.items() if ".".join(k[1:]) == v}
    assert {("inference", "model"), ("orchestrator", "max_async_level"), ("trainer", "wandb")} <= set(shared)
    for (role, key), _ in shared.items():
        for config in roles.replicas if role == "inference" else [getattr(roles, role)]:
            if (role, key) == ("trainer", "wandb"):  # the launcher logs the one W&B run; the trainer doesn't
                assert not config.wandb.enabled
            else:
                assert getattr(config, key) == getattr(rl, key), (role, key)
        value = getattr(rl, key)
        written = value.model_dump(mode="json") if hasattr(value, "model_dump") else value
        with pytest.raises(ValueError, match="sets this from"):  # pydantic's ValidationError is one
            RLConfig.model_validate({**top, role: {key: written}})

"""Per-replica metrics and replica affinity counts of the orchestrator (pure logic, no servers)."""

from tidal.orchestrator.stats import ReplicaCounts, StepStats, replica_metrics
from tidal.types import Group, Rollout


def counts(requests: int, tokens: int, version: int = 0, updates: int = 0) -> ReplicaCounts:
    return ReplicaCounts(requests, tokens, in_flight=2, version=version, healthy=True, weight_updates=updates)


def test_replica_metrics_are_per_step_differences_of_the_running_totals():
    first = replica_metrics([counts(10, 100), counts(4, 40)], None, seconds=2.0)
    assert first["inference/replica_0/requests"] == 10 and first["inference/replica_1/requests"] == 4
    assert first["inference/replica_0/tokens_per_s"] == 50.0
    later = replica_metrics(
        [counts(25, 400, version=3, updates=3), counts(4, 40, version=3, updates=3)],
        [counts(10, 100), counts(4, 40)],
        seconds=3.0,
    )
    assert later["inference/replica_0/requests"] == 15 and later["inference/replica_1/requests"] == 0
    assert (
        later["inference/replica_0/tokens_per_s"] == 100.0 and later["inference/replica_1/tokens_per_s"] == 0
    )
    assert later["inference/replica_1/version"] == 3 and later["inference/replica_1/weight_updates"] == 3
    assert later["inference/replica_0/in_flight"] == 2 and later["inference/replica_0/healthy"] == 1.0


def rollout(replicas: float | None) -> Rollout:
    metrics = {} if replicas is None else {"inference/replicas": replicas}
    return Rollout([1], [2], [-0.1], [1], 1.0, 0, 0, "env", "t", metrics=metrics)


def test_rollouts_served_by_two_replicas_are_counted():
    stats = StepStats()
    stats.record([Group("t", "env", [rollout(1.0), rollout(2.0), rollout(None)])])
    assert stats.num_replica_switches == 1

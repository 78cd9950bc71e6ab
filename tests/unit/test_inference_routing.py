"""The least-loaded index picks what a scan of every server would, however the servers' fields change."""

import random

from tidal.inference.routing import LeastLoaded, ServerState


def scan(servers: list[ServerState]) -> ServerState | None:
    healthy = [s for s in servers if s.healthy]
    return min(healthy, key=lambda s: (s.updating, s.in_flight, s.last_pick, s.position)) if healthy else None


def test_the_index_agrees_with_a_full_scan_through_random_loads_picks_outages_and_updates() -> None:
    rng = random.Random(0)
    servers = [ServerState(f"http://s{i}:1") for i in range(17)]
    index = LeastLoaded(servers)
    picks = 0
    for _ in range(20_000):
        assert index.best() is scan(servers)
        action = rng.random()
        if action < 0.4:  # a request goes out to the pick
            chosen = index.best()
            if chosen is not None:
                picks += 1
                chosen.last_pick = picks
                chosen.in_flight += 1
        elif action < 0.8:  # one finishes somewhere
            busy = [s for s in servers if s.in_flight]
            if busy:
                rng.choice(busy).in_flight -= 1
        elif action < 0.85:
            rng.choice(servers).healthy = False
        elif action < 0.9:
            chosen = rng.choice(servers)
            chosen.updating = not chosen.updating
        else:
            rng.choice(servers).healthy = True
    assert len(index._heap) <= 4 * len(servers) + 64  # stale entries are cleared, not hoarded


def test_no_healthy_server_is_none_and_a_returning_one_is_found_again() -> None:
    servers = [ServerState("http://a:1"), ServerState("http://b:1")]
    index = LeastLoaded(servers)
    servers[0].in_flight = 5
    assert index.best() is servers[1]
    servers[1].healthy = False
    assert index.best() is servers[0]
    servers[0].healthy = False
    assert index.best() is None
    servers[1].healthy = True
    assert index.best() is servers[1]

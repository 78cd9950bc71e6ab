"""Which server gets the next request: the healthy one with the fewest requests in flight, ties to the one
picked least recently (then the first listed), found in O(log servers) instead of a scan per request.
Servers loading new weights come last: they are picked only when every healthy server is updating.

`ServerState` tells its `LeastLoaded` whenever a field that decides the order changes, however it is set
(the client, the health watch, a test), so the order is never stale. The heap holds (updating, load,
last pick, position) entries; an entry that no longer matches its server, or belongs to a server out of rotation,
is dropped when it surfaces, and the heap is rebuilt once such entries dominate it.
"""

import asyncio
import heapq
import math
from dataclasses import dataclass, field
from typing import Any

_ORDER_FIELDS = frozenset({"in_flight", "last_pick", "healthy", "updating"})


@dataclass
class ServerState:
    """What the client knows about one server."""

    url: str
    healthy: bool = True
    in_flight: int = 0
    last_pick: int = 0
    """When it was last picked (a counter): ties in load go to the least recently used server."""
    version: int = 0
    requests: int = 0
    """Generation requests it answered (a running total; the orchestrator logs it per step)."""
    completion_tokens: int = 0
    """Tokens it generated for this client (a running total)."""
    answered_at: float = -math.inf
    """When (time.monotonic) it last answered a request without a server error; the health watch spares
    servers that answered within its interval."""
    weight_updates: int = 0
    """Policy updates (full weights or a policy adapter) it loaded, catch-ups included (a running total)."""
    joined: bool = False
    """It has answered /health once: one that has not is still starting (`tidal rl` starts the orchestrator
    while vLLM loads), not lost."""
    updating: bool = False
    """A full-weight update runs on it: new requests go elsewhere, or wait for `idle` (a pinned session)."""
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    """Set while no update runs."""
    router: "LeastLoaded | None" = field(default=None, repr=False, compare=False)
    position: int = field(default=0, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.idle.set()

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name in _ORDER_FIELDS:
            router = self.__dict__.get("router")
            if router is not None:
                router.changed(self)


class LeastLoaded:
    """The least-loaded healthy server of a fixed list, kept current by the servers' own updates."""

    def __init__(self, servers: list[ServerState]):
        self.servers = servers
        self._heap: list[tuple[bool, int, int, int]] = []
        for position, server in enumerate(servers):
            server.position = position
            server.router = self
        self._rebuild()

    def changed(self, server: ServerState) -> None:
        if server.healthy:
            heapq.heappush(self._heap, (server.updating, server.in_flight, server.last_pick, server.position))
            if len(self._heap) > 4 * len(self.servers) + 64:  # mostly stale entries by now
                self._rebuild()

    def best(self) -> ServerState | None:
        """The server to pick (None if none is healthy); picking it is the caller's (set `last_pick`)."""
        heap = self._heap
        while heap:
            updating, in_flight, last_pick, position = heap[0]
            server = self.servers[position]
            if (
                server.healthy
                and server.in_flight == in_flight
                and server.last_pick == last_pick
                and server.updating == updating
            ):
                return server
            heapq.heappop(heap)
        return None

    def _rebuild(self) -> None:
        self._heap = [(s.updating, s.in_flight, s.last_pick, s.position) for s in self.servers if s.healthy]
        heapq.heapify(self._heap)

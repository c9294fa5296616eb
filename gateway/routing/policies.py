"""Load-only routing policies: ``round_robin`` and ``least_loaded``.

``round_robin`` cycles through the candidates in order; it ignores load and cache, which is what
makes it the baseline every other policy is compared to.

``least_loaded`` picks the candidate with the fewest requests in flight, counting the gateway's
own in-flight requests (exact and current) plus vLLM's queued requests from the last scrape (which
includes traffic from other gateway replicas, but is a few seconds old). Ties go to the candidate
with the lower KV usage, then rotate so equal workers share the load.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

from gateway.routing.kv_aware import KvAware
from gateway.routing.types import Candidate, Decision, Policy, RoutingRequest


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        c = candidates[next(self._counter) % len(candidates)]
        return Decision(c.worker_id, "round_robin", c.cached_tokens)


class LeastLoaded:
    name = "least_loaded"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        def key(c: Candidate) -> tuple[int, float]:
            return (c.load.inflight + c.load.waiting, c.load.kv_usage_ratio)

        lowest = min(key(c) for c in candidates)
        tied = [c for c in candidates if key(c) == lowest]
        c = tied[next(self._counter) % len(tied)]
        return Decision(c.worker_id, "least_loaded", c.cached_tokens)


# A pool's `policy` config value, the policy's `name` and its metric label are the same string.
POLICIES: dict[str, Callable[[], Policy]] = {
    RoundRobin.name: RoundRobin,
    LeastLoaded.name: LeastLoaded,
    KvAware.name: KvAware,
}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(POLICIES)}") from None

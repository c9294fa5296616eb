"""``least_loaded``: the candidate with the fewest requests in flight.

Load counts the gateway's own in-flight requests (exact and current) plus vLLM's queued requests
from the last scrape (which includes traffic from other gateway replicas, but is a few seconds
old); ``running`` is left out because it overlaps the gateway's own count. Ties go to the
candidate with the lower KV usage, then rotate among the tied ones so equal workers share the
load. Cost: two passes over the candidates per decision; the rotation counter is the only state.
Compared to ``kv_aware``, it never looks at the cache, so it is the load-only baseline.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gateway.config import PolicyName
from gateway.routing.types import Candidate, Decision, RoutingRequest


class LeastLoaded:
    name = PolicyName.LEAST_LOADED

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        def key(c: Candidate) -> tuple[int, float]:
            return (c.load.inflight + c.load.waiting, c.load.kv_usage_ratio)

        lowest = min(key(c) for c in candidates)
        tied = [c for c in candidates if key(c) == lowest]
        c = tied[next(self._counter) % len(tied)]
        return Decision(c.worker_id, "least_loaded", c.cached_tokens)

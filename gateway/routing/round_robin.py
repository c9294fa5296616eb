"""``round_robin``: cycle through the candidates in order.

It ignores load and cache, which is what makes it the baseline every other policy is compared to.
Cost: one counter step per decision; the counter is the only state.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from gateway.config import PolicyName
from gateway.routing.types import Candidate, Decision, RoutingRequest


class RoundRobin:
    name = PolicyName.ROUND_ROBIN

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        c = candidates[next(self._counter) % len(candidates)]
        return Decision(c.worker_id, "round_robin", c.cached_tokens)

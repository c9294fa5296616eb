"""``round_robin``: cycle through the candidates in order, from a random starting point.

It ignores load and cache, which is what makes it the baseline every other policy is compared to.

The rotation starts at a random offset, drawn once per policy (so once per pool in each gateway
process). Starting every policy at worker 0 made gateway replicas (or ``--processes`` children)
behind a round-robin balancer move in lockstep: the balancer hands request k to replica k mod R,
each replica picks its own worker k / R mod N, and consecutive requests land on the same worker
(4 in a row with 4 replicas). A random start spreads the replicas' rotations over the workers.
The offset is a large random integer, not a worker index, so it is uniform for any candidate
count and stays so when the candidate list changes size.

Cost: one counter step per decision; the counter is the only state.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import Final

from gateway.config import PolicyName
from gateway.routing.types import Candidate, Decision, RoutingRequest

OFFSET_BITS: Final = 32
"""The offset is drawn from [0, 2**32): its residue mod any realistic candidate count is uniform
to within 2**-20, so no worker is favoured as the first of a rotation."""


class RoundRobin:
    name = PolicyName.ROUND_ROBIN

    def __init__(self, rng: random.Random | None = None, *, start: int | None = None) -> None:
        """``start``: the rotation's first step (tests pin it); otherwise it is drawn from
        ``rng`` (default: the operating system's randomness, so forked processes differ)."""
        if start is None:
            start = (rng if rng is not None else random.SystemRandom()).getrandbits(OFFSET_BITS)
        self.start = start
        self._counter = itertools.count(start)

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        c = candidates[next(self._counter) % len(candidates)]
        return Decision(c.worker_id, "round_robin", c.cached_tokens)

"""``round_robin`` starts its rotation at a random offset, drawn once per policy (issue 15):
replicas behind a round-robin balancer no longer move in lockstep."""

from __future__ import annotations

import random
from collections import Counter
from itertools import groupby

from gateway.config import PoolSettings
from gateway.routing.policies import make_policy
from gateway.routing.round_robin import OFFSET_BITS, RoundRobin
from gateway.routing.types import Candidate, LoadSnapshot, RoutingRequest

REQUEST = RoutingRequest(model="m", prompt_tokens=10, max_tokens=10)
EIGHT = [Candidate(f"w{i}", LoadSnapshot(), 0) for i in range(8)]


def first_pick(policy: RoundRobin) -> int:
    return int(policy.choose(REQUEST, EIGHT).worker_id[1:])


def test_the_offset_is_drawn_from_the_injected_random_source_and_used_as_the_first_step() -> None:
    for seed in range(20):
        expected = random.Random(seed).getrandbits(OFFSET_BITS)
        policy = RoundRobin(random.Random(seed))
        assert policy.start == expected
        picks = [first_pick(policy) for _ in range(9)]
        assert picks == [(expected + k) % 8 for k in range(9)]


def test_two_fresh_policies_over_eight_workers_rarely_start_at_the_same_worker() -> None:
    """Seeded, so the counts below are fixed: about 1 pair in 8 coincides, as chance would have
    it, where the old policy (every rotation at worker 0) coincided in every pair."""
    pairs = 1000
    same = sum(first_pick(RoundRobin(random.Random(2 * i)))
               == first_pick(RoundRobin(random.Random(2 * i + 1))) for i in range(pairs))
    assert same < 0.2 * pairs
    old_same = sum(first_pick(RoundRobin(start=0)) == first_pick(RoundRobin(start=0))
                   for _ in range(pairs))
    assert old_same == pairs


def test_first_workers_are_spread_evenly_over_the_candidates() -> None:
    firsts = Counter(first_pick(RoundRobin(random.Random(seed))) for seed in range(4000))
    assert set(firsts) == set(range(8))
    assert all(400 <= n <= 600 for n in firsts.values()), firsts  # 500 expected each


def test_replicas_behind_a_round_robin_balancer_do_not_send_runs_to_one_worker() -> None:
    """Regression: 4 gateway replicas, each starting at worker 0, behind a round-robin balancer
    sent requests 4 at a time to the same worker (lockstep)."""

    def longest_run(replicas: list[RoundRobin]) -> int:
        chosen = [replicas[k % len(replicas)].choose(REQUEST, EIGHT).worker_id for k in range(64)]
        return max(len(list(run)) for _, run in groupby(chosen))

    assert longest_run([RoundRobin(start=0) for _ in range(4)]) == 4
    rng = random.Random(7)
    runs = [longest_run([RoundRobin(rng) for _ in range(4)]) for _ in range(200)]
    # A run of 4 needs the four offsets aligned (4 patterns in 8**3): ~1.6 in 200 by chance.
    assert sum(r >= 4 for r in runs) <= 6
    assert Counter(runs).most_common(1)[0][0] == 1  # no two neighbours aligned: (7/8)**4


def test_default_offset_comes_from_the_operating_system_per_policy() -> None:
    """No seed shared by processes: forked gateway children, each building its own policies,
    draw different offsets (equal 32-bit draws in 50 policies: probability ~3e-7)."""
    pool = PoolSettings.model_validate({"name": "p", "max_context_tokens": 4096,
                                        "policy": "round_robin"})
    starts = [p.start for p in (make_policy(pool) for _ in range(50)) if isinstance(p, RoundRobin)]
    assert len(starts) == 50
    assert len(set(starts)) == 50

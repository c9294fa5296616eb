"""Session affinity (``pools[].affinity``): a named session stays on its worker while that worker
is a candidate, not saturated and (with kv_aware) within tolerance; the reason says who decided."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from gateway.config import AffinitySettings, KvAwareSettings, PoolSettings
from gateway.routing.affinity import AFFINITY, SessionAffinity, rendezvous_score
from gateway.routing.kv_aware import KvAware
from gateway.routing.least_loaded import LeastLoaded
from gateway.routing.policies import make_policy
from gateway.routing.round_robin import RoundRobin
from gateway.routing.types import Candidate, LoadSnapshot, Policy, RoutingRequest


def req(session: str | None = "alice", tenant: str = "acme",
        prompt: int = 4096) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=prompt, max_tokens=16, session_id=session,
                          tenant=tenant)


def cand(worker: str, inflight: int = 0, *, cached: int = 0, saturated: bool = False,
         prefill: int = 0, kv: float = 0.0) -> Candidate:
    load = LoadSnapshot(inflight=inflight, inflight_prompt_tokens=prefill, kv_usage_ratio=kv)
    return Candidate(worker, load, cached, saturated=saturated)


def hashed(session: str, workers: Sequence[str], tenant: str = "acme") -> str:
    """The session's rendezvous worker among ``workers``."""
    return max(workers, key=lambda w: rendezvous_score((tenant, session), w))


def other(worker: str, workers: Sequence[str]) -> str:
    return next(w for w in workers if w != worker)


def sticky(policy: Policy, **settings: Any) -> SessionAffinity:
    cost = policy.cost if isinstance(policy, KvAware) else None
    return SessionAffinity(policy, AffinitySettings(by="session", **settings), cost)


WORKERS = ("a", "b", "c")


def test_requests_without_a_session_are_left_to_the_policy() -> None:
    policy = sticky(RoundRobin(start=0))
    picks = [policy.choose(req(session=None), [cand(w) for w in WORKERS]).worker_id
             for _ in range(4)]
    assert picks == ["a", "b", "c", "a"]


def test_a_new_session_goes_to_its_rendezvous_worker_in_every_process() -> None:
    """Two processes (two policies, no shared state) agree on where a new session goes."""
    one, two = sticky(LeastLoaded()), sticky(LeastLoaded())
    for session in ("alice", "bob", "carol", "dave"):
        first = one.choose(req(session), [cand(w) for w in WORKERS]).worker_id
        assert first == hashed(session, WORKERS)
        assert two.choose(req(session), [cand(w) for w in reversed(WORKERS)]).worker_id == first


def test_a_session_stays_on_its_worker_against_the_load_policy_with_reason_affinity() -> None:
    policy = sticky(LeastLoaded())
    home = hashed("alice", WORKERS)
    decisions = [policy.choose(req(), [cand(w, inflight=5 if w == home else i)
                                       for i, w in enumerate(WORKERS)]) for _ in range(5)]
    assert {d.worker_id for d in decisions} == {home}
    assert {d.reason for d in decisions} == {AFFINITY}


def test_the_policys_own_reason_stands_when_it_chose_the_holder_itself() -> None:
    policy = sticky(LeastLoaded())
    home = hashed("alice", WORKERS)
    d = policy.choose(req(), [cand(w, inflight=0 if w == home else 3) for w in WORKERS])
    assert (d.worker_id, d.reason) == (home, "least_loaded")


def test_a_saturated_holder_loses_the_session_which_then_stays_where_it_moved() -> None:
    policy = sticky(LeastLoaded())
    home = hashed("alice", WORKERS)
    policy.choose(req(), [cand(w) for w in WORKERS])
    moved = policy.choose(req(), [cand(w, inflight=3 if w == home else 1, saturated=w == home)
                                  for w in WORKERS])
    assert moved.worker_id != home and moved.reason == "least_loaded"
    # the old holder recovers and is the idlest: the session stays where its KV cache now is
    again = policy.choose(req(), [cand(w, inflight=0 if w == home else 2) for w in WORKERS])
    assert (again.worker_id, again.reason) == (moved.worker_id, AFFINITY)


def test_a_holder_that_is_no_candidate_loses_the_session() -> None:
    """Down, excluded after a failure, or at the pool's in-flight cap: the router leaves it out."""
    policy = sticky(RoundRobin())
    home = policy.choose(req(), [cand(w) for w in WORKERS]).worker_id
    rest = [w for w in WORKERS if w != home]
    moved = policy.choose(req(), [cand(w) for w in rest])
    assert moved.worker_id in rest
    assert policy.choose(req(), [cand(w) for w in WORKERS]).worker_id == moved.worker_id


def test_another_tenants_session_of_the_same_name_gets_nothing_of_it() -> None:
    """A hostile client naming another tenant's session id: its requests go where its own
    tenant's session of that name would go, not to the other tenant's worker."""
    workers = ("a", "b")
    session = next(s for s in (f"s{i}" for i in range(100))
                   if hashed(s, workers, "acme") != hashed(s, workers, "mallory"))
    policy = sticky(LeastLoaded())
    theirs = hashed(session, workers, "acme")
    victim = policy.choose(req(session, "acme"), [cand(w) for w in workers])
    assert victim.worker_id == theirs
    hostile = policy.choose(req(session, "mallory"),
                            [cand(w, inflight=0 if w == theirs else 1) for w in workers])
    assert hostile.worker_id == other(theirs, workers)


def test_memory_is_bounded_least_recently_used_first() -> None:
    policy = sticky(LeastLoaded(), max_sessions=2)
    home = hashed("alice", WORKERS)
    moved = policy.choose(req(), [cand(w, inflight=1 if w == home else 0, saturated=w == home)
                                  for w in WORKERS])
    assert moved.worker_id != home
    for session in ("bob", "carol"):
        policy.choose(req(session), [cand(w) for w in WORKERS])
    # alice was forgotten: back to its rendezvous worker, as in a process that never saw it
    assert policy.choose(req(), [cand(w) for w in WORKERS]).worker_id == home


# --- with kv_aware: affinity wins within a tolerance of the cheapest -------------------------


def kv(tolerance: float = 1024.0, **weights: Any) -> SessionAffinity:
    return sticky(KvAware(KvAwareSettings(**weights)), tolerance_tokens=tolerance)


def test_kv_aware_holder_within_tolerance_keeps_the_session_with_reason_affinity() -> None:
    policy = kv(tolerance=1024)
    home = hashed("alice", WORKERS)
    # 8 requests open on the holder: 512 tokens dearer than the idle ones (64 each)
    d = policy.choose(req(), [cand(w, inflight=8 if w == home else 0) for w in WORKERS])
    assert (d.worker_id, d.reason) == (home, AFFINITY)


def test_kv_aware_holder_beyond_tolerance_loses_to_the_cheapest_with_its_reason() -> None:
    policy = kv(tolerance=256)
    home = hashed("alice", WORKERS)
    d = policy.choose(req(), [cand(w, inflight=8 if w == home else 0) for w in WORKERS])
    assert d.worker_id != home and d.reason == "least_loaded"
    # and the session moved: the new worker keeps it now
    again = policy.choose(req(), [cand(w, inflight=1 if w == d.worker_id else 0)
                                  for w in WORKERS])
    assert (again.worker_id, again.reason) == (d.worker_id, AFFINITY)


def test_kv_aware_prefix_hit_on_the_holder_is_counted_as_prefix_hit() -> None:
    policy = kv()
    home = hashed("alice", WORKERS)
    d = policy.choose(req(), [cand(w, cached=2048 if w == home else 0) for w in WORKERS])
    assert (d.worker_id, d.reason, d.predicted_cached_tokens) == (home, "prefix_hit", 2048)


def test_kv_aware_a_longer_prefix_elsewhere_beyond_tolerance_wins() -> None:
    policy = kv(tolerance=1024)
    home = hashed("alice", WORKERS)
    elsewhere = other(home, WORKERS)
    d = policy.choose(req(), [cand(w, cached=3072 if w == elsewhere else 0) for w in WORKERS])
    assert (d.worker_id, d.reason) == (elsewhere, "prefix_hit")


def test_kv_aware_holder_over_the_kv_hard_limit_loses_whatever_the_tolerance() -> None:
    policy = kv(tolerance=1e9)
    home = hashed("alice", WORKERS)
    d = policy.choose(req(), [cand(w, kv=0.97 if w == home else 0.1) for w in WORKERS])
    assert d.worker_id != home


def test_kv_aware_saturation_stops_affinity_not_the_policys_own_choice() -> None:
    home = hashed("alice", WORKERS)
    d = kv().choose(req(), [cand(w, inflight=1 if w == home else 0, saturated=w == home)
                            for w in WORKERS])
    assert d.worker_id != home and d.reason == "least_loaded"
    d = kv().choose(req(), [cand(w, cached=2048 if w == home else 0, saturated=w == home)
                            for w in WORKERS])
    assert (d.worker_id, d.reason) == (home, "prefix_hit")


# --- configuration --------------------------------------------------------------------------


def pool(**fields: Any) -> PoolSettings:
    return PoolSettings.model_validate({"name": "p", "max_context_tokens": 4096, **fields})


def test_affinity_is_off_unless_configured() -> None:
    assert pool().affinity.by == "none"
    assert isinstance(make_policy(pool(policy="least_loaded")), LeastLoaded)


@pytest.mark.parametrize("value", ["session", {"by": "session", "tolerance_tokens": 64}])
def test_make_policy_wraps_the_policy_and_keeps_its_name(value: Any) -> None:
    policy = make_policy(pool(policy="kv_aware", affinity=value))
    assert isinstance(policy, SessionAffinity)
    assert policy.name == "kv_aware"


def test_a_bad_affinity_setting_is_refused() -> None:
    with pytest.raises(ValueError):
        pool(affinity="tenant")
    with pytest.raises(ValueError):
        pool(affinity={"by": "session", "max_sessions": 0})

"""The load-only policies and the registry: round_robin cycles; least_loaded picks the least busy,
then rotates; make_policy builds any configured policy from its pool's settings."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from gateway.config import PolicyName, PoolSettings
from gateway.routing.kv_aware import KvAware
from gateway.routing.least_loaded import LeastLoaded
from gateway.routing.policies import POLICIES, make_policy
from gateway.routing.round_robin import RoundRobin
from gateway.routing.types import Candidate, LoadSnapshot, RoutingRequest

REQUEST = RoutingRequest(model="m", prompt_tokens=10, max_tokens=10)


def pool(policy: str, **fields: Any) -> PoolSettings:
    return PoolSettings.model_validate(
        {"name": "p", "max_context_tokens": 4096, "policy": policy, **fields}
    )


def cand(
    worker_id: str,
    inflight: int = 0,
    waiting: int = 0,
    kv: float = 0.0,
    running: int = 0,
    cached: int = 0,
) -> Candidate:
    return Candidate(
        worker_id=worker_id,
        load=LoadSnapshot(inflight=inflight, waiting=waiting, kv_usage_ratio=kv, running=running),
        cached_tokens=cached,
    )


# --- round_robin ---------------------------------------------------------------------------------


def test_round_robin_cycles_through_candidates_in_order() -> None:
    policy = RoundRobin(start=0)
    candidates = [cand("a"), cand("b"), cand("c")]

    picks = [policy.choose(REQUEST, candidates).worker_id for _ in range(7)]

    assert picks == ["a", "b", "c", "a", "b", "c", "a"]


def test_round_robin_ignores_load_and_cache() -> None:
    policy = RoundRobin(start=0)
    candidates = [cand("busy", inflight=99, kv=0.99), cand("idle", cached=1000)]

    picks = [policy.choose(REQUEST, candidates).worker_id for _ in range(4)]

    assert picks == ["busy", "idle", "busy", "idle"]


def test_round_robin_decision_has_its_reason_and_the_cached_tokens() -> None:
    d = RoundRobin().choose(REQUEST, [cand("a", cached=32)])

    assert (d.worker_id, d.reason, d.predicted_cached_tokens) == ("a", "round_robin", 32)


def test_round_robin_keeps_cycling_when_the_candidate_list_shrinks() -> None:
    policy = RoundRobin(start=0)
    three = [cand("a"), cand("b"), cand("c")]
    two = [cand("a"), cand("c")]

    picks = [policy.choose(REQUEST, three if i < 2 else two).worker_id for i in range(4)]

    assert picks[:2] == ["a", "b"]
    assert set(picks[2:]) == {"a", "c"}


# --- least_loaded --------------------------------------------------------------------------------


def test_least_loaded_picks_fewest_requests_in_flight() -> None:
    candidates = [cand("a", inflight=5), cand("b", inflight=1), cand("c", inflight=3)]

    assert LeastLoaded().choose(REQUEST, candidates).worker_id == "b"


def test_least_loaded_counts_vllm_waiting_requests_with_inflight() -> None:
    candidates = [cand("a", inflight=2, waiting=0), cand("b", inflight=0, waiting=3)]

    assert LeastLoaded().choose(REQUEST, candidates).worker_id == "a"


def test_least_loaded_ignores_running_requests_when_counting_load() -> None:
    """`running` overlaps the gateway's own in-flight count; only inflight + waiting is load."""
    candidates = [cand("a", inflight=1, running=40), cand("b", inflight=2, running=0)]

    assert LeastLoaded().choose(REQUEST, candidates).worker_id == "a"


def test_least_loaded_breaks_ties_by_lower_kv_usage() -> None:
    policy = LeastLoaded()
    candidates = [cand("a", inflight=1, kv=0.9), cand("b", inflight=1, kv=0.2),
                  cand("c", inflight=1, kv=0.5)]

    picks = {policy.choose(REQUEST, candidates).worker_id for _ in range(6)}

    assert picks == {"b"}


def test_least_loaded_load_beats_kv_usage() -> None:
    candidates = [cand("a", inflight=0, kv=0.99), cand("b", inflight=1, kv=0.0)]

    assert LeastLoaded().choose(REQUEST, candidates).worker_id == "a"


def test_least_loaded_rotates_among_fully_tied_candidates() -> None:
    policy = LeastLoaded()
    candidates = [cand("a"), cand("b"), cand("c")]

    picks = [policy.choose(REQUEST, candidates).worker_id for _ in range(6)]

    assert Counter(picks) == {"a": 2, "b": 2, "c": 2}
    assert picks[0] != picks[1]


def test_least_loaded_never_picks_a_busier_candidate_while_rotating() -> None:
    policy = LeastLoaded()
    candidates = [cand("a"), cand("busy", inflight=1), cand("b")]

    picks = {policy.choose(REQUEST, candidates).worker_id for _ in range(9)}

    assert picks == {"a", "b"}


def test_least_loaded_decision_has_its_reason_and_the_cached_tokens() -> None:
    d = LeastLoaded().choose(REQUEST, [cand("a", inflight=3), cand("b", cached=64)])

    assert (d.worker_id, d.reason, d.predicted_cached_tokens) == ("b", "least_loaded", 64)


@pytest.mark.parametrize("policy_name", ["round_robin", "least_loaded"])
def test_single_candidate_is_always_chosen(policy_name: str) -> None:
    policy = make_policy(pool(policy_name))

    picks = {policy.choose(REQUEST, [cand("only", inflight=50)]).worker_id for _ in range(3)}

    assert picks == {"only"}


# --- make_policy ---------------------------------------------------------------------------------


def test_the_registry_builds_exactly_the_policy_names_the_config_accepts() -> None:
    """The config accepted `policy: kv_aware`, but make_policy did not know it: a config that
    validated crashed the gateway at start-up with a ValueError instead of a ConfigError."""
    assert PoolSettings.model_fields["policy"].annotation is PolicyName
    assert set(POLICIES) == set(PolicyName)


@pytest.mark.parametrize("name", list(PolicyName))
def test_make_policy_builds_a_policy_whose_name_is_the_config_value(name: PolicyName) -> None:
    assert make_policy(pool(name)).name == name


def test_make_policy_returns_independent_instances() -> None:
    """Two pools with the same policy must not share a rotation counter: ``one``'s three
    decisions between ``two``'s first and second would, with a shared counter, bring ``two``
    back to the worker it just chose (four steps over two candidates)."""
    one, two = make_policy(pool("round_robin")), make_policy(pool("round_robin"))
    candidates = [cand("a"), cand("b")]

    first = two.choose(REQUEST, candidates).worker_id
    for _ in range(3):
        one.choose(REQUEST, candidates)

    assert two.choose(REQUEST, candidates).worker_id != first


def test_make_policy_gives_kv_aware_the_weights_of_its_pool() -> None:
    settings = pool("kv_aware", kv_aware={"active_request_tokens": 8, "kv_soft_limit": 0.5})

    policy = make_policy(settings)

    assert isinstance(policy, KvAware)
    assert policy.weights == settings.kv_aware
    assert (policy.weights.active_request_tokens, policy.weights.kv_soft_limit) == (8, 0.5)


def test_make_policy_gives_kv_aware_the_default_weights_when_its_pool_sets_none() -> None:
    policy = make_policy(pool("kv_aware"))

    assert isinstance(policy, KvAware)
    assert policy.weights == KvAware().weights


def test_least_loaded_shares_evenly_among_tied_candidates_when_a_busier_one_is_present() -> None:
    """The rotation offset ran over all candidates, not over the tied ones: with `a`, `b` tied
    and a busier third candidate, `a` got two picks in three (200 of 300)."""
    policy = LeastLoaded()
    candidates = [cand("a"), cand("b"), cand("busy", inflight=1)]

    picks = Counter(policy.choose(REQUEST, candidates).worker_id for _ in range(300))

    assert picks == {"a": 150, "b": 150}

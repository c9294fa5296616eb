"""The route carries what hit accounting needs: the candidates as the policy saw them, the
fleet's best cached prefix, and the holders left out at their in-flight cap."""

from __future__ import annotations

from gateway.config import PoolSettings
from tests.unit.test_router import FakePrefixIndex, fleet, req

TOKENS = tuple(range(1000))


def capped_pool(cap: int | None) -> PoolSettings:
    return PoolSettings.model_validate({
        "name": "p", "max_context_tokens": 4096, "max_inflight_per_worker": cap,
        "workers": ["http://a", "http://b", "http://c"]})


def test_route_carries_the_candidates_and_the_longest_prefix_among_them() -> None:
    index = FakePrefixIndex(cached={"http://b": 480, "http://c": 960})
    route = fleet([capped_pool(None)], prefix_index=index).router.route(req(1000, token_ids=TOKENS))
    assert route.worker.url == "http://a"  # the fake policy takes the first
    assert [(c.worker_id, c.cached_tokens) for c in route.candidates] == [
        ("http://a", 0), ("http://b", 480), ("http://c", 960)]
    assert route.fleet_best_tokens == 960
    assert route.held_back == ()


def test_a_holder_at_its_inflight_cap_counts_in_the_fleet_best_though_no_candidate() -> None:
    index = FakePrefixIndex(cached={"http://b": 480, "http://c": 960})
    f = fleet([capped_pool(2)], prefix_index=index)
    f.busy("http://c", inflight=2)
    route = f.router.route(req(1000, token_ids=TOKENS))
    assert [c.worker_id for c in route.candidates] == ["http://a", "http://b"]
    assert route.fleet_best_tokens == 960
    assert route.held_back == (("http://c", 960),)


def test_without_token_ids_the_fleet_best_is_zero() -> None:
    route = fleet([capped_pool(None)], prefix_index=FakePrefixIndex(
        cached={"http://b": 480})).router.route(req(1000))
    assert route.fleet_best_tokens == 0 and len(route.candidates) == 3

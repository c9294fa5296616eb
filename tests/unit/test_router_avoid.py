"""``Router.route(avoid=...)``: the workers the admission gate keeps for other tenants
(``gateway.overload``, ``AdmissionGate.avoid``) are left out while another worker of the home
pool can take the request, and used when nothing else is left: a preference, not a retry's
exclusion (which stays in the failed worker's pool)."""

from __future__ import annotations

from tests.unit.test_router import SHORT, FakePrefixIndex, fleet, pool, req

URLS = ["http://w1", "http://w2", "http://w3"]


def test_avoided_workers_are_not_offered_while_another_worker_remains() -> None:
    f = fleet([pool("p", SHORT, URLS)])
    route = f.router.route(req(100), avoid={"http://w1", "http://w2"})
    assert route.worker.url == "http://w3"
    assert f.policies["p"].offered == [["http://w3"]]


def test_every_worker_is_offered_when_all_are_avoided() -> None:
    f = fleet([pool("p", SHORT, URLS)])
    route = f.router.route(req(100), avoid=set(URLS))
    assert route.worker.url == "http://w1"
    assert f.policies["p"].offered == [URLS]


def test_avoid_of_a_down_worker_leaves_the_healthy_ones() -> None:
    """A worker the gate avoids going down must not leave the request with no worker."""
    f = fleet([pool("p", SHORT, URLS)], all_up=False)
    f.up("http://w2")
    assert f.router.route(req(100), avoid={"http://w2"}).worker.url == "http://w2"


def test_avoided_workers_still_count_for_the_fleets_best_cached_prefix() -> None:
    """Hit accounting compares against every healthy worker of the pool, avoided or not."""
    index = FakePrefixIndex(cached={"http://w1": 64})
    f = fleet([pool("p", SHORT, URLS)], prefix_index=index)
    route = f.router.route(req(100, token_ids=tuple(range(100))), avoid={"http://w1"})
    assert route.worker.url == "http://w2"
    assert route.fleet_best_tokens == 64

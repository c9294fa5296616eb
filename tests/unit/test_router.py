"""gateway.routing.router: pool selection by context length, spill, retries, model filtering.

The registry and workers are the real ones (plain objects, no I/O); the policy and the prefix
index are small honest fakes that record what the router handed them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import pytest

from gateway.config import AffinitySettings, PoolSettings
from gateway.routing.least_loaded import LeastLoaded
from gateway.routing.router import (
    DEFAULT_BLOCK_SIZE_TOKENS,
    ContextLengthExceeded,
    NoHealthyWorker,
    Route,
    Router,
    candidate,
)
from gateway.routing.types import Candidate, Decision, Policy, RoutingRequest
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import VllmStats, Worker

SHORT, MEDIUM, LONG = 4096, 16384, 131072


class FirstCandidate:
    """Picks the first candidate and remembers every candidate list it was offered."""

    name = "first"

    def __init__(self) -> None:
        self.offered: list[list[str]] = []
        self.cached: list[dict[str, int]] = []

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        self.offered.append([c.worker_id for c in candidates])
        self.cached.append({c.worker_id: c.cached_tokens for c in candidates})
        return Decision(candidates[0].worker_id, "first_pick", candidates[0].cached_tokens)


@dataclass
class FakePrefixIndex:
    """Answers from a fixed table; records what was routed where."""

    cached: dict[str, int] = field(default_factory=dict)
    queries: list[tuple[tuple[int, ...], list[tuple[str, int]]]] = field(default_factory=list)
    routed: list[tuple[str, tuple[int, ...], int]] = field(default_factory=list)

    def cached_and_pending(
        self, token_ids: Sequence[int], workers: Sequence[tuple[str, int]],
        adapter: str | None = None, salt: str | None = None,
    ) -> dict[str, tuple[int, int]]:
        self.queries.append((tuple(token_ids), list(workers)))
        return {url: (n, 0) for url, n in self.cached.items() if url in dict(workers)}

    def record_routed(
        self, worker_id: str, token_ids: Sequence[int], block_size_tokens: int,
        adapter: str | None = None, salt: str | None = None,
    ) -> None:
        self.routed.append((worker_id, tuple(token_ids), block_size_tokens))


def pool(
    name: str, limit: int, urls: Sequence[str], *, saturation_inflight: int = 4
) -> PoolSettings:
    return PoolSettings.model_validate({
        "name": name,
        "max_context_tokens": limit,
        "workers": list(urls),
        "saturation_inflight": saturation_inflight,
    })


@dataclass
class Fleet:
    router: Router
    registry: WorkerRegistry
    policies: dict[str, FirstCandidate]

    def up(self, *urls: str) -> None:
        for url in urls:
            w = self.registry.get(url)
            assert w is not None, url
            w.healthy = True

    def busy(self, url: str, inflight: int = 100, waiting: int = 0) -> None:
        w = self.registry.get(url)
        assert w is not None, url
        w.inflight = inflight
        w.stats = VllmStats(waiting=waiting)


def fleet(
    pools: Sequence[PoolSettings],
    *,
    spill: bool = True,
    all_up: bool = True,
    prefix_index: FakePrefixIndex | None = None,
) -> Fleet:
    registry = WorkerRegistry(list(pools))
    policies = {p.name: FirstCandidate() for p in pools}
    as_policy: dict[str, Policy] = dict(policies)
    router = Router(pools, registry, as_policy, spill=spill, prefix_index=prefix_index)
    f = Fleet(router, registry, policies)
    if all_up:
        f.up(*(w.url for w in registry))
    return f


def two_pools(
    *, spill: bool = True, all_up: bool = True, prefix_index: FakePrefixIndex | None = None
) -> Fleet:
    return fleet(
        [
            pool("short", SHORT, ["http://s1", "http://s2"]),
            pool("long", LONG, ["http://l1", "http://l2"]),
        ],
        spill=spill,
        all_up=all_up,
        prefix_index=prefix_index,
    )


def req(
    prompt_tokens: int, max_tokens: int = 0, model: str = "m", token_ids: tuple[int, ...] = ()
) -> RoutingRequest:
    return RoutingRequest(
        model=model, prompt_tokens=prompt_tokens, max_tokens=max_tokens, token_ids=token_ids
    )


def where(route: Route) -> tuple[str, str, str]:
    return route.pool.name, route.worker.url, route.decision.reason


# --- pool selection ------------------------------------------------------------------------------


def test_short_request_goes_to_the_short_pool() -> None:
    f = two_pools()

    assert where(f.router.route(req(100, 100))) == ("short", "http://s1", "first_pick")


def test_long_prompt_goes_to_long_pool_when_short_pool_limit_exceeded() -> None:
    f = two_pools()

    assert where(f.router.route(req(SHORT + 1, 1)))[0] == "long"


def test_max_tokens_counts_toward_the_pool_limit() -> None:
    f = two_pools()

    route = f.router.route(req(prompt_tokens=100, max_tokens=SHORT))

    assert route.pool.name == "long"


def test_request_of_exactly_the_pool_limit_fits_that_pool() -> None:
    f = two_pools()

    assert f.router.route(req(SHORT - 500, 500)).pool.name == "short"


def test_request_one_token_over_the_pool_limit_goes_to_the_next_pool() -> None:
    f = two_pools()

    assert f.router.route(req(SHORT - 500, 501)).pool.name == "long"


def test_request_exactly_at_the_largest_limit_fits() -> None:
    f = two_pools()

    assert f.router.route(req(LONG, 0)).pool.name == "long"


def test_smallest_fitting_pool_wins_even_when_pools_are_configured_out_of_order() -> None:
    f = fleet([
        pool("long", LONG, ["http://l1"]),
        pool("short", SHORT, ["http://s1"]),
        pool("medium", MEDIUM, ["http://m1"]),
    ])

    assert f.router.route(req(10)).pool.name == "short"
    assert f.router.route(req(SHORT + 1)).pool.name == "medium"
    assert f.router.route(req(MEDIUM + 1)).pool.name == "long"


def test_pools_that_fit_lists_every_fitting_pool_smallest_first() -> None:
    f = fleet([
        pool("long", LONG, ["http://l1"]),
        pool("short", SHORT, ["http://s1"]),
        pool("medium", MEDIUM, ["http://m1"]),
    ])

    assert [p.name for p in f.router.pools_that_fit(req(SHORT + 1))] == ["medium", "long"]


def test_request_larger_than_every_pool_raises_context_length_exceeded() -> None:
    f = two_pools()

    with pytest.raises(ContextLengthExceeded) as info:
        f.router.route(req(LONG, 1))

    assert info.value.needed_tokens == LONG + 1
    assert info.value.largest_tokens == LONG
    assert str(LONG + 1) in str(info.value)
    assert str(LONG) in str(info.value)


def test_context_length_is_checked_before_worker_health() -> None:
    """A too-long request is the client's error (400), even when no worker is up (503)."""
    f = two_pools(all_up=False)

    with pytest.raises(ContextLengthExceeded):
        f.router.route(req(LONG + 1))


# --- spill ---------------------------------------------------------------------------------------


def test_spills_short_to_long_when_every_short_worker_is_saturated_and_spill_enabled() -> None:
    f = two_pools()
    f.busy("http://s1")
    f.busy("http://s2")

    route = f.router.route(req(100))

    assert where(route) == ("long", "http://l1", "spill")
    assert route.policy == "first"


def test_worker_with_requests_waiting_in_vllm_counts_as_saturated_for_spill() -> None:
    f = two_pools()
    f.busy("http://s1", inflight=0, waiting=1)
    f.busy("http://s2", inflight=0, waiting=3)

    assert f.router.route(req(100)).pool.name == "long"


def test_saturation_is_reached_at_exactly_saturation_inflight() -> None:
    f = two_pools()  # saturation_inflight=4
    f.busy("http://s1", inflight=3)
    f.busy("http://s2", inflight=4)

    assert f.router.route(req(100)).pool.name == "short"

    f.busy("http://s1", inflight=4)
    assert f.router.route(req(100)).pool.name == "long"


def test_no_spill_while_one_short_worker_has_room() -> None:
    f = two_pools()
    f.busy("http://s1")

    route = f.router.route(req(100))

    assert route.pool.name == "short"
    assert route.decision.reason == "first_pick"
    assert f.policies["short"].offered == [["http://s1", "http://s2"]]


def test_stays_in_saturated_short_pool_when_spill_disabled() -> None:
    f = two_pools(spill=False)
    f.busy("http://s1")
    f.busy("http://s2")

    assert where(f.router.route(req(100))) == ("short", "http://s1", "first_pick")
    assert f.policies["long"].offered == []


def test_queues_in_own_pool_when_every_larger_worker_is_saturated_too() -> None:
    f = two_pools()
    for url in ("http://s1", "http://s2", "http://l1", "http://l2"):
        f.busy(url)

    route = f.router.route(req(100))

    assert route.pool.name == "short"
    assert route.decision.reason != "spill"


def test_spill_offers_only_the_unsaturated_workers_of_the_larger_pool() -> None:
    f = two_pools()
    f.busy("http://s1")
    f.busy("http://s2")
    f.busy("http://l1")

    assert where(f.router.route(req(100))) == ("long", "http://l2", "spill")
    assert f.policies["long"].offered == [["http://l2"]]


def test_spill_judges_the_larger_pool_by_its_own_saturation_limit() -> None:
    f = fleet([
        pool("short", SHORT, ["http://s1"], saturation_inflight=2),
        pool("long", LONG, ["http://l1"], saturation_inflight=50),
    ])
    f.busy("http://s1", inflight=2)
    f.busy("http://l1", inflight=10)  # saturated by short's limit, not by long's

    assert f.router.route(req(100)).pool.name == "long"


def test_spill_goes_to_the_next_larger_pool_with_room() -> None:
    f = fleet([
        pool("short", SHORT, ["http://s1"]),
        pool("medium", MEDIUM, ["http://m1"]),
        pool("long", LONG, ["http://l1"]),
    ])
    f.busy("http://s1")

    assert where(f.router.route(req(100))) == ("medium", "http://m1", "spill")

    f.busy("http://m1")
    assert where(f.router.route(req(100))) == ("long", "http://l1", "spill")


def test_never_spills_from_long_pool_to_short_pool() -> None:
    f = two_pools()
    f.busy("http://l1")
    f.busy("http://l2")

    route = f.router.route(req(SHORT + 1))

    assert route.pool.name == "long"
    assert route.decision.reason == "first_pick"
    assert f.policies["short"].offered == []


def test_spills_when_the_short_pool_has_no_healthy_worker() -> None:
    f = two_pools(all_up=False)
    f.up("http://l1", "http://l2")

    assert where(f.router.route(req(100))) == ("long", "http://l1", "spill")


def test_spills_when_no_short_worker_serves_the_model() -> None:
    f = two_pools()
    for url in ("http://s1", "http://s2"):
        w = f.registry.get(url)
        assert w is not None
        w.models = frozenset({"other-model"})

    assert f.router.route(req(100, model="m")).pool.name == "long"


def test_no_healthy_worker_when_short_pool_is_down_and_spill_disabled() -> None:
    f = two_pools(spill=False, all_up=False)
    f.up("http://l1", "http://l2")

    with pytest.raises(NoHealthyWorker, match="short"):
        f.router.route(req(100))


def test_no_healthy_worker_when_no_worker_is_up() -> None:
    f = two_pools(all_up=False)

    with pytest.raises(NoHealthyWorker):
        f.router.route(req(100))


def test_no_healthy_worker_for_a_long_request_when_long_pool_is_down() -> None:
    f = two_pools(all_up=False)
    f.up("http://s1", "http://s2")

    with pytest.raises(NoHealthyWorker, match="long"):
        f.router.route(req(SHORT + 1))


def test_unhealthy_workers_are_never_offered_to_the_policy() -> None:
    f = two_pools(all_up=False)
    f.up("http://s2", "http://l1")

    f.router.route(req(100))

    assert f.policies["short"].offered == [["http://s2"]]


# --- retries (exclude) ---------------------------------------------------------------------------


def test_retry_excludes_the_failed_worker_and_stays_in_its_pool() -> None:
    f = two_pools()

    route = f.router.route(req(100), exclude=["http://s1"])

    assert where(route) == ("short", "http://s2", "first_pick")
    assert f.policies["short"].offered == [["http://s2"]]


def test_retry_does_not_spill_even_when_the_remaining_workers_are_saturated() -> None:
    f = two_pools()
    f.busy("http://s2")

    route = f.router.route(req(100), exclude=["http://s1"])

    assert route.worker.url == "http://s2"
    assert f.policies["long"].offered == []


def test_retry_raises_no_healthy_worker_when_the_pool_has_no_other_worker() -> None:
    f = two_pools()

    with pytest.raises(NoHealthyWorker, match="short"):
        f.router.route(req(100), exclude=["http://s1", "http://s2"])


def test_retry_after_spill_stays_in_the_pool_it_spilled_to() -> None:
    """With the short pool down, a request spilled to l1; when l1 refused the connection, the
    retry looked only in the short pool (its `home`) and failed with NoHealthyWorker (a 502 to
    the client) although l2 in the long pool was healthy and idle."""
    f = two_pools(all_up=False)
    f.up("http://l1", "http://l2")
    first = f.router.route(req(100))
    assert first.worker.url == "http://l1"

    retry = f.router.route(req(100), exclude=[first.worker.url])

    assert retry.pool.name == "long"
    assert retry.worker.url == "http://l2"


# --- models --------------------------------------------------------------------------------------


def test_only_workers_serving_the_model_are_candidates() -> None:
    f = fleet([pool("short", SHORT, ["http://a", "http://b", "http://c"])])
    models = {"http://a": {"llama"}, "http://b": {"qwen"}, "http://c": {"qwen", "llama"}}
    for url, names in models.items():
        w = f.registry.get(url)
        assert w is not None
        w.models = frozenset(names)

    f.router.route(req(10, model="qwen"))

    assert f.policies["short"].offered == [["http://b", "http://c"]]


def test_worker_whose_models_are_unknown_is_a_candidate_for_any_model() -> None:
    f = fleet([pool("short", SHORT, ["http://a", "http://b"])])
    b = f.registry.get("http://b")
    assert b is not None
    b.models = frozenset({"llama"})

    f.router.route(req(10, model="qwen"))

    assert f.policies["short"].offered == [["http://a"]]


def test_no_healthy_worker_names_the_model_when_nobody_serves_it() -> None:
    f = fleet([pool("short", SHORT, ["http://a"])])
    a = f.registry.get("http://a")
    assert a is not None
    a.models = frozenset({"llama"})

    with pytest.raises(NoHealthyWorker, match="qwen"):
        f.router.route(req(10, model="qwen"))


# --- policy and prefix index wiring --------------------------------------------------------------


def test_each_pool_uses_its_own_policy() -> None:
    pools = [pool("short", SHORT, ["http://s1", "http://s2"]), pool("long", LONG, ["http://l1"])]
    registry = WorkerRegistry(pools)
    for w in registry:
        w.healthy = True
    first = FirstCandidate()
    router = Router(pools, registry, {"short": LeastLoaded(), "long": first}, spill=True)
    s1 = registry.get("http://s1")
    assert s1 is not None
    s1.inflight = 2

    short = router.route(req(10))
    long = router.route(req(SHORT + 1))

    assert (short.worker.url, short.decision.reason, short.policy) == (
        "http://s2", "least_loaded", "least_loaded")
    assert (long.policy, first.offered) == ("first", [["http://l1"]])


def test_candidates_carry_the_workers_load() -> None:
    seen: list[Candidate] = []

    class Spy(FirstCandidate):
        def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
            seen.extend(candidates)
            return super().choose(request, candidates)

    pools = [pool("short", SHORT, ["http://s1"])]
    registry = WorkerRegistry(pools)
    w = registry.get("http://s1")
    assert w is not None
    w.healthy = True
    w.inflight = 3
    w.stats = VllmStats(running=7, waiting=0, kv_usage_ratio=0.25, block_size_tokens=32)
    Router(pools, registry, {"short": Spy()}, spill=True).route(req(10))

    (c,) = seen
    assert (c.load.inflight, c.load.running, c.load.kv_usage_ratio, c.block_size_tokens) == (
        3, 7, 0.25, 32)


def test_prefix_index_cached_tokens_reach_the_policy_and_the_decision() -> None:
    index = FakePrefixIndex(cached={"http://s2": 48})
    f = two_pools(prefix_index=index)
    s2 = f.registry.get("http://s2")
    assert s2 is not None
    s2.stats = VllmStats(block_size_tokens=32)

    f.router.route(req(100, token_ids=tuple(range(100))))

    assert f.policies["short"].cached == [{"http://s1": 0, "http://s2": 48}]
    assert index.queries == [
        (tuple(range(100)), [("http://s1", DEFAULT_BLOCK_SIZE_TOKENS), ("http://s2", 32)])
    ]


def test_routed_prompt_is_recorded_for_the_chosen_worker_with_its_block_size() -> None:
    index = FakePrefixIndex()
    f = two_pools(prefix_index=index)
    f.busy("http://s1")
    f.busy("http://s2")
    l1 = f.registry.get("http://l1")
    assert l1 is not None
    l1.stats = VllmStats(block_size_tokens=64)

    f.router.route(req(3, token_ids=(5, 6, 7)))

    assert index.routed == [("http://l1", (5, 6, 7), 64)]


def test_a_prompt_vllm_reads_from_no_cache_is_routed_without_a_lookup_but_recorded() -> None:
    """A request for its prompt's logprobs: vLLM computes the whole prompt wherever it goes, so
    no worker's cached prefix counts (the fleet's best is 0 too); its blocks are cached
    afterwards, so the route is recorded."""
    index = FakePrefixIndex(cached={"http://s2": 48})
    f = two_pools(prefix_index=index)
    route = f.router.route(replace(req(100, token_ids=tuple(range(100))),
                                   reads_prefix_cache=False))
    assert index.queries == []
    assert f.policies["short"].cached == [{"http://s1": 0, "http://s2": 0}]
    assert (route.decision.predicted_cached_tokens, route.fleet_best_tokens) == (0, 0)
    assert [r[0] for r in index.routed] == [route.worker.url]


def test_prefix_index_is_not_consulted_without_token_ids() -> None:
    index = FakePrefixIndex(cached={"http://s1": 99})
    f = two_pools(prefix_index=index)

    route = f.router.route(req(100))

    assert (index.queries, index.routed) == ([], [])
    assert route.decision.predicted_cached_tokens == 0


def test_candidate_combines_gateway_inflight_with_scraped_stats() -> None:
    w = Worker(url="http://w:8000", pool="short", healthy=True)
    w.inflight, w.inflight_prompt_tokens = 4, 9000
    w.stats = VllmStats(running=6, waiting=2, kv_usage_ratio=0.5, block_size_tokens=32)

    cand = candidate(w, cached_tokens=64)

    load = cand.load
    assert (load.inflight, load.inflight_prompt_tokens, load.running, load.waiting,
            load.kv_usage_ratio) == (4, 9000, 6, 2, 0.5)
    assert (cand.worker_id, cand.cached_tokens, cand.block_size_tokens) == (
        "http://w:8000", 64, 32)


def test_candidate_load_is_a_copy_that_later_changes_do_not_touch() -> None:
    w = Worker(url="http://w:8000", pool="short", healthy=True)
    cand = candidate(w)

    w.inflight += 5

    assert cand.load.inflight == 0


def test_candidate_is_saturated_by_the_pools_in_flight_count_or_vllms_queue() -> None:
    w = Worker(url="http://w:8000", pool="short", healthy=True)
    w.inflight = 3
    assert not candidate(w, saturation_inflight=4).saturated
    assert not candidate(w).saturated  # no threshold given: never
    w.inflight = 4
    assert candidate(w, saturation_inflight=4).saturated
    w.inflight, w.stats = 0, VllmStats(waiting=1)
    assert candidate(w, saturation_inflight=4).saturated


class Recording:
    """Picks the first candidate; keeps the candidates it was offered."""

    name = "recording"

    def __init__(self) -> None:
        self.offered: list[Candidate] = []

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        self.offered.extend(candidates)
        return Decision(candidates[0].worker_id, "first_pick")


def test_router_tells_the_policy_which_candidates_are_saturated_in_their_pool() -> None:
    """Session affinity keeps a session only on a worker that is not saturated: the router
    judges it by the pool's own saturation_inflight (only for a pool with affinity)."""
    short = pool("short", SHORT, ["http://s1", "http://s2"], saturation_inflight=2).model_copy(
        update={"affinity": AffinitySettings(by="session")})
    registry = WorkerRegistry([short])
    policy = Recording()
    router = Router([short], registry, {"short": policy}, spill=False)
    for w in registry:
        w.healthy = True
    busy = registry.get("http://s2")
    assert busy is not None
    busy.inflight = 2

    router.route(req(100))

    assert {c.worker_id: c.saturated for c in policy.offered} == {
        "http://s1": False, "http://s2": True}

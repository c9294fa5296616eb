"""The ``zipf_hot`` scenario in model time (``gateway.bench.routers.zipf_model``): the peers'
``cache_aware`` rule as modelled, the bounds, and what the model says of kvgate's processes."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.bench.routers.scenario_zipf import PREFIX_TOKENS
from gateway.bench.routers.zipf_model import (
    SHAPES,
    Fleet,
    PeerCacheAware,
    alone_ttft_s,
    ceiling,
    simulate,
    summary,
    workload,
)

PROMPT = PREFIX_TOKENS + 512


def test_cache_aware_follows_its_tree_until_the_load_is_imbalanced() -> None:
    peer = PeerCacheAware(["a", "b", "c"])
    # a prefix nobody holds goes to the smallest tree; then it sticks there
    assert peer.route(7, PROMPT) == ("a", "smallest_tree")
    assert peer.route(8, PROMPT) == ("b", "smallest_tree")
    assert peer.route(7, PROMPT) == ("a", "prefix_hit")
    # a prompt that matches half or less of itself is not "cached"
    assert peer.route(7, 2 * PREFIX_TOKENS)[1] == "smallest_tree"
    # more than 64 open requests on one worker beyond another's, and 1.5x: the shortest queue
    holder, _ = peer.route(9, PROMPT)
    while True:
        least = min(peer.load.values())
        gap = max(peer.load.values()) - least
        idlest = [u for u, n in peer.load.items() if n == least]
        url, reason = peer.route(9, PROMPT)
        if gap <= 64:
            assert (url, reason) == (holder, "prefix_hit")
            continue
        assert reason == "load_balance" and url in idlest and url != holder
        break
    for url in list(peer.load):
        while peer.load[url] > 1:
            peer.done(url)
    assert peer.route(9, PROMPT) == (holder, "prefix_hit")


def test_no_router_beats_the_bounds() -> None:
    arrivals = workload(1, 160, 18.0, 8.0)
    alone = alone_ttft_s(arrivals, Fleet(1, 8.0).cost)
    for policy, hot in (("cache_aware", None), ("kvgate", None), ("kvgate", {})):
        outs = simulate(arrivals, policy, hot=hot)
        assert all(o.ttft_s is not None and o.ttft_s >= a * 0.999
                   for o, a in zip(outs, alone, strict=True))
        assert summary(outs, 8.0)["hit_rate"] <= ceiling(arrivals) + 1e-9


def test_the_index_is_fed_by_the_workers_events() -> None:
    """What kvgate predicted at the chosen worker is what the worker's cache gave: the index
    learns from the simulator's own KV events (without them its entries would expire)."""
    outs = simulate(workload(2, 320, 18.0, 8.0), "kvgate", hot={}, processes=2)
    right = sum(abs(o.predicted_tokens - o.cached_tokens) < 16 for o in outs)
    assert right >= 0.97 * len(outs)


def test_processes_that_share_their_routes_give_fewer_hits_away() -> None:
    arrivals = workload(1, 320, 18.0, 8.0)
    alone = simulate(arrivals, "kvgate", hot={}, processes=2, share_routes_ms=None, seed=1)
    shared = simulate(arrivals, "kvgate", hot={}, processes=2, seed=1)
    assert shared == simulate(arrivals, "kvgate", hot={}, processes=2, seed=1)  # deterministic
    lost, kept = summary(alone, 8.0), summary(shared, 8.0)
    assert kept["hit_rate"] > lost["hit_rate"] + 0.005
    assert kept["p99"] < lost["p99"]


def test_on_the_sim16_shape_the_hold_rule_gives_no_hit_away() -> None:
    """Plain ``kv_aware`` leaves holders for their queues (``load_balance``) and loses hits
    there; with hot prefixes the holder keeps them and the hit rate is the ceiling's."""
    shape = SHAPES["sim16"]
    arrivals = workload(3, shape.requests, shape.rate, 8.0, shape.prefixes, shape.prefix_tokens,
                        shape.question_tokens, shape.zipf_s)
    settings: tuple[dict[str, Any] | None, ...] = (None, {})
    plain, hot = (summary(simulate(arrivals, "kvgate", hot=h, workers=shape.workers,
                                   num_gpu_blocks=shape.num_gpu_blocks), 8.0)
                  for h in settings)
    assert plain["lost_to_load"] > 0.01
    assert hot["lost_to_load"] == 0
    assert hot["hit_rate"] == pytest.approx(ceiling(arrivals))

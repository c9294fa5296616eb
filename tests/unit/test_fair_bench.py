"""The fairness benchmark's own logic (``gateway.bench.fairness``): its phases, seeds, the
event-loop lag it samples and the gateways it configures."""

from __future__ import annotations

import asyncio
import itertools
import time

from gateway.bench.fairness import (
    CHAT_PHASE_FACTOR,
    TENANTS,
    gateway_config,
    loop_lag_s,
    parse_args,
    plan,
    tenant_seed,
)


def test_tenant_seeds_differ_between_tenants_and_phases() -> None:
    """Regression: every load of a phase ran on the phase's one seed, so b's and c's Poisson
    arrivals were the same: each chat had a twin sent at the same instant, and the two shared
    an engine step on the one worker kept for them (the unexplained pairs in the p99 tail)."""
    seeds = [tenant_seed(phase, t) for phase, t in itertools.product(range(12), TENANTS)]
    assert len(set(seeds)) == len(seeds)


def test_quiet_and_the_judged_flood_run_longer_than_the_other_phases() -> None:
    phases = {name: duration for name, _, _, duration in plan(parse_args([]))}
    d = parse_args([]).duration_s
    assert phases["quiet"] == phases["flood/room"] == CHAT_PHASE_FACTOR * d
    assert phases["flood/forward"] == phases["flood/fifo"] == phases["flood/fair"] == d


def test_the_fair_flood_is_judged_and_runs_longer_when_room_is_not_run() -> None:
    phases = {name: duration for name, _, _, duration in plan(parse_args(["--gates", "fifo,fair"]))}
    d = parse_args([]).duration_s
    assert phases["flood/fair"] == CHAT_PHASE_FACTOR * d
    assert phases["flood/fifo"] == d


async def test_loop_lag_measures_a_blocked_event_loop() -> None:
    stop = asyncio.Event()
    sampling = asyncio.create_task(loop_lag_s(stop, tick_s=0.001))
    await asyncio.sleep(0.01)
    time.sleep(0.05)  # noqa: ASYNC251  (the point: the loop is blocked ~50 ms)
    await asyncio.sleep(0.01)
    stop.set()
    lags = await sampling
    assert max(lags) >= 0.04
    assert sorted(lags)[len(lags) // 2] < 0.04  # the other ticks were not


def test_only_the_room_gateways_keep_room_and_their_reserve_is_the_one_asked() -> None:
    room = gateway_config(["http://w"], "room", 8, reserve_workers=2)["limits"]
    assert room["reserve_workers"] == 2 and room["long_prompt_tokens"] > 0
    for gate in ("forward", "fifo", "fair"):
        limits = gateway_config(["http://w"], gate, 8)["limits"]
        assert "long_prompt_tokens" not in limits and "reserve_workers" not in limits

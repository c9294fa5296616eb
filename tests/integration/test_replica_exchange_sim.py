"""Gateway replicas that agree (issue 15 item 3), through one real Redis: the replica exchange
(``gateway.kvindex.exchange``) and the snapshot a starting replica loads.

Whole gateways (in-process, each on its own server thread) in front of four simulated workers
without KV events (approximate mode: a replica knows a prefix's holder only from routes, its
own or, with the exchange, its peers'), and exchanges wired to indexes directly where the test
must show what a replica knows before any KV event exists.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import httpx
import pytest
import redis.asyncio as aioredis

from gateway import promtext
from gateway.app import create_app
from gateway.config import ReplicaSettings, build_settings
from gateway.kvindex.exchange import ReplicaExchange
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import PrefixIndex
from gateway.procs.net import free_port
from gateway.sim.config import SimWorkerConfig
from gateway.workers.worker import Worker
from tests.harness import serve_app
from tests.integration.sim_workers import Workers, ask, up, wait_for, words

if TYPE_CHECKING:
    from tests.integration.redis_fixture import RedisServer

pytest_plugins = ["tests.integration.redis_fixture"]

CONFIG = SimWorkerConfig(model_name="sim", time_scale=0.0, enable_prompt_tokens_details=True)
W1, W2 = "http://w1:8000", "http://w2:8000"


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    w = Workers(configs=[CONFIG] * 4)
    try:
        yield w
    finally:
        w.close()


def gateway_settings(workers: Workers, redis_url: str, prefix: str, *, exchange: bool = True
                     ) -> Any:
    return build_settings({
        "models": [{"name": "sim", "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "policy": "kv_aware",
                   "workers": [{"url": u} for u in workers.urls]}],
        "health": {"interval_s": 0.1, "timeout_s": 30.0, "scrape_interval_s": 0.1},
        "replicas": {"exchange": exchange, "redis_url": redis_url, "key_prefix": prefix,
                     "interval_s": 0.01, "snapshot_interval_s": 0.2},
    })


def exchange_of(app: Any) -> ReplicaExchange:
    ex = app.api.state.services.exchange
    assert isinstance(ex, ReplicaExchange)
    return ex


def learned(app: Any) -> dict[str, int]:
    return {w: s.learned for w, s in app.api.state.services.prefix_index.stats().items()}


def test_a_prefix_routed_by_one_replica_goes_to_the_same_worker_from_another(
    workers: Workers, redis_server: str,
) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    prompts = [words(seed) for seed in range(100, 116)]
    a_app = create_app(gateway_settings(workers, redis_server, prefix))
    b_app = create_app(gateway_settings(workers, redis_server, prefix))
    with serve_app(a_app, ready_path="/ready") as a, serve_app(b_app, ready_path="/ready") as b:
        wait_for(lambda: all(up(gw, w) for gw in (a, b) for w in workers.urls),
                 "every worker up")
        wait_for(lambda: exchange_of(b_app).subscribed.is_set(), "b subscribed")
        holders = {p: ask(a, p)[0] for p in prompts}
        wait_for(lambda: learned(b_app) == learned(a_app), "a's routes learned by b", 60.0)
        # Another question after the same prefix: a new prompt for b, an old prefix for a.
        again = {p: ask(b, p + " and then some more words")
                 for p in prompts}
        text = httpx.get(b + "/metrics").text
    assert len(set(holders.values())) >= 2  # spread: without a's routes b could not guess
    for p, (worker, cached) in again.items():
        assert worker == holders[p], "b sent a prefix a placed to another worker"
        assert cached >= 384, cached  # the simulator says the prefix was cached there
    assert (promtext.value(text, "kvgate_replica_exchange_messages_total", direction="received")
            or 0) >= 1


def test_a_fresh_replica_routes_known_prefixes_to_their_holders_from_a_peers_snapshot(
    workers: Workers, redis_server: str,
) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    prompts = [words(seed) for seed in range(200, 216)]
    first = create_app(gateway_settings(workers, redis_server, prefix))
    with serve_app(first, ready_path="/ready") as gw:
        wait_for(lambda: all(up(gw, w) for w in workers.urls), "every worker up")
        holders = {p: ask(gw, p)[0] for p in prompts}
        written = exchange_of(first).counts.get("snapshot_written", 0)
        wait_for(lambda: exchange_of(first).counts.get("snapshot_written", 0) > written,
                 "a snapshot written after the requests", 5.0)
    assert len(set(holders.values())) >= 2

    started = time.monotonic()
    second = create_app(gateway_settings(workers, redis_server, prefix))
    with serve_app(second, ready_path="/ready") as gw:
        wait_for(lambda: all(up(gw, w) for w in workers.urls), "every worker up")
        ready_s = time.monotonic() - started
        again = {p: ask(gw, p) for p in prompts}
        loaded = exchange_of(second).counts.get("snapshot_loaded", 0)
    print(f"warm {ready_s:.2f} s after the replica's start")
    assert loaded == 1
    for p, (worker, cached) in again.items():
        assert worker == holders[p], "a prompt went to a worker that does not hold it"
        assert cached >= 384, cached


def test_a_gateway_whose_exchange_redis_is_down_starts_and_serves(workers: Workers) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    app = create_app(gateway_settings(workers, dead, "test:down"))
    with serve_app(app, ready_path="/ready") as gw:
        wait_for(lambda: all(up(gw, w) for w in workers.urls), "every worker up")
        served = [ask(gw, words(seed))[0] for seed in range(300, 304)]
        wait_for(lambda: exchange_of(app).counts.get("failed", 0) >= 1, "a failed publish")
        text = httpx.get(gw + "/metrics").text
    assert len(served) == 4
    assert (promtext.value(text, "kvgate_replica_snapshots_total", outcome="failed") or 0) >= 1
    assert (promtext.value(text, "kvgate_replica_exchange_messages_total", direction="failed")
            or 0) >= 1


# --- exchanges on bare indexes: what a replica knows before any KV event ---------------------


def replica(redis_url: str, prefix: str, *, events: bool = True, **kw: Any) -> ReplicaExchange:
    index = PrefixIndex(BlockIndex())
    for w in (W1, W2):
        index.set_worker(w, 16, None, None)
        index.index.set_events(w, events)  # events mode, with no event published yet
    settings = ReplicaSettings(exchange=True, key_prefix=prefix, interval_s=0.01, **kw)
    return ReplicaExchange(settings, redis_url, index)


async def until(condition: Any, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_a_peers_route_is_a_speculative_entry_here_before_any_kv_event(
    redis_server: str,
) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    a, b = replica(redis_server, prefix), replica(redis_server, prefix)
    await a.start()
    await b.start()
    try:
        await until(b.subscribed.is_set, "b subscribed")
        tokens = list(range(1000, 1000 + 16 * 64))
        assert a.index is not None and b.index is not None
        a.index.record_routed(W2, tuple(tokens), 16)  # what the router does after choosing W2
        hashes = block_hashes(tokens, 16)
        await until(lambda: b.index is not None
                    and b.index.index.match_prefix(hashes, [W2])[W2] == 64, "b holds the route")
        # pending: the kv_aware cost treats it as a prefill under way there, as a's own does
        assert b.index.index.match_prefix_pending(hashes, [W1, W2]) == {W1: (0, 0), W2: (64, 64)}
        assert b.index.index.stats()[W2].speculative == 64
    finally:
        await a.close()
        await b.close()


async def test_peer_load_is_visible_and_dropped_when_the_peer_goes_quiet(
    redis_server: str,
) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    a = replica(redis_server, prefix)
    b = replica(redis_server, prefix, peer_timeout_s=0.5)
    wa, wb = Worker(url=W1, pool="p"), Worker(url=W1, pool="p")
    a.attach(wa)
    b.attach(wb)
    await b.start()
    await until(b.subscribed.is_set, "b subscribed")
    await a.start()
    try:
        wa.inflight, wa.inflight_prompt_tokens = 5, 12_000
        await until(lambda: wb.gateway_inflight == 5, "a's requests counted on b")
        assert wb.gateway_inflight_prompt_tokens == 12_000
        assert wb.inflight == 0
        await a.close()  # a goes quiet
        await until(lambda: wb.gateway_inflight == 0, "a's load dropped")
        assert b.peers == 0
    finally:
        await a.close()
        await b.close()


async def test_hostile_messages_on_the_channel_are_ignored_and_counted(redis_server: str) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    a, b = replica(redis_server, prefix), replica(redis_server, prefix)
    await b.start()
    raw = aioredis.Redis.from_url(redis_server)
    try:
        await until(b.subscribed.is_set, "b subscribed")
        for data in (b"", b"KX", b"KX\x01\x01" + b"\xff" * 40, b"\x00" * 5000,
                     b"x" * (2 << 20), b"text, not bytes"):
            await raw.publish(b.channel, data)
        await until(lambda: b.counts.get("malformed", 0) >= 6, "the garbage counted")
        await a.start()  # and an honest peer still gets through
        assert a.index is not None and b.index is not None
        a.index.record_routed(W1, tuple(range(64)), 16)
        await until(lambda: b.index is not None
                    and b.index.index.match_prefix(block_hashes(list(range(64)), 16), [W1])[W1]
                    == 4, "the honest route applied")
    finally:
        await raw.aclose()
        await a.close()
        await b.close()


async def test_the_exchange_survives_a_redis_outage_and_resumes_after_it(
    redis_control: RedisServer,
) -> None:
    prefix = f"test:{uuid.uuid4().hex}"
    a, b = replica(redis_control.url, prefix), replica(redis_control.url, prefix)
    await a.start()
    await b.start()
    try:
        await until(b.subscribed.is_set, "b subscribed")
        assert a.index is not None and b.index is not None
        redis_control.kill()
        a.index.record_routed(W1, tuple(range(320)), 16)  # never blocks, never raises
        await until(lambda: a.counts.get("failed", 0) >= 1, "a failed publish")
        redis_control.start()
        await until(b.subscribed.is_set, "b subscribed again")
        tokens = list(range(5000, 5000 + 16 * 8))
        hashes = block_hashes(tokens, 16)

        async def route_until_b_holds() -> None:
            while b.index is not None and b.index.index.match_prefix(hashes, [W2])[W2] != 8:
                a.index.record_routed(W2, tuple(tokens), 16)  # type: ignore[union-attr]
                await asyncio.sleep(0.1)

        await asyncio.wait_for(route_until_b_holds(), 60.0)
    finally:
        await a.close()
        await b.close()


async def test_on_a_redis_cluster_routes_reach_a_peer_and_the_snapshot_round_trips(
    redis_cluster: str,
) -> None:
    """Pub/sub goes through the node the URL names (the cluster forwards PUBLISH to every
    node); the snapshot key through the cluster client, to its slot's primary."""
    prefix = f"test:{uuid.uuid4().hex}"
    a = replica(redis_cluster, prefix, events=False)
    b = replica(redis_cluster, prefix, events=False)
    await a.start()
    await b.start()
    try:
        await until(b.subscribed.is_set, "b subscribed")
        assert a.index is not None and b.index is not None
        tokens = list(range(7000, 7000 + 16 * 8))
        hashes = block_hashes(tokens, 16)
        a.index.record_routed(W1, tuple(tokens), 16)
        await until(lambda: b.index is not None
                    and b.index.index.match_prefix(hashes, [W1])[W1] == 8, "b holds the route")
        assert await a.write_snapshot(force=True)
        fresh = replica(redis_cluster, prefix, events=False)
        await fresh.start()
        try:
            assert fresh.counts.get("snapshot_loaded") == 1
            assert fresh.index is not None
            assert fresh.index.index.match_prefix(hashes, [W1]) == {W1: 8}
        finally:
            await fresh.close()
    finally:
        await a.close()
        await b.close()


async def test_a_closing_exchange_ends_its_loops_when_redis_py_loses_the_cancellation(
    redis_server: str,
) -> None:
    """redis-py 8.1 can return from a command as if nothing happened when the task running it
    is cancelled (``gateway.tasks``): a close that cancelled its loops once then waited for them
    hung (the leaked gateway threads that made a test of this module take 33 s instead of 3).
    With a snapshot written every millisecond, most closes land inside a Redis command."""
    rng = random.Random(7)
    for trial in range(30):
        ex = replica(redis_server, f"test:{uuid.uuid4().hex}", snapshot_interval_s=0.001)
        await ex.start()
        await asyncio.sleep(rng.uniform(0.0, 0.01))
        started = time.monotonic()
        async with asyncio.timeout(5.0):
            await ex.close()
        assert time.monotonic() - started < 1.0, f"trial {trial}: close took too long"

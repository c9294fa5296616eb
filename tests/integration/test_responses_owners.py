"""The response-owner map (``gateway.budgets.owners``): bounded in memory, shared in Redis, and
keyed by tenant in both, so one tenant's id is never another's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from gateway.budgets import owners as owners_module
from gateway.budgets.owners import FileOwners, MemoryOwners, OwnersUnavailable, ResponseOwner
from gateway.budgets.redis_owners import RedisOwners
from gateway.procs.net import free_port

pytest_plugins = ["tests.integration.redis_fixture"]

ACME = ResponseOwner("acme", "http://w0", 120)


def test_memory_owners_are_per_tenant_and_forget_the_least_recently_used() -> None:
    async def run() -> None:
        owners = MemoryOwners(max_entries=2)
        await owners.put("r1", ACME)
        await owners.put("r2", ResponseOwner("acme", "http://w1", 5))
        assert await owners.get("mallory", "r1") is None
        assert await owners.get("acme", "r1") == ACME  # r1 used: r2 is now the oldest
        await owners.put("r3", ResponseOwner("acme", "http://w1", 7))
        assert len(owners) == 2
        assert await owners.get("acme", "r2") is None
        assert await owners.get("acme", "r1") == ACME

    asyncio.run(run())


def test_file_owners_are_shared_by_the_processes_of_a_gateway_and_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(owners_module, "PRUNE_EVERY", 4)

    async def run() -> None:
        a, b = (FileOwners(tmp_path / "owners.sqlite3", max_entries=3) for _ in range(2))
        for owners in (a, b):
            await owners.start()
        try:
            await a.put("r0", ACME)
            assert await b.get("acme", "r0") == ACME  # another process sees it
            assert await b.get("mallory", "r0") is None
            for i in range(1, 4):
                await a.put(f"r{i}", ResponseOwner("acme", "http://w1", i))
            assert await b.get("acme", "r0") is None  # the oldest written, pruned
            assert await b.get("acme", "r3") == ResponseOwner("acme", "http://w1", 3)
        finally:
            for owners in (a, b):
                await owners.close()

    asyncio.run(run())


def test_a_process_starting_while_a_sibling_holds_the_new_file_waits_for_it(
    tmp_path: Path,
) -> None:
    """The processes of a gateway set the shared file up together; one that finds it locked
    for longer than SQLite's busy wait (a sibling switching it to WAL) tries again instead of
    failing its start (a CI run's gateway exited with "database is locked")."""
    import sqlite3
    import threading
    import time

    path = tmp_path / "owners.sqlite3"
    holder = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN EXCLUSIVE")
    held_s = owners_module.BUSY_TIMEOUT_MS / 1000 + 0.5  # past the busy wait
    release = threading.Timer(held_s, lambda: holder.execute("COMMIT"))
    release.start()

    async def run() -> float:
        owners = FileOwners(path, max_entries=3)
        t0 = time.monotonic()
        await owners.start()
        took = time.monotonic() - t0
        await owners.put("r1", ResponseOwner("t", "http://w", 5))
        assert await owners.get("t", "r1") == ResponseOwner("t", "http://w", 5)
        await owners.close()
        return took
    try:
        assert asyncio.run(run()) >= held_s - 0.2
    finally:
        release.join()
        holder.close()


def test_redis_owners_are_shared_under_the_tenants_hash_tag_with_a_ttl(redis_server: str) -> None:
    async def run() -> None:
        a, b = (RedisOwners(redis_server, ttl_s=60, key_prefix="kvgate:owners-test",
                            timeout_s=0.5, max_connections=4, pool_timeout_s=0.5)
                for _ in range(2))
        for owners in (a, b):
            await owners.start()
        try:
            await a.put("resp_1", ACME)
            assert await b.get("acme", "resp_1") == ACME  # another gateway sees it
            assert await b.get("mallory", "resp_1") is None
        finally:
            for owners in (a, b):
                await owners.close()

    asyncio.run(run())
    key = "kvgate:owners-test:{acme}:resp:resp_1"
    client = redis.Redis.from_url(redis_server)
    assert client.get(key) == b"http://w0 120"
    assert 0 < client.ttl(key) <= 60


def test_redis_owners_unreachable_is_an_owners_unavailable_error() -> None:
    async def run() -> None:
        owners = RedisOwners(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60,
                             key_prefix="kvgate:x", timeout_s=0.2, max_connections=2,
                             pool_timeout_s=0.2)
        await owners.start()
        try:
            with pytest.raises(OwnersUnavailable):
                await owners.get("acme", "resp_1")
            with pytest.raises(OwnersUnavailable):
                await owners.put("resp_1", ACME)
        finally:
            await owners.close()

    asyncio.run(run())

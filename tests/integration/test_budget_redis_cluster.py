"""The Redis budget store on a real Redis Cluster of three primaries (issue 12, item 6).

The whole store contract runs on the cluster too (``test_budget_contract.py``, ``redis-cluster``);
these tests check what only a cluster has: one slot per tenant with the tenants spread over the
nodes, the connection limit, and an unreachable cluster being an outage like an unreachable Redis.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.cluster import RedisCluster as SyncCluster
from redis.crc import key_slot

from gateway.budgets import BudgetService
from gateway.budgets.errors import StoreUnavailableError
from gateway.budgets.redis_store import RedisBudgetStore
from gateway.config import BudgetSettings
from gateway.procs.net import free_port

pytest_plugins = ["tests.integration.redis_fixture"]
pytestmark = pytest.mark.asyncio(loop_scope="session")

TENANTS = tuple(f"tenant-{i}" for i in range(8))


def nodes_url(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("redis+cluster://").rsplit(":", 1)
    return host, int(port)


async def test_each_tenants_keys_share_one_slot_and_the_tenants_spread_over_the_nodes(
    redis_cluster: str,
) -> None:
    prefix = f"test:{uuid.uuid4().hex[:12]}"
    settings = BudgetSettings.model_validate({
        "store": "redis", "redis_url": redis_cluster, "redis_key_prefix": prefix,
        "redis_timeout_s": 5.0, "defaults": {"inflight_kv_bytes": 1 << 30}})
    service = BudgetService(settings, tenants=TENANTS)
    await service.start()
    try:
        for tenant in TENANTS:
            for session in ("s1", "s2", None):
                await service.admit(tenant, session, 1 << 20, 10)
        assert not service.degraded
    finally:
        await service.close()

    host, port = nodes_url(redis_cluster)
    cluster = SyncCluster(host=host, port=port, decode_responses=True)
    try:
        keys = list(cluster.scan_iter(match=f"{prefix}:*", target_nodes=SyncCluster.PRIMARIES))
        slots: dict[str, set[int]] = {}
        for key in keys:
            tenant = key[key.index("{") + 1:key.index("}")]
            slots.setdefault(tenant, set()).add(key_slot(key.encode()))
        nodes = {cluster.nodes_manager.get_node_from_slot(slot).name
                 for tenant_slots in slots.values() for slot in tenant_slots}
    finally:
        cluster.close()
    assert set(slots) == set(TENANTS)
    assert all(len(s) == 1 for s in slots.values())  # every script's keys in one slot
    assert len(nodes) > 1  # and the tenants on several primaries


async def test_a_burst_beyond_max_connections_waits_for_one_instead_of_failing(
    redis_cluster: str,
) -> None:
    """redis-py's cluster client refuses a command past ``max_connections`` per node at once
    (``MaxConnectionsError``): a burst of admissions would have counted as a Redis outage."""
    store = RedisBudgetStore(redis_cluster, key_prefix=f"test:{uuid.uuid4().hex[:12]}",
                             timeout_s=5.0, max_connections=2, pool_timeout_s=10.0)
    await store.start()
    try:
        reads = await asyncio.gather(
            *(store.usage(TENANTS[0], f"s{i}", time.time()) for i in range(40)))
    finally:
        await store.close()
    assert reads == [None] * 40


async def test_an_unreachable_cluster_is_an_outage() -> None:
    store = RedisBudgetStore(f"redis+cluster://127.0.0.1:{free_port()}", timeout_s=0.5)
    await store.start()
    try:
        with pytest.raises(StoreUnavailableError):
            await store.ping()
        with pytest.raises(StoreUnavailableError):
            await store.usage(TENANTS[0], "s1", time.time())
    finally:
        await store.close()

"""``RedisOwners``: the response-owner map in Redis, shared by every gateway of the budget store.

The map and its rules are ``gateway.budgets.owners``'. Here: one string key per stored response,
``<prefix>:{tenant}:resp:<id>`` -> ``"<worker url> <context tokens>"``, under the tenant's hash
tag like the budget keys (one Cluster slot per tenant), expiring ``ttl_s`` after it was written.
It runs on the budget store's connection handling (blocking pool, timeouts, Cluster URLs, the
outage errors), which it inherits; it is imported only when ``budgets.store`` is ``redis``.
"""

from __future__ import annotations

from gateway.budgets.errors import StoreUnavailableError
from gateway.budgets.owners import OwnersUnavailable, ResponseOwner
from gateway.budgets.redis_store import RedisBudgetStore


class RedisOwners(RedisBudgetStore):
    """The map in Redis, shared by every gateway of the budget store (its key prefix and hash
    tags); ``get`` and ``put`` raise ``OwnersUnavailable`` when Redis cannot be reached."""

    def __init__(self, url: str, *, ttl_s: int, key_prefix: str, timeout_s: float,
                 max_connections: int, pool_timeout_s: float) -> None:
        super().__init__(url, key_prefix=key_prefix, timeout_s=timeout_s,
                         max_connections=max_connections, pool_timeout_s=pool_timeout_s,
                         name="redis-owners")
        self._ttl_s = ttl_s

    def _key(self, tenant: str, response_id: str) -> str:
        return f"{self._tag(tenant)}:resp:{response_id}"

    async def get(self, tenant: str, response_id: str) -> ResponseOwner | None:
        try:
            value = await self._command("get", self._key(tenant, response_id))
        except StoreUnavailableError as exc:
            raise OwnersUnavailable(str(exc)) from None
        if not isinstance(value, str):
            return None
        worker, _, tokens = value.rpartition(" ")
        return ResponseOwner(tenant, worker, int(tokens)) if tokens.isdigit() else None

    async def put(self, response_id: str, owner: ResponseOwner) -> None:
        value = f"{owner.worker} {owner.context_tokens}"
        try:
            await self._command("set", self._key(owner.tenant, response_id), value,
                                ex=self._ttl_s)
        except StoreUnavailableError as exc:
            raise OwnersUnavailable(str(exc)) from None

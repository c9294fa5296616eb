"""Which worker holds a stored Responses conversation: a bounded map response id -> owner.

vLLM keeps a stored response (``/v1/responses`` with ``store``) in the memory of the server that
produced it; a request naming it in ``previous_response_id``, and ``GET`` / ``cancel`` of it,
work on that server only (any other answers 404). The gateway learns the id from the answer
(``gateway.upstream.relay``) and records here who owns it: the tenant whose request made it,
the worker, and how many tokens the conversation holds there (the prompt vLLM prefilled plus
what it generated: what the next turn will prefill again on top of its own input).

Keys are (tenant, response id): a tenant asking for another tenant's id finds nothing, exactly
as for an id that never existed, so it can neither route to nor read another tenant's
conversation (404, as vLLM answers an unknown id).

Two backends, chosen with the budget store (``budgets.store``), since they must be shared by the
same gateways:

* ``MemoryOwners``: an LRU of at most ``max_entries`` per tenant in this process (O(1) per
  operation); older conversations are forgotten first (their next turn answers 404, as after a
  vLLM restart). A gateway of one process.
* ``FileOwners``: the processes of one gateway (``--processes N``, the memory store) share one
  SQLite file in their runtime directory (WAL: readers never wait; a write holds the file for
  tens of microseconds). A continuation may arrive on any process, so the map must be theirs
  together, as the budget store is. At most ``max_entries`` rows per tenant, its oldest written
  deleted first (every ``PRUNE_EVERY`` of its writes in a process). One indexed SELECT or INSERT
  per operation, run on the event loop: ~20-50 us, against a thread hop that would cost more.

The bound is per tenant because one bound for all let a tenant evict every other tenant's
conversations: ``max_entries`` cheap stored responses (one output token each) of one key made
every other key's next turn a 404 (``tests/security/test_surface.py``). Memory is then at most
``max_entries`` x the configured keys.
* ``RedisOwners`` (``gateway.budgets.redis_owners``): one string key per response, ``<prefix>:{tenant}:resp:<id>``, under the
  tenant's hash tag like the budget keys (one Cluster slot per tenant), with a TTL of
  ``ttl_s`` (Redis bounds its memory by expiry rather than by count). One GET or SET per
  operation, on the budget store's connection handling (pool, timeouts, Cluster, outage errors).

The trade-off against encoding the owner into the id (the gateway choosing ``request_id``): that
would need no map, but the id would then have to be signed (a tenant must not forge one naming
another's worker) and could not carry the conversation's size; a map keeps vLLM's ids as they are.
"""

from __future__ import annotations

import asyncio
import random
import sqlite3
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

PRUNE_EVERY = 1024
BUSY_TIMEOUT_MS = 1000


@dataclass(frozen=True, slots=True)
class ResponseOwner:
    tenant: str
    worker: str  # the worker's base URL (``Worker.url``)
    context_tokens: int  # tokens of the stored conversation: prompt + output, as vLLM reported


class OwnersUnavailable(Exception):
    """The shared map cannot be read (Redis unreachable): a continuation cannot be routed."""


class ResponseOwners(Protocol):
    """The response-owner map (see the module docstring)."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def get(self, tenant: str, response_id: str) -> ResponseOwner | None:
        """The owner of ``tenant``'s response ``response_id``; None when unknown to it."""
        ...

    async def put(self, response_id: str, owner: ResponseOwner) -> None: ...


class MemoryOwners:
    def __init__(self, max_entries: int) -> None:
        self._max_entries = max_entries  # per tenant
        self._owners: dict[str, OrderedDict[str, ResponseOwner]] = {}

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def get(self, tenant: str, response_id: str) -> ResponseOwner | None:
        owners = self._owners.get(tenant)
        if owners is None:
            return None
        owner = owners.get(response_id)
        if owner is not None:
            owners.move_to_end(response_id)  # a conversation in use stays
        return owner

    async def put(self, response_id: str, owner: ResponseOwner) -> None:
        owners = self._owners.setdefault(owner.tenant, OrderedDict())
        owners[response_id] = owner
        owners.move_to_end(response_id)
        while len(owners) > self._max_entries:
            owners.popitem(last=False)

    def __len__(self) -> int:
        return sum(len(owners) for owners in self._owners.values())


SETUP_RETRY_S = 10.0
"""How long a process keeps trying to set the shared file up while its siblings do the same."""


def _set_up(db: sqlite3.Connection) -> None:
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=OFF")  # a map for routing, not a record: no fsync
    db.execute("CREATE TABLE IF NOT EXISTS owners (tenant TEXT, id TEXT, worker TEXT,"
               " tokens INTEGER, PRIMARY KEY (tenant, id))")
    # (tenant, rowid): a tenant's rows newest first, for its prune
    db.execute("CREATE INDEX IF NOT EXISTS owners_by_tenant ON owners (tenant)")


class FileOwners:
    def __init__(self, path: Path, max_entries: int) -> None:
        self._path = path
        self._max_entries = max_entries
        self._db: sqlite3.Connection | None = None
        self._writes: dict[str, int] = {}  # per tenant, in this process

    async def start(self) -> None:
        db = sqlite3.connect(self._path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        # The processes of one gateway start together on a new file: switching it to WAL needs
        # the file to itself, and SQLite answers "database is locked" at once (no busy wait)
        # to all but one of them; a CI run's gateway died of it at start. So: again, shortly.
        deadline = time.monotonic() + SETUP_RETRY_S
        while True:
            try:
                _set_up(db)
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) and "busy" not in str(exc):
                    raise
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.02 + random.random() * 0.05)
        self._db = db

    async def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _require(self) -> sqlite3.Connection:
        if self._db is None:
            raise OwnersUnavailable("the response-owner file is not open")
        return self._db

    async def get(self, tenant: str, response_id: str) -> ResponseOwner | None:
        try:
            row = self._require().execute(
                "SELECT worker, tokens FROM owners WHERE tenant = ? AND id = ?",
                (tenant, response_id)).fetchone()
        except sqlite3.Error as exc:
            raise OwnersUnavailable(f"response-owner file: {exc}") from None
        return None if row is None else ResponseOwner(tenant, row[0], row[1])

    async def put(self, response_id: str, owner: ResponseOwner) -> None:
        db = self._require()
        try:
            db.execute("INSERT OR REPLACE INTO owners VALUES (?, ?, ?, ?)",
                       (owner.tenant, response_id, owner.worker, owner.context_tokens))
            writes = self._writes[owner.tenant] = self._writes.get(owner.tenant, 0) + 1
            if writes % PRUNE_EVERY == 0:  # a replaced row got a new rowid: newest last
                db.execute("DELETE FROM owners WHERE tenant = ? AND rowid <= (SELECT rowid FROM"
                           " owners WHERE tenant = ? ORDER BY rowid DESC LIMIT 1 OFFSET ?)",
                           (owner.tenant, owner.tenant, self._max_entries))
        except sqlite3.Error as exc:
            raise OwnersUnavailable(f"response-owner file: {exc}") from None

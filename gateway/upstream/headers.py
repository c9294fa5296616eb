"""The headers a request to a pool's workers carries, built once per pool.

The pool's credential (``PoolSettings.upstream_headers``) is a pydantic private attribute: a
read goes through ``BaseModel.__getattr__``, ~2.6 µs, and building ``{content-type, credential}``
again costs more. Every call site that talks to a pool's workers per request (placement, the
prefill step of a disaggregated pool, background watchers, a stored response's retrieval) takes
them from here. Keyed by the settings object (its id, the object kept so the id cannot be
reused); a process that builds settings anew more than ``MAX_CACHED_POOLS`` times starts over.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.config import PoolSettings

JSON_HEADERS: Mapping[str, str] = {"content-type": "application/json"}
MAX_CACHED_POOLS = 64

_POOLS: dict[int, tuple[PoolSettings, Mapping[str, str], Mapping[str, str]]] = {}


def _entry(pool: PoolSettings) -> tuple[PoolSettings, Mapping[str, str], Mapping[str, str]]:
    found = _POOLS.get(id(pool))
    if found is None or found[0] is not pool:
        if len(_POOLS) >= MAX_CACHED_POOLS:
            _POOLS.clear()
        auth = dict(pool.upstream_headers)
        found = _POOLS[id(pool)] = (pool, {**JSON_HEADERS, **auth} if auth else JSON_HEADERS,
                                    auth)
    return found


def json_headers(pool: PoolSettings) -> Mapping[str, str]:
    """A JSON request's headers to ``pool``'s workers: content type and the pool's credential."""
    return _entry(pool)[1]


def credential(pool: PoolSettings) -> Mapping[str, str]:
    """The pool's credential alone (empty without ``upstream_api_key``): a GET's headers."""
    return _entry(pool)[2]

"""What the router asks of a prefix index (``gateway.kvindex.service.PrefixIndex``): protocols,
apart from the router and the routing values (``gateway.routing.types``), because those are
compiled (``gateway.native``) and a runtime-checkable protocol cannot be.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable


class PrefixIndexLike(Protocol):
    """The part of ``gateway.kvindex.service.PrefixIndex`` the router uses."""

    def cached_and_pending(
        self, token_ids: Sequence[int], workers: Sequence[tuple[str, int]],
        adapter: str | None = None, salt: str | None = None,
    ) -> dict[str, tuple[int, int]]: ...

    def record_routed(
        self, worker_id: str, token_ids: Sequence[int], block_size_tokens: int,
        adapter: str | None = None, salt: str | None = None,
    ) -> None: ...


@runtime_checkable
class TieredPrefixIndexLike(Protocol):
    """An index that also knows lower KV tiers (``PrefixIndex.cached_pending_lower``): per
    worker, (GPU tokens, pending among them, tokens past them held only in a lower tier). Not
    a subclass of ``PrefixIndexLike``: the router asks it for this method only."""

    def cached_pending_lower(
        self, token_ids: Sequence[int], workers: Sequence[tuple[str, int]],
        adapter: str | None = None, salt: str | None = None,
    ) -> dict[str, tuple[int, int, int]]: ...


@runtime_checkable
class EvictionProbingIndex(Protocol):
    """An index that can tell hit accounting which predicted blocks its worker's events removed
    after routing (``PrefixIndex.eviction_probe``); like ``TieredPrefixIndexLike``, on its own."""

    def eviction_probe(
        self, worker_id: str, token_ids: Sequence[int], block_size_tokens: int,
        adapter: str | None = None, salt: str | None = None,
    ) -> Callable[[int, int], int] | None: ...

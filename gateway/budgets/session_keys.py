"""Which API key each session last used, for per-key limits where only the session id is known."""

from __future__ import annotations

from collections import OrderedDict


class SessionKeys:
    """Which API key each session last used: a bounded LRU, for per-key limits in the budget-ratio
    gauge and the admin API. Sessions this replica never saw fall back to the default limits."""

    def __init__(self, capacity: int = 65_536) -> None:
        self._capacity = capacity
        self._keys: OrderedDict[str, str | None] = OrderedDict()

    def note(self, session_id: str | None, key_name: str | None) -> None:
        if session_id is None:
            return
        self._keys[session_id] = key_name
        self._keys.move_to_end(session_id)
        if len(self._keys) > self._capacity:
            self._keys.popitem(last=False)

    def get(self, session_id: str) -> str | None:
        return self._keys.get(session_id)

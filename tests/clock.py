"""``ManualClock``: the one clock tests set by hand.

It is called like ``time.time`` or ``time.monotonic`` (the ``clock`` argument of the budget
store, the block index ...) and returns ``now``, which moves only when a test sets it or calls
``advance``: leases, refills and TTLs are then tested without sleeping. The default start is a
plausible Unix time, for code that compares or formats wall-clock times.
"""

from __future__ import annotations

T0 = 1_700_000_000.0


class ManualClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

"""Per-session KV budgets, rate limits and throttles (no HTTP; the gateway wires it in).

* ``service.BudgetService``: the facade (admit / release / renew / throttle / reads);
* ``errors``: typed errors carrying ``code``, ``retry_after_s``, ``reason`` (``gateway.errors``
  maps them to HTTP);
* ``models``: the values (``BudgetLimits``, ``Reservation``, ``Throttle``, ``SessionUsage`` ...)
  and ``limits_for``, the limits the ``budgets:`` section (``gateway.config.BudgetSettings``)
  gives an API key;
* ``store``: the ``BudgetStore`` protocol and the accounting algorithm; ``memory`` and
  ``redis_store`` (+ ``lua``) implement it;
* ``session_id.sanitize_session_id``: the one rule for session ids in keys and metric labels.
"""

from gateway.budgets.errors import (
    REJECTION_REASONS,
    BudgetError,
    BudgetUnavailableError,
    KVBudgetExceededError,
    KVByteSecondsExceededError,
    KVRequestTooLargeError,
    RateLimitExceededError,
    SessionThrottledError,
)
from gateway.budgets.memory import MemoryBudgetStore
from gateway.budgets.models import (
    BudgetLimits,
    Reservation,
    SessionUsage,
    Throttle,
    ThrottleState,
    kv_footprint_bytes,
    limits_for,
)
from gateway.budgets.service import BudgetService, BudgetStats
from gateway.budgets.session_id import SESSION_ID_MAX_LEN, sanitize_session_id
from gateway.budgets.store import BudgetStore

__all__ = [
    "REJECTION_REASONS",
    "SESSION_ID_MAX_LEN",
    "BudgetError",
    "BudgetLimits",
    "BudgetService",
    "BudgetStats",
    "BudgetStore",
    "BudgetUnavailableError",
    "KVBudgetExceededError",
    "KVByteSecondsExceededError",
    "KVRequestTooLargeError",
    "MemoryBudgetStore",
    "RateLimitExceededError",
    "Reservation",
    "SessionThrottledError",
    "SessionUsage",
    "Throttle",
    "ThrottleState",
    "kv_footprint_bytes",
    "limits_for",
    "sanitize_session_id",
]

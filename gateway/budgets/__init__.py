"""KV budgets, rate limits and throttles per tenant and per session (no HTTP; the gateway wires
it in). Identity is (tenant, session): ``session_id`` names both and the one rule for ids.

* ``service.BudgetService``: the facade (admit / release / renew / shrink / throttle / reads);
* ``errors``: typed errors carrying ``code``, ``retry_after_s``, ``reason`` (``gateway.errors``
  maps them to HTTP);
* ``models``: the values (``BudgetLimits``, ``Limits``, ``Reservation``, ``Throttle``,
  ``SessionUsage`` ...) and ``limits_for``, the session and tenant limits the ``budgets:``
  section (``gateway.config.BudgetSettings``) gives a tenant (an API key);
* ``store``: the ``BudgetStore`` protocol and the accounting algorithm; ``memory``, ``shared``
  and ``redis_store`` (+ ``lua``) implement it;
* ``session_id``: ``ANONYMOUS_TENANT``, ``DEFAULT_SESSION`` and ``sanitize_session_id``, the one
  rule for session ids in keys and metric labels.
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
    Limits,
    Reservation,
    SessionUsage,
    Throttle,
    ThrottleState,
    kv_footprint_bytes,
    limits_for,
)
from gateway.budgets.service import BudgetService, BudgetStats
from gateway.budgets.session_id import (
    ANONYMOUS_TENANT,
    DEFAULT_SESSION,
    SESSION_ID_MAX_LEN,
    sanitize_session_id,
)
from gateway.budgets.store import BudgetStore

__all__ = [
    "ANONYMOUS_TENANT",
    "DEFAULT_SESSION",
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
    "Limits",
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

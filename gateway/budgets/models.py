"""Values of the budget engine: limits, reservations, throttles, usage snapshots.

All are frozen dataclasses; a store turns them into its own representation and back. Times are
seconds on the wall clock (``time.time()`` by default, injected for tests) because they are
shared by every gateway that talks to one Redis: a lease written by one gateway expires for all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from gateway.config import BudgetSettings, LimitSettings

Clock = Callable[[], float]
"""Seconds since the epoch; ``time.time`` in production, a manual clock in tests."""

RATE_PERIOD_S = 60.0
"""The period of ``requests_per_minute`` and ``tokens_per_minute``."""


class ThrottleState(StrEnum):
    """What an operator or an alert did to a session or a whole tenant."""

    THROTTLED = "throttled"
    """Served within tighter limits: at most ``max_inflight_requests`` and/or ``budget_factor``."""
    BLOCKED = "blocked"
    """Not served at all until the throttle expires."""


@dataclass(frozen=True)
class BudgetLimits:
    """The limits one session (or one tenant, over all its sessions) is held to; ``None`` means
    unlimited.

    Each field name is also the ``reason`` a rejection by that limit carries (and so the
    ``kvgate_budget_rejections_total{reason}`` label), except that a request that can never fit
    is always ``request_too_large``.
    """

    request_kv_bytes: int | None = None
    inflight_kv_bytes: int | None = None
    inflight_requests: int | None = None
    kv_byte_seconds: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None

    def __post_init__(self) -> None:
        for name in (
            "request_kv_bytes",
            "inflight_kv_bytes",
            "inflight_requests",
            "kv_byte_seconds",
            "requests_per_minute",
            "tokens_per_minute",
        ):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be >= 0 or None, got {value}")

    def never_fits(self, kv_bytes: int, tokens: int) -> str | None:
        """The limit a request of this size can never pass, even in an idle session, or ``None``."""
        if self.request_kv_bytes is not None and kv_bytes > self.request_kv_bytes:
            return "request_kv_bytes"
        if self.inflight_kv_bytes is not None and kv_bytes > self.inflight_kv_bytes:
            return "inflight_kv_bytes"
        if self.inflight_requests == 0:
            return "inflight_requests"
        if self.kv_byte_seconds == 0 and kv_bytes > 0:
            return "kv_byte_seconds"
        if self.requests_per_minute == 0:
            return "requests_per_minute"
        if self.tokens_per_minute is not None and tokens > self.tokens_per_minute:
            return "tokens_per_minute"
        return None


@dataclass(frozen=True)
class Limits:
    """What one tenant's requests are held to: each session's limits and the tenant's (the sum
    over all its sessions)."""

    session: BudgetLimits
    tenant: BudgetLimits

    def never_fits(self, kv_bytes: int, tokens: int) -> tuple[str, str, int | None] | None:
        """``(level, limit, its value)`` of a limit this request can never pass, or ``None``."""
        for level, limits in (("session", self.session), ("tenant", self.tenant)):
            limit = limits.never_fits(kv_bytes, tokens)
            if limit is not None:
                return level, limit, getattr(limits, limit)
        return None


def limits_for(settings: BudgetSettings, tenant: str) -> Limits:
    """The ``budgets.defaults`` (and ``defaults.tenant``), overridden field by field by
    ``budgets.per_key[tenant]`` (and its ``tenant``)."""
    session = settings.defaults
    tenant_level: LimitSettings = session.tenant
    override = settings.per_key.get(tenant)
    if override is not None:
        session = session.model_copy(update={
            name: getattr(override, name) for name in override.model_fields_set
            if name != "tenant"})
        if "tenant" in override.model_fields_set:
            tenant_level = tenant_level.model_copy(update={
                name: getattr(override.tenant, name)
                for name in override.tenant.model_fields_set})
    return Limits(session=_limits(session), tenant=_limits(tenant_level))


# Limits a client can multiply by naming more sessions, unless its tenant is held too; a per-request
# limit (request_kv_bytes) holds whatever the session is called.
ROTATABLE = ("inflight_kv_bytes", "inflight_requests", "kv_byte_seconds", "requests_per_minute",
             "tokens_per_minute")


def rotation_gaps(settings: BudgetSettings) -> list[str]:
    """The session limits a tenant could walk around by rotating session ids: set per session
    (``defaults`` or a ``per_key`` entry) with no limit on the same field for the tenant.
    Each as ``"<tenant or *>.<field>"``; empty when every session limit has a tenant limit."""
    gaps = []
    for tenant in ("*", *sorted(settings.per_key)):
        limits = limits_for(settings, tenant if tenant != "*" else "")
        for name in ROTATABLE:
            if (getattr(limits.session, name) is not None
                    and getattr(limits.tenant, name) is None):
                gaps.append(f"{tenant}.{name}")
    return gaps


def _limits(s: LimitSettings) -> BudgetLimits:
    return BudgetLimits(
        request_kv_bytes=_int(s.request_kv_bytes),
        inflight_kv_bytes=_int(s.inflight_kv_bytes),
        inflight_requests=s.inflight_requests,
        kv_byte_seconds=_int(s.kv_byte_seconds),
        requests_per_minute=s.requests_per_minute,
        tokens_per_minute=s.tokens_per_minute,
    )


def _int(value: int | None) -> int | None:
    return None if value is None else int(value)


def kv_footprint_bytes(prompt_tokens: int, max_output_tokens: int, kv_bytes_per_token: int) -> int:
    """The KV a request may hold at its end: (prompt + max output tokens) x KV bytes per token."""
    if prompt_tokens < 0 or max_output_tokens < 0 or kv_bytes_per_token < 0:
        raise ValueError("token counts and kv_bytes_per_token must be >= 0")
    return (prompt_tokens + max_output_tokens) * kv_bytes_per_token


@dataclass(frozen=True, init=False)
class Reservation:
    """A request's hold on its session's and its tenant's budgets, from ``admit`` until
    ``release``.

    ``store`` names the store that holds it (``memory``, ``redis``, ``shared`` or ``fallback``
    for the local store used while Redis is unreachable under ``fail_open``), so a release goes to
    the store that made it. ``lease_expires_at`` is when a store may reap it unless renewed.
    """

    id: str
    tenant: str
    session_id: str
    kv_bytes: int
    tokens: int
    started_at: float
    lease_expires_at: float
    store: str

    def __init__(
        self, id: str, tenant: str, session_id: str, kv_bytes: int, tokens: int, started_at: float,
        lease_expires_at: float, store: str,
    ) -> None:
        object.__setattr__(self, "id", id)
        object.__setattr__(self, "tenant", tenant)
        object.__setattr__(self, "session_id", session_id)
        object.__setattr__(self, "kv_bytes", kv_bytes)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "started_at", started_at)
        object.__setattr__(self, "lease_expires_at", lease_expires_at)
        object.__setattr__(self, "store", store)


@dataclass(frozen=True)
class Throttle:
    """An operator's or an alert's restriction on one session or a whole tenant, until
    ``expires_at``."""

    state: ThrottleState
    expires_at: float
    reason: str = ""
    max_inflight_requests: int | None = 1
    """While ``throttled``: at most this many requests in flight (``None``: no extra limit)."""
    budget_factor: float = 1.0
    """While ``throttled``: every budget (in-flight KV, byte-seconds, rpm, tpm) times this."""
    set_at: float = 0.0

    def __post_init__(self) -> None:
        if not 0.0 < self.budget_factor <= 1.0:
            raise ValueError(f"budget_factor must be in (0, 1], got {self.budget_factor}")
        if self.max_inflight_requests is not None and self.max_inflight_requests < 0:
            raise ValueError("max_inflight_requests must be >= 0 or None")
        if not math.isfinite(self.expires_at):
            raise ValueError("a throttle needs a finite expiry")


@dataclass(frozen=True)
class SessionUsage:
    """A session's (or, with ``session_id`` ``None``, a whole tenant's) accounting at one instant,
    after expired leases and throttles were reaped.

    Bucket levels are what is left to spend now (byte-seconds net of what the requests in flight
    have accrued so far, so it can be negative: a debt that refills); capacities are the effective
    ones of the last admission (scaled while throttled), ``None`` when unlimited.
    """

    tenant: str
    session_id: str | None
    inflight_kv_bytes: int
    inflight_requests: int
    kv_byte_seconds_available: float | None
    kv_byte_seconds_capacity: float | None
    requests_available: float | None
    requests_capacity: float | None
    tokens_available: float | None
    tokens_capacity: float | None
    hold_ewma_s: float | None
    throttle: Throttle | None


@dataclass(frozen=True, init=False)
class ReserveRequest:
    """Everything a store needs to decide one admission atomically: ``limits`` are the
    session's, ``tenant_limits`` the tenant's (over all its sessions)."""

    tenant: str
    session_id: str
    reservation_id: str
    kv_bytes: int
    tokens: int
    limits: BudgetLimits
    tenant_limits: BudgetLimits
    window_s: float
    lease_ttl_s: float
    now: float

    def __init__(
        self, tenant: str, session_id: str, reservation_id: str, kv_bytes: int, tokens: int,
        limits: BudgetLimits, tenant_limits: BudgetLimits, window_s: float, lease_ttl_s: float,
        now: float,
    ) -> None:
        object.__setattr__(self, "tenant", tenant)
        object.__setattr__(self, "session_id", session_id)
        object.__setattr__(self, "reservation_id", reservation_id)
        object.__setattr__(self, "kv_bytes", kv_bytes)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "limits", limits)
        object.__setattr__(self, "tenant_limits", tenant_limits)
        object.__setattr__(self, "window_s", window_s)
        object.__setattr__(self, "lease_ttl_s", lease_ttl_s)
        object.__setattr__(self, "now", now)

"""``BudgetSettings``: the ``budgets:`` section of the gateway's Settings tree.

Byte fields accept integers or sizes with units (``"16GiB"``, ``"512 MiB"``, ``"2GB"``); ``null``
means unlimited. A ``per_key`` entry overrides only the fields it sets, so
``per_key: {batch: {inflight_kv_bytes: 64GiB}}`` keeps every other default, and an explicit
``null`` there lifts a default limit for that key.

Example::

    budgets:
      store: redis
      redis_url: redis://redis:6379/0
      outage_policy: fail_open
      defaults: {inflight_kv_bytes: 16GiB, kv_byte_seconds: 2TiB, requests_per_minute: 120}
      per_key:
        batch-team: {inflight_kv_bytes: 64GiB, requests_per_minute: null}
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ByteSize, ConfigDict, Field, model_validator

from gateway.budgets.models import BudgetLimits

StoreKind = Literal["memory", "redis"]
OutagePolicy = Literal["fail_open", "fail_closed"]


class LimitSettings(BaseModel):
    """One set of per-session limits; every field ``null`` (unlimited) unless set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_kv_bytes: ByteSize | None = Field(
        default=None,
        description=(
            "Largest KV footprint one request may have: (prompt + max output tokens) x the "
            "model's KV bytes per token. A larger request is refused with 400 "
            "kv_request_too_large. null: unlimited."
        ),
    )
    inflight_kv_bytes: ByteSize | None = Field(
        default=None,
        description=(
            "Most KV bytes a session may hold in flight (sum of the footprints of its requests "
            "being served). Over it: 429 kv_budget_exceeded with Retry-After. A single request "
            "larger than this can never fit: 400. null: unlimited."
        ),
    )
    inflight_requests: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Most requests a session may have in flight. Over it: 429 rate_limit_exceeded. "
            "null: unlimited."
        ),
    )
    kv_byte_seconds: ByteSize | None = Field(
        default=None,
        description=(
            "KV byte-seconds a session may burn per window_s: a token bucket of this capacity, "
            "refilled continuously at kv_byte_seconds / window_s per second and charged "
            "kv_bytes x seconds held when each request ends. Empty: 429 "
            "kv_byte_seconds_exceeded. Accepts units (e.g. 2TiB meaning 2 TiB-seconds). "
            "null: unlimited."
        ),
    )
    requests_per_minute: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Requests a session may start per minute (a token bucket refilled continuously). "
            "Over it: 429 rate_limit_exceeded. null: unlimited."
        ),
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Tokens (prompt + max output tokens, refunded down to the actual count at release) "
            "a session may reserve per minute. Over it: 429 rate_limit_exceeded; a single "
            "request above it: 400. null: unlimited."
        ),
    )

    def to_limits(self) -> BudgetLimits:
        return BudgetLimits(
            request_kv_bytes=_int(self.request_kv_bytes),
            inflight_kv_bytes=_int(self.inflight_kv_bytes),
            inflight_requests=self.inflight_requests,
            kv_byte_seconds=_int(self.kv_byte_seconds),
            requests_per_minute=self.requests_per_minute,
            tokens_per_minute=self.tokens_per_minute,
        )


def _int(value: ByteSize | None) -> int | None:
    return None if value is None else int(value)


class BudgetSettings(BaseModel):
    """Per-session KV budgets, rate limits and throttles, and where their accounting lives."""

    model_config = ConfigDict(extra="forbid")

    defaults: LimitSettings = Field(
        default_factory=LimitSettings,
        description=(
            "Limits for every session. Anonymous requests (no session id) only get the "
            "per-request check (request_kv_bytes, and a request that could never fit)."
        ),
    )
    per_key: dict[str, LimitSettings] = Field(
        default_factory=dict,
        description=(
            "Overrides keyed by API-key name; each overrides only the fields it sets "
            "(an explicit null lifts a limit)."
        ),
    )
    store: StoreKind = Field(
        default="memory",
        description=(
            "Where accounting lives: 'memory' (this process only) or 'redis' (shared by every "
            "gateway; needs redis_url)."
        ),
    )
    redis_url: str | None = Field(
        default=None,
        description="Redis URL (redis://, rediss:// or unix://) when store is 'redis'.",
    )
    redis_key_prefix: str = Field(
        default="kvgate:budget",
        min_length=1,
        description="Prefix of every Redis key the budget store writes.",
    )
    redis_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Connect and read timeout of one Redis call; past it Redis counts as unreachable "
            "and outage_policy applies."
        ),
    )
    redis_max_connections: int = Field(
        default=64,
        ge=1,
        description=(
            "Most connections this gateway opens to Redis; admissions beyond it wait for a free "
            "one (one admission holds a connection for one round trip)."
        ),
    )
    redis_pool_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "How long an admission waits for a free Redis connection before Redis counts as "
            "unavailable."
        ),
    )
    outage_policy: OutagePolicy = Field(
        default="fail_open",
        description=(
            "While Redis is unreachable: 'fail_open' keeps serving, enforcing budgets with a "
            "local in-memory store (per gateway, so a session may get up to N gateways x its "
            "budget); 'fail_closed' refuses admissions with 503 budget_store_unavailable. "
            "Either way the gateway probes Redis with backoff and switches back when it answers."
        ),
    )
    probe_initial_s: float = Field(
        default=0.5,
        gt=0,
        description="First delay between Redis reconnection probes; doubles up to probe_max_s.",
    )
    probe_max_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest delay between Redis reconnection probes.",
    )
    lease_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Lease of one reservation: a gateway renews the leases of its requests in flight "
            "every lease_ttl_s / 3; a reservation whose gateway died is reaped after this long."
        ),
    )
    auto_renew: bool = Field(
        default=True,
        description="Renew the leases of this gateway's reservations in a background task.",
    )
    window_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "Window of kv_byte_seconds: the bucket refills fully in window_s, so a session "
            "sustains kv_byte_seconds / window_s bytes held on average."
        ),
    )
    top_k: int = Field(
        default=20,
        ge=0,
        description=(
            "Sessions listed by GET /admin/sessions by default and exported in the "
            "kvgate_session_kv_bytes{session} gauge (most KV in flight first)."
        ),
    )

    @model_validator(mode="after")
    def _check_store(self) -> Self:
        if self.store == "redis":
            if not self.redis_url:
                raise ValueError("budgets.redis_url is required when budgets.store is 'redis'")
            if not self.redis_url.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError("budgets.redis_url must start with redis://, rediss:// or unix://")
        if self.probe_max_s < self.probe_initial_s:
            raise ValueError("budgets.probe_max_s must be >= probe_initial_s")
        return self

    def limits_for(self, key_name: str | None) -> BudgetLimits:
        """The defaults, overridden field by field by ``per_key[key_name]`` when present."""
        base = self.defaults
        override = self.per_key.get(key_name) if key_name is not None else None
        if override is not None:
            base = base.model_copy(
                update={name: getattr(override, name) for name in override.model_fields_set}
            )
        return base.to_limits()

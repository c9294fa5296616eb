"""gateway.config.BudgetSettings and gateway.budgets.limits_for: defaults, per-key overrides at
the session and the tenant level, sizes with units, validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.budgets import BudgetLimits, Limits, limits_for
from gateway.config import ApiKeySettings, BudgetSettings, LimitSettings, SessionLimitSettings

GiB = 1 << 30


def test_defaults_are_unlimited_and_in_memory() -> None:
    s = BudgetSettings()
    assert s.store == "memory" and s.outage_policy == "fail_open"
    assert limits_for(s, "anonymous") == Limits(BudgetLimits(), BudgetLimits())
    assert limits_for(s, "any-key") == Limits(BudgetLimits(), BudgetLimits())


def test_byte_limits_accept_units() -> None:
    s = BudgetSettings.model_validate(
        {"defaults": {"inflight_kv_bytes": "16GiB", "request_kv_bytes": "512 MiB"}}
    )
    limits = limits_for(s, "anonymous").session
    assert limits.inflight_kv_bytes == 16 * GiB
    assert limits.request_kv_bytes == 512 << 20


def test_per_key_override_replaces_only_the_fields_it_sets() -> None:
    s = BudgetSettings.model_validate(
        {
            "defaults": {"inflight_kv_bytes": "4GiB", "requests_per_minute": 60},
            "per_key": {
                "batch": {"inflight_kv_bytes": "64GiB"},
                "vip": {"requests_per_minute": None},
            },
        }
    )
    assert limits_for(s, "batch").session == BudgetLimits(inflight_kv_bytes=64 * GiB,
                                                          requests_per_minute=60)
    assert limits_for(s, "vip").session == BudgetLimits(inflight_kv_bytes=4 * GiB)
    assert limits_for(s, "other") == limits_for(s, "anonymous")


def test_tenant_limits_have_defaults_and_per_key_overrides_field_by_field() -> None:
    s = BudgetSettings.model_validate(
        {
            "defaults": {"inflight_kv_bytes": "4GiB",
                         "tenant": {"inflight_kv_bytes": "16GiB", "requests_per_minute": 600}},
            "per_key": {
                "batch": {"tenant": {"inflight_kv_bytes": "64GiB"}},
                "vip": {"inflight_kv_bytes": "8GiB", "tenant": {"requests_per_minute": None}},
            },
        }
    )
    assert limits_for(s, "other") == Limits(
        session=BudgetLimits(inflight_kv_bytes=4 * GiB),
        tenant=BudgetLimits(inflight_kv_bytes=16 * GiB, requests_per_minute=600))
    assert limits_for(s, "batch") == Limits(
        session=BudgetLimits(inflight_kv_bytes=4 * GiB),
        tenant=BudgetLimits(inflight_kv_bytes=64 * GiB, requests_per_minute=600))
    assert limits_for(s, "vip") == Limits(
        session=BudgetLimits(inflight_kv_bytes=8 * GiB),
        tenant=BudgetLimits(inflight_kv_bytes=16 * GiB))


def test_a_request_that_can_never_fit_names_the_level_whose_limit_refuses_it() -> None:
    limits = Limits(session=BudgetLimits(inflight_kv_bytes=4 * GiB),
                    tenant=BudgetLimits(inflight_kv_bytes=2 * GiB))
    assert limits.never_fits(GiB, 1) is None
    assert limits.never_fits(3 * GiB, 1) == ("tenant", "inflight_kv_bytes", 2 * GiB)
    assert limits.never_fits(5 * GiB, 1) == ("session", "inflight_kv_bytes", 4 * GiB)


def test_key_names_and_redis_prefix_cannot_break_the_tenant_hash_tag() -> None:
    """A tenant is a Redis Cluster hash tag (``{tenant}``) and a metric label: key names and the
    key prefix must not carry braces or spaces."""
    for bad in ("a{b}", "a b", "", "x" * 65):
        with pytest.raises(ValidationError):
            ApiKeySettings.model_validate({"name": bad, "sha256": "0" * 64})
    ApiKeySettings.model_validate({"name": "team-a.prod@eu:1", "sha256": "0" * 64})
    with pytest.raises(ValidationError):
        BudgetSettings(redis_key_prefix="kv{gate}")


def test_redis_store_requires_a_redis_url() -> None:
    with pytest.raises(ValidationError, match="redis_url"):
        BudgetSettings(store="redis")
    with pytest.raises(ValidationError, match="redis://"):
        BudgetSettings(store="redis", redis_url="http://localhost:6379")
    BudgetSettings(store="redis", redis_url="redis://localhost:6379/0")


def test_unknown_fields_and_negative_limits_are_rejected() -> None:
    with pytest.raises(ValidationError):
        BudgetSettings.model_validate({"defaults": {"inflight_kv_byte": 1}})
    with pytest.raises(ValidationError):
        BudgetSettings.model_validate({"defaults": {"requests_per_minute": -1}})
    with pytest.raises(ValidationError):
        BudgetSettings.model_validate({"lease_ttl_s": 0})


def test_every_field_is_documented() -> None:
    for model in (BudgetSettings, LimitSettings, SessionLimitSettings):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"

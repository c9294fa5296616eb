"""gateway.config.BudgetSettings and gateway.budgets.limits_for: defaults, per-key overrides, sizes
with units, validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from gateway.budgets import BudgetLimits, limits_for
from gateway.config import BudgetSettings, SessionLimitSettings

GiB = 1 << 30


def test_defaults_are_unlimited_and_in_memory() -> None:
    s = BudgetSettings()
    assert s.store == "memory" and s.outage_policy == "fail_open"
    assert limits_for(s, None) == BudgetLimits()
    assert limits_for(s, "any-key") == BudgetLimits()


def test_byte_limits_accept_units() -> None:
    s = BudgetSettings.model_validate(
        {"defaults": {"inflight_kv_bytes": "16GiB", "request_kv_bytes": "512 MiB"}}
    )
    limits = limits_for(s, None)
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
    assert limits_for(s, "batch") == BudgetLimits(inflight_kv_bytes=64 * GiB, requests_per_minute=60)
    assert limits_for(s, "vip") == BudgetLimits(inflight_kv_bytes=4 * GiB)
    assert limits_for(s, "other") == limits_for(s, None)


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
    for model in (BudgetSettings, SessionLimitSettings):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no description"

"""Hit accounting: every prompt token in exactly one outcome, the loss buckets summing to the
ceiling minus what vLLM delivered, the mismatch detector and the ledger of recent requests."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.config import build_settings
from gateway.routing.accounting import (
    LOSSES,
    OUTCOMES,
    HitBuckets,
    HitLedger,
    HitRecord,
    MismatchDetector,
    account,
    delivered_from,
)

POOL = build_settings({
    "models": [{"name": "m", "tokenizer": "simple"}],
    "pools": [{"name": "p", "max_context_tokens": 8192, "workers": ["http://w1"]}],
}).pools[0]
REASONS = ("prefix_hit", "least_loaded", "load_balance", "kv_pressure", "spill", "round_robin",
           "affinity", "owner")


def usage(cached: int | None) -> dict[str, object]:
    details = None if cached is None else {"cached_tokens": cached}
    return {"prompt_tokens": 100, "completion_tokens": 1, "prompt_tokens_details": details}


@given(p=st.integers(-5, 5000), f=st.integers(-5, 5000), pr=st.integers(-5, 5000),
       d=st.one_of(st.none(), st.integers(-5, 6000)), reason=st.sampled_from(REASONS),
       evicted=st.integers(-5, 5000), mismatch=st.booleans())
def test_outcomes_sum_to_the_prompt_and_losses_to_ceiling_minus_delivered_for_any_input(
    p: int, f: int, pr: int, d: int | None, reason: str, evicted: int, mismatch: bool,
) -> None:
    b = account(p, f, pr, d, reason, evicted_tokens=evicted, mismatch=mismatch)
    tokens = dict(b.items())
    assert tuple(tokens) == OUTCOMES
    assert all(v >= 0 for v in tokens.values())
    assert sum(tokens.values()) == b.prompt_tokens == max(p, 0)
    assert sum(tokens[k] for k in LOSSES) == b.lost_tokens
    if d is not None:
        assert b.unknown == 0
        assert b.lost_tokens == b.ceiling_tokens - b.delivered


def test_a_prompt_no_worker_holds_is_never_seen_whoever_is_chosen() -> None:
    assert account(1000, 0, 0, 0, "least_loaded") == HitBuckets(1000, never_seen=1000)


def test_a_holder_passed_over_for_load_loses_its_prefix_to_load() -> None:
    b = account(1000, 960, 0, 0, "load_balance")
    assert (b.load, b.never_seen, b.delivered, b.ceiling_tokens) == (960, 40, 0, 960)


def test_a_holder_passed_over_for_kv_pressure_loses_its_prefix_to_kv_pressure() -> None:
    b = account(1000, 960, 320, 320, "kv_pressure")
    assert (b.kv_pressure, b.load, b.delivered, b.never_seen) == (640, 0, 320, 40)


def test_a_prediction_the_worker_did_not_deliver_is_stale_index() -> None:
    b = account(1000, 960, 960, 0, "prefix_hit")
    assert (b.stale_index, b.delivered, b.never_seen) == (960, 0, 40)


def test_evicted_tokens_are_taken_from_the_shortfall_and_the_rest_stays_stale() -> None:
    b = account(1000, 960, 960, 320, "prefix_hit", evicted_tokens=480)
    assert (b.evicted, b.stale_index, b.delivered) == (480, 160, 320)
    # an eviction count larger than the shortfall cannot invent losses
    assert account(1000, 960, 960, 960, "prefix_hit", evicted_tokens=480).evicted == 0


def test_a_shortfall_of_a_flagged_model_is_mismatch_not_stale_index() -> None:
    b = account(1000, 960, 960, 0, "prefix_hit", mismatch=True)
    assert (b.mismatch, b.stale_index) == (960, 0)


def test_vllm_delivering_more_than_the_index_knew_raises_the_ceiling_without_a_loss() -> None:
    b = account(1000, 320, 320, 640, "prefix_hit")
    assert (b.delivered, b.ceiling_tokens, b.lost_tokens, b.never_seen) == (640, 640, 0, 360)


def test_a_worker_delivering_more_than_predicted_reduces_the_load_loss_only_by_that() -> None:
    b = account(1000, 960, 320, 640, "load_balance")
    assert (b.load, b.delivered, b.stale_index) == (320, 640, 0)


def test_without_cached_tokens_the_prediction_at_the_chosen_worker_is_unknown() -> None:
    b = account(1000, 960, 320, None, "load_balance")
    assert (b.unknown, b.load, b.never_seen, b.delivered) == (320, 640, 40, 0)
    assert b.ceiling_tokens == 960


def test_delivered_is_read_only_from_an_integer_cached_tokens() -> None:
    assert delivered_from(usage(48)) == 48
    assert delivered_from(usage(None)) is None
    assert delivered_from({"prompt_tokens_details": {"cached_tokens": True}}) is None
    assert delivered_from({"prompt_tokens_details": {"cached_tokens": "48"}}) is None
    assert delivered_from({"prompt_tokens": 3}) is None
    assert delivered_from(None) is None
    assert delivered_from([1, 2]) is None


def test_detector_flags_a_model_whose_predictions_are_never_delivered_once_enough_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    changes: list[tuple[str, bool]] = []
    d = MismatchDetector(window=32, min_samples=8, on_change=lambda m, f: changes.append((m, f)))
    with caplog.at_level(logging.WARNING, "gateway.routing.accounting"):
        flags = [d.observe("m", 512, 0) for _ in range(8)]
    assert flags == [False] * 7 + [True]
    assert changes == [("m", True)]
    assert "prefix cache mismatch for model m" in caplog.text
    assert "tokenizer or chat template" in caplog.text
    assert not d.observe("other", 512, 512)  # per model


def test_detector_ignores_answers_that_predicted_nothing() -> None:
    d = MismatchDetector(window=32, min_samples=8)
    for _ in range(100):
        assert not d.observe("m", 0, 0)
    assert d.ratio("m") is None


def test_detector_does_not_flag_a_model_that_mostly_hits() -> None:
    d = MismatchDetector(window=32, min_samples=8)
    for i in range(64):
        assert not d.observe("m", 512, 0 if i % 4 == 0 else 512)


def test_detector_clears_only_once_delivery_recovers_past_the_upper_threshold() -> None:
    changes: list[tuple[str, bool]] = []
    d = MismatchDetector(window=10, min_samples=10, on_change=lambda m, f: changes.append((m, f)))
    for _ in range(10):
        d.observe("m", 100, 0)
    for _ in range(3):  # 30%: above flag_below, below clear_above: still flagged
        assert d.observe("m", 100, 100)
    for _ in range(7):
        d.observe("m", 100, 100)
    assert changes == [("m", True), ("m", False)]
    assert "m" not in d.flagged


def record(ledger: HitLedger, rid: str, *, fleet: int = 960, predicted: int = 960,
           reason: str = "prefix_hit") -> HitRecord:
    return ledger.routed(rid, "m", POOL, "kv_aware", reason, "http://w1", 1000, fleet, predicted)


def test_ledger_keeps_only_the_last_capacity_requests() -> None:
    ledger = HitLedger(3)
    for i in range(5):
        record(ledger, f"r{i}")
    assert len(ledger) == 3
    assert ledger.get("r1") is None and ledger.get("r4") is not None


def test_ledger_with_capacity_zero_keeps_nothing_but_still_accounts() -> None:
    ledger = HitLedger(0)
    rec = ledger.routed("r", "m", POOL, "kv_aware", "prefix_hit", "http://w1", 1000, 960, 960)
    assert ledger.get("r") is None
    assert ledger.settle(rec, usage(960)).delivered == 960
    assert ledger.totals()["p"]["delivered"] == 960


def test_ledger_settles_once_and_totals_sum_to_the_prompt_tokens() -> None:
    ledger = HitLedger(10)
    a = ledger.routed("a", "m", POOL, "kv_aware", "prefix_hit", "http://w1", 1000, 960, 960)
    b = ledger.routed("b", "m", POOL, "kv_aware", "load_balance", "http://w1", 1000, 960, 0)
    first = ledger.settle(a, usage(640))
    assert ledger.settle(a, usage(0)) is first  # a second settle changes nothing
    ledger.settle(b, None)
    totals = ledger.totals()["p"]
    assert sum(totals.values()) == 2000
    assert totals == {"delivered": 640, "never_seen": 80, "load": 960, "kv_pressure": 0,
                      "stale_index": 320, "evicted": 0, "mismatch": 0, "unknown": 0}


def test_a_moved_request_is_accounted_at_the_worker_it_moved_to() -> None:
    ledger = HitLedger(10)
    rec = ledger.routed("a", "m", POOL, "kv_aware", "prefix_hit", "http://w1", 1000, 960, 960)
    ledger.moved(rec, "kv_aware", "least_loaded", "http://w2", 960, 0)
    b = ledger.settle(rec, usage(0))
    assert (rec.worker, rec.moves, b.load, b.stale_index) == ("http://w2", 1, 960, 0)


def test_the_ledger_uses_the_detector_so_a_flagged_models_losses_are_mismatch() -> None:
    ledger = HitLedger(100, detector=MismatchDetector(window=8, min_samples=4))
    buckets = [ledger.settle(record(ledger, f"r{i}"), usage(0)) for i in range(6)]
    assert [b.stale_index for b in buckets] == [960, 960, 960, 0, 0, 0]
    assert [b.mismatch for b in buckets] == [0, 0, 0, 960, 960, 960]


def test_a_shortfall_the_eviction_probe_explains_is_evicted_and_the_probe_is_dropped() -> None:
    calls: list[tuple[int, int]] = []

    def probe(predicted: int, delivered: int) -> int:
        calls.append((predicted, delivered))
        return predicted - delivered

    ledger = HitLedger(10)
    rec = ledger.routed("r", "m", POOL, "kv_aware", "prefix_hit", "http://w1", 1000, 960, 960,
                        eviction_probe=probe)
    buckets = ledger.settle(rec, usage(320))
    assert (buckets.evicted, buckets.stale_index, buckets.delivered) == (640, 0, 320)
    assert calls == [(960, 320)] and rec.eviction_probe is None


def test_without_an_eviction_or_a_usage_the_shortfall_stays_stale_or_unknown() -> None:
    ledger = HitLedger(10)
    no_eviction = ledger.routed("a", "m", POOL, "kv_aware", "prefix_hit", "http://w1", 1000, 960,
                                960, eviction_probe=lambda p, d: 0)
    assert ledger.settle(no_eviction, usage(320)).stale_index == 640

    def never(predicted: int, delivered: int) -> int:
        raise AssertionError("asked without a delivered count")

    no_usage = ledger.routed("b", "m", POOL, "kv_aware", "prefix_hit", "http://w1", 1000, 960,
                             960, eviction_probe=never)
    assert ledger.settle(no_usage, None).unknown == 960
    assert no_usage.eviction_probe is None  # its hashes are not kept past the answer

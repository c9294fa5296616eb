"""gateway.routing.slo and its wiring in the router: calibration, selection, shedding by class.

The models and ``select`` are pure and tested directly; the router is the real one over the real
registry and workers (plain objects), with the real ``kv_aware`` policy, so "no objective" can be
compared with the policy's own choice over many load states.
"""

from __future__ import annotations

import math
import random

import pytest

from gateway.config import ConfigError, PoolSettings, Priority, SloSettings, build_settings
from gateway.errors import from_domain
from gateway.request import slo_seconds_from
from gateway.routing.kv_aware import KvAware
from gateway.routing.router import Router, SloUnattainable, candidate
from gateway.routing.slo import (
    RETRY_AFTER_MAX_S,
    SLO_BEST_EFFORT_REASON,
    SLO_REASON,
    TPOT,
    TTFT,
    LineFit,
    Prediction,
    SloModel,
    SloTarget,
    select,
)
from gateway.routing.types import Policy, RoutingRequest
from gateway.workers.registry import WorkerRegistry
from gateway.workers.worker import VllmStats

URLS = ["http://w0", "http://w1", "http://w2", "http://w3"]


# --- the calibrated models ------------------------------------------------------------------------


def test_cold_worker_predicts_the_configured_prior() -> None:
    s = SloSettings(ttft_base_ms=20, ttft_ms_per_cost_unit=0.05, tpot_base_ms=8,
                    tpot_ms_per_request=0.25)
    p = SloModel(s).predict("http://w0", cost=1000, batch=4)
    assert p.ttft_s == pytest.approx(0.020 + 1000 * 0.05e-3)
    assert p.tpot_s == pytest.approx(0.008 + 4 * 0.25e-3)


def test_ttft_calibration_converges_to_the_workers_true_line() -> None:
    """A worker 4x slower than the prior with a 50 ms floor: after requests of varied cost the
    prediction is within 5% of what it does, and the calibration gauge (observed / predicted,
    which forgets the early misses over a few half-lives) is back at 1."""
    model = SloModel(SloSettings())
    rng = random.Random(7)
    for _ in range(40):
        cost = rng.uniform(0, 8000)
        model.observe(model.predict("http://w0", cost, 1), 0.050 + 0.2e-3 * cost, None)
    assert model.predict("http://w0", 4000, 1).ttft_s == pytest.approx(0.85, rel=0.05)
    for _ in range(400):
        cost = rng.uniform(0, 8000)
        p = model.predict("http://w0", cost, 1)
        model.observe(p, 0.050 + 0.2e-3 * cost, None)
    for cost in (100.0, 2000.0, 8000.0):
        true = 0.050 + 0.2e-3 * cost
        assert model.predict("http://w0", cost, 1).ttft_s == pytest.approx(true, rel=0.05)
    assert model.ratio("http://w0", TTFT) == pytest.approx(1.0, abs=0.05)


def test_tpot_calibration_follows_the_batch_size() -> None:
    model = SloModel(SloSettings())
    for i in range(300):
        batch = 1 + i % 40
        p = model.predict("http://w0", 0, batch)
        model.observe(p, None, 0.012 + 0.0015 * batch)
    assert model.predict("http://w0", 0, 30).tpot_s == pytest.approx(0.012 + 0.045, rel=0.05)
    assert model.predict("http://w0", 0, 2).tpot_s == pytest.approx(0.015, rel=0.1)


def test_calibration_follows_a_worker_that_slows_down_within_a_few_half_lives() -> None:
    model = SloModel(SloSettings(half_life_requests=16))
    rng = random.Random(3)
    for slope in (0.1e-3, 0.4e-3):
        for _ in range(120):
            cost = rng.uniform(0, 6000)
            model.observe(model.predict("http://w0", cost, 1), 0.02 + slope * cost, None)
    assert model.predict("http://w0", 5000, 1).ttft_s == pytest.approx(0.02 + 2.0, rel=0.1)


def test_worker_whose_requests_all_cost_the_same_still_predicts_that_cost() -> None:
    """Degenerate x: the prior's pseudo-observations keep the fit defined."""
    model = SloModel(SloSettings())
    for _ in range(100):
        model.observe(model.predict("http://w0", 2048, 1), 0.9, None)
    assert model.predict("http://w0", 2048, 1).ttft_s == pytest.approx(0.9, rel=0.05)


def test_cold_worker_predicts_with_its_warm_peers_mean() -> None:
    model = SloModel(SloSettings(warm_after_requests=8))
    for url in ("http://w0", "http://w1"):
        for cost in range(0, 8000, 400):
            model.observe(model.predict(url, cost, 1), 0.01 + 0.3e-3 * cost, None)
    cold = model.predict("http://new", 4000, 1).ttft_s
    assert cold == pytest.approx(0.01 + 1.2, rel=0.05)
    prior = SloModel(SloSettings()).predict("http://new", 4000, 1).ttft_s
    assert prior < cold / 2  # the prior alone would have been far too optimistic


def test_cold_worker_slower_than_its_peers_is_found_out_within_two_requests() -> None:
    """Regression: a cold worker used to predict with its peers' mean until it had
    ``warm_after_requests`` observations of its own, so a worker 100x slower than its peers
    kept being predicted fast (and kept receiving requests with a TTFT objective)."""
    model = SloModel(SloSettings())
    for cost in range(0, 8000, 400):
        model.observe(model.predict("http://fast", cost, 1), 0.005 + 1e-5 * cost, None)
    for slow_cost in (800.0, 900.0):
        model.observe(model.predict("http://slow", slow_cost, 1), 1e-3 * slow_cost, None)
    assert model.predict("http://slow", 850, 1).ttft_s > 0.5
    assert not model.warm("http://slow") and model.warm("http://fast")


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf])
def test_absurd_observations_are_dropped(bad: float) -> None:
    model = SloModel(SloSettings())
    before = model.predict("http://w0", 1000, 3)
    model.observe(before, bad, bad)
    after = model.predict("http://w0", 1000, 3)
    assert (after.ttft_s, after.tpot_s) == (before.ttft_s, before.tpot_s)


def test_line_fit_never_predicts_a_negative_slope_or_intercept() -> None:
    fit = LineFit(4096, 64)
    for x, y in ((0.0, 0.5), (1000.0, 0.3), (4000.0, 0.1)):  # falling: nonsense for a queue
        fit.add(x, y)
    a, b = fit.params(0.02, 1e-4)
    assert a >= 0 and b >= 0
    fit = LineFit(4096, 64)
    for x in range(100, 5000, 100):
        fit.add(float(x), 1e-3 * x - 0.09)  # would need a negative intercept
    a, b = fit.params(0.02, 1e-4)
    assert a == 0.0 and b > 0


# --- selection --------------------------------------------------------------------------------------


def pred(worker: str, cost: float, ttft_s: float, tpot_s: float = 0.01) -> Prediction:
    return Prediction(worker, cost, 1, ttft_s, tpot_s)


PREDS = [pred("a", 5000, 0.80), pred("b", 900, 0.20), pred("c", 300, 0.05)]


def test_policy_choice_that_meets_the_objective_is_kept_even_if_others_are_cheaper() -> None:
    s = select(PREDS, 1, [True] * 3, [0] * 3, ttft_s=0.45, tpot_s=None, elapsed_s=0.0,
               shed=True)
    assert (s.index, s.moved, s.shed) == (1, False, False)


def test_policy_choice_meeting_the_objective_without_margin_moves_to_the_fastest() -> None:
    """b's 0.20 s meets 0.25 s, but not with KEEP_SLACK (2x) to spare: an error of the
    prediction would miss it (a slow GPU's line is least accurate at low cost), so the request
    goes where it leaves the most slack."""
    s = select(PREDS, 1, [True] * 3, [0] * 3, ttft_s=0.25, tpot_s=None, elapsed_s=0.0,
               shed=True)
    assert (s.index, s.moved) == (2, True)


def test_policy_choice_that_misses_moves_to_the_cheapest_meeting_candidate() -> None:
    s = select(PREDS, 0, [True] * 3, [0] * 3, ttft_s=0.25, tpot_s=None, elapsed_s=0.0,
               shed=True)
    assert (s.index, s.moved) == (2, True)


def test_meeting_candidates_are_ranked_by_predicted_ttft_not_by_token_cost() -> None:
    """On mixed GPUs a token costs more on the slower worker: the one with the lower kv_aware
    cost (a) is predicted slower than the one with more queued (b); b leaves more slack."""
    preds = [pred("policy", 9000, 2.0), pred("a", 500, 0.45), pred("b", 1500, 0.15)]
    s = select(preds, 0, [True] * 3, [0] * 3, ttft_s=0.5, tpot_s=None, elapsed_s=0.0,
               shed=True)
    assert s.index == 2


def test_best_effort_weighs_both_objectives_by_their_overshoot() -> None:
    preds = [Prediction("a", 0, 1, 0.30, 0.200), Prediction("b", 0, 1, 0.60, 0.012)]
    # a: TTFT 1.5x, TPOT 20x over; b: TTFT 3x, TPOT 1.2x over: b misses by the least
    s = select(preds, 0, [True, True], [0, 0], ttft_s=0.2, tpot_s=0.01, elapsed_s=0.0,
               shed=False)
    assert s.index == 1 and not s.attainable


def test_candidate_over_the_kv_hard_limit_is_never_a_move_target() -> None:
    s = select(PREDS, 0, [True, True, False], [0] * 3, ttft_s=0.25, tpot_s=None,
               elapsed_s=0.0, shed=True)
    assert s.index == 1


def test_time_already_spent_in_the_gateway_counts_against_the_ttft() -> None:
    s = select(PREDS, 1, [True] * 3, [0] * 3, ttft_s=0.25, tpot_s=None, elapsed_s=0.1,
               shed=True)
    assert s.index == 2  # b's 0.20 s no longer fits after 0.1 s queued


def test_unattainable_objective_sheds_only_when_the_class_is_shed() -> None:
    batch = select(PREDS, 0, [True] * 3, [0] * 3, ttft_s=0.01, tpot_s=None, elapsed_s=0.0,
                   shed=True)
    interactive = select(PREDS, 0, [True] * 3, [0] * 3, ttft_s=0.01, tpot_s=None,
                         elapsed_s=0.0, shed=False)
    assert batch.shed and not batch.attainable and batch.unmet == TTFT
    assert 1.0 <= batch.retry_after_s <= RETRY_AFTER_MAX_S
    # best effort: the candidate predicted to miss by the least
    assert not interactive.shed and not interactive.attainable and interactive.index == 2


def test_tpot_objective_no_candidate_meets_is_reported_as_tpot() -> None:
    s = select(PREDS, 0, [True] * 3, [0] * 3, ttft_s=1.0, tpot_s=0.001, elapsed_s=0.0,
               shed=True)
    assert s.shed and s.unmet == TPOT


# --- the router ------------------------------------------------------------------------------------


def kv_pool(**slo: object) -> PoolSettings:
    return PoolSettings.model_validate({
        "name": "p", "max_context_tokens": 32768, "policy": "kv_aware", "workers": URLS,
        "slo": slo})


def kv_router(pool: PoolSettings) -> tuple[Router, WorkerRegistry]:
    registry = WorkerRegistry([pool])
    for w in registry:
        w.healthy = True
    policies: dict[str, Policy] = {pool.name: KvAware(pool.kv_aware)}
    return Router([pool], registry, policies, spill=False), registry


def load(registry: WorkerRegistry, url: str, *, queued: int = 0, inflight: int = 0,
         running: int = 0, kv: float = 0.0) -> None:
    w = registry.get(url)
    assert w is not None
    w.inflight, w.inflight_prompt_tokens = inflight, queued
    w.stats = VllmStats(running=running, kv_usage_ratio=kv)


def request(prompt_tokens: int = 1000) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=prompt_tokens, max_tokens=16)


def test_no_objective_routes_exactly_as_the_policy_alone_over_random_load_states() -> None:
    pool = kv_pool()
    router, registry = kv_router(pool)
    alone = KvAware(pool.kv_aware)
    rng = random.Random(11)
    for _ in range(300):
        for url in URLS:
            load(registry, url, queued=rng.choice((0, 0, 500, 4000)),
                 inflight=rng.randrange(6), running=rng.randrange(6),
                 kv=rng.choice((0.1, 0.85, 0.97)))
        req = request(rng.randrange(10, 8000))
        cands = [candidate(w) for w in registry.healthy("p", "m")]
        for slo in (None, SloTarget(), SloTarget(priority=Priority.BATCH)):
            # each asked once per request, so both rotations (ties) stay in step
            assert router.route(req, slo=slo).decision == alone.choose(req, cands)


def test_objective_moves_the_request_to_a_worker_predicted_to_meet_it() -> None:
    router, registry = kv_router(kv_pool())
    # w3 is idle but serves 8 requests (decode load: 8 x 64 cost units); the others have
    # ~0.4 s of prefill queued (the prior: 0.05 ms per unit), cheaper by kv_aware's weights
    for url in URLS[:3]:
        load(registry, url, queued=8000)
    load(registry, URLS[3], inflight=8, running=8)
    route = router.route(request(2000), slo=SloTarget(ttft_s=0.5))
    assert route.worker.url == "http://w3"
    assert route.slo is not None and route.slo.ttft_s == 0.5


def test_objective_met_by_the_policys_choice_leaves_it_unchanged() -> None:
    router, registry = kv_router(kv_pool())
    for url in URLS:
        load(registry, url)
    plain = router.route(request(2000))
    with_slo = router.route(request(2000), slo=SloTarget(ttft_s=5.0))
    assert with_slo.decision.reason != SLO_REASON
    assert plain.decision.reason == with_slo.decision.reason


def test_unattainable_objective_refuses_a_batch_request_and_serves_an_interactive_one() -> None:
    router, registry = kv_router(kv_pool())
    for url in URLS:
        load(registry, url, queued=40000)  # ~2 s of prefill queued everywhere (the prior)
    with pytest.raises(SloUnattainable) as refused:
        router.route(request(), slo=SloTarget(ttft_s=0.2, priority=Priority.BATCH))
    assert refused.value.objectives == (TTFT,) and refused.value.pool == "p"
    route = router.route(request(), slo=SloTarget(ttft_s=0.2, priority=Priority.INTERACTIVE))
    assert route.decision.reason == SLO_BEST_EFFORT_REASON


def test_pool_shed_setting_decides_which_classes_are_refused() -> None:
    router, registry = kv_router(kv_pool(shed=[]))
    for url in URLS:
        load(registry, url, queued=40000)
    route = router.route(request(), slo=SloTarget(ttft_s=0.2, priority=Priority.BATCH))
    assert route.worker.url in URLS
    router, registry = kv_router(kv_pool(shed=["interactive", "batch"]))
    for url in URLS:
        load(registry, url, queued=40000)
    with pytest.raises(SloUnattainable):
        router.route(request(), slo=SloTarget(ttft_s=0.2))


def test_pool_default_objective_applies_when_the_request_names_none() -> None:
    router, registry = kv_router(kv_pool(ttft_ms=200))
    for url in URLS:
        load(registry, url, queued=40000)
    with pytest.raises(SloUnattainable):
        router.route(request(), slo=SloTarget(priority=Priority.BATCH))
    # the request's own (looser) objective replaces the pool's
    route = router.route(request(), slo=SloTarget(ttft_s=60.0, priority=Priority.BATCH))
    assert route.slo is not None and route.slo.ttft_s == 60.0


def test_tight_objective_never_moves_a_request_onto_a_worker_over_the_kv_hard_limit() -> None:
    router, registry = kv_router(kv_pool())
    load(registry, URLS[0], queued=40000)
    load(registry, URLS[1], queued=40000)
    load(registry, URLS[2], queued=40000)
    load(registry, URLS[3], kv=0.99)  # idle but full: only it would meet 0.2 s
    with pytest.raises(SloUnattainable):
        router.route(request(), slo=SloTarget(ttft_s=0.2, priority=Priority.BATCH))


def test_shed_error_is_a_503_slo_unattainable_with_retry_after() -> None:
    exc = SloUnattainable("m", pool="p", objective="tpot", objectives=("ttft", "tpot"),
                          retry_after_s=2.2)
    err = from_domain(exc)
    assert err is not None
    assert (err.status, err.code, err.param, err.type) == (
        503, "slo_unattainable", "x-slo-tpot-ms", "service_unavailable_error")
    assert err.response().headers["retry-after"] == "3"


# --- hostile headers and config ------------------------------------------------------------------


@pytest.mark.parametrize("value", [
    "0", "0.0", "-5", "nan", "NaN", "inf", "-inf", "1e3", "1_000", "0x10", "5ms", ".5", "5.",
    "", "  ", "٣", "99999999999", "3600000.1", "1.2.3", "+5", "10" * 20])
def test_bad_objective_header_is_a_400_invalid_slo(value: str) -> None:
    with pytest.raises(Exception) as refused:
        slo_seconds_from([value], "x-slo-ttft-ms", 3_600_000)
    err = from_domain(refused.value)
    assert err is not None
    assert (err.status, err.type, err.code, err.param) == (
        400, "invalid_request_error", "invalid_slo", "x-slo-ttft-ms")


def test_objective_header_sent_twice_is_a_400() -> None:
    with pytest.raises(Exception) as refused:
        slo_seconds_from(["100", "5000"], "x-slo-tpot-ms", 3_600_000)
    err = from_domain(refused.value)
    assert err is not None and err.status == 400 and err.param == "x-slo-tpot-ms"


@pytest.mark.parametrize(("value", "seconds"), [
    ("250", 0.25), (" 62.5 ", 0.0625), ("3600000", 3600.0), ("0.5", 0.0005)])
def test_good_objective_header_is_read_in_milliseconds(value: str, seconds: float) -> None:
    assert slo_seconds_from([value], "x-slo-ttft-ms", 3_600_000) == pytest.approx(seconds)


def test_absent_objective_header_is_none() -> None:
    assert slo_seconds_from([], "x-slo-ttft-ms", 3_600_000) is None


@pytest.mark.parametrize("bad", [0, -1, 4_000_000])
def test_key_default_objective_out_of_range_fails_the_config(bad: float) -> None:
    with pytest.raises(ConfigError, match="slo_ttft_ms"):
        build_settings({
            "models": [{"name": "m", "tokenizer": "simple"}],
            "pools": [{"name": "p", "max_context_tokens": 1024, "workers": ["http://w0"]}],
            "auth": {"api_keys": [{"name": "k", "sha256": "0" * 64, "slo_ttft_ms": bad}]}})


def test_slo_settings_default_sheds_batch_only() -> None:
    assert SloSettings().shed == [Priority.BATCH]


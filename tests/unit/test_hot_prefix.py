"""Hot prefixes (``gateway.routing.hot``): demand per prefix, a holder grown on purpose when one
cannot keep up, and ``kv_aware``'s choice, exactly, everywhere else."""

from __future__ import annotations

import itertools
import random

import pytest
from pydantic import ValidationError

from gateway.config import HotPrefixSettings, KvAwareSettings
from gateway.routing.hot import COOLDOWN_REQUESTS, HOT_PREFIX, HotPrefixes, Option
from gateway.routing.kv_aware import KvAware
from gateway.routing.types import Candidate, LoadSnapshot, RoutingRequest

PREFIX = 2048
WORKERS = [f"w{i}" for i in range(8)]


def prompt(prefix: int, question: int, prefix_tokens: int = PREFIX) -> tuple[int, ...]:
    """``prefix_tokens`` tokens shared by every prompt of ``prefix``, then 64 of its own."""
    return (tuple(prefix * 100_000 + t for t in range(prefix_tokens))
            + tuple(10_000_000 + question * 64 + t for t in range(64)))


def req(prefix: int, question: int, adapter: str | None = None) -> RoutingRequest:
    ids = prompt(prefix, question)
    return RoutingRequest("m", len(ids), 16, token_ids=ids, adapter=adapter)


def cand(worker: str, cached: int = 0, inflight: int = 0, queued: int = 0,
         kv: float = 0.0) -> Candidate:
    return Candidate(worker, LoadSnapshot(inflight, queued, inflight, 0, kv), cached)


def policy(**hot: float) -> KvAware:
    settings = HotPrefixSettings.model_validate({"enabled": True, **hot})
    return KvAware(KvAwareSettings(hot_prefix=settings))


def plain() -> KvAware:
    """``kv_aware`` alone (hot prefixes off)."""
    return KvAware(KvAwareSettings(hot_prefix=HotPrefixSettings(enabled=False)))


def fleet(holders: dict[str, int], inflight: dict[str, int]) -> list[Candidate]:
    return [cand(w, holders.get(w, 0), inflight.get(w, 0)) for w in WORKERS]


# -- the demand estimate -------------------------------------------------------------------------


def test_share_is_the_decayed_fraction_of_the_pools_recent_requests() -> None:
    hot = HotPrefixes(HotPrefixSettings(enabled=True, window_requests=32))
    d = 1 - 1 / 32
    ids = prompt(0, 0)
    key = hot.key(ids, PREFIX, None)
    seen: list[int] = []
    for n in range(1, 201):
        hot.count_request()
        if n % 3 == 0:
            hot.observe(key)
            seen.append(n)
    expected = sum(d ** (200 - n) for n in seen) / sum(d ** (200 - n) for n in range(1, 201))
    assert hot.share(key) == pytest.approx(expected, rel=1e-9)
    assert hot.share(key) == pytest.approx(1 / 3, abs=0.03)


def test_share_decays_when_the_prefix_stops_being_asked_for() -> None:
    hot = HotPrefixes(HotPrefixSettings(enabled=True, window_requests=64))
    key = hot.key(prompt(0, 0), PREFIX, None)
    for _ in range(200):
        hot.count_request()
        hot.observe(key)
    assert hot.share(key) == pytest.approx(1.0)
    assert hot.wanted_holders(key, 8) == 7  # need 8 fair shares, 7 x 1.25 >= 8
    for _ in range(300):
        hot.count_request()
    assert hot.share(key) < 0.01
    assert hot.wanted_holders(key, 8) == 1


def test_demand_is_tracked_for_at_most_max_prefixes_least_recent_dropped() -> None:
    hot = HotPrefixes(HotPrefixSettings(enabled=True, max_prefixes=4))
    keys = [hot.key(prompt(p, 0), PREFIX, None) for p in range(10)]
    for k in keys:
        hot.count_request()
        hot.observe(k)
    hot.observe(keys[6])  # seen again: the most recent now
    assert len(hot) == 4
    assert hot.share(keys[0]) == 0.0
    assert all(hot.share(k) > 0 for k in (keys[6], keys[7], keys[8], keys[9]))


def test_the_key_is_the_prefix_not_the_question_and_an_adapter_has_its_own() -> None:
    hot = HotPrefixes(HotPrefixSettings(enabled=True))
    assert hot.key(prompt(0, 1), PREFIX, None) == hot.key(prompt(0, 2), PREFIX, None)
    assert hot.key(prompt(0, 1), PREFIX, None) != hot.key(prompt(1, 1), PREFIX, None)
    assert hot.key(prompt(0, 1), PREFIX, None) != hot.key(prompt(0, 1), PREFIX, "lora-a")


# -- growing a holder ------------------------------------------------------------------------------


def test_a_second_holder_is_grown_when_one_holder_cannot_keep_up() -> None:
    """Half the traffic shares prefix 0 (4 of 8 fair shares), held by w0 alone, which is busy
    (10 requests in flight, the rest idle): the 8th request of the prefix is sent to the
    cheapest non-holder on purpose (once its decayed count reaches 8); the ones before went
    to w0 (kv_aware's choice)."""
    p = policy()
    inflight = {"w0": 10}
    decisions = []
    for q in range(24):
        if q % 2:  # a cold prompt
            p.choose(req(1000 + q, q), fleet({}, inflight))
        else:
            decisions.append(p.choose(req(0, q), fleet({"w0": PREFIX}, inflight)))
    hot = [d for d in decisions if d.reason == HOT_PREFIX]
    assert len(hot) == 1
    assert hot[0].worker_id != "w0" and hot[0].predicted_cached_tokens == 0
    first = decisions.index(hot[0])
    assert first >= 8 and all(d.worker_id == "w0" for d in decisions[:first])


def test_after_growing_the_prefix_goes_to_the_less_loaded_holder() -> None:
    p = policy()
    for q in range(12):
        p.choose(req(0, q), fleet({"w0": PREFIX}, {"w0": 10}))
    holders = {"w0": PREFIX, "w1": PREFIX}
    d = p.choose(req(0, 99), fleet(holders, {"w0": 6, "w1": 1}))
    assert (d.worker_id, d.reason) == ("w1", "prefix_hit")
    d = p.choose(req(0, 100), fleet(holders, {"w0": 2, "w1": 5}))
    assert (d.worker_id, d.reason) == ("w0", "prefix_hit")


def test_a_third_holder_is_grown_for_a_prefix_asking_for_more_than_two_fair_shares() -> None:
    p = policy()
    grown = []
    holders = {"w0": PREFIX}
    for q in range(200):  # every request is prefix 0: 8 fair shares
        d = p.choose(req(0, q), fleet(holders, {w: 10 for w in holders}))
        if d.reason == HOT_PREFIX:
            grown.append(d.worker_id)
            holders[d.worker_id] = PREFIX
    assert len(grown) >= 2 and len(set(grown)) == len(grown)
    assert len(holders) == 1 + len(grown) <= 8


def test_no_second_growth_within_the_cooldown_while_the_index_lags() -> None:
    """The index has not yet shown the new holder: the prefix is not grown on every request."""
    p = policy()
    reasons = [p.choose(req(0, q), fleet({"w0": PREFIX}, {"w0": 10})).reason for q in range(40)]
    grown = [i for i, r in enumerate(reasons) if r == HOT_PREFIX]
    assert len(grown) >= 2
    assert all(b - a >= COOLDOWN_REQUESTS for a, b in itertools.pairwise(grown))


def test_a_non_holder_over_the_kv_hard_limit_is_never_grown() -> None:
    p = policy()
    for q in range(30):
        cands = [cand("w0", PREFIX, 10), cand("w1", 0, 0, kv=0.99), cand("w2", 0, 3)]
        d = p.choose(req(0, q), cands)
        assert d.worker_id != "w1"
    assert p.hot is not None and d.worker_id in ("w0", "w2")


# -- nothing changes elsewhere ---------------------------------------------------------------------


def test_an_idle_holder_keeps_even_the_hottest_prefix() -> None:
    p, base = policy(), plain()
    for q in range(100):
        cands = fleet({"w0": PREFIX}, {"w0": 1, "w3": 1})
        assert p.choose(req(0, q), cands) == base.choose(req(0, q), cands)


def random_state(rng: random.Random, held: int) -> list[Candidate]:
    return [cand(w, held if rng.random() < 0.3 else 0, rng.randrange(12), rng.randrange(4000),
                 rng.choice((0.0, 0.5, 0.9, 0.97))) for w in WORKERS]


def test_the_decision_is_kv_awares_exactly_for_cold_and_short_prefixes() -> None:
    """300 random load states, nothing cached or a cached prefix below min_prefix_tokens."""
    rng = random.Random(15)
    p, base = policy(), plain()
    for q in range(300):
        short = rng.random() < 0.5
        ids = prompt(rng.randrange(8), q, 256 if short else PREFIX)
        r = RoutingRequest("m", len(ids), 16, token_ids=ids)
        cands = random_state(rng, 256 if short else 0)
        assert p.choose(r, cands) == base.choose(r, cands), q


def test_a_moderately_used_prefix_gets_kv_awares_choice_exactly_with_hold_margin_zero() -> None:
    """Prefixes in turn from 8 (one fair share each: never under-replicated), 300 random load
    states: with hold_margin 0 the rule is kv_aware's own, decision for decision."""
    rng = random.Random(16)
    p, base = policy(hold_margin=0.0), plain()
    for q in range(300):
        r = req(q % 8, q)
        cands = random_state(rng, PREFIX)
        assert p.choose(r, cands) == base.choose(r, cands), q


def test_a_holder_busy_for_a_moment_keeps_a_prefix_its_holders_cover() -> None:
    """Regression (issue 15's Zipf run): kv_aware left a prefix holder as soon as its queue
    exceeded one recompute elsewhere, recomputing a 2K prefix for a transient queue (hit rate
    58% against a ceiling of 71%). A prefix whose demand one holder covers now stays until the
    holder's cost exceeds the alternative's by hold_margin recomputes more."""
    p, base = policy(hold_margin=1.0), plain()
    for q in range(64):  # prefix 0 among 8 equally popular ones: one fair share
        p.choose(req(q % 8, q), fleet({}, {}))
    queued = {"w0": 3000}  # past one recompute (2,048 tokens), within two
    cands = [cand("w0", PREFIX, 2, queued["w0"])] + [cand(w) for w in WORKERS[1:]]
    assert base.choose(req(0, 99), cands).reason == "load_balance"
    d = p.choose(req(0, 99), cands)
    assert (d.worker_id, d.reason, d.predicted_cached_tokens) == ("w0", "prefix_hit", PREFIX)
    cands[0] = cand("w0", PREFIX, 2, 5000)  # past two recomputes: it goes, as kv_aware's would
    d = p.choose(req(0, 100), cands)
    assert (d.reason, d.predicted_cached_tokens) == ("load_balance", 0) and d.worker_id != "w0"


def test_a_holder_under_kv_pressure_is_left_as_kv_aware_leaves_it() -> None:
    p, base = policy(), plain()
    for q in range(64):
        p.choose(req(q % 8, q), fleet({}, {}))
    cands = [cand("w0", PREFIX, 2, 0, kv=0.94)] + [cand(w) for w in WORKERS[1:]]
    assert base.choose(req(0, 99), cands).reason == "kv_pressure"
    d = p.choose(req(0, 99), cands)  # (the idle workers tie: which one is rotation's choice)
    assert (d.reason, d.predicted_cached_tokens) == ("kv_pressure", 0) and d.worker_id != "w0"


def test_copies_are_not_pinned_once_demand_falls() -> None:
    """Prefix 0 is hot and gets a second holder; then other prefixes take the traffic: prefix
    0 asks for one holder again and its requests get kv_aware's choice, whatever it is."""
    p, base = policy(window_requests=32), plain()
    holders = {"w0": PREFIX}
    for q in range(40):
        d = p.choose(req(0, q), fleet(holders, {"w0": 10}))
        if d.reason == HOT_PREFIX:
            holders[d.worker_id] = PREFIX
    assert len(holders) >= 2
    for q in range(200):  # the traffic moves to cold prompts
        p.choose(req(5000 + q, q), fleet({}, {}))
    assert p.hot is not None
    key = p.hot.key(prompt(0, 0), PREFIX, None)
    assert p.hot.wanted_holders(key, 8) == 1
    for q in range(10):
        cands = fleet(holders, {"w0": 6, next(w for w in holders if w != "w0"): 6})
        assert p.choose(req(0, 1000 + q), cands) == base.choose(req(0, 1000 + q), cands)


# -- the rule alone, and the settings --------------------------------------------------------------


def test_the_rule_grows_onto_the_cheapest_eligible_non_holder() -> None:
    hot = HotPrefixes(HotPrefixSettings(enabled=True))
    ids = prompt(0, 0)
    options = [Option(PREFIX, 900.0), Option(0, 2300.0), Option(0, 2100.0),
               Option(0, 1000.0, over_hard_limit=True)]
    picks = []
    for _ in range(12):
        hot.count_request()
        picks.append(hot.choose(ids, None, options, 0, 1.0))
    assert picks.count((2, True)) == 1 and picks.count(None) == 11


def test_the_rule_leaves_a_holder_whose_wait_is_below_the_wait_fraction() -> None:
    """Holder cost 900 (its wait 836 over its own 64 tokens), non-holder 2300 = 2112 of its
    own prefill + 188 of load: the holder's extra wait 648 < 0.5 x 2048 of recompute."""
    hot = HotPrefixes(HotPrefixSettings(enabled=True, wait_fraction=0.5))
    options = [Option(PREFIX, 900.0), Option(0, 2300.0)]
    for _ in range(30):
        hot.count_request()
        assert hot.choose(prompt(0, 0), None, options, 0, 1.0) is None


def test_hot_prefixes_are_on_by_default_off_when_disabled_and_their_settings_are_bounded(
        ) -> None:
    assert KvAware().hot is not None
    assert plain().hot is None
    with pytest.raises(ValidationError):
        HotPrefixSettings(window_requests=4)
    with pytest.raises(ValidationError):
        HotPrefixSettings(wait_fraction=1.5)
    with pytest.raises(ValidationError):
        HotPrefixSettings(min_prefix_tokens=0)
    with pytest.raises(ValidationError):
        KvAwareSettings.model_validate({"hot_prefix": {"enabled": True, "spread": 2}})

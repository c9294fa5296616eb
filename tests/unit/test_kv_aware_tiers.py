"""kv_aware with lower KV tiers (issue 15, item 4): a prefix a worker holds only in its CPU tier
is priced at its reload time, never free and never a full miss; the router fills
``Candidate.lower_tier_cached_tokens`` from an index that keeps tiers."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from pydantic import ValidationError

from gateway.config import KvAwareSettings, PoolSettings
from gateway.kvindex.hashing import block_hashes
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import PrefixIndex
from gateway.planner import parse_profile
from gateway.routing.kv_aware import KvAware, reload_tokens_per_token
from gateway.routing.router import Router
from gateway.routing.types import Candidate, Decision, LoadSnapshot, Policy, RoutingRequest
from gateway.workers.registry import WorkerRegistry


def req(prompt: int = 4096) -> RoutingRequest:
    return RoutingRequest(model="m", prompt_tokens=prompt, max_tokens=16)


def cand(worker: str, cached: int = 0, lower: int = 0, inflight: int = 0) -> Candidate:
    return Candidate(worker, LoadSnapshot(inflight=inflight), cached,
                     lower_tier_cached_tokens=lower)


def test_lower_tier_tokens_cost_their_reload_weight_not_a_recompute() -> None:
    w = KvAwareSettings(cpu_reload_tokens_per_token=0.25, uncached_weight=2.0,
                        active_request_tokens=0.0)
    s = KvAware(w).score(req(1000), cand("a", cached=200, lower=600))
    # uncached × ((P − cached − lower) + reload × lower) = 2 × (200 + 0.25 × 600)
    assert s.cost == pytest.approx(2.0 * (200 + 150))
    assert s.cached == 800  # what vLLM reports cached: local plus loaded (v1/metrics/stats.py)


def test_lower_tier_tokens_are_capped_by_the_uncached_part_and_never_negative() -> None:
    policy = KvAware(KvAwareSettings(active_request_tokens=0.0))
    over = policy.score(req(1000), cand("a", cached=900, lower=5000))
    assert over.cached == 1000
    assert over.cost == pytest.approx(100 * 0.16)
    lying = policy.score(req(1000), cand("a", cached=100, lower=-500))
    assert (lying.cached, lying.cost) == (100, 900)


def test_cpu_tier_holder_beats_a_cold_worker_at_equal_load() -> None:
    d = KvAware().choose(req(), [cand("cold"), cand("cpu", lower=3584)])
    assert (d.worker_id, d.predicted_cached_tokens) == ("cpu", 3584)


def test_gpu_holder_beats_a_cpu_tier_holder_at_equal_load() -> None:
    d = KvAware().choose(req(), [cand("cpu", lower=3584), cand("gpu", cached=3584)])
    assert (d.worker_id, d.predicted_cached_tokens) == ("gpu", 3584)


def test_cpu_tier_holder_loses_when_its_reload_plus_load_costs_more_than_a_recompute() -> None:
    # reload 3584 × 0.16 ≈ 573 tokens + 64 × 60 requests ≫ a cold worker's 4096.
    d = KvAware().choose(req(), [cand("cpu", lower=3584, inflight=60), cand("cold")])
    assert d.worker_id == "cold"


@pytest.mark.parametrize("weight", [0.0, 1.0, -0.1, 1.5])
def test_reload_weight_is_never_free_and_never_a_full_miss(weight: float) -> None:
    with pytest.raises(ValidationError):
        KvAwareSettings(cpu_reload_tokens_per_token=weight)


def test_default_reload_weight_is_llama_3_8b_on_an_h100_over_25_gb_per_s() -> None:
    model, gpu = parse_profile("llama-3-8b@h100")
    # 131,072 KV bytes per token / 25e9 B/s over 1 / (989.5e12 × 0.5 / (2 × 8.03e9)) s
    assert model.kv_bytes_per_token() == 131_072
    weight = reload_tokens_per_token(model, gpu, 25e9)
    assert weight == pytest.approx(KvAwareSettings().cpu_reload_tokens_per_token, abs=0.005)
    assert reload_tokens_per_token(model, gpu, 50e9) == pytest.approx(weight / 2)
    big, _ = parse_profile("llama-3-70b@h100")  # more KV per token, far slower prefill
    assert reload_tokens_per_token(big, gpu, 25e9) == pytest.approx(0.046, abs=0.002)
    with pytest.raises(ValueError):
        reload_tokens_per_token(model, gpu, 0.0)


class Recording:
    """kv_aware itself, remembering what it was offered."""

    name = "kv_aware"

    def __init__(self) -> None:
        self.policy = KvAware()
        self.offered: list[Candidate] = []

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        self.offered = list(candidates)
        return self.policy.choose(request, candidates)


def test_router_fills_lower_tier_tokens_from_a_tiered_index_and_routes_to_the_cpu_holder(
) -> None:
    pool = PoolSettings.model_validate({"name": "p", "max_context_tokens": 8192,
                                        "workers": ["http://a", "http://b"]})
    registry = WorkerRegistry([pool])
    for w in registry:
        w.healthy = True
    blocks = BlockIndex()
    index = PrefixIndex(blocks)
    policy = Recording()
    policies: dict[str, Policy] = {"p": policy}
    router = Router([pool], registry, policies, spill=False, prefix_index=index)
    tokens = tuple(range(1, 1026))  # 64 full blocks of 16, then one token
    blocks.apply_stored_lower("http://b", "CPU", block_hashes(tokens, 16))
    route = router.route(RoutingRequest(model="m", prompt_tokens=len(tokens), max_tokens=8,
                                        token_ids=tokens))
    offered = {c.worker_id: (c.cached_tokens, c.lower_tier_cached_tokens)
               for c in policy.offered}
    assert offered == {"http://a": (0, 0), "http://b": (0, 1024)}
    assert route.worker.url == "http://b"
    assert route.decision.predicted_cached_tokens == 1024

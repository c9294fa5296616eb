"""``kv_aware``: send each request where its first token is expected soonest.

The cost of candidate ``w`` for a request of ``P`` prompt tokens, in prefill-token equivalents
(one unit ≈ the time to prefill one prompt token on that worker):

    cost(w) = uncached_weight        × (P − cached(w))                  # own prefill still to do
            + queued_prefill_weight  × max(queued(w) − pending(w), 0)    # prefill queued ahead
            + active_request_tokens  × max(inflight(w), running(w) + waiting(w))  # decode load
            + kv_pressure_weight     × P × ramp(kv_usage(w))            # risk of preemption

    queued(w): prefill the gateway has in flight on w (uncached prompt tokens of requests that have
    not produced their first token). pending(w): the part of our cached prefix on w that those
    requests are still computing (speculative index entries, or learned ones routed in the last
    few seconds). That is shared work, not a queue: following a burst of same-prefix requests onto
    their worker costs the wait for that prefill, which an idle worker would have to redo anyway.
    Charging it as a queue scattered such bursts over idle workers (16 simulated workers, shared
    2K-token prefixes: 56 ``load_balance`` decisions, hit rate 91% against a ceiling of 94%).

    ramp(u) = clamp((u − kv_soft_limit) / (kv_hard_limit − kv_soft_limit), 0, 1)

    Lower KV tiers (issue 15, item 4): ``cached(w)`` is the prefix w holds on the GPU; past it,
    ``lower(w)`` tokens that w holds only in a lower tier (vLLM's CPU offload,
    ``--kv-offloading-size``; ``Candidate.lower_tier_cached_tokens``) are reloaded over the host
    link instead of recomputed, so the first term becomes

        uncached_weight × ((P − cached(w) − lower(w)) + cpu_reload_tokens_per_token × lower(w))

    A reloaded token costs its KV bytes over the link; a recomputed one, its share of the
    prefill. In prefill-token units:

        cpu_reload_tokens_per_token = (kv_bytes_per_token / link_bytes_per_s)
                                      / (1 / prefill_tokens_per_s)
                                    = kv_bytes_per_token × prefill_tokens_per_s / link_bytes_per_s

    (``reload_tokens_per_token``, from ``gateway.kvmath`` and the planner's GPU presets;
    tensor parallelism divides both sides alike). Llama-3-8B (128 KiB per token, bf16) on an
    H100 (989.5 dense TFLOP/s at 0.5 utilisation: ≈ 30,800 prefill tokens/s) over 25 GB/s
    (PCIe Gen4 x16, or Gen5 at half its peak): 131,072 × 30,800 / 25e9 ≈ 0.16, the default.
    Llama-3-70B on the same: ≈ 0.046; Qwen2.5-7B (GQA 7:1, 56 KiB): ≈ 0.075. The setting is
    bounded to (0, 1): a lower-tier hit is never free (a GPU hit must beat it) and never as dear
    as a miss (a cold worker must lose to it at equal load). The reload is charged to the
    request alone, as vLLM loads a request's blocks before its prefill while others step on.
    What a candidate has cached (``CandidateCost.cached``, the decision's
    ``predicted_cached_tokens``, the reasons below) counts the lower tier's tokens too: vLLM
    reports reloaded tokens as cached (``usage.prompt_tokens_details.cached_tokens`` = local +
    external, ``v1/metrics/stats.py``).

Candidates at or above ``kv_hard_limit`` KV usage are left out unless every candidate is; the
cheapest of the rest wins. Costs within ``tie_tolerance_tokens`` of the best are ties: the fewest
in-flight requests wins, then the session's rendezvous hash (the same session keeps the same worker
while the candidate set holds, and only 1/N of sessions move when it changes), else rotation.
Keeping a conversation on its worker beyond ties is ``pools[].affinity`` (``affinity.py``).

The weights are set per pool (``pools[].kv_aware`` in the config, ``KvAwareSettings``); the
defaults and why:

- ``uncached_weight = 1``, ``queued_prefill_weight = 1``: prefill is compute-bound and roughly
  linear in tokens, so a token of our own prefill and a token of prefill queued ahead of us cost
  the same. This is Dynamo's ``max(active_prefill + new_prompt − overlap, 0)`` term. It assumes
  ``inflight_prompt_tokens`` counts prefill still to do (uncached tokens of requests that have not
  produced their first token); if it counts whole prompts of every open request, most of those are
  decoding or were cache hits, and the weight must drop (≈ 0.25) or a prefix holder busy with its
  own burst loses to an idle worker.
- ``active_request_tokens = 64``: a running request costs each engine step one token of the batch
  budget plus a read of its KV, slowing everyone's prefill chunks a little; 64 makes 16 extra open
  requests weigh as much as a 1K-token prefill, so a 4K-token cached prefix keeps attracting its
  requests until its holder has about 64 more requests open than the idlest worker. SGLang's gate
  switches to shortest-queue at a difference of 64 requests (and 1.5× ratio); Dynamo charges every
  active KV block, a much stronger pull towards balance that we do not have the data for (KV
  usage per worker is only a ratio here).
- ``kv_pressure_weight = 1`` between ``kv_soft_limit = 0.80`` and ``kv_hard_limit = 0.95``: as a
  worker's cache fills, admitting the prompt risks preempting (and recomputing) running requests
  and evicting the very prefix we came for; at 0.95 the penalty equals the whole prompt, so no
  cache hit can pay for it, and above it the worker is avoided. llm-d scores KV utilisation with
  weight 2 against prefix 3 and queue 2 (normalised scores); we keep the units in tokens so the
  terms compare on TTFT rather than on arbitrary scales.

Reasons (the ``reason`` metric label):

- ``prefix_hit``: the chosen worker holds the longest cached prefix among the candidates and some
  candidate holds less, i.e. the cache discriminated and the holder won.
- ``least_loaded``: every candidate holds the same cached prefix (usually none): load decided.
- ``kv_pressure``: a worker holding a longer prefix was passed over because its KV cache is above
  the hard limit, or because the KV-pressure term alone made it lose.
- ``load_balance``: a worker holding a longer prefix was passed over for its queued prefill or
  decode load.
- ``hot_prefix``: a holder grown on purpose: the prefix's demand exceeds its holders' fair
  shares of the pool and its holder is busy (``pools[].kv_aware.hot_prefix``, on by default;
  ``gateway/routing/hot.py``). Later requests of the prefix find it on both and go to the less
  loaded. With it on, a request that the rule keeps on a holder through a transient queue is a
  ``prefix_hit``.

Cost: O(candidates) arithmetic per decision (≈ 1 µs per candidate), plus one BLAKE2b per tied
candidate when a session breaks a tie. No I/O, no locks; the rotation counter is the only state.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from gateway.config import KvAwareSettings, PolicyName
from gateway.kvmath import ModelArch
from gateway.planner import GpuSpec, prefill_time_s
from gateway.routing.affinity import rendezvous_score
from gateway.routing.hot import HOT_PREFIX, HotPrefixes
from gateway.routing.types import Candidate, Decision, RoutingRequest

PREFIX_HIT = "prefix_hit"
LEAST_LOADED = "least_loaded"
KV_PRESSURE = "kv_pressure"
LOAD_BALANCE = "load_balance"
REASONS = (PREFIX_HIT, LEAST_LOADED, KV_PRESSURE, LOAD_BALANCE, HOT_PREFIX)


@dataclass(frozen=True, init=False)
class CandidateCost:
    index: int
    candidate: Candidate
    cached: int
    cost: float
    kv_cost: float
    over_hard_limit: bool

    def __init__(
        self, index: int, candidate: Candidate, cached: int, cost: float, kv_cost: float,
        over_hard_limit: bool,
    ) -> None:
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "candidate", candidate)
        object.__setattr__(self, "cached", cached)
        object.__setattr__(self, "cost", cost)
        object.__setattr__(self, "kv_cost", kv_cost)
        object.__setattr__(self, "over_hard_limit", over_hard_limit)


class KvAware:
    """Lowest estimated time to first token; see the module docstring."""

    name: Final = PolicyName.KV_AWARE  # a class constant also when compiled (gateway.native)

    def __init__(self, weights: KvAwareSettings | None = None) -> None:
        self.weights = weights if weights is not None else KvAwareSettings()
        self._counter = itertools.count()
        # Hot prefixes (``gateway.routing.hot``): None unless ``hot_prefix.enabled``.
        hot = self.weights.hot_prefix
        self.hot = HotPrefixes(hot) if hot.enabled else None

    def score(self, request: RoutingRequest, candidate: Candidate, index: int = 0) -> CandidateCost:
        w = self.weights
        load = candidate.load
        prompt = max(request.prompt_tokens, len(request.token_ids), 0)
        cached = min(max(candidate.cached_tokens, 0), prompt)
        lower = min(max(candidate.lower_tier_cached_tokens, 0), prompt - cached)
        active = max(load.inflight, load.running + load.waiting)
        span = w.kv_hard_limit - w.kv_soft_limit
        ramp = min(max((load.kv_usage_ratio - w.kv_soft_limit) / span, 0.0), 1.0)
        kv_cost = w.kv_pressure_weight * prompt * ramp
        cost = (
            w.uncached_weight * (prompt - cached - lower + w.cpu_reload_tokens_per_token * lower)
            + w.queued_prefill_weight
            * max(load.inflight_prompt_tokens - max(candidate.pending_cached_tokens, 0), 0)
            + w.active_request_tokens * active
            + kv_cost
        )
        return CandidateCost(  # cached: what vLLM will report cached, a lower tier's included
            index, candidate, cached + lower, cost, kv_cost, load.kv_usage_ratio >= w.kv_hard_limit
        )

    def cost(self, request: RoutingRequest, candidate: Candidate) -> float:
        """``candidate``'s cost for ``request``; infinite at or above ``kv_hard_limit`` (what
        session affinity compares: ``gateway.routing.affinity``)."""
        s = self.score(request, candidate)
        return math.inf if s.over_hard_limit else s.cost

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        scored = [self.score(request, c, i) for i, c in enumerate(candidates)]
        eligible = [s for s in scored if not s.over_hard_limit] or scored
        best_cost = min(s.cost for s in eligible)
        tol = self.weights.tie_tolerance_tokens
        tied = [s for s in eligible if s.cost <= best_cost + tol]
        chosen = self._break_tie(request, tied) if len(tied) > 1 else tied[0]
        hot = self.hot
        if hot is not None:
            hot.count_request()
            if request.token_ids:
                moved = hot.choose(request.token_ids, (request.adapter, request.cache_salt),
                                   scored, chosen.index, self.weights.uncached_weight)
                if moved is not None:
                    g = scored[moved[0]]
                    return Decision(g.candidate.worker_id, HOT_PREFIX if moved[1] else PREFIX_HIT,
                                    g.cached)
        return Decision(
            chosen.candidate.worker_id,
            self._reason(chosen, scored),
            chosen.cached,
        )

    def _break_tie(self, request: RoutingRequest, tied: list[CandidateCost]) -> CandidateCost:
        fewest = min(s.candidate.load.inflight for s in tied)
        tied = [s for s in tied if s.candidate.load.inflight == fewest]
        if len(tied) == 1:
            return tied[0]
        key = request.session_key
        if key is not None:
            return max(tied, key=lambda s: rendezvous_score(key, s.candidate.worker_id))
        return tied[next(self._counter) % len(tied)]

    def _reason(self, chosen: CandidateCost, scored: list[CandidateCost]) -> str:
        most = max(s.cached for s in scored)
        if all(s.cached == most for s in scored):
            return LEAST_LOADED
        if chosen.cached >= most:
            return PREFIX_HIT
        holder = min((s for s in scored if s.cached == most), key=lambda s: s.cost)
        if holder.over_hard_limit:
            return KV_PRESSURE
        if holder.cost - holder.kv_cost <= chosen.cost + self.weights.tie_tolerance_tokens:
            return KV_PRESSURE
        return LOAD_BALANCE


def reload_tokens_per_token(
    model: ModelArch, gpu: GpuSpec, link_bytes_per_s: float, *, utilisation: float = 0.5,
    kv_dtype: str = "auto",
) -> float:
    """What reloading one token's KV from a lower tier costs, in tokens of prefill on ``gpu``:
    ``kv_bytes_per_token / link_bytes_per_s`` over ``planner.prefill_time_s`` of one token
    (the module docstring's arithmetic; ``cpu_reload_tokens_per_token`` is its setting)."""
    if not link_bytes_per_s > 0:
        raise ValueError(f"link_bytes_per_s must be > 0, got {link_bytes_per_s}")
    reload_s = model.kv_bytes_per_token(kv_dtype) / link_bytes_per_s
    return reload_s / prefill_time_s(model, gpu, 1, utilisation)

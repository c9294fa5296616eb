"""Hot prefixes (issue 15, item 2): the holders of a prefix follow its demand. A prefix that
asks for more than its holders can serve gets another holder deliberately; one whose holders
cover it is not copied for a transient queue.

The problem, measured (``python -m gateway.bench.routers --scenario zipf_hot``: 64 system
prompts of 3K tokens, Zipf popularity, 8 simulated H100s near saturation). ``kv_aware`` leaves a
prefix's holder as soon as its wait exceeds one recompute elsewhere (``load_balance``). Judged
one request at a time that is right; for the fleet it is not: every such copy is a 3K-token
prefill added to a busy fleet, the queues it creates trigger more copies, and kvgate ended 12
points below the hit-rate ceiling the Rust routers reached, with TTFT p50 twice theirs. Yet for
the head of a Zipf workload one holder really is not enough: a second copy paid once serves every
later request. So the number of holders is decided by the prefix's demand, not by one queue.

The rule, per decision of a ``kv_aware`` pool (``pools[].kv_aware.hot_prefix``):

1. The prefix is the longest one any candidate holds, ``L`` tokens (``L`` below
   ``min_prefix_tokens``: a short prefix is cheap to recompute, nothing happens). Its key is a
   hash of ``L``, the adapter and cache salt, and the last 16 tokens before ``L`` (the holders'
   deepest common block; a different prompt with the same 16 tokens at the same depth only
   merges two prefixes' demand, it never sends a request where its own prefix is not cached).
2. Demand is a share of the pool's traffic, exponentially decayed over its last
   ``window_requests`` requests: each request multiplies every count by ``d = 1 - 1/window`` (done
   lazily: a key's count is brought up to date only when its prefix is seen) and adds 1 to its
   own key's. ``share = count / total`` (``total = (1 - d^n) / (1 - d)`` after ``n`` requests),
   and ``need = share x candidates``: how many workers' fair shares the prefix asks for. Decay per
   request rather than per second makes the measure independent of the time scale (a simulator
   run 8x slow, a busy or an idle hour). The prefix is *under-replicated* when it has at least
   ``MIN_REQUESTS`` (decayed) recent requests and ``need > holders x (1 + headroom)``.
3. Grow: when ``kv_aware`` chose a holder, the prefix is under-replicated, it was not grown in
   the pool's last ``COOLDOWN_REQUESTS`` requests (the index shows a new holder at once, as
   pending; this only bounds a lagging index), and the holder is busy (its wait beyond the
   cheapest non-holder's is at least ``wait_fraction`` of the recompute there: an idle holder
   serves it alone), the request goes to the cheapest non-holder below ``kv_hard_limit``,
   reason ``hot_prefix``.
4. Hold: when ``kv_aware`` left the holders for load and the prefix is *not* under-replicated,
   the best holder keeps the request unless its cost exceeds the alternative's by more than
   ``hold_margin`` recomputes of the prefix (reason ``prefix_hit``: the holder won); ``kv_aware``
   leaves at 0. A departure for KV pressure (the holder's KV term decided) is never held, nor
   one of an under-replicated prefix (that copy is wanted).
5. Spreading needs nothing more: once two workers hold the prefix (pending at first), both have
   it cached and ``kv_aware``'s cost sends each request to the less loaded one. When demand
   falls, nothing keeps the copies: growth stops, and a copy no request picks is evicted by
   vLLM's LRU like any block.

What it does not change: a request whose longest cached prefix is short or cold, or whose holder
``kv_aware`` keeps anyway and either covers the demand or is idle: the decision is
``kv_aware``'s, exactly (unit-tested on random load states; ``hold_margin: 0`` gives
``kv_aware``'s decisions for every prefix its holders cover). It does not model seconds: a
holder's capacity is its fair share of the pool's current traffic, so growth needs both the
share and a busy holder. Holding trades a longer wait at the holder (up to ``hold_margin``
recomputes) for the prefill a copy would add to the fleet.

Cost: every request, one integer increment. A request with a cached prefix of at least
``min_prefix_tokens``: one hash of a 16-tuple, one dict lookup with a move-to-end, one ``pow``
and one pass over the candidates. Measured (``kv_aware.choose``, 8 candidates, best of 5
alternating runs of 20,000): a short cold chat 23.8 -> 24.1 µs (+0.35), a 3K-token cached
prefix 24.5 -> 27.4 µs (+2.9). Memory: at most ``max_prefixes`` keys (LRU), ≈ 220 B each
(tracemalloc): 220 KB at the default 1,024.

Compared to: SGLang's and vLLM's routers have no notion of demand: a prefix stays on its tree's
worker until a load-imbalance gate trips (a 64-request gap and 1.5x), then goes to the shortest
queue, uncached (sticky, so near the ceiling, but one worker carries the head: load max/mean 2.35
in the scenario); llm-d and Dynamo score prefix and load each request alone, as ``kv_aware``
without this module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.config import HotPrefixSettings

HOT_PREFIX = "hot_prefix"
"""The reason of a decision that grew a holder (``kvgate_routing_decisions_total{reason}``)."""

KEY_TOKENS = 16
"""Tokens before the prefix's end hashed into its key (one block at vLLM's default size)."""
MIN_REQUESTS = 8.0
"""Decayed recent requests a prefix needs before its share is believed (8 of the first 8
requests of a pool are not a hot prefix)."""
COOLDOWN_REQUESTS = 16
"""Pool requests between two growths of one prefix."""


class Scored(Protocol):
    """One candidate as the rule sees it (``kv_aware.CandidateCost`` is one): the tokens of the
    prompt it holds, its ``kv_aware`` cost, and whether it is at or above ``kv_hard_limit``."""

    @property
    def cached(self) -> int: ...
    @property
    def cost(self) -> float: ...
    @property
    def kv_cost(self) -> float: ...
    @property
    def over_hard_limit(self) -> bool: ...


@dataclass(frozen=True)
class Option:
    """A ``Scored`` of plain values."""

    cached: int
    cost: float
    over_hard_limit: bool = False
    kv_cost: float = 0.0


@dataclass(slots=True)
class _Demand:
    count: float  # decayed requests of this prefix, as of request number ``at``
    at: int
    grown_at: int  # the pool's request number at the last growth (-COOLDOWN: never)


class HotPrefixes:
    """Demand per hot prefix of one pool and the growth rule; see the module docstring."""

    def __init__(self, settings: HotPrefixSettings) -> None:
        self.settings = settings
        self._decay = 1.0 - 1.0 / settings.window_requests
        self._n = 0  # requests of the pool seen (every decision)
        self._demand: OrderedDict[int, _Demand] = OrderedDict()

    def __len__(self) -> int:
        return len(self._demand)

    def count_request(self) -> None:
        """One more request of the pool (every decision, cached or not)."""
        self._n += 1

    def key(self, token_ids: Sequence[int], prefix_tokens: int, chain: Hashable) -> int:
        """The key of the prompt's first ``prefix_tokens`` tokens (module docstring, step 1);
        ``chain``: what else keys its blocks (the request's adapter and cache salt)."""
        start = max(prefix_tokens - KEY_TOKENS, 0)
        return hash((prefix_tokens, chain, tuple(token_ids[start:prefix_tokens])))

    def observe(self, key: int) -> float:
        """Count one request of prefix ``key``; its decayed count of recent requests."""
        d = self._demand.get(key)
        n = self._n
        if d is None:
            d = self._demand[key] = _Demand(0.0, n, -COOLDOWN_REQUESTS)
            if len(self._demand) > self.settings.max_prefixes:
                self._demand.popitem(last=False)
        else:
            self._demand.move_to_end(key)
            if n != d.at:
                d.count *= self._decay ** (n - d.at)
        d.count += 1.0
        d.at = n
        return d.count

    def share(self, key: int) -> float:
        """The prefix's decayed share of the pool's recent requests (0 for an unknown key)."""
        d = self._demand.get(key)
        if d is None or self._n == 0:
            return 0.0
        decay = self._decay
        total = (1.0 - decay ** self._n) / (1.0 - decay)
        return d.count * decay ** (self._n - d.at) / total

    def wanted_holders(self, key: int, candidates: int) -> int:
        """The holders the prefix's demand asks for: ``ceil(need / (1 + headroom))``, at least
        one (what ``choose`` grows towards; 1 once demand has fallen)."""
        need = self.share(key) * candidates
        h = self.settings.headroom
        whole = int(need / (1.0 + h))
        return max(1, whole + (1 if need > whole * (1.0 + h) else 0))

    def choose(self, token_ids: Sequence[int], chain: Hashable, options: Sequence[Scored],
               chosen: int, uncached_weight: float) -> tuple[int, bool] | None:
        """Where the request goes instead of ``chosen`` (``kv_aware``'s choice), as (index into
        ``options``, True when that grows a new holder / False when it keeps the prefix on a
        holder), or None: ``chosen`` stands. Counts the request's demand as a side effect; call
        ``count_request`` first."""
        most = max(o.cached for o in options)
        s = self.settings
        if most < s.min_prefix_tokens:
            return None
        key = self.key(token_ids, most, chain)
        count = self.observe(key)
        holders = 0
        best_h: Scored | None = None
        best_n: Scored | None = None
        h_index = n_index = -1
        for i, o in enumerate(options):
            if o.cached >= most:
                holders += 1
                if not o.over_hard_limit and (best_h is None or o.cost < best_h.cost):
                    best_h, h_index = o, i
            elif not o.over_hard_limit and (best_n is None or o.cost < best_n.cost):
                best_n, n_index = o, i
        if best_h is None or best_n is None:
            return None  # every candidate holds it, or no holder can take it (kv_pressure)
        under = (count >= MIN_REQUESTS
                 and self.share(key) * len(options) > holders * (1.0 + s.headroom))
        picked = options[chosen]
        if picked.cached >= most:  # kv_aware stays with a holder: grow one more?
            d = self._demand[key]
            if not under or self._n - d.grown_at < COOLDOWN_REQUESTS:
                return None
            recompute = uncached_weight * (most - best_n.cached)
            if best_n.cost - best_h.cost > (1.0 - s.wait_fraction) * recompute:
                return None  # the holder is not busy enough to be worth a second copy
            d.grown_at = self._n
            return n_index, True
        # kv_aware leaves the holders for load (or KV pressure): a new copy the prefix's demand
        # does not ask for is kept from it until the wait beats the recompute by hold_margin.
        if under or best_h.cost - best_h.kv_cost <= picked.cost:
            return None  # a holder is wanted anyway / the KV-pressure term decided
        recompute = uncached_weight * (most - picked.cached)
        if best_h.cost > picked.cost + s.hold_margin * recompute:
            return None
        return h_index, False

"""Hit accounting: where every prompt token of a routed request went, and why a hit was lost.

For each routed request three numbers are known or learned:

    F  fleet best: the longest cached prefix, in tokens, that any healthy worker of the request's
       pool holds as the index predicts at routing time (the chosen worker's candidates plus
       workers held back at ``max_inflight_per_worker``); already limited as vLLM limits a hit
       (full blocks only, never the last prompt token);
    Pr predicted: what the index predicted at the worker chosen (``Decision.predicted_cached_tokens``);
    D  delivered: ``usage.prompt_tokens_details.cached_tokens``, what vLLM actually served from
       its prefix cache (vLLM with ``--enable-prompt-tokens-details``, the simulator with
       ``enable_prompt_tokens_details``); None when the answer carries no such number.

Every one of the ``P`` prompt tokens (the gateway's count) lands in exactly one outcome:

    ceiling C   = max(F, Pr, D)            what the best choice could have got, as far as we know
    delivered   = D
    never_seen  = P − C                    no worker holds it (incl. the tail vLLM never serves
                                           from cache: a partial last block, the last token)
    choice loss = C − max(Pr, D)           a holder of more was passed over:
                   -> kv_pressure          when the decision's reason is ``kv_pressure``
                   -> load                 any other reason (load_balance, least_loaded with a
                                           holder at its in-flight cap, spill, round_robin,
                                           affinity, slo ...): the policy weighed something
                                           else (load, or a latency objective)
    shortfall   = max(Pr − D, 0)           the chosen worker delivered less than predicted:
                   -> evicted              when an event removed the first block vLLM did not
                                           serve between routing and the answer (the chain
                                           breaks there: the whole shortfall; the index's
                                           removal log, ``HitRecord.eviction_probe``)
                   -> mismatch             the rest, while the model is flagged (below)
                   -> stale_index          the rest otherwise

so ``delivered + never_seen + losses == P`` and the loss buckets (load, kv_pressure, stale_index,
evicted, mismatch) sum to exactly ``C − D``. ``D > F`` (vLLM held more than the index knew, e.g.
approximate mode or events not yet arrived) raises the ceiling to D: no loss, and nothing is
invented. When D is unknown (a worker without ``--enable-prompt-tokens-details``, a client that
left, an error), the part that depends on it is the outcome ``unknown``: never_seen = P − F,
the choice loss F − Pr still counts, and ``unknown`` = Pr; nothing is guessed as delivered.

What can and cannot be told apart. ``load`` and ``kv_pressure`` are certain: they come from the
decision itself. ``stale_index`` is "predicted, not delivered" at the chosen worker: a block the
index still listed after vLLM dropped it (a missed event, ``reset_prefix_cache``, a restart),
or a prefix still being prefilled by another request in flight (``pending`` in the explanation).
``evicted`` needs to know which blocks were removed after routing: the ``BlockIndex`` numbers
the removals its workers' events make and logs the last blocks removed (``removal_mark`` /
``removed_since``); a worker without events, or a removal older than the log reaches, leaves
the shortfall ``stale_index``. An event that arrives after the answer is settled (vLLM
publishes per engine step) is missed the same way. ``mismatch`` is the silent 0% hit
rate: for a whole model, the index predicts hits that vLLM never delivers. The gateway's prompt
shares prefixes that the server's does not (its chat template or tokenizer differs from the
server's, e.g. the server's template puts per-request text first; routing history then predicts
hits the server cannot have), or the server runs with prefix caching off. It cannot be seen in
one request, only over a window: ``MismatchDetector`` flags a model when, over its last
``window`` answers that predicted at least one token, vLLM delivered less than ``flag_below``
of what was predicted (and clears it above ``clear_above``; defaults: 64 answers, 16 at least,
10% and 50%), with one warning log line and a gauge. While flagged, shortfalls are
``mismatch``, not ``stale_index``. (KV events whose block hashes differ from the gateway's, a
hash seed or block size mismatch, do the opposite: the index under-predicts, vLLM delivers more
than predicted, and no token is lost to the accounting; only the routing is blind.)

Accounted: one-step chat and completions requests of one prompt (the gateway asks vLLM for the
usage of every stream, so a stream without ``include_usage`` is accounted too). Not accounted:
a disaggregated two-step request, a batch of prompts, Responses, pooling.

Cost per request, measured with ``time.process_time`` over 20,000 requests on the shared 2-core
box (load average 7-15, so an upper bound): ≈ 6-8 µs of CPU in all, of which ≈ 2 µs are the
three or four Prometheus counter increments, ≈ 2.5 µs ``settle`` (usage read, detector,
buckets, totals), ≈ 0.5 µs the record and its ring slot, ≈ 0.4 µs the router's candidates tuple
and fleet best, ≈ 0.2 µs the request id. The record is made at routing (a retry moves it);
``settle`` and its counters run off the request path, a moment after the request ended
(``gateway.backlog``), and the ledger's readers (``Dispatcher.hits``) flush that backlog first. The ring keeps the last ``capacity`` requests
(``routing.explain_requests``) with their candidates' snapshots, never their token ids.
Compared with Dynamo's and llm-d's hit-rate metrics (a ratio per worker), this says where each
lost token went; the price is one record per request held for ``capacity`` requests.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import islice
from operator import add
from typing import Any, Final, NamedTuple

from gateway.config import PoolSettings
from gateway.routing.types import Candidate

log = logging.getLogger(__name__)

DELIVERED: Final = "delivered"
NEVER_SEEN: Final = "never_seen"
LOAD: Final = "load"
KV_PRESSURE: Final = "kv_pressure"
STALE_INDEX: Final = "stale_index"
EVICTED: Final = "evicted"
MISMATCH: Final = "mismatch"
UNKNOWN: Final = "unknown"
OUTCOMES: Final = (DELIVERED, NEVER_SEEN, LOAD, KV_PRESSURE, STALE_INDEX, EVICTED, MISMATCH,
                   UNKNOWN)
"""Every outcome of a prompt token (the ``outcome`` label of ``kvgate_prefix_tokens_total``)."""
LOSSES: Final = (LOAD, KV_PRESSURE, STALE_INDEX, EVICTED, MISMATCH)
"""The outcomes that sum to ceiling minus delivered."""

DEFAULT_EXPLAIN_REQUESTS: Final = 4096


class HitBuckets(NamedTuple):
    """Where a request's prompt tokens went; the outcomes sum to ``prompt_tokens``. (A named
    tuple: a frozen dataclass of nine fields took ~1 µs per request to build.)"""

    prompt_tokens: int
    delivered: int = 0
    never_seen: int = 0
    load: int = 0
    kv_pressure: int = 0
    stale_index: int = 0
    evicted: int = 0
    mismatch: int = 0
    unknown: int = 0

    @property
    def ceiling_tokens(self) -> int:
        """The most the best worker could have served, as far as index and vLLM tell."""
        return self.prompt_tokens - self.never_seen

    @property
    def lost_tokens(self) -> int:
        return self.load + self.kv_pressure + self.stale_index + self.evicted + self.mismatch

    def items(self) -> Iterator[tuple[str, int]]:
        """(outcome, tokens) for every outcome, in ``OUTCOMES`` order."""
        return zip(OUTCOMES, self[1:], strict=True)


def account(prompt_tokens: int, fleet_best_tokens: int, predicted_tokens: int,
            delivered_tokens: int | None, reason: str, *, evicted_tokens: int = 0,
            mismatch: bool = False) -> HitBuckets:
    """The buckets of one request (see the module docstring). Inputs are clamped into range
    (a negative or oversized number from a worker cannot break the sum): every count to
    ``[0, prompt_tokens]``, the fleet best to at least the prediction."""
    # Conditionals rather than min()/max(): this runs once per request.
    p = prompt_tokens if prompt_tokens > 0 else 0
    pr = predicted_tokens if predicted_tokens > 0 else 0
    pr = pr if pr < p else p
    f = fleet_best_tokens if fleet_best_tokens > pr else pr
    f = f if f < p else p
    kv = reason == KV_PRESSURE
    if delivered_tokens is None:
        choice = f - pr
        return HitBuckets(p, 0, p - f, 0 if kv else choice, choice if kv else 0, 0, 0, 0, pr)
    d = delivered_tokens if delivered_tokens > 0 else 0
    d = d if d < p else p
    ceiling = f if f > d else d
    choice = ceiling - (pr if pr > d else d)
    shortfall = pr - d if pr > d else 0
    evicted = evicted_tokens if evicted_tokens > 0 else 0
    evicted = evicted if evicted < shortfall else shortfall
    rest = shortfall - evicted
    return HitBuckets(p, d, p - ceiling, 0 if kv else choice, choice if kv else 0,
                      0 if mismatch else rest, evicted, rest if mismatch else 0, 0)


def delivered_from(usage: Any) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when the worker reported an integer, else
    None (vLLM without ``--enable-prompt-tokens-details`` writes null or nothing). ``usage`` is
    parsed JSON, so its objects are dicts (``isinstance`` against ``Mapping``, an ABC, costs
    ~0.4 µs a check, against ~0.05 µs for ``dict``)."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None


class MismatchDetector:
    """Per model: over the last ``window`` answers that predicted at least ``min_predicted_tokens``
    cached tokens, the delivered sum against the predicted sum. Flagged below ``flag_below`` once
    ``min_samples`` answers are in, cleared above ``clear_above`` (hysteresis: no flapping)."""

    def __init__(self, *, window: int = 64, min_samples: int = 16, flag_below: float = 0.1,
                 clear_above: float = 0.5, min_predicted_tokens: int = 1,
                 on_change: Callable[[str, bool], None] | None = None) -> None:
        self.window, self.min_samples = window, min_samples
        self.flag_below, self.clear_above = flag_below, clear_above
        self.min_predicted_tokens = min_predicted_tokens
        self._on_change = on_change
        self._samples: dict[str, deque[tuple[int, int]]] = {}
        self._sums: dict[str, list[int]] = {}  # model -> [predicted, delivered]
        self.flagged: set[str] = set()

    def observe(self, model: str, predicted_tokens: int, delivered_tokens: int) -> bool:
        """Add one answer; whether ``model`` is flagged now."""
        if predicted_tokens < self.min_predicted_tokens:
            return model in self.flagged
        samples = self._samples.get(model)
        if samples is None:
            samples = self._samples[model] = deque()
            self._sums[model] = [0, 0]
        sums = self._sums[model]
        delivered = min(max(delivered_tokens, 0), predicted_tokens)
        samples.append((predicted_tokens, delivered))
        sums[0] += predicted_tokens
        sums[1] += delivered
        if len(samples) > self.window:
            old_p, old_d = samples.popleft()
            sums[0] -= old_p
            sums[1] -= old_d
        if len(samples) < self.min_samples:
            return model in self.flagged
        ratio = sums[1] / sums[0]
        if model not in self.flagged and ratio < self.flag_below:
            self.flagged.add(model)
            log.warning(
                "prefix cache mismatch for model %s: vLLM served %.1f%% of the %d cached tokens"
                " the index predicted over its last %d answers; the gateway's tokenizer or chat"
                " template probably differs from the server's (models[].tokenizer,"
                " models[].chat_template), so no prompt of this model can hit (or the server"
                " runs with prefix caching off)",
                model, 100 * ratio, sums[0], len(samples))
            self._changed(model, True)
        elif model in self.flagged and ratio >= self.clear_above:
            self.flagged.discard(model)
            log.info("prefix cache mismatch for model %s cleared: vLLM serves %.1f%% of the"
                     " predicted cached tokens", model, 100 * ratio)
            self._changed(model, False)
        return model in self.flagged

    def ratio(self, model: str) -> float | None:
        """Delivered over predicted in the model's window; None before any sample."""
        sums = self._sums.get(model)
        return None if sums is None or sums[0] == 0 else sums[1] / sums[0]

    def _changed(self, model: str, flagged: bool) -> None:
        if self._on_change is not None:
            self._on_change(model, flagged)


@dataclass(slots=True, init=False)
class HitRecord:
    """One routed request, as explained by ``GET /admin/routing/explain``. Set at routing
    (and again if the request moves to another worker), completed when it ends."""

    request_id: str
    model: str
    pool: PoolSettings
    policy: str
    reason: str
    worker: str
    prompt_tokens: int
    fleet_best_tokens: int
    predicted_tokens: int
    candidates: tuple[Candidate, ...]
    held_back: tuple[tuple[str, int], ...]  # (worker, cached tokens) at their in-flight cap
    routed_at_s: float  # wall clock
    moves: int = 0  # moved to another worker (connect retry, resumed stream)
    buckets: HitBuckets | None = None  # None: not ended yet
    delivered_tokens: int | None = None
    # (predicted, delivered) -> tokens lost to blocks the chosen worker's events removed after
    # routing (``PrefixIndex.eviction_probe``); None: the index cannot tell. Dropped when settled.
    eviction_probe: Callable[[int, int], int] | None = None

    def __init__(
        self, request_id: str, model: str, pool: PoolSettings, policy: str, reason: str,
        worker: str, prompt_tokens: int, fleet_best_tokens: int, predicted_tokens: int,
        candidates: tuple[Candidate, ...], held_back: tuple[tuple[str, int], ...],
        routed_at_s: float, moves: int = 0, buckets: HitBuckets | None = None,
        delivered_tokens: int | None = None,
        eviction_probe: Callable[[int, int], int] | None = None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.pool = pool
        self.policy = policy
        self.reason = reason
        self.worker = worker
        self.prompt_tokens = prompt_tokens
        self.fleet_best_tokens = fleet_best_tokens
        self.predicted_tokens = predicted_tokens
        self.candidates = candidates
        self.held_back = held_back
        self.routed_at_s = routed_at_s
        self.moves = moves
        self.buckets = buckets
        self.delivered_tokens = delivered_tokens
        self.eviction_probe = eviction_probe


class HitLedger:
    """The last ``capacity`` routed requests by id, per-pool totals by outcome, and the
    mismatch detector. One per gateway process; no I/O, no locks (the event loop's thread)."""

    def __init__(self, capacity: int = DEFAULT_EXPLAIN_REQUESTS, *,
                 detector: MismatchDetector | None = None) -> None:
        self.capacity = max(capacity, 0)
        self.detector = detector if detector is not None else MismatchDetector()
        self._records: dict[str, HitRecord] = {}
        # The ids in arrival order, a ring: the oldest is overwritten (a dict's own order would
        # make "drop the oldest" a scan over the deleted entries at its front).
        self._ring: list[str | None] = [None] * self.capacity
        self._next = 0
        self._totals: dict[str, list[int]] = {}  # pool -> tokens per outcome (OUTCOMES order)

    def routed(self, request_id: str, model: str, pool: PoolSettings, policy: str, reason: str,
               worker: str, prompt_tokens: int, fleet_best_tokens: int, predicted_tokens: int,
               candidates: tuple[Candidate, ...] = (),
               held_back: tuple[tuple[str, int], ...] = (),
               eviction_probe: Callable[[int, int], int] | None = None) -> HitRecord:
        record = HitRecord(request_id, model, pool, policy, reason, worker, prompt_tokens,
                           fleet_best_tokens, predicted_tokens, candidates, held_back,
                           time.time(), eviction_probe=eviction_probe)
        if self.capacity:
            at = self._next
            oldest = self._ring[at]
            if oldest is not None:
                self._records.pop(oldest, None)
            self._ring[at] = request_id
            self._records[request_id] = record
            self._next = at + 1 if at + 1 < self.capacity else 0
        return record

    def moved(self, record: HitRecord, policy: str, reason: str, worker: str,
              fleet_best_tokens: int, predicted_tokens: int,
              candidates: tuple[Candidate, ...] = (),
              eviction_probe: Callable[[int, int], int] | None = None) -> None:
        """The request left its worker for another (which then answers for it)."""
        record.policy, record.reason, record.worker = policy, reason, worker
        record.eviction_probe = eviction_probe
        record.fleet_best_tokens, record.predicted_tokens = fleet_best_tokens, predicted_tokens
        record.candidates, record.held_back = candidates, ()
        record.moves += 1

    def settle(self, record: HitRecord, usage: Any, *, evicted_tokens: int = 0) -> HitBuckets:
        """Complete ``record`` with the answer's ``usage`` (None: no usage came); its buckets,
        also added to the pool's totals. A second call returns the first result unchanged."""
        if record.buckets is not None:
            return record.buckets
        delivered = delivered_from(usage)
        mismatch = False
        if delivered is not None:
            mismatch = self.detector.observe(record.model, record.predicted_tokens, delivered)
            probe = record.eviction_probe
            if probe is not None and not evicted_tokens:
                evicted_tokens = probe(record.predicted_tokens, delivered)
        record.eviction_probe = None
        buckets = account(record.prompt_tokens, record.fleet_best_tokens,
                          record.predicted_tokens, delivered, record.reason,
                          evicted_tokens=evicted_tokens, mismatch=mismatch)
        record.buckets, record.delivered_tokens = buckets, delivered
        pool = record.pool.name
        totals = self._totals.get(pool)
        self._totals[pool] = (list(islice(buckets, 1, None)) if totals is None
                              else list(map(add, totals, islice(buckets, 1, None))))
        return buckets

    def get(self, request_id: str) -> HitRecord | None:
        return self._records.get(request_id)

    def __len__(self) -> int:
        return len(self._records)

    def totals(self) -> dict[str, dict[str, int]]:
        """Per pool, prompt tokens by outcome since start (this process)."""
        return {pool: dict(zip(OUTCOMES, t, strict=True)) for pool, t in self._totals.items()}

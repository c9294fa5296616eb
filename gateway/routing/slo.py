"""Latency objectives: predict each candidate's TTFT and TPOT, prefer those that meet the request's.

A request may carry a TTFT and a TPOT objective (``x-slo-ttft-ms`` / ``x-slo-tpot-ms``, else its
API key's ``slo_ttft_ms`` / ``slo_tpot_ms``, else its pool's ``slo.ttft_ms`` / ``slo.tpot_ms``;
parsed in ``gateway.request``). This module keeps, per pool and worker, a calibrated model of
how long that worker takes, and turns the pool policy's decision into one that meets the
objectives when some worker can. Pure: no I/O, no clock (the caller passes what it measured).

The models, one per worker and objective, each ``y = a + b x`` fitted online:

    TTFT(w) = a_w + b_w × cost(w)      cost: the ``kv_aware`` cost of the request on w at routing
                                       (``KvAware.score``: prefill-token units, own uncached prompt
                                       + prefill queued ahead + decode load + KV pressure), whatever
                                       the pool's policy; y: routing -> first token, seconds
    TPOT(w) = c_w + d_w × batch(w)     batch: max(in flight, running + waiting) + 1 at routing
                                       (decode is memory-bound: every step reads the KV of the
                                       whole running batch, so a worker's TPOT grows with it)

Fit: exponentially weighted least squares (each new observation of a worker multiplies the weight
of its older ones by ``2^(-1/half_life_requests)``), with the configured prior folded in as two
pseudo-observations of total weight ``PRIOR_WEIGHT`` (a quarter of one request) at x = 0 and at
a reference x (4,096 cost units; 32 requests) that never decay: a ridge towards the prior, so a
worker whose requests all cost the same (a degenerate x) still has a slope, and a cold worker
(no observation) predicts the prior exactly. A slope that comes out negative is taken as 0 (intercept: the weighted mean), an
intercept that comes out negative as 0 (slope through the origin). Until a worker has
``warm_after_requests`` (effective) observations, its prior line is the mean of its pool's warm
workers' lines when there is one: a worker that just joined starts like its peers, not like the
textbook prior, and its own observations take over from the first (each weighs 4x the prior): a
worker that is really slower is found out in one or two requests. O(1) to observe; O(1) to
predict for a warm worker (its solved line is cached until its next observation), O(warm peers)
for a cold one; one small object per worker. Per request without an objective: one ``kv_aware``
score (the chosen worker's) and one prediction, about a third of an 8-candidate ``kv_aware``
decision; with one, a score and a prediction per candidate (about twice the decision).

Only what the worker did is fitted: TTFT is measured from the routing decision (time the request
spent in the gateway before it, admission queue included, is ``SloTarget.elapsed_s`` and counts
against the objective, not against the worker), on streamed answers (a whole answer's first byte
comes after its last token), of requests computed on one worker (not a disaggregated pool's
two-step requests).

Selection (``select``), given the pool policy's choice p and every candidate's prediction. A
prediction "fits" when it meets the objectives with ``FIT_SLACK`` (1.2) to spare: ``elapsed +
1.2 × TTFT ≤ ttft`` (the calibration's error: predicted over observed spreads about ±30% at
p10/p90, and a miss costs more than a move). A candidate "harms" when placing the request there
would make a request with an objective still pending there miss it (``Promises``, below):

1. no objective: p, unchanged, with nothing computed for the other candidates (the request path
   is today's; only the chosen worker's prediction is kept, for calibration);
2. a ``batch`` request (``X-Priority: batch``, or its key's priority) packs: the candidate with
   the *largest* predicted TTFT among those that fit, harm no one and hold at least p's cached
   tokens (never a cache hit given away). Its objective is loose, so it takes the slowest
   capacity that still serves it in time and leaves the fast candidates to requests with tight
   objectives: on a fleet of H100s and A100s, an 800 ms objective for a 6K prompt fits an idle
   A100 (630 ms), and the H100s stay free for the 120 ms interactive ones (the ``slo`` scenario:
   the policy before this sent batch prompts to the fastest worker, and the interactive
   requests that came next waited behind a 200 ms prefill). It also leaves room for the tight
   requests (``room``): the pool's last ``TIGHT_WINDOW_REQUESTS`` requests with a TTFT
   objective that do not pack (``TightDemand``: their rate, mean uncached prompt and tightest
   objective) need ``reserve`` = ceil(rate × their TTFT on the fastest idle worker /
   ``ROOM_BUSY``) workers *clear*, where one of them would still meet that objective with
   ``FIT_SLACK`` to spare; a fit that would make one of the last ``reserve`` clear workers
   unclear is passed over for one that would not (a worker already busy with batch prefills
   takes one more). When every harmless fit would, it is held until the first candidate's
   pending requests are all due (a queue drained; a sixteenth of its objective when none is
   pending), while it still fits after that; else it takes the slowest fit as before. In the ``slo`` scenario's
   full length the misses came in bursts where batch prefills covered every H100 (three
   batch requests 20 ms apart, each packed onto another one) and the interactive requests
   that came next had nowhere to meet 120 ms. None fits harmlessly, but one would once the
   requests it would delay have had their first token, and waiting for that still fits: it is
   held (step 5); when no wait helps and every candidate that meets its objective would make a
   pending request miss, a batch request of a shed class is refused (step 6) rather than placed
   there: it is the class that gives way (session 11 placed it, and one batch prefill joining
   the step of waiting interactive requests made each of them miss);
3. p meets the objectives with ``KEEP_SLACK`` (2x) to spare and harms no one: p (a policy's
   choice for the cache or the session is never overridden needlessly). The margin is wide
   because a line fitted over a worker's whole range is least accurate at its low end: in the
   ``slo`` scenario, idle A100s were predicted to meet a 120 ms objective for a 1K prompt
   with 1.2x to spare, and missed it by a few ms (5 of 8 such requests in one run);
4. else the lowest predicted TTFT (then the lower ``kv_aware`` cost, fewer in flight, order) of
   the candidates that meet the objectives (without slack), harm no one and are below the
   pool's ``kv_hard_limit``; if each of those harms someone, p when it meets them, else the
   lowest predicted TTFT among them: reason ``slo``. Seconds, not cost units: on a fleet of
   mixed GPUs a token costs more on the slower ones, and the most slack left under the
   objective is the best guard against a prediction's error;
5. held (``Selection.hold_s``, the router's ``SloHold``): the request path waits that long in
   the gateway and routes it again, the wait counted in ``elapsed``; routed after a hold, its
   reason is ``slo_held``. Only a batch request, only while it still fits after the wait, so it
   ends: never more than its own objective, nor more than ``MAX_HOLD_S`` in all (then the
   policy's choice);
6. else none can: a request of a class in ``slo.shed`` (default: ``batch``, the admission
   queue's lower class: its key's ``priority`` or ``X-Priority: batch``) is refused, 503
   ``slo_unattainable`` with Retry-After (the smallest predicted overshoot, 1 to 30 s): refusing
   it now costs its client less than an answer that comes too late, and the capacity goes to
   requests that can still make it. Any other class (interactive) is served best-effort on the
   eligible candidate predicted to miss by the least (the largest ratio predicted / objective
   over its objectives, smallest) among those where it makes no pending request miss (when
   each would: among all), reason ``slo_best_effort``: a late request joining the prefill step
   of requests that would still meet theirs turns one miss into several (the ``slo``
   scenario's bursts stacked every best-effort request onto the one worker predicted least
   late, with requests there that would have made it).

Pending requests (``Promises``, one per pool, in the router's clock): each request routed with
a TTFT objective is pending on its worker until its predicted first token (routing + predicted
TTFT), with its deadline (routing − elapsed + objective). vLLM's scheduler runs a waiting
request's prefill in one step with every request admitted behind it (FCFS, chunked prefill up
to ``max_num_batched_tokens``), so a request routed later to that worker delays the pending
ones by about its own prefill: its uncached tokens × the worker's calibrated slope (seconds per
cost unit). A candidate harms when that delay pushes a pending request past its deadline; once
placed, the delay is added to the pending ones' due times. Pending requests are forgotten when
due (no notice of the first token is needed; an early one only protects them a little long).
With ``--processes N`` they are the gateway's, not one process's: each process publishes its
own and the delay it added per worker in the shared load table
(``gateway.workers.load_table``), so a request one process routes protects, and is delayed by,
what the others route. Cost per request with an objective: O(pending on each candidate), a
handful, plus one read of the other processes' rows per candidate.

Where objectives do not apply: a request that must go to one worker (a stored Responses
conversation: ``Router._owner_route``) and a retry after a connection failure are placed as
without them. Each gateway process calibrates from the answers it relays (not shared: every
process sees a similar sample of every worker's traffic). A session kept on its worker by
``affinity: session`` may be moved to meet an objective; the affinity table still names the old
worker for its next turn.

Why this shape. An objective only ever changes where its own request goes, or refuses it: it never
reorders, preempts or evicts another request (the gateway writes no ``priority`` into the body:
under ``--scheduling-policy priority`` vLLM preempts running requests by it), it does not change
admission, budgets or fair queuing (all decided before routing), and a move goes only to a worker
the policy could have picked (healthy, with room below the pool's caps, below the KV hard limit).
The worst a hostile client can do with a tight objective is to be refused, or be sent to the
worker predicted fastest, a placement ``least_loaded`` could have made as well; its requests
pending there steer other requests with objectives away from that worker (and may hold a batch
request) until their first token is due, as any request with that objective would. Compared to: Dynamo and llm-d route on a
predicted TTFT (llm-d's latency predictor, a trained model per pod); here the predictor is the
router's own cost, with one slope and one intercept per worker fitted online, so it needs no
training data and follows a worker that slows down within ``half_life_requests``. Queuing an
unattainable request until it becomes attainable (instead of shedding it) is not done: the time
it would wait is the TTFT it would miss (a queue drains no faster than the clock that counts
against the objective). What is done is step 5: waiting while the request is attainable but
would make others miss theirs. Chosen with ``python -m gateway.bench.routers.slo_model`` (the
scenario in model time, every miss explained, over many arrival schedules and with the
scenario's gateway processes) and proven with the ``slo`` scenario. The tight demand and the
calibration are per gateway process (each sees about half the traffic with 2), the pending
requests the gateway's. In model time over 24 arrival schedules of the full length
(``slo_model --seeds 1 .. 24 [--processes 2]``): one process attains a median 96.9% (worst
93.9%); two, each with its own pending requests, 97.2% (worst 88.3%, mean 96.0%), and sharing
them 98.1% (worst 92.1%, mean 97.5%; better in 18 schedules, worse in 5). Sharing the tight
demand too, tried in the model, gave back those gains (97.1%, worst 93.1%: one process's
behaviour, which sheds more), and alone it lost (94.7%).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.config import Priority, SloSettings

TTFT = "ttft"
TPOT = "tpot"
OBJECTIVES = (TTFT, TPOT)
"""The ``slo`` label of ``kvgate_slo_requests_total`` and ``kvgate_slo_prediction_ratio``."""
MET, MISSED, SHED = "met", "missed", "shed"
"""The ``outcome`` label of ``kvgate_slo_requests_total``."""
SLO_REASON = "slo"
"""The decision reason of a request moved off the policy's choice to meet its objective."""
SLO_BEST_EFFORT_REASON = "slo_best_effort"
"""... of a request no candidate was predicted to meet, served where it misses by the least."""
SLO_HELD_REASON = "slo_held"
"""... of a request held in the gateway first (step 5), wherever it then went."""

TTFT_REFERENCE_COST = 4096.0  # where the prior's second pseudo-observation sits (cost units)
TPOT_REFERENCE_BATCH = 32.0  # ... and for TPOT (requests in the batch)
RATIO_HALF_LIFE_REQUESTS = 16  # the calibration gauge's memory
PRIOR_WEIGHT = 0.25  # the prior, in observations: enough to define a degenerate fit, no more
FIT_SLACK = 1.2  # a packed request fits where its predicted TTFT x this meets its objective
KEEP_SLACK = 2.0  # the policy's choice stands when it meets the objectives with this to spare
HOLD_MIN_S = 0.001
MAX_HOLD_S = 5.0
"""A request is held (step 5) for this long in all at most, then placed where the policy chose:
a held request keeps its admission slot and budget reservation, and a client that left does not
end its hold, so an objective as long as the header allows (an hour) must not hold it that long
while requests with objectives keep arriving ahead of it."""
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 30.0
TIGHT_WINDOW_REQUESTS = 16  # the tight requests a batch one leaves room for: the last this many
ROOM_BUSY = 0.5
"""A batch request leaves clear the workers the pool's tight requests need busy at most this
share of the time (``room``): ceil(their rate x their prefill on the fastest idle worker / 0.5)."""


@dataclass(frozen=True, slots=True)
class SloTarget:
    """What one request asks for, as the request path resolved it before routing."""

    ttft_s: float | None = None  # None: no TTFT objective from the request or its key
    tpot_s: float | None = None
    priority: Priority = Priority.INTERACTIVE
    elapsed_s: float = 0.0  # spent in the gateway before routing (counts against the TTFT)
    held_s: float = 0.0  # of which held by the router for the requests ahead (step 5)


@dataclass(frozen=True, slots=True)
class Prediction:
    """One candidate's predicted latencies, and the inputs they came from (kept for the fit)."""

    worker_id: str
    cost: float  # kv_aware cost units at routing
    batch: int  # requests in its batch with this one
    ttft_s: float  # routing -> first token
    tpot_s: float


@dataclass(frozen=True, slots=True)
class SloPlacement:
    """What a route carries for the objectives: the chosen worker's prediction and the
    objectives in force (the request's, its key's or its pool's; None: none)."""

    prediction: Prediction
    ttft_s: float | None = None
    tpot_s: float | None = None

    @property
    def active(self) -> bool:
        return self.ttft_s is not None or self.tpot_s is not None


@dataclass(frozen=True, slots=True)
class Selection:
    """``select``'s answer: the index chosen, or ``shed`` (then ``index`` is the policy's)."""

    index: int
    moved: bool = False
    shed: bool = False
    attainable: bool = True
    retry_after_s: float = RETRY_AFTER_MIN_S
    unmet: str = TTFT  # the objective no candidate met (when not attainable)
    hold_s: float = 0.0  # > 0: place nothing yet, ask again after this long (step 5)
    gives_way: bool = False  # shed although a candidate meets it: each would make another miss


class LineFit:
    """``y = a + b x`` by exponentially weighted least squares with a prior line (module
    docstring). Five running sums; ``weight`` is the effective number of observations."""

    __slots__ = ("_cache", "_decay", "_sw", "_sx", "_sxx", "_sxy", "_sy", "_x_ref")

    def __init__(self, x_ref: float, half_life: float) -> None:
        self._decay = 0.5 ** (1.0 / half_life)
        self._x_ref = x_ref
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0
        # the last answer of ``params`` and its prior: a warm worker is predicted for every
        # candidate of every request and observed once per request
        self._cache: tuple[float, float, float, float] | None = None

    @property
    def weight(self) -> float:
        return self._sw

    def add(self, x: float, y: float) -> None:
        k = self._decay
        self._cache = None
        self._sw = self._sw * k + 1.0
        self._sx = self._sx * k + x
        self._sy = self._sy * k + y
        self._sxx = self._sxx * k + x * x
        self._sxy = self._sxy * k + x * y

    def params(self, a0: float, b0: float) -> tuple[float, float]:
        """(a, b), both >= 0, fitted to the observations and the prior line ``a0 + b0 x``
        (``PRIOR_WEIGHT`` observations of it, half at x = 0 and half at the reference x)."""
        if self._sw == 0.0:
            return a0, b0
        c = self._cache
        if c is not None and c[0] == a0 and c[1] == b0:
            return c[2], c[3]
        a, b = self._solve(a0, b0)
        self._cache = (a0, b0, a, b)
        return a, b

    def _solve(self, a0: float, b0: float) -> tuple[float, float]:
        x_ref = self._x_ref
        y_ref, h = a0 + b0 * x_ref, PRIOR_WEIGHT / 2
        s = self._sw + PRIOR_WEIGHT
        sx, sy = self._sx + h * x_ref, self._sy + h * (a0 + y_ref)
        sxx, sxy = self._sxx + h * x_ref * x_ref, self._sxy + h * x_ref * y_ref
        det = s * sxx - sx * sx
        b = (s * sxy - sx * sy) / det if det > 0.0 else 0.0
        if b <= 0.0:
            return max(sy / s, 0.0), 0.0
        a = (sy - b * sx) / s
        if a < 0.0:
            return 0.0, (sxy / sxx if sxx > 0.0 else 0.0)
        return a, b


class _Worker:
    __slots__ = ("ratio_tpot", "ratio_ttft", "tpot", "ttft")

    def __init__(self, s: SloSettings) -> None:
        half = float(s.half_life_requests)
        self.ttft = LineFit(TTFT_REFERENCE_COST, half)
        self.tpot = LineFit(TPOT_REFERENCE_BATCH, half)
        # observed / predicted, exponentially weighted (1: calibrated): the calibration gauge
        self.ratio_ttft: float | None = None
        self.ratio_tpot: float | None = None


class SloModel:
    """One pool's calibrated latency models, per worker (the module docstring)."""

    def __init__(self, settings: SloSettings) -> None:
        self.settings = settings
        self._workers: dict[str, _Worker] = {}
        self._ratio_keep = 0.5 ** (1.0 / RATIO_HALF_LIFE_REQUESTS)
        self._ttft_prior = (settings.ttft_base_ms / 1e3, settings.ttft_ms_per_cost_unit / 1e3)
        self._tpot_prior = (settings.tpot_base_ms / 1e3, settings.tpot_ms_per_request / 1e3)

    def _worker(self, worker_id: str) -> _Worker:
        w = self._workers.get(worker_id)
        if w is None:
            w = self._workers[worker_id] = _Worker(self.settings)
        return w

    def _prior(self, ttft: bool) -> tuple[float, float]:
        return self._ttft_prior if ttft else self._tpot_prior

    def _params(self, worker_id: str, ttft: bool) -> tuple[float, float]:
        w = self._workers.get(worker_id)
        fit = None if w is None else (w.ttft if ttft else w.tpot)
        warm = self.settings.warm_after_requests
        if fit is not None and fit.weight >= warm:
            return fit.params(*self._prior(ttft))
        # a cold worker: its observations so far, on its warm peers' mean line as the prior
        prior = self._prior(ttft)
        peers = [p.ttft if ttft else p.tpot for p in self._workers.values()]
        fitted = [f.params(*prior) for f in peers if f.weight >= warm]
        if fitted:
            prior = (sum(a for a, _ in fitted) / len(fitted),
                     sum(b for _, b in fitted) / len(fitted))
        return prior if fit is None else fit.params(*prior)

    def ttft_slope(self, worker_id: str) -> float:
        """Seconds of TTFT per cost unit on the worker (its calibrated ``b``)."""
        return self._params(worker_id, True)[1]

    def warm(self, worker_id: str) -> bool:
        """Whether the worker's TTFT model rests on its own observations."""
        w = self._workers.get(worker_id)
        return w is not None and w.ttft.weight >= self.settings.warm_after_requests

    def predict(self, worker_id: str, cost: float, batch: int) -> Prediction:
        a, b = self._params(worker_id, True)
        c, d = self._params(worker_id, False)
        cost = max(cost, 0.0)
        return Prediction(worker_id, cost, batch, a + b * cost, c + d * batch)

    def observe(self, prediction: Prediction, ttft_s: float | None,
                tpot_s: float | None) -> None:
        """What the worker did for a request routed with ``prediction``: its TTFT from routing
        (None: not measured) and its TPOT (None: fewer than two tokens). Absurd values (negative,
        not finite) are dropped."""
        w = self._worker(prediction.worker_id)
        keep = self._ratio_keep
        warm = self.settings.warm_after_requests
        if ttft_s is not None and math.isfinite(ttft_s) and ttft_s >= 0.0:
            if prediction.ttft_s > 0.0 and w.ttft.weight >= warm:
                r = ttft_s / prediction.ttft_s
                w.ratio_ttft = r if w.ratio_ttft is None else keep * w.ratio_ttft + (1 - keep) * r
            w.ttft.add(prediction.cost, ttft_s)
        if tpot_s is not None and math.isfinite(tpot_s) and tpot_s >= 0.0:
            if prediction.tpot_s > 0.0 and w.tpot.weight >= warm:
                r = tpot_s / prediction.tpot_s
                w.ratio_tpot = r if w.ratio_tpot is None else keep * w.ratio_tpot + (1 - keep) * r
            w.tpot.add(float(prediction.batch), tpot_s)

    def ratio(self, worker_id: str, objective: str) -> float | None:
        """Observed / predicted for ``objective`` on the worker, exponentially weighted over
        ``RATIO_HALF_LIFE_REQUESTS``, counted once it is warm (a cold worker's predictions are
        its peers' by design); None before that."""
        w = self._workers.get(worker_id)
        if w is None:
            return None
        return w.ratio_ttft if objective == TTFT else w.ratio_tpot

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)


class SharedPromises(Protocol):
    """One worker's slot in the table the gateway's processes share
    (``gateway.workers.load_table.SharedLoad``): the delay each process added there and the
    pending requests each published."""

    def add_delay(self, delay_s: float) -> None: ...

    def publish(self, pairs: list[tuple[float, float]]) -> None: ...

    def promises(self) -> tuple[float, list[tuple[float, float]]]: ...


class Promises:
    """Per worker, the requests with a TTFT objective routed there whose first token is not due
    yet (predicted), in the caller's clock; a request placed behind them, whose prefill would
    join their step, delays them. Kept as (due less the worker's total delay when added,
    deadline): a request is due at that plus the total delay now, so a delay is one addition
    whoever holds the requests it moves. With ``shared`` (``LoadTable.shared``: the gateway's
    other processes) the total is the gateway's and their pending requests count as this
    process's own: a request one process routes protects, and is delayed by, what every process
    routes (in model time over 24 arrival schedules of the ``slo`` scenario, 2 processes
    attained a median 97.2%, worst 88.3%, each with its own; 98.1%, worst 92.1%, shared)."""

    __slots__ = ("_by_worker", "_delay", "_shared")

    def __init__(self, shared: Callable[[str], SharedPromises | None] | None = None) -> None:
        self._by_worker: dict[str, list[tuple[float, float]]] = {}
        self._delay: dict[str, float] = {}  # delay added per worker, where nothing is shared
        self._shared = shared

    def _slot(self, worker_id: str) -> SharedPromises | None:
        return None if self._shared is None else self._shared(worker_id)

    def assess(self, worker_id: str, delay_s: float, now_s: float) -> tuple[bool, float]:
        """Whether delaying the worker's pending requests by ``delay_s`` makes one miss, and
        seconds until the last of them is due (0: none).

        One already due past its deadline (placed best-effort: its objective could not be met)
        is missing anyway and protects nothing: otherwise a client sending objectives no worker
        can meet (``x-slo-ttft-ms: 1``) would mark every worker harmed, and other tenants' batch
        requests would be held or refused (503 ``slo_unattainable``) for it."""
        own = self._by_worker.get(worker_id, ())
        slot = self._slot(worker_id)
        others: list[tuple[float, float]] = []
        if slot is None:
            if not own:
                return False, 0.0
            total = self._delay.get(worker_id, 0.0)
        else:
            total, others = slot.promises()
        harmed, last = False, 0.0
        for pending in (own, others):
            for base, deadline in pending:
                due = base + total
                if due > now_s:
                    harmed = harmed or due <= deadline < due + delay_s
                    last = max(last, due - now_s)
        return harmed, last

    def harmed(self, worker_id: str, delay_s: float, now_s: float) -> bool:
        return self.assess(worker_id, delay_s, now_s)[0]

    def clear_in(self, worker_id: str, now_s: float) -> float:
        return self.assess(worker_id, 0.0, now_s)[1]

    def add(self, worker_id: str, due_s: float, deadline_s: float | None, delay_s: float,
            now_s: float) -> None:
        """A request routed to the worker: the pending ones there are delayed by its
        ``delay_s``; it is pending itself until ``due_s`` (with a deadline: tracked)."""
        slot = self._slot(worker_id)
        before = self._delay.get(worker_id, 0.0) if slot is None else slot.promises()[0]
        # the ones due by now are done: pruned before the delay could move them past now
        own = [e for e in self._by_worker.get(worker_id, ()) if e[0] + before > now_s]
        total = before + delay_s
        if slot is None:
            self._delay[worker_id] = total
        else:
            slot.add_delay(delay_s)
        if deadline_s is not None:
            own.append((due_s - total, deadline_s))
        if own:
            self._by_worker[worker_id] = own
        else:
            self._by_worker.pop(worker_id, None)
        if slot is not None:  # the ones a delay could make miss first (least to spare)
            slot.publish(sorted(own, key=lambda e: (e[1] < e[0] + total, e[1] - e[0])))


@dataclass(frozen=True, slots=True)
class Tight:
    """The pool's recent tight requests (``TightDemand.recent``): their mean uncached prompt,
    the tightest of their TTFT objectives, and how many arrive per second."""

    prompt_tokens: float
    ttft_s: float
    rate_per_s: float


class TightDemand:
    """The last ``TIGHT_WINDOW_REQUESTS`` requests of a pool routed with a TTFT objective that
    do not pack (not batch): when, their uncached prompt, their objective. O(1) to observe,
    O(window) to read (once per batch request)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: deque[tuple[float, float, float]] = deque(maxlen=TIGHT_WINDOW_REQUESTS)

    def observe(self, now_s: float, uncached_tokens: int, ttft_s: float) -> None:
        self._seen.append((now_s, float(uncached_tokens), ttft_s))

    def recent(self, now_s: float) -> Tight | None:
        """None before 4 are seen. The rate counts the time since the oldest up to now, so a
        class that stopped arriving fades (16 requests over a window that keeps growing)."""
        seen = self._seen
        if len(seen) < 4:
            return None
        span = now_s - seen[0][0]
        rate = len(seen) / span if span > 0.0 else math.inf
        return Tight(sum(x[1] for x in seen) / len(seen), min(x[2] for x in seen), rate)


def room(now_s: Sequence[float], after_s: Sequence[float], idle_s: float,
         tight: Tight) -> list[bool]:
    """Per candidate, whether placing a batch request there keeps room for the tight requests.

    ``now_s``: a tight request's predicted TTFT on each candidate as it stands, ``after_s``: with
    the batch request's prefill queued there too, ``idle_s``: on the fastest idle worker. A
    candidate is *clear* where a tight request would meet the tightest objective with
    ``FIT_SLACK`` to spare. The tight requests need ``reserve`` clear workers, ceil(rate x
    idle_s / ``ROOM_BUSY``), at least 1 and at most all but one: a placement keeps room unless
    it turns a clear candidate unclear while no more than ``reserve`` are clear."""
    ttft_s = tight.ttft_s
    clear = [FIT_SLACK * t <= ttft_s for t in now_s]
    need = tight.rate_per_s * idle_s / ROOM_BUSY
    reserve = min(max(math.ceil(need) if math.isfinite(need) else len(clear), 1),
                  max(len(clear) - 1, 1))
    spare = sum(clear) > reserve
    return [spare or not c or FIT_SLACK * a <= ttft_s
            for c, a in zip(clear, after_s, strict=True)]


def meets(p: Prediction, ttft_s: float | None, tpot_s: float | None, elapsed_s: float,
          slack: float = 1.0) -> bool:
    """Whether ``p`` meets the objectives, its predictions times ``slack``."""
    return ((ttft_s is None or elapsed_s + slack * p.ttft_s <= ttft_s)
            and (tpot_s is None or slack * p.tpot_s <= tpot_s))


def select(predictions: Sequence[Prediction], chosen: int, eligible: Sequence[bool],
           inflight: Sequence[int], *, ttft_s: float | None, tpot_s: float | None,
           elapsed_s: float, shed: bool, pack: bool = False,
           cached: Sequence[int] = (), harm: Sequence[bool] = (),
           clear_in_s: Sequence[float] = (), room: Sequence[bool] = ()) -> Selection:
    """Steps 2-5 of the module docstring. ``chosen``: the policy's index; ``eligible``: below the
    KV hard limit; ``inflight``: the tie-break; ``shed``: the request's class is shed;
    ``pack``: its class packs (batch); ``cached``: each candidate's cached tokens; ``harm``:
    placing it there would make a request pending there miss its objective (``Promises``),
    ``clear_in_s``: until the last of those is due; ``room``: placing a batch request there
    keeps the clear workers the tight requests need (``room``; empty: no tight demand)."""
    n = len(predictions)
    harms = harm or [False] * n
    if pack and ttft_s is not None:
        floor = cached[chosen] if cached else 0
        # a fit: predicted to meet with FIT_SLACK to spare, losing no cache hit the policy found
        fit = [i for i, p in enumerate(predictions)
               if eligible[i] and (not cached or cached[i] >= floor)
               and elapsed_s + FIT_SLACK * p.ttft_s <= ttft_s
               and (tpot_s is None or p.tpot_s <= tpot_s)]
        fits = [i for i in fit if not harms[i]]
        roomy = [i for i in fits if not room or room[i]]
        if roomy:
            best = max(roomy, key=lambda i: (predictions[i].ttft_s, -inflight[i], -i))
            return Selection(best, moved=best != chosen)
        if fits:
            # each would take a worker the tight requests need: wait until a candidate's pending
            # requests are all due (a queue drained), if it still fits after that
            wait = min((c for c in clear_in_s if c > 0.0), default=ttft_s / 16)
            if elapsed_s + wait + FIT_SLACK * min(predictions[i].ttft_s for i in fits) <= ttft_s:
                return Selection(chosen, hold_s=max(wait, HOLD_MIN_S))
            best = max(fits, key=lambda i: (predictions[i].ttft_s, -inflight[i], -i))
            return Selection(best, moved=best != chosen)
        # held until the requests it would delay have their first token, if it still fits then
        waits = [clear_in_s[i] for i in fit if clear_in_s
                 and elapsed_s + clear_in_s[i] + FIT_SLACK * predictions[i].ttft_s <= ttft_s]
        if waits:
            return Selection(chosen, hold_s=max(min(waits), HOLD_MIN_S))
    if not harms[chosen] and meets(predictions[chosen], ttft_s, tpot_s, elapsed_s, KEEP_SLACK):
        return Selection(chosen)
    meeting = [i for i, p in enumerate(predictions)
               if eligible[i] and meets(p, ttft_s, tpot_s, elapsed_s)]
    harmless = [i for i in meeting if not harms[i]]
    if harmless:
        best = min(harmless, key=lambda i: (predictions[i].ttft_s, predictions[i].cost,
                                            inflight[i], i))
        return Selection(best, moved=best != chosen)
    if meeting and pack and shed and ttft_s is not None:
        # a batch request that could only be placed where it makes a pending request miss
        # gives way: refused rather than turn its own answer into someone else's miss
        due = min((c for c in clear_in_s if c > 0.0), default=RETRY_AFTER_MIN_S)
        return Selection(chosen, shed=True, attainable=False, gives_way=True,
                         retry_after_s=min(max(due, RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))
    if chosen in meeting:
        return Selection(chosen)
    if meeting:
        best = min(meeting, key=lambda i: (predictions[i].ttft_s, predictions[i].cost,
                                           inflight[i], i))
        return Selection(best, moved=best != chosen)
    pool = [i for i, e in enumerate(eligible) if e] or list(range(len(predictions)))
    ttft_ok = ttft_s is None or any(elapsed_s + predictions[i].ttft_s <= ttft_s for i in pool)
    unmet = TPOT if ttft_ok else TTFT
    over = [elapsed_s + predictions[i].ttft_s - ttft_s for i in pool] if ttft_s is not None else []
    retry = min(max(min(over, default=RETRY_AFTER_MIN_S), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S)
    if shed:
        return Selection(chosen, shed=True, attainable=False, retry_after_s=retry, unmet=unmet)

    def miss(i: int) -> float:
        p = predictions[i]
        return max((elapsed_s + p.ttft_s) / ttft_s if ttft_s else 0.0,
                   p.tpot_s / tpot_s if tpot_s else 0.0)

    spare = [i for i in pool if not harms[i]]
    best = min(spare or pool, key=lambda i: (miss(i), predictions[i].cost, inflight[i], i))
    return Selection(best, moved=best != chosen, attainable=False, retry_after_s=retry,
                     unmet=unmet)

"""The numbers of a benchmark run: per-request records in, percentiles and rates out. Pure.

Percentiles interpolate linearly between the closest ranks (numpy's default), so p50 of two values
is their mean. Latency percentiles count successful requests only (an error's latency says nothing
about the model); TPOT counts requests with at least two output tokens. Throughput divides by the
run's wall time, from its first request sent to its last one finished.

The fleet prefix-cache hit rate is vLLM's own counters, differenced: (sum over workers of
``vllm:prefix_cache_hits_total`` after - before) / (same for ``..._queries_total``), both counted
in tokens. A worker whose counters went down (a restart) contributes nothing rather than a negative.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gateway.workers.worker import VllmStats


@dataclass(frozen=True)
class RequestRecord:
    """What one request did, as seen by the client. Times in seconds; offsets from run start."""

    index: int
    group: str
    status: int
    """HTTP status; 0 when no response came (connection error, timeout, cancelled)."""
    error: str | None
    """None on success; else the error kind (``"503"``, ``"stream_error"``, ``"timeout"`` ...)."""
    scheduled_s: float
    """When the request was due (open loop: its Poisson arrival; closed loop: when it was sent)."""
    sent_s: float
    ttft_s: float | None
    """Request sent -> first chunk carrying generated text."""
    tpot_s: float | None
    """(last token - first token) / (completion tokens - 1)."""
    e2e_s: float | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    """``usage.prompt_tokens_details.cached_tokens`` when the server reports it."""
    approx_prompt_tokens: int
    chunks: int
    """Chunks that carried generated text (several tokens may share one)."""
    session_id: str | None = None
    message: str | None = None
    """The error's text, truncated."""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class Distribution:
    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float


@dataclass(frozen=True)
class Summary:
    requests: int
    ok: int
    errors: dict[str, int]
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens_mean: float | None
    """From ``usage.prompt_tokens``; the workload's approximation when the server sent none."""
    ttft_s: Distribution | None
    tpot_s: Distribution | None
    e2e_s: Distribution | None
    send_lag_s: Distribution | None
    """Sent - scheduled: how late the client was (open loop, or a turn waiting on its session)."""
    cached_tokens_ratio: float | None
    """Sum of reported cached tokens / sum of prompt tokens, when the server reports them."""


@dataclass(frozen=True)
class CacheDelta:
    queries_tokens: float
    hits_tokens: float

    @property
    def hit_rate(self) -> float | None:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens > 0 else None


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0..1) of ``values``, linear between closest ranks; NaN when empty."""
    if not values:
        return math.nan
    if not 0.0 <= q <= 1.0:
        raise ValueError("q must be in [0, 1]")
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio_interval(numerator: Sequence[float], denominator: Sequence[float], q: float,
                   level: float = 0.9, resamples: int = 2000, seed: int = 0
                   ) -> tuple[float, float] | None:
    """A percentile bootstrap interval (``level``, e.g. 0.9: the 5th and 95th percentiles of the
    resampled ratios) of ``percentile(numerator, q) / percentile(denominator, q)``: each sample
    resampled with replacement, ``resamples`` times, seeded. None when either is empty or a
    resampled denominator is 0. A p99 of ~200 requests is their third worst, so a single run's
    ratio of two p99s moves by tens of percent from sampling alone: the interval says how far."""
    if not numerator or not denominator:
        return None
    rng = random.Random(seed)
    ratios: list[float] = []
    for _ in range(resamples):
        den = percentile(rng.choices(denominator, k=len(denominator)), q)
        if den == 0:
            return None
        ratios.append(percentile(rng.choices(numerator, k=len(numerator)), q) / den)
    tail = (1.0 - level) / 2
    return percentile(ratios, tail), percentile(ratios, 1.0 - tail)


def distribution(values: Iterable[float | None]) -> Distribution | None:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    return Distribution(
        count=len(xs),
        mean=sum(xs) / len(xs),
        p50=percentile(xs, 0.50),
        p90=percentile(xs, 0.90),
        p99=percentile(xs, 0.99),
        max=xs[-1],
    )


def tpot(first_token_s: float | None, last_token_s: float | None,
         completion_tokens: int | None) -> float | None:
    """Time per output token after the first; None with fewer than two tokens."""
    if first_token_s is None or last_token_s is None or completion_tokens is None:
        return None
    if completion_tokens < 2:
        return None
    return (last_token_s - first_token_s) / (completion_tokens - 1)


def summarize(records: Sequence[RequestRecord], duration_s: float | None = None) -> Summary:
    ok = [r for r in records if r.ok]
    if duration_s is None:
        duration_s = _wall(records)
    errors = Counter(r.error for r in records if r.error is not None)
    out_tokens = sum(r.completion_tokens or 0 for r in ok)
    prompt = [float(r.prompt_tokens if r.prompt_tokens is not None else r.approx_prompt_tokens)
              for r in records]
    with_cached = [r for r in ok if r.cached_tokens is not None and r.prompt_tokens]
    cached_ratio = None
    if with_cached:
        total_prompt = sum(r.prompt_tokens or 0 for r in with_cached)
        cached_ratio = sum(r.cached_tokens or 0 for r in with_cached) / total_prompt
    rate = duration_s if duration_s > 0 else math.inf
    return Summary(
        requests=len(records),
        ok=len(ok),
        errors=dict(sorted(errors.items())),
        duration_s=duration_s,
        requests_per_s=len(ok) / rate,
        output_tokens_per_s=out_tokens / rate,
        prompt_tokens_mean=sum(prompt) / len(prompt) if prompt else None,
        ttft_s=distribution(r.ttft_s for r in ok),
        tpot_s=distribution(r.tpot_s for r in ok),
        e2e_s=distribution(r.e2e_s for r in ok),
        send_lag_s=distribution(r.sent_s - r.scheduled_s for r in records),
        cached_tokens_ratio=cached_ratio,
    )


def summarize_groups(records: Sequence[RequestRecord]) -> dict[str, Summary]:
    """One summary per group, ordered by mean prompt length (turn 1 before turn 2, 2K before 4K).

    Each group's throughput divides by the wall time of that group's own requests.
    """
    by_group: dict[str, list[RequestRecord]] = {}
    for r in records:
        by_group.setdefault(r.group, []).append(r)
    summaries = {g: summarize(rs) for g, rs in by_group.items()}
    order = sorted(summaries, key=lambda g: (summaries[g].prompt_tokens_mean or 0.0, g))
    return {g: summaries[g] for g in order}


def _wall(records: Sequence[RequestRecord]) -> float:
    if not records:
        return 0.0
    start = min(r.sent_s for r in records)
    end = max(r.sent_s + (r.e2e_s or 0.0) for r in records)
    return end - start


def cache_delta(before: Mapping[str, VllmStats | None],
                after: Mapping[str, VllmStats | None]) -> CacheDelta | None:
    """Fleet prefix-cache counters' increase between two scrapes; None if no worker was read twice."""
    queries = hits = 0.0
    seen = False
    for url, b in before.items():
        a = after.get(url)
        if a is None or b is None:
            continue
        seen = True
        dq = a.prefix_cache_queries_tokens - b.prefix_cache_queries_tokens
        dh = a.prefix_cache_hits_tokens - b.prefix_cache_hits_tokens
        if dq < 0 or dh < 0:  # counters reset: the worker restarted mid-run
            continue
        queries += dq
        hits += dh
    return CacheDelta(queries, hits) if seen else None

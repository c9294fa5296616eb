"""The hit-rate ceiling of a run, its warm requests, and counter deltas: the pure arithmetic.

``ceiling`` replays the prompts a contender's run sent, in send order, on one prefix cache that
never evicts, with vLLM's rules; ``warm_ttft_ms`` leaves out the requests that are cold by
construction (see the package docstring); ``counter_delta`` and ``load_spread`` turn two scrapes
into what a run did. All of it runs on token ids and numbers, no processes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.bench.loadgen import LoadSpec, build_body
from gateway.bench.stats import distribution
from gateway.bench.workloads import Workload
from gateway.kvindex.hashing import BlockHash, block_hashes
from gateway.prompt.tokenizer import PromptTokenizer


@dataclass(frozen=True)
class CacheCount:
    """Prefix-cache lookups in tokens, as vLLM counts them."""

    queries_tokens: int
    hits_tokens: int

    @property
    def hit_rate(self) -> float | None:
        return self.hits_tokens / self.queries_tokens if self.queries_tokens else None


def ceiling(prompts: Iterable[Sequence[int]], block_size_tokens: int) -> CacheCount:
    """Hits of ``prompts``, in order, on one prefix cache that never evicts.

    vLLM's rules: a prompt queries all its tokens; it hits its longest run of leading full blocks
    already cached, but at most ``(len - 1) // block_size`` blocks (the last token is always
    computed, so a fully cached prompt re-computes its last block's worth); afterwards all its
    full blocks are cached. Only prompt tokens count: generated tokens never match the next
    prompt's text unless it carries the real answer, which the workloads here do not.
    """
    queries = hits = 0
    for n_tokens, hit in ceiling_hits(prompts, block_size_tokens):
        queries += n_tokens
        hits += hit
    return CacheCount(queries, hits)


def ceiling_hits(prompts: Iterable[Sequence[int]], block_size_tokens: int
                 ) -> Iterator[tuple[int, int]]:
    """Per prompt, (prompt tokens, tokens hit) on the never-evicting cache of ``ceiling``."""
    cached: set[BlockHash] = set()
    for ids in prompts:
        hashes = block_hashes(ids, block_size_tokens)
        usable = max(0, (len(ids) - 1) // block_size_tokens)
        matched = 0
        for h in hashes[:usable]:
            if h not in cached:
                break
            matched += 1
        cached.update(hashes)
        yield len(ids), matched * block_size_tokens


def sent_prompts(workload: Workload, records: Iterable[Any], load: LoadSpec,
                 tokenizer: PromptTokenizer) -> Iterator[list[int]]:
    """Token ids of the requests a run sent (salt included), in the order they were sent.

    ``records`` are ``RequestRecord``s (or anything with ``index``, ``sent_s`` and ``status``);
    requests that got no HTTP response never reached a worker and are left out.
    """
    by_index = {r.index: r for r in workload.all_requests()}
    for rec in sent_in_order(records):
        request = by_index[rec.index]
        body = build_body(request, request.messages, load)
        if load.api == "chat":
            yield tokenizer.encode_chat(body["messages"], body)
        else:
            yield tokenizer.encode_text(body["prompt"])


def sent_in_order(records: Iterable[Any]) -> list[Any]:
    """The records of requests that reached a server (got an HTTP status), in send order."""
    return sorted((r for r in records if r.status != 0), key=lambda r: (r.sent_s, r.index))


WARM_MIN_CEILING_SHARE = 0.5


def warm_ttft_ms(records: Iterable[Any], per_prompt: Sequence[tuple[int, int]]
                 ) -> dict[str, float | None]:
    """TTFT p50/p99 (ms) of the successful requests that are not cold by construction.

    A request is *cold by construction* when even the never-evicting cache of ``ceiling`` hits
    less than half its prompt: the first request of a shared prefix, a session's first turn. No
    router can make those hits, and with a few dozen prefixes or sessions they alone make up the
    last percent of TTFT, so p99 over all requests compares cold starts, not routing. The warm
    p99 leaves them out. ``per_prompt`` is ``ceiling_hits`` in ``sent_in_order(records)`` order.
    """
    sent = sent_in_order(records)
    xs = [r.ttft_s for r, (n, hit) in zip(sent, per_prompt, strict=True)
          if n and hit >= WARM_MIN_CEILING_SHARE * n and r.error is None
          and r.ttft_s is not None]
    d = distribution(xs)
    return {"warm_requests": len(xs),
            "warm_ttft_p50_ms": None if d is None else d.p50 * 1000,
            "warm_ttft_p99_ms": None if d is None else d.p99 * 1000}


def counter_delta(before: Mapping[tuple[str, ...], float],
                  after: Mapping[tuple[str, ...], float]) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for key, value in after.items():
        d = value - before.get(key, 0.0)
        if d > 0:
            out[key] = d
    return out


def load_spread(per_worker: Mapping[str, float]) -> float | None:
    """max / mean of per-worker load (1.0 = perfectly even)."""
    values = list(per_worker.values())
    if not values or sum(values) <= 0:
        return None
    return max(values) / (sum(values) / len(values))

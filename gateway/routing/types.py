"""The values routing works on: what is asked, who can serve it, and what was decided.

Pure data: no I/O, no FastAPI, no httpx. Policies receive a ``RoutingRequest`` and a sequence of
``Candidate`` (a worker's identity plus a snapshot of its load and of what it holds in KV cache)
and return a ``Decision``. Compiled with the request path (``gateway.native``); what the router
asks of a prefix index is in ``gateway.routing.index_like``, whose runtime-checkable protocols
mypyc cannot compile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class RoutingRequest:
    """One request as routing sees it."""

    model: str
    prompt_tokens: int
    max_tokens: int  # output tokens the request may produce (explicit, or the configured default)
    token_ids: tuple[int, ...] = ()  # empty when the prompt is not available as ids
    session_id: str | None = None  # the session the client named; None: it named none
    stream: bool = False
    tenant: str = ""  # the API key's name: a session is only ever the same within its tenant
    # The worker (url) holding the conversation this request continues (a Responses
    # previous_response_id): it goes there or nowhere (``Router.route``).
    owner: str | None = None
    # The LoRA adapter of ``model`` the request names (None: the base model): only workers
    # with it loaded serve it, and its cached blocks are its own (vLLM's block hashes carry it).
    adapter: str | None = None
    # vLLM's ``cache_salt``: the prompt's cached blocks are those of requests with the same
    # salt (and adapter) only, as vLLM's block hashes carry it.
    cache_salt: str | None = None
    # False: vLLM will not read this prompt from any cache (``gateway.request.
    # reads_prefix_cache``), so no worker's cached prefix is looked up for it.
    reads_prefix_cache: bool = True
    # The gateway's id for the request (its ``x-request-id`` answer header; the key of
    # ``GET /admin/routing/explain``); "" where none was given.
    request_id: str = ""

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def session_key(self) -> tuple[str, str] | None:
        """The named session scoped by its tenant (``A``'s ``alice`` is not ``B``'s), or None."""
        return None if self.session_id is None else (self.tenant, self.session_id)


@dataclass(frozen=True)
class LoadSnapshot:
    """A worker's load: the gateway's own in-flight count plus the last scrape of vLLM's metrics."""

    inflight: int = 0  # requests the gateway has open on this worker right now
    inflight_prompt_tokens: int = 0  # prompt tokens of those requests (prefill work queued)
    running: int = 0  # vllm:num_requests_running
    waiting: int = 0  # vllm:num_requests_waiting
    kv_usage_ratio: float = 0.0  # vllm:kv_cache_usage_perc, 0..1


@dataclass(frozen=True)
class Candidate:
    """A healthy worker that can serve the request."""

    worker_id: str  # the worker's base URL: unique, stable, and the metric label
    load: LoadSnapshot = field(default_factory=LoadSnapshot)
    cached_tokens: int = 0  # prompt tokens this worker is believed to hold in its KV cache
    # ... of which probably still being prefilled there by requests in flight (shared work)
    pending_cached_tokens: int = 0
    # prompt tokens past ``cached_tokens`` held only in a lower tier of the worker (vLLM's CPU
    # offload, ``--kv-offloading-size``): reloaded over the host link rather than recomputed
    lower_tier_cached_tokens: int = 0
    block_size_tokens: int | None = None
    saturated: bool = False  # ``Worker.saturated`` at the pool's saturation_inflight


@dataclass(frozen=True)
class Decision:
    worker_id: str
    reason: str  # prefix_hit, least_loaded, round_robin, affinity, spill ... (a metric label)
    predicted_cached_tokens: int = 0


class Policy(Protocol):
    """Chooses one candidate. Synchronous and free of I/O; ``candidates`` is never empty."""

    @property
    def name(self) -> str: ...

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision: ...

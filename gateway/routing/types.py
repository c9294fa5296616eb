"""The values routing works on: what is asked, who can serve it, and what was decided.

Pure data: no I/O, no FastAPI, no httpx. Policies receive a ``RoutingRequest`` and a sequence of
``Candidate`` (a worker's identity plus a snapshot of its load and of what it holds in KV cache)
and return a ``Decision``. Compiled with the request path (``gateway.native``); what the router
asks of a prefix index is in ``gateway.routing.index_like``, whose runtime-checkable protocols
mypyc cannot compile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True, init=False)
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

    def __init__(
        self, model: str, prompt_tokens: int, max_tokens: int, token_ids: tuple[int, ...] = (),
        session_id: str | None = None, stream: bool = False, tenant: str = "",
        owner: str | None = None, adapter: str | None = None, cache_salt: str | None = None,
        reads_prefix_cache: bool = True, request_id: str = "",
    ) -> None:
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "token_ids", token_ids)
        object.__setattr__(self, "session_id", session_id)
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "tenant", tenant)
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "adapter", adapter)
        object.__setattr__(self, "cache_salt", cache_salt)
        object.__setattr__(self, "reads_prefix_cache", reads_prefix_cache)
        object.__setattr__(self, "request_id", request_id)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.max_tokens

    @property
    def session_key(self) -> tuple[str, str] | None:
        """The named session scoped by its tenant (``A``'s ``alice`` is not ``B``'s), or None."""
        return None if self.session_id is None else (self.tenant, self.session_id)


@dataclass(frozen=True, init=False)
class LoadSnapshot:
    """A worker's load: the gateway's own in-flight count plus the last scrape of vLLM's metrics."""

    inflight: int = 0  # requests the gateway has open on this worker right now
    inflight_prompt_tokens: int = 0  # prompt tokens of those requests (prefill work queued)
    running: int = 0  # vllm:num_requests_running
    waiting: int = 0  # vllm:num_requests_waiting
    kv_usage_ratio: float = 0.0  # vllm:kv_cache_usage_perc, 0..1

    def __init__(
        self, inflight: int = 0, inflight_prompt_tokens: int = 0, running: int = 0,
        waiting: int = 0, kv_usage_ratio: float = 0.0,
    ) -> None:
        object.__setattr__(self, "inflight", inflight)
        object.__setattr__(self, "inflight_prompt_tokens", inflight_prompt_tokens)
        object.__setattr__(self, "running", running)
        object.__setattr__(self, "waiting", waiting)
        object.__setattr__(self, "kv_usage_ratio", kv_usage_ratio)


NO_LOAD = LoadSnapshot()
"""An idle worker's load (frozen: one instance serves as every default)."""


@dataclass(frozen=True, init=False)
class Candidate:
    """A healthy worker that can serve the request."""

    worker_id: str  # the worker's base URL: unique, stable, and the metric label
    load: LoadSnapshot = NO_LOAD
    cached_tokens: int = 0  # prompt tokens this worker is believed to hold in its KV cache
    # ... of which probably still being prefilled there by requests in flight (shared work)
    pending_cached_tokens: int = 0
    # prompt tokens past ``cached_tokens`` held only in a lower tier of the worker (vLLM's CPU
    # offload, ``--kv-offloading-size``): reloaded over the host link rather than recomputed
    lower_tier_cached_tokens: int = 0
    block_size_tokens: int | None = None
    saturated: bool = False  # ``Worker.saturated`` at the pool's saturation_inflight

    def __init__(
        self, worker_id: str, load: LoadSnapshot = NO_LOAD, cached_tokens: int = 0,
        pending_cached_tokens: int = 0, lower_tier_cached_tokens: int = 0,
        block_size_tokens: int | None = None, saturated: bool = False,
    ) -> None:
        object.__setattr__(self, "worker_id", worker_id)
        object.__setattr__(self, "load", load)
        object.__setattr__(self, "cached_tokens", cached_tokens)
        object.__setattr__(self, "pending_cached_tokens", pending_cached_tokens)
        object.__setattr__(self, "lower_tier_cached_tokens", lower_tier_cached_tokens)
        object.__setattr__(self, "block_size_tokens", block_size_tokens)
        object.__setattr__(self, "saturated", saturated)


@dataclass(frozen=True, init=False)
class Decision:
    worker_id: str
    reason: str  # prefix_hit, least_loaded, round_robin, affinity, spill ... (a metric label)
    predicted_cached_tokens: int = 0

    def __init__(self, worker_id: str, reason: str, predicted_cached_tokens: int = 0) -> None:
        object.__setattr__(self, "worker_id", worker_id)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "predicted_cached_tokens", predicted_cached_tokens)


class Policy(Protocol):
    """Chooses one candidate. Synchronous and free of I/O; ``candidates`` is never empty."""

    @property
    def name(self) -> str: ...

    def choose(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision: ...

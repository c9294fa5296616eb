"""One settings tree: a YAML file, overridden by ``KVGATE_*`` environment variables.

Every field is documented once, here (``Field(description=...)``); ``deploy/config.example.yaml``
carries the same text as comments. Nested fields are overridden with ``__``, e.g.
``KVGATE_LISTEN__PORT=9000`` or ``KVGATE_POOLS='[...]'`` (JSON for lists).

A bad config fails at start-up with a message naming the field (``ConfigError``).
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from gateway.kvmath import kv_dtype_bytes, load_model_arch


class ConfigError(ValueError):
    """The configuration is invalid; the message names the offending field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenSettings(_Strict):
    host: str = Field("127.0.0.1", description="Address the gateway listens on.")
    port: int = Field(8000, ge=1, le=65535, description="TCP port the gateway listens on.")
    processes: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description=(
            "Gateway processes serving the port (one accept socket, budgets, worker load, KV"
            " events and /metrics shared by all): an integer >= 1, or 'auto' for the number of"
            " usable cores (CPU affinity, capped by a container's CPU limit). 1 runs the gateway"
            " as one process with nothing shared."
        ),
    )

    def process_count(self) -> int:
        """``processes`` resolved: 'auto' is ``usable_cores()``."""
        return usable_cores() if self.processes == "auto" else self.processes


CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")


def usable_cores(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The cores this process may run on (its CPU affinity), capped by its cgroup's CPU quota
    (``docker run --cpus``, a Kubernetes CPU limit), which affinity does not show."""
    cores = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
        return max(1, min(cores, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 file, or "max": no quota
        return cores


class Runner(StrEnum):
    """What a model's workers run: vLLM's ``--runner`` (``auto`` resolves to one of these)."""

    GENERATE = "generate"  # chat, completions (and the generation routes of other parts)
    POOLING = "pooling"  # embeddings, score, rerank, classify, pooling


class AdapterSettings(_Strict):
    """A LoRA adapter of a model the gateway may load on that model's workers at run time."""

    name: str = Field(..., min_length=1, description="The adapter's served name (`model` clients send).")
    path: str = Field(
        ..., min_length=1,
        description="Where the workers read it (vLLM's `lora_path` of `/v1/load_lora_adapter`).",
    )


class ModelSettings(_Strict):
    name: str = Field(
        ..., min_length=1, description="Model name clients send in `model` (vLLM's served name)."
    )
    runner: Runner = Field(
        Runner.GENERATE,
        description=(
            "vLLM's `--runner` of this model's workers: `generate` serves the generation routes,"
            " `pooling` (an embedding, reranker or classifier model) the pooling routes; the"
            " other kind is refused with 400 before any worker is asked."
        ),
    )
    tokenizer: str = Field(
        "simple",
        description=(
            "Tokenizer and chat template source: a local directory with tokenizer files, a model id"
            " (fetched from the hub once, so only where the operator allows it), or `simple`"
            " (the deterministic tokenizer the simulated workers use)."
        ),
    )
    architecture: str | None = Field(
        None,
        description=(
            "KV arithmetic source for budgets: a kvmath preset name (e.g. `llama-3-8b`) or a path"
            " to the model's config.json. Defaults to the tokenizer directory's config.json."
        ),
    )
    kv_dtype: str = Field("auto", description="KV cache dtype: auto (the model's), fp8, fp16, bf16.")
    adapters: list[AdapterSettings] = Field(
        default_factory=list,
        description=(
            "LoRA adapters of this model the gateway loads on a worker (vLLM's"
            " `/v1/load_lora_adapter`, which needs `VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`) when"
            " a request names one that no healthy worker has loaded. Adapters the workers list"
            " in `/v1/models` are routed to whether listed here or not."
        ),
    )
    max_loaded_per_worker: int = Field(
        4, ge=1,
        description=(
            "The most of this model's adapters the gateway keeps loaded on one worker: a load"
            " beyond it first unloads the least recently routed adapter with no request in"
            " flight there, else the request is refused with 503."
        ),
    )

    @model_validator(mode="after")
    def _kv_arithmetic(self) -> ModelSettings:
        if self.architecture is not None:
            # Fail at start-up, naming the field, rather than on the first request.
            load_model_arch(self.architecture).kv_bytes_per_token(self.kv_dtype)
        else:
            kv_dtype_bytes(self.kv_dtype, 2)
        return self


class WorkerSettings(_Strict):
    url: str = Field(..., description="Base URL of a vLLM (or simulated) worker, e.g. http://10.0.0.5:8000.")
    kv_events_endpoint: str | None = Field(
        None,
        description=(
            "ZMQ endpoint of the worker's KV event publisher (`tcp://host:5557` to connect to a"
            " worker that binds; `tcp://*:5557` to bind here for a worker that connects)."
        ),
    )
    kv_replay_endpoint: str | None = Field(
        None, description="ZMQ endpoint of the worker's KV event replay socket, for gap recovery."
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError("must start with http:// or https://")
        if not urlsplit(v).hostname:
            raise ValueError("must name a host, e.g. http://10.0.0.5:8000")
        return v.rstrip("/")


class KvEventsSettings(_Strict):
    """What the gateway accepts from KV-event publishers (``gateway.kvindex.events``, ``peers``).

    Bind mode (``kv_events_endpoint: tcp://*:PORT``, the worker connects to the gateway): only the
    worker's own host (its URL's) and ``bind_peers`` may connect; a connection from elsewhere is
    refused before any of its messages is read. Connect mode needs no list: the gateway chooses
    whom it connects to.
    """

    max_message_bytes: ByteSize = Field(
        default=ByteSize(16 << 20), ge=1 << 10,
        description=(
            "Largest KV-event message taken from a publisher (integer or size: `16MiB`); a larger"
            " one drops that connection unread (the worker's entries start fresh). vLLM publishes"
            " one batch per engine step, about 0.7 MB for 128K tokens prefilled in one step."
        ),
    )
    bind_peers: list[str] = Field(
        default_factory=list,
        description=(
            "Bind mode: more addresses, CIDR networks (`10.0.0.0/8`) or host names allowed to"
            " connect besides each worker's own host, e.g. when workers connect through NAT or"
            " their URL names a load balancer."
        ),
    )
    lower_tiers: bool = Field(
        default=True,
        description=(
            "Keep blocks that workers' KV connectors report in a lower tier (vLLM's CPU offload,"
            " `--kv-offloading-size`: medium CPU) and route to them at their reload cost"
            " (pools[].kv_aware.cpu_reload_tokens_per_token); false: the GPU cache only."
        ),
    )

    @field_validator("bind_peers")
    @classmethod
    def _peers(cls, v: list[str]) -> list[str]:
        for spec in v:
            parse_peer(spec)
        return v


def parse_peer(spec: str) -> ipaddress.IPv4Network | ipaddress.IPv6Network | str:
    """One allowed KV-event peer: a network (an address is a /32 or /128), or a host name."""
    try:
        return ipaddress.ip_network(spec.strip("[]"), strict=False)
    except ValueError:
        if not spec or any(c.isspace() or c in "/:[]" for c in spec):
            raise ValueError(f"not an address, network or host name: {spec!r}") from None
        return spec


class TimeoutSettings(_Strict):
    connect_s: float = Field(
        5.0, gt=0,
        description="Connect timeout to a worker (a failure is retried on another worker).",
    )
    first_token_s: float = Field(
        300.0, gt=0,
        description=(
            "Streams: longest wait from forwarding the request to its first token (queueing +"
            " prefill). Past it: 504 upstream_timeout, and the worker's request is aborted."
        ),
    )
    read_s: float = Field(
        600.0, gt=0,
        description=(
            "Longest silence from a worker: between two chunks of a stream, or for a whole"
            " non-streamed answer. A stream past it ends with an error event."
        ),
    )


class KubernetesDiscoverySettings(_Strict):
    namespace: str = Field(..., min_length=1, description="Namespace of the workers' Service.")
    label_selector: str = Field(
        ..., min_length=1,
        description=(
            "Label selector of the workers' EndpointSlices, e.g."
            " `kubernetes.io/service-name=vllm-short`."
        ),
    )
    port_name: str | None = Field(
        "http", description="Named port of the OpenAI API in the slices (null: the first port)."
    )
    scheme: Literal["http", "https"] = Field("http", description="Scheme of the worker URLs.")
    kv_events_port: int | None = Field(
        None, ge=1, le=65535,
        description="Port of each worker's KV event publisher (vLLM binds tcp://*:PORT).",
    )
    kv_replay_port: int | None = Field(
        None, ge=1, le=65535, description="Port of each worker's KV event replay socket.",
    )
    api_url: str | None = Field(
        None,
        description=(
            "Kubernetes API server URL; null: in-cluster (service account token and CA)."
        ),
    )


class PolicyName(StrEnum):
    """The routing policies: a pool's ``policy`` value, the policy's ``name`` and its metric label.

    Defined here, once, because config validates it and sits below ``routing``;
    ``gateway.routing.policies`` maps each name to its class.
    """

    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    KV_AWARE = "kv_aware"


class HotPrefixSettings(_Strict):
    """Hot prefixes of a ``kv_aware`` pool: a prefix whose demand exceeds what its holders serve
    gets another holder deliberately (reason ``hot_prefix``); ``gateway/routing/hot.py`` gives
    the rule and why."""

    enabled: bool = Field(
        default=True,
        description=(
            "Grow extra holders for hot prefixes and keep the others on their holders through a"
            " transient queue (false: kv_aware's choice, exactly)."
        ),
    )
    min_prefix_tokens: int = Field(
        default=512, ge=16,
        description="Shorter cached prefixes are never replicated (cheap to recompute anyway).",
    )
    window_requests: int = Field(
        default=512, ge=16, le=1_000_000,
        description=(
            "A prefix's demand is its share of the pool's last ~N requests (exponentially"
            " decayed per request, so independent of the time scale)."
        ),
    )
    headroom: float = Field(
        default=0.25, ge=0, le=100,
        description=(
            "Grow a holder when the prefix's share x candidates exceeds holders x (1 + headroom)"
            " fair shares."
        ),
    )
    wait_fraction: float = Field(
        default=0.1, ge=0, le=1,
        description=(
            "... and only while the holder's wait beyond the idlest non-holder's is at least this"
            " fraction of recomputing the prefix there (kv_aware alone moves at 1)."
        ),
    )
    hold_margin: float = Field(
        default=3.0, ge=0, le=100,
        description=(
            "A prefix whose demand its holders cover leaves them for load only when the best"
            " holder's cost exceeds the alternative's by this many recomputes of the prefix"
            " (0: kv_aware's own rule, leave as soon as the wait beats one recompute)."
        ),
    )
    max_prefixes: int = Field(
        default=1024, ge=1, le=1_000_000,
        description="Prefixes whose demand is tracked (least recently seen dropped first).",
    )


class KvAwareSettings(_Strict):
    """Weights of the ``kv_aware`` cost, in prefill-token equivalents.

    ``gateway/routing/kv_aware.py`` gives the cost function and the reason for each default.
    """

    uncached_weight: float = Field(
        default=1.0, ge=0,
        description="Cost of one prompt token the worker does not hold in its KV cache.",
    )
    queued_prefill_weight: float = Field(
        default=1.0, ge=0,
        description=(
            "Cost of one token of prefill the gateway already has in flight on the worker"
            " (uncached prompt tokens of requests still waiting for their first token)."
        ),
    )
    active_request_tokens: float = Field(
        default=64.0, ge=0,
        description="Cost of each request open on the worker (decode load), in prompt tokens.",
    )
    kv_pressure_weight: float = Field(
        default=1.0, ge=0,
        description=(
            "KV-pressure penalty, in multiples of the prompt, at kv_hard_limit; it ramps up"
            " linearly from 0 at kv_soft_limit."
        ),
    )
    kv_soft_limit: float = Field(
        default=0.80, ge=0, le=1,
        description="KV usage ratio (0..1) where the KV-pressure penalty starts.",
    )
    kv_hard_limit: float = Field(
        default=0.95, ge=0, le=1,
        description=(
            "KV usage ratio (0..1) where the penalty is full; workers at or above it are avoided"
            " unless every candidate is."
        ),
    )
    tie_tolerance_tokens: float = Field(
        default=1.0, ge=0,
        description=(
            "Costs within this many tokens of the cheapest are ties: fewest requests in flight"
            " wins, then the session's own worker (rendezvous hash), then rotation."
        ),
    )
    cpu_reload_tokens_per_token: float = Field(
        default=0.16, gt=0, lt=1,
        description=(
            "Cost of one prompt token a worker holds only in a lower KV tier (vLLM's CPU"
            " offload), as a fraction of recomputing it: KV bytes per token / host-link"
            " bytes/s x prefill tokens/s (gateway.routing.kv_aware.reload_tokens_per_token)."
            " The default is Llama-3-8B on an H100 over a 25 GB/s link; never free (> 0),"
            " never a full miss (< 1)."
        ),
    )
    hot_prefix: HotPrefixSettings = Field(default_factory=HotPrefixSettings)

    @model_validator(mode="after")
    def _limits(self) -> KvAwareSettings:
        if self.kv_soft_limit >= self.kv_hard_limit:
            raise ValueError(
                f"kv_soft_limit ({self.kv_soft_limit}) must be below kv_hard_limit"
                f" ({self.kv_hard_limit})"
            )
        return self


class AffinitySettings(_Strict):
    """Session affinity of a pool; ``gateway/routing/affinity.py`` gives the rule and why.

    ``affinity: session`` is short for ``affinity: {by: session}``.
    """

    by: Literal["none", "session"] = Field(
        default="none",
        description=(
            "`session`: a request naming a session (X-Session-ID, else `user`; scoped by its"
            " tenant) goes to the worker that served that session before, while that worker is"
            " healthy, not saturated and, with kv_aware, within tolerance_tokens of the"
            " cheapest; the decision reason is then `affinity`. `none`: the policy alone."
        ),
    )
    tolerance_tokens: float = Field(
        default=1024.0, ge=0,
        description=(
            "kv_aware only: the session's worker keeps it while its cost is at most this many"
            " prefill-token equivalents above the cheapest candidate's."
        ),
    )
    max_sessions: int = Field(
        default=65536, gt=0,
        description=(
            "Sessions whose worker each gateway process remembers (least recently used"
            " forgotten first; a forgotten session goes to its rendezvous-hash worker)."
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, v: Any) -> Any:
        return {"by": v} if isinstance(v, str) else v


MAX_SLO_MS = 3_600_000.0
"""The largest latency objective accepted (one hour), in a header or the config."""


class SloSettings(_Strict):
    """Latency objectives of a pool and the calibration of their predictions;
    ``gateway/routing/slo.py`` gives the model, the selection and why."""

    ttft_ms: float | None = Field(
        default=None, gt=0, le=MAX_SLO_MS,
        description=(
            "TTFT objective of a request that names none (no x-slo-ttft-ms header, no key"
            " default): routing prefers workers predicted to meet it. null: none."
        ),
    )
    tpot_ms: float | None = Field(
        default=None, gt=0, le=MAX_SLO_MS,
        description="TPOT objective of a request that names none, as ttft_ms. null: none.",
    )
    shed: list[Priority] = Field(
        default_factory=lambda: [Priority.BATCH],
        description=(
            "Priority classes refused (503 slo_unattainable, Retry-After) when no worker is"
            " predicted to meet their objective; the other classes are served best-effort where"
            " the policy sends them. []: never refuse."
        ),
    )
    ttft_base_ms: float = Field(
        default=20.0, ge=0,
        description=(
            "Prior of a worker's TTFT model before it has observations: TTFT at zero cost"
            " (routing to first token, ms)."
        ),
    )
    ttft_ms_per_cost_unit: float = Field(
        default=0.05, ge=0,
        description=(
            "Prior TTFT per kv_aware cost unit (one prompt token to prefill), ms; 0.05: an"
            " 8B model on one H100 (~20K prefill tokens/s)."
        ),
    )
    tpot_base_ms: float = Field(
        default=8.0, ge=0, description="Prior TPOT of a worker whose batch is this one request, ms."
    )
    tpot_ms_per_request: float = Field(
        default=0.25, ge=0, description="Prior TPOT added by each request in the worker's batch, ms."
    )
    half_life_requests: int = Field(
        default=64, gt=0,
        description="Calibration: an observation's weight halves after this many newer ones.",
    )
    warm_after_requests: int = Field(
        default=8, gt=0,
        description=(
            "A worker with fewer observations predicts with its pool's warm workers' mean"
            " model (or the prior when none is warm)."
        ),
    )


class PoolSettings(_Strict):
    name: str = Field(..., min_length=1, description="Pool name (a metric label).")
    max_context_tokens: int = Field(
        ..., gt=0, description="Largest prompt + max output tokens this pool's workers accept."
    )
    policy: PolicyName = Field(
        PolicyName.LEAST_LOADED,
        description="Routing policy inside the pool.",
    )
    kv_aware: KvAwareSettings = Field(
        default_factory=KvAwareSettings,
        description="Weights of the kv_aware policy; read only when `policy` is kv_aware.",
    )
    affinity: AffinitySettings = Field(
        default_factory=AffinitySettings,
        description="Session affinity on top of the policy (any policy); off by default.",
    )
    slo: SloSettings = Field(
        default_factory=SloSettings,
        description="Latency objectives (x-slo-ttft-ms / x-slo-tpot-ms) and their calibration.",
    )
    workers: list[WorkerSettings] = Field(
        default_factory=list,
        description=(
            "The pool's static workers: the workers that answer clients (with prefill_workers"
            " set, its decode workers)."
        ),
    )
    prefill_workers: list[WorkerSettings] = Field(
        default_factory=list,
        description=(
            "Prefill workers of a disaggregated pool (vLLM with a KV connector, e.g."
            " NixlConnector): for each chat or completions request one of them computes the"
            " prompt's KV (max_tokens 1, kv_transfer_params do_remote_decode), and the decode"
            " worker chosen among `workers` pulls it and generates. Never sent a client's request"
            " directly; empty: the pool is not disaggregated."
        ),
    )
    discovery: KubernetesDiscoverySettings | None = Field(
        None,
        description=(
            "Find (more) workers from Kubernetes EndpointSlices, watched as pods come, go and"
            " turn ready; added to the static list."
        ),
    )
    prefill_discovery: KubernetesDiscoverySettings | None = Field(
        None,
        description=(
            "Find (more) prefill workers from Kubernetes EndpointSlices, as `discovery` finds"
            " the pool's workers (a selector of the prefill pods, e.g. llm-d's"
            " `llm-d.ai/role=prefill`); set: the pool is disaggregated."
        ),
    )
    remote_prefill_min_tokens: int = Field(
        0, ge=0,
        description=(
            "A disaggregated pool computes a request's prompt on a prefill worker only when at"
            " least this many of its tokens are not predicted cached on the decode worker chosen;"
            " a shorter remainder (a short chat, or the new turn of a conversation whose earlier"
            " turns that decode worker holds) is computed by the decode worker itself, as a"
            " colocated worker would, without the second round trip nor a place in the prefill"
            " workers' queue. 0: every request is prefilled remotely."
        ),
    )
    timeouts: TimeoutSettings | None = Field(
        None, description="This pool's timeouts, replacing the top-level `timeouts` section.",
    )
    max_inflight_per_worker: int | None = Field(
        None, gt=0,
        description=(
            "Hard cap on requests this gateway keeps in flight on one worker of the pool; when"
            " every worker is at it (and none can spill), 503 pool_saturated. null: no cap."
        ),
    )
    saturation_inflight: int = Field(
        32,
        gt=0,
        description=(
            "A worker is saturated when the gateway has this many requests in flight on it (or"
            " vLLM reports requests waiting). When every worker of a pool is saturated, requests"
            " may spill to the next larger pool (see routing.spill)."
        ),
    )
    upstream_api_key_env: str | None = Field(
        None, min_length=1,
        description=(
            "Name of an environment variable holding the API key this pool's workers require"
            " (`vllm serve --api-key`): sent as `Authorization: Bearer` on forwarded requests and"
            " on /v1/models reads (vLLM leaves /health and /metrics open). The key itself is never"
            " written in config or logs; a client's own Authorization header is never forwarded."
        ),
    )
    upstream_api_key_file: str | None = Field(
        None, min_length=1,
        description=(
            "Path of a file holding that key instead (e.g. a mounted Kubernetes Secret); surrounding"
            " whitespace is dropped. At most one of upstream_api_key_env and upstream_api_key_file."
        ),
    )
    # Read once, when the settings are built (a missing key fails at start-up, naming the field),
    # into the header every request to the pool sends; private: no dump or repr shows it.
    _upstream_headers: dict[str, str] = PrivateAttr(default_factory=dict)

    @field_validator("workers", "prefill_workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        # A bare URL string is shorthand for {url: ...}.
        if isinstance(v, list):
            return [{"url": w} if isinstance(w, str) else w for w in v]
        return v

    @model_validator(mode="after")
    def _disaggregation(self) -> PoolSettings:
        if self.disaggregated and not self.workers and self.discovery is None:
            raise ValueError(
                "a pool with prefill workers (prefill_workers, prefill_discovery) needs decode"
                " workers (`workers` or `discovery`): prefill workers never answer a client")
        return self

    @property
    def disaggregated(self) -> bool:
        """Prefill and decode on different workers (``gateway.upstream.disagg``)."""
        return bool(self.prefill_workers) or self.prefill_discovery is not None

    @model_validator(mode="after")
    def _read_upstream_api_key(self) -> PoolSettings:
        env, path = self.upstream_api_key_env, self.upstream_api_key_file
        if env is not None and path is not None:
            raise ValueError("set upstream_api_key_env or upstream_api_key_file, not both")
        key: str | None = None
        if env is not None:
            key = os.environ.get(env)
            if not key:
                raise ValueError(f"upstream_api_key_env: environment variable {env} is not set")
        elif path is not None:
            try:
                key = Path(path).read_text().strip()
            except OSError as exc:
                raise ValueError(
                    f"upstream_api_key_file: cannot read {path}: {exc.strerror}") from None
            if not key:
                raise ValueError(f"upstream_api_key_file: {path} is empty")
        if key is not None:
            self._upstream_headers = {"authorization": f"Bearer {key}"}
        return self

    @property
    def upstream_headers(self) -> Mapping[str, str]:
        """The headers that authenticate the gateway to this pool's workers (none without a key)."""
        return self._upstream_headers


class RoutingSettings(_Strict):
    spill: bool = Field(
        True,
        description=(
            "Allow a request to move to the next larger pool when every worker of its own pool is"
            " saturated. Never from a larger pool to a smaller one."
        ),
    )
    resume_streams: bool = Field(
        False,
        description=(
            "When a worker dies in the middle of a chat stream (n = 1), continue it on another"
            " worker of the pool (the conversation plus the partial answer, vLLM's"
            " continue_final_message) and splice the streams, so the client sees one response."
            " Off: the stream ends with an error event."
        ),
    )
    default_max_tokens: int = Field(
        1024,
        gt=0,
        description=(
            "Output limit of a chat request that gives neither max_completion_tokens nor"
            " max_tokens: the gateway selects the pool and reserves the budget for it and writes"
            " it into the forwarded body as max_completion_tokens, so vLLM stops there instead"
            " of generating up to the rest of the context. Completions follow vLLM's own"
            " default (16) and are forwarded unchanged."
        ),
    )
    response_owners_max: int = Field(
        100_000,
        gt=0,
        description=(
            "Stored Responses whose worker (the one holding the conversation) each gateway"
            " process remembers per tenant with the memory budget store, least recently used"
            " forgotten first (one tenant's responses never push out another's); a forgotten"
            " one answers 404 to previous_response_id, as vLLM does for an unknown id."
        ),
    )
    response_owner_ttl_s: int = Field(
        86_400,
        gt=0,
        description=(
            "With the Redis budget store: how long the owner of a stored response is kept in"
            " Redis (shared by every gateway), from when the response was made."
        ),
    )
    explain_requests: int = Field(
        4096,
        ge=0,
        le=1_000_000,
        description=(
            "Routed requests each gateway process remembers for GET /admin/routing/explain"
            " (pool, policy, reason, each candidate's cached tokens and cost, the fleet's best,"
            " what vLLM delivered, where the lost tokens went), oldest forgotten first; about"
            " 1 KB each with 8 candidates. 0: none kept (the hit accounting metrics still count)."
        ),
    )


class HealthSettings(_Strict):
    interval_s: float = Field(2.0, gt=0, description="Active health check period (GET /health).")
    timeout_s: float = Field(1.0, gt=0, description="Health check timeout.")
    healthy_threshold: int = Field(
        1, ge=1, description="Consecutive successes that mark a down worker up."
    )
    unhealthy_threshold: int = Field(
        2, ge=1, description="Consecutive failures (checks or connection errors) that mark it down."
    )
    breaker_open_s: float = Field(
        5.0, ge=0,
        description=(
            "A worker marked down stays out this long at least; then passing health checks let"
            " one trial request through (half-open) before it takes traffic again."
        ),
    )
    scrape_interval_s: float = Field(
        5.0, gt=0, description="Period of the scrape of each worker's /metrics."
    )


class Priority(StrEnum):
    """The priority classes of the admission queue (``gateway.overload``): a key's ``priority``,
    the ``X-Priority`` header's values. Interactive is served first; batch keeps a bounded share."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class GatewayLimitSettings(_Strict):
    """Limits on the gateway as a whole (per-session limits are ``budgets``)."""

    max_body_bytes: int = Field(
        16 * 1024 * 1024, gt=0, description="Largest request body accepted (413 beyond)."
    )
    client_keep_alive_s: float = Field(
        75.0, gt=0,
        description=(
            "A client's idle keep-alive connection is closed after this long (nginx's default)."
            " Keep it above the idle expiry of the clients' connection pools (httpx and the"
            " openai client 5 s, aiohttp 15 s) and of a load balancer in front (AWS ALB 60 s):"
            " a request sent on a connection the gateway is closing fails in the client (a"
            " reset), and a POST is not retried. uvicorn (vLLM's server) closes at 5 s."
        ),
    )
    max_inflight_requests: int = Field(
        2048, gt=0,
        description="Completions this gateway serves at once; more wait in the queue.",
    )
    max_queued_requests: int = Field(
        1024, ge=0,
        description="Completions that may wait for a slot; beyond: 503 gateway_overloaded.",
    )
    queue_timeout_s: float = Field(
        10.0, gt=0,
        description="Longest wait in the queue; then 503 gateway_overloaded with Retry-After.",
    )
    tokenize_timeout_s: float = Field(
        10.0, gt=0,
        description=(
            "Longest the gateway renders the chat template and tokenizes one prompt; then 400"
            " prompt_timeout (gateway/prompt/limits.py: checked as the template renders and"
            " before encoding, so the tokenizing thread stops there)."
        ),
    )
    fair_queuing: bool = Field(
        True,
        description=(
            "Serve the queue in weighted fair order across tenants by the KV byte-seconds they"
            " hold, interactive before batch (gateway/overload.py). false: first come first"
            " served, whoever floods."
        ),
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description=(
            "Fair-share weight per tenant (API-key name, or `anonymous`); 1 when not listed. A"
            " tenant of weight 2 is served twice the KV byte-seconds of one of weight 1."
        ),
    )
    batch_share: float = Field(
        0.1, gt=0, le=0.5,
        description=(
            "Share of the slots freed while interactive and batch requests both wait that goes"
            " to batch, so batch never starves under interactive load."
        ),
    )
    long_prompt_tokens: int = Field(
        0, ge=0,
        description=(
            "A prompt of this many tokens or more is a long prefill (4096 is a good start: ~0.13"
            " s for an 8B model on an H100, several short chats' TTFT): while another tenant"
            " sends shorter prompts, long ones start only while their pool keeps more than"
            " `reserve_workers` workers free of long prefills, and wait in the fair queue"
            " otherwise (gateway/overload.py, \"room for the others\"). A non-streamed request"
            " counts as prefilling until it ends (the gateway sees no first token), so tenants"
            " sending long prompts unstreamed get at most the pool's workers less the reserve"
            " of them in flight while others are active. 0 (default): off."
        ),
    )
    reserve_workers: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto",
        description=(
            "Workers per pool kept free of long prefills for other tenants' short requests while"
            " those are active (at most the pool's healthy workers less one): an integer >= 0,"
            " or 'auto' (default) to size it from the short requests the gate sees in flight in"
            " the pool, smoothed over `active_window_s`: one worker per short request in flight"
            " on average, with hysteresis, at least 1 while others are active and at most"
            " their weighted share of the pool (gateway/overload.py, \"the size of the"
            " reserve\")."
        ),
    )
    active_window_s: float = Field(
        5.0, gt=0,
        description=(
            "A tenant is active (others' long prompts keep room for it) for this long after it"
            " sent a prompt shorter than `long_prompt_tokens`."
        ),
    )
    guaranteed_share: bool = Field(
        False,
        description=(
            "With fair_queuing: an interactive request of a tenant holding less than its share"
            " (its weight over the weights of the tenants with requests in flight or queued) of"
            " max_inflight_requests or of the KV bytes held in flight enters at once even when"
            " every slot is taken, so a short chat never waits for slots a flood of long prompts"
            " holds (requests in flight may then reach twice max_inflight_requests). false: a"
            " full gate queues everyone (gateway/overload.py)."
        ),
    )

    @field_validator("reserve_workers", mode="before")
    @classmethod
    def _reserve(cls, v: object) -> object:
        """One line naming both forms, instead of one error per member of the union."""
        if isinstance(v, str) and v.strip().isdigit():  # from an environment variable
            return int(v)
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            return v
        raise ValueError(f"must be an integer >= 0 or 'auto', not {v!r}")

    @field_validator("tenant_weights")
    @classmethod
    def _weights(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [name for name, w in v.items() if not w > 0]
        if bad:
            raise ValueError(f"weights must be > 0: {bad}")
        return v


StoreKind = Literal["memory", "redis"]
REDIS_URL_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://")
OutagePolicy = Literal["fail_open", "fail_closed"]


class LimitSettings(BaseModel):
    """One set of limits, of a session or of a tenant (the sum over its sessions); every field
    ``null`` (unlimited) unless set. The descriptions say "session"; at the tenant level each
    limit applies to the sum over all the tenant's sessions."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_kv_bytes: ByteSize | None = Field(
        default=None,
        description=(
            "Largest KV footprint one request may have: (prompt + max output tokens) x the "
            "model's KV bytes per token. A larger request is refused with 400 "
            "kv_request_too_large. null: unlimited."
        ),
    )
    inflight_kv_bytes: ByteSize | None = Field(
        default=None,
        description=(
            "Most KV bytes a session may hold in flight (sum of the footprints of its requests "
            "being served). Over it: 429 kv_budget_exceeded with Retry-After. A single request "
            "larger than this can never fit: 400. null: unlimited."
        ),
    )
    inflight_requests: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Most requests a session may have in flight. Over it: 429 rate_limit_exceeded. "
            "null: unlimited."
        ),
    )
    kv_byte_seconds: ByteSize | None = Field(
        default=None,
        description=(
            "KV byte-seconds a session may burn per window_s: a token bucket of this capacity, "
            "refilled continuously at kv_byte_seconds / window_s per second and charged "
            "kv_bytes x seconds held when each request ends. Empty: 429 "
            "kv_byte_seconds_exceeded. Accepts units (e.g. 2TiB meaning 2 TiB-seconds). "
            "null: unlimited."
        ),
    )
    requests_per_minute: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Requests a session may start per minute (a token bucket refilled continuously). "
            "Over it: 429 rate_limit_exceeded. null: unlimited."
        ),
    )
    tokens_per_minute: int | None = Field(
        default=None,
        ge=0,
        description=(
            "Tokens (prompt + max output tokens, refunded down to the actual count at release) "
            "a session may reserve per minute. Over it: 429 rate_limit_exceeded; a single "
            "request above it: 400. null: unlimited."
        ),
    )


class SessionLimitSettings(LimitSettings):
    """Per-session limits, and under ``tenant`` the limits of the sum over a tenant's sessions."""

    tenant: LimitSettings = Field(
        default_factory=LimitSettings,
        description=(
            "Limits on a tenant (an API key, or `anonymous` when keys are off): the sum over all "
            "its sessions, so rotating session ids cannot buy more than this. Same fields as a "
            "session's; null: unlimited."
        ),
    )


class BudgetSettings(BaseModel):
    """KV budgets, rate limits and throttles per tenant and per session, and where their
    accounting lives.

    Identity is (tenant, session): the tenant is the API key's name (``anonymous`` when no keys
    are configured), the session an id scoped inside it. Each request is held to its session's
    limits (``defaults``) and to its tenant's, the sum over all its sessions
    (``defaults.tenant``). Byte fields accept integers or sizes with units (``"16GiB"``,
    ``"512 MiB"``, ``"2GB"``); ``null`` means unlimited. A ``per_key`` entry overrides only the
    fields it sets, at either level, so ``per_key: {batch: {inflight_kv_bytes: 64GiB}}`` keeps
    every other default, and an explicit ``null`` there lifts a default limit for that key
    (``gateway.budgets.models.limits_for``).

    Example::

        budgets:
          store: redis
          redis_url: redis://redis:6379/0
          outage_policy: fail_open
          defaults:
            inflight_kv_bytes: 16GiB
            kv_byte_seconds: 2TiB
            requests_per_minute: 120
            tenant: {inflight_kv_bytes: 64GiB, requests_per_minute: 600}
          per_key:
            batch-team: {inflight_kv_bytes: 64GiB, tenant: {inflight_kv_bytes: 256GiB}}
    """

    model_config = ConfigDict(extra="forbid")

    defaults: SessionLimitSettings = Field(
        default_factory=SessionLimitSettings,
        description=(
            "Limits for every session, and under `tenant` for every tenant (the sum over its "
            "sessions). A request without a session id is charged to its tenant's `default` "
            "session."
        ),
    )
    per_key: dict[str, SessionLimitSettings] = Field(
        default_factory=dict,
        description=(
            "Overrides keyed by API-key name (`anonymous`: the one tenant when keys are off); "
            "each overrides only the fields it sets, session and tenant level alike (an "
            "explicit null lifts a limit)."
        ),
    )
    store: StoreKind = Field(
        default="memory",
        description=(
            "Where accounting lives: 'memory' (this process only) or 'redis' (shared by every "
            "gateway; needs redis_url)."
        ),
    )
    redis_url: str | None = Field(
        default=None,
        description=(
            "Redis URL (redis://, rediss:// or unix://) when store is 'redis'. A Redis Cluster"
            " (or Valkey cluster): redis+cluster:// or rediss+cluster:// and any one node, e.g."
            " redis+cluster://redis-0.redis:6379; the client finds the others and follows"
            " resharding."
        ),
    )
    redis_key_prefix: str = Field(
        default="kvgate:budget",
        min_length=1,
        pattern=r"^[^{}]+$",
        description=(
            "Prefix of every Redis key the budget store writes (no braces: the tenant is the "
            "keys' Redis Cluster hash tag)."
        ),
    )
    redis_timeout_s: float = Field(
        default=1.0,
        gt=0,
        description=(
            "Connect and read timeout of one Redis call; past it Redis counts as unreachable "
            "and outage_policy applies."
        ),
    )
    redis_max_connections: int = Field(
        default=64,
        ge=1,
        description=(
            "Most connections this gateway opens to Redis; admissions beyond it wait for a free "
            "one (one admission holds a connection for one round trip)."
        ),
    )
    redis_pool_timeout_s: float = Field(
        default=2.0,
        gt=0,
        description=(
            "How long an admission waits for a free Redis connection before Redis counts as "
            "unavailable."
        ),
    )
    outage_policy: OutagePolicy = Field(
        default="fail_open",
        description=(
            "While Redis is unreachable: 'fail_open' keeps serving, enforcing budgets with a "
            "local in-memory store (per gateway, so a session may get up to N gateways x its "
            "budget); 'fail_closed' refuses admissions with 503 budget_store_unavailable. "
            "Either way the gateway probes Redis with backoff and switches back when it answers."
        ),
    )
    probe_initial_s: float = Field(
        default=0.5,
        gt=0,
        description="First delay between Redis reconnection probes; doubles up to probe_max_s.",
    )
    probe_max_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest delay between Redis reconnection probes.",
    )
    lease_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description=(
            "Lease of one reservation: a gateway renews the leases of its requests in flight "
            "every lease_ttl_s / 3; a reservation whose gateway died is reaped after this long."
        ),
    )
    auto_renew: bool = Field(
        default=True,
        description="Renew the leases of this gateway's reservations in a background task.",
    )
    window_s: float = Field(
        default=300.0,
        gt=0,
        description=(
            "Window of kv_byte_seconds: the bucket refills fully in window_s, so a session "
            "sustains kv_byte_seconds / window_s bytes held on average."
        ),
    )
    top_k: int = Field(
        default=20,
        ge=0,
        description=(
            "Sessions listed by GET /admin/sessions by default and exported in the "
            "kvgate_session_kv_bytes{tenant,session} gauge (most KV in flight first)."
        ),
    )

    @model_validator(mode="after")
    def _check_store(self) -> Self:
        if self.store == "redis":
            if not self.redis_url:
                raise ValueError("budgets.redis_url is required when budgets.store is 'redis'")
            if not self.redis_url.startswith(REDIS_URL_SCHEMES):
                raise ValueError(
                    "budgets.redis_url must start with redis://, rediss://, unix://,"
                    " redis+cluster:// or rediss+cluster://")
        if self.probe_max_s < self.probe_initial_s:
            raise ValueError("budgets.probe_max_s must be >= probe_initial_s")
        return self


class ApiKeySettings(_Strict):
    name: str = Field(
        ..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9._:@-]+$",
        description=(
            "The key's name: its tenant (every session of the key is scoped inside it), per-key"
            " budget overrides (budgets.per_key), the `tenant` label of metrics and alerts."
        ),
    )
    sha256: str = Field(
        ...,
        pattern=r"^[0-9a-f]{64}$",
        description=(
            "SHA-256 hex digest of the key (`printf %s \"$KEY\" | sha256sum`); the key itself is"
            " never stored."
        ),
    )
    priority: Priority = Field(
        Priority.INTERACTIVE,
        description=(
            "The class of this key's requests in the admission queue; `X-Priority: batch` may"
            " lower one request's, nothing raises it."
        ),
    )
    slo_ttft_ms: float | None = Field(
        default=None, gt=0, le=MAX_SLO_MS,
        description=(
            "TTFT objective of this key's requests that send no x-slo-ttft-ms header (before"
            " the pool's slo.ttft_ms). null: none."
        ),
    )
    slo_tpot_ms: float | None = Field(
        default=None, gt=0, le=MAX_SLO_MS,
        description="TPOT objective of this key's requests without x-slo-tpot-ms. null: none.",
    )
    isolate_prefix_cache: bool = Field(
        False,
        description=(
            "Give this key's prompts a prefix cache of their own: the gateway writes a"
            " `cache_salt` derived from the key's name (and the client's own `cache_salt`, if"
            " any) into each of its requests, so vLLM never serves them from blocks another"
            " key's requests computed, nor another key's from theirs: no prefix-cache timing"
            " side channel between keys, at the cost of no prefix hits across them. A client"
            " cannot choose another key's salt. The workers must take vLLM's `cache_salt` (vLLM"
            " 0.32 and `kvgate sim` do)."
        ),
    )
    models: list[str] | None = Field(
        None,
        description=(
            "The models this key may use, by the names clients send (served names, aliases,"
            " LoRA adapters: an adapter is a model of its own, not allowed with its base). Any"
            " other gets 404 model_not_found, as a model nobody serves (whether it exists is"
            " not told), on every route that names a model, /tokenize included, and"
            " /v1/models lists only these. null: every model."
        ),
    )


class AuthSettings(_Strict):
    api_keys: list[ApiKeySettings] = Field(
        default_factory=list,
        description=(
            "Client API keys (`Authorization: Bearer KEY`). Empty: no key is required. Otherwise"
            " every /v1 request needs one of them (401 without, 401 for an unknown key)."
        ),
    )

    @model_validator(mode="after")
    def _unique(self) -> AuthSettings:
        names = [k.name for k in self.api_keys]
        if len(set(names)) != len(names):
            raise ValueError(f"api_keys: duplicate key name in {names}")
        return self


class AdminSettings(_Strict):
    token: SecretStr | None = Field(
        None,
        description=(
            "Bearer token of the admin API (/admin/*), Alertmanager's webhook included. Unset:"
            " the admin API answers 403. Prefer KVGATE_ADMIN__TOKEN over writing it in a file."
        ),
    )
    metrics_token: SecretStr | None = Field(
        None,
        description=(
            "Bearer token Prometheus sends to scrape /metrics (`authorization: credentials_file:`"
            " in its scrape config); the admin token is taken too. Set: /metrics answers 401"
            " without it, since its top-K series carry tenants and session ids (often end users'"
            " ids). Unset: /metrics is open, as vLLM's is; a gateway with auth.api_keys warns at"
            " start. Prefer KVGATE_ADMIN__METRICS_TOKEN over writing it in a file."
        ),
    )
    ui_enabled: bool = Field(
        True,
        description=(
            "Serve the live status page at /ui (pools, workers, KV occupancy, top sessions). It"
            " needs no token; with auth.api_keys set, its tenants and sessions are shown only to"
            " the admin token (open /ui#token=TOKEN), since session ids are often end users'."
        ),
    )
    alert_throttle_ttl_s: float = Field(
        900.0, gt=0,
        description=(
            "How long a firing alert's throttle lasts unless Alertmanager repeats it (keep it above"
            " Alertmanager's repeat_interval) or resolves it."
        ),
    )


class ShutdownSettings(_Strict):
    drain_delay_s: float = Field(
        2.0, ge=0,
        description=(
            "After SIGTERM, /ready fails for this long (new requests are still served) before the"
            " gateway stops accepting connections: time for load balancers to notice."
        ),
    )
    grace_s: float = Field(
        30.0, ge=0,
        description="Then in-flight requests and streams get this long to finish before closing.",
    )


class ReplicaSettings(_Strict):
    """Several gateway replicas in front of the same workers (``gateway.kvindex.exchange``):
    what KV events cannot tell a replica, exchanged through Redis at a bounded rate, and the
    snapshot a starting replica fills its index from. Off by default."""

    exchange: bool = Field(
        default=False,
        description=(
            "Exchange routes (the blocks each replica just sent to a worker, before the worker's"
            " KV events confirm them: all of them without events) and per-worker load with the"
            " other replicas, and keep a snapshot of the index for replicas that start. Needs"
            " redis_url or budgets.redis_url."
        ),
    )
    redis_url: str | None = Field(
        default=None,
        description=(
            "Redis of the exchange (redis://, rediss://, unix://, or redis+cluster://: pub/sub"
            " then goes through the named node, PUBLISH reaching every node); default"
            " budgets.redis_url."
        ),
    )
    key_prefix: str = Field(
        default="kvgate:replicas", min_length=1,
        description="Prefix of the exchange's channel and keys; replicas that agree share it.",
    )
    interval_s: float = Field(
        default=0.025, gt=0, le=1.0,
        description="Routes and load are batched and published once per interval.",
    )
    max_bytes_per_s: ByteSize = Field(
        default=ByteSize(4 << 20), ge=1 << 10,
        description=(
            "Publishing cap per gateway process (integer or size: `4MiB`): routes beyond it are"
            " dropped (counted); load is always sent."
        ),
    )
    heartbeat_s: float = Field(
        default=1.0, gt=0,
        description="Load is published when it changes, and at least this often.",
    )
    peer_timeout_s: float = Field(
        default=3.0, gt=0,
        description="A peer replica silent this long no longer adds to the workers' load.",
    )
    max_message_bytes: ByteSize = Field(
        default=ByteSize(1 << 20), ge=1 << 10,
        description="Larger exchange messages are ignored (counted as malformed).",
    )
    snapshot: bool = Field(
        default=True,
        description=(
            "With exchange: one replica writes its index (per worker, the most recently used"
            " blocks) to Redis every snapshot_interval_s; a starting replica loads it before it"
            " reports ready."
        ),
    )
    snapshot_interval_s: float = Field(default=2.0, gt=0)
    snapshot_ttl_s: float = Field(
        default=60.0, gt=0, description="A snapshot not rewritten within this is dropped.")
    snapshot_max_blocks: int = Field(
        default=16_384, ge=1, description="Blocks per worker in a snapshot, most recent first.")
    snapshot_wait_s: float = Field(
        default=1.0, gt=0,
        description="Longest a starting replica waits for the snapshot (Redis down: it starts"
                    " cold).")
    timeout_s: float = Field(default=1.0, gt=0, description="Redis command timeout.")


class Settings(BaseSettings):
    """The whole configuration of one gateway process."""

    model_config = SettingsConfigDict(
        env_prefix="KVGATE_", env_nested_delimiter="__", extra="forbid", frozen=True
    )

    listen: ListenSettings = Field(default_factory=ListenSettings)  # type: ignore[arg-type]
    models: list[ModelSettings] = Field(..., min_length=1, description="Models served.")
    model_aliases: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "Client name -> served name (a model's or a configured adapter's): a request naming"
            " the alias is served as the served name, and answered with it, as OpenAI answers"
            " its own aliases."
        ),
    )
    pools: list[PoolSettings] = Field(..., min_length=1, description="Worker pools.")
    routing: RoutingSettings = Field(default_factory=RoutingSettings)  # type: ignore[arg-type]
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)  # type: ignore[arg-type]
    health: HealthSettings = Field(default_factory=HealthSettings)  # type: ignore[arg-type]
    kv_events: KvEventsSettings = Field(default_factory=KvEventsSettings)
    limits: GatewayLimitSettings = Field(default_factory=GatewayLimitSettings)  # type: ignore[arg-type]
    budgets: BudgetSettings = Field(default_factory=BudgetSettings)
    replicas: ReplicaSettings = Field(default_factory=ReplicaSettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    admin: AdminSettings = Field(default_factory=AdminSettings)  # type: ignore[arg-type]
    shutdown: ShutdownSettings = Field(default_factory=ShutdownSettings)  # type: ignore[arg-type]

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Environment first: KVGATE_* overrides what the YAML file says.
        return (env_settings, init_settings)

    @model_validator(mode="after")
    def _cross_checks(self) -> Settings:
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pools: duplicate pool name in {names}")
        models = [m.name for m in self.models]
        if len(set(models)) != len(models):
            raise ValueError(f"models: duplicate model name in {models}")
        adapters = [a.name for m in self.models for a in m.adapters]
        if len(set(adapters)) != len(adapters) or set(adapters) & set(models):
            raise ValueError(f"models: an adapter name is used twice or is a model's: {adapters}")
        for alias, served in self.model_aliases.items():
            if alias in models or alias in adapters:
                raise ValueError(f"model_aliases: {alias!r} is already a served name")
            if served not in models and served not in adapters:
                raise ValueError(f"model_aliases: {alias!r} names {served!r}, which is neither"
                                 " a model nor a configured adapter")
        seen: set[str] = set()
        for url in (w.url for p in self.pools for w in [*p.workers, *p.prefill_workers]):
            if url in seen:
                raise ValueError(f"pools: worker {url} appears twice (a worker belongs to one pool"
                                 " and has one role: prefill or not)")
            seen.add(url)
        if self.replicas.exchange and not (self.replicas.redis_url or self.budgets.redis_url):
            raise ValueError("replicas.exchange needs replicas.redis_url or budgets.redis_url")
        return self


def _format_error(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {loc}: {err['msg']}")
    return "invalid configuration:\n" + "\n".join(lines)


def build_settings(data: dict[str, Any]) -> Settings:
    try:
        return Settings(**data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc)) from None


def load_settings(path: str | Path | None) -> Settings:
    """Read the YAML file (if any) and apply the environment on top."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            raw = yaml.safe_load(p.read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if raw is None:
            raw = {}
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {p}: the top level must be a mapping")
        data = raw
    return build_settings(data)

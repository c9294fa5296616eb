"""vLLM's Prometheus metrics, one ``CollectorRegistry`` per simulated worker.

Names, label names and histogram buckets are vLLM 0.32's (``vllm/v1/metrics/loggers.py`` and
``buckets.py``): every series carries ``model_name`` (the served name) and ``engine="0"``, except
``vllm:cache_config_info`` whose labels are the cache config (vLLM gives it ``engine`` but no
``model_name``). Counters are ``prometheus_client`` counters, exposed with ``_total`` (and
``_created``) exactly like vLLM's.

A worker with a KV connector (``kv_role``) also has what vLLM 0.32 exports for the NIXL connector
(``ConnectorMetrics``): ``vllm:external_prefix_cache_queries``/``_hits`` (``loggers.py``),
``vllm:nixl_xfer_time_seconds``, ``vllm:nixl_bytes_transferred``,
``vllm:nixl_num_failed_transfers``, ``vllm:nixl_num_kv_expired_reqs`` (``nixl/stats.py``) and,
for the consumer roles, ``vllm:num_requests_kv_fetch_by_stage``.

Gauges (running, waiting, KV usage) are read from the scheduler at scrape time. Latencies are
wall-clock seconds as a client sees them: with ``time_scale`` 0.1 they are a tenth of the
modelled hardware's; divide by ``time_scale`` to get the latter.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TIME_TO_FIRST_TOKEN_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
INTER_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
NIXL_XFER_TIME_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
)  # fmt: skip
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))  # 2 KiB .. 8 GiB
KV_FETCH_STAGES = ("waiting_to_start", "in_progress", "completed_waiting")


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's 1-2-5 series capped at ``max_model_len``."""
    out: list[float] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_model_len:
                return out
            out.append(value)
        exponent += 1


class SimMetrics:
    """Every metric one worker exposes; ``render()`` is its ``/metrics`` body."""

    def __init__(
        self,
        model_name: str,
        *,
        block_size_tokens: int,
        num_gpu_blocks: int,
        max_model_len: int,
        gpu_memory_utilization: float = 0.9,
        enable_prefix_caching: bool = True,
        registry: CollectorRegistry | None = None,
        max_loras: int | None = None,
        kv_role: str | None = None,
    ) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        reg = self.registry
        names = ["model_name", "engine"]
        values = {"model_name": model_name, "engine": "0"}

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=reg).labels(**values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=reg).labels(**values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[float]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=reg).labels(**values)

        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [
                "block_size",
                "cache_dtype",
                "enable_prefix_caching",
                "gpu_memory_utilization",
                "num_gpu_blocks",
                "engine",
            ],
            registry=reg,
        )
        info.labels(
            block_size=str(block_size_tokens),
            cache_dtype="auto",
            enable_prefix_caching=str(enable_prefix_caching),
            gpu_memory_utilization=str(gpu_memory_utilization),
            num_gpu_blocks=str(num_gpu_blocks),
            engine="",
        ).set(1)
        if max_loras is not None:
            # vLLM has it only with LoRA enabled; the sim does not track which adapters run.
            Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                  ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=reg,
                  ).labels(max_lora=str(max_loras), waiting_lora_adapters="",
                           running_lora_adapters="").set_to_current_time()

        self.num_requests_running = gauge(
            "vllm:num_requests_running", "Number of requests in model execution batches."
        )
        self.num_requests_waiting = gauge(
            "vllm:num_requests_waiting", "Number of requests waiting to be processed."
        )
        self.kv_cache_usage_perc = gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."
        )
        self.prefix_cache_queries = counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
        )
        self.prefix_cache_hits = counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.num_preemptions = counter(
            "vllm:num_preemptions", "Cumulative number of preemption from the engine."
        )
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external)."
        )
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self._request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*names, "finished_reason"],
            registry=reg,
        )
        self._success_labels = values
        for reason in ("stop", "length", "abort"):
            self._request_success.labels(**values, finished_reason=reason)

        tokens_buckets = request_tokens_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens_buckets
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            tokens_buckets,
        )
        self.request_params_max_tokens = histogram(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            tokens_buckets,
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total",
            "Histogram of number of tokens per engine_step.",
            ITERATION_TOKENS_BUCKETS,
        )
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            TIME_TO_FIRST_TOKEN_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.request_time_per_output_token = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            INTER_TOKEN_LATENCY_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_queue_time = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_inference_time = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.request_decode_time = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        self.connector = (
            ConnectorMetrics(reg, names, values, consumer=kv_role in ("kv_consumer", "kv_both"))
            if kv_role is not None else None
        )

    def bind_gauges(
        self,
        running: Callable[[], float],
        waiting: Callable[[], float],
        kv_usage: Callable[[], float],
    ) -> None:
        self.num_requests_running.set_function(running)
        self.num_requests_waiting.set_function(waiting)
        self.kv_cache_usage_perc.set_function(kv_usage)

    def request_finished(
        self,
        *,
        finished_reason: str,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        max_tokens: int,
        e2e_s: float,
        queue_s: float,
        prefill_s: float,
        decode_s: float,
    ) -> None:
        self._request_success.labels(**self._success_labels, finished_reason=finished_reason).inc()
        self.request_prompt_tokens.observe(num_prompt_tokens)
        self.request_generation_tokens.observe(num_generation_tokens)
        self.request_params_max_tokens.observe(max_tokens)
        self.e2e_request_latency.observe(e2e_s)
        self.request_queue_time.observe(queue_s)
        self.request_inference_time.observe(prefill_s + decode_s)
        self.request_prefill_time.observe(prefill_s)
        self.request_decode_time.observe(decode_s)
        if num_generation_tokens > 1:
            self.request_time_per_output_token.observe(decode_s / (num_generation_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ConnectorMetrics:
    """What vLLM exports with the NIXL connector. Transfers are counted on the side that reads
    (the consumer), expired leases on the producer, as in vLLM."""

    def __init__(
        self, reg: CollectorRegistry, names: list[str], values: dict[str, str], *, consumer: bool
    ) -> None:
        self.external_prefix_cache_queries = Counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in "
            "terms of number of queried tokens.", names, registry=reg).labels(**values)
        self.external_prefix_cache_hits = Counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in "
            "terms of number of cached tokens.", names, registry=reg).labels(**values)
        self.xfer_time = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers.", names,
            buckets=NIXL_XFER_TIME_BUCKETS, registry=reg).labels(**values)
        self.bytes_transferred = Histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.", names,
            buckets=NIXL_BYTES_BUCKETS, registry=reg).labels(**values)
        self.failed_transfers = Counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers, including handshake and notification "
            "failures. NOTE: KV expiry is tracked separately in vllm:nixl_num_kv_expired_reqs.",
            names, registry=reg).labels(**values)
        self.kv_expired_reqs = Counter(
            "vllm:nixl_num_kv_expired_reqs",
            "Number of requests that had their KV expire. NOTE: This metric is tracked on the P "
            "instance.", names, registry=reg).labels(**values)
        self._fetch: dict[str, Gauge] = {}
        if consumer:
            fetch = Gauge(
                "vllm:num_requests_kv_fetch_by_stage",
                "Number of waiting requests by async KV load stage. Stage labels: "
                "'waiting_to_start' = needs an async KV load that has not started; "
                "'in_progress' = load started and not yet reported finished; "
                "'completed_waiting' = load finished, request not running yet.",
                [*names, "stage"], registry=reg)
            self._fetch = {stage: fetch.labels(**values, stage=stage) for stage in KV_FETCH_STAGES}
            for gauge in self._fetch.values():
                gauge.set(0)

    def bind_fetch_stages(
        self, in_progress: Callable[[], float], completed_waiting: Callable[[], float]
    ) -> None:
        """The sim starts a pull as soon as its request arrives: nothing waits to start."""
        if self._fetch:
            self._fetch["in_progress"].set_function(in_progress)
            self._fetch["completed_waiting"].set_function(completed_waiting)

"""One simulated vLLM worker: scheduler + engine loop + metrics + KV-event publisher + ASGI app,
and with a ``kv_role`` the KV connector of prefill/decode disaggregation (``kvtransfer``).

The worker does no I/O in its constructor; ``start()`` starts the engine task and binds the
publisher, ``stop()`` undoes both. The HTTP server around ``app`` is the fleet's business.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import zmq

from gateway.prompt.tokenizer import SIMPLE, PromptTokenizer, load_tokenizer
from gateway.sim.api import SimApp
from gateway.sim.config import SimWorkerConfig, resolve
from gateway.sim.costmodel import CostModel
from gateway.sim.engine import Bell, RequestStream, SimEngine
from gateway.sim.kvcache import KVEvent, SimLora
from gateway.sim.kvevents import KVEventPublisher
from gateway.sim.kvtransfer import KVTransfer
from gateway.sim.metrics import SimMetrics
from gateway.sim.scheduler import SamplingSpec, Scheduler, SchedulerConfig, request_seed

log = logging.getLogger(__name__)

_SIMPLE_EOS = 2
_SIMPLE_FIRST_ID = 16
_SIMPLE_VOCAB = 32000


class SimWorker:
    def __init__(
        self,
        config: SimWorkerConfig,
        *,
        tokenizer: PromptTokenizer | None = None,
        cost: CostModel | None = None,
        zmq_context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.config = config
        resources = resolve(config, cost)
        if resources.max_model_len < config.max_model_len:
            log.warning(
                "%s: max_model_len %d does not fit in %d blocks of %d tokens; using %d",
                config.model_name, config.max_model_len, resources.num_gpu_blocks,
                config.block_size_tokens, resources.max_model_len,
            )  # fmt: skip
        self.num_gpu_blocks = resources.num_gpu_blocks
        self.max_model_len = resources.max_model_len
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.tokenizer)
        self._simple = self.tokenizer.name == SIMPLE
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_gpu_blocks=resources.num_gpu_blocks,
                block_size_tokens=config.block_size_tokens,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                max_model_len=resources.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                record_events=config.kv_events,
                hash_seed=config.hash_seed,
                has_connector=config.kv_role is not None,
                cpu_offload_blocks=resources.cpu_offload_blocks,
                cpu_offload_self_describing_events=config.self_describing_kv_events,
                cpu_reload_s_per_token=resources.cpu_reload_s_per_token,
            )
        )
        self.metrics = SimMetrics(
            config.model_name,
            block_size_tokens=config.block_size_tokens,
            num_gpu_blocks=resources.num_gpu_blocks,
            max_model_len=resources.max_model_len,
            gpu_memory_utilization=config.gpu_memory_utilization,
            enable_prefix_caching=config.enable_prefix_caching,
            max_loras=(max(1, len(config.lora_modules))
                       if config.lora_modules or config.allow_runtime_lora_updating else None),
            kv_role=config.kv_role,
        )
        self.publisher: KVEventPublisher | None = None
        if config.kv_events:
            if zmq_context is None:
                raise ValueError("kv_events needs a zmq context")
            self.publisher = KVEventPublisher(
                zmq_context,
                config.kv_events_endpoint or "tcp://127.0.0.1:*",
                config.kv_replay_endpoint,
                topic=config.kv_events_topic,
            )
        self.kv_transfer: KVTransfer | None = None
        if config.kv_role is not None:
            self.kv_transfer = KVTransfer(
                self.scheduler,
                block_size_tokens=config.block_size_tokens,
                kv_bytes_per_token=resources.kv_bytes_per_token,
                bytes_per_s=config.kv_transfer_bytes_per_s,
                lease_s=config.kv_lease_duration_s,
                time_scale=config.time_scale,
                recompute_on_failure=config.kv_load_failure_policy == "recompute",
                engine_id=config.kv_engine_id,
                host=config.kv_transfer_host or "localhost",
                metrics=self.metrics.connector,
                wake=lambda: self.engine.wake(),
            )
        self.engine = SimEngine(
            self.scheduler,
            resources.cost,
            time_scale=config.time_scale,
            step_overhead_s=config.step_overhead_s,
            metrics=self.metrics,
            publish=self._publish if self.publisher is not None else None,
            on_held=self.kv_transfer.hold if self.kv_transfer is not None else None,
        )
        if self.kv_transfer is not None:
            kvt, sched = self.kv_transfer, self.scheduler
            # vLLM counts a request waiting for its remote KV as waiting (WAITING_FOR_REMOTE_KVS)
            self.metrics.bind_gauges(
                lambda: float(sched.num_running),
                lambda: float(sched.num_waiting + kvt.loading),
                lambda: sched.kv.pool.usage,
            )
            if self.metrics.connector is not None:
                self.metrics.connector.bind_fetch_stages(
                    lambda: float(kvt.loading),
                    lambda: float(sum(1 for r in sched.waiting if r.remote_kv)),
                )
        self.app = SimApp(self)
        self.started_at = time.time()
        self._text_cache: dict[int, str] = {}

    async def start(self) -> None:
        if self.publisher is not None:
            self.publisher.start()
        self.engine.start()
        self.started_at = time.time()

    def set_address(self, host: str, port: int) -> None:
        """Where this worker serves HTTP: what a producer puts in ``remote_host``/``remote_port``
        (``kv_transfer_host`` wins over ``host``)."""
        if self.kv_transfer is not None:
            self.kv_transfer.host = self.config.kv_transfer_host or host
            self.kv_transfer.port = port

    async def stop(self) -> None:
        await self.engine.stop()
        if self.kv_transfer is not None:
            await self.kv_transfer.close()
        if self.publisher is not None:
            await self.publisher.close()

    def _publish(self, events: Sequence[KVEvent]) -> None:
        assert self.publisher is not None
        self.publisher.publish(events)

    def kv_event_sources(self) -> dict[str, Any]:
        """vLLM's ``/kv_event_sources``: the publisher config per data-parallel rank."""
        pub = self.publisher
        if pub is None:
            return {}
        return {
            "0": {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": pub.endpoint,
                "replay_endpoint": pub.replay_endpoint,
                "buffer_steps": 10_000,
                "hwm": 100_000,
                "max_queue_size": 100_000,
                "topic": self.config.kv_events_topic,
            }
        }

    def submit(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        body: Mapping[str, Any],
        *,
        max_tokens: int,
        arrival_time: float | None = None,
        choice: int = 0,
        forced_token_ids: Sequence[int] = (),
        bell: Bell | None = None,
        lora: SimLora | None = None,
        cache_salt: str | None = None,
        skip_reading_prefix_cache: bool = False,
        kv_hold: bool = False,
        remote_kv: bool = False,
        remote_cached_tokens: int | None = None,
    ) -> RequestStream:
        """Queue a generation request; ``body`` supplies ``seed``, ``ignore_eos``, ``min_tokens``;
        ``choice`` (k of ``n``) gives each choice of one request its own tokens;
        ``forced_token_ids`` are the output a structured output forces (then EOS); ``bell``
        wakes the reader of several streams at once. ``kv_hold``: keep the blocks for a remote
        decode (``do_remote_decode``); ``remote_kv``: the prompt's KV was pulled, admit it as
        computed; ``remote_cached_tokens``: the producer's hit, reported in ``usage``;
        ``skip_reading_prefix_cache``: vLLM's, for a request that asked for its prompt's
        logprobs (``gateway.request.reads_prefix_cache``)."""
        seed = body.get("seed")
        min_tokens = body.get("min_tokens")
        sampling = SamplingSpec(
            max_tokens=max_tokens,
            min_tokens=min_tokens if isinstance(min_tokens, int) else 0,
            ignore_eos=bool(body.get("ignore_eos", False)),
            eos_probability=self.config.eos_probability,
            eos_token_id=_SIMPLE_EOS,
            seed=(request_seed(
                self.config.seed, seed if isinstance(seed, int) else None, prompt_token_ids
            ) + choice) & 0xFFFFFFFF,
            vocab_low=_SIMPLE_FIRST_ID,
            vocab_high=_SIMPLE_VOCAB,
            token_pool=() if self._simple else _token_pool(prompt_token_ids),
            forced_token_ids=tuple(forced_token_ids),
        )
        request = self.scheduler.new_request(request_id, prompt_token_ids, sampling, lora=lora,
                                             cache_salt=cache_salt)
        request.kv_hold = kv_hold
        request.skip_reading_prefix_cache = skip_reading_prefix_cache
        request.remote_kv = remote_kv
        request.remote_cached_tokens = remote_cached_tokens
        return self.engine.submit(request, arrival_time, bell)

    def token_choices(self, prompt_token_ids: Sequence[int]) -> Sequence[int]:
        """Ids known to be in the vocabulary: the simple tokenizer's whole range, else the
        prompt's own (a real tokenizer's size is not known here)."""
        if self._simple:
            return range(_SIMPLE_FIRST_ID, _SIMPLE_VOCAB)
        return _token_pool(prompt_token_ids)

    def token_text(self, token_id: int) -> str:
        """Text of one generated token (cached; the simple tokenizer's words are space-joined)."""
        text = self._text_cache.get(token_id)
        if text is None:
            piece = self.tokenizer.decode([token_id])
            text = " " + piece if self._simple and piece else piece
            if len(self._text_cache) < 100_000:
                self._text_cache[token_id] = text
        return text


def _token_pool(prompt_token_ids: Sequence[int]) -> tuple[int, ...]:
    """Valid ids of a real tokenizer without knowing its vocabulary: the prompt's own."""
    pool = tuple(sorted(set(prompt_token_ids)))
    return pool or (0,)

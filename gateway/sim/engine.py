"""The simulated worker's engine loop: continuous batching in (scaled) real time.

The loop, one task per worker:

1. sleep on an ``asyncio.Event`` while there is nothing to run (an idle worker costs no CPU);
2. ``Scheduler.schedule()`` picks this step's work (see ``gateway.sim.scheduler``);
3. the step's modelled duration (``gateway.sim.costmodel.step_time_s``) times ``time_scale`` is
   slept, against a running *ideal* clock: a step that starts late because the event loop was
   busy is shortened by the lateness, so over many steps throughput matches the model; a lag of
   more than ``max_lag_s`` (an overloaded host) is forgiven rather than caught up in a burst;
4. ``Scheduler.update_from_output()`` samples one token per request that finished its
   prefill or decoded; tokens are pushed to the requests' streams, metrics are updated, and the
   step's KV events are published as one batch.

Aborts (a client went away) that arrive while a step is in flight are applied after it, as vLLM
applies them between steps. Latency metrics use the wall clock at delivery, so they include the
loop's real overheads, as a client would see them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.sim.costmodel import CostModel, step_time_s
from gateway.sim.kvcache import KVEvent
from gateway.sim.metrics import SimMetrics
from gateway.sim.scheduler import FINISH_ABORT, Scheduler, SimRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    token_id: int
    finish_reason: str | None


class Bell:
    """Wakes one reader: of one stream, or of several (the choices of one HTTP request, read
    as their tokens come, in the order vLLM interleaves them)."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def ring(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None


class RequestStream:
    """Tokens of one request, from the engine to its HTTP handler."""

    __slots__ = (
        "_items",
        "arrival_time",
        "bell",
        "closed",
        "first_token_time",
        "last_token_time",
        "request",
        "scheduled_time",
    )

    def __init__(self, request: SimRequest, arrival_time: float, bell: Bell | None = None) -> None:
        self.request = request
        self._items: deque[TokenEvent] = deque()
        self.bell = Bell() if bell is None else bell
        self.closed = False
        self.arrival_time = arrival_time
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def push(self, event: TokenEvent) -> None:
        self._items.append(event)
        self.bell.ring()

    def close(self) -> None:
        self.closed = True
        self.bell.ring()

    def take(self) -> list[TokenEvent]:
        """The tokens produced since the last call, without waiting."""
        items = list(self._items)
        self._items.clear()
        return items

    async def next_batch(self) -> list[TokenEvent]:
        """Every token produced since the last call; empty once the request was aborted."""
        while not self._items:
            if self.closed:
                return []
            await self.bell.wait()
        return self.take()


class SimEngine:
    def __init__(
        self,
        scheduler: Scheduler,
        cost: CostModel,
        *,
        time_scale: float = 1.0,
        step_overhead_s: float = 0.0,
        metrics: SimMetrics | None = None,
        publish: Callable[[Sequence[KVEvent]], object] | None = None,
        max_lag_s: float = 0.05,
        on_held: Callable[[SimRequest], object] | None = None,
    ) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.scheduler = scheduler
        self.cost = cost
        self.time_scale = time_scale
        self.step_overhead_s = step_overhead_s
        self.metrics = metrics
        self.publish = publish
        self.max_lag_s = max_lag_s
        self.on_held = on_held
        """Called when a ``kv_hold`` request finishes with its blocks held (the lease starts)."""
        self._streams: dict[str, RequestStream] = {}
        self._pending_aborts: set[str] = set()
        self._in_step = False
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # Accounting, for benchmarks and tests.
        self.num_steps = 0
        self.num_lag_resets = 0
        """Times the loop fell more than ``max_lag_s`` behind the model and gave up catching up."""
        self._last_queries = 0
        self._last_hits = 0
        self._last_external_queries = 0
        self._last_external_hits = 0
        self._last_preemptions = 0
        if metrics is not None:
            kv = scheduler.kv.pool
            metrics.bind_gauges(
                lambda: float(scheduler.num_running),
                lambda: float(scheduler.num_waiting),
                lambda: kv.usage,
            )

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    # -- requests ---------------------------------------------------------------------------

    def submit(self, request: SimRequest, arrival_time: float | None = None,
               bell: Bell | None = None) -> RequestStream:
        stream = RequestStream(request, time.monotonic() if arrival_time is None else arrival_time,
                               bell)
        self.scheduler.add_request(request)
        self._streams[request.request_id] = stream
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        if request_id not in self._streams:
            return
        if self._in_step:
            self._pending_aborts.add(request_id)
        else:
            self._abort_now(request_id)

    def wake(self) -> None:
        """Let the loop look again: blocks were freed outside a step (a pulled or expired
        hold), so a request that did not fit may fit now."""
        self._wake.set()

    def reset_prefix_cache(self) -> bool:
        """Forget all cached blocks (only while idle). As in vLLM, the ``AllBlocksCleared`` event
        waits in the queue and goes out in the batch of the next step."""
        return self.scheduler.reset_prefix_cache()

    def _abort_now(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        request = self.scheduler.abort_request(request_id)
        if stream is None:
            return
        stream.close()
        if request is not None and self.metrics is not None:
            self._finish_metrics(stream, FINISH_ABORT, time.monotonic())

    # -- the loop ---------------------------------------------------------------------------

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        ideal_end: float | None = None
        while True:
            if not sched.has_unfinished():
                ideal_end = None
                self._wake.clear()
                await self._wake.wait()
                continue
            plan = sched.schedule()
            events = sched.take_events()
            if plan.empty:
                # Nothing fits (cannot happen for validated requests): wait for a change.
                self._flush_events(events)
                ideal_end = None
                self._wake.clear()
                await self._wake.wait()
                continue
            now = loop.time()
            for request in plan.admitted:
                stream = self._streams.get(request.request_id)
                if stream is not None and stream.scheduled_time is None:
                    stream.scheduled_time = now
            model_s = step_time_s(self.cost, plan, self.step_overhead_s,
                                  sched.config.cpu_reload_s_per_token)
            if ideal_end is not None and now - ideal_end > self.max_lag_s:
                self.num_lag_resets += 1
                if self.num_lag_resets == 1:
                    log.warning(
                        "simulated engine fell %.0f ms behind its model clock: the host cannot "
                        "keep up with time_scale=%g; latencies are inflated from here on",
                        (now - ideal_end) * 1e3,
                        self.time_scale,
                    )
                ideal_end = None
            start = now if ideal_end is None else ideal_end
            end = start + model_s * self.time_scale
            self._in_step = True
            try:
                delay = end - loop.time()
                # Always yield once, so HTTP handlers run even when steps take no time.
                await asyncio.sleep(delay if delay > 0 else 0)
            finally:
                self._in_step = False
            ideal_end = end
            self.num_steps += 1
            outputs = sched.update_from_output(plan)
            t = time.monotonic()
            metrics = self.metrics
            for out in outputs:
                if (
                    out.finish_reason is not None
                    and self.on_held is not None
                    and out.request.request_id in sched.held
                ):
                    self.on_held(out.request)
                stream = self._streams.get(out.request.request_id)
                if stream is None:
                    continue
                if metrics is not None:
                    if out.first_token:
                        metrics.time_to_first_token.observe(t - stream.arrival_time)
                        metrics.prompt_tokens.inc(out.request.num_prompt_tokens)
                        metrics.prompt_tokens_cached.inc(out.request.num_cached_tokens)
                    elif stream.last_token_time is not None:
                        metrics.inter_token_latency.observe(t - stream.last_token_time)
                    metrics.generation_tokens.inc()
                if stream.first_token_time is None:
                    stream.first_token_time = t
                stream.last_token_time = t
                stream.push(TokenEvent(out.token_id, out.finish_reason))
                if out.finish_reason is not None:
                    del self._streams[out.request.request_id]
                    if metrics is not None:
                        self._finish_metrics(stream, out.finish_reason, t)
            if metrics is not None:
                self._step_metrics(plan.num_scheduled_tokens)
            self._flush_events(events)
            if self._pending_aborts:
                for request_id in list(self._pending_aborts):
                    self._abort_now(request_id)
                self._pending_aborts.clear()

    def _flush_events(self, events: list[KVEvent]) -> None:
        if events and self.publish is not None:
            self.publish(events)

    def _step_metrics(self, num_tokens: int) -> None:
        metrics = self.metrics
        assert metrics is not None
        stats = self.scheduler.prefix_stats
        if stats.queries != self._last_queries:
            metrics.prefix_cache_queries.inc(stats.queries - self._last_queries)
            self._last_queries = stats.queries
        if stats.hits != self._last_hits:
            metrics.prefix_cache_hits.inc(stats.hits - self._last_hits)
            self._last_hits = stats.hits
        connector = metrics.connector
        if connector is not None:
            if stats.external_queries != self._last_external_queries:
                connector.external_prefix_cache_queries.inc(
                    stats.external_queries - self._last_external_queries)
                self._last_external_queries = stats.external_queries
            if stats.external_hits != self._last_external_hits:
                connector.external_prefix_cache_hits.inc(
                    stats.external_hits - self._last_external_hits)
                self._last_external_hits = stats.external_hits
        preemptions = self.scheduler.num_preemptions
        if preemptions != self._last_preemptions:
            metrics.num_preemptions.inc(preemptions - self._last_preemptions)
            self._last_preemptions = preemptions
        metrics.iteration_tokens.observe(num_tokens)

    def _finish_metrics(self, stream: RequestStream, reason: str, t: float) -> None:
        metrics = self.metrics
        assert metrics is not None
        req = stream.request
        scheduled = stream.scheduled_time if stream.scheduled_time is not None else t
        first = stream.first_token_time if stream.first_token_time is not None else t
        metrics.request_finished(
            finished_reason=reason,
            num_prompt_tokens=req.num_prompt_tokens,
            num_generation_tokens=req.num_output_tokens,
            max_tokens=req.sampling.max_tokens,
            e2e_s=t - stream.arrival_time,
            queue_s=scheduled - stream.arrival_time,
            prefill_s=first - scheduled,
            decode_s=t - first,
        )

"""A request's hold on its worker: the load it adds to that worker while it runs.

Policies choose by ``Worker.inflight`` and ``Worker.inflight_prompt_tokens`` (prefill queued on
the worker); a ``WorkerHold`` adds one request and its uncached prompt tokens when it is taken,
takes the prompt tokens back once prefill is done (the first token), and the request at
``release``. ``release`` acts once however often it is called, so the proxy's ``finally`` (and a
retry or resume that moves the request to another worker) may call it freely.

The ``kvgate_worker_inflight`` gauge follows the count through ``Metrics.backlog``, a moment
later (``gateway.backlog``): routing reads the count, only a scrape reads the gauge. One update
per worker waits there at a time (``Backlog.defer_latest``): it sets the count as of when it
runs, so the holds taken and released meanwhile need no update of their own.

Named a hold, not a lease: a lease in kvgate is the budget store's time-limited claim on a
reservation (``gateway.budgets``); this one has no expiry and lives in one process's memory.
"""

from __future__ import annotations

from gateway.metrics import Metrics
from gateway.workers.worker import Worker


class WorkerHold:
    __slots__ = ("_metrics", "_pool", "_prefill_tokens", "_prefilling", "_released", "_worker")

    def __init__(self, worker: Worker, pool: str, prefill_tokens: int, metrics: Metrics) -> None:
        self._worker = worker
        self._pool = pool
        self._metrics = metrics
        self._prefill_tokens = prefill_tokens  # prompt tokens the worker must compute
        self._prefilling = True
        self._released = False
        # the counts routing reads: at once; the gauge only a scrape reads: off the wave
        worker.inflight += 1
        worker.inflight_prompt_tokens += prefill_tokens
        metrics.backlog.defer_latest((pool, id(worker)), show_inflight, metrics, pool, worker)

    def prefill_done(self) -> None:
        if self._prefilling:
            self._prefilling = False
            self._worker.inflight_prompt_tokens -= self._prefill_tokens

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.prefill_done()
        worker = self._worker
        worker.inflight -= 1
        self._metrics.backlog.defer_latest((self._pool, id(worker)), show_inflight,
                                           self._metrics, self._pool, worker)


def show_inflight(metrics: Metrics, pool: str, worker: Worker) -> None:
    """``kvgate_worker_inflight`` of ``worker`` set to its in-flight count as of now (deferred
    to ``Metrics.backlog``, one at a time per worker: it shows the latest count whichever
    holds changed it since it was queued). Keyed by the worker object (``id``: the queued
    item keeps it alive), so a worker that left and came back under its url is updated too."""
    metrics.child(metrics.worker_inflight, pool, worker.url).set(worker.inflight)

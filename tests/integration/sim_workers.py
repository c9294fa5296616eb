"""Two simulated workers that tests can stop and start, and waiting on the gateway's view of them.

Shared by the affinity and Responses tests (each worker is a ``SimFleet`` of one on a fixed port,
so one can be stopped and started again while the other serves).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import httpx

from gateway import promtext
from gateway.procs.net import free_ports
from gateway.sim.config import SimWorkerConfig
from gateway.sim.fleet import SimFleet

MODEL = "sim"
CONFIG = SimWorkerConfig(model_name=MODEL, time_scale=0.25)


class Workers:
    """Simulated workers on fixed ports, each its own fleet on one background loop: two of
    ``config``, or one per entry of ``configs``."""

    def __init__(self, config: SimWorkerConfig = CONFIG, *,
                 configs: Sequence[SimWorkerConfig] | None = None) -> None:
        self._configs = list(configs) if configs is not None else [config, config]
        self.ports = free_ports(len(self._configs))
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._fleets: dict[str, SimFleet] = {}
        for url in self.urls:
            self.start(url)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def start(self, url: str) -> None:
        i = self.urls.index(url)
        fleet = SimFleet([self._configs[i]], ports=[self.ports[i]])
        self._run(fleet.start())
        self._fleets[url] = fleet

    def endpoints(self, url: str) -> tuple[str, str | None]:
        """The worker's KV event and replay endpoints (its config must publish events)."""
        pub = self._fleets[url].workers[0].publisher
        assert pub is not None
        return pub.endpoint, pub.replay_endpoint

    def stop(self, url: str) -> None:
        self._run(self._fleets.pop(url).stop())

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for url in list(self._fleets):
            self.stop(url)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


def one_event_worker(**fields: Any) -> Workers:
    """One simulated worker that publishes KV events (with replay, on free ports) and reports
    cached tokens in its usage: the gateway's index and vLLM's cache side by side."""
    return Workers(configs=[SimWorkerConfig(
        model_name=MODEL, time_scale=0.0, enable_prompt_tokens_details=True, kv_events=True,
        kv_events_endpoint="tcp://127.0.0.1:*", kv_replay_endpoint="tcp://127.0.0.1:*",
        **fields)])


def pool_of_one(workers: Workers, context_tokens: int) -> dict[str, Any]:
    """A ``kv_aware`` pool of ``workers``' one worker, subscribed to its events."""
    (url,) = workers.urls
    pub, replay = workers.endpoints(url)
    return {"name": "p", "max_context_tokens": context_tokens, "policy": "kv_aware",
            "workers": [{"url": url, "kv_events_endpoint": pub, "kv_replay_endpoint": replay}]}


def until_events_arrive(gateway: str, worker: str, send: Callable[[int], object]) -> None:
    """ZMQ's slow joiner: events published before the gateway's subscription reached the worker
    are lost, so ``send(n)`` (a prompt of its own each time) until the gateway has applied a
    batch from ``worker``."""
    from tests.harness import kv_event_batches

    n = 0
    while kv_event_batches(gateway).get(worker, 0) == 0:
        assert n < 300, f"no KV event from {worker} reached the gateway"
        send(n)
        n += 1
        time.sleep(0.1)


@contextmanager
def gateway_of_one(worker: Workers, context_tokens: int, warm: Callable[[str, int], object],
                   **settings: Any) -> Iterator[str]:
    """A gateway (in this process) with one pool of ``worker``'s one simulated worker, the
    ``simple`` tokenizer and ``settings`` besides; yielded once the worker is up and the
    gateway has applied a KV event batch of its (``warm(gateway, n)`` sends a prompt of its
    own each time, as ``until_events_arrive``)."""
    from gateway.app import create_app
    from gateway.config import build_settings
    from tests.harness import serve_app

    config = build_settings({
        "models": [{"name": "sim", "tokenizer": "simple"}],
        "pools": [pool_of_one(worker, context_tokens)],
        "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.2},
        **settings,
    })
    with serve_app(create_app(config), ready_path="/ready") as gw:
        wait_for(lambda: httpx.get(gw + "/ready").status_code == 200, "the worker up")
        until_events_arrive(gw, worker.urls[0], lambda n: warm(gw, n))
        yield gw


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def up(gateway: str, worker: str) -> bool:
    text = httpx.get(gateway + "/metrics").text
    return promtext.value(text, "kvgate_worker_up", worker=worker) == 1.0


def words(seed: int, n: int = 200) -> str:
    """About ``2 n`` tokens with the simple tokenizer (two per word), distinct per seed."""
    return " ".join(f"t{seed}x{i}" for i in range(n))


def ask(gateway: str, text: str, model: str = MODEL) -> tuple[str, int]:
    """The worker that served a one-token completion through the gateway, and the tokens it
    had cached (the simulator's ``prompt_tokens_details``)."""
    r = httpx.post(f"{gateway}/v1/completions",
                   json={"model": model, "prompt": text, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return r.headers["x-kvgate-worker"], int(details.get("cached_tokens") or 0)

"""Overload: the admission gate and the per-worker cap refuse early and recover fully (issue 7).

A held worker (answers a completion only when the test releases it) lets the test fill the
gateway exactly: with ``limits.max_inflight_requests: 2`` and ``max_queued_requests: 2``,

* queued requests reach the worker in the order they came, as slots free;
* a request beyond the queue is refused at once: 503 ``gateway_overloaded`` with Retry-After;
* a request that waits longer than ``queue_timeout_s`` is refused then, never forwarded;
* ``pools[].max_inflight_per_worker`` refuses with 503 ``pool_saturated`` and Retry-After;
* afterwards nothing is held: in-flight gauges at 0, the gate admits a full set again.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio
from starlette.types import Receive, Scope, Send

from gateway import promtext
from gateway.app import KvgateApp, create_app
from gateway.config import build_settings
from tests.harness import answer_probe, eventually, read_asgi_body, serve_app

pytestmark = pytest.mark.timeout(60)

QUEUE_TIMEOUT_S = 1.5
ADMIN = "admin-secret"


class HeldWorker:
    """Answers each completion only when ``release(tag)`` is called (tag: the body's ``tag``);
    records the order requests arrive in, and which requests' clients went away."""

    def __init__(self) -> None:
        self.arrivals: list[str] = []
        self.aborted: list[str] = []
        self._held: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Event]] = {}
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] not in ("/v1/chat/completions", "/v1/completions"):
            await answer_probe(scope, send)
            return
        raw = await read_asgi_body(receive)
        tag = str(orjson.loads(raw)["tag"])
        released = asyncio.Event()
        with self._lock:
            self._held[tag] = (asyncio.get_running_loop(), released)
            self.arrivals.append(tag)

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.aborted.append(tag)
            released.set()

        watcher = asyncio.create_task(watch())
        await released.wait()
        watcher.cancel()
        with self._lock:
            self._held.pop(tag, None)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": orjson.dumps({
            "id": tag, "object": "chat.completion", "created": 0, "model": "noop",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": tag},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})})

    def release(self, tag: str) -> None:
        with self._lock:
            loop, event = self._held[tag]
        loop.call_soon_threadsafe(event.set)

    def release_all(self) -> None:
        with self._lock:
            held = list(self._held.values())
        for loop, event in held:
            loop.call_soon_threadsafe(event.set)

    async def wait_arrivals(self, count: int, timeout_s: float = 30.0) -> list[str]:
        deadline = time.monotonic() + timeout_s
        while len(self.arrivals) < count:
            assert time.monotonic() < deadline, f"arrivals {self.arrivals}, wanted {count}"
            await asyncio.sleep(0.01)
        return list(self.arrivals)


def gateway_settings(worker_urls: list[str], **pool: Any) -> Any:
    return build_settings({
        "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "workers": worker_urls, **pool}],
        "health": {"interval_s": 60},
        "limits": {"max_inflight_requests": 2, "max_queued_requests": 2,
                   "queue_timeout_s": QUEUE_TIMEOUT_S},
        "budgets": {"defaults": {"inflight_kv_bytes": "64GiB"}},
        "admin": {"token": ADMIN},
    })


@pytest.fixture(scope="module")
def held() -> HeldWorker:
    return HeldWorker()


@pytest.fixture(scope="module")
def gated(held: HeldWorker) -> Iterator[tuple[str, KvgateApp]]:
    with serve_app(held) as worker_url:
        app = create_app(gateway_settings([worker_url]))
        with serve_app(app, ready_path="/ready") as gw:
            yield gw, app


@pytest_asyncio.fixture(loop_scope="function")
async def client(held: HeldWorker) -> AsyncIterator[httpx.AsyncClient]:
    """A client for one test; whatever the test left held is released after it."""
    async with httpx.AsyncClient(timeout=30) as http:
        try:
            yield http
        finally:
            held.release_all()
            await asyncio.sleep(0.2)
            held.arrivals.clear()


def post(http: httpx.AsyncClient, gw: str, tag: str, **kw: Any) -> asyncio.Task[httpx.Response]:
    body = {"model": "noop", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8, "tag": tag}
    return asyncio.create_task(http.post(gw + "/v1/chat/completions", json=body,
                                         headers={"x-session-id": f"s-{tag}"}, **kw))


def assert_overloaded(r: httpx.Response, code: str) -> None:
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code
    assert int(r.headers["retry-after"]) >= 1


async def assert_all_released(http: httpx.AsyncClient, gw: str, app: KvgateApp) -> None:
    """Nothing in flight, nothing queued, no reservation held (bounded wait: the last
    response's bookkeeping runs just after its body went out)."""
    gate = app.api.state.services.dispatcher.gate
    deadline = time.monotonic() + 30
    while True:
        inflight = promtext.values((await http.get(gw + "/metrics")).text, "kvgate_worker_inflight")
        sessions = (await http.get(gw + "/admin/sessions",
                                   headers={"authorization": f"Bearer {ADMIN}"})).json()["data"]
        held = [s for s in sessions if s["inflight_requests"] or s["inflight_kv_bytes"]]
        state = (gate.inflight, gate.queued, inflight, held)
        if state == (0, 0, [0.0], []):
            return
        assert time.monotonic() < deadline, f"gate inflight/queued, gauges, sessions: {state}"
        await asyncio.sleep(0.02)


async def fill(http: httpx.AsyncClient, gw: str, held: HeldWorker, tags: list[str],
               app: KvgateApp) -> list[asyncio.Task[httpx.Response]]:
    """Two requests in flight on the worker, then the others (queued), one at a time."""
    tasks = [post(http, gw, tags[0]), post(http, gw, tags[1])]
    await held.wait_arrivals(2)
    for n, tag in enumerate(tags[2:], start=1):
        tasks.append(post(http, gw, tag))
        await until_queued(app, n)  # queued in this order
    return tasks


async def until_queued(app: KvgateApp, n: int) -> None:
    gate = app.api.state.services.dispatcher.gate
    await eventually(lambda: gate.queued == n)


async def test_queued_requests_reach_the_worker_in_arrival_order_as_slots_free(
    gated: tuple[str, KvgateApp], held: HeldWorker, client: httpx.AsyncClient,
) -> None:
    gw, app = gated
    tasks = await fill(client, gw, held, ["r1", "r2", "q1", "q2"], app)
    assert len(held.arrivals) == 2
    assert app.api.state.services.dispatcher.gate.queued == 2
    # While held, the requests hold their sessions' reservations (what the end check clears).
    sessions = (await client.get(gw + "/admin/sessions",
                                 headers={"authorization": f"Bearer {ADMIN}"})).json()["data"]
    assert {s["session_id"] for s in sessions if s["inflight_requests"]} == {"s-r1", "s-r2"}

    held.release(held.arrivals[0])
    assert (await held.wait_arrivals(3))[2] == "q1"
    held.release(held.arrivals[1])
    assert (await held.wait_arrivals(4))[3] == "q2"
    held.release("q1")
    held.release("q2")
    responses = await asyncio.gather(*tasks)
    assert [r.status_code for r in responses] == [200] * 4
    assert [r.json()["id"] for r in responses] == ["r1", "r2", "q1", "q2"]
    await assert_all_released(client, gw, app)


async def test_request_beyond_the_queue_is_refused_at_once_with_retry_after(
    gated: tuple[str, KvgateApp], held: HeldWorker, client: httpx.AsyncClient,
) -> None:
    gw, app = gated
    before = promtext.value((await client.get(gw + "/metrics")).text, "kvgate_requests_total",
                            pool="none", code="503") or 0.0
    tasks = await fill(client, gw, held, ["r1", "r2", "q1", "q2"], app)
    started = time.monotonic()
    refused = await post(client, gw, "x")
    assert time.monotonic() - started < 0.5
    assert_overloaded(refused, "gateway_overloaded")
    assert "x" not in held.arrivals
    held.release_all()
    await held.wait_arrivals(4)  # the queued two arrive as the first two leave
    held.release_all()
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 4
    after = promtext.value((await client.get(gw + "/metrics")).text, "kvgate_requests_total",
                           pool="none", code="503")
    assert after == before + 1
    await assert_all_released(client, gw, app)


async def test_request_waiting_past_queue_timeout_gets_503_and_is_never_forwarded(
    gated: tuple[str, KvgateApp], held: HeldWorker, client: httpx.AsyncClient,
) -> None:
    gw, app = gated
    tasks = await fill(client, gw, held, ["r1", "r2"], app)
    started = time.monotonic()
    refused = await post(client, gw, "late")
    waited = time.monotonic() - started
    assert_overloaded(refused, "gateway_overloaded")
    assert refused.headers["retry-after"] == "2"  # queue_timeout_s, rounded up
    assert QUEUE_TIMEOUT_S * 0.9 <= waited < QUEUE_TIMEOUT_S + 1.0
    assert "late" not in held.arrivals
    held.release_all()
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200, 200]
    await assert_all_released(client, gw, app)


async def test_client_that_gives_up_while_queued_frees_its_place_and_is_never_forwarded(
    gated: tuple[str, KvgateApp], held: HeldWorker, client: httpx.AsyncClient,
) -> None:
    """Regression: the gateway did not watch for a disconnect while a request waited in the
    admission queue, so a client that gave up kept its place until a slot came (or the queue
    timeout), and live requests were refused with 503 meanwhile. Under overload, clients that
    time out and retry then fill the queue with the dead."""
    gw, app = gated
    tasks = await fill(client, gw, held, ["r1", "r2"], app)
    impatient = post(client, gw, "gone", timeout=0.3)
    with pytest.raises(httpx.ReadTimeout):
        await impatient
    await until_queued(app, 0)  # the client's FIN has reached the gateway: it left the queue
    waiting = [post(client, gw, "w1"), post(client, gw, "w2")]
    await asyncio.sleep(0.2)
    refused = [t.result().json() for t in waiting if t.done()]
    held.release("r1")
    held.release("r2")
    await asyncio.sleep(0.2)
    held.release_all()
    await asyncio.sleep(0.2)
    held.release_all()
    await asyncio.gather(*tasks, *waiting)
    assert not refused, f"refused while a client that had left held a queue place: {refused}"
    assert "gone" not in held.arrivals, "a request whose client left was forwarded"
    assert sorted(held.arrivals) == ["r1", "r2", "w1", "w2"]
    await assert_all_released(client, gw, app)


async def test_max_inflight_per_worker_refuses_with_pool_saturated_and_recovers() -> None:
    worker = HeldWorker()
    with serve_app(worker) as worker_url:
        app = create_app(gateway_settings([worker_url], max_inflight_per_worker=1))
        with serve_app(app, ready_path="/ready") as gw:
            async with httpx.AsyncClient(timeout=30) as http:
                first = post(http, gw, "a")
                await worker.wait_arrivals(1)
                started = time.monotonic()
                refused = await post(http, gw, "b")
                assert time.monotonic() - started < 0.5
                assert_overloaded(refused, "pool_saturated")
                assert "b" not in worker.arrivals
                worker.release("a")
                assert (await first).status_code == 200
                again = post(http, gw, "c")
                await worker.wait_arrivals(2)
                worker.release("c")
                assert (await again).status_code == 200
                await assert_all_released(http, gw, app)


async def test_gate_admits_a_full_set_again_after_overload(
    gated: tuple[str, KvgateApp], held: HeldWorker, client: httpx.AsyncClient,
) -> None:
    """Runs after the others in this module: no slot or queue place leaked."""
    gw, app = gated
    tasks = [post(client, gw, "z1"), post(client, gw, "z2")]
    assert sorted(await held.wait_arrivals(2)) == ["z1", "z2"]
    held.release_all()
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200, 200]
    await assert_all_released(client, gw, app)

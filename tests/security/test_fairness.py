"""Fair share under contention, tried as a hostile tenant would (issue 12, item 4).

A held worker (answers only when the test releases a request) and a gate of one slot make the
order of admission visible through the gateway, with two real API keys:

* a tenant flooding the queue does not keep another tenant's request behind its backlog: the
  light tenant's request is the next to reach the worker (FIFO sent the whole flood first);
* a flood that fills the queue does not shut the other tenant out: the flood's newest request is
  refused (503 with Retry-After) to make room;
* a key whose class is batch cannot raise itself with ``X-Priority: interactive``;
* an unknown ``X-Priority`` is a 400 in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import pytest_asyncio

from gateway.app import KvgateApp, create_app
from gateway.config import build_settings
from tests.harness import eventually, serve_app
from tests.integration.test_reliability_overload import HeldWorker

pytestmark = pytest.mark.timeout(60)

KEYS = {"flood": "key-flood", "light": "key-light", "bulk": "key-bulk"}


def settings(worker_url: str, *, fair: bool) -> Any:
    return build_settings({
        "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [worker_url]}],
        "health": {"interval_s": 60},
        "limits": {"max_inflight_requests": 1, "max_queued_requests": 4,
                   "queue_timeout_s": 20, "fair_queuing": fair},
        "auth": {"api_keys": [
            {"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(),
             "priority": "batch" if name == "bulk" else "interactive"}
            for name, key in KEYS.items()]},
    })


@pytest.fixture(scope="module")
def held() -> HeldWorker:
    return HeldWorker()


@pytest.fixture(scope="module")
def gateway(held: HeldWorker) -> Iterator[tuple[str, KvgateApp]]:
    with serve_app(held) as worker_url:
        app = create_app(settings(worker_url, fair=True))
        with serve_app(app, ready_path="/ready") as gw:
            yield gw, app


@pytest_asyncio.fixture(loop_scope="function")
async def client(held: HeldWorker, gateway: tuple[str, KvgateApp]
                 ) -> AsyncIterator[httpx.AsyncClient]:
    gate = gateway[1].api.state.services.dispatcher.gate
    async with httpx.AsyncClient(timeout=30) as http:
        try:
            yield http
        finally:
            def idle() -> bool:  # whatever is held, and what the queue lets through after it
                held.release_all()
                return bool(gate.inflight == 0 and gate.queued == 0)

            await eventually(idle)
            held.arrivals.clear()


def post(http: httpx.AsyncClient, gw: str, tenant: str, tag: str,
         headers: dict[str, str] | None = None) -> asyncio.Task[httpx.Response]:
    body = {"model": "noop", "messages": [{"role": "user", "content": "hi " * 500}],
            "max_tokens": 512, "tag": tag}
    return asyncio.create_task(http.post(
        gw + "/v1/chat/completions", json=body,
        headers={"authorization": f"Bearer {KEYS[tenant]}", **(headers or {})}))


async def drain(held: HeldWorker, arrivals: int) -> None:
    """Release requests as they reach the worker until ``arrivals`` have."""
    while len(held.arrivals) < arrivals:
        held.release_all()
        await asyncio.sleep(0.05)
    held.release_all()


async def queue_up(http: httpx.AsyncClient, gateway: tuple[str, KvgateApp], held: HeldWorker,
                   requests: list[tuple[str, str, dict[str, str] | None]]
                   ) -> list[asyncio.Task[httpx.Response]]:
    """The first request takes the slot (on the worker); the others queue in this order (each
    is seen queued before the next is sent)."""
    gw, app = gateway
    gate = app.api.state.services.dispatcher.gate
    tenant, tag, headers = requests[0]
    tasks = [post(http, gw, tenant, tag, headers)]
    await held.wait_arrivals(1)
    queued = gate.queued
    for tenant, tag, headers in requests[1:]:
        tasks.append(post(http, gw, tenant, tag, headers))
        queued = min(queued + 1, gate.max_queued)
        await eventually(lambda queued=queued: gate.queued == queued)  # type: ignore[misc]
    return tasks


async def test_flooding_tenant_does_not_keep_another_tenant_behind_its_backlog(
        gateway: tuple[str, KvgateApp], held: HeldWorker, client: httpx.AsyncClient) -> None:
    """With FIFO (``limits.fair_queuing: false``, and every gateway before issue 12) the light
    tenant's request reached the worker after the flood's three queued ones."""
    tasks = await queue_up(client, gateway, held, [
        ("flood", "f0", None), ("flood", "f1", None), ("flood", "f2", None),
        ("flood", "f3", None), ("light", "l0", None)])
    held.release("f0")
    assert (await held.wait_arrivals(2))[1] == "l0"
    await drain(held, 5)
    assert [r.status_code for r in await asyncio.gather(*tasks)] == [200] * 5


async def test_flood_filling_the_queue_cannot_shut_another_tenant_out(
        gateway: tuple[str, KvgateApp], held: HeldWorker, client: httpx.AsyncClient) -> None:
    gw, _ = gateway
    tasks = await queue_up(client, gateway, held, [("flood", f"f{i}", None) for i in range(5)])
    light = post(client, gw, "light", "l0")
    pushed_out = tasks[-1]
    await eventually(pushed_out.done)
    r = pushed_out.result()
    assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["code"] == "gateway_overloaded"
    assert not light.done()
    held.release("f0")
    assert (await held.wait_arrivals(2))[1] == "l0"
    held.release_all()
    assert (await light).status_code == 200


async def test_batch_key_cannot_raise_itself_to_interactive(
        gateway: tuple[str, KvgateApp], held: HeldWorker, client: httpx.AsyncClient) -> None:
    await queue_up(client, gateway, held, [("light", "l0", None),
                                           ("bulk", "b0", {"x-priority": "interactive"}),
                                           ("flood", "f0", None)])
    held.release("l0")
    assert (await held.wait_arrivals(2))[1] == "f0"


async def test_unknown_priority_is_refused_in_openai_shape(
        gateway: tuple[str, KvgateApp], client: httpx.AsyncClient) -> None:
    gw, _ = gateway
    r = await post(client, gw, "light", "x", {"x-priority": "urgent"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "invalid_priority" and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"}

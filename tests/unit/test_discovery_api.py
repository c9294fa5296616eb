"""KubernetesDiscovery against a fake Kubernetes API server on loopback.

The fake (an aiohttp app) answers the EndpointSlice list and watch requests of a script, in the
shapes the real API server uses: a list with ``metadata.resourceVersion``, a chunked watch of one
JSON event per line (ADDED/MODIFIED/DELETED/BOOKMARK), a 410 as an ERROR event and as an HTTP
status, and a watch connection dropped in the middle.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.workers.discovery import KubernetesDiscovery
from tests.unit.test_discovery import endpoint_slice

NAMESPACE = "llm"
SELECTOR = "kvgate.io/pool=short-chat"
PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class FakeApiServer:
    """Answers list requests from ``lists`` and watch requests from ``watches``, in order."""

    lists: list[Handler]
    watches: list[Handler]
    seen: list[tuple[str, str | None]] = field(default_factory=list)  # (list|watch, resourceVersion)
    headers: list[dict[str, str]] = field(default_factory=list)
    selectors: list[str] = field(default_factory=list)
    url: str = ""

    async def handle(self, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch") in ("1", "true")
        self.seen.append(("watch" if watch else "list", request.query.get("resourceVersion")))
        self.headers.append(dict(request.headers))
        self.selectors.append(request.query.get("labelSelector", ""))
        queue = self.watches if watch else self.lists
        if not queue:
            return await hold_open(request)
        return await queue.pop(0)(request)


def list_of(rv: str, *slices: dict[str, Any]) -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.json_response({
            "kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
            "metadata": {"resourceVersion": rv}, "items": list(slices),
        })
    return handler


def status(code: int, body: str = "") -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(status=code, text=body or json.dumps(
            {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code}))
    return handler


def watch_of(*events: dict[str, Any], then: str = "end") -> Handler:
    """Stream the events, one JSON line each; then end the response, drop the connection
    (``drop``) or keep it open (``hold``)."""

    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for e in events:
            await resp.write(json.dumps(e).encode() + b"\n")
        if then == "drop":
            await asyncio.sleep(0.05)
            assert request.transport is not None
            request.transport.close()  # no final chunk: the client sees a broken payload
            return resp
        if then == "hold":
            await asyncio.sleep(3600)
        await resp.write_eof()
        return resp

    return handler


async def not_json(_: web.Request) -> web.StreamResponse:
    return web.Response(text="<html>gateway timeout</html>", content_type="text/html")


async def hold_open(request: web.Request) -> web.StreamResponse:
    return await watch_of(then="hold")(request)


def event(kind: str, obj: dict[str, Any]) -> dict[str, Any]:
    return {"type": kind, "object": obj}


def bookmark(rv: str) -> dict[str, Any]:
    return event("BOOKMARK", {"kind": "EndpointSlice", "apiVersion": "discovery.k8s.io/v1",
                              "metadata": {"resourceVersion": rv}})


GONE_EVENT = event("ERROR", {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                             "message": "too old resource version: 104 (190)",
                             "reason": "Expired", "code": 410})


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[FakeApiServer], Awaitable[FakeApiServer]]]:
    runners: list[web.AppRunner] = []

    async def start(fake: FakeApiServer) -> FakeApiServer:
        app = web.Application()
        app.router.add_get(PATH, fake.handle)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        sockets = site._server.sockets  # type: ignore[union-attr]
        fake.url = f"http://127.0.0.1:{sockets[0].getsockname()[1]}"
        return fake

    yield start
    for runner in runners:
        await runner.cleanup()


def discovery(fake: FakeApiServer, token: Path | None = None) -> KubernetesDiscovery:
    return KubernetesDiscovery(NAMESPACE, SELECTOR, "http", base_url=fake.url, token_path=token,
                               ca_path=None, backoff_initial_s=0.01, backoff_max_s=0.05, seed=0)


async def run_until(d: KubernetesDiscovery, seen: list[frozenset[str]],
                    done: Callable[[], bool], timeout_s: float = 10) -> None:
    changed = asyncio.Event()

    def on_change(new: frozenset[str]) -> None:
        seen.append(new)
        changed.set()

    task = asyncio.create_task(d.run(on_change))
    try:
        async with asyncio.timeout(timeout_s):
            while not done():
                await changed.wait()
                changed.clear()
    finally:
        await d.close()
        await asyncio.wait_for(task, 5)  # run() returns (does not raise) after close()


def urls(*ips: str) -> frozenset[str]:
    return frozenset(f"http://{ip}:8000" for ip in ips)


A1, A2, B1, C1, D1 = "127.0.10.1", "127.0.10.2", "127.0.11.1", "127.0.12.1", "127.0.13.1"


async def test_follows_watch_reconnects_after_drop_and_relists_on_410(
    serve: Callable[[FakeApiServer], Awaitable[FakeApiServer]], tmp_path: Path
) -> None:
    token = tmp_path / "token"
    token.write_text("secret-token\n")
    a_after = endpoint_slice("a", [(A1, True)], rv="200")
    fake = await serve(FakeApiServer(
        lists=[
            list_of("100", endpoint_slice("a", [(A1, True), (A2, False)]),
                    endpoint_slice("b", [(B1, True)])),
            list_of("200", a_after),
            list_of("300", a_after),
        ],
        watches=[
            watch_of(
                event("MODIFIED", endpoint_slice("a", [(A1, True), (A2, True)], rv="101")),
                event("ADDED", endpoint_slice("c", [(C1, True)], rv="102")),
                event("DELETED", endpoint_slice("b", [(B1, True)], rv="103")),
                bookmark("104"),
                then="drop",
            ),
            watch_of(GONE_EVENT),           # 410 inside the stream
            status(410),                    # 410 as the watch's HTTP status
            watch_of(event("ADDED", endpoint_slice("d", [(D1, True)], rv="301")), then="hold"),
        ],
    ))
    seen: list[frozenset[str]] = []
    d = discovery(fake, token)
    await run_until(d, seen, lambda: urls(A1, D1) in seen)

    assert seen == [
        urls(A1, B1),              # first list
        urls(A1, A2, B1),          # MODIFIED: A2 ready
        urls(A1, A2, B1, C1),      # ADDED c
        urls(A1, A2, C1),          # DELETED b (the bookmark changes nothing)
        urls(A1),                  # relist after the 410 event (the third list: no change)
        urls(A1, D1),              # watch after the relist
    ]
    assert fake.seen == [
        ("list", None), ("watch", "100"),
        ("watch", "104"),          # after the drop: from the bookmark's resourceVersion
        ("list", None), ("watch", "200"),
        ("list", None), ("watch", "300"),
    ]
    assert all(h.get("Authorization") == "Bearer secret-token" for h in fake.headers)
    assert set(fake.selectors) == {SELECTOR}


async def test_failed_list_is_retried_with_backoff(
    serve: Callable[[FakeApiServer], Awaitable[FakeApiServer]]
) -> None:
    fake = await serve(FakeApiServer(
        lists=[status(500, "etcdserver: leader changed"), status(403, "forbidden"),
               not_json, list_of("7", endpoint_slice("a", [(A1, True)]))],
        watches=[],
    ))
    seen: list[frozenset[str]] = []
    await run_until(discovery(fake), seen, lambda: bool(seen))
    assert seen == [urls(A1)]
    assert [kind for kind, _ in fake.seen[:4]] == ["list", "list", "list", "list"]
    assert "Authorization" not in fake.headers[0]  # no token file: no header


async def test_watch_that_ends_is_resumed_from_its_last_resource_version(
    serve: Callable[[FakeApiServer], Awaitable[FakeApiServer]]
) -> None:
    fake = await serve(FakeApiServer(
        lists=[list_of("10")],
        watches=[
            watch_of(event("ADDED", endpoint_slice("a", [(A1, True)], rv="11"))),  # then ends
            watch_of(),  # ends with nothing (server-side timeoutSeconds)
            watch_of(event("ADDED", endpoint_slice("b", [(B1, True)], rv="12")), then="hold"),
        ],
    ))
    seen: list[frozenset[str]] = []
    await run_until(discovery(fake), seen, lambda: urls(A1, B1) in seen)
    assert seen == [frozenset(), urls(A1), urls(A1, B1)]  # the empty first list is reported
    assert fake.seen == [("list", None), ("watch", "10"), ("watch", "11"), ("watch", "11")]


async def test_malformed_watch_line_reconnects_without_losing_state(
    serve: Callable[[FakeApiServer], Awaitable[FakeApiServer]]
) -> None:
    async def garbage(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"<html>proxy error</html>\n")
        await resp.write_eof()
        return resp

    fake = await serve(FakeApiServer(
        lists=[list_of("5", endpoint_slice("a", [(A1, True)]))],
        watches=[garbage,
                 watch_of(event("ADDED", endpoint_slice("b", [(B1, True)], rv="6")), then="hold")],
    ))
    seen: list[frozenset[str]] = []
    await run_until(discovery(fake), seen, lambda: urls(A1, B1) in seen)
    assert seen == [urls(A1), urls(A1, B1)]
    assert fake.seen == [("list", None), ("watch", "5"), ("watch", "5")]


async def test_close_before_run_makes_run_return_at_once() -> None:
    d = KubernetesDiscovery(NAMESPACE, SELECTOR, base_url="http://127.0.0.1:9", token_path=None,
                            ca_path=None)
    await d.close()
    await asyncio.wait_for(d.run(lambda _: None), 1)


def test_in_cluster_url_comes_from_the_service_environment(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    d = KubernetesDiscovery("team a", SELECTOR, token_path=None, ca_path=None)
    assert d._collection_url() == (
        "https://[fd00::1]:6443/apis/discovery.k8s.io/v1/namespaces/team%20a/endpointslices")
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST")
    with pytest.raises(RuntimeError, match="not in a cluster"):
        d._collection_url()

"""A pool whose workers come from Kubernetes EndpointSlices, against a fake API server."""

from __future__ import annotations

import asyncio
import json
import queue
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway.app import create_app
from gateway.bench import noop
from gateway.config import build_settings
from tests.harness import answer_probe, serve_app
from tests.unit.test_discovery import endpoint_slice


class FakeKubernetes:
    """Lists one EndpointSlice; the watch streams whatever events the test puts in ``events``."""

    def __init__(self, slice_: dict[str, Any]) -> None:
        self.slice = slice_
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await answer_probe(scope, send)
            return
        watch = b"watch=1" in scope["query_string"] or b"watch=true" in scope["query_string"]
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        if not watch:
            body = {"kind": "EndpointSliceList", "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": "10"}, "items": [self.slice]}
            await send({"type": "http.response.body", "body": json.dumps(body).encode()})
            return
        # Each watch ends after a second, as a real one ends at its timeout; the client watches
        # again from its last resourceVersion (and nothing lingers when the gateway stops).
        deadline = time.monotonic() + 1
        while time.monotonic() < deadline:
            try:
                event = self.events.get_nowait()
            except queue.Empty:
                await asyncio.sleep(0.05)
                continue
            await send({"type": "http.response.body", "more_body": True,
                        "body": json.dumps(event).encode() + b"\n"})
        await send({"type": "http.response.body", "body": b""})


@pytest.fixture()
def backend() -> Iterator[str]:
    with serve_app(noop.app) as url:
        yield url


def test_discovered_workers_serve_and_leave_when_their_endpoint_goes(backend: str) -> None:
    port = int(backend.rsplit(":", 1)[1])
    slice_ = endpoint_slice("vllm-short-abc", [("127.0.0.1", True)],
                            ports=[{"name": "http", "port": port, "protocol": "TCP"}], rv="10")
    fake = FakeKubernetes(slice_)
    with serve_app(fake) as api_url:
        settings = build_settings({
            "models": [{"name": "noop", "tokenizer": "simple"}],
            "pools": [{"name": "short-chat", "max_context_tokens": 4096, "discovery": {
                "namespace": "llm", "label_selector": "kvgate.io/pool=short-chat",
                "api_url": api_url}}],
            "health": {"interval_s": 0.2, "timeout_s": 30.0},
        })
        with serve_app(create_app(settings)) as gw:
            deadline = time.monotonic() + 60
            while httpx.get(gw + "/ready").status_code != 200:
                assert time.monotonic() < deadline, "the discovered worker never became ready"
                time.sleep(0.1)
            r = httpx.post(gw + "/v1/chat/completions", json={
                "model": "noop", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 200
            assert r.headers["x-kvgate-worker"] == f"http://127.0.0.1:{port}"
            up = f'kvgate_worker_up{{pool="short-chat",worker="http://127.0.0.1:{port}"}} 1.0'
            assert up in httpx.get(gw + "/metrics").text

            fake.events.put({"type": "DELETED", "object": {**slice_, "metadata": {
                **slice_["metadata"], "resourceVersion": "11"}}})
            deadline = time.monotonic() + 60
            while httpx.get(gw + "/ready").status_code != 503:
                assert time.monotonic() < deadline, "the removed worker is still in the pool"
                time.sleep(0.1)
            r = httpx.post(gw + "/v1/chat/completions", json={
                "model": "noop", "messages": [{"role": "user", "content": "hi"}]})
            assert r.status_code == 503 and r.json()["error"]["code"] == "no_healthy_worker"
            # Every series labelled with it goes, counters and histograms too (regression: they
            # stayed forever): dashboards and alerts must not show a gone worker.
            metrics = httpx.get(gw + "/metrics").text
            assert f'worker="http://127.0.0.1:{port}"' not in metrics
            assert 'kvgate_requests_total{code="503",pool="none",worker="none"} 1.0' in metrics

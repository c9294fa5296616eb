"""The gateway over real sockets in front of scripted backends: errors, retries, streams, limits.

The backends here are honest fakes (small ASGI apps on real ports); the same behaviours against real
vLLM are in test_gateway_vllm.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from starlette.types import Receive, Scope, Send

from gateway.app import create_app
from gateway.bench import noop
from gateway.config import build_settings
from gateway.procs.net import free_port
from tests.harness import answer_probe, serve_app

CHAT = {"model": "noop", "messages": [{"role": "user", "content": "hello there"}]}


def settings_for(pools: list[dict[str, Any]], **extra: Any) -> Any:
    data: dict[str, Any] = {
        "models": [{"name": "noop", "tokenizer": "simple"}],
        "pools": pools,
        "health": {"interval_s": 0.2, "timeout_s": 30.0,
                   "scrape_interval_s": 0.5, "unhealthy_threshold": 1},
    }
    data.update(extra)
    return build_settings(data)


@pytest.fixture(scope="module")
def backend() -> Iterator[str]:
    with serve_app(noop.app) as url:
        yield url


@pytest.fixture(scope="module")
def gateway(backend: str) -> Iterator[str]:
    settings = settings_for(
        [{"name": "short-chat", "max_context_tokens": 2048, "workers": [backend]}],
        limits={"max_body_bytes": 64 * 1024},
    )
    with serve_app(create_app(settings), ready_path="/ready") as url:
        yield url


def assert_openai_error(r: httpx.Response, status: int, code: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if code is not None:
        assert err["code"] == code


def test_openai_client_chat_non_streaming_and_streaming(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x")
    done = client.chat.completions.create(
        model="noop", messages=[{"role": "user", "content": "hi"}]
    )
    assert done.choices[0].message.content == "ok"
    chunks = list(
        client.chat.completions.create(
            model="noop", messages=[{"role": "user", "content": "hi"}], stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "okokokok"
    # The gateway asked for usage; the client did not, so it must not see the usage chunk.
    assert all(c.choices for c in chunks)


def test_stream_keeps_usage_chunk_when_client_asked_for_it(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x")
    chunks = list(
        client.chat.completions.create(
            model="noop",
            messages=[{"role": "user", "content": "hi"}],
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 5


def test_models_lists_models_served_by_healthy_workers(gateway: str) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="x")
    assert [m.id for m in client.models.list()] == ["noop"]


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (b"{not json", 400, "invalid_json"),
        (b"[1, 2]", 400, "invalid_json"),
        (b'{"model": "noop"}', 400, None),
        (b'{"model": "noop", "messages": []}', 400, None),
        (
            b'{"model": "noop", "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
            400,
            None,
        ),
        (
            b'{"model": "noop", "messages": [{"role": "user", "content": "x"}], "stream": "yes"}',
            400,
            None,
        ),
        (
            b'{"model": "gpt-unknown", "messages": [{"role": "user", "content": "x"}]}',
            404,
            "model_not_found",
        ),
        (
            b'{"model": "noop", "messages": [{"role": "user", "content": "x"}],'
            b' "max_tokens": 5000}',
            400,
            "context_length_exceeded",
        ),
        (b'\xff\xfe{"model": 1}', 400, "invalid_json"),
    ],
)
def test_refusals_are_openai_shaped(
    gateway: str, body: bytes, status: int, code: str | None
) -> None:
    r = httpx.post(
        gateway + "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert_openai_error(r, status, code)


def test_body_over_limit_gets_413(gateway: str) -> None:
    big = b'{"model": "noop", "prompt": "' + b"a" * (70 * 1024) + b'"}'
    r = httpx.post(gateway + "/v1/completions", content=big)
    assert_openai_error(r, 413, "request_too_large")


def test_body_over_limit_without_content_length_gets_413(gateway: str) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "noop", "prompt": "'
        for _ in range(100):
            yield b"a" * 1024
        yield b'"}'

    r = httpx.post(gateway + "/v1/completions", content=chunks())
    assert_openai_error(r, 413, "request_too_large")


def test_unknown_route_and_wrong_method_are_openai_shaped(gateway: str) -> None:
    assert_openai_error(httpx.get(gateway + "/v1/nothing"), 404)
    assert_openai_error(httpx.get(gateway + "/v1/chat/completions"), 405)


def _failing_worker(status: int, content_type: bytes, body: bytes) -> Any:
    """A worker that is healthy and answers every completion with ``status`` and ``body``."""
    async def failing(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] == "/health":
            await answer_probe(scope, send)
            return
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": body})

    return failing


def _chat_through_gateway(worker_app: Any) -> httpx.Response:
    with serve_app(worker_app) as worker:
        settings = settings_for([{"name": "p", "max_context_tokens": 4096, "workers": [worker]}])
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            return httpx.post(gw + "/v1/chat/completions", json=CHAT)


def test_worker_error_passes_through_with_status_and_body() -> None:
    r = _chat_through_gateway(_failing_worker(
        400, b"application/json",
        b'{"error":{"message":"vllm says no","type":"BadRequestError","param":null,"code":400}}'))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "vllm says no"


@pytest.mark.parametrize(("content_type", "body", "quoted"), [
    (b"text/plain; charset=utf-8", b"Internal Server Error", "Internal Server Error"),
    (b"text/html", b"<html>" + b"x" * 5000 + b"</html>", "<html>xxx"),
    (b"application/json", b"{not json", "{not json"),
    (b"application/json", b"", None),
])
def test_a_worker_error_that_is_not_json_reaches_the_client_openai_shaped(
    content_type: bytes, body: bytes, quoted: str | None,
) -> None:
    """Regression: a worker's plain-text 500 (a crash, a proxy's page) reached the client as it
    was. Its status is kept and its text quoted (bounded) in the OpenAI error shape."""
    r = _chat_through_gateway(_failing_worker(500, content_type, body))
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "upstream_error"
    if quoted is None:
        assert err["message"] == "the worker answered 500"
    else:
        assert err["message"].startswith(f"the worker answered 500: {quoted}")
        assert len(err["message"]) < 600


def test_no_healthy_worker_gets_503() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    settings = settings_for([{"name": "p", "max_context_tokens": 4096, "workers": [dead]}])
    with serve_app(create_app(settings)) as gw:
        assert httpx.get(gw + "/ready").status_code == 503
        r = httpx.post(gw + "/v1/chat/completions", json=CHAT)
    assert_openai_error(r, 503, "no_healthy_worker")
    assert "retry-after" in r.headers


def test_connection_failure_is_retried_on_another_worker_of_the_pool() -> None:
    port = free_port()
    with serve_app(noop.app) as good:
        with serve_app(noop.app, port=port) as doomed:
            settings = settings_for(
                [
                    {
                        "name": "p",
                        "max_context_tokens": 4096,
                        "policy": "round_robin",
                        "workers": [doomed, good],
                    }
                ],
                health={"interval_s": 60, "unhealthy_threshold": 1},
            )
            gw_ctx = serve_app(create_app(settings), ready_path="/ready")
            gw = gw_ctx.__enter__()
        # `doomed` is gone but the gateway still believes it healthy (next check in 60 s).
        try:
            for _ in range(4):
                r = httpx.post(gw + "/v1/chat/completions", json=CHAT)
                assert r.status_code == 200, r.text
                assert r.headers["x-kvgate-worker"] == good
            metrics = httpx.get(gw + "/metrics").text
            assert 'kvgate_upstream_retries_total{pool="p"} 1.0' in metrics
            assert f'kvgate_worker_up{{pool="p",worker="{doomed}"}} 0.0' in metrics
        finally:
            gw_ctx.__exit__(None, None, None)


def test_worker_unreachable_with_no_other_worker_gets_502() -> None:
    with serve_app(noop.app) as doomed:
        settings = settings_for(
            [{"name": "p", "max_context_tokens": 4096, "workers": [doomed]}],
            health={"interval_s": 60},
        )
        gw_ctx = serve_app(create_app(settings), ready_path="/ready")
        gw = gw_ctx.__enter__()
    try:
        r = httpx.post(gw + "/v1/chat/completions", json=CHAT)
        assert_openai_error(r, 502, "upstream_unreachable")
    finally:
        gw_ctx.__exit__(None, None, None)


class SlowStream:
    """A worker that streams one chunk every 50 ms for ten seconds and notes when its client
    (the gateway) disconnects, as vLLM's server notices it and aborts the request."""

    def __init__(self) -> None:
        self.disconnected = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        while (await receive()).get("more_body"):
            pass

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            self.disconnected.set()

        watcher = asyncio.create_task(watch())
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        for _ in range(200):
            if self.disconnected.is_set():
                return
            await send(
                {
                    "type": "http.response.body",
                    "more_body": True,
                    "body": b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\n\n',
                }
            )
            await asyncio.sleep(0.05)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        watcher.cancel()


def test_client_disconnect_mid_stream_closes_the_upstream_request() -> None:
    worker_app = SlowStream()
    with serve_app(worker_app) as worker:
        settings = settings_for([{"name": "p", "max_context_tokens": 4096, "workers": [worker]}])
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            with httpx.stream(
                "POST", gw + "/v1/chat/completions", json={**CHAT, "stream": True}
            ) as r:
                it = r.iter_bytes()
                assert b"data:" in next(it)
            started = time.monotonic()
            assert worker_app.disconnected.wait(5), "upstream request still running"
            assert time.monotonic() - started < 2
            metrics = httpx.get(gw + "/metrics").text
            assert f'kvgate_worker_inflight{{pool="p",worker="{worker}"}} 0.0' in metrics

"""Slow and hung workers: the pool's timeouts end requests in bounded time (issue 7).

A scripted worker on a real port misbehaves on demand (the request body names the script; the
gateway forwards unknown fields untouched): it accepts and never answers, sends headers and then
nothing, sends only keep-alive comments, stops mid-stream, or never finishes a plain body. The
pool sets ``timeouts.first_token_s`` and ``read_s`` small while the top-level timeouts stay at a
minute, so the pool's own section is what ends each request:

* nothing sent to the client yet: 504 ``upstream_timeout``, OpenAI-shaped;
* a stream already started: an OpenAI-style error event, then a clean end of the body;
* either way the worker's connection is closed (vLLM would abort the request), the in-flight
  gauge returns to 0 and the session's budget reservation is released.

A slow but steady stream (every gap shorter than ``read_s``, the whole longer than both
timeouts) completes: ``read_s`` bounds silence, not duration.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest
from starlette.types import Receive, Scope, Send

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from tests.harness import answer_probe, read_asgi_body, serve_app

pytestmark = pytest.mark.timeout(60)

FIRST_TOKEN_S = 0.5
READ_S = 1.0
SLACK_S = 1.0  # scheduling on a loaded 2-core box
SLOW_PREFILL_S = 1.0
ADMIN = "admin-secret"


def _chunk(content: str) -> bytes:
    return b"data: " + orjson.dumps({
        "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "noop",
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }) + b"\n\n"


class ScriptedWorker:
    """Answers health checks; misbehaves on completions as the body's ``script`` says, and
    notes every request whose client (the gateway) went away before the script finished."""

    def __init__(self) -> None:
        self.aborted: list[str] = []
        self.lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] != "/v1/chat/completions":
            await answer_probe(scope, send)
            return
        raw = await read_asgi_body(receive)
        script = str(orjson.loads(raw).get("script"))

        async def until_disconnect() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            with self.lock:
                self.aborted.append(script)

        sse = [(b"content-type", b"text/event-stream")]
        if script == "hang_before_headers":
            await until_disconnect()
        elif script == "silent_after_headers":
            await send({"type": "http.response.start", "status": 200, "headers": sse})
            await until_disconnect()
        elif script == "keepalives_only":
            await send({"type": "http.response.start", "status": 200, "headers": sse})
            watcher = asyncio.create_task(until_disconnect())
            while not watcher.done():
                await send({"type": "http.response.body", "body": b": ping\n\n",
                            "more_body": True})
                await asyncio.sleep(0.1)
        elif script == "stall_mid_stream":
            await send({"type": "http.response.start", "status": 200, "headers": sse})
            for _ in range(3):
                await send({"type": "http.response.body", "body": _chunk("x"),
                            "more_body": True})
            await until_disconnect()
        elif script == "partial_body":
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json")]})
            await send({"type": "http.response.body", "body": b'{"id": "c", "choi',
                        "more_body": True})
            await until_disconnect()
        elif script in ("slow_prefill", "slow_prefill_no_headers"):
            # A long prompt queued and prefilled: the first token takes a while, then tokens
            # come quickly. vLLM sends the stream's headers at once (``slow_prefill``).
            if script == "slow_prefill":
                await send({"type": "http.response.start", "status": 200, "headers": sse})
            await asyncio.sleep(SLOW_PREFILL_S)
            if script == "slow_prefill_no_headers":
                await send({"type": "http.response.start", "status": 200, "headers": sse})
            for _ in range(5):
                await send({"type": "http.response.body", "body": _chunk("z"),
                            "more_body": True})
                await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        elif script == "slow_steady_stream":
            await send({"type": "http.response.start", "status": 200, "headers": sse})
            for _ in range(8):  # 8 x 0.3 s: longer than both timeouts, no gap over read_s
                await asyncio.sleep(0.3)
                await send({"type": "http.response.body", "body": _chunk("y"),
                            "more_body": True})
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        else:
            raise AssertionError(f"unknown script {script!r}")


@pytest.fixture(scope="module")
def worker() -> ScriptedWorker:
    return ScriptedWorker()


@pytest.fixture(scope="module")
def gateway(worker: ScriptedWorker) -> Iterator[tuple[str, str]]:
    with serve_app(worker) as worker_url:
        settings = build_settings({
            "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
            "timeouts": {"first_token_s": 60, "read_s": 60},
            "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [worker_url],
                       "timeouts": {"connect_s": 1, "first_token_s": FIRST_TOKEN_S,
                                    "read_s": READ_S}}],
            # Whether timeouts count against the worker's health is not what this file tests.
            "health": {"interval_s": 60, "unhealthy_threshold": 1000},
            "budgets": {"defaults": {"inflight_kv_bytes": "64GiB"}},
            "admin": {"token": ADMIN},
        })
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            yield gw, worker_url


def send(gw: str, script: str, stream: bool) -> tuple[httpx.Response, list[dict[str, Any]], float]:
    """One request; the parsed data events of a stream (``[DONE]`` as {"done": True}) and the
    seconds it took. A stream that does not end cleanly raises here."""
    body = {"model": "noop", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16,
            "stream": stream, "script": script}
    started = time.monotonic()
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=30,
                      headers={"x-session-id": f"timeouts-{script}"}) as r:
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: "):]
                    events.append({"done": True} if data == "[DONE]" else orjson.loads(data))
        else:
            r.read()
    return r, events, time.monotonic() - started


def assert_upstream_closed(worker: ScriptedWorker, script: str) -> None:
    deadline = time.monotonic() + 30
    while script not in worker.aborted:
        assert time.monotonic() < deadline, f"the worker's request ({script}) was never closed"
        time.sleep(0.02)


def assert_nothing_held(gw: str) -> None:
    deadline = time.monotonic() + 30
    while True:
        inflight = promtext.values(httpx.get(gw + "/metrics").text, "kvgate_worker_inflight")
        sessions = httpx.get(gw + "/admin/sessions",
                             headers={"authorization": f"Bearer {ADMIN}"}).json()["data"]
        held = [s for s in sessions if s["inflight_requests"] or s["inflight_kv_bytes"]]
        if inflight and not any(inflight) and not held:
            return
        assert time.monotonic() < deadline, f"in flight {inflight}, sessions holding {held}"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("script", "stream", "limit_s"),
    [
        ("hang_before_headers", True, FIRST_TOKEN_S),
        ("hang_before_headers", False, READ_S),
        ("partial_body", False, READ_S),
    ],
)
def test_worker_silent_before_any_byte_gets_504_within_the_pool_timeout(
    gateway: tuple[str, str], worker: ScriptedWorker, script: str, stream: bool, limit_s: float,
) -> None:
    gw, _ = gateway
    r, _, elapsed = send(gw, script, stream)
    assert r.status_code == 504, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "upstream_timeout"
    assert limit_s * 0.9 <= elapsed < limit_s + SLACK_S, elapsed
    assert_upstream_closed(worker, script)
    assert_nothing_held(gw)


@pytest.mark.parametrize(
    ("script", "limit_s", "tokens_before"),
    [
        ("silent_after_headers", FIRST_TOKEN_S, 0),
        ("keepalives_only", FIRST_TOKEN_S, 0),  # comments are not tokens
        ("stall_mid_stream", READ_S, 3),
    ],
)
def test_stream_that_stops_ends_with_an_error_event_within_the_pool_timeout(
    gateway: tuple[str, str], worker: ScriptedWorker, script: str, limit_s: float,
    tokens_before: int,
) -> None:
    gw, _ = gateway
    r, events, elapsed = send(gw, script, stream=True)
    assert r.status_code == 200
    assert len(events) == tokens_before + 1, events
    err = events[-1]["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "upstream_timeout"
    assert limit_s * 0.9 <= elapsed < limit_s + SLACK_S, elapsed
    assert_upstream_closed(worker, script)
    assert_nothing_held(gw)


def test_slow_but_steady_stream_outlives_both_timeouts(gateway: tuple[str, str]) -> None:
    gw, _ = gateway
    r, events, elapsed = send(gw, "slow_steady_stream", stream=True)
    assert r.status_code == 200
    assert events[-1] == {"done": True}
    assert len(events) == 9 and not any("error" in e for e in events)
    assert elapsed > FIRST_TOKEN_S + READ_S
    assert_nothing_held(gw)


def test_timeouts_are_counted_as_504(gateway: tuple[str, str]) -> None:
    gw, worker_url = gateway
    before = promtext.value(httpx.get(gw + "/metrics").text, "kvgate_requests_total",
                            worker=worker_url, code="504") or 0.0
    send(gw, "hang_before_headers", stream=True)
    send(gw, "stall_mid_stream", stream=True)
    after = promtext.value(httpx.get(gw + "/metrics").text, "kvgate_requests_total",
                           worker=worker_url, code="504")
    assert after == before + 2


@pytest.mark.parametrize("script", ["slow_prefill", "slow_prefill_no_headers"])
def test_first_token_may_take_up_to_first_token_s_even_when_read_s_is_shorter(
    worker: ScriptedWorker, script: str,
) -> None:
    """Regression: a stream's wait for its first token was also bounded by ``read_s`` (it is
    aiohttp's ``sock_read``, which runs from the moment the request is sent), so with the usual
    tuning (a long ``first_token_s`` for long prefills, a short ``read_s`` to catch stalls) a
    long prefill was cut at ``read_s`` with upstream_timeout."""
    with serve_app(worker) as worker_url:
        settings = build_settings({
            "models": [{"name": "noop", "tokenizer": "simple"}],
            "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [worker_url],
                       "timeouts": {"first_token_s": SLOW_PREFILL_S * 3,
                                    "read_s": SLOW_PREFILL_S / 2}}],
            "health": {"interval_s": 60},
        })
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            r, events, elapsed = send(gw, script, stream=True)
    assert r.status_code == 200, r.text
    assert not any("error" in e for e in events), events
    assert events[-1] == {"done": True} and len(events) == 6
    assert elapsed >= SLOW_PREFILL_S

"""Budgets, throttles, API keys and the admin API, end to end through the HTTP gateway.

Every request here goes over real sockets: a client (httpx, or the real ``openai`` client) talks to
the gateway (uvicorn in a thread), which forwards to ``HeldBackend``, an honest fake worker whose
completions wait until the test lets them go. In-flight state is therefore deterministic: the test
knows how many requests the worker holds at each moment, and reads the gateway's view of them from
``GET /admin/tenants/{tenant}/sessions/{session}`` and ``/metrics``. Sessions are scoped inside
their tenant (the API key): most tests use key ``alpha``'s sessions.

The model is ``tokenizer: simple`` with ``architecture: llama-3-8b``: 128 KiB of KV per token.
Completions are sent with a prompt of token ids, so a request's KV footprint is exactly
``(prompt tokens + max_tokens) x 131072`` bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import socket
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest
from starlette.types import Receive, Scope, Send

from gateway import promtext
from gateway.app import KvgateApp, create_app
from gateway.bench import noop
from gateway.budgets.models import Reservation
from gateway.config import Settings, build_settings
from gateway.dispatch import INLINE_TOKENIZE_BYTES
from gateway.services import Services
from tests.harness import read_asgi_body, serve_app

MODEL = "m"
GHOST_MODEL = "ghost"  # configured in the gateway, served by no worker
KV_BYTES_PER_TOKEN = 131072  # llama-3-8b: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes
MiB = 1024 * 1024

PROMPT_TOKENS = 16
MAX_TOKENS = 48
FOOTPRINT_TOKENS = PROMPT_TOKENS + MAX_TOKENS
FOOTPRINT_BYTES = FOOTPRINT_TOKENS * KV_BYTES_PER_TOKEN  # 8 MiB
INFLIGHT_BUDGET_BYTES = 3 * FOOTPRINT_BYTES  # 24 MiB: three standard requests
REQUEST_LIMIT_BYTES = 64 * MiB

ADMIN_TOKEN = "admin-token-0f3c9d"
KEYS = {
    name: f"sk-{name}-{hashlib.sha256(name.encode()).hexdigest()[:24]}"
    for name in ("alpha", "ident", "big", "wide", "rpm", "tpm", "bs")
}

RELEASE_TIMEOUT_S = 5.0


# -- the fake worker ------------------------------------------------------------------------


class HeldBackend:
    """An OpenAI-style worker driven by fields of the request body (the gateway forwards fields
    it does not know untouched, as it must for vLLM's own extensions):

    * ``x_hold: true`` waits until the test calls ``release``; ``x_hold_s`` waits that long.
      A stream sends its first chunk, then waits;
    * ``x_status: 500`` answers that status with an OpenAI-shaped error (after any hold);
    * ``x_break: true`` (streams) drops the connection after the first chunk, as a worker that
      crashed mid-stream;
    * ``x_usage_total: N`` reports ``usage.total_tokens = N`` (streams: in the usage chunk).

    It counts the requests it holds (``holding``, ``peak_holding``) and those whose client, the
    gateway, went away while held (``aborted``), as vLLM notices and aborts them.
    """

    POLL_S = 0.005

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tickets = 0
        self.holding = 0
        self.peak_holding = 0
        self.completions = 0
        self.aborted = 0

    # -- test side ---------------------------------------------------------------------------

    def release(self, n: int) -> None:
        with self._lock:
            self._tickets += n

    def release_all(self) -> None:
        with self._lock:
            self._tickets += self.holding

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_holding = self.holding

    def wait_holding(self, n: int, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.holding != n:
            if time.monotonic() > deadline:
                raise AssertionError(f"backend holds {self.holding} requests, expected {n}")
            time.sleep(0.005)

    # -- ASGI side ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await noop.app(scope, receive, send)  # the no-op backend's start-up and shut-down
            return
        if scope["type"] != "http":
            return
        body = await read_asgi_body(receive)
        path = scope["path"]
        if path in ("/v1/chat/completions", "/v1/completions"):
            await self._complete(path, json.loads(body), receive, send)
        elif path == "/v1/models":
            models = {"object": "list", "data": [
                {"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}]}
            await _send_json(send, 200, models)
        elif path in ("/health", "/metrics"):
            await _send_json(send, 200, None)
        else:
            await _send_json(send, 404, {"error": {"message": "no such route", "type": "x",
                                                   "param": None, "code": 404}})

    async def _complete(
        self, path: str, req: dict[str, Any], receive: Receive, send: Send
    ) -> None:
        with self._lock:
            self.completions += 1
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.create_task(watch())
        try:
            if req.get("stream"):
                await self._stream(path, req, send, gone)
                return
            if not await self._hold(req, gone):
                return
            status = int(req.get("x_status", 200))
            if status != 200:
                await _send_json(send, status, _worker_error(status))
                return
            answer = _completion(path, req)
            if "x_usage_total" in req:
                answer["usage"] = _usage(req["x_usage_total"])
            await _send_json(send, 200, answer)
        finally:
            watcher.cancel()

    async def _stream(
        self, path: str, req: dict[str, Any], send: Send, gone: asyncio.Event
    ) -> None:
        status = int(req.get("x_status", 200))
        if status != 200:
            await _send_json(send, status, _worker_error(status))
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        first = _chunk(path, "first")
        if "x_chunk_usage_total" in req:  # as ``continuous_usage_stats`` gives each chunk
            first["usage"] = _usage(req["x_chunk_usage_total"])
        await send({"type": "http.response.body", "body": _event(first), "more_body": True})
        if not await self._hold(req, gone):
            return
        if req.get("x_break"):
            raise RuntimeError("worker crashed mid-stream (scripted by the test)")
        tail = _event(_chunk(path, "last"))
        options = req.get("stream_options") or {}
        if options.get("include_usage") and "x_usage_total" in req:
            usage_chunk = {**_chunk(path, ""), "choices": [], "usage": _usage(req["x_usage_total"])}
            tail += _event(usage_chunk)
        tail += b"data: [DONE]\n\n"
        await send({"type": "http.response.body", "body": tail, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def _hold(self, req: dict[str, Any], gone: asyncio.Event) -> bool:
        """Wait as the request asks; ``False`` when the client went away meanwhile."""
        hold_s = req.get("x_hold_s")
        if not req.get("x_hold") and hold_s is None:
            return True
        started = time.monotonic()
        with self._lock:
            self.holding += 1
            self.peak_holding = max(self.peak_holding, self.holding)
        try:
            while True:
                if gone.is_set():
                    with self._lock:
                        self.aborted += 1
                    return False
                if hold_s is not None and time.monotonic() - started >= float(hold_s):
                    return True
                with self._lock:
                    if req.get("x_hold") and self._tickets > 0:
                        self._tickets -= 1
                        return True
                await asyncio.sleep(self.POLL_S)
        finally:
            with self._lock:
                self.holding -= 1


async def _send_json(send: Send, status: int, content: Any) -> None:
    body = b"" if content is None else json.dumps(content).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": body})


def _worker_error(status: int) -> dict[str, Any]:
    return {"error": {"message": f"worker failed with {status}", "type": "InternalServerError",
                      "param": None, "code": status}}


def _usage(total: int) -> dict[str, int]:
    return {"prompt_tokens": 1, "completion_tokens": max(0, total - 1), "total_tokens": total}


def _completion(path: str, req: dict[str, Any]) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": MODEL,
                "choices": [{"index": 0, "finish_reason": "stop",
                             "message": {"role": "assistant", "content": "ok"}}]}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]}


def _chunk(path: str, text: str) -> dict[str, Any]:
    if path == "/v1/chat/completions":
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0,
                "model": MODEL, "choices": [{"index": 0, "delta": {"content": text}}]}
    return {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": MODEL,
            "choices": [{"index": 0, "text": text, "finish_reason": None}]}


def _event(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class LoopCapture:
    """Wraps an ASGI app and remembers the event loop it runs on (set by the lifespan), so a
    test can run coroutines on the gateway's own loop with ``run_coroutine_threadsafe``."""

    def __init__(self, app: KvgateApp) -> None:
        self.app = app
        self.loop: asyncio.AbstractEventLoop | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.loop = asyncio.get_running_loop()
        await self.app(scope, receive, send)

    def run(self, coro: Any, timeout_s: float = 20.0) -> Any:
        assert self.loop is not None, "the gateway has not started"
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


# -- settings and helpers -------------------------------------------------------------------


def key_entry(name: str) -> dict[str, str]:
    return {"name": name, "sha256": hashlib.sha256(KEYS[name].encode()).hexdigest()}


def gateway_settings(workers: list[str], **extra: Any) -> Settings:
    data: dict[str, Any] = {
        "models": [
            {"name": MODEL, "tokenizer": "simple", "architecture": "llama-3-8b"},
            {"name": GHOST_MODEL, "tokenizer": "simple", "architecture": "llama-3-8b"},
        ],
        "pools": [{"name": "p", "max_context_tokens": 32768, "workers": workers}],
        "health": {"interval_s": 0.2, "timeout_s": 30.0,
                   "scrape_interval_s": 0.5, "unhealthy_threshold": 2},
    }
    data.update(extra)
    return build_settings(data)


def main_settings(backend: str) -> Settings:
    return gateway_settings(
        [backend],
        budgets={
            "defaults": {"request_kv_bytes": "64MiB", "inflight_kv_bytes": "24MiB"},
            "per_key": {
                "big": {"request_kv_bytes": None, "inflight_kv_bytes": "256MiB"},
                "wide": {"inflight_kv_bytes": "128MiB"},
                "rpm": {"requests_per_minute": 2},
                "tpm": {"tokens_per_minute": 100},
                "bs": {"kv_byte_seconds": "1MiB"},
            },
        },
        auth={"api_keys": [key_entry(name) for name in KEYS]},
        admin={"token": ADMIN_TOKEN},
    )


def new_session(label: str) -> str:
    return f"{label}-{uuid.uuid4().hex[:8]}"


def completion_body(
    prompt_tokens: int = PROMPT_TOKENS, max_tokens: int = MAX_TOKENS, **extra: Any
) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [100] * prompt_tokens, "max_tokens": max_tokens, **extra}


def post(
    gw: str,
    body: dict[str, Any],
    *,
    session: str | None = None,
    key: str | None = "alpha",
    path: str = "/v1/completions",
    timeout_s: float = 15.0,
) -> httpx.Response:
    headers: dict[str, str] = {}
    if session is not None:
        headers["X-Session-ID"] = session
    if key is not None:
        headers["Authorization"] = f"Bearer {KEYS[key]}"
    return httpx.post(gw + path, json=body, headers=headers, timeout=timeout_s)


def admin(method: str, gw: str, path: str, body: Any = None) -> httpx.Response:
    return httpx.request(method, gw + path, json=body,
                         headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)


def assert_openai_error(
    r: httpx.Response, status: int, code: str | None, type_: str | None = None
) -> dict[str, Any]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] == code, err
    if type_ is not None:
        assert err["type"] == type_, err
    result: dict[str, Any] = err
    return result


def retry_after_s(r: httpx.Response) -> int:
    assert "retry-after" in r.headers, f"no Retry-After on {r.status_code}: {r.text}"
    value = int(r.headers["retry-after"])
    assert value >= 1
    return value


def session_view(gw: str, session: str, tenant: str = "alpha") -> dict[str, Any] | None:
    r = admin("GET", gw, f"/admin/tenants/{tenant}/sessions/{session}")
    if r.status_code == 404:
        assert_openai_error(r, 404, "session_not_found")
        return None
    assert r.status_code == 200, r.text
    view: dict[str, Any] = r.json()
    return view


def listed_sessions(gw: str, top: int = 1000) -> dict[str, dict[str, Any]]:
    r = admin("GET", gw, f"/admin/sessions?top={top}")
    assert r.status_code == 200, r.text
    return {row["session_id"]: row for row in r.json()["data"]}


def gauge(gw: str, name: str) -> dict[str, float]:
    """The samples of one gauge family in /metrics, by their ``session`` label (or '')."""
    r = httpx.get(gw + "/metrics", timeout=10)
    assert r.status_code == 200
    series = promtext.samples(r.text).get(name, {})
    return {dict(labels).get("session", ""): value for labels, value in series.items()}


def counter(gw: str, name: str, **labels: str) -> float:
    r = httpx.get(gw + "/metrics", timeout=10)
    return promtext.value(r.text, name, **labels) or 0.0


def eventually(predicate: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        time.sleep(0.02)


def assert_holds(gw: str, session: str, requests: int, kv_bytes: int,
                 tenant: str = "alpha") -> None:
    view = session_view(gw, session, tenant)
    assert view is not None, f"session {session} unknown to the gateway"
    assert (view["inflight_requests"], view["inflight_kv_bytes"]) == (requests, kv_bytes), view


def assert_holds_nothing(gw: str, session: str, tenant: str = "alpha") -> None:
    view = session_view(gw, session, tenant)
    assert view is None or (view["inflight_requests"], view["inflight_kv_bytes"]) == (0, 0), view


def assert_released(gw: str, session: str, tenant: str = "alpha") -> None:
    """Every reservation of ``session`` returns to zero: in its own view, the top list and the
    top-K gauge. The release runs after the last byte reaches the client, so poll briefly."""

    def released() -> bool:
        view = session_view(gw, session, tenant)
        return view is None or (view["inflight_requests"], view["inflight_kv_bytes"]) == (0, 0)

    eventually(released, f"session {session} to hold nothing", RELEASE_TIMEOUT_S)
    assert session not in listed_sessions(gw)
    assert session not in gauge(gw, "kvgate_session_kv_bytes")


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def backend_app() -> HeldBackend:
    return HeldBackend()


@pytest.fixture(scope="module")
def backend(backend_app: HeldBackend) -> Iterator[str]:
    with serve_app(backend_app) as url:
        yield url


@pytest.fixture(scope="module")
def gw(backend: str) -> Iterator[str]:
    with serve_app(create_app(main_settings(backend)), ready_path="/ready") as url:
        yield url


@pytest.fixture(scope="module")
def open_gw(backend: str) -> Iterator[str]:
    """No API keys and no admin token: anonymous requests, admin API switched off."""
    settings = gateway_settings(
        [backend],
        budgets={"defaults": {"request_kv_bytes": "64MiB", "inflight_kv_bytes": "8MiB"}},
    )
    with serve_app(create_app(settings), ready_path="/ready") as url:
        yield url


@pytest.fixture(scope="module")
def pool() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=40) as executor:
        yield executor


@pytest.fixture
def backend_idle(backend_app: HeldBackend) -> Iterator[HeldBackend]:
    """The shared backend, checked idle before and after the test (a held request left behind
    would bleed into the next test), and with any leftover held requests let go."""
    backend_app.wait_holding(0)
    backend_app.reset_peak()
    try:
        yield backend_app
    finally:
        backend_app.release_all()
        backend_app.wait_holding(0)


def start(pool: ThreadPoolExecutor, fn: Callable[..., httpx.Response], *args: Any,
          **kwargs: Any) -> Future[httpx.Response]:
    return pool.submit(fn, *args, **kwargs)


# -- per-request KV footprint -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt_tokens", "max_tokens", "limit_text"),
    [
        (100, 500, "per-request KV bytes"),  # 600 tokens = 75 MiB > request_kv_bytes 64 MiB
        (50, 200, "in-flight KV bytes"),  # 250 tokens = 31.25 MiB: alone over the 24 MiB budget
    ],
)
def test_request_over_a_limit_it_can_never_pass_gets_400_kv_request_too_large(
    gw: str, backend_idle: HeldBackend, prompt_tokens: int, max_tokens: int, limit_text: str
) -> None:
    session = new_session("too-large")
    before = backend_idle.completions
    rejections = counter(gw, "kvgate_budget_rejections_total", reason="request_too_large")
    r = post(gw, completion_body(prompt_tokens, max_tokens), session=session)
    err = assert_openai_error(r, 400, "kv_request_too_large", "invalid_request_error")
    footprint = (prompt_tokens + max_tokens) * KV_BYTES_PER_TOKEN
    assert str(footprint) in err["message"], err["message"]
    assert str(prompt_tokens + max_tokens) in err["message"]
    assert limit_text in err["message"]
    assert "retry-after" not in r.headers  # waiting cannot help
    assert backend_idle.completions == before  # never forwarded
    assert session_view(gw, session) is None  # nothing reserved
    after = counter(gw, "kvgate_budget_rejections_total", reason="request_too_large")
    assert after == rejections + 1


def test_request_too_large_surfaces_through_the_openai_client_as_bad_request(gw: str) -> None:
    client = openai.OpenAI(base_url=gw + "/v1", api_key=KEYS["alpha"], max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[100] * 100, max_tokens=500,
                                  extra_headers={"X-Session-ID": new_session("oai")})
    assert info.value.status_code == 400
    assert info.value.code == "kv_request_too_large"


def test_request_at_exactly_the_per_request_limit_is_served_and_one_token_more_is_not(
    gw: str, backend_idle: HeldBackend
) -> None:
    """512 tokens x 128 KiB = 64 MiB = request_kv_bytes: the limit is inclusive. Key `wide`
    raises only the in-flight budget (128 MiB), so the default request limit is what binds."""
    r = post(gw, completion_body(12, 500), session=new_session("exact"), key="wide")
    assert r.status_code == 200, r.text
    r = post(gw, completion_body(13, 500), session=new_session("exact"), key="wide")
    err = assert_openai_error(r, 400, "kv_request_too_large")
    assert str(513 * KV_BYTES_PER_TOKEN) in err["message"]
    assert "per-request KV bytes" in err["message"]


# -- in-flight KV budget ----------------------------------------------------------------------


def test_footprint_counts_each_prompt_once_and_max_tokens_for_every_choice(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """n = 2 choices share the prompt's KV: (16 + 2 x 48) tokens. A chat prompt is counted as
    the gateway tokenized it (x-kvgate-prompt-tokens) plus max_tokens."""
    session = new_session("footprint")
    fut = start(pool, post, gw, completion_body(n=2, x_hold=True), session=session)
    backend_idle.wait_holding(1)
    assert_holds(gw, session, 1, (PROMPT_TOKENS + 2 * MAX_TOKENS) * KV_BYTES_PER_TOKEN)
    backend_idle.release_all()
    assert fut.result().status_code == 200
    assert_released(gw, session)

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "how big is my KV?"}],
            "max_tokens": 40, "stream": True, "x_hold": True}
    headers = {"X-Session-ID": session, "Authorization": f"Bearer {KEYS['alpha']}"}
    with httpx.stream("POST", gw + "/v1/chat/completions", json=chat, headers=headers,
                      timeout=10) as r:
        chunks = r.iter_bytes()
        assert b"first" in next(chunks)
        prompt_tokens = int(r.headers["x-kvgate-prompt-tokens"])
        assert prompt_tokens > 5
        backend_idle.wait_holding(1)
        assert_holds(gw, session, 1, (prompt_tokens + 40) * KV_BYTES_PER_TOKEN)
        backend_idle.release_all()
        assert b"[DONE]" in b"".join(chunks)
    assert_released(gw, session)


def test_session_at_its_inflight_budget_gets_429_with_retry_after_while_another_is_served(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    busy, other = new_session("busy"), new_session("other")
    held = [start(pool, post, gw, completion_body(x_hold=True), session=busy) for _ in range(3)]
    backend_idle.wait_holding(3)
    assert_holds(gw, busy, 3, INFLIGHT_BUDGET_BYTES)
    assert gauge(gw, "kvgate_session_kv_bytes")[busy] == INFLIGHT_BUDGET_BYTES
    assert gauge(gw, "kvgate_session_kv_budget_ratio")[busy] == pytest.approx(1.0)

    rejections = counter(gw, "kvgate_budget_rejections_total", reason="inflight_kv_bytes")
    r = post(gw, completion_body(), session=busy)
    err = assert_openai_error(r, 429, "kv_budget_exceeded", "rate_limit_error")
    assert counter(gw, "kvgate_budget_rejections_total", reason="inflight_kv_bytes") == (
        rejections + 1
    )
    assert "in-flight KV bytes" in err["message"]
    retry_after_s(r)

    served = post(gw, completion_body(), session=other)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["text"] == "ok"

    backend_idle.release_all()
    assert [f.result().status_code for f in held] == [200, 200, 200]
    assert_released(gw, busy)
    assert post(gw, completion_body(), session=busy).status_code == 200


def test_concurrent_requests_of_one_session_never_exceed_its_budget_and_all_return(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    session = new_session("burst")
    # Thirty at once against a budget of three: exactly three reach the worker.
    futures = [start(pool, post, gw, completion_body(x_hold=True), session=session)
               for _ in range(30)]
    eventually(lambda: sum(f.done() for f in futures) + backend_idle.holding == 30,
               "every request answered or held")
    assert backend_idle.holding == 3
    refused = [f.result() for f in futures if f.done()]
    for r in refused:
        assert_openai_error(r, 429, "kv_budget_exceeded")
        retry_after_s(r)
    assert backend_idle.peak_holding == 3
    assert_holds(gw, session, 3, INFLIGHT_BUDGET_BYTES)
    backend_idle.release_all()
    assert sorted(f.result().status_code for f in futures) == [200] * 3 + [429] * 27
    assert_released(gw, session)

    # Thirty clients that retry on 429 until served, streaming and not, each held 30 ms.
    backend_idle.reset_peak()

    def until_served(i: int) -> int:
        body = completion_body(x_hold_s=0.03, stream=i % 2 == 0)
        for attempt in range(1, 2000):
            r = post(gw, body, session=session)
            if r.status_code == 200:
                return attempt
            assert_openai_error(r, 429, "kv_budget_exceeded")
            time.sleep(0.005)
        raise AssertionError("never served")

    attempts = list(pool.map(until_served, range(30)))
    assert len(attempts) == 30 and max(attempts) > 1  # they did contend
    assert backend_idle.peak_holding in (1, 2, 3)
    assert_released(gw, session)


# -- session identity -------------------------------------------------------------------------


def test_session_is_the_header_else_the_user_field_else_the_tenants_default_session(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """The API key is the tenant; the session is scoped inside it (changed on purpose: the key's
    name used to be the session of a request naming none)."""
    header, user = new_session("hdr"), new_session("usr")
    both = start(pool, post, gw, completion_body(x_hold=True, user=user), session=header,
                 key="ident")
    backend_idle.wait_holding(1)
    assert_holds(gw, header, 1, FOOTPRINT_BYTES, "ident")
    assert_holds_nothing(gw, user, "ident")
    assert_holds_nothing(gw, "default", "ident")

    by_user = start(pool, post, gw, completion_body(x_hold=True, user=user), key="ident")
    backend_idle.wait_holding(2)
    assert_holds(gw, user, 1, FOOTPRINT_BYTES, "ident")
    assert_holds_nothing(gw, "default", "ident")

    by_key = start(pool, post, gw, completion_body(x_hold=True), key="ident")
    backend_idle.wait_holding(3)
    assert_holds(gw, "default", 1, FOOTPRINT_BYTES, "ident")
    assert_holds(gw, header, 1, FOOTPRINT_BYTES, "ident")
    assert_holds_nothing(gw, header)  # alpha's session of that name is another one

    backend_idle.release_all()
    assert [f.result().status_code for f in (both, by_user, by_key)] == [200, 200, 200]
    for session in (header, user, "default"):
        assert_released(gw, session, "ident")


def test_user_field_sessions_are_budgeted_separately(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    user, other = new_session("u1"), new_session("u2")
    held = [start(pool, post, gw, completion_body(x_hold=True, user=user), key="ident")
            for _ in range(3)]
    backend_idle.wait_holding(3)
    assert_openai_error(post(gw, completion_body(user=user), key="ident"), 429,
                        "kv_budget_exceeded")
    assert post(gw, completion_body(user=other), key="ident").status_code == 200
    backend_idle.release_all()
    assert [f.result().status_code for f in held] == [200] * 3
    assert_released(gw, user)


def test_requests_naming_no_session_share_the_tenants_default_session_budget(
    open_gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """Regression (changed on purpose): no header, no user, no API key used to reserve nothing,
    so any number of 8 MiB requests ran at once past an 8 MiB budget. They are now the
    anonymous tenant's ``default`` session's."""
    held = start(pool, post, open_gw, completion_body(x_hold=True), key=None)
    backend_idle.wait_holding(1)
    assert_openai_error(post(open_gw, completion_body(), key=None), 429, "kv_budget_exceeded")
    assert_openai_error(post(open_gw, completion_body(100, 500), key=None), 400,
                        "kv_request_too_large")
    # A named session has its own budget.
    session = new_session("named")
    first = start(pool, post, open_gw, completion_body(x_hold=True), session=session, key=None)
    backend_idle.wait_holding(2)
    assert_openai_error(post(open_gw, completion_body(), session=session, key=None), 429,
                        "kv_budget_exceeded")
    backend_idle.release_all()
    assert [f.result().status_code for f in [held, first]] == [200] * 2


# -- rate limits and byte-seconds ----------------------------------------------------------


def test_requests_per_minute_exceeded_gets_429_rate_limit_exceeded(
    gw: str, backend_idle: HeldBackend
) -> None:
    session = new_session("rpm")
    assert post(gw, completion_body(), session=session, key="rpm").status_code == 200
    assert post(gw, completion_body(), session=session, key="rpm").status_code == 200
    r = post(gw, completion_body(), session=session, key="rpm")
    err = assert_openai_error(r, 429, "rate_limit_exceeded", "rate_limit_error")
    assert "requests per minute" in err["message"]
    retry_after = retry_after_s(r)
    assert retry_after >= 1 and retry_after <= 30  # one request refills in 60 s / 2
    # Another session of the same key has its own bucket.
    assert post(gw, completion_body(), session=new_session("rpm"), key="rpm").status_code == 200


def test_tokens_per_minute_exceeded_gets_429_and_a_request_over_it_400(
    gw: str, backend_idle: HeldBackend
) -> None:
    session = new_session("tpm")
    # 64 tokens of a 100-token bucket; the worker reports no usage, so nothing is refunded.
    assert post(gw, completion_body(), session=session, key="tpm").status_code == 200
    r = post(gw, completion_body(), session=session, key="tpm")
    err = assert_openai_error(r, 429, "rate_limit_exceeded", "rate_limit_error")
    assert "tokens per minute" in err["message"]
    retry_after_s(r)
    r = post(gw, completion_body(20, 90), session=new_session("tpm"), key="tpm")
    err = assert_openai_error(r, 400, "kv_request_too_large")
    assert "tokens per minute" in err["message"]


def test_tokens_per_minute_are_refunded_down_to_the_reported_usage(
    gw: str, backend_idle: HeldBackend
) -> None:
    session = new_session("refund")
    r = post(gw, completion_body(x_usage_total=10), session=session, key="tpm")
    assert r.status_code == 200, r.text

    def refunded() -> bool:
        view = session_view(gw, session, "tpm")
        return view is not None and view["tokens_available"] >= 89  # 100 - 10 used (+ refill)

    eventually(refunded, "the 54 unused tokens refunded")
    assert post(gw, completion_body(), session=session, key="tpm").status_code == 200


@pytest.mark.parametrize("n", [1, 4])
def test_a_stream_left_before_its_usage_is_charged_per_chunk_usage_only_for_one_sequence(
    gw: str, backend_idle: HeldBackend, n: int
) -> None:
    """``continuous_usage_stats``: vLLM's per-chunk usage counts one choice's tokens of one
    prompt. Regression: a client that left an ``n``-choice stream before its last chunk was
    charged that (1/n of what it got; tokens per minute walked around n-fold). With one
    sequence the per-chunk usage is the request's and is refunded down to; with several the
    reservation is kept, as for any stream cut short without usage."""
    session = new_session(f"chunk-usage-{n}")
    body = completion_body(16, 80 // n, n=n, stream=True, x_hold=True, x_chunk_usage_total=20,
                           stream_options={"include_usage": True, "continuous_usage_stats": True})
    headers = {"X-Session-ID": session, "Authorization": f"Bearer {KEYS['tpm']}"}
    with httpx.stream("POST", gw + "/v1/completions", headers=headers, json=body,
                      timeout=10) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # kept: a dropped iterator closes the response
        assert b'"usage"' in next(chunks)
        backend_idle.wait_holding(1)
    assert_released(gw, session, "tpm")
    view = session_view(gw, session, "tpm")
    assert view is not None
    if n == 1:  # 96 reserved, 20 used: refunded (+ refill)
        assert view["tokens_available"] >= 79, view
    else:  # 96 reserved and kept (+ refill over the test's seconds)
        assert view["tokens_available"] < 20, view


def test_a_client_that_closes_right_after_its_request_has_it_aborted_and_released(
    gw: str, backend_idle: HeldBackend
) -> None:
    """Regression: a client gone before the proxy started listening for it (it closed right
    after sending, while the request was admitted and routed) was never noticed: the request
    went to the worker, which generated the whole answer for nobody, its reservation held."""
    session = new_session("fire-and-forget")

    def left() -> float:  # requests that ended with their client gone
        return sum(promtext.values(httpx.get(gw + "/metrics", timeout=10).text,
                                   "kvgate_requests_total", code="499"))

    before = left()
    # over ``INLINE_TOKENIZE_BYTES``: tokenized in the pool, so the close is read meanwhile
    body = json.dumps(completion_body(x_hold=True, x_pad="p" * INLINE_TOKENIZE_BYTES)).encode()
    address = urllib.parse.urlsplit(gw)
    with socket.create_connection((address.hostname, address.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                     b"application/json\r\nx-session-id: %s\r\nauthorization: Bearer %s\r\n"
                     b"content-length: %d\r\n\r\n%s" % (session.encode(), KEYS["alpha"].encode(),
                                                      len(body), body))
    eventually(lambda: left() == before + 1, "the request to end as its client left (499)")
    assert_released(gw, session)
    eventually(lambda: backend_idle.holding == 0, "nothing held by the worker")


def test_kv_byte_seconds_used_up_gets_429_kv_byte_seconds_exceeded(
    gw: str, backend_idle: HeldBackend
) -> None:
    """1 MiB-second of budget; an 8 MiB request held 0.2 s burns 1.6 MiB-seconds."""
    session = new_session("bs")
    r = post(gw, completion_body(x_hold_s=0.2), session=session, key="bs")
    assert r.status_code == 200, r.text
    assert_released(gw, session)
    r = post(gw, completion_body(), session=session, key="bs")
    err = assert_openai_error(r, 429, "kv_byte_seconds_exceeded", "rate_limit_error")
    assert "KV byte-seconds" in err["message"]
    retry_after_s(r)


# -- reservations return to zero on every ending --------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_worker_500_passes_through_and_releases_the_reservation(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor, stream: bool
) -> None:
    session = new_session("w500")
    body = completion_body(x_hold=True, x_status=500, stream=stream)
    fut = start(pool, post, gw, body, session=session)
    if not stream:  # a stream's error status comes before any hold
        backend_idle.wait_holding(1)
        assert_holds(gw, session, 1, FOOTPRINT_BYTES)
        backend_idle.release_all()
    r = fut.result()
    assert r.status_code == 500
    assert r.json()["error"]["message"] == "worker failed with 500"
    assert_released(gw, session)


def test_worker_crash_mid_stream_releases_the_reservation(
    gw: str, backend_idle: HeldBackend
) -> None:
    session = new_session("crash")
    r = post(gw, completion_body(stream=True, x_break=True), session=session)
    assert r.status_code == 200  # the stream had started
    assert b'"code":"upstream_error"' in r.content
    assert_released(gw, session)


def test_client_disconnect_mid_stream_releases_the_reservation(
    gw: str, backend_idle: HeldBackend
) -> None:
    session = new_session("gone-stream")
    aborted = backend_idle.aborted
    headers = {"X-Session-ID": session, "Authorization": f"Bearer {KEYS['alpha']}"}
    with httpx.stream("POST", gw + "/v1/completions", headers=headers,
                      json=completion_body(stream=True, x_hold=True), timeout=10) as r:
        assert r.status_code == 200
        chunks = r.iter_bytes()  # kept: a dropped iterator closes the response
        assert b"first" in next(chunks)
        backend_idle.wait_holding(1)
        assert_holds(gw, session, 1, FOOTPRINT_BYTES)
    # The client is gone: the gateway aborts the upstream request and gives the budget back.
    eventually(lambda: backend_idle.aborted == aborted + 1, "the worker to see the abort")
    assert_released(gw, session)


def test_client_disconnect_while_waiting_for_a_whole_answer_releases_the_reservation(
    gw: str, backend_idle: HeldBackend
) -> None:
    session = new_session("gone-whole")
    aborted = backend_idle.aborted
    with pytest.raises(httpx.ReadTimeout):
        post(gw, completion_body(x_hold=True), session=session, timeout_s=0.5)
    eventually(lambda: backend_idle.aborted == aborted + 1, "the worker to see the abort")
    assert_released(gw, session)


def test_no_healthy_worker_for_the_model_gets_503_and_releases_the_reservation(
    gw: str, backend_idle: HeldBackend
) -> None:
    session = new_session("ghost")
    body = {**completion_body(), "model": GHOST_MODEL}
    for _ in range(4):  # more than the budget's three: each 503 gave its reservation back
        r = post(gw, body, session=session)
        assert_openai_error(r, 503, "no_healthy_worker")
    assert_released(gw, session)


def test_upstream_connection_failure_gets_502_and_releases_the_reservation() -> None:
    doomed = HeldBackend()
    with serve_app(doomed) as worker:
        settings = gateway_settings(
            [worker],
            health={"interval_s": 60, "unhealthy_threshold": 5},
            budgets={"defaults": {"inflight_kv_bytes": "8MiB"}},
            admin={"token": ADMIN_TOKEN},
        )
        gw_ctx = serve_app(create_app(settings), ready_path="/ready")
        gateway = gw_ctx.__enter__()
    # The worker is gone; the gateway still believes it healthy (next check in 60 s).
    try:
        session = new_session("refused")
        for _ in range(3):  # a budget of one request: each 502 gave its reservation back
            r = post(gateway, completion_body(), session=session, key=None)
            assert_openai_error(r, 502, "upstream_unreachable")
        assert_released(gateway, session, "anonymous")
    finally:
        gw_ctx.__exit__(None, None, None)


# -- operator throttles -----------------------------------------------------------------------


def test_operator_block_refuses_the_session_until_lifted(
    gw: str, backend_idle: HeldBackend
) -> None:
    session = new_session("blocked")
    r = admin("POST", gw, f"/admin/tenants/alpha/sessions/{session}/throttle",
              {"state": "blocked", "ttl_s": 120, "reason": "abuse ticket 42"})
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "blocked"
    view = session_view(gw, session)
    assert view is not None and view["throttle"]["state"] == "blocked"
    assert view["throttle"]["reason"] == "abuse ticket 42"
    assert gauge(gw, "kvgate_throttled_sessions")[""] >= 1

    r = post(gw, completion_body(), session=session)
    err = assert_openai_error(r, 429, "session_throttled", "rate_limit_error")
    assert "blocked" in err["message"]
    assert 60 < retry_after_s(r) <= 120  # until the block expires
    assert post(gw, completion_body(), session=new_session("free")).status_code == 200

    r = admin("DELETE", gw, f"/admin/tenants/alpha/sessions/{session}/throttle")
    assert r.status_code == 200
    assert r.json() == {"tenant": "alpha", "session_id": session, "lifted": True}
    assert post(gw, completion_body(), session=session).status_code == 200
    r = admin("DELETE", gw, f"/admin/tenants/alpha/sessions/{session}/throttle")
    assert r.json()["lifted"] is False


def test_throttled_session_gets_one_request_in_flight(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    session = new_session("throttled")
    r = admin("POST", gw, f"/admin/tenants/alpha/sessions/{session}/throttle", {"state": "throttled"})
    assert r.status_code == 200, r.text
    first = start(pool, post, gw, completion_body(x_hold=True), session=session)
    backend_idle.wait_holding(1)
    r = post(gw, completion_body(), session=session)
    err = assert_openai_error(r, 429, "session_throttled")
    assert "throttled" in err["message"]
    retry_after_s(r)
    backend_idle.release_all()
    assert first.result().status_code == 200
    assert_released(gw, session)
    assert post(gw, completion_body(), session=session).status_code == 200
    assert admin("DELETE", gw, f"/admin/tenants/alpha/sessions/{session}/throttle").json()["lifted"] is True


def test_throttle_request_with_bad_fields_is_400_openai_shaped(gw: str) -> None:
    r = admin("POST", gw, f"/admin/tenants/alpha/sessions/{new_session('bad')}/throttle", {"state": "frozen"})
    assert_openai_error(r, 400, None, "invalid_request_error")


# -- Alertmanager -----------------------------------------------------------------------------


def am_alert(
    session: str | None, status: str, *, alertname: str = "KvgateRunawaySession",
    throttle: str | None = "throttled", tenant: str | None = "alpha",
) -> dict[str, Any]:
    """One alert exactly as Alertmanager's webhook (version 4) sends it."""
    labels = {"alertname": alertname, "severity": "warning"}
    if tenant is not None and session is not None:
        labels["tenant"] = tenant
    if session is not None:
        labels["session"] = session
    if throttle is not None:
        labels["throttle"] = throttle
    return {
        "status": status,
        "labels": labels,
        "annotations": {
            "summary": f"Session {session} holds 97.3% of its in-flight KV budget",
            "description": f"Session {session} has held more than 90% of its in-flight KV budget"
                           " for 5 minutes (97.3% now).",
            "runbook_url": "docs/runbook.md#kvgaterunawaysession",
        },
        "startsAt": "2025-03-14T09:26:53.589Z",
        "endsAt": "0001-01-01T00:00:00Z" if status == "firing" else "2025-03-14T09:41:53.589Z",
        "generatorURL": "http://prometheus:9090/graph?g0.expr=max+by+%28tenant%2Csession%29+%28kvgate_"
                        "session_kv_budget_ratio%29+%3E+0.9&g0.tab=1",
        "fingerprint": hashlib.sha256(json.dumps(labels, sort_keys=True).encode())
        .hexdigest()[:16],
    }


def alpha(session: str) -> dict[str, str]:
    """A session of tenant ``alpha`` as the webhook's answer names it."""
    return {"tenant": "alpha", "session_id": session}


def am_payload(alerts: list[dict[str, Any]]) -> dict[str, Any]:
    common_labels = dict(alerts[0]["labels"])
    for a in alerts[1:]:
        common_labels = {k: v for k, v in common_labels.items() if a["labels"].get(k) == v}
    common_annotations = dict(alerts[0]["annotations"])
    for a in alerts[1:]:
        common_annotations = {k: v for k, v in common_annotations.items()
                              if a["annotations"].get(k) == v}
    return {
        "receiver": "kvgate-throttle",
        "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
        "alerts": alerts,
        "groupLabels": {"alertname": alerts[0]["labels"]["alertname"]},
        "commonLabels": common_labels,
        "commonAnnotations": common_annotations,
        "externalURL": "http://alertmanager:9093",
        "version": "4",
        "groupKey": '{}/{severity="warning"}:{alertname="KvgateRunawaySession"}',
        "truncatedAlerts": 0,
    }


def test_firing_alert_throttles_the_session_and_resolved_lifts_it(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    session = new_session("runaway")
    r = admin("POST", gw, "/admin/alerts", am_payload([am_alert(session, "firing")]))
    assert r.status_code == 200, r.text
    assert r.json() == {"throttled": [alpha(session)], "lifted": []}
    view = session_view(gw, session)
    assert view is not None
    assert view["throttle"]["state"] == "throttled"
    assert view["throttle"]["reason"] == "KvgateRunawaySession"

    first = start(pool, post, gw, completion_body(x_hold=True), session=session)
    backend_idle.wait_holding(1)
    assert_openai_error(post(gw, completion_body(), session=session), 429, "session_throttled")
    backend_idle.release_all()
    assert first.result().status_code == 200

    r = admin("POST", gw, "/admin/alerts", am_payload([am_alert(session, "resolved")]))
    assert r.status_code == 200, r.text
    assert r.json() == {"throttled": [], "lifted": [alpha(session)]}
    held = [start(pool, post, gw, completion_body(x_hold=True), session=session)
            for _ in range(2)]
    backend_idle.wait_holding(2)  # two in flight again
    backend_idle.release_all()
    assert [f.result().status_code for f in held] == [200, 200]
    assert_released(gw, session)


def test_alert_with_throttle_label_blocked_blocks_the_session(gw: str) -> None:
    session = new_session("alert-block")
    payload = am_payload([am_alert(session, "firing", alertname="KvgateAbuse",
                                   throttle="blocked")])
    assert admin("POST", gw, "/admin/alerts", payload).json()["throttled"] == [alpha(session)]
    r = post(gw, completion_body(), session=session)
    assert "blocked" in assert_openai_error(r, 429, "session_throttled")["message"]
    assert 800 < retry_after_s(r) <= 900  # admin.alert_throttle_ttl_s
    resolved = am_payload([am_alert(session, "resolved", alertname="KvgateAbuse",
                                    throttle="blocked")])
    assert admin("POST", gw, "/admin/alerts", resolved).json()["lifted"] == [alpha(session)]
    assert post(gw, completion_body(), session=session).status_code == 200


def test_alert_group_with_firing_resolved_and_unlabelled_alerts_acts_per_alert(
    gw: str,
) -> None:
    hot, cooled = new_session("hot"), new_session("cooled")
    admin("POST", gw, "/admin/alerts", am_payload([am_alert(cooled, "firing")]))
    payload = am_payload([
        am_alert(hot, "firing"),
        am_alert(cooled, "resolved"),
        am_alert(None, "firing", alertname="KvgateWorkerKvCacheNearFull", throttle=None),
    ])
    r = admin("POST", gw, "/admin/alerts", payload)
    assert r.status_code == 200, r.text
    assert r.json() == {"throttled": [alpha(hot)], "lifted": [alpha(cooled)]}
    hot_view = session_view(gw, hot)
    assert hot_view is not None and hot_view["throttle"]["state"] == "throttled"
    cooled_view = session_view(gw, cooled)
    assert cooled_view is None or cooled_view["throttle"] is None
    admin("DELETE", gw, f"/admin/tenants/alpha/sessions/{hot}/throttle")


def test_alert_on_an_exported_session_label_throttles_the_raw_session_id(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """The alert carries the `session` label as /metrics exported it (sanitized: an id with
    spaces or slashes keeps a prefix plus a hash); it must reach the session clients name raw."""
    raw = f"team a/conv #{uuid.uuid4().hex[:6]}"
    fut = start(pool, post, gw, completion_body(x_hold=True), session=raw)
    backend_idle.wait_holding(1)
    labels = [s for s in gauge(gw, "kvgate_session_kv_bytes") if s.startswith("team_a_conv")]
    assert len(labels) == 1 and " " not in labels[0] and "/" not in labels[0]
    backend_idle.release_all()
    assert fut.result().status_code == 200
    payload = am_payload([am_alert(labels[0], "firing", throttle="blocked")])
    assert admin("POST", gw, "/admin/alerts", payload).json()["throttled"] == [alpha(labels[0])]
    try:
        assert_openai_error(post(gw, completion_body(), session=raw), 429, "session_throttled")
    finally:
        admin("DELETE", gw, f"/admin/tenants/alpha/sessions/{labels[0]}/throttle")
    assert post(gw, completion_body(), session=raw).status_code == 200


def test_resolved_alert_does_not_lift_an_operator_block(gw: str) -> None:
    """Bug: the webhook lifts whatever throttle a session has when an alert on it resolves.
    The realistic order: the runaway alert fires (session throttled), an operator escalates to a
    block, the blocked session's in-flight KV drains so the alert resolves, and Alertmanager's
    resolved notification silently undoes the operator's block."""
    session = new_session("escalated")
    admin("POST", gw, "/admin/alerts", am_payload([am_alert(session, "firing")]))
    r = admin("POST", gw, f"/admin/tenants/alpha/sessions/{session}/throttle",
              {"state": "blocked", "ttl_s": 3600, "reason": "operator escalation"})
    assert r.status_code == 200, r.text
    admin("POST", gw, "/admin/alerts", am_payload([am_alert(session, "resolved")]))
    try:
        view = session_view(gw, session)
        assert view is not None and view["throttle"] is not None, "operator block lifted"
        assert view["throttle"]["state"] == "blocked"
        assert_openai_error(post(gw, completion_body(), session=session), 429,
                            "session_throttled")
    finally:
        admin("DELETE", gw, f"/admin/tenants/alpha/sessions/{session}/throttle")


def test_firing_alert_does_not_loosen_an_operator_block(gw: str) -> None:
    """Bug: a firing alert (throttle: throttled) replaces an operator's `blocked` with
    `throttled`, so the next Alertmanager repeat lets a blocked session back in."""
    session = new_session("keep-blocked")
    admin("POST", gw, f"/admin/tenants/alpha/sessions/{session}/throttle", {"state": "blocked", "ttl_s": 3600})
    admin("POST", gw, "/admin/alerts", am_payload([am_alert(session, "firing")]))
    try:
        view = session_view(gw, session)
        assert view is not None and view["throttle"]["state"] == "blocked", view
    finally:
        admin("DELETE", gw, f"/admin/tenants/alpha/sessions/{session}/throttle")


# -- API keys ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("authorization", "code"),
    [
        (None, "missing_api_key"),
        ("Bearer", "missing_api_key"),
        (f"Basic {KEYS['alpha']}", "missing_api_key"),
        ("Bearer sk-not-a-key", "invalid_api_key"),
        (f"Bearer {ADMIN_TOKEN}", "invalid_api_key"),  # the admin token is no client key
    ],
)
def test_completion_without_a_valid_api_key_gets_401(
    gw: str, backend_idle: HeldBackend, authorization: str | None, code: str
) -> None:
    before = backend_idle.completions
    headers = {} if authorization is None else {"Authorization": authorization}
    r = httpx.post(gw + "/v1/completions", json=completion_body(), headers=headers)
    assert_openai_error(r, 401, code, "authentication_error")
    assert backend_idle.completions == before


def test_openai_client_with_a_valid_key_is_served_and_a_wrong_one_refused(gw: str) -> None:
    good = openai.OpenAI(base_url=gw + "/v1", api_key=KEYS["alpha"], max_retries=0)
    done = good.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        extra_headers={"X-Session-ID": new_session("oai-ok")},
    )
    assert done.choices[0].message.content == "ok"
    bad = openai.OpenAI(base_url=gw + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert info.value.code == "invalid_api_key"


def test_per_key_overrides_apply_and_keep_the_other_defaults(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    # `big` lifts request_kv_bytes: 1024 tokens = 128 MiB, refused for alpha, served for big.
    body = completion_body(24, 1000)
    assert_openai_error(post(gw, body, session=new_session("a")), 400, "kv_request_too_large")
    assert post(gw, body, session=new_session("b"), key="big").status_code == 200
    # `big` holds four standard requests (32 MiB) where alpha's budget stops at three.
    session = new_session("big")
    held = [start(pool, post, gw, completion_body(x_hold=True), session=session, key="big")
            for _ in range(4)]
    backend_idle.wait_holding(4)
    assert_holds(gw, session, 4, 4 * FOOTPRINT_BYTES, "big")
    backend_idle.release_all()
    assert [f.result().status_code for f in held] == [200] * 4
    # `rpm` overrides only requests_per_minute: the default request_kv_bytes still binds.
    r = post(gw, completion_body(100, 500), session=new_session("rpm"), key="rpm")
    assert_openai_error(r, 400, "kv_request_too_large")
    assert_released(gw, session, "big")


def test_budget_ratio_gauge_uses_the_per_key_budget_of_the_session(
    gw: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """Bug: kvgate_session_kv_budget_ratio divides by the default in-flight budget for every
    session. A `big` session holding 32 MiB of its 256 MiB budget (12.5%) is exported at 1.33,
    so KvgateRunawaySession (ratio > 0.9) fires and the webhook throttles a healthy session;
    a key with a smaller budget than the default is never flagged."""
    session = new_session("big-ratio")
    held = [start(pool, post, gw, completion_body(x_hold=True), session=session, key="big")
            for _ in range(4)]
    backend_idle.wait_holding(4)
    try:
        assert gauge(gw, "kvgate_session_kv_bytes")[session] == 4 * FOOTPRINT_BYTES
        ratio = gauge(gw, "kvgate_session_kv_budget_ratio")[session]
        assert ratio == pytest.approx(4 * FOOTPRINT_BYTES / (256 * MiB))
    finally:
        backend_idle.release_all()
        for f in held:
            f.result()


# -- admin API access -------------------------------------------------------------------------

ADMIN_CALLS = [
    ("GET", "/admin/sessions", None),
    ("GET", "/admin/tenants", None),
    ("GET", "/admin/tenants/alpha", None),
    ("GET", "/admin/tenants/alpha/sessions/some-session", None),
    ("POST", "/admin/tenants/alpha/sessions/some-session/throttle", {"state": "blocked"}),
    ("DELETE", "/admin/tenants/alpha/sessions/some-session/throttle", None),
    ("POST", "/admin/tenants/alpha/throttle", {"state": "blocked"}),
    ("DELETE", "/admin/tenants/alpha/throttle", None),
    ("POST", "/admin/alerts", am_payload([am_alert("some-session", "firing")])),
]


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
@pytest.mark.parametrize(
    ("authorization", "status", "code"),
    [
        (None, 401, "missing_admin_token"),
        ("Bearer wrong-token", 401, "invalid_admin_token"),
        (f"Bearer {KEYS['alpha']}", 403, "not_an_admin_token"),
    ],
)
def test_admin_api_refuses_callers_without_the_admin_token(
    gw: str, method: str, path: str, body: Any, authorization: str | None, status: int,
    code: str,
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    r = httpx.request(method, gw + path, json=body, headers=headers)
    assert_openai_error(r, status, code, "authentication_error" if status == 401
                        else "permission_error")
    assert session_view(gw, "some-session") is None  # nothing was throttled


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_CALLS)
@pytest.mark.parametrize("authorization", [None, f"Bearer {ADMIN_TOKEN}"])
def test_admin_api_is_403_when_no_admin_token_is_configured(
    open_gw: str, method: str, path: str, body: Any, authorization: str | None
) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    r = httpx.request(method, open_gw + path, json=body, headers=headers)
    assert_openai_error(r, 403, "admin_disabled", "permission_error")


def test_unknown_session_or_tenant_is_404_openai_shaped(gw: str) -> None:
    r = admin("GET", gw, f"/admin/tenants/alpha/sessions/{new_session('nobody')}")
    assert_openai_error(r, 404, "session_not_found")
    for method, path in (("GET", "/admin/tenants/nobody"),
                         ("GET", "/admin/tenants/nobody/sessions/s"),
                         ("POST", "/admin/tenants/nobody/throttle")):
        r = admin(method, gw, path, {} if method == "POST" else None)
        assert_openai_error(r, 404, "tenant_not_found")


# -- bounded metric cardinality ---------------------------------------------------------------


def test_ten_thousand_sessions_export_at_most_top_k_series_and_leavers_lose_theirs(
    backend: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    top_k = 5
    sessions = 10_000
    captured = LoopCapture(create_app(gateway_settings(
        [backend],
        budgets={"defaults": {"inflight_kv_bytes": "16GiB"}, "top_k": top_k},
        admin={"token": ADMIN_TOKEN},
    )))
    with serve_app(captured, ready_path="/ready") as gateway:
        services: Services = captured.app.api.state.services

        async def hold_all() -> list[Reservation]:
            # Session bulk-i holds i + 1 tokens of KV: a strict order, largest last.
            return [
                await services.budgets.admit("anonymous", f"bulk-{i:05d}",
                                             (i + 1) * KV_BYTES_PER_TOKEN, i + 1)
                for i in range(sessions)
            ]

        async def release_all(reservations: list[Reservation]) -> None:
            for res in reservations:
                await services.budgets.release(res)

        reservations: list[Reservation] = captured.run(hold_all())
        expected_top = {f"bulk-{i:05d}": (i + 1) * KV_BYTES_PER_TOKEN
                        for i in range(sessions - top_k, sessions)}
        assert gauge(gateway, "kvgate_session_kv_bytes") == expected_top
        assert set(gauge(gateway, "kvgate_session_kv_budget_ratio")) == set(expected_top)
        assert len(listed_sessions(gateway, top=1000)) == 1000

        # A whale enters the top K through the gateway; the smallest of the K loses its series.
        whale = new_session("whale")
        fut = start(pool, post, gateway, completion_body(20_000, 1, x_hold=True),
                    session=whale, key=None)
        backend_idle.wait_holding(1)
        series = gauge(gateway, "kvgate_session_kv_bytes")
        assert len(series) == top_k
        assert series[whale] == 20_001 * KV_BYTES_PER_TOKEN
        assert f"bulk-{sessions - top_k:05d}" not in series
        # The whale leaves: its series goes, the displaced session's comes back.
        backend_idle.release_all()
        assert fut.result().status_code == 200
        eventually(lambda: whale not in gauge(gateway, "kvgate_session_kv_bytes"),
                   "the whale's series to go")
        assert gauge(gateway, "kvgate_session_kv_bytes") == expected_top
        assert whale not in gauge(gateway, "kvgate_session_kv_budget_ratio")

        captured.run(release_all(reservations))
        assert gauge(gateway, "kvgate_session_kv_bytes") == {}
        assert gauge(gateway, "kvgate_session_kv_budget_ratio") == {}


def test_admin_sessions_lists_top_k_sessions_by_default(
    backend: str, backend_idle: HeldBackend, pool: ThreadPoolExecutor
) -> None:
    """Bug: GET /admin/sessions defaults to 20 rows whatever budgets.top_k says (its `top`
    query parameter has a literal default of 20), though top_k is documented as the number of
    sessions it lists by default."""
    settings = gateway_settings(
        [backend], budgets={"top_k": 2}, admin={"token": ADMIN_TOKEN},
    )
    with serve_app(create_app(settings), ready_path="/ready") as gateway:
        sessions = [new_session(f"top{i}") for i in range(4)]
        held = [start(pool, post, gateway, completion_body(16, 16 * (i + 1), x_hold=True),
                      session=s, key=None) for i, s in enumerate(sessions)]
        backend_idle.wait_holding(4)
        try:
            assert set(gauge(gateway, "kvgate_session_kv_bytes")) == set(sessions[2:])
            assert len(listed_sessions(gateway, top=10)) == 4
            r = admin("GET", gateway, "/admin/sessions")
            assert [row["session_id"] for row in r.json()["data"]] == sessions[:1:-1]
        finally:
            backend_idle.release_all()
            for f in held:
                f.result()

"""Bad input: nothing a client sends makes the gateway answer 5xx, and every 4xx is OpenAI-shaped
(issue 7).

Two halves:

* schemathesis, against the gateway's own OpenAPI schema (``create_app(settings).api.openapi()``)
  with hand-written request bodies for the two completion routes (their FastAPI routes take the
  raw ``Request``, so the published schema has no body for them), positive and negative
  examples, a fixed number per operation, derandomized (the same examples every run);
* targeted cases the generator is unlikely to find: bytes that are not UTF-8, numbers beyond
  float and int64, zero and negative ``max_tokens``, ``n > 1`` with streaming, wrong types,
  10 MB bodies, JSON nested 100,000 levels (and just under the parser's limit), session ids of
  10 KB or with control characters (served; never a raw label in /metrics), unknown models,
  wrong methods, content types that are not JSON, a client that leaves mid-upload.

The backend records every body it is sent, so pass-through claims are checked on the bytes.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, cast

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given
from hypothesis import settings as hypothesis_settings
from starlette.types import Receive, Scope, Send

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from tests.harness import answer_probe, read_asgi_body, serve_app

pytestmark = pytest.mark.timeout(120)

ADMIN = "admin-secret"
MAX_BODY_BYTES = 1024 * 1024
MAX_EXAMPLES = 50
CHAT = {"model": "noop", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
SAFE_LABEL = re.compile(r"[A-Za-z0-9._:@~-]{1,128}")


class RecordingWorker:
    """An OpenAI-style backend that answers at once (or after the body's ``hold_s``, or, with
    ``"hold": true``, once ``release`` is set) and keeps the raw body of every completion it was
    sent."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.release = threading.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["path"] not in ("/v1/chat/completions", "/v1/completions"):
            await answer_probe(scope, send)
            return
        raw = await read_asgi_body(receive)
        self.bodies.append(raw)
        body = orjson.loads(raw)
        hold_s = body.get("hold_s")
        if isinstance(hold_s, (int, float)):
            await asyncio.sleep(float(hold_s))
        if body.get("hold") is True:
            await asyncio.to_thread(self.release.wait, 120)
        if body.get("stream"):
            chunk = orjson.dumps({"id": "c", "object": "chat.completion.chunk", "created": 0,
                                  "model": "noop", "choices": [{"index": 0, "delta": {
                                      "content": "ok"}, "finish_reason": "stop"}]})
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "more_body": True,
                        "body": b"data: " + chunk + b"\n\ndata: [DONE]\n\n"})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": orjson.dumps({
            "id": "c", "object": "chat.completion", "created": 0, "model": "noop",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                         "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})})


def gateway_settings(worker_url: str) -> Any:
    return build_settings({
        "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "workers": [worker_url]}],
        "health": {"interval_s": 60},
        "limits": {"max_body_bytes": MAX_BODY_BYTES},
        "budgets": {"defaults": {"inflight_kv_bytes": "64GiB"}},
        "admin": {"token": ADMIN},
    })


@pytest.fixture(scope="module")
def worker() -> RecordingWorker:
    return RecordingWorker()


@pytest.fixture(scope="module")
def gw(worker: RecordingWorker) -> Iterator[str]:
    with serve_app(worker) as worker_url, serve_app(
            create_app(gateway_settings(worker_url)), ready_path="/ready") as url:
        yield url


def assert_openai_error(r: httpx.Response, status: int | None = None,
                        param: str | None = None, code: str | None = None) -> dict[str, Any]:
    if status is not None:
        assert r.status_code == status, r.text
    assert 400 <= r.status_code < 500, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# -- schemathesis ------------------------------------------------------------------------------

_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "user", "assistant"]},
        "content": {"anyOf": [
            {"type": "string", "maxLength": 200},
            {"type": "array", "maxItems": 3, "items": {
                "type": "object", "required": ["type", "text"],
                "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}},
        ]},
        "name": {"type": "string"},
    },
}
_COMMON = {
    "model": {"type": "string", "enum": ["noop"]},
    "max_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 1024},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 1, "maximum": 1024},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"],
                       "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": ["integer", "null"], "minimum": 1, "maximum": 128},
    "user": {"type": "string", "maxLength": 300},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "seed": {"type": "integer"},
}
_TOKEN_IDS = {"type": "array", "minItems": 1, "maxItems": 50,
              "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}}
COMPLETION_BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {
        "type": "object", "required": ["model", "messages"],
        "properties": {**_COMMON, "messages": {"type": "array", "minItems": 1, "maxItems": 4,
                                               "items": _MESSAGE}},
    },
    "/v1/completions": {
        "type": "object", "required": ["model", "prompt"],
        "properties": {**_COMMON, "prompt": {"anyOf": [
            {"type": "string", "maxLength": 500},
            {"type": "array", "minItems": 1, "maxItems": 3,
             "items": {"type": "string", "maxLength": 100}},
            _TOKEN_IDS,
            {"type": "array", "minItems": 1, "maxItems": 3, "items": _TOKEN_IDS},
        ]}},
    },
}


def openapi_document() -> dict[str, Any]:
    """The gateway's published schema, plus request bodies (and the session header) for the two
    completion routes where it declares none. The worker URL does not matter: only the routes
    are read."""
    doc = copy.deepcopy(create_app(gateway_settings("http://127.0.0.1:9")).api.openapi())
    for path, body in COMPLETION_BODIES.items():
        op = doc["paths"][path]["post"]
        # Used only while the published schema has no body for the route.
        op.setdefault("requestBody", {"required": True,
                                      "content": {"application/json": {"schema": body}}})
        op.setdefault("parameters", [{"name": "X-Session-ID", "in": "header",
                                      "required": False,
                                      "schema": {"type": "string", "maxLength": 300}}])
    return doc


SCHEMA = schemathesis.openapi.from_dict(openapi_document())
OPERATIONS = [cast(Any, result).ok() for result in SCHEMA.get_all_operations()]
CASES = [
    pytest.param(op, mode, id=f"{op.method.upper()} {op.path} {mode.value}")
    for op in OPERATIONS
    for mode in schemathesis.GenerationMode
    # A negative example needs an input that can be wrong: a body or a query parameter.
    if mode is schemathesis.GenerationMode.POSITIVE or op.get_request_payload_content_types()
    or any(p.location.value == "query" for p in op.iter_parameters())
]


def test_schema_covers_every_route_the_gateway_serves() -> None:
    routes = {(op.method.upper(), op.path) for op in OPERATIONS}
    assert {("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
            ("GET", "/v1/models"), ("GET", "/health"), ("GET", "/ready"),
            ("GET", "/metrics")} <= routes


@pytest.mark.parametrize(("operation", "mode"), CASES)
def test_generated_requests_get_no_5xx_and_openai_shaped_4xx(
    gw: str, operation: Any, mode: schemathesis.GenerationMode,
) -> None:
    statuses: dict[int, int] = {}

    @hypothesis_settings(max_examples=MAX_EXAMPLES, derandomize=True, deadline=None,
                         database=None, suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        r = case.call(base_url=gw, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        where = f"{r.status_code} {r.text[:300]}\n{case.as_curl_command()}"
        assert r.status_code < 500, where
        if r.status_code >= 400:
            err = orjson.loads(r.content).get("error")
            assert isinstance(err, dict), where
            assert set(err) == {"message", "type", "param", "code"}, where
            assert isinstance(err["message"], str) and err["message"], where

    run()
    assert statuses, "no example was generated"


# -- targeted cases ----------------------------------------------------------------------------


def post(gw: str, body: bytes | dict[str, Any], path: str = "/v1/chat/completions",
         headers: dict[str, str] | None = None) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(gw + path, content=content, timeout=30,
                      headers=headers or {"content-type": "application/json"})


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        pytest.param(b'{"model":"noop","messages":[{"role":"user","content":"\xff\xfe"}]}',
                     None, "invalid_json", id="invalid-utf8-in-string"),
        pytest.param(b'{"model":"noop","messages":[{"role":"user","content":"\\ud800"}]}',
                     None, "invalid_json", id="lone-surrogate-escape"),
        pytest.param(b'{"model":"noop","messages":[{"role":"user","content":"x"}],'
                     b'"max_tokens":1e400}', None, "invalid_json", id="max_tokens-1e400"),
        pytest.param(b'{"model":"noop","messages":[{"role":"user","content":"x"}],'
                     b'"max_tokens":' + str(2**80).encode() + b"}", "max_tokens", None,
                     id="max_tokens-2**80"),
        pytest.param({**CHAT, "max_tokens": 0}, "max_tokens", None, id="max_tokens-0"),
        pytest.param({**CHAT, "max_tokens": -1}, "max_tokens", None, id="max_tokens-negative"),
        pytest.param({**CHAT, "max_tokens": None, "max_completion_tokens": 0},
                     "max_completion_tokens", None, id="max_completion_tokens-0"),
        pytest.param({**CHAT, "max_tokens": "10"}, "max_tokens", None, id="max_tokens-string"),
        pytest.param({**CHAT, "max_tokens": True}, "max_tokens", None, id="max_tokens-bool"),
        pytest.param({**CHAT, "max_tokens": 2**62}, "messages", "context_length_exceeded",
                     id="max_tokens-2**62"),
        pytest.param({**CHAT, "n": 0}, "n", None, id="n-0"),
        pytest.param({**CHAT, "n": 129}, "n", None, id="n-129"),
        pytest.param({**CHAT, "n": 1.5}, "n", None, id="n-float"),
        pytest.param({**CHAT, "model": 1}, "model", None, id="model-int"),
        pytest.param({**CHAT, "model": ""}, "model", None, id="model-empty"),
        pytest.param({**CHAT, "messages": "hello"}, "messages", None, id="messages-string"),
        pytest.param({**CHAT, "messages": [1]}, "messages.0", None, id="messages-item-int"),
        pytest.param({**CHAT, "messages": [{"content": "x"}]}, "messages.0", None,
                     id="messages-no-role"),
        pytest.param({**CHAT, "stream": "yes"}, "stream", None, id="stream-string"),
        pytest.param({**CHAT, "user": 5}, "user", None, id="user-int"),
        pytest.param({**CHAT, "stream_options": []}, "stream_options", None,
                     id="stream_options-list"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, None, "invalid_json",
                     id="nested-100k-arrays"),
        pytest.param(b'{"model":"noop","x":' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000
                     + b"}", None, "invalid_json", id="nested-100k-objects"),
        pytest.param(b"", None, "invalid_json", id="empty-body"),
        pytest.param(b"null", None, "invalid_json", id="json-null"),
    ],
)
def test_malformed_chat_request_gets_openai_shaped_400(
    gw: str, body: bytes | dict[str, Any], param: str | None, code: str | None,
) -> None:
    assert_openai_error(post(gw, body), 400, param=param, code=code)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param({"model": "noop", "prompt": {}}, "prompt", id="prompt-object"),
        pytest.param({"model": "noop", "prompt": []}, "prompt", id="prompt-empty-list"),
        pytest.param({"model": "noop", "prompt": [[]]}, "prompt", id="prompt-empty-ids"),
        pytest.param({"model": "noop", "prompt": [1, "a"]}, "prompt", id="prompt-mixed"),
        pytest.param({"model": "noop", "prompt": [2**40]}, "prompt", id="prompt-huge-id"),
        pytest.param({"model": "noop", "prompt": [-1]}, "prompt", id="prompt-negative-id"),
        pytest.param({"model": "noop"}, "prompt", id="prompt-missing"),
    ],
)
def test_malformed_completion_request_gets_openai_shaped_400(
    gw: str, body: dict[str, Any], param: str,
) -> None:
    assert_openai_error(post(gw, body, "/v1/completions"), 400, param=param)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param("/v1/completions", {"model": "noop", "prompt": "abc", "max_tokens": 3,
                                         "truncate_prompt_tokens": 0}, id="completion-cut-to-0"),
        pytest.param("/v1/chat/completions", {**CHAT, "truncate_prompt_tokens": 0},
                     id="chat-cut-to-0"),
        pytest.param("/v1/completions", {"model": "noop", "prompt": "", "max_tokens": 3,
                                         "add_special_tokens": False},
                     id="completion-empty-without-special-tokens"),
    ],
)
def test_an_empty_prompt_is_refused_before_it_reaches_a_worker(
    gw: str, worker: RecordingWorker, path: str, body: dict[str, Any],
) -> None:
    """Regression: a prompt of no tokens was reserved, routed and forwarded; vLLM refuses it
    (400, "The decoder prompt cannot be empty"), and a worker that failed on it instead had its
    plain-text 500 relayed as it was."""
    sent = len(worker.bodies)
    assert_openai_error(post(gw, body, path), 400, code="empty_prompt")
    assert len(worker.bodies) == sent


def test_unknown_model_gets_404_model_not_found(gw: str) -> None:
    assert_openai_error(post(gw, {**CHAT, "model": "gpt-unknown"}), 404, param="model",
                        code="model_not_found")


def test_integers_wider_than_64_bits_in_pass_through_fields_reach_the_worker_exactly(
    gw: str, worker: RecordingWorker,
) -> None:
    big = str(2**80).encode()
    for stream in (b"false", b"true"):  # a stream's body is re-serialised by the gateway
        body = (b'{"model":"noop","messages":[{"role":"user","content":"x"}],"seed":' + big
                + b',"stream":' + stream + b"}")
        r = post(gw, body)
        assert r.status_code == 200, r.text
        assert b'"seed":' + big in worker.bodies[-1]


def test_n_greater_than_one_with_streaming_is_forwarded(gw: str, worker: RecordingWorker) -> None:
    with httpx.stream("POST", gw + "/v1/chat/completions", timeout=30,
                      json={**CHAT, "n": 3, "stream": True}) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    assert orjson.loads(worker.bodies[-1])["n"] == 3


def test_json_nested_just_under_the_parser_limit_with_stream_is_not_a_500(gw: str) -> None:
    """Regression: orjson accepts 1,000 levels of nesting, but a stream's body is re-parsed
    with the standard library (``ParsedRequest.forward_body``), whose recursion limit is lower:
    the RecursionError escaped ``ProxyResponse`` and uvicorn answered a plain-text 500."""
    depth = 1000
    nested = b"[" * depth + b"]" * depth
    for stream in (b"false", b"true"):
        body = (b'{"model":"noop","messages":[{"role":"user","content":"x"}],"stream":'
                + stream + b',"tools_hint":' + nested + b"}")
        r = post(gw, body)
        assert r.status_code < 500, f"stream={stream.decode()}: {r.status_code} {r.text[:200]}"
        if r.status_code >= 400:
            assert_openai_error(r)


def test_body_of_10_mb_gets_413_with_or_without_content_length(gw: str) -> None:
    ten_mb = b'{"model":"noop","prompt":"' + b"a" * (10 * 1024 * 1024) + b'"}'
    assert_openai_error(post(gw, ten_mb, "/v1/completions"), 413, code="request_too_large")

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(ten_mb), 64 * 1024):
            yield ten_mb[i:i + 64 * 1024]

    r = httpx.post(gw + "/v1/completions", content=chunks(), timeout=30)
    assert_openai_error(r, 413, code="request_too_large")


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        pytest.param(orjson.dumps(CHAT), "text/plain", id="json-as-text-plain"),
        pytest.param(b"model=noop&messages=hi", "application/x-www-form-urlencoded", id="form"),
        pytest.param(b"--b\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nnoop\r\n--b--",
                     "multipart/form-data; boundary=b", id="multipart"),
        pytest.param(b"\x1f\x8b\x08\x00garbage", "application/json", id="gzip-bytes-as-json"),
        pytest.param(b"<xml/>", "application/xml", id="xml"),
    ],
)
def test_non_json_content_types_get_no_5xx(gw: str, content: bytes, content_type: str) -> None:
    r = post(gw, content, headers={"content-type": content_type})
    if r.status_code != 200:  # JSON sent as text/plain may be served; the rest are refused
        assert_openai_error(r, 400, code="invalid_json")


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/chat/completions"), ("PUT", "/v1/chat/completions"),
        ("DELETE", "/v1/completions"), ("PATCH", "/v1/completions"),
        ("OPTIONS", "/v1/chat/completions"), ("POST", "/v1/models"), ("POST", "/health"),
        ("POST", "/metrics"), ("DELETE", "/ready"),
    ],
)
def test_method_not_allowed_gets_openai_shaped_405(gw: str, method: str, path: str) -> None:
    assert_openai_error(httpx.request(method, gw + path), 405, code="method_not_allowed")


def _session_labels(metrics_text: str) -> set[str]:
    labels: set[str] = set()
    for series in promtext.samples(metrics_text).values():
        for pairs in series:
            labels |= {v for k, v in pairs if k == "session"}
    return labels


@pytest.mark.parametrize(
    ("header", "user"),
    [
        pytest.param("s" * 10_000, None, id="10KB-header"),
        pytest.param("caf\xe9 \xe0 la carte", None, id="latin1-header"),
        pytest.param(None, "a\x00b\n\x1b[31mred\u202e" + "z" * 5000, id="control-chars-user"),
    ],
)
def test_odd_session_ids_are_served_and_never_a_raw_metrics_label(
    gw: str, worker: RecordingWorker, header: str | None, user: str | None,
) -> None:
    raw_id = header if header is not None else user
    assert raw_id is not None
    body: dict[str, Any] = {**CHAT, "hold": True}  # held on the worker until it is looked at
    headers = {"content-type": "application/json"}
    if header is not None:
        headers["x-session-id"] = header
    if user is not None:
        body["user"] = user

    async def while_in_flight() -> tuple[httpx.Response, str, list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=60) as http:
            worker.release.clear()
            request = asyncio.create_task(http.post(
                gw + "/v1/chat/completions", content=orjson.dumps(body),
                headers=[(k.encode(), v.encode("latin-1")) for k, v in headers.items()]))
            try:
                deadline = time.monotonic() + 60
                while True:  # until the gateway holds the request (on the worker)
                    sessions: list[dict[str, Any]] = (await http.get(
                        gw + "/admin/sessions",
                        headers={"authorization": f"Bearer {ADMIN}"})).json()["data"]
                    if any(s["inflight_requests"] for s in sessions) or request.done():
                        break
                    assert time.monotonic() < deadline, "the request never reached the worker"
                    await asyncio.sleep(0.02)
                metrics = (await http.get(gw + "/metrics")).text
            finally:
                worker.release.set()
            return await request, metrics, sessions

    r, metrics, sessions = asyncio.run(while_in_flight())
    assert r.status_code == 200, r.text
    held = [s["session_id"] for s in sessions if s["inflight_requests"]]
    assert len(held) == 1, sessions
    labels = _session_labels(metrics)
    assert held[0] in labels, "the in-flight session is not in the top-K gauge"
    for label in labels:
        assert SAFE_LABEL.fullmatch(label), label
        assert label != raw_id.strip()
    assert raw_id not in metrics


def test_client_that_leaves_mid_upload_is_not_an_unhandled_error(
    gw: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """Regression: ``read_body`` let starlette's ``ClientDisconnect`` escape, so a client that
    went away while sending its body was logged at ERROR as "unhandled error" with a traceback
    (and answered 500 into the void); a client leaving is not a gateway failure."""
    host, port = gw.removeprefix("http://").split(":")
    caplog.set_level(logging.WARNING)
    for _ in range(3):
        with socket.create_connection((host, int(port))) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                      b"content-type: application/json\r\ncontent-length: 100000\r\n\r\n"
                      b'{"model": "noop", "messages": [')
            time.sleep(0.1)
    time.sleep(0.3)
    assert httpx.get(gw + "/health").status_code == 200
    errors = [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    assert not errors, [f"{rec.name}: {rec.getMessage()}" for rec in errors]


def test_concurrent_garbage_leaves_nothing_in_flight(gw: str) -> None:
    """Many bad requests at once, then the gauges: a refusal must not leak a slot."""
    bodies = [b"{", b"[]", orjson.dumps({**CHAT, "max_tokens": 0}),
              orjson.dumps({**CHAT, "model": "nope"}), b"\xff" * 100]

    statuses: list[int] = []

    def hammer() -> None:
        with httpx.Client(timeout=30) as http:
            for _ in range(20):
                for b in bodies:
                    statuses.append(http.post(gw + "/v1/chat/completions", content=b).status_code)

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(statuses) == 400 and max(statuses) < 500, sorted(set(statuses))
    inflight = promtext.samples(httpx.get(gw + "/metrics").text)["kvgate_worker_inflight"]
    assert set(inflight.values()) == {0.0}
    assert post(gw, CHAT).status_code == 200

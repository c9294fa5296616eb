"""The upstream side, tried as a hostile client would (issue 12, item 5): retries, bodies, usage,
keys and worker credentials.

* A request is sent to a second worker only when the first cannot have started it: a worker that
  read the request and then died (or crashed on it) is not handed a copy, so nothing is generated
  twice and a request that kills a worker kills only one (fake socket workers count what they
  received; a simulated worker is SIGKILLed mid-generation).
* Bodies above ``EARLY_BODY_BYTES`` are read only once admitted: a queued request's body stays in
  the socket, one beyond the queue is refused before its body is sent, and a Content-Length over
  the limit is a 413 before anything.
* ``stream_options.continuous_usage_stats`` without ``include_usage`` gets no usage, as from vLLM.
* ``/v1/models`` needs a key when keys are configured.
* A pool's upstream key reaches its workers; the client's Authorization header never does;
  proven with a real vLLM server started with ``--api-key``.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import httpx
import orjson
import pytest
from prometheus_client import CollectorRegistry
from starlette.types import Receive, Scope, Send

from gateway import promtext
from gateway.app import create_app
from gateway.bench import noop
from gateway.config import Settings, build_settings
from gateway.metrics import Metrics
from gateway.procs.kvgate import SIM_MODEL, SimProcess
from gateway.procs.process import ProcessSet, StartError, start_all
from gateway.procs.vllm import VllmOptions, VllmServer, build_tiny_model, start_vllm_servers
from gateway.workers.health import HealthMonitor
from gateway.workers.registry import WorkerRegistry
from tests.harness import SocketWorker, answer_probe, eventually, read_asgi_body, serve_app

pytestmark = pytest.mark.timeout(120)

CLIENT_KEY = "sk-client-of-the-gateway"
UPSTREAM_KEY = "sk-upstream-worker-secret"
UPSTREAM_KEY_ENV = "UPSTREAM_TEST_KEY"
CHAT: dict[str, Any] = {"model": "noop", "messages": [{"role": "user", "content": "hello"}],
                        "max_tokens": 8}
MiB = 1024 * 1024


def gateway_settings(urls: list[str], model: str = "noop", tokenizer: str = "simple",
                     pool: dict[str, Any] | None = None, **extra: Any) -> Settings:
    data: dict[str, Any] = {
        "models": [{"name": model, "tokenizer": tokenizer}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "policy": "round_robin",
                   "workers": urls, **(pool or {})}],
        # Only requests find a worker faulty here: checks are far apart, one failure is enough.
        "health": {"interval_s": 60, "unhealthy_threshold": 1},
    }
    data.update(extra)
    return build_settings(data)


def client_keys() -> dict[str, Any]:
    return {"api_keys": [{"name": "team",
                          "sha256": hashlib.sha256(CLIENT_KEY.encode()).hexdigest()}]}


def assert_error(r: httpx.Response, status: int, code: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] == code, err


# --- retries ---------------------------------------------------------------------------------


def test_request_a_worker_read_is_not_sent_to_another_worker_when_it_dies_without_answering(
) -> None:
    """Regression: ``ServerDisconnectedError`` after the request was sent counted as "the worker
    cannot have started it" and was retried on another worker, so a non-streamed 6,000-token
    request was generated twice after a worker kill, and a request that crashes a worker
    crashed a second one. Now it is a 502, and the failure still counts against the worker."""
    a, b = SocketWorker("close"), SocketWorker("close")
    try:
        with serve_app(create_app(gateway_settings([a.url, b.url])), ready_path="/ready") as gw:
            plain = httpx.post(gw + "/v1/chat/completions", json=CHAT, timeout=10)
            received_for_plain = a.completions + b.completions
            streamed = httpx.post(gw + "/v1/chat/completions", json={**CHAT, "stream": True},
                                  timeout=10)
            metrics = httpx.get(gw + "/metrics").text
    finally:
        a.close()
        b.close()
    assert received_for_plain == 1
    # The first worker is down after its failure; the stream went to the other one, once.
    assert (a.completions, b.completions) == (1, 1)
    for r in (plain, streamed):
        assert_error(r, 502, "upstream_error")
        assert "not retried" in r.json()["error"]["message"]
    assert not promtext.value(metrics, "kvgate_upstream_retries_total", pool="p")
    assert promtext.values(metrics, "kvgate_worker_up") == [0.0, 0.0]


def test_connection_refused_is_still_retried_on_another_worker() -> None:
    gone = SocketWorker("close")
    try:
        with serve_app(noop.app) as good, serve_app(
                create_app(gateway_settings([gone.url, good])), ready_path="/ready") as gw:
            gone.close()
            # Round robin: one of the two is sent to the gone worker first.
            responses = [httpx.post(gw + "/v1/chat/completions", json=CHAT, timeout=10)
                         for _ in range(2)]
            metrics = httpx.get(gw + "/metrics").text
    finally:
        gone.close()
    for r in responses:
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-worker"] == good
    assert gone.completions == 0
    assert promtext.value(metrics, "kvgate_upstream_retries_total", pool="p") == 1.0


def test_non_streamed_request_is_not_generated_again_after_its_worker_is_killed_mid_generation(
    tmp_path: Path,
) -> None:
    """A simulated worker is SIGKILLed while it generates a long non-streamed answer: the client
    gets a 502 and the other worker never receives the request."""
    sims = [SimProcess(time_scale=4.0, log_path=tmp_path / f"sim-{i}.log") for i in range(2)]
    start_all(sims)
    try:
        settings = gateway_settings([s.url for s in sims], model=SIM_MODEL)
        body = {**CHAT, "model": SIM_MODEL, "max_tokens": 150}  # ~3 s at this time scale
        with serve_app(create_app(settings), ready_path="/ready") as gw, \
                ThreadPoolExecutor(1) as pool:
            answer = pool.submit(httpx.post, gw + "/v1/chat/completions", json=body, timeout=30)
            victim = wait_running(sims)
            survivor = next(s for s in sims if s is not victim)
            victim.kill()
            r = answer.result(timeout=30)
            survivor_metrics = httpx.get(survivor.url + "/metrics").text
    finally:
        for s in sims:
            s.stop()
    assert_error(r, 502, "upstream_error")
    assert not promtext.value(survivor_metrics, "vllm:prompt_tokens_total")
    assert not promtext.value(survivor_metrics, "vllm:num_requests_running")


def wait_running(sims: list[SimProcess], timeout_s: float = 10.0) -> SimProcess:
    """The simulated worker that is generating a request."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for sim in sims:
            if promtext.value(httpx.get(sim.url + "/metrics").text, "vllm:num_requests_running"):
                return sim
        time.sleep(0.05)
    raise AssertionError("no simulated worker started the request")


# --- bodies and admission --------------------------------------------------------------------


class RecordingWorker:
    """An OpenAI-style worker that keeps the path, headers and body of every request; answers a
    completion after the body's ``hold_s``; lists ``noop`` on ``/v1/models``. With
    ``required_key``, its ``/v1`` routes answer 401 without ``Authorization: Bearer KEY``, as
    ``vllm serve --api-key`` does."""

    def __init__(self, required_key: str | None = None) -> None:
        self.required_key = required_key
        self.requests: list[tuple[str, dict[str, str], bytes]] = []
        self.completion_arrived = threading.Event()
        self.release = threading.Event()  # what a completion with "hold": true waits for

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        raw = await read_asgi_body(receive)
        self.requests.append((scope["path"], headers, raw))
        if (self.required_key is not None and scope["path"].startswith("/v1")
                and headers.get("authorization") != f"Bearer {self.required_key}"):
            await respond(send, 401, {"error": "Unauthorized"})
        elif scope["path"] == "/v1/models":
            await respond(send, 200, {"object": "list", "data": [{"id": "noop"}]})
        elif scope["path"] == "/v1/chat/completions":
            self.completion_arrived.set()
            await asyncio.sleep(float(orjson.loads(raw).get("hold_s", 0)))
            if orjson.loads(raw).get("hold") is True:
                await asyncio.to_thread(self.release.wait, 120)
            await respond(send, 200, {
                "id": "c", "object": "chat.completion", "created": 0, "model": "noop",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        else:
            await answer_probe(scope, send)

    def completions(self) -> list[tuple[dict[str, str], bytes]]:
        return [(h, b) for path, h, b in self.requests if path == "/v1/chat/completions"]


async def respond(send: Send, status: int, body: Any) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": orjson.dumps(body)})


async def send_head(gw: str, content_length: int
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A completion request's head on a new connection; its body is left to the caller."""
    url = urlsplit(gw)
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gw\r\n"
                 b"content-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n" % content_length)
    await writer.drain()
    return reader, writer


async def read_response(reader: asyncio.StreamReader, timeout_s: float) -> tuple[int, bytes]:
    """Status and body of one HTTP/1.1 response (Content-Length or chunked)."""
    async with asyncio.timeout(timeout_s):
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
        if b"content-length" in fields:
            return status, await reader.readexactly(int(fields[b"content-length"]))
        body = await reader.readuntil(b"\r\n0\r\n\r\n")
        return status, body


async def test_large_body_waits_for_admission_unread_and_beyond_the_queue_is_refused_unread(
) -> None:
    """Regression: every body was read before admission, so the gateway held (connections x
    16 MiB) of bodies, not (requests admitted x body size); a request beyond the queue was read
    whole before its 503. Here the bodies past the queue are never even sent."""
    worker = RecordingWorker()
    big = orjson.dumps({**CHAT, "pad": "x" * MiB})
    limits = {"max_inflight_requests": 1, "max_queued_requests": 1, "queue_timeout_s": 20,
              "max_body_bytes": 4 * MiB}
    with serve_app(worker) as url:
        app = create_app(gateway_settings([url], limits=limits))
        with serve_app(app, ready_path="/ready") as gw:
            gate = app.api.state.services.dispatcher.gate
            async with httpx.AsyncClient(timeout=60) as http:
                # The holder keeps the one slot until the test releases it (a timed hold could
                # end during a stall, and the queued request would take the slot early).
                worker.release.clear()
                holder = asyncio.create_task(http.post(gw + "/v1/chat/completions",
                                                       json={**CHAT, "hold": True}))
                try:
                    assert await asyncio.to_thread(worker.completion_arrived.wait, 60)
                    queued_reader, queued_writer = await send_head(gw, len(big))  # no body yet
                    await eventually(lambda: gate.queued == 1)
                    for _ in range(4):  # beyond the queue: refused at once, with no body sent
                        reader, writer = await send_head(gw, len(big))
                        status, body = await read_response(reader, timeout_s=60)
                        writer.close()
                        assert status == 503, body
                        assert orjson.loads(body)["error"]["code"] == "gateway_overloaded"
                    reader, writer = await send_head(gw, 5 * MiB)  # over the limit: 413
                    status, body = await read_response(reader, timeout_s=60)
                    writer.close()
                    assert status == 413
                    assert orjson.loads(body)["error"]["code"] == "request_too_large"
                    assert len(worker.completions()) == 1
                finally:
                    worker.release.set()
                # The queued request sends its body only now, and is served after the holder.
                queued_writer.write(big)
                await queued_writer.drain()
                status, body = await read_response(queued_reader, timeout_s=60)
                queued_writer.close()
                assert status == 200, body
                assert (await holder).status_code == 200
    assert [len(b) for _, b in worker.completions()][1] == len(big)


# --- usage -----------------------------------------------------------------------------------


def usage_flags(url: str, body: dict[str, Any]) -> list[bool]:
    """For each data event of a stream (``[DONE]`` aside): whether it carries ``usage``."""
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    return [orjson.loads(e).get("usage") is not None for e in events if e != "[DONE]"]


def test_continuous_usage_stats_without_include_usage_gets_no_usage_as_from_vllm(
    tmp_path: Path,
) -> None:
    """Regression: the gateway adds ``include_usage`` to every stream it forwards (to account
    its tokens), so a client that set only ``continuous_usage_stats`` got usage on every chunk,
    which vLLM sends only when both are set. The simulated worker follows vLLM's rule; the
    client must see through the gateway what it sees from the worker directly."""
    sim = SimProcess(time_scale=0.5, log_path=tmp_path / "sim.log")
    sim.start()
    try:
        with serve_app(create_app(gateway_settings([sim.url], model=SIM_MODEL)),
                       ready_path="/ready") as gw:
            for options in ({"continuous_usage_stats": True},
                            {"continuous_usage_stats": True, "include_usage": False},
                            {"continuous_usage_stats": True, "include_usage": True},
                            {"include_usage": True}, None):
                body = {**CHAT, "model": SIM_MODEL, "stream": True, "max_tokens": 6,
                        "temperature": 0}
                if options is not None:
                    body["stream_options"] = options
                assert usage_flags(gw, body) == usage_flags(sim.url, body), options
            leaked = usage_flags(gw, {**CHAT, "model": SIM_MODEL, "stream": True,
                                      "stream_options": {"continuous_usage_stats": True}})
    finally:
        sim.stop()
    assert leaked and not any(leaked)


# --- keys ------------------------------------------------------------------------------------


def test_models_route_needs_a_valid_key_when_keys_are_configured() -> None:
    """Regression: ``/v1/models`` answered without a key while every completion needed one."""
    with serve_app(RecordingWorker()) as url, serve_app(
            create_app(gateway_settings([url], auth=client_keys())), ready_path="/ready") as gw:
        missing = httpx.get(gw + "/v1/models")
        wrong = httpx.get(gw + "/v1/models", headers={"authorization": "Bearer sk-wrong"})
        good = httpx.get(gw + "/v1/models", headers={"authorization": f"Bearer {CLIENT_KEY}"})
    assert_error(missing, 401, "missing_api_key")
    assert_error(wrong, 401, "invalid_api_key")
    assert good.status_code == 200, good.text
    assert [m["id"] for m in good.json()["data"]] == ["noop"]


# --- upstream credentials --------------------------------------------------------------------


def test_pool_key_goes_to_the_worker_and_the_clients_key_never_does(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: workers started with ``vllm serve --api-key`` could not be used (the gateway
    sent no credential). The client's own Authorization header is the gateway's key: it must
    never reach a worker."""
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    worker = RecordingWorker(required_key=UPSTREAM_KEY)
    client = {"authorization": f"Bearer {CLIENT_KEY}", "cookie": "session=secret"}
    with serve_app(worker) as url:
        settings = gateway_settings([url], pool={"upstream_api_key_env": UPSTREAM_KEY_ENV},
                                    auth=client_keys())
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            plain = httpx.post(gw + "/v1/chat/completions", json=CHAT, headers=client)
            streamed = httpx.post(gw + "/v1/chat/completions", json={**CHAT, "stream": True},
                                  headers=client)
    assert plain.status_code == 200, plain.text
    assert streamed.status_code == 200, streamed.text
    sent = worker.completions()
    assert len(sent) == 2
    assert all(h["authorization"] == f"Bearer {UPSTREAM_KEY}" for h, _ in sent)
    assert all("cookie" not in h for h, _ in sent)
    assert not [h for _, h, _ in worker.requests if CLIENT_KEY in str(h)]
    assert UPSTREAM_KEY not in repr(settings) and UPSTREAM_KEY not in str(settings.model_dump())


def test_worker_that_refuses_the_pools_key_is_a_502_not_the_clients_401() -> None:
    worker = RecordingWorker(required_key=UPSTREAM_KEY)
    with serve_app(worker) as url, serve_app(create_app(gateway_settings([url])),
                                             ready_path="/ready") as gw:
        r = httpx.post(gw + "/v1/chat/completions", json=CHAT)
    assert_error(r, 502, "upstream_unauthorized")


async def models_read(settings: Settings, with_key: bool) -> frozenset[str] | None:
    """What one health round reads of the pool's worker's ``/v1/models``."""
    registry = WorkerRegistry(settings.pools)
    headers = {p.name: p.upstream_headers for p in settings.pools} if with_key else None
    async with aiohttp.ClientSession() as client:
        monitor = HealthMonitor(registry, client, settings.health,
                                Metrics(CollectorRegistry()), upstream_headers=headers)
        await monitor.check_all()
    (worker,) = registry
    assert worker.healthy
    return worker.models


async def test_models_read_carries_the_pools_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with serve_app(RecordingWorker(required_key=UPSTREAM_KEY)) as url:
        settings = gateway_settings([url], pool={"upstream_api_key_env": UPSTREAM_KEY_ENV})
        assert await models_read(settings, with_key=True) == frozenset({"noop"})
        assert await models_read(settings, with_key=False) is None  # 401: unknown, serves all


def test_missing_upstream_key_fails_at_start_up_naming_the_field() -> None:
    os.environ.pop(UPSTREAM_KEY_ENV, None)
    with pytest.raises(ValueError, match="upstream_api_key_env"):
        gateway_settings(["http://127.0.0.1:1"], pool={"upstream_api_key_env": UPSTREAM_KEY_ENV})


@pytest.fixture(scope="module")
def keyed_vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One real vLLM server whose /v1 routes need ``UPSTREAM_KEY`` (vLLM reads $VLLM_API_KEY
    as it reads ``--api-key``; the process kit passes the environment on)."""
    with ProcessSet(tmp_path_factory.mktemp("keyed-vllm")) as procs:
        previous = os.environ.get("VLLM_API_KEY")
        os.environ["VLLM_API_KEY"] = UPSTREAM_KEY
        try:
            (server,) = start_vllm_servers(procs, 1, VllmOptions(), build_tiny_model(),
                                           name="vllm-keyed")
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        finally:
            if previous is None:
                del os.environ["VLLM_API_KEY"]
            else:
                os.environ["VLLM_API_KEY"] = previous
        yield server


@pytest.mark.timeout(400)
async def test_real_vllm_started_with_api_key_serves_through_the_pools_key(
    keyed_vllm: VllmServer, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    server = keyed_vllm
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4, "temperature": 0}
    keyed = gateway_settings([server.url], model=server.model_name,
                             tokenizer=str(server.model_dir),
                             pool={"upstream_api_key_env": UPSTREAM_KEY_ENV})
    assert await models_read(keyed, with_key=True) == frozenset({server.model_name})
    unkeyed = gateway_settings([server.url], model=server.model_name,
                               tokenizer=str(server.model_dir))
    async with httpx.AsyncClient(timeout=60) as http:
        assert (await http.get(server.url + "/v1/models")).status_code == 401  # protected
        with serve_app(create_app(keyed), ready_path="/ready") as gw:
            plain = await http.post(gw + "/v1/chat/completions", json=body)
            streamed = await http.post(gw + "/v1/chat/completions",
                                       json={**body, "stream": True})
        with serve_app(create_app(unkeyed), ready_path="/ready") as gw:
            refused = await http.post(gw + "/v1/chat/completions", json=body)
    assert plain.status_code == 200, plain.text
    assert plain.json()["usage"]["completion_tokens"] >= 1
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
    assert_error(refused, 502, "upstream_unauthorized")

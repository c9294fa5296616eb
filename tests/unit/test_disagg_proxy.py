"""The two-step protocol through a served gateway, in front of honest fakes of vLLM's prefill and
decode workers (small ASGI apps on real ports that speak the NIXL connector's
``kv_transfer_params``): the bodies each step sends, what the client gets when the prefill
fails, the prefill retry, and a client that leaves during the prefill.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.kvmath import load_model_arch
from tests.harness import SocketWorker, answer_probe, read_asgi_body, serve_app

ADMIN_TOKEN = "admin-secret"
CHAT = {"model": "noop", "messages": [{"role": "user", "content": "hello there, prefill me"}],
        "max_tokens": 8}


def kv_params(engine: str) -> dict[str, Any]:
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
            "remote_engine_id": engine, "remote_request_id": "cmpl-p", "remote_host": "127.0.0.1",
            "remote_port": 5600, "tp_size": 1}


class FakeWorker:
    """A vLLM worker with a KV connector: a request with ``do_remote_decode`` is a prefill,
    answered by ``mode`` (``ok``: vLLM's answer with ``kv_transfer_params``; ``no_params``: as a
    worker without a connector; ``400``/``500``: an error object; ``slow``: no answer until the
    client leaves); any other request is generated here, its text naming this worker and whether
    it came with the prefill's ``kv_transfer_params``. ``decode_mode`` shapes a generation:
    ``ok``; ``pause``: a stream that stops after its first token until ``go`` is set; ``late_500``:
    no answer until ``go`` is set, then a 500 (a decode that fails before its first token)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.url = ""  # where it is served
        self.mode = "ok"
        self.decode_mode = "ok"
        self.go = threading.Event()  # set by the test
        self.bodies: list[dict[str, Any]] = []
        self.left = threading.Event()  # set from the server thread

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if scope["method"] != "POST":
            await answer_probe(scope, send)
            return
        body = json.loads(await read_asgi_body(receive))
        self.bodies.append(body)
        params = body.get("kv_transfer_params")
        if isinstance(params, dict) and params.get("do_remote_decode"):
            await self._prefill(receive, send)
        else:
            text = f"{self.name}:{'pulled' if params else 'local'}"
            await self._generate(scope["path"], body, text, send)

    async def _prefill(self, receive: Receive, send: Send) -> None:
        if self.mode == "slow":
            while (await receive())["type"] != "http.disconnect":
                pass
            self.left.set()
            return
        if self.mode in ("400", "500"):
            err = {"message": f"prefill says {self.mode}", "type": "BadRequestError",
                   "param": "messages", "code": int(self.mode)}
            await _json(send, int(self.mode), {"error": err})
            return
        params = kv_params(self.name) if self.mode == "ok" else None
        await _json(send, 200, {"id": "cmpl-p", "choices": [{"index": 0, "text": "x"}],
                                "usage": {"prompt_tokens": 9, "completion_tokens": 1,
                                          "total_tokens": 10},
                                "kv_transfer_params": params})

    async def _until_go(self) -> None:
        # in a thread: the server's loop goes on answering health probes meanwhile
        await asyncio.to_thread(self.go.wait, 20)

    async def _generate(self, path: str, body: dict[str, Any], text: str, send: Send) -> None:
        chat = path.endswith("chat/completions")
        usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
        if self.decode_mode == "late_500":
            await self._until_go()
            await _json(send, 500, {"error": {"message": "decode failed", "type": "InternalError",
                                              "param": None, "code": 500}})
            return
        if not body.get("stream"):
            choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                       "finish_reason": "length"} if chat
                      else {"index": 0, "text": text, "finish_reason": "length"})
            await _json(send, 200, {"id": "cmpl-d", "choices": [choice], "usage": usage,
                                    "kv_transfer_params": None})
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for piece in (text[:3], text[3:]):
            choice = ({"index": 0, "delta": {"content": piece}} if chat
                      else {"index": 0, "text": piece})
            event = {"id": "cmpl-d", "choices": [choice]}
            await send({"type": "http.response.body", "body": b"data: " + json.dumps(
                event).encode() + b"\n\n", "more_body": True})
            if self.decode_mode == "pause":
                await self._until_go()
        await send({"type": "http.response.body", "more_body": True, "body": b"data: "
                    + json.dumps({"id": "cmpl-d", "choices": [], "usage": usage}).encode()
                    + b"\n\ndata: [DONE]\n\n"})
        await send({"type": "http.response.body", "body": b""})


async def _json(send: Send, status: int, obj: Any) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(obj).encode()})


def gateway_settings(prefill: list[str], decode: list[str], **pool: Any) -> Any:
    return build_settings({
        # an architecture: KV bytes per token, so budgets reserve bytes
        "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "pd", "max_context_tokens": 4096, "policy": "kv_aware",
                   "workers": decode, "prefill_workers": prefill, **pool}],
        "health": {"interval_s": 0.2, "scrape_interval_s": 0.5, "unhealthy_threshold": 1},
        "admin": {"token": ADMIN_TOKEN},
    })


def metrics(gw: str) -> str:
    return httpx.get(gw + "/metrics").text


def wait_until_up(gw: str, urls: list[str]) -> None:
    deadline = time.monotonic() + 20
    while not all(promtext.value(metrics(gw), "kvgate_worker_up", worker=u) == 1.0 for u in urls):
        assert time.monotonic() < deadline, "workers never came up"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def fakes() -> Iterator[dict[str, FakeWorker]]:
    workers = {name: FakeWorker(name) for name in ("prefill-a", "prefill-b", "decode-a",
                                                   "plain")}
    with serve_app(workers["prefill-a"]) as pa, serve_app(workers["prefill-b"]) as pb, \
            serve_app(workers["decode-a"]) as da, serve_app(workers["plain"]) as pl:
        for worker, url in zip(workers.values(), (pa, pb, da, pl), strict=True):
            worker.url = url
        yield workers


@pytest.fixture(scope="module")
def gateway(fakes: dict[str, FakeWorker]) -> Iterator[str]:
    urls = {name: w.url for name, w in fakes.items() if name != "plain"}
    settings = gateway_settings([urls["prefill-a"], urls["prefill-b"]], [urls["decode-a"]])
    with serve_app(create_app(settings), ready_path="/ready") as gw:
        wait_until_up(gw, list(urls.values()))
        yield gw


@pytest.fixture(autouse=True)
def reset(fakes: dict[str, FakeWorker]) -> None:
    for w in fakes.values():
        w.mode = w.decode_mode = "ok"
        w.go.clear()
        w.bodies.clear()


def prefills(fakes: dict[str, FakeWorker]) -> list[dict[str, Any]]:
    return fakes["prefill-a"].bodies + fakes["prefill-b"].bodies


def set_prefill_mode(fakes: dict[str, FakeWorker], mode: str) -> None:
    fakes["prefill-a"].mode = fakes["prefill-b"].mode = mode


def test_chat_runs_prefill_then_decode_with_the_prefills_kv_transfer_params(
    gateway: str, fakes: dict[str, FakeWorker],
) -> None:
    r = httpx.post(gateway + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == "decode-a:pulled"
    [prefill] = prefills(fakes)
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert (prefill["max_tokens"], prefill["stream"], prefill["n"]) == (1, False, 1)
    assert prefill["messages"] == CHAT["messages"]
    [decode] = fakes["decode-a"].bodies
    prefilled_on = "prefill-a" if fakes["prefill-a"].bodies else "prefill-b"
    assert decode["kv_transfer_params"] == kv_params(prefilled_on)
    assert decode["max_tokens"] == 8 and "stream" not in decode


def test_streamed_completion_relays_the_decode_and_splits_ttft(
    gateway: str, fakes: dict[str, FakeWorker],
) -> None:
    body = {"model": "noop", "prompt": "once upon a time", "max_tokens": 8, "stream": True}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == "decode-a:pulled" and events[-1] == "[DONE]"
    [prefill] = prefills(fakes)
    assert prefill["stream"] is False and "stream_options" not in prefill
    assert fakes["decode-a"].bodies[0]["stream"] is True
    text = metrics(gateway)
    decode_url = fakes["decode-a"].url
    assert (promtext.value(text, "kvgate_decode_first_token_seconds_count", pool="pd",
                          worker=decode_url) or 0) >= 1
    assert (promtext.value(text, "kvgate_ttft_seconds_count", pool="pd", worker=decode_url) or 0) >= 1
    prefill_url = next(w.url for w in (fakes["prefill-a"], fakes["prefill-b"])
                       if w.bodies)
    assert (promtext.value(text, "kvgate_prefill_seconds_count", pool="pd",
                          worker=prefill_url) or 0) >= 1
    assert (promtext.value(text, "kvgate_prefill_requests_total", pool="pd",
                          worker=prefill_url, code="200") or 0) >= 1


def test_prefill_4xx_reaches_the_client_as_the_worker_said_and_no_decode_runs(
    gateway: str, fakes: dict[str, FakeWorker],
) -> None:
    set_prefill_mode(fakes, "400")
    r = httpx.post(gateway + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"] == {"message": "prefill says 400", "type": "BadRequestError",
                                 "param": "messages", "code": 400}  # vLLM's, as it said it
    assert fakes["decode-a"].bodies == []


def test_prefill_5xx_is_a_502_upstream_error(gateway: str, fakes: dict[str, FakeWorker]) -> None:
    set_prefill_mode(fakes, "500")
    r = httpx.post(gateway + "/v1/chat/completions", json={**CHAT, "stream": True}, timeout=10)
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "upstream_error" and "prefill says 500" in err["message"]
    assert fakes["decode-a"].bodies == []


def test_prefill_answer_without_kv_transfer_params_is_a_502_that_says_so(
    gateway: str, fakes: dict[str, FakeWorker],
) -> None:
    set_prefill_mode(fakes, "no_params")
    r = httpx.post(gateway + "/v1/chat/completions", json=CHAT, timeout=10)
    assert r.status_code == 502
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == "prefill_no_kv_transfer" and "kv_transfer_params" in err["message"]
    assert fakes["decode-a"].bodies == []


def test_several_choices_go_to_the_decode_worker_alone(
    gateway: str, fakes: dict[str, FakeWorker],
) -> None:
    r = httpx.post(gateway + "/v1/chat/completions", json={**CHAT, "n": 2}, timeout=10)
    assert r.status_code == 200
    assert r.json()["choices"][0]["message"]["content"] == "decode-a:local"
    assert prefills(fakes) == []


def test_client_leaving_mid_prefill_aborts_it_and_leaves_nothing_held(
    gateway: str, fakes: dict[str, FakeWorker],
) -> None:
    set_prefill_mode(fakes, "slow")
    for w in fakes.values():
        w.left.clear()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gateway + "/v1/chat/completions", json=CHAT, timeout=0.5)
    deadline = time.monotonic() + 10
    while not (fakes["prefill-a"].left.is_set() or fakes["prefill-b"].left.is_set()):
        assert time.monotonic() < deadline, "the prefill's connection was never closed"
        time.sleep(0.02)
    while True:
        text = metrics(gateway)
        inflight = [promtext.value(text, "kvgate_worker_inflight", pool="pd", worker=w.url)
                    for w in fakes.values()]
        if all(v in (None, 0.0) for v in inflight):
            break
        assert time.monotonic() < deadline, f"in flight left behind: {inflight}"
        time.sleep(0.02)
    assert sum(promtext.value(text, "kvgate_prefill_requests_total", pool="pd", worker=w.url,
                              code="499") or 0.0 for w in fakes.values()) >= 1
    assert fakes["decode-a"].bodies == []
    usage = httpx.get(gateway + "/admin/tenants/anonymous", timeout=5,
                      headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    assert usage.status_code == 404 or usage.json()["inflight_requests"] == 0, usage.text


def test_prefill_worker_that_resets_the_request_is_retried_on_the_other(
    fakes: dict[str, FakeWorker],
) -> None:
    resetting = SocketWorker("reset")  # /health answers, every POST is reset unread
    try:
        good = fakes["prefill-a"].url
        decode = fakes["decode-a"].url
        settings = gateway_settings([resetting.url, good], [decode])
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            wait_until_up(gw, [resetting.url, good, decode])
            for _ in range(4):
                r = httpx.post(gw + "/v1/chat/completions", json=CHAT, timeout=10)
                assert r.status_code == 200, r.text
                assert r.json()["choices"][0]["message"]["content"] == "decode-a:pulled"
                if resetting.completions:
                    break
            text = metrics(gw)
        assert resetting.completions >= 1
        assert (promtext.value(text, "kvgate_upstream_retries_total", pool="pd") or 0) >= 1
    finally:
        resetting.close()


def test_prefill_without_an_answer_in_first_token_s_is_a_504(fakes: dict[str, FakeWorker]) -> None:
    set_prefill_mode(fakes, "slow")
    settings = gateway_settings([fakes["prefill-a"].url], [fakes["decode-a"].url],
                                timeouts={"connect_s": 1.0, "first_token_s": 0.5, "read_s": 5.0})
    with serve_app(create_app(settings), ready_path="/ready") as gw:
        wait_until_up(gw, [fakes["prefill-a"].url, fakes["decode-a"].url])
        r = httpx.post(gw + "/v1/chat/completions", json=CHAT, timeout=10)
        text = metrics(gw)
    assert r.status_code == 504 and r.json()["error"]["code"] == "upstream_timeout"
    assert fakes["decode-a"].bodies == []
    assert promtext.value(text, "kvgate_prefill_requests_total", pool="pd",
                          worker=fakes["prefill-a"].url, code="504") == 1


def test_prefill_worker_closing_after_reading_the_request_is_a_502_not_retried(
    fakes: dict[str, FakeWorker],
) -> None:
    """A worker that read the request may have started it: no second prefill elsewhere."""
    closing = SocketWorker("close")
    try:
        decode = fakes["decode-a"].url
        with serve_app(create_app(gateway_settings([closing.url], [decode])),
                       ready_path="/ready") as gw:
            wait_until_up(gw, [closing.url, decode])
            r = httpx.post(gw + "/v1/chat/completions", json=CHAT, timeout=10)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_error"
        assert closing.completions == 1
        assert fakes["decode-a"].bodies == []
    finally:
        closing.close()


# -- budgets: each side charged while it holds the prompt's KV ----------------------------------

PER_TOKEN = load_model_arch("llama-3-8b").kv_bytes_per_token("auto")
PROMPT = list(range(100, 140))  # token ids: exactly 40 prompt tokens
MAX_TOKENS = 8


def session_bytes(gw: str, session: str) -> int:
    """The KV bytes the session holds (a session with no state: 0)."""
    r = httpx.get(f"{gw}/admin/tenants/anonymous/sessions/{session}", timeout=5,
                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    return int(r.json()["inflight_kv_bytes"]) if r.status_code == 200 else 0


def wait_for_bytes(gw: str, session: str, expected: int, what: str) -> None:
    deadline = time.monotonic() + 10
    while (held := session_bytes(gw, session)) != expected:
        assert time.monotonic() < deadline, f"{what}: {held} bytes held, not {expected}"
        time.sleep(0.02)


def streamed_in_thread(gw: str, session: str) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []

    def client() -> None:
        with httpx.stream("POST", gw + "/v1/completions", timeout=20,
                          headers={"X-Session-ID": session},
                          json={"model": "noop", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                                "stream": True}) as r:
            r.read()
            answers.append(r)

    thread = threading.Thread(target=client)
    thread.start()
    return thread, answers


def test_reservation_shrinks_to_the_decode_side_at_the_decode_steps_first_token(
    gateway: str, fakes: dict[str, FakeWorker],
) -> None:
    fakes["decode-a"].decode_mode = "pause"  # paused after its first token
    thread, answers = streamed_in_thread(gateway, "pd-first-token")
    try:
        wait_for_bytes(gateway, "pd-first-token", (len(PROMPT) + MAX_TOKENS) * PER_TOKEN,
                       "after the first token")
    finally:
        fakes["decode-a"].go.set()
        thread.join(20)
    assert answers and answers[0].status_code == 200
    assert "decode-a:pulled" in "".join(
        json.loads(line[6:])["choices"][0]["text"] for line in answers[0].text.splitlines()
        if line.startswith("data: {") and '"text"' in line)
    wait_for_bytes(gateway, "pd-first-token", 0, "after the end")


def test_decode_failing_before_its_first_token_keeps_both_sides_charged_until_the_end(
    gateway: str, fakes: dict[str, FakeWorker],
) -> None:
    fakes["decode-a"].decode_mode = "late_500"
    thread, answers = streamed_in_thread(gateway, "pd-decode-fails")
    try:
        deadline = time.monotonic() + 10
        while not fakes["decode-a"].bodies:  # the decode step was sent, and waits
            assert time.monotonic() < deadline, "the decode step never started"
            time.sleep(0.02)
        time.sleep(0.1)
        assert session_bytes(gateway, "pd-decode-fails") == (
            2 * len(PROMPT) + MAX_TOKENS) * PER_TOKEN
    finally:
        fakes["decode-a"].go.set()
        thread.join(20)
    assert answers and answers[0].status_code == 500  # the worker's error, passed through
    wait_for_bytes(gateway, "pd-decode-fails", 0, "after the end")


def test_request_reserved_for_two_steps_but_routed_to_a_plain_pool_holds_its_prompt_once(
    fakes: dict[str, FakeWorker],
) -> None:
    """A request whose home pool (the smallest that fits) has no prefill workers is reserved
    for one step though a disaggregated pool fits it too; it once held its prompt twice for its
    whole life."""
    plain = fakes["plain"]
    settings = build_settings({
        "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [
            {"name": "short", "max_context_tokens": 1024, "workers": [plain.url]},
            {"name": "pd", "max_context_tokens": 4096, "policy": "kv_aware",
             "workers": [fakes["decode-a"].url],
             "prefill_workers": [fakes["prefill-a"].url, fakes["prefill-b"].url]},
        ],
        "health": {"interval_s": 0.2, "scrape_interval_s": 0.5, "unhealthy_threshold": 1},
        "admin": {"token": ADMIN_TOKEN},
    })
    plain.decode_mode = "pause"
    with serve_app(create_app(settings), ready_path="/ready") as gw:
        wait_until_up(gw, [w.url for w in fakes.values()])
        thread, answers = streamed_in_thread(gw, "plain-pool")
        try:
            deadline = time.monotonic() + 10
            while not plain.bodies:
                assert time.monotonic() < deadline, "the request never reached the plain pool"
                time.sleep(0.02)
            wait_for_bytes(gw, "plain-pool", (len(PROMPT) + MAX_TOKENS) * PER_TOKEN,
                           "in the plain pool")
        finally:
            plain.go.set()
            thread.join(20)
        assert answers and answers[0].status_code == 200
        assert answers[0].headers["x-kvgate-pool"] == "short"
        assert prefills(fakes) == []
        wait_for_bytes(gw, "plain-pool", 0, "after the end")


def test_request_spilled_into_a_disaggregated_pool_runs_in_one_step_reserved_once(
    fakes: dict[str, FakeWorker],
) -> None:
    """Reserved for one step (its home pool has no prefill workers), a request that spills into
    a disaggregated pool is computed by the decode worker: a prefill step there would hold the
    prompt twice with only one copy reserved."""
    plain, decode = fakes["plain"], fakes["decode-a"]
    settings = build_settings({
        "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [
            {"name": "short", "max_context_tokens": 1024, "workers": [plain.url],
             "saturation_inflight": 1},
            {"name": "pd", "max_context_tokens": 4096, "policy": "kv_aware",
             "workers": [decode.url],
             "prefill_workers": [fakes["prefill-a"].url, fakes["prefill-b"].url]},
        ],
        "routing": {"spill": True},
        "health": {"interval_s": 0.2, "scrape_interval_s": 0.5, "unhealthy_threshold": 1},
        "admin": {"token": ADMIN_TOKEN},
    })
    plain.decode_mode = decode.decode_mode = "pause"
    with serve_app(create_app(settings), ready_path="/ready") as gw:
        wait_until_up(gw, [w.url for w in fakes.values()])
        first, first_answers = streamed_in_thread(gw, "home")
        spilled: threading.Thread | None = None
        answers: list[httpx.Response] = []
        try:
            wait_for_bytes(gw, "home", (len(PROMPT) + MAX_TOKENS) * PER_TOKEN, "home pool busy")
            spilled, answers = streamed_in_thread(gw, "spilled")
            wait_for_bytes(gw, "spilled", (len(PROMPT) + MAX_TOKENS) * PER_TOKEN,
                           "spilled into the disaggregated pool")
        finally:
            plain.go.set()
            decode.go.set()
            first.join(20)
            if spilled is not None:
                spilled.join(20)
        assert first_answers and first_answers[0].headers["x-kvgate-pool"] == "short"
        assert answers and answers[0].status_code == 200
        assert (answers[0].headers["x-kvgate-pool"], answers[0].headers["x-kvgate-worker"]) == (
            "pd", decode.url)
        assert prefills(fakes) == []
        wait_for_bytes(gw, "spilled", 0, "after the end")

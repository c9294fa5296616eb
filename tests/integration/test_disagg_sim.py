"""Prefill/decode disaggregation end to end: a real served gateway in front of simulated vLLM
workers with the NIXL connector's roles (``kv_role``): prefill on producers, decode on consumers
that pull the prompt's KV from the producer the gateway names.

Two producers and two consumers; each producer in its own fleet so one can be stopped. What is
checked is read from the workers' own /metrics (as vLLM exports them) and the gateway's.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.kvmath import load_model_arch
from gateway.sim.config import SimWorkerConfig
from gateway.sim.fleet import SimFleet
from tests.harness import serve_app

MODEL = "sim"
ADMIN = {"Authorization": "Bearer admin-secret"}
PRODUCER = SimWorkerConfig(model_name=MODEL, max_model_len=8192, time_scale=0.2,
                           kv_role="kv_producer")
CONSUMER = SimWorkerConfig(model_name=MODEL, max_model_len=8192, time_scale=0.2,
                           kv_role="kv_consumer")
# 3000 prompt tokens of llama-3-8b on an H100 is ~0.1 modelled seconds: x100, ~10 s of prefill,
# in chunks of 256 tokens (vLLM's chunked prefill): an abort takes effect at the next step.
SLOW_PRODUCER = SimWorkerConfig(model_name=MODEL, max_model_len=8192, time_scale=100.0,
                                max_num_batched_tokens=256, kv_role="kv_producer")
SYSTEM = "You are a careful assistant who answers in short sentences. " * 40


class Fleets:
    """Simulated workers on one background loop, each fleet stoppable on its own."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._fleets: dict[str, SimFleet] = {}

    def start(self, *configs: SimWorkerConfig) -> list[str]:
        fleet = SimFleet(list(configs))
        urls: list[str] = asyncio.run_coroutine_threadsafe(fleet.start(), self._loop).result(30)
        for url in urls:
            self._fleets[url] = fleet
        return urls

    def stop(self, url: str) -> None:
        fleet = self._fleets.pop(url)
        asyncio.run_coroutine_threadsafe(fleet.stop(), self._loop).result(30)

    def close(self) -> None:
        for fleet in {id(f): f for f in self._fleets.values()}.values():
            asyncio.run_coroutine_threadsafe(fleet.stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()


@pytest.fixture(scope="module")
def fleets() -> Iterator[Fleets]:
    f = Fleets()
    try:
        yield f
    finally:
        f.close()


@pytest.fixture(scope="module")
def workers(fleets: Fleets) -> dict[str, list[str]]:
    decode = fleets.start(CONSUMER, CONSUMER)
    prefill = fleets.start(PRODUCER) + fleets.start(PRODUCER)
    return {"prefill": prefill, "decode": decode}


def settings(prefill: list[str], decode: list[str], **pool: Any) -> Any:
    return build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "pd", "max_context_tokens": 8192, "policy": "kv_aware",
                   "workers": decode, "prefill_workers": prefill, **pool}],
        "health": {"interval_s": 0.2, "timeout_s": 30.0,
                   "scrape_interval_s": 0.3, "unhealthy_threshold": 1},
        "admin": {"token": "admin-secret"},
    })


def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def value(url: str, name: str, **labels: str) -> float:
    return promtext.value(httpx.get(url + "/metrics").text, name, **labels) or 0.0


def up(gw: str, url: str) -> bool:
    return value(gw, "kvgate_worker_up", worker=url) == 1.0


@pytest.fixture(scope="module")
def gateway(workers: dict[str, list[str]]) -> Iterator[str]:
    with serve_app(create_app(settings(workers["prefill"], workers["decode"])),
                   ready_path="/ready") as gw:
        for url in workers["prefill"] + workers["decode"]:
            wait_for(lambda url=url: up(gw, url), f"{url} up")  # type: ignore[misc]
        yield gw


def total(urls: list[str], name: str) -> float:
    return sum(value(u, name) for u in urls)


def test_chat_and_completions_streamed_or_not_come_from_the_decode_worker(
    gateway: str, workers: dict[str, list[str]],
) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
    prefill, decode = workers["prefill"], workers["decode"]
    before = {name: total(urls, metric) for name, urls, metric in (
        ("prefill_gen", prefill, "vllm:generation_tokens_total"),
        ("decode_gen", decode, "vllm:generation_tokens_total"),
        ("pulls", decode, "vllm:nixl_xfer_time_seconds_count"))}
    messages: list[Any] = [{"role": "system", "content": SYSTEM},
                           {"role": "user", "content": "Hi."}]
    chat = client.chat.completions.create(model=MODEL, messages=messages,
                                          max_tokens=12, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content and chat.usage is not None
    assert chat.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    done = client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=12,
                                     extra_body={"ignore_eos": True})
    assert done.choices[0].text and done.usage is not None and done.usage.completion_tokens == 12
    streamed = list(client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=12,
                                              stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices)
    # Every request: one token on a prefill worker (max_tokens 1, do_remote_decode), its KV
    # pulled by a decode worker, which generated all 12 tokens the client got.
    wait_for(lambda: total(decode, "vllm:generation_tokens_total") - before["decode_gen"] >= 48,
             "decode workers' token counters")
    assert total(prefill, "vllm:generation_tokens_total") - before["prefill_gen"] == 4
    assert total(decode, "vllm:generation_tokens_total") - before["decode_gen"] == 48
    assert total(decode, "vllm:nixl_xfer_time_seconds_count") - before["pulls"] == 4
    text = httpx.get(gateway + "/metrics").text
    assert sum(promtext.value(text, "kvgate_requests_total", pool="pd", worker=d, code="200")
               or 0.0 for d in decode) >= 4
    assert all(promtext.value(text, "kvgate_requests_total", pool="pd", worker=p, code="200")
               is None for p in prefill)  # a prefill worker never answers a client


def test_shared_prefix_goes_to_the_same_prefill_worker(
    gateway: str, workers: dict[str, list[str]],
) -> None:
    prefix = "A shared preamble that every turn of this conversation repeats. " * 30
    before = {p: value(gateway, "kvgate_prefill_requests_total", pool="pd", worker=p, code="200")
              for p in workers["prefill"]}
    for turn in range(4):
        r = httpx.post(gateway + "/v1/completions", timeout=30, json={
            "model": MODEL, "prompt": prefix + f"Question {turn}?", "max_tokens": 4})
        assert r.status_code == 200, r.text
    after = {p: value(gateway, "kvgate_prefill_requests_total", pool="pd", worker=p, code="200")
             for p in workers["prefill"]}
    assert sorted(after[p] - before[p] for p in after) == [0, 4]
    assert value(gateway, "kvgate_prefill_decisions_total", pool="pd", reason="prefix_hit") >= 3


def test_short_remainders_are_computed_by_the_decode_worker_in_one_step(fleets: Fleets) -> None:
    """``remote_prefill_min_tokens``: a short chat, and the new turn of a conversation whose
    earlier turns the decode worker already holds (it cached the blocks it pulled), skip the
    prefill workers; a long uncached prompt does not."""
    decode = fleets.start(CONSUMER)
    prefill = fleets.start(PRODUCER)
    history = "An earlier turn of this conversation that the decode worker now holds. " * 40
    with serve_app(create_app(settings(prefill, decode, remote_prefill_min_tokens=256)),
                   ready_path="/ready") as gw:
        for url in prefill + decode:
            wait_for(lambda url=url: up(gw, url), f"{url} up")  # type: ignore[misc]

        def steps(prompt: str) -> tuple[float, float]:
            """(prefill steps, prompt tokens the decode worker pulled) for one request."""
            before = (value(gw, "kvgate_prefill_requests_total", pool="pd", worker=prefill[0],
                            code="200"), value(decode[0], "vllm:nixl_xfer_time_seconds_count"))
            r = httpx.post(gw + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": prompt, "max_tokens": 4})
            assert r.status_code == 200, r.text
            assert r.headers["x-kvgate-worker"] == decode[0]
            return (value(gw, "kvgate_prefill_requests_total", pool="pd", worker=prefill[0],
                          code="200") - before[0],
                    value(decode[0], "vllm:nixl_xfer_time_seconds_count") - before[1])

        assert steps("A short question?") == (0, 0)
        assert steps(history + "First question?") == (1, 1)  # ~900 tokens, none held
        assert steps(history + "Second question?") == (0, 0)  # held by the decode worker
    fleets.stop(prefill[0])
    fleets.stop(decode[0])


def test_prefill_worker_down_is_avoided(fleets: Fleets) -> None:
    decode = fleets.start(CONSUMER)
    doomed, survivor = fleets.start(PRODUCER), fleets.start(PRODUCER)
    prefill = doomed + survivor
    with serve_app(create_app(settings(prefill, decode)), ready_path="/ready") as gw:
        for url in prefill + decode:
            wait_for(lambda url=url: up(gw, url), f"{url} up")  # type: ignore[misc]
        fleets.stop(doomed[0])
        wait_for(lambda: not up(gw, doomed[0]), "the stopped prefill worker down")
        for turn in range(4):
            r = httpx.post(gw + "/v1/completions", timeout=30, json={
                "model": MODEL, "prompt": f"Turn {turn}: tell me something.", "max_tokens": 4})
            assert r.status_code == 200, r.text
        assert value(gw, "kvgate_prefill_requests_total", pool="pd", worker=survivor[0],
                     code="200") == 4
    fleets.stop(survivor[0])
    fleets.stop(decode[0])


def test_client_leaving_mid_prefill_aborts_it_and_releases_every_hold(fleets: Fleets) -> None:
    decode = fleets.start(CONSUMER)
    slow = fleets.start(SLOW_PRODUCER)
    prompt = list(range(100, 3100))  # token ids: exactly 3000 prompt tokens
    max_tokens = 8
    with serve_app(create_app(settings(slow, decode)), ready_path="/ready") as gw:
        for url in slow + decode:
            wait_for(lambda url=url: up(gw, url), f"{url} up")  # type: ignore[misc]
        # The client is a raw connection that leaves when the test says so (not on a timer: a
        # stalled machine must not let it leave before the test has seen the request held).
        body = orjson.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
        host, port = gw.removeprefix("http://").split(":")
        client = socket.create_connection((host, int(port)), timeout=60)
        client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
                       b"content-type: application/json\r\n"
                       + f"content-length: {len(body)}\r\n\r\n".encode() + body)

        def usage() -> dict[str, Any] | None:
            r = httpx.get(gw + "/admin/tenants/anonymous", headers=ADMIN, timeout=60)
            return r.json() if r.status_code == 200 else None

        try:
            wait_for(lambda: (u := usage()) is not None and u["inflight_requests"] == 1,
                     "the request admitted")
            # The prompt's KV is reserved twice: on the prefill worker and on the decode worker.
            per_token = load_model_arch("llama-3-8b").kv_bytes_per_token("auto")
            held = usage()
            assert held is not None
            assert held["inflight_kv_bytes"] == (2 * len(prompt) + max_tokens) * per_token
            assert value(slow[0], "vllm:num_requests_running") == 1
        finally:
            client.close()  # the client gives up during the ~10 s prefill
        # vLLM aborts on the closed connection: the prefill stops long before its ~10 s.
        wait_for(lambda: value(slow[0], "vllm:num_requests_running") == 0,
                 "the prefill aborted", timeout_s=8)
        wait_for(lambda: all(value(gw, "kvgate_worker_inflight", pool="pd", worker=u) == 0
                             for u in slow + decode), "no request in flight")
        u = usage()
        assert u is None or (u["inflight_requests"], u["inflight_kv_bytes"]) == (0, 0)
        assert value(gw, "kvgate_prefill_requests_total", pool="pd", worker=slow[0],
                     code="499") == 1
        assert value(decode[0], "vllm:request_success_total") == 0  # no decode ran
    fleets.stop(slow[0])
    fleets.stop(decode[0])


# A prefill of ~1 s and a decode of ~0.1 s per token: slow enough to read the budget in each
# phase through the admin API.
SLOWISH_PRODUCER = SimWorkerConfig(model_name=MODEL, max_model_len=8192, time_scale=20.0,
                                   kv_role="kv_producer")
SLOWISH_CONSUMER = SimWorkerConfig(model_name=MODEL, max_model_len=8192, time_scale=20.0,
                                   kv_role="kv_consumer")


def test_session_is_charged_the_prompt_twice_only_until_the_decode_worker_pulled_it(
    fleets: Fleets,
) -> None:
    """Issue 14: budgets charge each side for the time it holds the KV. During the prefill the
    session holds the prompt twice (the prefill worker's copy, the decode worker's to come) plus
    the output limit; from the decode step's first token, the decode side's footprint alone; at
    the end nothing."""
    decode = fleets.start(SLOWISH_CONSUMER) + fleets.start(SLOWISH_CONSUMER)
    prefill = fleets.start(SLOWISH_PRODUCER) + fleets.start(SLOWISH_PRODUCER)
    prompt = list(range(100, 1600))  # token ids: exactly 1500 prompt tokens
    max_tokens = 24
    per_token = load_model_arch("llama-3-8b").kv_bytes_per_token("auto")
    both_sides = (2 * len(prompt) + max_tokens) * per_token
    decode_side = (len(prompt) + max_tokens) * per_token
    with serve_app(create_app(settings(prefill, decode)), ready_path="/ready") as gw:
        for url in prefill + decode:
            wait_for(lambda url=url: up(gw, url), f"{url} up")  # type: ignore[misc]
        first_token, finished = threading.Event(), threading.Event()
        got: list[str] = []

        def client() -> None:
            try:
                with httpx.stream("POST", gw + "/v1/completions", timeout=60,
                                  headers={"X-Session-ID": "pd-budget"},
                                  json={"model": MODEL, "prompt": prompt,
                                        "max_tokens": max_tokens, "stream": True,
                                        "ignore_eos": True}) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            got.append(line)
                            first_token.set()
            finally:
                finished.set()

        def held() -> int | None:
            r = httpx.get(gw + "/admin/tenants/anonymous/sessions/pd-budget", headers=ADMIN,
                          timeout=60)
            return r.json()["inflight_kv_bytes"] if r.status_code == 200 else None

        def prefilling() -> float:
            return sum(value(p, "vllm:num_requests_running") for p in prefill)

        thread = threading.Thread(target=client)
        thread.start()
        try:
            wait_for(lambda: prefilling() == 1, "the prefill running", timeout_s=10)
            during_prefill = held()
            assert prefilling() == 1, "the prefill ended before the budget was read"
            assert during_prefill == both_sides
            wait_for(first_token.is_set, "the decode step's first token", timeout_s=20)
            wait_for(lambda: held() == decode_side, "the reservation shrunk to the decode side")
            assert not finished.is_set(), "the decode ended before the budget was read"
            top = httpx.get(gw + "/admin/sessions", headers=ADMIN, timeout=60).json()["data"]
            assert [(s["session_id"], s["inflight_kv_bytes"]) for s in top] == [
                ("pd-budget", decode_side)]
            thread.join(60)
            assert len(got) == max_tokens  # one token per event, all from the decode worker
            u = held()
            assert u is None or u == 0
            wait_for(lambda: (tenant := httpx.get(gw + "/admin/tenants/anonymous",
                                                  headers=ADMIN, timeout=60)).status_code != 200
                     or tenant.json()["inflight_kv_bytes"] == 0, "the tenant back at zero")
        finally:
            thread.join(60)
    for url in decode + prefill:
        fleets.stop(url)

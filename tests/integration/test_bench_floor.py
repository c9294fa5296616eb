"""The overhead benchmark's floors (``gateway.bench.floor``) forward what the backend answers,
whole and streamed, over kept-alive connections: otherwise their CPU per request would be a
floor of nothing."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import httpx
import pytest

from gateway.bench.floor import KINDS
from gateway.procs.kvgate import floor_proxy
from gateway.procs.net import free_port
from gateway.procs.process import ManagedProcess

CHAT = {"model": "noop", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def backend(noop_backend_url: str) -> str:
    return noop_backend_url


@pytest.fixture(scope="module", params=KINDS)
def floor(request: pytest.FixtureRequest, backend: str) -> Iterator[str]:
    proc: ManagedProcess
    proc, url = floor_proxy(request.param, free_port(), backend)
    proc.start(timeout_s=60)
    try:
        yield url
    finally:
        proc.stop()


def _events(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("data: ")]


def test_a_floor_answers_as_the_backend_whole_and_streamed_on_one_connection(
    floor: str, backend: str,
) -> None:
    with httpx.Client(timeout=10) as direct, httpx.Client(timeout=10) as through:
        want = direct.post(backend + "/v1/chat/completions", json=CHAT)
        want_stream = direct.post(backend + "/v1/chat/completions",
                                  json={**CHAT, "stream": True})
        for _ in range(20):  # one client connection, kept alive; the upstream's reused
            got = through.post(floor + "/v1/chat/completions", json=CHAT)
            assert got.status_code == 200
            assert got.json() == want.json()
            assert got.headers["content-type"] == want.headers["content-type"]
            got_stream = through.post(floor + "/v1/chat/completions",
                                      json={**CHAT, "stream": True})
            assert got_stream.status_code == 200
            assert got_stream.headers["content-type"].startswith("text/event-stream")
            events = _events(got_stream.text)
            assert events == _events(want_stream.text)
            assert events[-1] == "data: [DONE]" and len(events) == 5 + 3
            assert json.loads(events[1][6:])["choices"][0]["delta"]["content"] == "ok"


def test_a_floor_serves_concurrent_clients_each_its_own_answer(floor: str) -> None:
    async def many() -> list[int]:
        async with httpx.AsyncClient(timeout=10) as client:
            answers = await asyncio.gather(*(
                client.post(floor + "/v1/chat/completions", json={**CHAT, "max_tokens": n})
                for n in range(1, 33)))
            return [a.status_code for a in answers]

    assert asyncio.run(many()) == [200] * 32

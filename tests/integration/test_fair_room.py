"""The room kept for others, through the gateway (issue 12, item 4; ``gateway/overload.py``).

Two held workers (each answers a completion only when the test releases it, so a long prompt
held there stays "prefilling" in the gateway's view) in one ``kv_aware`` pool, two API keys,
``limits.long_prompt_tokens: 1000`` and ``reserve_workers: 1``:

* while tenant ``light`` is active, tenant ``flood``'s second long prompt does not reach a
  worker while its first one occupies one of the two: it waits in the gateway;
* ``light``'s chat meanwhile goes at once, to the worker with no long prefill;
* the waiting long prompt goes on as soon as the first one ends;
* with the room off (``long_prompt_tokens: 0``) the second long prompt reaches the other worker
  at once, and the chat lands behind a long prefill: what the room is for.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from tests.harness import serve_app
from tests.integration.test_reliability_overload import HeldWorker

pytestmark = pytest.mark.timeout(60)

KEYS = {"flood": "key-flood", "light": "key-light"}
LONG_WORDS = 1500
SHORT_WORDS = 20


def settings(workers: list[str], long_prompt_tokens: int) -> Any:
    return build_settings({
        "models": [{"name": "noop", "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "p", "max_context_tokens": 8192, "policy": "kv_aware",
                   "workers": workers}],
        "health": {"interval_s": 60},
        "limits": {"long_prompt_tokens": long_prompt_tokens, "reserve_workers": 1,
                   "queue_timeout_s": 20},
        "auth": {"api_keys": [{"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                              for name, key in KEYS.items()]},
    })


@contextlib.contextmanager
def two_workers(long_prompt_tokens: int) -> Iterator[tuple[str, list[HeldWorker], int]]:
    held = [HeldWorker(), HeldWorker()]
    with serve_app(held[0]) as one, serve_app(held[1]) as two:
        app = create_app(settings([one, two], long_prompt_tokens))
        with serve_app(app, ready_path="/ready") as gw:
            yield gw, held, long_prompt_tokens
            for worker in held:
                worker.release_all()


@pytest.fixture(params=[1000, 0], ids=["room", "no_room"])
def fleet(request: pytest.FixtureRequest) -> Iterator[tuple[str, list[HeldWorker], int]]:
    with two_workers(request.param) as f:
        yield f


def post(http: httpx.AsyncClient, gw: str, tenant: str, tag: str,
         words: int) -> asyncio.Task[httpx.Response]:
    # every prompt its own (the tag first): no shared prefix pulls two to one worker
    body = {"model": "noop", "messages": [{"role": "user", "content": f"{tag} " + "hi " * words}],
            "max_tokens": 16, "tag": tag}
    return asyncio.create_task(http.post(gw + "/v1/chat/completions", json=body,
                                         headers={"authorization": f"Bearer {KEYS[tenant]}"}))


async def arrived(held: list[HeldWorker], tag: str, timeout_s: float) -> int | None:
    """The index of the worker ``tag`` reached within ``timeout_s``, else None."""
    for _ in range(int(timeout_s / 0.01)):
        for i, worker in enumerate(held):
            if tag in worker.arrivals:
                return i
        await asyncio.sleep(0.01)
    return None


async def test_long_prompt_waits_while_the_pool_keeps_a_worker_for_another_tenants_chat(
        fleet: tuple[str, list[HeldWorker], int]) -> None:
    gw, held, long_prompt_tokens = fleet
    async with httpx.AsyncClient(timeout=30) as http:
        chat = post(http, gw, "light", "l0", SHORT_WORDS)  # light is active from now on
        where = await arrived(held, "l0", 5.0)
        assert where is not None
        held[where].release("l0")
        assert (await chat).status_code == 200

        first = post(http, gw, "flood", "f0", LONG_WORDS)
        busy = await arrived(held, "f0", 5.0)
        assert busy is not None
        second = post(http, gw, "flood", "f1", LONG_WORDS)
        if long_prompt_tokens == 0:  # no room kept: the flood takes the other worker at once
            assert await arrived(held, "f1", 5.0) == 1 - busy
            chat = post(http, gw, "light", "l1", SHORT_WORDS)
            assert await arrived(held, "l1", 5.0) is not None
            for worker in held:
                worker.release_all()
            assert [r.status_code for r in await asyncio.gather(first, second, chat)] == [200] * 3
            return
        assert await arrived(held, "f1", 0.5) is None  # parked in the gateway

        chat = post(http, gw, "light", "l1", SHORT_WORDS)
        assert await arrived(held, "l1", 2.0) == 1 - busy  # at once, where no long prefill is
        held[1 - busy].release("l1")
        assert (await chat).status_code == 200
        assert await arrived(held, "f1", 0.3) is None  # still one worker to keep

        held[busy].release("f0")  # the first long prompt ends: room again
        assert (await first).status_code == 200
        assert await arrived(held, "f1", 5.0) is not None
        for worker in held:
            worker.release_all()
        assert (await second).status_code == 200


async def test_long_prompt_whose_client_leaves_while_parked_is_never_forwarded() -> None:
    """Regression: a parked long prompt (its body read, waiting for room) did not watch its
    client, so one whose client had given up still went to a worker when room came: a long
    prefill computed for nobody, and a place in the queue held meanwhile."""
    with two_workers(1000) as (gw, held, _):
        async with httpx.AsyncClient(timeout=30) as http:
            chat = post(http, gw, "light", "l0", SHORT_WORDS)  # light is active from now on
            where = await arrived(held, "l0", 5.0)
            assert where is not None
            held[where].release("l0")
            assert (await chat).status_code == 200
            first = post(http, gw, "flood", "f0", LONG_WORDS)
            busy = await arrived(held, "f0", 5.0)
            assert busy is not None
            async with httpx.AsyncClient(timeout=0.5) as impatient:
                gone = post(impatient, gw, "flood", "f1", LONG_WORDS)
                with pytest.raises(httpx.ReadTimeout):
                    await gone  # parked in the gateway; the client gives up
            for _ in range(500):  # its FIN reaches the gateway: it leaves the queue
                text = (await http.get(gw + "/metrics")).text
                if promtext.value(text, "kvgate_gateway_queued_requests") == 0.0:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("the parked request whose client left is still queued")
            held[busy].release("f0")  # room again
            assert (await first).status_code == 200
            assert await arrived(held, "f1", 1.0) is None

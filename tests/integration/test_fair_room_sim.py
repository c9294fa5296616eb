"""The room kept for others keeps long *decodes* off the reserved worker too, through the gateway
on three simulated workers (issue 12, item 4; ``AdmissionGate.avoid``).

Tenant ``flood`` streams two long prompts while alone (no room to keep: they go to two workers)
and keeps them decoding. Then tenant ``light`` sends chats: each avoids the two workers carrying
a long request, even when ``kv_aware`` alone would prefer one of them (the free worker has more
requests open: light's own long-running chats). A long prompt sent while light is active leaves
that worker, now the reserved one, alone. Without the wiring (the gate's ``avoid`` passed to
the router, ``Slot.routed`` counting the long requests per worker) light's chats spread over all
three workers by ``kv_aware``'s cost.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.config import SimWorkerConfig
from tests.harness import serve_app
from tests.integration.sim_workers import MODEL, Workers, up, wait_for, words

pytestmark = pytest.mark.timeout(120)

KEYS = {"flood": "key-flood", "light": "key-light"}
LONG_WORDS = 1000  # ~2,000 tokens with the simple tokenizer: long at long_prompt_tokens 1000
SHORT_WORDS = 20
DECODE_TOKENS = 20_000  # decoding for the whole test (ignore_eos): closed by the test


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[str, list[str]]]:
    workers = Workers(configs=[SimWorkerConfig(model_name=MODEL, max_model_len=32768)] * 3)
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "p", "max_context_tokens": 32768, "policy": "kv_aware",
                   "workers": workers.urls}],
        "health": {"interval_s": 0.2},
        "limits": {"long_prompt_tokens": 1000, "reserve_workers": 1, "queue_timeout_s": 20},
        "auth": {"api_keys": [{"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                              for name, key in KEYS.items()]},
    })
    try:
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            for url in workers.urls:
                wait_for(functools.partial(up, gw, url), f"{url} up")
            yield gw, workers.urls
    finally:
        workers.close()


@contextlib.asynccontextmanager
async def decoding(http: httpx.AsyncClient, gw: str, tenant: str, seed: int,
                   prompt_words: int) -> AsyncIterator[str]:
    """A streamed request that keeps decoding while the block runs; yields its worker once its
    first token has come (its prefill is over: it is decoding there)."""
    body = {"model": MODEL, "prompt": words(seed, prompt_words), "max_tokens": DECODE_TOKENS,
            "ignore_eos": True, "stream": True}
    async with http.stream("POST", gw + "/v1/completions", json=body,
                           headers={"authorization": f"Bearer {KEYS[tenant]}"}) as r:
        assert r.status_code == 200
        lines = r.aiter_lines()  # held: an iterator left to the collector closes the stream
        async for line in lines:
            if line.startswith("data: "):
                break
        yield r.headers["x-kvgate-worker"]


async def served_by(http: httpx.AsyncClient, gw: str, tenant: str, seed: int,
                    prompt_words: int) -> str:
    r = await http.post(gw + "/v1/completions",
                        json={"model": MODEL, "prompt": words(seed, prompt_words),
                              "max_tokens": 1},
                        headers={"authorization": f"Bearer {KEYS[tenant]}"})
    assert r.status_code == 200, r.text
    return r.headers["x-kvgate-worker"]


async def test_chats_avoid_workers_decoding_long_prompts_and_long_prompts_avoid_the_reserve(
        fleet: tuple[str, list[str]]) -> None:
    gw, urls = fleet
    async with httpx.AsyncClient(timeout=30) as http, contextlib.AsyncExitStack() as stack:
        # flood alone: no room kept, its two long prompts go to two workers and decode there
        first = await stack.enter_async_context(decoding(http, gw, "flood", 1, LONG_WORDS))
        second = await stack.enter_async_context(decoding(http, gw, "flood", 2, LONG_WORDS))
        assert first != second
        free = next(u for u in urls if u not in (first, second))
        # light's long-running chats: all on the worker with no long request, though
        # kv_aware's cost (64 per open request) would spread them
        for seed in (10, 11, 12):
            assert await stack.enter_async_context(
                decoding(http, gw, "light", seed, SHORT_WORDS)) == free
        # a chat now: the free worker has 3 open, the others 1 each; it still goes there
        assert await served_by(http, gw, "light", 20, SHORT_WORDS) == free
        # light is active: flood's next long prompt leaves the free (reserved) worker alone
        assert await served_by(http, gw, "flood", 30, LONG_WORDS) != free

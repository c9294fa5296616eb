"""A request leaves no reference cycle behind: its state (the parsed body, the token ids, the
reservation, the route) is freed when it ends, by reference counting, not by the garbage
collector. Under a flood of 128K-token prompts each cycle held a prompt's ids until a
collection, and the collections took 4-18 ms of the event loop each (issue 11, isolation;
``Dispatcher._settle``, ``kvindex.service._RouteSlices``). Whole, streamed and long requests
through the compiled request path when it is built (as the gateway runs), the ASGI app called
in-process against the no-op backend."""

from __future__ import annotations

import asyncio
import gc
import time
from collections import Counter

import orjson
import pytest

from gateway import server
from gateway.bench.overhead.calls import _call
from gateway.bench.overhead.model import CHAT_BODY, STREAM_BODY, Target
from gateway.bench.overhead.run import kvgate_config
from gateway.kvindex.service import ROUTE_SLICE_BLOCKS
from gateway.procs.net import free_port
from gateway.procs.vllm import tiny_model_path


@pytest.fixture(scope="module")
def backend(noop_backend_url: str) -> str:
    return noop_backend_url


def _long_body() -> bytes:
    """A chat of more than ``ROUTE_SLICE_BLOCKS`` blocks (~5,200 tokens with either tokenizer,
    under the pool's 8K): its route is recorded in slices."""
    words = " ".join("ab" for _ in range(ROUTE_SLICE_BLOCKS * 16 * 5 // 8))
    return orjson.dumps({**CHAT_BODY, "messages": [{"role": "user", "content": words}]})


@pytest.mark.parametrize("policy", ["kv_aware", "round_robin"])
def test_requests_through_the_gateway_leave_no_garbage_cycles(backend: str, policy: str) -> None:
    from gateway.app import create_app
    from gateway.config import build_settings

    tokenizer = "hf" if policy == "kv_aware" else "simple"
    settings = build_settings(kvgate_config(Target("gc", "", "kvgate", policy, tokenizer),
                                            backend, free_port(), tiny_model_path()))
    bodies = [orjson.dumps(CHAT_BODY), orjson.dumps(STREAM_BODY), _long_body()]
    garbage: list[object] = []

    async def run() -> None:
        app = create_app(settings)
        async with app.api.router.lifespan_context(app.api):
            deadline = time.monotonic() + 60
            while await _call(app, "GET", "/ready") != 200:
                assert time.monotonic() < deadline, "the gateway did not get ready"
                await asyncio.sleep(0.05)
            for body in bodies * 3:  # warm: connections, caches, lazily built state
                assert await _call(app, "POST", "/v1/chat/completions", body) == 200
            await asyncio.sleep(0.3)  # the deferred bookkeeping and the route's slices
            gc.collect()
            gc.set_debug(gc.DEBUG_SAVEALL)
            try:
                for body in bodies * 5:
                    assert await _call(app, "POST", "/v1/chat/completions", body) == 200
                await asyncio.sleep(0.3)
                gc.collect()
                garbage.extend(gc.garbage)
            finally:
                gc.set_debug(0)
                gc.garbage.clear()

    gc.disable()
    try:
        server.run(run())
    finally:
        gc.enable()
    assert Counter(type(o).__name__ for o in garbage) == Counter()

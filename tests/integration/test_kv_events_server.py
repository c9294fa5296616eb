"""A real vLLM server's KV events make the gateway predict exactly the prefix-cache hits it gets.

The gateway hashes the ids that ``/tokenize`` returns; the subscriber hashes the token ids that the
server's ``BlockStored`` events carry. The two must meet in the index, whatever hash the engine uses.
"""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from gateway.kvindex.events import KvEventsConfig
from gateway.kvindex.index import BlockIndex
from gateway.kvindex.service import PrefixIndex
from gateway.procs.vllm import VllmServer

pytestmark = pytest.mark.vllm

HTTP_TIMEOUT_S = 120.0
EVENT_WAIT_S = 60.0


def _prompt() -> str:
    words = "every request goes to the worker that already holds its prefix in cache".split()
    return f"Session {uuid.uuid4().hex}: " + " ".join(words[i % len(words)] for i in range(150))


async def until_subscribed(prefix: PrefixIndex, server: VllmServer,
                           client: httpx.AsyncClient) -> None:
    """ZMQ's slow joiner: what a publisher sends before the subscription reaches it is lost, and
    how long that takes is not bounded on a loaded machine. Requests of their own (prompts no
    other shares a block with) until the subscriber has applied a batch from ``server``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3 * EVENT_WAIT_S
    while True:
        stats = prefix.subscriber_stats()[server.url]
        if stats.batches + stats.warm_batches > 0:
            return
        assert loop.time() < deadline, stats
        r = await client.post(f"{server.url}/v1/completions",
                              json={"model": server.model_name, "prompt": _prompt(),
                                    "max_tokens": 1})
        assert r.status_code == 200, r.text
        await asyncio.sleep(0.2)


async def test_events_from_a_real_server_predict_its_prefix_cache_hits(
    vllm_servers: list[VllmServer],
) -> None:
    first, second = vllm_servers[0], vllm_servers[1]
    block = first.block_size_tokens
    prefix = PrefixIndex(BlockIndex())
    for s in (first, second):
        prefix.set_worker(
            s.url,
            s.block_size_tokens,
            None,
            KvEventsConfig(s.kv_events_endpoint, s.kv_replay_endpoint, s.kv_events_topic),
        )
    await prefix.start()
    try:
        prompt = _prompt()
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
            await until_subscribed(prefix, first, client)
            tokenized = await client.post(
                f"{first.url}/tokenize", json={"model": first.model_name, "prompt": prompt}
            )
            ids = tuple(tokenized.json()["tokens"])
            workers = [(first.url, block), (second.url, second.block_size_tokens)]
            assert prefix.cached_tokens(ids, workers) == {first.url: 0, second.url: 0}

            done = await client.post(
                f"{first.url}/v1/completions",
                json={"model": first.model_name, "prompt": prompt, "max_tokens": 1},
            )
            assert done.status_code == 200

            expected = (len(ids) - 1) // block * block
            deadline = asyncio.get_running_loop().time() + EVENT_WAIT_S
            while prefix.cached_tokens(ids, workers)[first.url] < expected:
                assert asyncio.get_running_loop().time() < deadline, prefix.subscriber_stats()
                await asyncio.sleep(0.05)
            assert prefix.cached_tokens(ids, workers) == {first.url: expected, second.url: 0}
            assert prefix.index.stats()[first.url].confirmed >= len(ids) // block

            # and the server agrees: sending it again hits exactly what was predicted
            again = await client.post(
                f"{first.url}/v1/completions",
                json={"model": first.model_name, "prompt": prompt, "max_tokens": 1},
            )
            details = again.json()["usage"].get("prompt_tokens_details") or {}
            if details.get("cached_tokens") is not None:
                assert details["cached_tokens"] == expected
        stats = prefix.subscriber_stats()[first.url]
        assert stats.resets == 0 and stats.decode_errors == 0, stats
        assert not any(k.startswith("skipped") for k in stats.events), stats.events
    finally:
        await prefix.close()

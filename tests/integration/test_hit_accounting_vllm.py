"""Hit accounting against real vLLM: the index's prediction is what vLLM delivers.

On the session's ``vllm_with_details`` server (``--enable-prompt-tokens-details``, KV events;
shared with ``test_cached_tokens_vllm.py``, whose prompts share no block with these).
A prefix-sharing workload (a few long system documents, several questions each, in rounds so
that each document comes back after the others) goes through the gateway; for every request the
explanation's predicted cached tokens must be within one block of vLLM's ``cached_tokens`` (for
at least 99% of them), and its outcomes must sum to its prompt tokens, the losses to the ceiling
minus what was delivered.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.vllm import VllmServer
from gateway.routing.accounting import LOSSES, OUTCOMES
from tests.harness import explained, serve_app

pytestmark = pytest.mark.vllm

TOKEN = "admin-secret"
BLOCK = 32
WORDS = "alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike".split()


def document(seed: int, n_words: int) -> str:
    return " ".join(f"{WORDS[(i * 7 + seed) % len(WORDS)]}{(i + seed) % 13}" for i in range(n_words))


@pytest.fixture(scope="module")
def gateway(vllm_with_details: VllmServer) -> Iterator[str]:
    s = vllm_with_details
    settings = build_settings({
        "models": [{"name": s.model_name, "tokenizer": str(s.model_dir)}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "policy": "kv_aware",
                   "workers": [{"url": s.url, "kv_events_endpoint": s.kv_events_endpoint,
                                "kv_replay_endpoint": s.kv_replay_endpoint}]}],
        "health": {"interval_s": 0.5, "timeout_s": 30.0, "scrape_interval_s": 0.5},
        "admin": {"token": TOKEN},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        deadline = time.monotonic() + 30
        while httpx.get(url + "/v1/models").json()["data"] == [] and time.monotonic() < deadline:
            time.sleep(0.2)
        yield url


def explain(gateway: str, request_id: str) -> dict[str, Any]:
    return explained(gateway, request_id, TOKEN)


def test_predicted_cached_tokens_are_within_a_block_of_vllms_and_outcomes_sum(
    gateway: str,
) -> None:
    docs = [document(seed, 300) for seed in range(4)]
    explained = []
    for question in range(6):
        for d in docs:
            r = httpx.post(gateway + "/v1/chat/completions", timeout=120, json={
                "model": "tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "system", "content": d},
                             {"role": "user", "content": f"what is word number {question}?"}]})
            assert r.status_code == 200, r.text
            e = explain(gateway, r.headers["x-request-id"])
            assert e["delivered_cached_tokens"] == (
                r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
            explained.append(e)

    close = [abs(e["predicted_cached_tokens"] - e["delivered_cached_tokens"]) <= BLOCK
             for e in explained]
    assert sum(close) >= 0.99 * len(explained), [
        (e["predicted_cached_tokens"], e["delivered_cached_tokens"]) for e in explained]
    assert sum(e["delivered_cached_tokens"] > 0 for e in explained) >= 18  # the repeats hit
    for e in explained:
        outcomes = e["outcomes"]
        assert sum(outcomes.values()) == e["prompt_tokens"]
        assert outcomes["unknown"] == 0
        assert sum(outcomes[k] for k in LOSSES) == (
            e["ceiling_tokens"] - e["delivered_cached_tokens"])

    text = httpx.get(gateway + "/metrics").text
    counted = sum(promtext.value(text, "kvgate_prefix_tokens_total", pool="p", outcome=o) or 0
                  for o in OUTCOMES)
    assert counted == sum(e["prompt_tokens"] for e in explained)

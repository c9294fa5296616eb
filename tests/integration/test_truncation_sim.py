"""``truncate_prompt_tokens`` on the generation routes, through the gateway to a simulated worker.

vLLM cuts a chat or completions prompt to ``truncate_prompt_tokens`` (``truncation_side: left``
keeps its end) before it runs it, so the gateway counts, routes and hashes what vLLM keeps: a
prompt longer than every pool is served when it is cut to fit (it was refused as too long), the
budget holds the tokens kept, and two prompts that differ only in what the cut drops share their
cached blocks (predicted as vLLM delivers them).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.harness import explained, kv_event_batches
from tests.integration.sim_workers import (
    Workers,
    gateway_of_one,
    one_event_worker,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

ADMIN = "admin-token-truncation"
CONTEXT = 512


@pytest.fixture(scope="module")
def worker() -> Iterator[Workers]:
    with one_event_worker(max_model_len=CONTEXT) as w:
        yield w


@pytest.fixture(scope="module")
def gateway(worker: Workers) -> Iterator[str]:
    with gateway_of_one(worker, CONTEXT, lambda gw, n: complete(
            gw, list(range(60_000 + 40 * n, 60_040 + 40 * n))), admin={"token": ADMIN}) as gw:
        yield gw


def complete(gateway: str, prompt: list[int], **fields: Any) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/completions", timeout=30,
                      json={"model": "sim", "prompt": prompt, "max_tokens": 1, **fields})


def test_a_prompt_longer_than_every_pool_is_served_when_it_is_cut_to_fit(gateway: str) -> None:
    prompt = list(range(1000, 3000))  # 2,000 tokens, the pool holds 512
    refused = complete(gateway, prompt)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "context_length_exceeded"
    for side in ("right", "left"):
        r = complete(gateway, prompt, truncate_prompt_tokens=100, truncation_side=side)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens"] == 100
        e = explained(gateway, r.headers["x-request-id"], ADMIN)
        assert e["prompt_tokens"] == 100
    r = httpx.post(f"{gateway}/v1/chat/completions", timeout=30, json={
        "model": "sim", "max_tokens": 1, "truncate_prompt_tokens": 50,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(800))}]})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == 50


def test_prompts_that_differ_only_in_what_the_cut_drops_share_their_blocks(
    gateway: str, worker: Workers,
) -> None:
    (url,) = worker.urls
    tail = list(range(5000, 5300))  # what a left cut of 300 keeps of both
    def events_past(seen: float) -> bool:
        return kv_event_batches(gateway).get(url, 0) > seen

    for i, head in enumerate((list(range(7000, 7400)), list(range(8000, 8600)))):
        before = kv_event_batches(gateway).get(url, 0)
        r = complete(gateway, head + tail, truncate_prompt_tokens=300, truncation_side="left")
        assert r.status_code == 200, r.text
        delivered = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        e = explained(gateway, r.headers["x-request-id"], ADMIN)
        assert (delivered >= 288) is (i == 1), delivered  # the second: all but the last block
        assert abs(e["predicted_cached_tokens"] - delivered) <= 16, e
        if i == 0:
            wait_for(functools.partial(events_past, before), "its events", 30)


def test_the_simulator_refuses_a_prompt_cut_to_nothing_as_vllm_does(worker: Workers) -> None:
    """vLLM answers 400 ("The decoder prompt cannot be empty") for a prompt of no tokens; the
    simulator raised inside its scheduler and answered a plain-text 500."""
    for path, body in (
            ("/v1/completions", {"prompt": [1, 2, 3], "truncate_prompt_tokens": 0}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                      "truncate_prompt_tokens": 0})):
        r = httpx.post(worker.urls[0] + path, timeout=30,
                       json={"model": "sim", "max_tokens": 1, **body})
        assert r.status_code == 400, r.text
        assert "prompt cannot be empty" in r.json()["error"]["message"]

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
from tests.harness import explained, kv_event_batches, serve_app

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


def test_salted_prompts_are_predicted_as_vllm_caches_them(
    gateway: str, vllm_with_details: VllmServer,
) -> None:
    """vLLM keys a prompt's blocks by its ``cache_salt`` (the first block's extra keys, which
    its KV events publish): the index predicts a hit for the same salt only, never across salts
    or between salted and unsalted prompts, whatever is cached under the same tokens."""
    worker = vllm_with_details.url
    doc = "Salted. " + document(5, 300)  # unlike every other prompt of the session from its first block
    steps = [("tenant-a", False), ("tenant-a", True), (None, False), (None, True),
             ("tenant-c", False), ("tenant-a", True)]
    for i, (salt, hit) in enumerate(steps):
        before = kv_event_batches(gateway).get(worker, 0)
        body: dict[str, Any] = {
            "model": "tiny", "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": doc},
                         {"role": "user", "content": f"question {i}?"}]}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(gateway + "/v1/chat/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        e = explain(gateway, r.headers["x-request-id"])
        delivered = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert e["delivered_cached_tokens"] == delivered
        assert (delivered > 200) is hit, (i, salt, delivered)
        assert abs(e["predicted_cached_tokens"] - delivered) <= BLOCK, (i, salt, e)
        # A miss's blocks are in the index before the next request (a hit may store none: its
        # new tail can be shorter than a block).
        deadline = time.monotonic() + 30
        while not hit and kv_event_batches(gateway).get(worker, 0) <= before:
            assert time.monotonic() < deadline, "no KV event batch for the request"
            time.sleep(0.05)


def test_an_invalid_cache_salt_is_refused_as_vllm_refuses_it(
    gateway: str, vllm_with_details: VllmServer,
) -> None:
    """The gateway's 400 is vLLM's own message, before anything is reserved or routed."""
    for salt in ("", 7, "x" * 129, "a/b", "a@b"):
        body = {"model": "tiny", "max_tokens": 1, "cache_salt": salt,
                "messages": [{"role": "user", "content": "hi"}]}
        ours = httpx.post(gateway + "/v1/chat/completions", timeout=60, json=body)
        theirs = httpx.post(vllm_with_details.url + "/v1/chat/completions", timeout=60,
                            json={**body, "model": vllm_with_details.model_name})
        assert ours.status_code == theirs.status_code == 400, (salt, ours.text, theirs.text)
        assert ours.json()["error"]["message"] in theirs.json()["error"]["message"], salt
        assert ours.json()["error"]["param"] == "cache_salt"


def test_a_request_for_its_prompts_logprobs_is_predicted_no_hit_as_vllm_serves_none(
    gateway: str, vllm_with_details: VllmServer,
) -> None:
    """vLLM computes the whole prompt of a request that asks for its logprobs (``echo`` with
    ``logprobs`` on completions, ``prompt_logprobs``, ``echo`` on chat): the gateway predicts
    no hit for it (and routes it by load), though the prefix is cached; its blocks are cached
    all the same."""
    worker = vllm_with_details.url
    doc = "Logprobs. " + document(6, 300)
    chat = [{"role": "system", "content": doc}, {"role": "user", "content": "a question?"}]
    asks: list[tuple[str, dict[str, Any], bool]] = [
        ("/v1/chat/completions", {"messages": chat}, False),
        ("/v1/chat/completions", {"messages": chat, "prompt_logprobs": 0}, False),
        ("/v1/chat/completions", {"messages": chat, "echo": True}, False),
        ("/v1/chat/completions", {"messages": chat}, True),
        ("/v1/completions", {"prompt": doc}, False),
        ("/v1/completions", {"prompt": doc, "echo": True, "logprobs": 0}, False),
        ("/v1/completions", {"prompt": doc, "echo": True}, True),
    ]
    for i, (path, body, hit) in enumerate(asks):
        before = kv_event_batches(gateway).get(worker, 0)
        r = httpx.post(gateway + path, timeout=120,
                       json={"model": "tiny", "max_tokens": 1, "temperature": 0, **body})
        assert r.status_code == 200, r.text
        delivered = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        e = explain(gateway, r.headers["x-request-id"])
        assert (delivered > 200) is hit, (i, delivered)
        assert abs(e["predicted_cached_tokens"] - delivered) <= BLOCK, (i, e)
        if i in (0, 4):  # a first miss: its blocks are in the index before the next request
            deadline = time.monotonic() + 30
            while kv_event_batches(gateway).get(worker, 0) <= before:
                assert time.monotonic() < deadline, "no KV event batch for the request"
                time.sleep(0.05)


def test_a_truncated_prompt_is_counted_and_predicted_as_vllm_cuts_it(
    gateway: str, vllm_with_details: VllmServer,
) -> None:
    """``truncate_prompt_tokens``: vLLM keeps the last tokens (its side for a generation
    model's tokenizer, left) or, with ``truncation_side: right``, the first; the gateway counts
    what it keeps and predicts its hits on that: prompts that differ only in what the cut drops
    share their blocks."""
    worker = vllm_with_details.url
    head, tail = "Truncated. " + document(7, 150), document(8, 150)
    right = {"truncate_prompt_tokens": 256, "truncation_side": "right"}
    cases: list[tuple[str, dict[str, Any], bool]] = [  # (prompt, truncation, a hit expected)
        (head + " " + document(9, 100), right, False),
        (head + " " + document(10, 100), right, True),
        ("First. " + tail, {"truncate_prompt_tokens": 256}, False),
        ("Second, other. " + tail, {"truncate_prompt_tokens": 256}, True),
    ]
    for i, (prompt, fields, hit) in enumerate(cases):
        before = kv_event_batches(gateway).get(worker, 0)
        r = httpx.post(gateway + "/v1/completions", timeout=120,
                       json={"model": "tiny", "prompt": prompt, "max_tokens": 1, **fields})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        e = explain(gateway, r.headers["x-request-id"])
        assert usage["prompt_tokens"] == e["prompt_tokens"] == 256, (i, usage, e)
        delivered = usage["prompt_tokens_details"]["cached_tokens"]
        assert (delivered >= 192) is hit, (i, delivered)
        assert abs(e["predicted_cached_tokens"] - delivered) <= BLOCK, (i, e)
        deadline = time.monotonic() + 30
        while not hit and kv_event_batches(gateway).get(worker, 0) <= before:
            assert time.monotonic() < deadline, "no KV event batch for the request"
            time.sleep(0.05)

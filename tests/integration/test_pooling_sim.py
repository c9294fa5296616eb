"""The pooling routes through the gateway, in front of simulated workers (``runner: pooling``).

Two simulated workers in one pool: ``emb`` (a pooling model) and ``gen`` (a generating one),
both with the simple tokenizer and llama-3-8b's KV arithmetic (128 KiB per token), so a request's
KV footprint is exactly its input tokens x 131072 bytes. Inputs given as token ids make that
count exact in every test. The tenant ``alpha`` has a limit of ``REQUEST_LIMIT_TOKENS`` tokens of
KV per request, which a request can only meet by counting every one of its sequences.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import Runner, build_settings
from gateway.sim import SimFleet, SimWorkerConfig
from tests.harness import serve_app

KV_BYTES_PER_TOKEN = 131072
REQUEST_LIMIT_TOKENS = 40
KEY = "sk-alpha-" + "7" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_CONTEXT_TOKENS = 512


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, str]]:
    """The two simulated workers on their own event loop in a thread: name -> URL."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fleet = SimFleet([
        SimWorkerConfig(model_name="emb", runner=Runner.POOLING, time_scale=0.01,
                        max_model_len=MAX_CONTEXT_TOKENS),
        SimWorkerConfig(model_name="gen", time_scale=0.01, max_model_len=MAX_CONTEXT_TOKENS),
    ])
    try:
        emb, gen = asyncio.run_coroutine_threadsafe(fleet.start(), loop).result(60)
        yield {"emb": emb, "gen": gen}
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


@pytest.fixture(scope="module")
def gateway(workers: dict[str, str]) -> Iterator[str]:
    settings = build_settings({
        "models": [
            {"name": "emb", "runner": "pooling", "architecture": "llama-3-8b"},
            {"name": "gen", "architecture": "llama-3-8b"},
        ],
        "pools": [{"name": "p", "max_context_tokens": MAX_CONTEXT_TOKENS,
                   "workers": [workers["emb"], workers["gen"]]}],
        "auth": {"api_keys": [{"name": "alpha",
                               "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
        "budgets": {"defaults": {"request_kv_bytes": REQUEST_LIMIT_TOKENS * KV_BYTES_PER_TOKEN}},
        "health": {"interval_s": 0.2, "timeout_s": 30.0},
        "limits": {"max_body_bytes": 256 * 1024},
    })
    with serve_app(create_app(settings)) as url:
        for _ in range(100):
            served = httpx.get(url + "/v1/models", headers=AUTH).json()["data"]
            if len(served) == 2:
                break
            threading.Event().wait(0.1)
        yield url


def post(url: str, path: str, body: dict[str, Any], headers: dict[str, str] = AUTH
         ) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def ids(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def test_openai_embeddings_through_the_gateway_equal_the_workers_own(
        gateway: str, workers: dict[str, str]) -> None:
    texts = ["paged attention keeps blocks", "prefix caching reuses them"]
    through = openai.OpenAI(base_url=gateway + "/v1", api_key=KEY, max_retries=0)
    direct = openai.OpenAI(base_url=workers["emb"] + "/v1", api_key="none", max_retries=0)
    got = through.embeddings.create(model="emb", input=texts)
    want = direct.embeddings.create(model="emb", input=texts)
    assert [d.embedding for d in got.data] == [d.embedding for d in want.data]
    assert got.usage == want.usage and got.usage.prompt_tokens > 0


@pytest.mark.parametrize("path, body", [
    ("/score", {"text_1": "what is kv cache", "text_2": ["blocks of keys", "a cat"]}),
    ("/v1/score", {"queries": ["a", "b"], "documents": ["c d", "e f"]}),
    ("/rerank", {"query": "kv cache", "documents": ["blocks of keys", "a cat"], "top_n": 1}),
    ("/v1/rerank", {"query": "kv cache", "documents": ["blocks of keys", "a cat"]}),
    ("/v2/rerank", {"query": "kv cache", "documents": ["blocks of keys", "a cat"]}),
    ("/classify", {"input": ["good", "bad"]}),
    ("/pooling", {"input": [[5, 6, 7]]}),
    ("/v1/embeddings", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_pooling_route_through_the_gateway_answers_as_the_worker(
        gateway: str, workers: dict[str, str], path: str, body: dict[str, Any]) -> None:
    got = post(gateway, path, {"model": "emb", **body})
    want = post(workers["emb"], path, {"model": "emb", **body}, headers={})
    assert got.status_code == want.status_code == 200, got.text

    def stable(answer: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in answer.items() if k not in ("id", "created")}
    assert stable(got.json()) == stable(want.json())


def test_every_input_of_a_request_counts_against_the_request_limit(gateway: str) -> None:
    """Splitting one long input into many inputs of one request must not slip under the
    per-request KV limit: the footprint is the sum of the sequences, not the longest."""
    ok = post(gateway, "/v1/embeddings", {"model": "emb", "input": [ids(REQUEST_LIMIT_TOKENS)]})
    assert ok.status_code == 200, ok.text
    split = [ids(10, 100 + 10 * i) for i in range(REQUEST_LIMIT_TOKENS // 10 + 1)]
    refused = post(gateway, "/v1/embeddings", {"model": "emb", "input": split})
    assert refused.status_code == 400
    assert refused.json()["error"]["code"] == "kv_request_too_large"


def test_score_counts_every_query_and_document(gateway: str) -> None:
    words = " ".join(["w"] * 12)  # 24 tokens with the simple tokenizer (words and spaces)
    one = post(gateway, "/score", {"model": "emb", "text_1": "q", "text_2": [words]})
    assert one.status_code == 200, one.text
    two = post(gateway, "/score", {"model": "emb", "text_1": "q", "text_2": [words, words]})
    assert two.status_code == 400 and two.json()["error"]["code"] == "kv_request_too_large"


def test_truncated_inputs_count_only_what_vllm_keeps(gateway: str) -> None:
    body = {"model": "emb", "input": [ids(REQUEST_LIMIT_TOKENS + 30)]}
    assert post(gateway, "/v1/embeddings", body).status_code == 400
    cut = post(gateway, "/v1/embeddings", {**body, "truncate_prompt_tokens": 20})
    assert cut.status_code == 200, cut.text
    assert cut.json()["usage"]["prompt_tokens"] == 20


def test_an_input_longer_than_every_pool_is_refused_before_any_worker(gateway: str) -> None:
    r = post(gateway, "/v1/embeddings",
             {"model": "emb", "input": [ids(3), ids(MAX_CONTEXT_TOKENS + 1)]})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"


def test_generation_route_for_a_pooling_model_is_a_clear_400(gateway: str) -> None:
    r = post(gateway, "/v1/chat/completions",
             {"model": "emb", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "unsupported_endpoint" and error["param"] == "model"
    assert "pooling" in error["message"]


def test_pooling_route_for_a_generating_model_is_a_clear_400(gateway: str) -> None:
    for path in ("/v1/embeddings", "/classify", "/pooling"):
        r = post(gateway, path, {"model": "gen", "input": "hello"})
        assert r.status_code == 400, path
        assert r.json()["error"]["code"] == "unsupported_endpoint"
    r = post(gateway, "/rerank", {"model": "gen", "query": "a", "documents": ["b"]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_endpoint"


def test_pooling_routes_require_a_key(gateway: str) -> None:
    for path, body in (("/v1/embeddings", {"input": "x"}), ("/score", {"text_1": "a",
                                                                      "text_2": "b"})):
        r = post(gateway, path, {"model": "emb", **body}, headers={})
        assert r.status_code == 401, path
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("body, param", [
    ({"input": [{"type": "image_url", "image_url": {"url": "x"}}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, -2]]}, "input"),
    ({"input": "x", "truncate_prompt_tokens": -5}, "truncate_prompt_tokens"),
    ({"data": {"image": "x"}}, "data"),
    ({"messages": [{"role": "user", "content": "x"}], "add_special_tokens": "yes"},
     "add_special_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "continue_final_message": True,
      "add_generation_prompt": True}, "continue_final_message"),
])
def test_inputs_the_gateway_cannot_count_are_refused(
        gateway: str, body: dict[str, Any], param: str) -> None:
    r = post(gateway, "/v1/embeddings", {"model": "emb", **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_score_with_media_or_mismatched_sides_is_refused(gateway: str) -> None:
    media = post(gateway, "/score", {"model": "emb", "text_1": "q",
                                     "text_2": [{"content": [{"type": "image_url"}]}]})
    assert media.status_code == 400
    assert media.json()["error"]["code"] == "unsupported_content"
    uneven = post(gateway, "/score", {"model": "emb", "text_1": ["a", "b"],
                                      "text_2": ["c", "d", "e"]})
    assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "text_1"


def test_pooling_requests_are_counted_in_the_metrics(gateway: str) -> None:
    def ok_requests() -> float:
        text = httpx.get(gateway + "/metrics").text
        return promtext.value(text, "kvgate_requests_total", pool="p", code="200") or 0.0
    before = ok_requests()
    assert post(gateway, "/v1/embeddings", {"model": "emb", "input": "hello"}).status_code == 200
    assert ok_requests() == before + 1

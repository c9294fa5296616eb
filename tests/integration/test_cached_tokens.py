"""``usage.prompt_tokens_details.cached_tokens`` through the gateway, on simulated workers.

Worker ``sim-plain`` reports no cached tokens (vLLM without ``--enable-prompt-tokens-details``):
the gateway fills in its routing prediction and labels it ``predicted``. Worker ``sim-details``
reports them: they reach the client as the worker wrote them, labelled ``vllm``. The same claims
against real vLLM are in ``test_cached_tokens_vllm.py``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.config import SimWorkerConfig
from gateway.sim.fleet import SimFleet
from tests.harness import serve_app

PLAIN, DETAILS = "sim-plain", "sim-details"
PROMPT = "Tell me about paged attention, prefix caching and block tables. " * 12


@pytest.fixture(scope="module")
def workers() -> Iterator[dict[str, str]]:
    loop = asyncio.new_event_loop()
    fleet = SimFleet([SimWorkerConfig(model_name=PLAIN, time_scale=0.05),
                      SimWorkerConfig(model_name=DETAILS, time_scale=0.05,
                                      enable_prompt_tokens_details=True)])
    urls = loop.run_until_complete(fleet.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield {PLAIN: urls[0], DETAILS: urls[1]}
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


@pytest.fixture(scope="module")
def gateway(workers: dict[str, str]) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": PLAIN, "tokenizer": "simple"}, {"name": DETAILS, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": 8192, "policy": "kv_aware",
                   "workers": list(workers.values())}],
        "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.2},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        yield url


def predicted_total(gateway: str) -> float:
    text = httpx.get(gateway + "/metrics").text
    return promtext.value(text, "kvgate_predicted_cached_tokens_total", pool="p") or 0.0


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(url + path, json=body, timeout=30)
    assert r.status_code == 200, r.text
    return r


def chat(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 4,
            **extra}


def test_the_prediction_fills_in_where_the_worker_reports_no_cached_tokens(
    gateway: str,
) -> None:
    seen = []
    for _ in range(2):
        before = predicted_total(gateway)
        r = post(gateway, "/v1/chat/completions", chat(PLAIN))
        predicted = predicted_total(gateway) - before
        assert r.headers["x-kvgate-cached-tokens"] == "predicted"
        usage = r.json()["usage"]
        assert usage["prompt_tokens_details"] == {"cached_tokens": predicted}
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert seen[1] > 0  # the repeat: its prefix was routed to that worker before


def test_completions_usage_gets_the_prediction_too(gateway: str) -> None:
    body = {"model": PLAIN, "prompt": PROMPT, "max_tokens": 2}
    post(gateway, "/v1/completions", body)
    before = predicted_total(gateway)
    r = post(gateway, "/v1/completions", body)
    assert r.headers["x-kvgate-cached-tokens"] == "predicted"
    cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == predicted_total(gateway) - before > 0


def test_a_streams_usage_chunk_carries_them_labelled_by_a_comment_the_client_skips(
    gateway: str,
) -> None:
    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
    body = chat(PLAIN)
    post(gateway, "/v1/chat/completions", body)
    chunks = list(client.chat.completions.create(
        model=PLAIN, messages=body["messages"], max_tokens=4, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens is not None
    assert usage.prompt_tokens_details.cached_tokens > 0  # the prompt was routed there before

    with httpx.stream("POST", gateway + "/v1/chat/completions", timeout=30,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}
                      ) as r:
        lines = [line for line in r.iter_lines() if line]
    usage_at = next(i for i, line in enumerate(lines) if '"usage"' in line)
    assert lines[usage_at - 1] == ": x-kvgate-cached-tokens: predicted"
    assert "x-kvgate-cached-tokens" not in r.headers  # unknown when the headers left


def test_a_stream_without_include_usage_still_gets_no_usage(gateway: str) -> None:
    with httpx.stream("POST", gateway + "/v1/chat/completions", timeout=30,
                      json={**chat(PLAIN), "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert not any("usage" in line for line in lines)


def test_the_workers_own_cached_tokens_pass_unchanged(
    gateway: str, workers: dict[str, str]
) -> None:
    post(gateway, "/v1/chat/completions", chat(DETAILS))
    through = post(gateway, "/v1/chat/completions", chat(DETAILS))
    direct = post(workers[DETAILS], "/v1/chat/completions", chat(DETAILS))
    assert through.headers["x-kvgate-cached-tokens"] == "vllm"
    assert through.json()["usage"]["prompt_tokens_details"] == \
        direct.json()["usage"]["prompt_tokens_details"]
    assert direct.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    with httpx.stream("POST", gateway + "/v1/chat/completions", timeout=30,
                      json={**chat(DETAILS), "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line]
    usage_at = next(i for i, line in enumerate(lines) if '"usage"' in line)
    assert lines[usage_at - 1] == ": x-kvgate-cached-tokens: vllm"
    streamed = orjson.loads(lines[usage_at][len("data: "):])["usage"]
    assert streamed["prompt_tokens_details"] == direct.json()["usage"]["prompt_tokens_details"]

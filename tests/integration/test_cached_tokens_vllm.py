"""``cached_tokens`` through the gateway equals real vLLM's, whole and streamed.

On the session's ``vllm_with_details`` server (``--enable-prompt-tokens-details``): the
session's ``vllm_servers`` run without it, as vLLM does by default, because the simulator's
shape test (``test_sim_vllm_shapes.py``) compares a simulated worker at its defaults with them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.vllm import VllmServer
from tests.harness import serve_app

pytestmark = pytest.mark.vllm

PROMPT = "A block table maps a sequence's logical KV blocks to physical ones. " * 10


@pytest.fixture(scope="module")
def gateway(vllm_with_details: VllmServer) -> Iterator[str]:
    server = vllm_with_details
    settings = build_settings({
        "models": [{"name": server.model_name, "tokenizer": str(server.model_dir)}],
        "pools": [{"name": "p", "max_context_tokens": 4096, "policy": "kv_aware",
                   "workers": [server.url]}],
        "health": {"interval_s": 0.5, "timeout_s": 30.0, "scrape_interval_s": 0.5},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        deadline = time.monotonic() + 30
        while httpx.get(url + "/v1/models").json()["data"] == [] and time.monotonic() < deadline:
            time.sleep(0.2)
        yield url


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2,
            "temperature": 0, **extra}


def test_cached_tokens_through_the_gateway_are_vllms(gateway: str) -> None:
    post(gateway, "/v1/chat/completions", chat())
    through = post(gateway, "/v1/chat/completions", chat())
    worker = through.headers["x-kvgate-worker"]
    direct = post(worker, "/v1/chat/completions", chat())  # the same prefix, again a full hit

    assert through.headers["x-kvgate-cached-tokens"] == "vllm"
    # a whole answer goes out with its length (the body as rewritten here), not in chunks
    assert through.headers["content-length"] == str(len(through.content))
    assert "transfer-encoding" not in through.headers
    cached = through.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == direct.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    client = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0)
    chunks = list(client.chat.completions.create(
        model="tiny", messages=chat()["messages"], max_tokens=2, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == cached


def test_a_streams_usage_is_labelled_vllm(gateway: str) -> None:
    post(gateway, "/v1/chat/completions", chat())
    with httpx.stream("POST", gateway + "/v1/chat/completions", timeout=120,
                      json=chat(stream=True, stream_options={"include_usage": True})) as r:
        lines = [line for line in r.iter_lines() if line]
    usage_at = next(i for i, line in enumerate(lines) if '"usage"' in line)
    assert lines[usage_at - 1] == ": x-kvgate-cached-tokens: vllm"
    usage = orjson.loads(lines[usage_at][len("data: "):])["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0


def test_completions_cached_tokens_are_vllms(gateway: str) -> None:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    post(gateway, "/v1/completions", body)
    through = post(gateway, "/v1/completions", body)
    direct = post(through.headers["x-kvgate-worker"], "/v1/completions", body)
    assert through.headers["x-kvgate-cached-tokens"] == "vllm"
    assert through.json()["usage"]["prompt_tokens_details"] == \
        direct.json()["usage"]["prompt_tokens_details"]

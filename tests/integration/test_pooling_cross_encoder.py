"""Score and rerank for a cross-encoder: each (query, document) pair counted as ONE sequence.

The model is a tiny reranker built here with ``transformers``: the tiny Llama's config with
``architectures: ["LlamaForSequenceClassification"]`` and one label, and the tiny Llama's
tokenizer files, in a temporary directory (no download). Its weights are not written: the
gateway reads only the config and the tokenizer, and ``.venv`` has no torch to make them. So no
real vLLM serves it here (the session's vLLM servers run the tiny causal LM and its embedding
variant; a reranker server would be a new start); a simulated pooling worker answers instead,
and the count is proven against the Hugging Face tokenizer's own pair encoding, which is what
vLLM 0.32's ``CrossEncoderIOProcessor`` calls (``tokenizer(text=query, text_pair=document)``).

The tenant's per-request KV limit is the HF count of the request's pairs: the gateway must admit
the request at exactly that count and refuse one token more (a bi-encoder's count, each text
alone, stays under the limit after that token: only the pair count refuses it).
"""

from __future__ import annotations

import asyncio
import hashlib
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoConfig, AutoTokenizer

from gateway.app import create_app
from gateway.config import Runner, build_settings
from gateway.prompt.pooling import ScoreEncoding, score_encoding
from gateway.prompt.tokenizer import HFTokenizer
from gateway.sim import SimFleet, SimWorkerConfig
from tests.harness import serve_app

MODEL = "tiny-rerank"
KEY = "sk-rerank-" + "5" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
KV_BYTES_PER_TOKEN = 1024  # the tiny Llama: 2 x 2 layers x 2 KV heads x 64 dims x 2 bytes
MAX_CONTEXT_TOKENS = 4096
QUERY = "what does the kv cache hold"
DOCUMENTS = ["keys and values of every token", "paged attention blocks", "nothing at all"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def reranker_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-reranker")
    config = AutoConfig.from_pretrained(str(tiny_model_dir), local_files_only=True)
    config.architectures = ["LlamaForSequenceClassification"]
    config.num_labels = 1
    config.save_pretrained(str(out))
    for name in TOKENIZER_FILES:
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def hf(reranker_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(reranker_dir), local_files_only=True)


def pair_tokens(hf: Any, query: str, documents: list[str]) -> int:
    return sum(len(hf(query, text_pair=d)["input_ids"]) for d in documents)


@pytest.fixture(scope="module")
def worker(reranker_dir: Path) -> Iterator[str]:
    """A simulated pooling worker with the reranker's tokenizer, on a loop in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fleet = SimFleet([SimWorkerConfig(model_name=MODEL, runner=Runner.POOLING, time_scale=0.01,
                                      tokenizer=str(reranker_dir),
                                      max_model_len=MAX_CONTEXT_TOKENS)])
    try:
        (url,) = asyncio.run_coroutine_threadsafe(fleet.start(), loop).result(60)
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


@pytest.fixture(scope="module")
def gateway(reranker_dir: Path, worker: str, hf: Any) -> Iterator[str]:
    limit_tokens = pair_tokens(hf, QUERY, DOCUMENTS)
    settings = build_settings({
        "models": [{"name": MODEL, "runner": "pooling", "tokenizer": str(reranker_dir)}],
        "pools": [{"name": "p", "max_context_tokens": MAX_CONTEXT_TOKENS, "workers": [worker]}],
        "auth": {"api_keys": [{"name": "exact",
                               "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
        "budgets": {"defaults": {"request_kv_bytes": limit_tokens * KV_BYTES_PER_TOKEN}},
        "health": {"interval_s": 0.2, "timeout_s": 30.0},
    })
    with serve_app(create_app(settings)) as url:
        deadline = time.monotonic() + 30
        while (not httpx.get(url + "/v1/models", headers=AUTH).json()["data"]
               and time.monotonic() < deadline):
            time.sleep(0.1)
        yield url


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + path, json={"model": MODEL, **body}, headers=AUTH, timeout=60)


def test_the_built_reranker_is_a_cross_encoder_by_vllms_rule(reranker_dir: Path) -> None:
    config = AutoConfig.from_pretrained(str(reranker_dir), local_files_only=True).to_dict()
    assert score_encoding(config) is ScoreEncoding.CROSS_ENCODER


def test_the_gateways_pair_encoding_is_the_hf_tokenizers_own(reranker_dir: Path, hf: Any) -> None:
    ours = HFTokenizer.load(str(reranker_dir), local_files_only=True)
    for document in DOCUMENTS:
        want = hf(QUERY, text_pair=document)["input_ids"]
        assert ours.encode_pair(QUERY, document) == want


@pytest.mark.parametrize("path, sides", [
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ("/score", {"queries": [QUERY] * 3, "documents": DOCUMENTS}),
])
def test_a_request_of_exactly_its_pair_tokens_is_admitted(
        gateway: str, path: str, sides: dict[str, Any]) -> None:
    r = post(gateway, path, sides)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path, sides", [
    ("/rerank", {"query": QUERY, "documents": [*DOCUMENTS[:2], DOCUMENTS[2] + " x"]}),
    ("/v2/rerank", {"query": QUERY + " x", "documents": DOCUMENTS}),
    ("/v1/score", {"text_1": QUERY, "text_2": [DOCUMENTS[0] + " x", *DOCUMENTS[1:]]}),
])
def test_one_token_more_than_the_pairs_is_refused(
        gateway: str, hf: Any, path: str, sides: dict[str, Any]) -> None:
    """One query against N documents: counting each text alone (a bi-encoder, the query once)
    would stay under the limit; only the pairs (the query again with each document) refuse."""
    query: str = sides["query"] if "query" in sides else sides["text_1"]
    documents: list[str] = sides["documents"] if "documents" in sides else sides["text_2"]
    alone = sum(len(hf(t)["input_ids"]) for t in (query, *documents))
    assert alone <= pair_tokens(hf, QUERY, DOCUMENTS)
    r = post(gateway, path, sides)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "kv_request_too_large"


def test_a_truncated_pair_counts_only_what_vllm_keeps(gateway: str, hf: Any) -> None:
    long_document = "tokens of a long document " * 200
    whole = pair_tokens(hf, QUERY, [long_document])
    assert whole > pair_tokens(hf, QUERY, DOCUMENTS)  # too long for the limit uncut
    body = {"query": QUERY, "documents": [long_document]}
    assert post(gateway, "/rerank", body).status_code == 400
    cut = post(gateway, "/rerank", {**body, "truncate_prompt_tokens": 8})
    assert cut.status_code == 200, cut.text

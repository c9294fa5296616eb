"""The gateway in front of two real vLLM servers (tiny local model), driven by the openai client.

Pools: `short` (1024 tokens) on server 0, `long` (4096 tokens, vLLM's max_model_len) on server 1,
and `huge` (8192 tokens) whose only worker is down, for the 503 shape.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from transformers import AutoTokenizer

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.kvgate import GatewayProcess
from gateway.procs.net import free_port, wait_until
from gateway.procs.vllm import VllmServer
from gateway.workers.vllm_metrics import parse_vllm_metrics
from tests.harness import serve_app

pytestmark = pytest.mark.vllm

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly "
    "box jumping frogs near the old river bank "
).split()


def text_of(n_words: int) -> str:
    return " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


@pytest.fixture(scope="module")
def gateway(vllm_servers: list[VllmServer]) -> Iterator[str]:
    short, long = vllm_servers
    settings = build_settings(
        {
            "models": [{"name": short.model_name, "tokenizer": str(short.model_dir)}],
            "pools": [
                {"name": "short", "max_context_tokens": 1024, "workers": [short.url]},
                {"name": "long", "max_context_tokens": 4096, "workers": [long.url]},
                {
                    "name": "huge",
                    "max_context_tokens": 8192,
                    "workers": [f"http://127.0.0.1:{free_port()}"],
                },
            ],
            "routing": {"spill": False, "default_max_tokens": 16},
            "health": {"interval_s": 0.5, "timeout_s": 30.0, "scrape_interval_s": 0.5},
            "limits": {"max_body_bytes": 1024 * 1024},
        }
    )
    with serve_app(create_app(settings)) as url:
        deadline = time.monotonic() + 30
        while httpx.get(url + "/v1/models").json()["data"] == [] and time.monotonic() < deadline:
            time.sleep(0.2)
        yield url


@pytest.fixture(scope="module")
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)


def raw_chat(gateway: str, **body: Any) -> httpx.Response:
    return httpx.post(gateway + "/v1/chat/completions", json={"model": "tiny", **body}, timeout=120)


def test_chat_non_streaming_through_gateway(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello there"}],
        max_tokens=8,
        temperature=0,
    )
    assert r.choices[0].message.role == "assistant"
    assert r.usage is not None and r.usage.completion_tokens == 8


def test_chat_streaming_through_gateway_hides_usage_chunk_unless_asked(
    client: openai.OpenAI,
) -> None:
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks and all(c.choices for c in chunks)
    asked = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "hello"}],
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert asked[-1].usage is not None and asked[-1].usage.completion_tokens == 6


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    done = client.completions.create(
        model="tiny", prompt="once upon a time", max_tokens=5, extra_body={"ignore_eos": True}
    )
    assert done.usage is not None and done.usage.completion_tokens == 5
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="once upon a time",
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    # vLLM's engine merges the tokens of steps its API server has not relayed yet into one
    # chunk, so a loaded machine may see fewer than 5 text chunks: the usage counts the tokens
    text_chunks = [c for c in chunks if c.choices]
    assert text_chunks and text_chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list()] == ["tiny"]


@pytest.mark.parametrize("n_words", [3, 200, 700])
def test_gateway_prompt_token_count_equals_vllm_usage_for_chat(gateway: str, n_words: int) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": text_of(n_words)},
    ]
    r = raw_chat(gateway, messages=messages, max_tokens=1)
    assert r.status_code == 200, r.text
    assert int(r.headers["x-kvgate-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"]


def test_gateway_prompt_token_count_equals_vllm_usage_for_completions(gateway: str) -> None:
    for prompt in ("hi", text_of(300)):
        r = httpx.post(
            gateway + "/v1/completions",
            json={"model": "tiny", "prompt": prompt, "max_tokens": 1},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert int(r.headers["x-kvgate-prompt-tokens"]) == r.json()["usage"]["prompt_tokens"]


def test_vllm_extras_pass_through_unchanged(gateway: str) -> None:
    r = raw_chat(
        gateway,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        top_k=1,
        vllm_xargs={"kv_cache_report_mode": "full"},
        ignore_eos=True,
        chat_template_kwargs={"unused_flag": True},
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_short_prompt_goes_to_short_pool_and_long_prompt_to_long_pool(
    gateway: str,
    vllm_servers: list[VllmServer],
) -> None:
    short = raw_chat(gateway, messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    long = raw_chat(gateway, messages=[{"role": "user", "content": text_of(900)}], max_tokens=2)
    assert short.headers["x-kvgate-pool"] == "short"
    assert short.headers["x-kvgate-worker"] == vllm_servers[0].url
    assert int(long.headers["x-kvgate-prompt-tokens"]) > 1024
    assert long.headers["x-kvgate-pool"] == "long"
    assert long.headers["x-kvgate-worker"] == vllm_servers[1].url


def test_max_tokens_counts_toward_pool_selection(gateway: str) -> None:
    r = raw_chat(gateway, messages=[{"role": "user", "content": "hi"}], max_tokens=2000)
    assert r.headers["x-kvgate-pool"] == "long"


def error_of(r: httpx.Response, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_prompt_too_long_for_every_pool_gets_400_without_touching_a_worker(gateway: str) -> None:
    before = httpx.get(gateway + "/metrics").text
    err = error_of(raw_chat(gateway, messages=[{"role": "user", "content": text_of(9000)}]), 400)
    assert err["code"] == "context_length_exceeded"
    assert httpx.get(gateway + "/metrics").text.count('code="200"') == before.count('code="200"')


def test_pool_without_healthy_worker_gets_503(gateway: str) -> None:
    err = error_of(
        raw_chat(gateway, messages=[{"role": "user", "content": "hi"}], max_tokens=5000), 503
    )
    assert err["code"] == "no_healthy_worker"


def test_unknown_model_gets_404_and_oversized_body_gets_413(gateway: str) -> None:
    assert error_of(
        httpx.post(
            gateway + "/v1/chat/completions",
            json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        ),
        404,
    )["code"] == ("model_not_found")
    big = {"model": "tiny", "prompt": "a " * 600_000}
    assert error_of(httpx.post(gateway + "/v1/completions", json=big), 413)["code"] == (
        "request_too_large"
    )


def test_vllm_error_passes_through_with_its_status(gateway: str) -> None:
    r = raw_chat(gateway, messages=[{"role": "user", "content": "x"}], temperature=-3)
    assert r.status_code == 400
    assert "error" in r.json()


def running(server: VllmServer) -> int:
    return parse_vllm_metrics(httpx.get(server.url + "/metrics").text).running


def generated(server: VllmServer) -> float:
    text = httpx.get(server.url + "/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:generation_tokens_total")
    )


def inflight(gateway: str, server: VllmServer) -> float | None:
    text = httpx.get(gateway + "/metrics").text
    return promtext.value(text, "kvgate_worker_inflight", worker=server.url)


def test_client_disconnect_mid_stream_aborts_the_vllm_request(
    vllm_servers: list[VllmServer],
    tmp_path: Path,
) -> None:
    """The client hangs up while vLLM is generating: the gateway lets the worker go, and vLLM
    aborts the request long before its 4000 tokens are done.

    A raw socket, so the test controls exactly when the connection goes: as soon as the stream's
    headers have arrived (vLLM has taken the request). Each check then waits, with a deadline,
    for a state only the abort reaches. Regression (it passed only when run again): the test polled
    vLLM's running count for 0, which is also what vLLM reports before its first step on the
    request, so the poll could end before anything happened and the checks after it (gateway
    released, no more tokens) raced the abort. The gateway runs as its own process: in the
    test's process it relays the stream under the same GIL the test needs to hang up.
    """
    server = vllm_servers[1]
    config = {
        "models": [{"name": server.model_name, "tokenizer": str(server.model_dir)}],
        "pools": [{"name": "long", "max_context_tokens": 4096, "workers": [server.url]}],
        "health": {"interval_s": 0.5, "timeout_s": 30.0},
    }
    max_tokens = 4000
    body = orjson.dumps(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "count"}],
            "stream": True,
            "max_tokens": max_tokens,
            "ignore_eos": True,
        }
    )
    gw = GatewayProcess(config, tmp_path / "kvgate.yaml", log_path=tmp_path / "gateway.log")
    with gw:
        wait_until(lambda: httpx.get(gw.url + "/v1/models").json()["data"], 30, "model listed")
        generated_before = generated(server)
        with socket.create_connection(("127.0.0.1", gw.port)) as sock:
            sock.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            sock.settimeout(30)
            received = b""
            while b"\r\n\r\n" not in received:
                chunk = sock.recv(65536)
                assert chunk, "the gateway closed the connection"
                received += chunk
            assert b" 200 OK" in received.split(b"\r\n", 1)[0]
            assert b"text/event-stream" in received
        # The gateway releases the worker after it has closed the upstream connection.
        wait_until(lambda: inflight(gw.url, server) == 0, 10, "the gateway releasing the worker")
        # vLLM idle, its generated-token count unchanged over half a second.
        seen = [generated(server)]

        def vllm_idle() -> bool:
            now = generated(server)
            idle = now == seen[-1] and running(server) == 0
            seen.append(now)
            return idle

        wait_until(vllm_idle, 15, "vLLM to stop generating", interval_s=0.5)
    tokens = seen[-1] - generated_before
    assert tokens < max_tokens, "vLLM ran the request to its end: the hang-up did not abort it"


def test_tokenizer_matches_transformers_chat_template(vllm_servers: list[VllmServer]) -> None:
    """The gateway's rule (render, then encode without special tokens) on the tiny model."""
    from gateway.prompt.tokenizer import HFTokenizer

    model_dir = str(vllm_servers[0].model_dir)
    ours = HFTokenizer.load(model_dir)
    messages = [{"role": "user", "content": "hello world"}]
    hf = AutoTokenizer.from_pretrained(model_dir)
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert ours.encode_chat(messages, {}) == hf.encode(text, add_special_tokens=False)

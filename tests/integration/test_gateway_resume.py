"""Mid-stream resume: a worker dies in the middle of a chat stream and the client still gets one
uninterrupted response (routing.resume_streams), or a clean error event when it is off."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.prompt.tokenizer import HFTokenizer
from gateway.sim.config import SimWorkerConfig
from gateway.sim.fleet import SimFleet
from tests.harness import serve_app
from tests.integration.resume_fixtures import DyingProxy


@pytest.fixture(scope="module")
def sim_workers() -> Iterator[list[str]]:
    loop = asyncio.new_event_loop()
    fleet = SimFleet([SimWorkerConfig(model_name="sim", max_model_len=8192, time_scale=0.2)] * 2)
    urls = loop.run_until_complete(fleet.start())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield urls
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def gateway_settings(dying: str, healthy: str, model: str, tokenizer: str, resume: bool) -> Any:
    return build_settings({
        "models": [{"name": model, "tokenizer": tokenizer}],
        # least_loaded: two idle workers tie, and ties rotate from the first, so the first
        # stream goes to the dying worker (round_robin starts at a random worker).
        "pools": [{"name": "chat", "max_context_tokens": 4096, "policy": "least_loaded",
                   "workers": [dying, healthy]}],
        "routing": {"resume_streams": resume},
        "health": {"interval_s": 60},
    })


def stream_chat(gw: str, model: str, **extra: Any) -> list[Any]:
    client = openai.OpenAI(base_url=gw + "/v1", api_key="none", max_retries=0)
    return list(client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Tell me a long story."}],
        max_tokens=40, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, **extra))


def test_stream_continues_on_another_worker_when_its_worker_dies(sim_workers: list[str]) -> None:
    port = int(sim_workers[0].rsplit(":", 1)[1])
    with DyingProxy(port, cut_after_content_events=12).running() as proxy:
        settings = gateway_settings(proxy.url, sim_workers[1], "sim", "simple", resume=True)
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            chunks = stream_chat(gw, "sim")
            metrics = httpx.get(gw + "/metrics").text
    assert proxy.cuts == 1
    assert len({c.id for c in chunks}) == 1  # one response, as far as the client can tell
    roles = [c for c in chunks if c.choices and c.choices[0].delta.role]
    assert len(roles) == 1
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 40
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and
                c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert 'kvgate_resumed_streams_total{pool="chat"} 1.0' in metrics


def test_without_resume_the_broken_stream_ends_with_an_error_event(sim_workers: list[str]) -> None:
    port = int(sim_workers[0].rsplit(":", 1)[1])
    with DyingProxy(port, cut_after_content_events=12).running() as proxy:
        settings = gateway_settings(proxy.url, sim_workers[1], "sim", "simple", resume=False)
        with serve_app(create_app(settings), ready_path="/ready") as gw, \
                pytest.raises(openai.APIError) as info:
            stream_chat(gw, "sim")
    assert "failed mid-stream" in str(info.value)


@pytest.mark.vllm
def test_resumed_stream_on_real_vllm_equals_the_uninterrupted_answer_at_temperature_0(
    vllm_servers: list[Any],
) -> None:
    """Regression (it passed only when run again): the dying proxy cut at the first TCP read that
    held its 4th event; a loaded vLLM writes several events at once, so the cut sometimes fell
    before any content reached the gateway (nothing to resume, nothing delivered). The proxy now
    cuts right after the first event with content, wherever the reads split."""
    a, b = vllm_servers
    # Greedy output is compared across two servers: start both from an empty prefix cache, as
    # when this test runs alone. Blocks other tests left cached change how a prompt's prefill is
    # split, and with it the bf16 rounding, enough to flip a near-tie of this random-weight model.
    for server in (a, b):
        httpx.post(server.url + "/reset_prefix_cache", timeout=30).raise_for_status()
    body = {"model": "tiny", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    reference = httpx.post(b.url + "/v1/chat/completions", json=body, timeout=60).json()
    expected = reference["choices"][0]["message"]["content"]
    # As early as content has been delivered: a loaded vLLM may pack many tokens into one event.
    with DyingProxy(a.port, cut_after_content_events=1).running() as proxy:
        settings = gateway_settings(proxy.url, b.url, "tiny", str(a.model_dir), resume=True)
        with serve_app(create_app(settings), ready_path="/ready") as gw:
            chunks = stream_chat(gw, "tiny", temperature=0)
    assert proxy.cuts == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    delivered = "".join(
        (json.loads(line[6:])["choices"] or [{}])[0].get("delta", {}).get("content") or ""
        for line in proxy.delivered.decode(errors="replace").split("\n")
        if line.startswith("data: {"))
    # One response: what the dead worker delivered, then the other worker's continuation.
    assert delivered and expected.startswith(delivered) and text.startswith(delivered)
    # The other worker added the rest, unless the dead one's first content event already held
    # the whole answer (a loaded vLLM packed all 40 tokens into it before the cut: seen once in
    # CI), when there is nothing left to continue.
    assert len(text) > len(delivered) or delivered == expected
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
    # At temperature 0 the continuation is the same answer whenever the partial answer
    # re-tokenizes to the tokens the model produced; this random-weight model often emits byte
    # fragments that do not (the README and the resume module say so), so equality is checked
    # only when it does.
    tok = HFTokenizer.load(str(a.model_dir))
    if tok.decode(tok.encode_text(delivered, add_special_tokens=False)) == delivered and (
            "\ufffd" not in delivered):
        assert text == expected

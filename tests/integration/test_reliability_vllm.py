"""Retry on connection failure against real vLLM (issue 7).

The shared ``vllm_servers`` must stay up for other tests, so nothing here kills them: the pool
pairs a real vLLM server with a worker that passed its health check and then went away (its port
now refuses connections, and checks are too far apart to notice). Every request the policy sends
to the dead worker must be retried on the real server before any byte reaches the client, for
plain and streamed completions alike.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from starlette.types import Receive, Scope, Send

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.net import free_port
from gateway.procs.vllm import VllmServer
from tests.harness import answer_probe, serve_app

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(300)]


async def health_only(scope: Scope, receive: Receive, send: Send) -> None:
    """Passes health checks; no /v1/models (so the gateway assumes it serves every model)."""
    if scope["type"] != "http":
        return
    await answer_probe(scope, send)


def retries(gw: str) -> float:
    return promtext.value(httpx.get(gw + "/metrics").text, "kvgate_upstream_retries_total",
                          pool="p") or 0.0


def test_connection_refused_is_retried_on_a_real_vllm_server(
    vllm_servers: list[VllmServer],
) -> None:
    server = vllm_servers[0]
    with serve_app(health_only, port=free_port()) as doomed:
        settings = build_settings({
            "models": [{"name": server.model_name, "tokenizer": str(server.model_dir)}],
            # least_loaded: the two idle workers tie and ties rotate from the first, so plain
            # and streamed requests both meet the dead worker first within a few rounds
            # (round_robin starts at a random worker: half the starts never sent it a plain one).
            "pools": [{"name": "p", "max_context_tokens": 4096, "policy": "least_loaded",
                       "workers": [doomed, server.url]}],
            "health": {"interval_s": 60, "unhealthy_threshold": 100},
        })
        gw_ctx = serve_app(create_app(settings), ready_path="/ready")
        gw = gw_ctx.__enter__()
    # `doomed` is gone; the gateway still believes it healthy.
    try:
        client = openai.OpenAI(base_url=gw + "/v1", api_key="x", max_retries=0, timeout=120)
        messages: list[openai.types.chat.ChatCompletionMessageParam] = [
            {"role": "user", "content": "Count to five."}]
        retried = {"plain": 0, "stream": 0}
        for _ in range(3):
            before = retries(gw)
            raw = client.chat.completions.with_raw_response.create(
                model=server.model_name, messages=messages, max_tokens=4, temperature=0)
            done = raw.parse()
            assert raw.headers["x-kvgate-worker"] == server.url
            assert done.usage is not None and done.usage.completion_tokens == 4
            retried["plain"] += int(retries(gw) - before)

            before = retries(gw)
            with client.chat.completions.with_streaming_response.create(
                model=server.model_name, messages=messages, max_tokens=4, temperature=0,
                stream=True, stream_options={"include_usage": True},
            ) as resp:
                assert resp.headers["x-kvgate-worker"] == server.url
                chunks = list(resp.parse())
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
            retried["stream"] += int(retries(gw) - before)
            if all(retried.values()):
                break
        assert all(retried.values()), f"the dead worker was never tried first: {retried}"
        text = httpx.get(gw + "/metrics").text
        assert promtext.value(text, "kvgate_worker_inflight", worker=server.url) == 0.0
        assert promtext.value(text, "kvgate_worker_inflight", worker=doomed) == 0.0
    finally:
        gw_ctx.__exit__(None, None, None)

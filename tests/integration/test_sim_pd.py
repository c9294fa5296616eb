"""Prefill/decode disaggregation between simulated workers: vLLM's two-step protocol by hand.

One fleet in this process: a producer (``kv_producer``), consumers (``kv_consumer``) with vLLM's
two ``kv_load_failure_policy`` values, a producer with a short lease, and a worker without a
connector. Each test runs what a router does with httpx: the prefill request
(``do_remote_decode``, ``max_tokens`` 1, not streamed), then the decode request with the
``kv_transfer_params`` the prefill answered.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson
import pytest
import pytest_asyncio

from gateway import promtext
from gateway.sim import SimFleet, SimWorkerConfig
from gateway.sim.costmodel import LinearCostModel
from gateway.sim.kvtransfer import PULL_PATH
from tests.harness import eventually

pytestmark = pytest.mark.asyncio(loop_scope="module")

MODEL = "sim-pd"
BLOCK = 16
PROMPT_WORDS = 500
PREFILL_S_PER_TOKEN = 1e-3  # a 500-token prompt computes in ~0.5 s
BYTES_PER_S = 0.5e9  # its KV (llama-3-8b: 128 KiB/token) moves in ~0.13 s
KV_BYTES_PER_TOKEN = 131072
REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                 "remote_block_ids": None, "remote_host": None, "remote_port": None}
BASE = SimWorkerConfig(model_name=MODEL, block_size_tokens=BLOCK, num_gpu_blocks=512,
                       kv_transfer_bytes_per_s=BYTES_PER_S, enable_prompt_tokens_details=True)
PRODUCER, CONSUMER, RECOMPUTE, SHORT_LEASE, PLAIN = range(5)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def fleet() -> AsyncIterator[SimFleet]:
    configs = [
        dataclasses.replace(BASE, kv_role="kv_producer", kv_engine_id="engine-p"),
        dataclasses.replace(BASE, kv_role="kv_consumer"),
        dataclasses.replace(BASE, kv_role="kv_consumer", kv_load_failure_policy="recompute"),
        dataclasses.replace(BASE, kv_role="kv_producer", kv_lease_duration_s=0.3),
        BASE,
    ]
    cost = LinearCostModel(prefill_s_per_token=PREFILL_S_PER_TOKEN, decode_base_s=0.005)
    fleet = SimFleet(configs, cost_models=[cost] * len(configs))
    await fleet.start()
    yield fleet
    await fleet.stop()


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as c:
        yield c


def chat(topic: str, **extra: Any) -> dict[str, Any]:
    words = " ".join(f"{topic}{i % 7}" for i in range(PROMPT_WORDS))
    return {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 8,
            **extra}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """What a router sends the prefill worker (the protocol's step 1)."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    return out | {"kv_transfer_params": dict(REMOTE_DECODE), "stream": False, "max_tokens": 1,
                  "n": 1}


async def prefill(client: httpx.AsyncClient, url: str, path: str,
                  body: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post(url + path, json=prefill_body(body))
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


async def ttft_of_stream(client: httpx.AsyncClient, url: str,
                         body: dict[str, Any]) -> tuple[float, list[Any]]:
    """Client-side seconds to the first content chunk, and every ``data:`` payload."""
    t0 = time.monotonic()
    first: float | None = None
    out: list[Any] = []
    async with client.stream("POST", url + "/v1/chat/completions",
                             json=body | {"stream": True}) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            payload = data if data == "[DONE]" else orjson.loads(data)
            out.append(payload)
            if first is None and isinstance(payload, dict) and any(
                    c.get("delta", {}).get("content") for c in payload.get("choices", [])):
                first = time.monotonic() - t0
    assert first is not None
    return first, out


def usage(fleet: SimFleet, worker: int) -> float:
    return fleet.workers[worker].scheduler.kv.pool.usage


async def metric(client: httpx.AsyncClient, url: str, name: str) -> float | None:
    return promtext.value((await client.get(url + "/metrics")).text, name)


async def test_prefill_answer_holds_the_blocks_and_says_where_they_are_in_vllm_keys(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    answer = await prefill(client, fleet.urls[PRODUCER], "/v1/chat/completions", chat("hold"))
    params = answer["kv_transfer_params"]
    port = int(fleet.urls[PRODUCER].rsplit(":", 1)[1])
    prompt_tokens = answer["usage"]["prompt_tokens"]
    assert answer["usage"]["completion_tokens"] == 1
    assert list(params) == [
        "do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
        "remote_request_id", "remote_host", "remote_port", "tp_size", "dcp_size", "pp_size",
        "remote_num_tokens", "remote_blocks_expiry_time", "transfer_mode",
        "remote_prefill_cached_tokens",
    ]  # fmt: skip
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    assert (params["remote_engine_id"], params["remote_host"], params["remote_port"]) == (
        "engine-p", "127.0.0.1", port)
    assert params["tp_size"] == 1 and params["transfer_mode"] == "pull"
    assert params["remote_num_tokens"] == prompt_tokens
    [block_ids] = params["remote_block_ids"]
    assert len(block_ids) == -(-prompt_tokens // BLOCK)
    producer = fleet.workers[PRODUCER]
    assert producer.scheduler.held_block_ids(params["remote_request_id"]) == block_ids
    assert usage(fleet, PRODUCER) * (producer.num_gpu_blocks - 1) == len(block_ids)
    # nobody pulls it in this test: free it the way a decode would
    pull = {"remote_engine_id": "engine-p", "remote_request_id": params["remote_request_id"],
            "remote_block_ids": block_ids}
    assert (await client.post(fleet.urls[PRODUCER] + PULL_PATH, json=pull)).status_code == 200
    assert usage(fleet, PRODUCER) == 0.0


async def test_decode_pulls_the_prompt_kv_and_answers_what_a_local_prefill_would(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    body = chat("answer")
    params = (await prefill(client, fleet.urls[PRODUCER], "/v1/chat/completions",
                            body))["kv_transfer_params"]
    assert usage(fleet, PRODUCER) > 0
    resp = await client.post(fleet.urls[CONSUMER] + "/v1/chat/completions",
                             json=body | {"kv_transfer_params": params})
    assert resp.status_code == 200, resp.text
    decoded = resp.json()
    assert decoded["kv_transfer_params"] is None  # vLLM's decode side answers none
    assert decoded["choices"][0]["finish_reason"] == "length"
    assert decoded["usage"]["completion_tokens"] == 8
    # the producer's hit is reported, not the decode's transfer (vLLM's output processor)
    assert decoded["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert usage(fleet, PRODUCER) == 0.0  # pulled: the producer's blocks are free
    # the same request computed locally on the same worker: the same tokens
    local = (await client.post(fleet.urls[CONSUMER] + "/v1/chat/completions", json=body)).json()
    assert decoded["choices"][0]["message"]["content"] == local["choices"][0]["message"]["content"]
    assert decoded["usage"]["prompt_tokens"] == local["usage"]["prompt_tokens"]


async def test_decode_ttft_is_the_transfer_not_the_prompt_compute(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = fleet.urls[CONSUMER]
    bytes0 = await metric(client, url, "vllm:nixl_bytes_transferred_sum") or 0.0
    hits0 = await metric(client, url, "vllm:external_prefix_cache_hits_total") or 0.0
    computed0 = fleet.workers[CONSUMER].engine.num_steps
    body = chat("ttft")
    answer = await prefill(client, fleet.urls[PRODUCER], "/v1/chat/completions", body)
    prompt_tokens = answer["usage"]["prompt_tokens"]
    num_blocks = -(-prompt_tokens // BLOCK)
    transfer_s = num_blocks * BLOCK * KV_BYTES_PER_TOKEN / BYTES_PER_S
    prefill_s = prompt_tokens * PREFILL_S_PER_TOKEN
    assert transfer_s < prefill_s / 2
    ttft, chunks = await ttft_of_stream(client, url,
                                        body | {"kv_transfer_params": answer["kv_transfer_params"]})
    assert chunks[-1] == "[DONE]"
    # transfer + a one-token prefill step + HTTP; a local prefill would take prefill_s
    assert transfer_s <= ttft < transfer_s + 0.15 < prefill_s
    assert await metric(client, url, "vllm:nixl_bytes_transferred_sum") == (
        bytes0 + num_blocks * BLOCK * KV_BYTES_PER_TOKEN)
    # every prompt token came from the producer; one prefill step of one token, then decodes
    assert await metric(client, url, "vllm:external_prefix_cache_hits_total") == (
        hits0 + prompt_tokens)
    assert fleet.workers[CONSUMER].engine.num_steps - computed0 == 8
    assert usage(fleet, PRODUCER) == 0.0


async def test_decode_of_completions_works_the_same(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    body = {"model": MODEL, "prompt": "completion " * 200, "max_tokens": 5}
    params = (await prefill(client, fleet.urls[PRODUCER], "/v1/completions",
                            body))["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    resp = await client.post(fleet.urls[CONSUMER] + "/v1/completions",
                             json=body | {"kv_transfer_params": params})
    assert resp.status_code == 200
    assert resp.json()["usage"]["completion_tokens"] == 5
    assert usage(fleet, PRODUCER) == 0.0


async def test_a_second_pull_of_the_same_blocks_is_404(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    params = (await prefill(client, fleet.urls[PRODUCER], "/v1/chat/completions",
                            chat("twice")))["kv_transfer_params"]
    pull = {"remote_engine_id": params["remote_engine_id"],
            "remote_request_id": params["remote_request_id"],
            "remote_block_ids": params["remote_block_ids"]}
    first = await client.post(fleet.urls[PRODUCER] + PULL_PATH, json=pull)
    second = await client.post(fleet.urls[PRODUCER] + PULL_PATH, json=pull)
    assert first.status_code == 200
    assert second.status_code == 404
    assert second.json()["error"]["type"] == "NotFoundError"


async def test_decode_with_pulled_params_fails_with_500_under_vllms_default_policy(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = fleet.urls[CONSUMER]
    failed0 = await metric(client, url, "vllm:nixl_num_failed_transfers_total") or 0.0
    body = chat("stale")
    params = (await prefill(client, fleet.urls[PRODUCER], "/v1/chat/completions",
                            body))["kv_transfer_params"]
    ok = await client.post(url + "/v1/chat/completions", json=body | {"kv_transfer_params": params})
    assert ok.status_code == 200
    again = await client.post(url + "/v1/chat/completions",
                              json=body | {"kv_transfer_params": params})
    assert again.status_code == 500
    assert again.json() == {"error": {"message": "Internal server error",
                                      "type": "InternalServerError", "param": None, "code": 500}}
    _, chunks = await sse_error(client, url, body | {"kv_transfer_params": params})
    assert chunks == [{"error": {"message": "Internal server error",
                                 "type": "InternalServerError", "param": None, "code": 500}},
                      "[DONE]"]
    assert await metric(client, url, "vllm:nixl_num_failed_transfers_total") == failed0 + 2


async def sse_error(client: httpx.AsyncClient, url: str,
                    body: dict[str, Any]) -> tuple[int, list[Any]]:
    out: list[Any] = []
    async with client.stream("POST", url + "/v1/chat/completions",
                             json=body | {"stream": True}) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                out.append(data if data == "[DONE]" else orjson.loads(data))
        return resp.status_code, out


@pytest.mark.parametrize("broken", [
    {"remote_host": None},
    {"remote_port": "x"},
    {"remote_block_ids": []},
    {"remote_engine_id": "no-such-engine"},
    {"remote_request_id": "chatcmpl-unknown"},
])  # fmt: skip
async def test_decode_with_bogus_params_fails_the_load(
    fleet: SimFleet, client: httpx.AsyncClient, broken: dict[str, Any]
) -> None:
    port = int(fleet.urls[PRODUCER].rsplit(":", 1)[1])
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]],
              "remote_engine_id": "engine-p", "remote_request_id": "chatcmpl-x",
              "remote_host": "127.0.0.1", "remote_port": port, "tp_size": 1} | broken
    resp = await client.post(fleet.urls[CONSUMER] + "/v1/chat/completions",
                             json=chat("bogus", max_tokens=2) | {"kv_transfer_params": params})
    assert resp.status_code == 500
    assert resp.json()["error"]["type"] == "InternalServerError"


async def test_failed_load_recomputes_the_prompt_under_the_recompute_policy(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    body = chat("recompute")
    params = {"do_remote_prefill": True, "do_remote_decode": False,
              "remote_block_ids": [[1, 2, 3]], "remote_engine_id": "engine-p",
              "remote_request_id": "chatcmpl-expired", "remote_host": "127.0.0.1",
              "remote_port": int(fleet.urls[PRODUCER].rsplit(":", 1)[1]), "tp_size": 1}
    ttft, chunks = await ttft_of_stream(client, fleet.urls[RECOMPUTE],
                                        body | {"kv_transfer_params": params})
    assert chunks[-1] == "[DONE]"
    assert ttft >= PROMPT_WORDS * PREFILL_S_PER_TOKEN  # the whole prompt computed locally


async def test_unpulled_blocks_are_freed_when_the_lease_expires(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = fleet.urls[SHORT_LEASE]
    expired0 = await metric(client, url, "vllm:nixl_num_kv_expired_reqs_total") or 0.0
    body = chat("expire")
    # streamed prefill is allowed (vLLM holds the blocks; the stream carries no params)
    async with client.stream("POST", url + "/v1/chat/completions",
                             json=prefill_body(body) | {"stream": True}) as resp:
        text = (await resp.aread()).decode()
    assert resp.status_code == 200 and "kv_transfer_params" not in text
    assert usage(fleet, SHORT_LEASE) > 0
    await eventually(lambda: usage(fleet, SHORT_LEASE) == 0.0)  # the 0.3 s lease, then a sweep
    assert await metric(client, url, "vllm:nixl_num_kv_expired_reqs_total") == expired0 + 1


async def test_worker_without_a_connector_ignores_kv_transfer_params(
    fleet: SimFleet, client: httpx.AsyncClient
) -> None:
    url = fleet.urls[PLAIN]
    answer = await prefill(client, url, "/v1/chat/completions", chat("plain"))
    assert answer["kv_transfer_params"] is None
    assert usage(fleet, PLAIN) == 0.0  # nothing held
    bogus = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}
    resp = await client.post(url + "/v1/chat/completions",
                             json=chat("plain") | {"kv_transfer_params": bogus})
    assert resp.status_code == 200
    assert (await client.post(url + PULL_PATH, json={})).status_code == 404
    assert "vllm:nixl" not in (await client.get(url + "/metrics")).text

"""The Responses API through the gateway, on two simulated workers (``gateway.sim.responses``).

A simulated worker keeps its stored responses in its own memory and answers 404 to an id it did
not make, as vLLM does: a chain of responses works only when each turn reaches the worker that
made the previous one. The gateway sends it there (the reason is ``owner``) whatever the pool's
policy (round robin here, which would alternate); another tenant's id is unknown to it (404),
and a conversation's earlier turns count toward the pool limit. The same proofs against real
vLLM are in ``test_responses_vllm.py``.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.kvgate import GatewayProcess
from gateway.procs.process import ProcessSet
from tests.harness import serve_app
from tests.integration.sim_workers import Workers, up, wait_for

pytestmark = pytest.mark.timeout(120)

MODEL = "sim"
KEYS = {"acme": "acme-key", "mallory": "mallory-key"}
POOL_TOKENS = 1024


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    w = Workers()
    try:
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def gateway(workers: Workers) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": POOL_TOKENS, "policy": "round_robin",
                   "workers": workers.urls}],
        "auth": {"api_keys": [{"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest()}
                              for name, key in KEYS.items()]},
        "routing": {"default_max_tokens": 8},
        "health": {"interval_s": 0.1, "timeout_s": 30.0, "unhealthy_threshold": 1,
                   "healthy_threshold": 1, "breaker_open_s": 0.2, "scrape_interval_s": 0.2},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
        yield url


def client(gateway: str, tenant: str = "acme") -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway + "/v1", api_key=KEYS[tenant], max_retries=0)


def create(base: str, tenant: str | None = "acme", **body: Any) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    return httpx.post(base + "/v1/responses", headers=headers, timeout=30,
                      json={"model": MODEL, "max_output_tokens": 4, "ignore_eos": True, **body})


def assert_error(r: httpx.Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if code is not None:
        assert error["code"] == code
    return dict(error)


def test_a_chain_of_three_responses_always_lands_on_the_worker_that_stored_the_previous(
    gateway: str,
) -> None:
    """Round robin alternates the workers; each continuation still reaches the owner."""
    for chain in range(4):
        previous: str | None = None
        owner = ""
        for turn in range(3):
            raw = client(gateway).responses.with_raw_response.create(
                model=MODEL, input=f"chain {chain} turn {turn}: tell me about paged attention",
                max_output_tokens=4, previous_response_id=previous,
                extra_body={"ignore_eos": True})
            r = raw.parse()
            assert r.status == "incomplete" and r.output_text  # cut at max_output_tokens
            if previous is not None:
                assert raw.headers["x-kvgate-route-reason"] == "owner"
                assert raw.headers["x-kvgate-worker"] == owner
            owner, previous = raw.headers["x-kvgate-worker"], r.id


def test_without_owner_routing_a_chain_fails_about_half_the_time(workers: Workers) -> None:
    """The same chains sent straight to a worker picked at random (what a gateway without the
    owner map does): a continuation reaching the other worker gets its 404."""
    pick = random.Random(13)
    failures = 0
    for chain in range(8):
        previous = None
        for turn in range(3):
            worker = pick.choice(workers.urls)
            r = httpx.post(worker + "/v1/responses", timeout=30, json={
                "model": MODEL, "input": f"chain {chain} turn {turn}", "max_output_tokens": 4,
                "previous_response_id": previous})
            if r.status_code == 404:
                assert r.json()["error"]["message"] == (
                    f"Response with id '{previous}' not found.")
                failures += 1
                break
            assert r.status_code == 200, r.text
            previous = r.json()["id"]
    assert 2 <= failures <= 7


def test_a_streamed_chain_lands_on_the_owner_and_the_stream_is_relayed_whole(
    gateway: str,
) -> None:
    previous = None
    for turn in range(3):
        with client(gateway).responses.with_streaming_response.create(
                model=MODEL, input=f"streamed turn {turn}", max_output_tokens=4, stream=True,
                previous_response_id=previous, extra_body={"ignore_eos": True}) as raw:
            if previous is not None:
                assert raw.headers["x-kvgate-route-reason"] == "owner"
            events = [orjson.loads(line[6:]) for line in raw.iter_lines()
                      if line.startswith("data: ")]
        kinds = [e["type"] for e in events]
        assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
        assert kinds.count("response.output_text.delta") >= 1
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        completed = events[-1]["response"]
        assert completed["usage"]["output_tokens"] == 4
        previous = completed["id"]


def test_another_tenants_response_id_is_unknown_for_create_retrieve_and_cancel(
    gateway: str,
) -> None:
    """Mallory holds acme's id (a leaked log line): the gateway answers as vLLM does for an id
    that does not exist, and no worker is asked."""
    mine = create(gateway, input="a secret conversation").json()["id"]
    for r in (create(gateway, "mallory", input="what did they say?", previous_response_id=mine),
              httpx.get(f"{gateway}/v1/responses/{mine}", timeout=10,
                        headers={"authorization": f"Bearer {KEYS['mallory']}"}),
              httpx.post(f"{gateway}/v1/responses/{mine}/cancel", timeout=10,
                         headers={"authorization": f"Bearer {KEYS['mallory']}"})):
        error = assert_error(r, 404, "response_not_found")
        assert error["message"] == f"Response with id '{mine}' not found."
        assert "x-kvgate-worker" not in r.headers
    assert create(gateway, input="again", previous_response_id=mine).status_code == 200


def test_retrieve_and_cancel_go_to_the_owner(gateway: str) -> None:
    made = create(gateway, input="keep this one").json()
    headers = {"authorization": f"Bearer {KEYS['acme']}"}
    got = httpx.get(f"{gateway}/v1/responses/{made['id']}", headers=headers, timeout=10)
    assert got.status_code == 200 and got.json() == made
    cancel = httpx.post(f"{gateway}/v1/responses/{made['id']}/cancel", headers=headers,
                        timeout=10)
    assert cancel.status_code == 400  # the owner's answer: a finished response runs no more
    assert cancel.json()["error"]["message"] == "Cannot cancel a synchronous response."
    assert_error(httpx.get(f"{gateway}/v1/responses/resp_{'0' * 32}", headers=headers,
                           timeout=10), 404, "response_not_found")
    assert_error(httpx.get(f"{gateway}/v1/responses/{made['id']}", timeout=10), 401)


def test_unknown_ids_and_unstored_responses_answer_404(gateway: str) -> None:
    assert_error(create(gateway, input="x", previous_response_id="resp_nope"), 404,
                 "response_not_found")
    assert_error(create(gateway, input="x", previous_response_id="r" * 300), 400)
    unstored = create(gateway, input="forget me", store=False).json()["id"]
    assert_error(create(gateway, input="x", previous_response_id=unstored), 404,
                 "response_not_found")


def test_client_chosen_ids_are_refused_before_any_worker(gateway: str) -> None:
    """``request_id``: it names the stored response, so it could overwrite another tenant's
    (background mode is served: ``test_responses_background.py``)."""
    victim = create(gateway, input="mine").json()["id"]
    r = create(gateway, "mallory", input="overwrite", request_id=victim)
    assert assert_error(r, 400, "unsupported_parameter")["param"] == "request_id"
    got = httpx.get(f"{gateway}/v1/responses/{victim}", timeout=10,
                    headers={"authorization": f"Bearer {KEYS['acme']}"})
    assert got.json()["output"][0]["content"][0]["text"]  # acme's own answer, untouched


def prompt_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    return int(r.headers["x-kvgate-prompt-tokens"])


def test_a_continuation_is_counted_with_the_conversation_the_worker_holds(gateway: str) -> None:
    """vLLM prefills the stored turns again under the new one: the gateway counts the
    previous response's total (its prompt and its output) plus this turn's input."""
    first = create(gateway, input="tell me about prefix caching")
    alone = prompt_tokens(create(gateway, input="and then?"))
    second = create(gateway, input="and then?", previous_response_id=first.json()["id"])
    assert prompt_tokens(second) == first.json()["usage"]["total_tokens"] + alone


def test_a_tiny_turn_of_a_long_conversation_is_refused_when_the_whole_exceeds_the_pool(
    gateway: str,
) -> None:
    """Without the stored turns counted, this continuation would be routed as a few tokens."""
    empty = prompt_tokens(create(gateway, input=""))
    per_word = prompt_tokens(create(gateway, input="word " * 10)) - empty  # for ten words
    words = 10 * (POOL_TOKENS - 4 - empty) // per_word - 10  # the most that fit, less a little
    first = create(gateway, input="word " * words, max_output_tokens=4)
    assert prompt_tokens(first) + 4 <= POOL_TOKENS
    alone = prompt_tokens(create(gateway, input="and?"))
    assert alone + 4 <= POOL_TOKENS < first.json()["usage"]["total_tokens"] + alone + 4
    r = create(gateway, input="and?", previous_response_id=first.json()["id"])
    assert_error(r, 400, "context_length_exceeded")


def test_the_processes_of_one_gateway_share_the_owners(workers: Workers, tmp_path: Path) -> None:
    """``kvgate serve --processes 2``: each turn comes on a fresh connection, so either process
    may take it; the owners live in the runtime directory's file, not in one process."""
    config = {"models": [{"name": MODEL, "tokenizer": "simple"}],
              "pools": [{"name": "p", "max_context_tokens": POOL_TOKENS,
                         "policy": "round_robin", "workers": workers.urls}],
              "health": {"interval_s": 0.1, "timeout_s": 30.0, "scrape_interval_s": 0.2}}
    with ProcessSet(tmp_path / "logs") as procs:
        gw = procs.start("gateway", GatewayProcess(config, tmp_path / "kvgate.yaml",
                                                   processes=2), timeout_s=60)
        for chain in range(4):
            previous = None
            for turn in range(3):
                r = create(gw.url, None, input=f"chain {chain} turn {turn}",
                           previous_response_id=previous)
                assert r.status_code == 200, r.text
                previous = r.json()["id"]


def test_the_owners_worker_down_is_a_503_then_served_again(gateway: str,
                                                         workers: Workers) -> None:
    made = create(gateway, input="before the outage")
    owner, rid = made.headers["x-kvgate-worker"], made.json()["id"]
    workers.stop(owner)
    try:
        wait_for(lambda: not up(gateway, owner), "the owner marked down")
        r = create(gateway, input="during", previous_response_id=rid)
        error = assert_error(r, 503, "response_owner_unavailable")
        assert owner in error["message"] and r.headers["retry-after"] == "2"
    finally:
        workers.start(owner)
    wait_for(lambda: up(gateway, owner), "the owner back")
    # a restarted worker has lost its stored responses, as vLLM does: its own 404 is relayed
    r = create(gateway, input="after", previous_response_id=rid)
    assert r.status_code == 404 and r.headers["x-kvgate-worker"] == owner


@pytest.mark.parametrize("stream", [False, True])
def test_the_owner_is_recorded_before_the_client_sees_the_response_id(
    workers: Workers, stream: bool,
) -> None:
    """Regression: the owner was recorded when the request finished, after its last bytes went
    out, so a client continuing at once through another replica (or process) got a 404 from a
    gateway that had not heard of the id yet (CI: two gateways on one Redis)."""
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": POOL_TOKENS, "policy": "round_robin",
                   "workers": workers.urls}],
        "routing": {"default_max_tokens": 8},
        "health": {"interval_s": 0.1, "timeout_s": 30.0, "healthy_threshold": 1},
    })
    app = create_app(settings)
    seen: list[bool] = []

    async def watching(scope: Any, receive: Any, send: Any) -> None:
        async def sending(message: Any) -> None:
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and b'"resp_' in body and not seen:
                rid = orjson.loads(body.split(b"data: ", 1)[-1].split(b"\n", 1)[0]
                                   if stream else body)
                rid = rid.get("response", rid)["id"]
                seen.append(await app.api.state.services.owners.get("anonymous", rid)
                            is not None)
            await send(message)
        await app(scope, receive, sending)

    with serve_app(watching, ready_path="/ready") as url:
        wait_for(lambda: all(up(url, w) for w in workers.urls), "both workers up")
        r = httpx.post(url + "/v1/responses", timeout=30, json={
            "model": MODEL, "input": "hello", "max_output_tokens": 4, "stream": stream})
    assert r.status_code == 200, r.text
    assert seen == [True]

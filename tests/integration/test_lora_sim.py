"""Models, aliases and LoRA adapters through the gateway, on two simulated workers (issue 14).

The simulated workers serve adapters as vLLM does (``/v1/models`` cards with ``parent``,
``/v1/load_lora_adapter`` with runtime updating on, 404 for an adapter not loaded). The gateway
routes an adapter's requests only to the workers holding it, loads a configured cold adapter
once (on one worker, however many requests ask at once), keeps at most
``max_loaded_per_worker`` of a model's adapters per worker, and refuses clearly when it cannot.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim.config import SimWorkerConfig
from tests.harness import serve_app
from tests.integration.sim_workers import MODEL, Workers, wait_for

pytestmark = pytest.mark.timeout(120)

WARM = "warm"  # loaded on the first worker by the test, not in the gateway's config
COLD = [f"cold-{i}" for i in range(6)]  # configured: the gateway may load these
MAX_LOADED = 2


@pytest.fixture(scope="module")
def workers() -> Iterator[Workers]:
    w = Workers(SimWorkerConfig(model_name=MODEL, time_scale=0.25,
                                allow_runtime_lora_updating=True,
                                enable_prompt_tokens_details=True))
    try:
        r = httpx.post(w.urls[0] + "/v1/load_lora_adapter",
                       json={"lora_name": WARM, "lora_path": "/adapters/warm"})
        assert r.status_code == 200, r.text
        yield w
    finally:
        w.close()


@pytest.fixture(scope="module")
def gateway(workers: Workers) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple",
                    "adapters": [{"name": n, "path": f"/adapters/{n}"} for n in COLD],
                    "max_loaded_per_worker": MAX_LOADED}],
        "model_aliases": {"gpt-4o-mini": MODEL, "sql": COLD[0]},
        "pools": [{"name": "p", "max_context_tokens": 65536, "policy": "kv_aware",
                   "workers": workers.urls}],
        # Generous: on a loaded machine a slow check must not mark a worker down (its
        # adapters would vanish from the gateway's view mid-test).
        "health": {"interval_s": 0.1, "timeout_s": 30.0, "healthy_threshold": 1,
                   "unhealthy_threshold": 5, "breaker_open_s": 0.2, "scrape_interval_s": 0.2},
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        wait_for(lambda: WARM in listed(url), "the gateway to see the warm adapter")
        yield url


def listed(url: str) -> dict[str, Any]:
    """The model cards of a gateway or a worker, by id."""
    return {c["id"]: c for c in httpx.get(url + "/v1/models", timeout=10).json()["data"]}


def ask(gateway: str, model: str, content: str = "hello there", **extra: Any) -> httpx.Response:
    return httpx.post(gateway + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 2,
        **extra})


def adapters_on(workers: Workers) -> dict[str, set[str]]:
    return {u: {i for i, c in listed(u).items() if c.get("parent") == MODEL}
            for u in workers.urls}


def test_an_alias_is_served_as_its_model_and_answered_with_the_served_name(
        gateway: str) -> None:
    r = ask(gateway, "gpt-4o-mini")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == MODEL  # as OpenAI answers its aliases: the model that served


def test_models_lists_models_loaded_adapters_and_aliases(gateway: str) -> None:
    cards = listed(gateway)
    assert cards[MODEL]["parent"] is None
    assert cards[WARM]["parent"] == MODEL
    assert cards["gpt-4o-mini"]["root"] == MODEL
    assert "nonexistent" not in cards


def test_requests_for_an_adapter_land_on_the_worker_holding_it(
        gateway: str, workers: Workers) -> None:
    for i in range(6):
        r = ask(gateway, WARM, f"question {i} for the warm adapter")
        assert r.status_code == 200, r.text
        assert r.headers["x-kvgate-worker"] == workers.urls[0]
        assert r.json()["model"] == WARM


def test_an_unknown_adapter_is_404_model_not_found_and_loads_nothing(
        gateway: str, workers: Workers) -> None:
    before = adapters_on(workers)
    r = ask(gateway, "no-such-adapter")
    assert r.status_code == 404
    assert r.json()["error"]["code"] == "model_not_found"
    assert adapters_on(workers) == before


def test_a_cold_adapter_is_loaded_once_on_one_worker_under_concurrent_requests(
        gateway: str, workers: Workers) -> None:
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: ask(gateway, COLD[1], f"cold question {i}"),
                                range(8)))
    assert all(r.status_code == 200 for r in answers), [r.text for r in answers]
    holders = [u for u, names in adapters_on(workers).items() if COLD[1] in names]
    assert len(holders) == 1
    assert {r.headers["x-kvgate-worker"] for r in answers} == set(holders)


def test_an_alias_of_a_cold_adapter_loads_and_serves_it(gateway: str,
                                                        workers: Workers) -> None:
    r = ask(gateway, "sql")
    assert r.status_code == 200, r.text
    assert r.json()["model"] == COLD[0]
    assert any(COLD[0] in names for names in adapters_on(workers).values())


def test_a_flood_of_cold_adapters_never_exceeds_the_per_worker_bound(
        gateway: str, workers: Workers) -> None:
    with ThreadPoolExecutor(12) as pool:
        answers = list(pool.map(lambda i: ask(gateway, COLD[i % len(COLD)], f"flood {i}"),
                                range(24)))
    for r in answers:
        assert r.status_code in (200, 503), r.text
        if r.status_code == 503:
            assert r.json()["error"]["code"] == "adapter_slots_busy"
    assert any(r.status_code == 200 for r in answers)
    for url, names in adapters_on(workers).items():
        assert len(names) <= MAX_LOADED, (url, names)


def test_a_cold_adapter_is_refused_503_when_every_slot_has_requests_in_flight(
        gateway: str, workers: Workers) -> None:
    # Occupy every evictable slot with a stream far longer than the test (a shorter one was
    # wholly relayed into the socket buffers, so finished for the gateway, and its adapter
    # rightly unloaded); the warm adapter (not in the config) is
    # never unloaded, so worker 0 has one evictable slot and worker 1 two.
    on = adapters_on(workers)
    busy = sorted(on[workers.urls[0]] - {WARM}) + sorted(on[workers.urls[1]])
    assert len(busy) == 3, on
    client = httpx.Client(timeout=60)
    streams = []
    readers: list[Iterator[str]] = []
    try:
        for name in busy:
            stream = client.stream("POST", gateway + "/v1/chat/completions", json={
                "model": name, "messages": [{"role": "user", "content": "a long story"}],
                "max_tokens": 60000, "ignore_eos": True, "stream": True})
            response = stream.__enter__()
            streams.append(stream)
            assert response.status_code == 200, (name, response.read())
            lines = response.iter_lines()
            next(lines)  # the first chunk: it is in flight
            readers.append(lines)  # kept: a dropped line iterator closes the response
        idle = next(n for n in COLD if all(n not in names for names in on.values()))
        r = ask(gateway, idle)
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "adapter_slots_busy"
        assert "max_loaded_per_worker" in r.json()["error"]["message"]
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
        client.close()


def test_the_simulator_keeps_prefix_cache_hits_per_adapter(workers: Workers) -> None:
    """Worker 0 directly: the same prompt cached for the warm adapter is no hit for the base
    model (vLLM's block hashes include the adapter), and is one for the adapter again."""
    url = workers.urls[0] + "/v1/completions"
    prompt = list(range(100, 100 + 16 * 8))

    def cached(model: str) -> int:
        r = httpx.post(url, timeout=30, json={"model": model, "prompt": prompt, "max_tokens": 1})
        assert r.status_code == 200, r.text
        return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])

    assert cached(WARM) == 0
    assert cached(MODEL) == 0
    assert cached(WARM) > 0


def test_the_simulator_refuses_an_adapter_it_has_not_loaded_as_vllm(workers: Workers) -> None:
    r = httpx.post(workers.urls[1] + "/v1/chat/completions", timeout=10, json={
        "model": WARM, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "NotFoundError"
    again = httpx.post(workers.urls[0] + "/v1/load_lora_adapter",
                       json={"lora_name": WARM, "lora_path": "/adapters/warm"})
    assert again.status_code == 400 and "already been loaded" in again.text
    gone = httpx.post(workers.urls[1] + "/v1/unload_lora_adapter", json={"lora_name": "x"})
    assert gone.status_code == 404


def test_tokenize_takes_aliases_and_adapters_with_the_base_models_tokenizer(
        gateway: str) -> None:
    def tokens(model: str) -> list[int]:
        r = httpx.post(gateway + "/tokenize", timeout=10,
                       json={"model": model, "prompt": "the same words"})
        assert r.status_code == 200, r.text
        return list(r.json()["tokens"])

    assert tokens(WARM) == tokens("gpt-4o-mini") == tokens(MODEL)
    assert httpx.post(gateway + "/tokenize", timeout=10, json={
        "model": "no-such-adapter", "prompt": "x"}).status_code == 404

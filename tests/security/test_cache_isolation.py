"""A key's prefix cache of its own (``auth.api_keys[].isolate_prefix_cache``), tried as a hostile
client would.

vLLM shares cached blocks between every request with the same tokens, so one tenant can time
another's prompts (a hit answers its first token sooner) unless their requests carry different
``cache_salt``s. For a key marked isolated the gateway writes a salt derived from the key into
every request; these tests send the same prompts under several keys to one simulated worker
(vLLM's prefix caching, KV events, ``cached_tokens`` in the usage) and check what vLLM's cache
served and what the gateway's index predicted: between shared keys the cache is shared (so the
tests can fail), an isolated key hits only its own prompts, and no salt a client sends, its own
or one computed for another key, gets it into another key's cache.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.request import tenant_cache_salt
from tests.harness import explained, kv_event_batches
from tests.integration.sim_workers import (
    Workers,
    gateway_of_one,
    one_event_worker,
    wait_for,
    words,
)
from tests.integration.test_gateway_budgets import assert_openai_error

pytestmark = pytest.mark.timeout(120)

KEYS = {"iso-a": "sk-iso-a-1b2c3d", "iso-b": "sk-iso-b-4e5f6a", "shared-c": "sk-shared-c-7b8c9d",
        "shared-d": "sk-shared-d-0e1f2a"}
ISOLATED = {"iso-a", "iso-b"}
ADMIN = "admin-token-cache-isolation"
BLOCK = 16


@pytest.fixture(scope="module")
def worker() -> Iterator[Workers]:
    with one_event_worker() as w:
        yield w


@pytest.fixture(scope="module")
def gateway(worker: Workers) -> Iterator[str]:
    keys = [{"name": name, "sha256": hashlib.sha256(key.encode()).hexdigest(),
             "isolate_prefix_cache": name in ISOLATED} for name, key in KEYS.items()]
    with gateway_of_one(worker, 4096,
                        lambda gw, n: call(gw, "shared-c", f"warm {n} " + words(900 + n, 20)),
                        auth={"api_keys": keys}, admin={"token": ADMIN}) as gw:
        yield gw


def call(gateway: str, key: str, prompt: str, **fields: Any) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/completions", timeout=30,
                      headers={"Authorization": f"Bearer {KEYS[key]}"},
                      json={"model": "sim", "prompt": prompt, "max_tokens": 1, **fields})


def cached(gateway: str, worker: str, key: str, prompt: str, **fields: Any) -> int:
    """The tokens vLLM's cache served for the prompt (checked against what the gateway's index
    predicted); after a miss, once the blocks it stored are in the index (a hit may store none:
    its new tail can be shorter than a block)."""
    before = kv_event_batches(gateway).get(worker, 0)
    r = call(gateway, key, prompt, **fields)
    assert r.status_code == 200, r.text
    delivered = int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    e = explained(gateway, r.headers["x-request-id"], ADMIN)
    assert abs(e["predicted_cached_tokens"] - delivered) <= BLOCK, (key, fields, e)
    if delivered == 0:
        wait_for(lambda: kv_event_batches(gateway).get(worker, 0) > before, "its events", 30)
    return delivered


def test_an_isolated_key_hits_its_own_prompts_only(gateway: str, worker: Workers) -> None:
    (url,) = worker.urls
    doc = words(1, 100)  # ~200 tokens
    assert cached(gateway, url, "shared-c", doc + " q1") == 0
    assert cached(gateway, url, "shared-d", doc + " q2") >= 192  # shared keys share
    assert cached(gateway, url, "iso-a", doc + " q3") == 0  # not the shared keys' blocks
    assert cached(gateway, url, "iso-a", doc + " q4") >= 192  # its own
    assert cached(gateway, url, "iso-b", doc + " q5") == 0  # not iso-a's
    assert cached(gateway, url, "shared-c", doc + " q6") >= 192  # the shared copy is still there
    # iso-a's client salts partition its own cache further, still never reaching another key's
    assert cached(gateway, url, "iso-a", doc + " q7", cache_salt="mine") == 0
    assert cached(gateway, url, "iso-a", doc + " q8", cache_salt="mine") >= 192
    assert cached(gateway, url, "iso-b", doc + " q9", cache_salt="mine") == 0


def test_no_client_salt_reaches_another_keys_cache(gateway: str, worker: Workers) -> None:
    (url,) = worker.urls
    doc = words(2, 100)
    assert cached(gateway, url, "iso-a", doc + " q1") == 0
    assert cached(gateway, url, "iso-a", doc + " q2") >= 192
    # The salt iso-a's requests carry, sent by iso-b: iso-b's is derived from it again.
    forged = tenant_cache_salt("iso-a", None)
    assert cached(gateway, url, "iso-b", doc + " q3", cache_salt=forged) == 0
    # By a shared key, which would send it verbatim: refused, nothing reserved or routed.
    r = call(gateway, "shared-c", doc + " q4", cache_salt=forged)
    assert_openai_error(r, 400, "reserved_cache_salt")
    assert r.json()["error"]["param"] == "cache_salt"
    # A shared key's own salts work as vLLM's do: shared with whoever sends the same one.
    assert cached(gateway, url, "shared-c", doc + " q5", cache_salt="team") == 0
    assert cached(gateway, url, "shared-d", doc + " q6", cache_salt="team") >= 192


def test_an_isolated_keys_salt_reaches_chat_and_responses_too(
    gateway: str, worker: Workers,
) -> None:
    """vLLM takes ``cache_salt`` on chat and the Responses API as on completions; a body that
    names it as null gets the derived one too."""
    (url,) = worker.urls
    doc = words(3, 100)

    def chat(key: str, question: str, **fields: Any) -> int:
        before = kv_event_batches(gateway).get(url, 0)
        r = httpx.post(f"{gateway}/v1/chat/completions", timeout=30,
                       headers={"Authorization": f"Bearer {KEYS[key]}"},
                       json={"model": "sim", "max_tokens": 1, **fields,
                             "messages": [{"role": "system", "content": doc},
                                          {"role": "user", "content": question}]})
        assert r.status_code == 200, r.text
        delivered = int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        if delivered == 0:
            wait_for(lambda: kv_event_batches(gateway).get(url, 0) > before, "its events", 30)
        return delivered
    assert chat("shared-c", "q1") == 0
    assert chat("iso-a", "q2", cache_salt=None) == 0
    assert chat("iso-a", "q3") >= 192
    r = httpx.post(f"{gateway}/v1/responses", timeout=30,
                   headers={"Authorization": f"Bearer {KEYS['iso-a']}"},
                   json={"model": "sim", "input": doc, "max_output_tokens": 4, "store": False})
    assert r.status_code == 200, r.text

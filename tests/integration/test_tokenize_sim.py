"""``/tokenize`` of the gateway and of the simulated worker agree, for the simple tokenizer.

The simulator stands in for vLLM where no model files exist (the demo, most integration tests);
its ``/tokenize`` must answer as the gateway does (which ``test_tokenize_vllm.py`` proves equal
to real vLLM with a real tokenizer), token strings and chat ``add_special_tokens`` included.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.sim import SimFleet, SimWorkerConfig
from tests.harness import serve_app

MODEL = "sim"
MAX_MODEL_LEN = 2048

BODIES: list[dict[str, Any]] = [
    {"prompt": "once upon a time, in a cache"},
    {"prompt": "no specials", "add_special_tokens": False},
    {"prompt": "strings too, ünïcode", "return_token_strs": True},
    {"prompt": "", "return_token_strs": True},
    {"messages": [{"role": "user", "content": "hello there"}]},
    {"messages": [{"role": "user", "content": "hello there"}], "add_special_tokens": True},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": "hi"}],
     "add_generation_prompt": False, "add_special_tokens": True, "return_token_strs": True},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}],
     "continue_final_message": True, "add_generation_prompt": False},
]


@pytest.fixture(scope="module")
def worker() -> Iterator[str]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    fleet = SimFleet([SimWorkerConfig(model_name=MODEL, time_scale=0.01,
                                      max_model_len=MAX_MODEL_LEN)])
    try:
        (url,) = asyncio.run_coroutine_threadsafe(fleet.start(), loop).result(60)
        yield url
    finally:
        asyncio.run_coroutine_threadsafe(fleet.stop(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)
        loop.close()


@pytest.fixture(scope="module")
def gateway(worker: str) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": MODEL, "tokenizer": "simple"}],
        "pools": [{"name": "p", "max_context_tokens": MAX_MODEL_LEN, "workers": [worker]}],
        "health": {"interval_s": 60},
    })
    with serve_app(create_app(settings)) as url:
        yield url


@pytest.mark.parametrize("body", BODIES)
def test_the_gateways_tokenize_equals_the_simulators(gateway: str, worker: str,
                                                     body: dict[str, Any]) -> None:
    want = httpx.post(worker + "/tokenize", json={"model": MODEL, **body}, timeout=30)
    got = httpx.post(gateway + "/tokenize", json={"model": MODEL, **body}, timeout=30)
    assert want.status_code == 200, want.text
    assert got.status_code == 200, got.text
    assert got.json() == want.json()
    answer = got.json()
    assert (answer["token_strs"] is None) != bool(body.get("return_token_strs"))

"""``/tokenize`` and ``/detokenize`` of the gateway equal real vLLM's, for the tiny chat model.

The gateway answers from its own copy of the tokenizer and chat template (no worker is asked);
the session's ``vllm_servers`` answer the same bodies. The pooling model's answers are compared
in ``test_pooling_vllm.py``, next to its server.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.vllm import VllmServer
from tests.harness import serve_app
from tests.integration.conftest import MAX_MODEL_LEN_TOKENS

pytestmark = pytest.mark.vllm

BODIES: list[dict[str, Any]] = [
    {"prompt": "once upon a time, in a cache"},
    {"prompt": "no special tokens here", "add_special_tokens": False},
    {"prompt": "<|im_start|>user\nliteral specials<|im_end|>"},
    {"prompt": ""},
    {"messages": [{"role": "user", "content": "hello there"}]},
    {"messages": [{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "two"},
                                               {"type": "text", "text": "parts"}]}],
     "add_generation_prompt": False},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}],
     "add_generation_prompt": False, "continue_final_message": True},
    {"messages": [{"role": "user", "content": "hi"}],
     "chat_template_kwargs": {"enable_thinking": False}},
    {"prompt": "once upon a time, in a cache", "return_token_strs": True},
    {"prompt": "<|im_start|>user\nliteral specials<|im_end|> ünïcode 🙂", "return_token_strs": True},
    {"prompt": "bare", "add_special_tokens": False, "return_token_strs": True},
    {"prompt": "asked not to", "return_token_strs": False},
    {"messages": [{"role": "user", "content": "hello there"}], "return_token_strs": True},
    {"messages": [{"role": "user", "content": "hello there"}], "add_special_tokens": True},
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "he"}],
     "add_generation_prompt": False, "continue_final_message": True,
     "add_special_tokens": True, "return_token_strs": True},
    {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False},
]


@pytest.fixture(scope="module")
def gateway(vllm_servers: list[VllmServer]) -> Iterator[str]:
    server = vllm_servers[0]
    settings = build_settings({
        "models": [{"name": server.model_name, "tokenizer": str(server.model_dir)}],
        "pools": [{"name": "p", "max_context_tokens": MAX_MODEL_LEN_TOKENS,
                   "workers": [server.url]}],
        "health": {"interval_s": 60},
    })
    with serve_app(create_app(settings)) as url:
        yield url


@pytest.mark.parametrize("body", BODIES)
def test_tokenize_equals_vllms(gateway: str, vllm_servers: list[VllmServer],
                               body: dict[str, Any]) -> None:
    server = vllm_servers[0]
    want = httpx.post(server.url + "/tokenize", json={"model": server.model_name, **body},
                      timeout=60)
    got = httpx.post(gateway + "/tokenize", json={"model": server.model_name, **body},
                     timeout=60)
    assert want.status_code == 200, want.text
    assert got.status_code == 200, got.text
    assert got.json() == want.json()


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True,
     "add_generation_prompt": True},
    {"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'mine' }}"},
    {"prompt": 5},
])
def test_tokenize_refuses_what_vllm_refuses(gateway: str, vllm_servers: list[VllmServer],
                                           body: dict[str, Any]) -> None:
    server = vllm_servers[0]
    want = httpx.post(server.url + "/tokenize", json={"model": server.model_name, **body},
                      timeout=60)
    got = httpx.post(gateway + "/tokenize", json={"model": server.model_name, **body},
                     timeout=60)
    assert want.status_code == 400, want.text
    assert got.status_code == 400, got.text
    assert set(got.json()["error"]) == {"message", "type", "param", "code"}


def test_detokenize_equals_vllms(gateway: str, vllm_servers: list[VllmServer]) -> None:
    server = vllm_servers[0]
    tokens: list[int] = httpx.post(
        server.url + "/tokenize", json={"messages": [{"role": "user", "content": "round trip"}]},
        timeout=60).json()["tokens"]
    empty: list[int] = []
    for ids in (tokens, tokens[1:4], empty):
        body = {"model": server.model_name, "tokens": ids}
        want = httpx.post(server.url + "/detokenize", json=body, timeout=60)
        got = httpx.post(gateway + "/detokenize", json=body, timeout=60)
        assert got.status_code == want.status_code == 200
        assert got.json() == want.json()

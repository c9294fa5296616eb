"""``/tokenize`` and ``/detokenize`` answered by the gateway itself, with no worker up.

The gateway has the tiny model's tokenizer and one pool whose only worker is down: every answer
here comes from the gateway (``test_tokenize_vllm.py`` compares them with vLLM's own). Keys are
required, bodies are bounded, and a large body is tokenized off the event loop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from transformers import AutoTokenizer

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.net import free_port
from tests.harness import serve_app

KEY = "sk-tok-" + "3" * 24
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY_BYTES = 256 * 1024
MAX_CONTEXT_TOKENS = 4096


@pytest.fixture(scope="module")
def gateway(tiny_model_dir: Path) -> Iterator[str]:
    settings = build_settings({
        "models": [{"name": "tiny", "tokenizer": str(tiny_model_dir)}],
        "pools": [{"name": "p", "max_context_tokens": MAX_CONTEXT_TOKENS,
                   "workers": [f"http://127.0.0.1:{free_port()}"]}],
        "auth": {"api_keys": [{"name": "tok",
                               "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
        "limits": {"max_body_bytes": MAX_BODY_BYTES},
        "health": {"interval_s": 60},
    })
    with serve_app(create_app(settings)) as url:
        yield url


@pytest.fixture(scope="module")
def hf(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def post(url: str, path: str, body: Any, headers: dict[str, str] = AUTH) -> httpx.Response:
    return httpx.post(url + path, json=body, headers=headers, timeout=30)


def test_tokenize_prompt_answers_the_tokenizers_ids_in_vllms_shape(gateway: str, hf: Any) -> None:
    r = post(gateway, "/tokenize", {"model": "tiny", "prompt": "hello there, world"})
    assert r.status_code == 200, r.text
    want = hf("hello there, world")["input_ids"]
    assert r.json() == {"count": len(want), "max_model_len": MAX_CONTEXT_TOKENS,
                        "tokens": want, "token_strs": None}
    bare = post(gateway, "/tokenize", {"prompt": "hello", "add_special_tokens": False}).json()
    assert bare["tokens"] == hf("hello", add_special_tokens=False)["input_ids"]


def test_tokenize_messages_renders_the_servers_template(gateway: str, hf: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for generation in (True, False):
        r = post(gateway, "/tokenize", {"model": "tiny", "messages": messages,
                                        "add_generation_prompt": generation})
        text = hf.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        assert r.json()["tokens"] == hf(text, add_special_tokens=False)["input_ids"]


def test_token_strs_are_the_tokenizers_vocabulary_entries(gateway: str, hf: Any) -> None:
    for body in ({"prompt": "hello there, world"},
                 {"messages": [{"role": "user", "content": "hi there"}]}):
        r = post(gateway, "/tokenize", {"model": "tiny", **body, "return_token_strs": True})
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["token_strs"] == hf.convert_ids_to_tokens(answer["tokens"])
        assert len(answer["token_strs"]) == answer["count"] > 0
        unasked = post(gateway, "/tokenize", {"model": "tiny", **body,
                                              "return_token_strs": False}).json()
        assert unasked["token_strs"] is None and unasked["tokens"] == answer["tokens"]


def test_chat_with_add_special_tokens_encodes_the_rendered_text_with_them(
        gateway: str, hf: Any) -> None:
    messages = [{"role": "user", "content": "hi"}]
    r = post(gateway, "/tokenize", {"model": "tiny", "messages": messages,
                                    "add_special_tokens": True})
    assert r.status_code == 200, r.text
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    with_specials = hf(text, add_special_tokens=True)["input_ids"]
    assert with_specials != hf(text, add_special_tokens=False)["input_ids"]
    assert r.json()["tokens"] == with_specials


def test_detokenize_round_trips(gateway: str, hf: Any) -> None:
    tokens = hf("a round trip")["input_ids"]
    r = post(gateway, "/detokenize", {"model": "tiny", "tokens": tokens})
    assert r.status_code == 200 and r.json() == {"prompt": hf.decode(tokens)}


def test_tokenize_and_detokenize_require_a_key(gateway: str) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [1]})):
        r = post(gateway, path, body, headers={})
        assert r.status_code == 401, path
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_a_large_prompt_is_tokenized_and_an_oversized_body_refused(gateway: str, hf: Any) -> None:
    # ~44 KB: off the loop, and within the floor (4,096 tokens x 13 characters) past which
    # a text is refused unencoded (tests/security/test_surface.py)
    text = "the quick brown fox jumps over the lazy dog " * 1000
    r = post(gateway, "/tokenize", {"model": "tiny", "prompt": text})
    assert r.status_code == 200 and r.json()["count"] == len(hf(text)["input_ids"])
    too_big = post(gateway, "/tokenize", {"model": "tiny", "prompt": "x" * MAX_BODY_BYTES})
    assert too_big.status_code == 413
    assert too_big.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {"model": "ghost", "prompt": "x"}, 404, "model"),
    ("/tokenize", {"model": "tiny"}, 400, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": 5}, 400, "prompt"),
    ("/tokenize", {"model": "tiny", "prompt": "x", "return_token_strs": "yes"}, 400,
     "return_token_strs"),
    ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                   "add_special_tokens": 1}, 400, "add_special_tokens"),
    ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                   "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    ("/tokenize", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                   "chat_template": "{{ 'pwned' }}"}, 400, "chat_template"),
    ("/tokenize", {"model": "tiny", "messages": [{"content": "x"}]}, 400, "messages.0"),
    ("/tokenize", [1, 2], 400, None),
    ("/detokenize", {"model": "tiny", "tokens": [1, -1]}, 400, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": [True]}, 400, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": [2**40]}, 400, "tokens"),
    ("/detokenize", {"model": "tiny", "tokens": "1 2"}, 400, "tokens"),
])
def test_bad_tokenize_requests_get_openai_shaped_errors(
        gateway: str, path: str, body: Any, status: int, param: str | None) -> None:
    r = post(gateway, path, body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param

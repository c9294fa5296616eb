"""Accounting on what vLLM will really do (issue 12, item 2), tried as a hostile client would.

Each way a request could hold more KV cache than the gateway reserved for it gets a test that
asserts the budget held: the KV the gateway held for the request (the most its session held in
flight, polled from the admin API while the request runs) covers every token the worker
generated for it (the usage it reports), and nothing is held once the request is over. They run
on the memory and the Redis budget stores.

The worker is the simulator, which answers as vLLM 0.32 does for output limits
(``gateway.sim.api``), started with vLLM's own rule for a chat request without a limit (the rest
of the context: ``--default-max-tokens 0``); every body sets ``ignore_eos`` so each sequence runs
to its limit. Before the fix a chat request without ``max_tokens`` reserved
``default_max_tokens`` and generated up to the rest of the context, completions trusted
``max_completion_tokens`` (which vLLM ignores there) and assumed 1,024 tokens where vLLM's
default is 16, and image parts were dropped from the count.

How messages are counted is checked against vLLM itself: its own request model, message parser
and template call (run in vLLM's interpreter, no server) render a set of message forms with a
template that shows every field vLLM passes, and the gateway must produce the same token ids.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.app import create_app
from gateway.config import build_settings
from gateway.procs.kvgate import SIM_MODEL, SimProcess
from gateway.procs.vllm import build_tiny_model, vllm_script
from gateway.prompt.render import UncountableContentError, prompt_token_ids, vllm_conversation
from gateway.prompt.tokenizer import HFTokenizer
from gateway.request import Endpoint, parse_body
from tests.harness import serve_app

pytest_plugins = ["tests.integration.redis_fixture"]
pytestmark = pytest.mark.timeout(120)

KV_BYTES_PER_TOKEN = 131072  # llama-3-8b: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes
CONTEXT_TOKENS = 4096  # the simulated worker's max_model_len and the pool's context
DEFAULT_MAX_TOKENS = 48  # routing.default_max_tokens
KEY = "sk-accounting-0123456789abcdef"
ADMIN_TOKEN = "admin-accounting-token"
AUTH = {"Authorization": f"Bearer {KEY}"}
TENANT = "acct"
CHAT_MESSAGES = [{"role": "user", "content": "Tell me about paged attention. " * 4}]


# -- the simulated worker and a gateway in front of it, per budget store ----------------------


@pytest.fixture(scope="module")
def sim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimProcess]:
    # ~20 ms per decode step: even a one-token request is in flight for a few polls.
    proc = SimProcess(time_scale=4.0, log_path=tmp_path_factory.mktemp("sim") / "sim.log",
                      extra_args=["--max-model-len", str(CONTEXT_TOKENS),
                                  "--default-max-tokens", "0"])
    proc.start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module", params=["memory", "redis"])
def gw(request: pytest.FixtureRequest, sim: SimProcess) -> Iterator[str]:
    budgets: dict[str, Any] = {"defaults": {"request_kv_bytes": "4GiB"}}
    if request.param == "redis":
        url = request.getfixturevalue("redis_server")
        budgets |= {"store": "redis", "redis_url": url,
                    "redis_key_prefix": f"acct-{uuid.uuid4().hex[:8]}"}
    settings = build_settings({
        "models": [{"name": SIM_MODEL, "tokenizer": "simple", "architecture": "llama-3-8b"}],
        "pools": [{"name": "p", "max_context_tokens": CONTEXT_TOKENS, "workers": [sim.url]}],
        "routing": {"default_max_tokens": DEFAULT_MAX_TOKENS},
        "health": {"interval_s": 0.2, "timeout_s": 30.0, "scrape_interval_s": 0.5},
        "auth": {"api_keys": [{"name": TENANT, "sha256": hashlib.sha256(KEY.encode()).hexdigest()}]},
        "admin": {"token": ADMIN_TOKEN},
        "budgets": budgets,
    })
    with serve_app(create_app(settings), ready_path="/ready") as url:
        yield url


def held_kv_bytes(gw: str, session: str, client: httpx.Client | None = None) -> int:
    """What the session holds now, by the admin API (0 when it holds nothing)."""
    r = (client or httpx).get(f"{gw}/admin/tenants/{TENANT}/sessions/{session}",
                              headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10)
    if r.status_code == 404:
        return 0
    assert r.status_code == 200, r.text
    view = r.json()
    assert view["inflight_requests"] in (0, 1), view
    held: int = view["inflight_kv_bytes"]
    return held


def stream(gw: str, path: str, body: dict[str, Any]) -> tuple[int, int, dict[str, Any]]:
    """Stream ``body`` (with usage asked for) as a fresh session: the most KV its session held
    while it ran, the prompt tokens the gateway counted, and vLLM's usage. After it, the session
    must hold nothing (``assert_nothing_held``)."""
    session = f"acct-{uuid.uuid4().hex[:10]}"
    full = {"model": SIM_MODEL, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **body}
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        with httpx.Client() as client:
            while not done.is_set():
                peak[0] = max(peak[0], held_kv_bytes(gw, session, client))

    watcher = threading.Thread(target=watch)
    watcher.start()
    usage: dict[str, Any] | None = None
    try:
        with httpx.stream("POST", gw + path, json=full, timeout=60,
                          headers={**AUTH, "X-Session-ID": session}) as r:
            assert r.status_code == 200, r.read()
            prompt_tokens = int(r.headers["x-kvgate-prompt-tokens"])
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    usage = orjson.loads(line[6:]).get("usage") or usage
    finally:
        done.set()
        watcher.join()
    assert usage is not None, "no usage chunk"
    assert_nothing_held(gw, session)
    return peak[0], prompt_tokens, usage


def assert_nothing_held(gw: str, session: str) -> None:
    for _ in range(250):
        if held_kv_bytes(gw, session) == 0:
            return
        httpx.get(gw + "/health", timeout=5)  # a short pause that also proves the gateway serves
    raise AssertionError(f"session {session} still holds KV after its request ended")


def assert_budget_held(held_bytes: int, usage: dict[str, Any]) -> None:
    """The KV reserved covers every token vLLM held: the prompt(s) and all generated tokens."""
    assert held_bytes >= usage["total_tokens"] * KV_BYTES_PER_TOKEN, (held_bytes, usage)


# -- output limits --------------------------------------------------------------------------


def test_chat_without_max_tokens_generates_no_more_than_was_reserved(gw: str) -> None:
    """Regression: 37 tokens reserved (prompt + default_max_tokens assumed), 8,171 generated:
    the body went upstream without a limit and vLLM ran to the end of the context."""
    held, prompt, usage = stream(gw, "/v1/chat/completions", {"messages": CHAT_MESSAGES})

    assert held == (prompt + DEFAULT_MAX_TOKENS) * KV_BYTES_PER_TOKEN
    assert usage["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert_budget_held(held, usage)


def test_chat_with_null_limits_is_held_to_the_reserved_limit(gw: str) -> None:
    body = {"messages": CHAT_MESSAGES, "max_tokens": None, "max_completion_tokens": None}

    held, _, usage = stream(gw, "/v1/chat/completions", body)

    assert usage["completion_tokens"] == DEFAULT_MAX_TOKENS
    assert_budget_held(held, usage)


def test_completions_max_completion_tokens_does_not_shrink_the_reservation(gw: str) -> None:
    """Regression: completions trusted ``max_completion_tokens`` (reserve 1), which vLLM
    ignores there, and generated ``max_tokens`` (7,000)."""
    body = {"prompt": [7] * 20, "max_completion_tokens": 1, "max_tokens": 70}

    held, prompt, usage = stream(gw, "/v1/completions", body)

    assert prompt == 20
    assert usage["completion_tokens"] == 70
    assert_budget_held(held, usage)


def test_completions_without_max_tokens_reserve_vllms_default_of_16(gw: str) -> None:
    """Regression: 1,024 tokens were reserved (``default_max_tokens``) where vLLM generates 16."""
    held, prompt, usage = stream(gw, "/v1/completions", {"prompt": [7] * 20})

    assert usage["completion_tokens"] == 16
    assert held == (prompt + 16) * KV_BYTES_PER_TOKEN
    assert_budget_held(held, usage)


def test_n_choices_and_best_of_hold_every_sequence(gw: str) -> None:
    """``n`` sequences each generate up to the limit; ``best_of`` is no field in vLLM 0.32 and
    adds nothing."""
    body = {"messages": CHAT_MESSAGES, "n": 3, "best_of": 6, "max_tokens": 10}

    held, prompt, usage = stream(gw, "/v1/chat/completions", body)

    assert usage["completion_tokens"] == 30
    assert held == (prompt + 3 * 10) * KV_BYTES_PER_TOKEN
    assert_budget_held(held, usage)


def test_token_id_prompt_batch_holds_each_prompt_and_every_choice(gw: str) -> None:
    body = {"prompt": [[5] * 30, [6] * 12], "n": 2, "max_tokens": 8}

    held, _, usage = stream(gw, "/v1/completions", body)

    assert usage["prompt_tokens"] == 42
    assert usage["completion_tokens"] == 2 * 2 * 8
    assert held == (42 + 2 * 2 * 8) * KV_BYTES_PER_TOKEN
    assert_budget_held(held, usage)


def test_echo_without_generation_is_held_for_its_one_token(gw: str) -> None:
    unseen = [100 + uuid.uuid4().int % 30000] * 1500  # a long, uncached prefill: in flight
    held, _, usage = stream(gw, "/v1/completions",
                            {"prompt": unseen, "max_tokens": 0, "echo": True})

    assert usage["completion_tokens"] == 1
    assert_budget_held(held, usage)


def test_stream_cut_short_leaves_nothing_held(gw: str) -> None:
    session = f"acct-{uuid.uuid4().hex[:10]}"
    body = {"model": SIM_MODEL, "messages": CHAT_MESSAGES, "stream": True, "ignore_eos": True,
            "max_tokens": 2000}
    with httpx.stream("POST", gw + "/v1/chat/completions", json=body, timeout=30,
                      headers={**AUTH, "X-Session-ID": session}) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        assert held_kv_bytes(gw, session) > 0
    assert_nothing_held(gw, session)


# -- content the gateway cannot count -----------------------------------------------------------

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}


@pytest.mark.parametrize(
    ("content", "param"),
    [
        pytest.param([{"type": "text", "text": "what is this?"}, IMAGE], "messages.0.content.1",
                     id="image_url"),
        pytest.param([{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
                     "messages.0.content.0", id="input_audio"),
        pytest.param(["see", {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}],
                     "messages.0.content.1", id="video_url"),
        pytest.param([{"type": "file", "file": {"file_data": "AAAA"}}], "messages.0.content.0",
                     id="file"),
        pytest.param([{"type": "image_embeds", "image_embeds": "AAAA"}], "messages.0.content.0",
                     id="image_embeds"),
        pytest.param([{"type": "text", "text": "cached image", "uuid": "img-1"}],
                     "messages.0.content.0", id="part-with-uuid"),
        pytest.param([{"image_url": {"url": "http://x/i.png"}}], "messages.0.content.0",
                     id="part-without-type"),
        pytest.param([{"type": "mystery", "text": "x"}], "messages.0.content.0", id="unknown"),
    ],
)
def test_content_parts_the_gateway_cannot_count_are_refused_before_anything_is_held(
    gw: str, content: list[Any], param: str
) -> None:
    """Regression: image and audio parts were dropped from the count (their tokens, often
    thousands per image, held in KV but never reserved)."""
    session = f"acct-{uuid.uuid4().hex[:10]}"
    r = httpx.post(gw + "/v1/chat/completions", timeout=30,
                   headers={**AUTH, "X-Session-ID": session},
                   json={"model": SIM_MODEL, "messages": [{"role": "user", "content": content}]})

    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error",
                                                        "unsupported_content", param)
    assert held_kv_bytes(gw, session) == 0


def test_completions_prompt_embeds_are_refused(gw: str) -> None:
    r = httpx.post(gw + "/v1/completions", headers=AUTH, timeout=30,
                   json={"model": SIM_MODEL, "prompt": "x", "prompt_embeds": "AAAA"})

    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_embeds"


def test_every_text_part_is_counted(gw: str) -> None:
    """Refusal and thinking parts were dropped from the count: text the template renders."""
    parts = [{"type": "text", "text": "alpha"}, {"type": "refusal", "refusal": "beta " * 50},
             {"type": "thinking", "thinking": "gamma " * 50}, "delta"]
    plain = "\n".join(["alpha", "beta " * 50, "gamma " * 50, "delta"])

    _, with_parts, _ = stream(gw, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": parts}], "max_tokens": 1})
    _, as_string, _ = stream(gw, "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": plain}], "max_tokens": 1})

    assert with_parts == as_string > 100


# -- message forms, token for token with vLLM's own renderer ------------------------------------

# A template of vLLM's "string" content format that renders every field vLLM hands a template.
PROBE_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>"
    "{% if m.name is defined %}[{{ m.name }}]{% endif %}{{ m.content }}"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% if m.tool_calls is defined %}{% for c in m.tool_calls %}"
    "<call>{{ c.function.name }}{{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}"
    "{% if m.tool_call_id is defined %}({{ m.tool_call_id }}){% endif %}"
    "{% if m.extra is defined %}{{ m.extra }}{% endif %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def call(arguments: Any) -> dict[str, Any]:
    return {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": arguments}}


MESSAGE_FORMS: dict[str, list[dict[str, Any]]] = {
    "text-part-kinds": [{"role": "user", "content": [
        {"type": "text", "text": "one"}, {"type": "input_text", "text": "two"},
        {"type": "output_text", "text": "three"}, {"type": "refusal", "refusal": "four"},
        {"type": "thinking", "thinking": "five"}, "six", {"type": "text", "text": None}]}],
    "tool-round-trip": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]},
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
    ],
    "tool-arguments-odd": [
        {"role": "user", "content": "go"},
        {"role": "assistant", "content": "", "tool_calls": [
            call("not json"), call(""), call("[1, 2]"), call('{"deep": {"k": [1, 2.5]}}')]},
    ],
    "empty-tool-calls-and-reasoning": [
        {"role": "user", "content": "think"},
        {"role": "assistant", "content": "ok", "tool_calls": [],
         "reasoning_content": "hmm " * 20},
    ],
    "dropped-keys-and-name": [
        {"role": "user", "content": "hi", "name": "ann", "extra": "SHOULD NOT COUNT " * 30},
    ],
    "system-billing-header": [
        {"role": "system", "content": "x-anthropic-billing-header: cch=abc123\nBe brief."},
        {"role": "user", "content": "hello"},
    ],
}

VLLM_RENDER = """
import json, sys
from transformers import AutoTokenizer
from vllm.config import ModelConfig
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.renderers.chat_utils import parse_chat_messages
from vllm.renderers.hf import safe_apply_chat_template
model_dir, tokenizer_dir = sys.argv[1], sys.argv[2]
config = ModelConfig(model=model_dir, tokenizer=tokenizer_dir)
tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
for line in sys.stdin:
    request = ChatCompletionRequest(model="m", **json.loads(line))
    conversation, _, _ = parse_chat_messages(request.messages, config, content_format="string")
    ids = safe_apply_chat_template(config, tokenizer, conversation, tools=None,
                                   chat_template=None, tokenize=True,
                                   add_generation_prompt=True)
    print(json.dumps(list(ids)), flush=True)
"""


@pytest.fixture(scope="module")
def probe_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer with ``PROBE_TEMPLATE`` as its chat template."""
    model_dir = build_tiny_model()
    out = tmp_path_factory.mktemp("probe-tokenizer")
    for name in ("tokenizer.json", "special_tokens_map.json"):
        shutil.copy(model_dir / name, out / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config,
                                                           "chat_template": PROBE_TEMPLATE}))
    return out


def vllm_token_ids(tokenizer_dir: Path, bodies: list[dict[str, Any]]) -> list[list[int]]:
    script = f"import sys; sys.argv[1:] = {[str(build_tiny_model()), str(tokenizer_dir)]!r}\n"
    proc = vllm_script(script + VLLM_RENDER, env={"PATH": "/usr/bin:/bin"})
    out, err = proc.communicate("".join(json.dumps(b) + "\n" for b in bodies), timeout=90)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("[")]


def test_message_forms_count_as_vllm_renders_them(probe_tokenizer_dir: Path) -> None:
    """Regression: refusal/thinking parts were dropped, null content broke the template, tool
    call arguments were rendered as a JSON string where vLLM renders an object, and keys vLLM
    drops were rendered."""
    bodies = [{"messages": messages} for messages in MESSAGE_FORMS.values()]
    tokenizer = HFTokenizer.load(str(probe_tokenizer_dir))

    expected = vllm_token_ids(probe_tokenizer_dir, bodies)

    assert len(expected) == len(bodies)
    for name, body, ids in zip(MESSAGE_FORMS, bodies, expected, strict=True):
        parsed = parse_body(orjson.dumps({"model": "m", **body}), Endpoint.CHAT,
                            default_max_tokens=DEFAULT_MAX_TOKENS)
        assert prompt_token_ids(tokenizer, parsed) == [ids], name


def test_conversation_is_normalised_without_touching_the_request_body() -> None:
    """The forwarded body is the client's: normalising must copy, never edit in place."""
    messages = MESSAGE_FORMS["tool-round-trip"]
    before = json.dumps(messages)

    vllm_conversation(messages)

    assert json.dumps(messages) == before


def test_uncountable_part_error_names_the_part() -> None:
    with pytest.raises(UncountableContentError) as info:
        vllm_conversation([{"role": "user", "content": "ok"},
                           {"role": "user", "content": ["a", IMAGE]}])

    assert info.value.param == "messages.1.content.1"
    assert "image_url" in str(info.value)

"""gateway.request (step 1: the few fields the gateway needs) and gateway.errors (their shape).

Refusals must be OpenAI-shaped 400s that name the offending ``param``; everything the gateway does
not need is forwarded byte for byte, except that a stream which did not ask for usage gets
``stream_options.include_usage`` added and a chat request without an output limit gets the one the
gateway reserved. Output limits follow vLLM 0.32's rules per route (chat and completions differ).
"""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import orjson
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from gateway.app import install_error_handlers
from gateway.budgets.session_id import SESSION_ID_MAX_LEN
from gateway.errors import GatewayError, bad_request, error_body
from gateway.prompt.limits import Truncation
from gateway.request import (
    Endpoint,
    ParsedRequest,
    parse_body,
    session_id_from,
)

MESSAGES = [{"role": "user", "content": "hi"}]
DEFAULT_MAX_TOKENS = 1024  # routing.default_max_tokens


def parse(raw: bytes, endpoint: Endpoint) -> ParsedRequest:
    return parse_body(raw, endpoint, default_max_tokens=DEFAULT_MAX_TOKENS)


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "messages": MESSAGES, **fields}).encode()


def completion(**fields: Any) -> bytes:
    return json.dumps({"model": "m", "prompt": "hi", **fields}).encode()


def refusal(raw: bytes, endpoint: Endpoint) -> GatewayError:
    with pytest.raises(GatewayError) as info:
        parse(raw, endpoint)
    return info.value


# --- refusals ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "endpoint", "param"),
    [
        pytest.param(json.dumps({"messages": MESSAGES}).encode(), Endpoint.CHAT, "model",
                     id="model-missing"),
        pytest.param(chat(model=""), Endpoint.CHAT, "model", id="model-empty"),
        pytest.param(chat(model=7), Endpoint.CHAT, "model", id="model-number"),
        pytest.param(chat(model=None), Endpoint.COMPLETIONS, "model", id="model-null"),
        pytest.param(json.dumps({"model": "m"}).encode(), Endpoint.CHAT, "messages",
                     id="messages-missing"),
        pytest.param(chat(messages=[]), Endpoint.CHAT, "messages", id="messages-empty"),
        pytest.param(chat(messages="hi"), Endpoint.CHAT, "messages", id="messages-string"),
        pytest.param(chat(messages={"role": "user"}), Endpoint.CHAT, "messages",
                     id="messages-object"),
        pytest.param(chat(messages=[{"role": "user", "content": "a"}, "b"]), Endpoint.CHAT,
                     "messages.1", id="message-not-object"),
        pytest.param(chat(messages=[{"content": "a"}]), Endpoint.CHAT, "messages.0",
                     id="message-without-role"),
        pytest.param(chat(messages=[{"role": 1, "content": "a"}]), Endpoint.CHAT, "messages.0",
                     id="message-role-number"),
        pytest.param(json.dumps({"model": "m"}).encode(), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-missing"),
        pytest.param(completion(prompt=None), Endpoint.COMPLETIONS, "prompt", id="prompt-null"),
        pytest.param(completion(prompt=5), Endpoint.COMPLETIONS, "prompt", id="prompt-number"),
        pytest.param(completion(prompt=[]), Endpoint.COMPLETIONS, "prompt", id="prompt-empty-list"),
        pytest.param(completion(prompt=[[]]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-empty-token-list"),
        pytest.param(completion(prompt=[[1, 2], []]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-batch-with-empty-entry"),
        pytest.param(completion(prompt=["a", 1]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-strings-and-ints"),
        pytest.param(completion(prompt=[1, "a"]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-ints-and-strings"),
        pytest.param(completion(prompt=[[1], 2]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-list-and-int"),
        pytest.param(completion(prompt=[True, False]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-bools"),
        pytest.param(completion(prompt=[-1]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-negative-token"),
        pytest.param(completion(prompt=[2**31]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-token-over-int32"),
        pytest.param(completion(prompt=[1.0]), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-float-token"),
        pytest.param(completion(prompt={"text": "a"}), Endpoint.COMPLETIONS, "prompt",
                     id="prompt-object"),
        pytest.param(chat(stream="true"), Endpoint.CHAT, "stream", id="stream-string"),
        pytest.param(chat(stream=1), Endpoint.CHAT, "stream", id="stream-int"),
        pytest.param(chat(max_tokens=0), Endpoint.CHAT, "max_tokens", id="max_tokens-zero"),
        pytest.param(chat(max_tokens=-3), Endpoint.CHAT, "max_tokens", id="max_tokens-negative"),
        pytest.param(chat(max_tokens="5"), Endpoint.CHAT, "max_tokens", id="max_tokens-string"),
        pytest.param(chat(max_tokens=True), Endpoint.CHAT, "max_tokens", id="max_tokens-bool"),
        pytest.param(chat(max_tokens=1.5), Endpoint.CHAT, "max_tokens", id="max_tokens-float"),
        pytest.param(completion(max_tokens=0), Endpoint.COMPLETIONS, "max_tokens",
                     id="completions-max_tokens-zero"),
        pytest.param(chat(max_completion_tokens=0, max_tokens=5), Endpoint.CHAT,
                     "max_completion_tokens", id="max_completion_tokens-zero"),
        pytest.param(chat(max_completion_tokens="x"), Endpoint.CHAT, "max_completion_tokens",
                     id="max_completion_tokens-string"),
        pytest.param(chat(n=0), Endpoint.CHAT, "n", id="n-zero"),
        pytest.param(chat(n=129), Endpoint.CHAT, "n", id="n-over-128"),
        pytest.param(chat(n=True), Endpoint.CHAT, "n", id="n-bool"),
        pytest.param(chat(n="2"), Endpoint.CHAT, "n", id="n-string"),
        pytest.param(chat(user=42), Endpoint.CHAT, "user", id="user-number"),
        pytest.param(chat(user={"id": "u"}), Endpoint.CHAT, "user", id="user-object"),
        pytest.param(chat(stream=True, stream_options="yes"), Endpoint.CHAT, "stream_options",
                     id="stream_options-string"),
        pytest.param(chat(stream=True, stream_options=[True]), Endpoint.CHAT, "stream_options",
                     id="stream_options-list"),
    ],
)
def test_invalid_field_is_refused_with_400_naming_the_param(
    raw: bytes, endpoint: Endpoint, param: str
) -> None:
    err = refusal(raw, endpoint)

    assert err.status == 400
    assert err.param == param
    assert err.type == "invalid_request_error"
    assert err.message


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"not json", b'{"model": "m",}', b'{"model": NaN}', b"\xff\xfe"],
    ids=["empty", "truncated", "text", "trailing-comma", "nan", "bad-utf8"],
)
def test_body_that_is_not_json_is_refused_as_invalid_json(raw: bytes) -> None:
    err = refusal(raw, Endpoint.CHAT)

    assert err.status == 400
    assert err.code == "invalid_json"
    assert err.param is None


@pytest.mark.parametrize("raw", [b"[]", b'"text"', b"3", b"null"])
def test_json_that_is_not_an_object_is_refused(raw: bytes) -> None:
    err = refusal(raw, Endpoint.COMPLETIONS)

    assert err.status == 400
    assert err.code == "invalid_json"


def test_chat_endpoint_does_not_require_prompt_and_completions_does_not_require_messages() -> None:
    parse(json.dumps({"model": "m", "messages": MESSAGES}).encode(), Endpoint.CHAT)
    parse(json.dumps({"model": "m", "prompt": "x"}).encode(), Endpoint.COMPLETIONS)


# --- accepted variants ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt",
    ["", "Once upon a time", ["a", "b"], [0, 1, 2**31 - 1], [[1, 2, 3], [4]], [[7]]],
    ids=["empty-string", "string", "strings", "token-ids", "token-id-lists", "one-token-list"],
)
def test_completions_prompt_variants_are_accepted(prompt: Any) -> None:
    parsed = parse(completion(prompt=prompt), Endpoint.COMPLETIONS)

    assert parsed.body["prompt"] == prompt
    assert parsed.endpoint is Endpoint.COMPLETIONS


def test_chat_request_fields_are_read() -> None:
    parsed = parse(
        chat(stream=True, max_tokens=64, n=3, user="alice",
             stream_options={"include_usage": True}),
        Endpoint.CHAT,
    )

    assert parsed.model == "m"
    assert parsed.stream is True
    assert parsed.max_tokens == 64
    assert parsed.n == 3
    assert parsed.user == "alice"
    assert parsed.client_wants_usage is True


def test_defaults_when_optional_fields_are_absent() -> None:
    parsed = parse(chat(), Endpoint.CHAT)

    assert parsed.stream is False
    assert parsed.max_tokens == DEFAULT_MAX_TOKENS
    assert parsed.n == 1
    assert parsed.user is None
    assert parsed.client_wants_usage is False


def test_null_optional_fields_mean_their_defaults() -> None:
    parsed = parse(
        chat(stream=None, max_tokens=None, max_completion_tokens=None, n=None, user=None,
             stream_options=None),
        Endpoint.CHAT,
    )

    assert parsed.stream is False
    assert parsed.max_tokens == DEFAULT_MAX_TOKENS
    assert parsed.n == 1
    assert parsed.user is None


def test_max_completion_tokens_wins_over_max_tokens() -> None:
    parsed = parse(chat(max_tokens=500, max_completion_tokens=20), Endpoint.CHAT)

    assert parsed.max_tokens == 20


def test_max_tokens_is_used_when_max_completion_tokens_is_null() -> None:
    parsed = parse(chat(max_tokens=500, max_completion_tokens=None), Endpoint.CHAT)

    assert parsed.max_tokens == 500


def test_n_of_128_is_accepted() -> None:
    assert parse(chat(n=128), Endpoint.CHAT).n == 128


def test_include_usage_false_means_client_does_not_want_usage() -> None:
    parsed = parse(chat(stream=True, stream_options={"include_usage": False}), Endpoint.CHAT)

    assert parsed.client_wants_usage is False


def test_unknown_fields_are_kept_in_body() -> None:
    parsed = parse(chat(top_k=5, vllm_xargs={"a": 1}), Endpoint.CHAT)

    assert parsed.body["top_k"] == 5
    assert parsed.body["vllm_xargs"] == {"a": 1}


# --- output limits: vLLM 0.32's rules per route ------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "limit"),
    [
        pytest.param({}, 16, id="absent-is-vllm-default-16"),
        pytest.param({"max_tokens": None}, 16, id="null-is-vllm-default-16"),
        pytest.param({"max_tokens": 40}, 40, id="max_tokens"),
        pytest.param({"max_completion_tokens": 1}, 16, id="max_completion_tokens-ignored"),
        pytest.param({"max_completion_tokens": 1, "max_tokens": 300}, 300,
                     id="max_completion_tokens-ignored-beside-max_tokens"),
        pytest.param({"max_completion_tokens": "x"}, 16, id="max_completion_tokens-not-checked"),
        pytest.param({"max_tokens": 0, "echo": True}, 1, id="echo-without-generation-samples-1"),
        pytest.param({"max_tokens": 2.0}, 2, id="integral-float"),
    ],
)
def test_completions_output_limit_follows_vllm_completions_rules(
    fields: dict[str, Any], limit: int
) -> None:
    """Completions trusted ``max_completion_tokens`` (reserve 1, vLLM generated 7,000: it is no
    field of a completions request) and assumed 1,024 where vLLM's default is 16."""
    raw = completion(**fields)

    parsed = parse(raw, Endpoint.COMPLETIONS)

    assert parsed.max_tokens == limit
    assert parsed.forward_body() == raw  # vLLM applies this limit itself: nothing to write


def test_completions_max_tokens_zero_without_echo_is_refused() -> None:
    assert refusal(completion(max_tokens=0, echo=False), Endpoint.COMPLETIONS).param == "max_tokens"


@pytest.mark.parametrize(
    ("fields", "limit"),
    [
        pytest.param({"max_completion_tokens": 20, "max_tokens": 500}, 20, id="mct-wins"),
        pytest.param({"max_tokens": 500}, 500, id="max_tokens"),
        pytest.param({"max_completion_tokens": None, "max_tokens": 7}, 7, id="mct-null"),
    ],
)
def test_chat_output_limit_given_by_the_client_is_kept_and_forwarded_unchanged(
    fields: dict[str, Any], limit: int
) -> None:
    raw = chat(**fields)

    parsed = parse(raw, Endpoint.CHAT)

    assert parsed.max_tokens == limit
    assert parsed.forward_body() == raw


def test_chat_without_output_limit_gets_the_reserved_limit_spliced_into_its_bytes() -> None:
    """Without a limit vLLM generated up to the rest of the context (8,171 tokens) while the
    gateway reserved ``default_max_tokens``: the reserved limit now goes upstream."""
    raw = b'{"model":"m", "messages":[{"role":"user","content":"h\\u00e9"}], "seed": 1.10}'

    parsed = parse(raw, Endpoint.CHAT)

    assert parsed.max_tokens == DEFAULT_MAX_TOKENS
    assert parsed.forward_body() == b'{"max_completion_tokens":1024,' + raw[1:]


def test_chat_with_null_max_completion_tokens_gets_max_tokens_spliced() -> None:
    raw = chat(max_completion_tokens=None)

    forwarded = parse(raw, Endpoint.CHAT).forward_body()

    assert forwarded == b'{"max_tokens":1024,' + raw[1:]
    assert json.loads(forwarded)["max_completion_tokens"] is None  # vLLM then reads max_tokens


def test_chat_with_both_limits_null_is_re_encoded_with_the_reserved_limit() -> None:
    wide = 123456789012345678901234567890
    raw = chat(max_completion_tokens=None, max_tokens=None, seed=wide)

    body = json.loads(parse(raw, Endpoint.CHAT).forward_body())

    assert body["max_completion_tokens"] == DEFAULT_MAX_TOKENS
    assert body["max_tokens"] is None
    assert body["seed"] == wide


def test_chat_stream_without_limit_or_stream_options_gets_both_spliced() -> None:
    raw = chat(stream=True)

    forwarded = parse(raw, Endpoint.CHAT).forward_body()

    assert forwarded == (b'{"stream_options":{"include_usage":true},"max_completion_tokens":1024,'
                         + raw[1:])


def test_chat_stream_with_stream_options_and_no_limit_is_re_encoded_with_both() -> None:
    raw = chat(stream=True, stream_options={"include_usage": False})

    body = json.loads(parse(raw, Endpoint.CHAT).forward_body())

    assert body["stream_options"]["include_usage"] is True
    assert body["max_completion_tokens"] == DEFAULT_MAX_TOKENS


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS])
def test_n_and_best_of_are_read_as_vllm_does(endpoint: Endpoint) -> None:
    """``n`` sequences are held per prompt; vLLM 0.32 has no ``best_of`` field (ignored)."""
    raw = chat(n=4, best_of=8) if endpoint is Endpoint.CHAT else completion(n=4, best_of=8)

    assert parse(raw, endpoint).n == 4


def test_completions_prompt_embeds_are_refused_as_uncountable() -> None:
    err = refusal(completion(prompt_embeds="AAAA"), Endpoint.COMPLETIONS)

    assert (err.status, err.param, err.code) == (400, "prompt_embeds", "unsupported_content")


# --- forward_body --------------------------------------------------------------------------------

VLLM_EXTRAS: dict[str, Any] = {
    "temperature": 0.7,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repetition_penalty": 1.1,
    "seed": 1234,
    "stop": ["</s>", "\n\n"],
    "logit_bias": {"50256": -100},
    "vllm_xargs": {"kv_transfer": {"mode": "push"}, "priority": 3},
    "chat_template_kwargs": {"enable_thinking": False},
    "structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "integer"}}}},
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
}


def test_non_streaming_request_is_forwarded_byte_for_byte() -> None:
    raw = b'{"model":"m",  "messages":[{"role":"user","content":"hi"}], "top_k": 3, "max_tokens":9}'

    parsed = parse(raw, Endpoint.CHAT)

    assert parsed.forward_body() == raw


def test_stream_that_asked_for_usage_is_forwarded_byte_for_byte() -> None:
    raw = chat(stream=True, stream_options={"include_usage": True}, max_tokens=9, **VLLM_EXTRAS)

    assert parse(raw, Endpoint.CHAT).forward_body() == raw


def test_stream_without_stream_options_gets_include_usage_and_keeps_every_other_field() -> None:
    raw = chat(stream=True, max_completion_tokens=9, **VLLM_EXTRAS)

    forwarded = json.loads(parse(raw, Endpoint.CHAT).forward_body())

    expected = {**json.loads(raw), "stream_options": {"include_usage": True}}
    assert forwarded == expected


def test_stream_with_include_usage_false_gets_it_true_and_keeps_other_stream_options() -> None:
    raw = chat(stream=True,
               stream_options={"include_usage": False, "continuous_usage_stats": True})

    forwarded = json.loads(parse(raw, Endpoint.CHAT).forward_body())

    # Per-chunk usage is vLLM's only with include_usage, which this client did not set.
    assert forwarded["stream_options"] == {"include_usage": True,
                                           "continuous_usage_stats": False}
    assert forwarded["messages"] == MESSAGES


@pytest.mark.parametrize("flag", ["include_usage", "continuous_usage_stats"])
@pytest.mark.parametrize("value", ["false", "true", 0, 1, [], {}])
def test_stream_options_flags_must_be_json_booleans(flag: str, value: Any) -> None:
    """Regression: ``include_usage: "false"`` read as true by the gateway (it asked vLLM for no
    usage) and as false by vLLM's lax parsing (it sent none): the stream was charged its whole
    reservation. Refused as ``stream`` is, before any worker is asked."""
    raw = chat(stream=True, stream_options={flag: value})
    with pytest.raises(GatewayError) as err:
        parse(raw, Endpoint.CHAT)
    assert (err.value.status, err.value.param) == (400, f"stream_options.{flag}")


def test_completions_stream_gets_include_usage() -> None:
    raw = completion(stream=True, prompt=[[1, 2], [3]], echo=True)

    forwarded = json.loads(parse(raw, Endpoint.COMPLETIONS).forward_body())

    assert forwarded["stream_options"] == {"include_usage": True}
    assert forwarded["prompt"] == [[1, 2], [3]]
    assert forwarded["echo"] is True


def test_forward_body_keeps_integers_wider_than_64_bits_exact() -> None:
    wide = 123456789012345678901234567890  # > 2**64: a float would lose the low digits
    raw = (
        b'{"model":"m","prompt":"x","stream":true,"seed":' + str(wide).encode()
        + b',"vllm_xargs":{"n":' + str(-wide).encode() + b'}}'
    )

    forwarded = parse(raw, Endpoint.COMPLETIONS).forward_body()

    assert str(wide).encode() in forwarded
    body = json.loads(forwarded)
    assert body["seed"] == wide
    assert body["vllm_xargs"]["n"] == -wide
    assert body["stream_options"] == {"include_usage": True}


def test_stream_without_stream_options_keeps_the_client_bytes_after_the_spliced_field() -> None:
    raw = (b'{ "model":"m",\n "messages":[{"role":"user","content":"h\\u00e9 1.10"}],'
           b' "stream":true, "max_tokens": 5}')

    forwarded = parse(raw, Endpoint.CHAT).forward_body()

    assert forwarded == b'{"stream_options":{"include_usage":true},' + raw[1:]


def test_forward_body_keeps_non_ascii_text_and_float_values() -> None:
    messages = [{"role": "user", "content": "héllo 你好 🚀 \u2028"}]
    raw = chat(stream=True, messages=messages, temperature=0.1, presence_penalty=-1e-7,
               stream_options={"include_usage": False})  # re-encoded, not spliced

    forwarded = parse(raw, Endpoint.CHAT).forward_body()

    body = json.loads(forwarded)
    assert body["messages"] == messages
    assert body["temperature"] == 0.1
    assert body["presence_penalty"] == -1e-7
    assert "你好".encode() in forwarded  # sent as UTF-8, not as \u escapes


def test_parsed_request_is_frozen() -> None:
    parsed = parse(chat(), Endpoint.CHAT)

    with pytest.raises(AttributeError):
        parsed.stream = True  # type: ignore[misc]
    assert isinstance(parsed, ParsedRequest)


# --- session_id_from -----------------------------------------------------------------------------


def test_session_header_wins_over_user() -> None:
    assert session_id_from("sess-1", "alice") == "sess-1"


def test_user_is_the_session_when_there_is_no_header() -> None:
    assert session_id_from(None, "alice") == "alice"


def test_empty_header_falls_through_to_user() -> None:
    assert session_id_from("", "alice") == "alice"


def test_no_session_when_the_client_names_none() -> None:
    """The API key is the tenant, never the session: a request naming no session goes to its
    tenant's default session (in the budget service)."""
    assert session_id_from(None, None) is None
    assert session_id_from("", "") is None


def test_session_id_of_exactly_the_limit_is_kept_as_is() -> None:
    sid = "s" * SESSION_ID_MAX_LEN

    assert session_id_from(sid, None) == sid


@pytest.mark.parametrize(
    "odd",
    ["s" * (SESSION_ID_MAX_LEN + 1), "a\nb", "tab\there", "nul\x00", "esc\x1b[31m", "x" * 5000],
    ids=["one-over-limit", "newline", "tab", "nul", "ansi-escape", "huge"],
)
def test_odd_session_ids_are_made_safe_before_reaching_logs_keys_or_labels(odd: str) -> None:
    sid = session_id_from(odd, "alice")

    assert sid is not None and sid != odd
    assert len(sid) <= SESSION_ID_MAX_LEN
    assert re.fullmatch(r"[A-Za-z0-9._:@~-]+", sid)
    assert session_id_from(odd, None) == sid  # stable: the same client stays one session


def test_blank_header_falls_back_to_user() -> None:
    assert session_id_from("   ", "alice") == "alice"


# --- errors: the OpenAI shape --------------------------------------------------------------------


def test_error_body_has_exactly_the_openai_fields() -> None:
    err = GatewayError(400, "bad", param="model", code="model_not_found")

    assert err.body() == {
        "error": {"message": "bad", "type": "invalid_request_error", "param": "model",
                  "code": "model_not_found"}
    }


def test_error_body_keeps_null_param_and_code() -> None:
    assert error_body("m", "t") == {"error": {"message": "m", "type": "t", "param": None,
                                              "code": None}}


@pytest.mark.parametrize(
    ("status", "type_"),
    [(400, "invalid_request_error"), (404, "not_found_error"), (413, "invalid_request_error"),
     (429, "rate_limit_error"), (502, "upstream_error"), (503, "service_unavailable_error"),
     (504, "timeout_error"), (418, "invalid_request_error")],
)
def test_error_type_follows_the_status(status: int, type_: str) -> None:
    assert GatewayError(status, "x").type == type_


def test_explicit_error_type_overrides_the_status_default() -> None:
    assert GatewayError(429, "x", type_="tokens_exceeded").type == "tokens_exceeded"


def test_bad_request_is_a_400_with_param_and_code() -> None:
    err = bad_request("nope", param="n", code="c")

    assert (err.status, err.param, err.code, str(err)) == (400, "n", "c", "nope")


def test_error_response_is_json_with_status_and_body() -> None:
    resp = GatewayError(503, "down", code="no_healthy_worker").response()

    assert resp.status_code == 503
    assert resp.media_type == "application/json"
    assert orjson.loads(bytes(resp.body)) == {
        "error": {"message": "down", "type": "service_unavailable_error", "param": None,
                  "code": "no_healthy_worker"}
    }
    assert "retry-after" not in resp.headers


@pytest.mark.parametrize(
    ("retry_after_s", "header"),
    [(0.0, "1"), (0.2, "1"), (1.0, "1"), (2.0, "2"), (30, "30"), (1.2, "2"), (2.5, "3"),
     (3.5, "4")],
)
def test_retry_after_header_is_whole_seconds_rounded_up_and_at_least_one(
    retry_after_s: float, header: str
) -> None:
    """Retry-After was rounded half-to-even (1.2 -> 1, 2.5 -> 2): the client came back before it
    could be admitted and got a second 429. Budget errors round up; gateway errors must too."""
    resp = GatewayError(429, "slow down", retry_after_s=retry_after_s).response()

    assert resp.headers["retry-after"] == header


# --- errors: the handlers installed on the app ---------------------------------------------------


class _Item(BaseModel):
    size: int


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/refuse")
    async def refuse() -> None:
        raise GatewayError(429, "busy", code="kv_budget_exceeded", retry_after_s=3)

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("secret internals")

    @app.post("/items")
    async def items(item: _Item) -> dict[str, int]:
        return {"size": item.size}

    return app


async def _get(method: str, path: str, **kwargs: Any) -> httpx.Response:
    transport = httpx.ASGITransport(app=_app(), raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        return await client.request(method, path, **kwargs)


def _assert_openai_shape(resp: httpx.Response) -> dict[str, Any]:
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    err: dict[str, Any] = body["error"]
    return err


async def test_gateway_error_raised_in_a_route_becomes_openai_json_with_retry_after() -> None:
    resp = await _get("GET", "/refuse")

    assert resp.status_code == 429
    assert resp.headers["retry-after"] == "3"
    err = _assert_openai_shape(resp)
    assert (err["type"], err["code"], err["message"]) == ("rate_limit_error",
                                                         "kv_budget_exceeded", "busy")


async def test_unknown_route_is_an_openai_shaped_404() -> None:
    resp = await _get("GET", "/nowhere")

    assert resp.status_code == 404
    assert _assert_openai_shape(resp)["code"] == "not_found"


async def test_wrong_method_is_an_openai_shaped_405() -> None:
    resp = await _get("DELETE", "/refuse")

    assert resp.status_code == 405
    assert _assert_openai_shape(resp)["code"] == "method_not_allowed"


async def test_request_validation_error_is_an_openai_shaped_400_naming_the_field() -> None:
    resp = await _get("POST", "/items", json={"size": "big"})

    assert resp.status_code == 400
    err = _assert_openai_shape(resp)
    assert err["param"] == "size"
    assert err["type"] == "invalid_request_error"


async def test_unexpected_exception_is_an_openai_shaped_500_without_internals() -> None:
    resp = await _get("GET", "/boom")

    assert resp.status_code == 500
    err = _assert_openai_shape(resp)
    assert err["code"] == "internal_error"
    assert "secret" not in resp.text


@pytest.mark.parametrize("endpoint", [Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES,
                                      Endpoint.EMBEDDINGS])
@pytest.mark.parametrize("fields, param", [
    ({"kv_transfer_params": {"do_remote_prefill": True, "remote_host": "10.0.0.9",
                             "remote_port": 5600, "remote_block_ids": [1, 2]}},
     "kv_transfer_params"),
    ({"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
    ({"kv_transfer_params": "x"}, "kv_transfer_params"),
    ({"ec_transfer_params": {"do_remote_decode": True}}, "ec_transfer_params"),
    ({"vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs"),
    ({"vllm_xargs": {"ec_transfer_params": [1]}}, "vllm_xargs"),
])
def test_a_client_cannot_send_kv_transfer_params(endpoint: Endpoint, fields: dict[str, Any],
                                                 param: str) -> None:
    """A client naming where a worker pulls KV from (any host), or asking a worker to keep a
    prompt's blocks for a decode that never comes, would walk around the gateway's routing and
    budgets; a value that is not an object fails vLLM's own handling of the request."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi",
            "input": "hi", **fields}
    err = refusal(json.dumps(body).encode(), endpoint)
    assert (err.status, err.param, err.code) == (400, param, "unsupported_parameter")


def test_null_transfer_params_and_other_xargs_pass_through() -> None:
    raw = chat(kv_transfer_params=None, vllm_xargs={"my_arg": 1})
    forwarded = json.loads(parse(raw, Endpoint.CHAT).forward)
    assert forwarded["vllm_xargs"] == {"my_arg": 1} and forwarded["kv_transfer_params"] is None


@pytest.mark.parametrize("priority", [-1, -100, "-5", "0", -5.0, 1.5, True, [0], {"p": 0}])
def test_a_priority_that_could_jump_other_clients_queue_or_that_vllm_would_coerce_is_refused(
        priority: Any) -> None:
    """A client's ``priority: -1`` went to vLLM unchanged: on a worker scheduling by priority
    it runs ahead of, and preempts, every other key's requests (all at the default 0)."""
    for endpoint, body in ((Endpoint.CHAT, {"messages": [{"role": "user", "content": "hi"}]}),
                           (Endpoint.COMPLETIONS, {"prompt": "hi"})):
        with pytest.raises(GatewayError) as err:
            parse(orjson.dumps({"model": "m", "priority": priority, **body}), endpoint)
        assert err.value.status == 400
        assert (err.value.param, err.value.code) == ("priority", "invalid_priority")


@pytest.mark.parametrize("priority", [0, 1, 10, None])
def test_a_priority_that_only_lowers_the_requests_own_standing_passes_untouched(
        priority: Any) -> None:
    raw = orjson.dumps({"model": "m", "priority": priority,
                        "messages": [{"role": "user", "content": "hi"}]})
    forwarded = orjson.loads(parse(raw, Endpoint.CHAT).forward)
    assert "priority" in forwarded and forwarded["priority"] == priority


CACHE_SALT_BODIES = ((Endpoint.CHAT, {"messages": MESSAGES}), (Endpoint.COMPLETIONS, {"prompt": "hi"}),
                     (Endpoint.RESPONSES, {"input": "hi"}))


@pytest.mark.parametrize("salt", ["", 7, True, ["s"], "x" * 129, "a/b", "a@b", "a\\b", "a\x00"])
def test_a_cache_salt_vllm_would_refuse_is_refused_with_its_message(salt: Any) -> None:
    for endpoint, body in CACHE_SALT_BODIES:
        with pytest.raises(GatewayError) as err:
            parse(orjson.dumps({"model": "m", "cache_salt": salt, **body}), endpoint)
        assert (err.value.status, err.value.param) == (400, "cache_salt")
        assert str(err.value).startswith("Parameter 'cache_salt' must be")


@pytest.mark.parametrize("salt", ["s", "tenant-1", "x" * 128, None])
def test_a_cache_salt_is_kept_for_routing_and_forwarded_untouched(salt: str | None) -> None:
    for endpoint, body in CACHE_SALT_BODIES:
        raw = orjson.dumps({"model": "m", "cache_salt": salt, **body})
        parsed = parse(raw, endpoint)
        assert parsed.cache_salt == salt
        assert orjson.loads(parsed.forward)["cache_salt"] == salt


@pytest.mark.parametrize(("endpoint", "fields", "reads"), [
    (Endpoint.COMPLETIONS, {}, True),
    (Endpoint.COMPLETIONS, {"logprobs": 1}, True),  # the generated tokens' logprobs only
    (Endpoint.COMPLETIONS, {"echo": True}, True),
    (Endpoint.COMPLETIONS, {"echo": True, "logprobs": 0}, False),  # loglikelihood requests
    (Endpoint.COMPLETIONS, {"prompt_logprobs": 0}, False),
    (Endpoint.COMPLETIONS, {"prompt_logprobs": None, "echo": False}, True),
    (Endpoint.CHAT, {}, True),
    (Endpoint.CHAT, {"logprobs": True, "top_logprobs": 2}, True),
    (Endpoint.CHAT, {"echo": True}, False),  # top_logprobs defaults to 0: prompt_logprobs 0
    (Endpoint.CHAT, {"prompt_logprobs": 1}, False),
])
def test_a_request_for_its_prompts_logprobs_reads_no_prefix_cache_as_in_vllm(
        endpoint: Endpoint, fields: dict[str, Any], reads: bool) -> None:
    base: dict[str, Any] = {"messages": MESSAGES} if endpoint is Endpoint.CHAT else {"prompt": "hi"}
    parsed = parse(orjson.dumps({"model": "m", **base, **fields}), endpoint)
    assert parsed.reads_prefix_cache is reads


def test_truncate_prompt_tokens_is_taken_on_the_generation_routes_as_vllm_checks_it() -> None:
    """vLLM cuts a chat or completions prompt to ``truncate_prompt_tokens`` (its
    ``TokenizeParams``, as on the pooling routes) before it runs it: the gateway counts, routes
    and hashes what vLLM keeps."""
    for endpoint, body in ((Endpoint.CHAT, {"messages": MESSAGES}),
                           (Endpoint.COMPLETIONS, {"prompt": "hi"})):
        parsed = parse(orjson.dumps({"model": "m", **body, "truncate_prompt_tokens": 5,
                                     "truncation_side": "left"}), endpoint)
        assert parsed.truncation == Truncation(5, left=True)
        # no side: vLLM's tokenizer side for a generation model, left (the pooling routes: right)
        parsed = parse(orjson.dumps({"model": "m", **body, "truncate_prompt_tokens": 5}),
                       endpoint)
        assert parsed.truncation == Truncation(5, left=True)
        parsed = parse(orjson.dumps({"model": "m", **body, "truncate_prompt_tokens": 5,
                                     "truncation_side": "right"}), endpoint)
        assert parsed.truncation == Truncation(5, left=False)
        assert parse(orjson.dumps({"model": "m", **body}), endpoint).truncation is None
        for bad in ({"truncate_prompt_tokens": -2}, {"truncate_prompt_tokens": "5"},
                    {"truncate_prompt_tokens": 5, "truncation_side": "middle"}):
            with pytest.raises(GatewayError) as err:
                parse(orjson.dumps({"model": "m", **body, **bad}), endpoint)
            assert err.value.status == 400
            assert err.value.param in ("truncate_prompt_tokens", "truncation_side")


def test_a_truncation_keeps_the_first_or_the_last_tokens() -> None:
    ids = list(range(10))
    assert Truncation(4).apply(ids, 99) == [0, 1, 2, 3]
    assert Truncation(4, left=True).apply(ids, 99) == [6, 7, 8, 9]
    assert Truncation(-1, left=True).apply(ids, 3) == [7, 8, 9]
    assert Truncation(20).apply(ids, 3) == ids
    assert Truncation(0, left=True).apply(ids, 3) == []


@pytest.mark.parametrize(("endpoint", "body"), [
    (Endpoint.EMBEDDINGS, {"input": "hi", "messages": [{"role": "user", "content": "long"}]}),
    (Endpoint.CLASSIFY, {"input": ["hi"], "messages": [{"role": "user", "content": "long"}]}),
    (Endpoint.POOLING, {"input": [1, 2], "messages": [{"role": "user", "content": "long"}]}),
    (Endpoint.SCORE, {"data_1": "a", "data_2": "b", "queries": "q", "documents": ["long"]}),
    (Endpoint.SCORE, {"data_1": "a", "data_2": "b", "queries": "q", "items": ["long"]}),
    (Endpoint.SCORE, {"text_1": "a", "text_2": "b", "queries": "q", "documents": ["long"]}),
    (Endpoint.SCORE, {"queries": "q", "documents": ["d"], "items": ["long"]}),
    (Endpoint.SCORE, {"data_1": "a", "data_2": "b", "text_1": "c", "text_2": "long"}),
    (Endpoint.SCORE, {"data_1": "a", "data_2": "b", "queries": "long"}),
], ids=["embeddings", "classify", "pooling", "score-documents", "score-items", "score-text",
        "documents-and-items", "data-and-text", "data-and-queries"])
def test_a_pooling_body_of_two_request_shapes_is_refused(endpoint: Endpoint,
                                                          body: dict[str, Any]) -> None:
    """Regression: vLLM parses a pooling body as a union of request types and runs the shape its
    union picks (``messages`` over ``input``; ``queries``/``documents`` over ``data_1``/
    ``data_2``), while the gateway counted the other: a tiny shape charged, a large one run
    (per-request, in-flight and per-minute budgets walked around)."""
    err = refusal(json.dumps({"model": "m", **body}).encode(), endpoint)
    assert (err.status, err.code) == (400, "ambiguous_request")


@pytest.mark.parametrize("body", [
    {"data_1": "a", "data_2": ["b", "c"]}, {"queries": "q", "documents": ["d"]},
    {"queries": ["q"], "items": ["i"]}, {"text_1": "a", "text_2": "b"},
    {"data_1": "a", "data_2": "b", "queries": None},
])
def test_a_score_body_of_one_shape_is_served(body: dict[str, Any]) -> None:
    parsed = parse(json.dumps({"model": "m", **body}).encode(), Endpoint.SCORE)
    assert parsed.pooling is not None and parsed.pooling.texts

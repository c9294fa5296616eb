"""The relay's usage splice: the top-level ``usage`` object found in an answer's bytes, and
``prompt_tokens_details.cached_tokens`` put in only where vLLM gave none."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from gateway.upstream.relay import FROM_VLLM, PREDICTED, find_usage, with_cached_tokens

USAGE = {"prompt_tokens": 40, "total_tokens": 44, "completion_tokens": 4}


def chat(usage: Any, **after: Any) -> bytes:
    """A chat answer as vLLM writes it (``json.dumps`` with compact separators): usage after the
    choices, ``prompt_logprobs`` and the rest after usage."""
    body = {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                         "finish_reason": "stop"}], "usage": usage, **after}
    return orjson.dumps(body)


def spliced(body: bytes, predicted: int = 32) -> tuple[dict[str, Any], bytes]:
    found = find_usage(body)
    assert found is not None
    out, source = with_cached_tokens(body, found, predicted)
    return orjson.loads(out), source


@pytest.mark.parametrize("details", ["absent", None, {}, {"cached_tokens": None},
                                     {"cached_tokens": None, "multimodal_tokens": {"image": 4}}])
def test_the_prediction_goes_in_where_vllm_reported_no_cached_tokens(details: Any) -> None:
    usage = dict(USAGE) if details == "absent" else {**USAGE, "prompt_tokens_details": details}
    answer, source = spliced(chat(usage))
    assert source == PREDICTED
    assert answer["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    assert {k: v for k, v in answer["usage"].items() if k != "prompt_tokens_details"} == USAGE
    if isinstance(details, dict) and "multimodal_tokens" in details:
        assert answer["usage"]["prompt_tokens_details"]["multimodal_tokens"] == {"image": 4}
    assert answer["choices"] == orjson.loads(chat(usage))["choices"]


def test_vllms_cached_tokens_pass_untouched_byte_for_byte() -> None:
    body = chat({**USAGE, "prompt_tokens_details": {"cached_tokens": 0}})
    found = find_usage(body)
    assert found is not None
    assert with_cached_tokens(body, found, 999) == (body, FROM_VLLM)


def test_only_the_usage_object_changes_the_rest_keeps_its_bytes() -> None:
    body = chat(USAGE, prompt_logprobs=None)
    out, _ = with_cached_tokens(body, find_usage(body) or pytest.fail("no usage"), 7)
    head = body[:body.index(b'"usage":')]
    assert out.startswith(head) and out.endswith(b',"prompt_logprobs":null}')


def test_whitespace_around_the_colon_and_a_stream_event_are_found() -> None:
    event = b'data: {"id":"c","choices":[],"usage" : {"prompt_tokens":3,"total_tokens":5}}\n\n'
    found = find_usage(event)
    assert found is not None and found.usage == {"prompt_tokens": 3, "total_tokens": 5}
    out, source = with_cached_tokens(event, found, 0)
    assert source == PREDICTED and out.startswith(b"data: {") and out.endswith(b"}}\n\n")
    assert orjson.loads(out[len(b"data: "):])["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 0}


def test_a_token_named_usage_in_logprobs_is_not_the_usage() -> None:
    """A completions ``top_logprobs`` is keyed by token text, and a chat ``prompt_logprobs``
    entry (after ``usage``) may decode to the string "usage": neither is the usage object."""
    body = orjson.dumps({
        "choices": [{"text": "usage", "logprobs": {"top_logprobs": [{"usage": -0.1}]}}],
        "usage": USAGE,
        "prompt_logprobs": [None, {"7": {"logprob": -1.0, "rank": 1, "decoded_token": "usage"}}],
    })
    found = find_usage(body)
    assert found is not None and found.usage == USAGE


def test_usage_in_a_string_is_not_found() -> None:
    body = orjson.dumps({"choices": [{"message": {"content": '{"usage": {"prompt_tokens": 1}}'}}],
                         "usage": None})
    assert find_usage(body) is None


@pytest.mark.parametrize("body", [b"", b'{"usage":null}', b'{"usage":{"prompt_tokens":', b"{}"])
def test_no_usage_object_is_none(body: bytes) -> None:
    assert find_usage(body) is None


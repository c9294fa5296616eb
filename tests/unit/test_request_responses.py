"""Parsing ``/v1/responses`` bodies: background mode (``gateway.request``, the Responses part)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from gateway.errors import GatewayError
from gateway.prompt.limits import Truncation
from gateway.request import Endpoint, parse_body


def parse(**body: Any) -> Any:
    raw = json.dumps({"model": "m", "input": "hi", **body}).encode()
    return parse_body(raw, Endpoint.RESPONSES, default_max_tokens=8)


def test_a_background_request_is_named_by_the_gateway_in_the_forwarded_body() -> None:
    """The id is the gateway's, so the response can be watched even if no answer comes back."""
    parsed = parse(background=True)
    assert parsed.background_id is not None
    assert re.fullmatch(r"resp_[0-9a-f]{32}", parsed.background_id)  # vLLM's own format
    forwarded = json.loads(parsed.forward_body())
    assert forwarded["request_id"] == parsed.background_id
    assert forwarded["max_output_tokens"] == 8 and forwarded["background"] is True
    assert parse(background=True).background_id != parsed.background_id


@pytest.mark.parametrize("body", [{}, {"background": False}, {"background": None},
                                  {"background": False, "store": False}])
def test_a_foreground_request_is_forwarded_without_an_id(body: dict[str, Any]) -> None:
    parsed = parse(max_output_tokens=4, **body)
    assert parsed.background_id is None
    assert parsed.forward_body() == parsed.raw


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"background": True, "store": False}, "background",
     "background can only be used when `store` is true"),
    ({"background": True, "store": None}, "background",
     "background can only be used when `store` is true"),
    ({"background": True, "store": 1}, "store", "`store` must be a boolean"),
    ({"background": "true"}, "background", "`background` must be a boolean"),
    ({"background": 1}, "background", "`background` must be a boolean"),
    ({"background": True, "request_id": "resp_theirs"}, "request_id", None),
])
def test_background_is_refused_where_vllm_refuses_it_or_could_read_it_otherwise(
    body: dict[str, Any], param: str, message: str | None,
) -> None:
    with pytest.raises(GatewayError) as caught:
        parse(**body)
    assert caught.value.status == 400 and caught.value.param == param
    if message is not None:
        assert caught.value.message == message


@pytest.mark.parametrize(("fields", "cut"), [
    ({}, None), ({"truncation": "disabled"}, None),
    ({"truncation": "auto"}, Truncation(-1, left=True)),
    ({"truncation": None}, Truncation(-1, left=True)),
])
def test_truncation_auto_cuts_the_conversation_to_the_models_length_as_vllm(
        fields: dict[str, Any], cut: Truncation | None) -> None:
    assert parse(**fields).truncation == cut


def test_an_unknown_truncation_is_refused() -> None:
    with pytest.raises(GatewayError) as err:
        parse(truncation="middle")
    assert (err.value.status, err.value.param) == (400, "truncation")

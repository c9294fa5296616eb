"""Step 1 of the request path: parse and validate only the fields the gateway needs.

Everything else in the body is forwarded to the worker untouched. The body is parsed with orjson
(fast). The gateway changes a body in one case: a stream whose client did not ask for the usage
chunk gets ``stream_options.include_usage``. Without ``stream_options`` in the body (the usual
case) the field is spliced into the client's bytes in front of the others, with no re-encoding;
otherwise the original bytes are re-parsed with the standard library, so integers wider than 64
bits survive exactly, and encoded again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import orjson

from gateway.budgets.session_id import sanitize_session_id
from gateway.errors import bad_request


class Endpoint(StrEnum):
    CHAT = "chat/completions"
    COMPLETIONS = "completions"


@dataclass(frozen=True)
class ParsedRequest:
    endpoint: Endpoint
    raw: bytes
    body: dict[str, Any]
    model: str
    stream: bool
    max_tokens: int | None
    n: int
    user: str | None
    client_wants_usage: bool  # stream_options.include_usage was set by the client
    forward: bytes  # what goes upstream (``forward_body``)

    @property
    def is_chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT

    def forward_body(self) -> bytes:
        return self.forward


def forward_body(raw: bytes, body: dict[str, Any], stream: bool,
                 client_wants_usage: bool) -> bytes:
    """The bytes to send upstream: the client's own, unless a stream needs its usage chunk."""
    if not stream or client_wants_usage:
        return raw
    if "stream_options" not in body:
        # A valid object with at least one member (``model``): the new member goes first.
        start = raw.index(b"{") + 1
        return raw[:start] + b'"stream_options":{"include_usage":true},' + raw[start:]
    try:
        body = json.loads(raw)
        options = body.get("stream_options")
        body["stream_options"] = {**(options if isinstance(options, dict) else {}),
                                  "include_usage": True}
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except RecursionError:  # orjson took it, the standard library cannot re-encode it
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


def parse_body(raw: bytes, endpoint: Endpoint) -> ParsedRequest:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")

    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string", param="model")

    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise bad_request("`messages` is required and must be a non-empty array",
                              param="messages")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise bad_request(f"messages[{i}] must be an object with a string `role`",
                                  param=f"messages.{i}")
    else:
        prompt = body.get("prompt")
        if not _valid_prompt(prompt):
            raise bad_request(
                "`prompt` is required: a string, an array of strings, an array of token ids,"
                " or an array of token-id arrays",
                param="prompt",
            )

    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", param="stream")

    max_tokens: int | None = None
    for field in ("max_completion_tokens", "max_tokens"):
        v = _integral(body.get(field))
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise bad_request(f"`{field}` must be a positive integer", param=field)
        max_tokens = v
        break

    n = _integral(body.get("n", 1))
    if n is None:
        n = 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1 or n > 128:
        raise bad_request("`n` must be an integer between 1 and 128", param="n")

    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("`user` must be a string", param="user")

    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("`stream_options` must be an object", param="stream_options")
    wants_usage = bool(options.get("include_usage")) if isinstance(options, dict) else False

    return ParsedRequest(
        endpoint=endpoint,
        raw=raw,
        body=body,
        model=model,
        stream=stream,
        max_tokens=max_tokens,
        n=n,
        user=user,
        client_wants_usage=wants_usage,
        forward=forward_body(raw, body, stream, wants_usage),
    )


def _integral(value: Any) -> Any:
    """2.0 -> 2, as vLLM's pydantic models accept it; anything else unchanged."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return int(value)
    return value


def _valid_prompt(prompt: Any) -> bool:
    if isinstance(prompt, str):
        return True
    if not isinstance(prompt, list) or not prompt:
        return False
    if all(isinstance(p, str) for p in prompt):
        return True
    if all(_is_token(t) for t in prompt):
        return True
    return all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt)


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31


def session_id_from(header: str | None, user: str | None, api_key_id: str | None) -> str | None:
    """DESIGN's identity rule: X-Session-ID, else `user`, else the API key, else none.

    The id is made safe for logs, store keys and metric labels by the one rule in
    ``gateway.budgets.session_id`` (long or odd ids keep a readable prefix plus a hash).
    """
    for candidate in (header, user, api_key_id):
        session = sanitize_session_id(candidate)
        if session is not None:
            return session
    return None

"""Step 1 of the request path: parse and validate only the fields the gateway needs.

Everything else in the body is forwarded to the worker untouched. The body is parsed with orjson
(fast). Its output limit is read by vLLM 0.32's rules for the route (``OUTPUT LIMITS`` below),
because the budget reserves what vLLM will really generate.

The gateway changes a body in two cases: a stream whose client did not ask for the usage chunk
gets ``stream_options.include_usage``, and a chat request without an output limit gets the limit
the gateway reserved (``routing.default_max_tokens``) as ``max_completion_tokens`` (``max_tokens``
when the former is there as null). New members are spliced into the client's bytes in front of
the others, with no re-encoding; only when a member is already there (``stream_options``, or both
limit fields given as null) are the original bytes re-parsed with the standard library, so
integers wider than 64 bits survive exactly, and encoded again. Every other body goes upstream
byte for byte.

OUTPUT LIMITS (vLLM 0.32, ``entrypoints/openai/*/protocol.py`` and ``get_max_tokens``):

* chat: ``max_completion_tokens``, else ``max_tokens``; with neither, vLLM generates up to the
  rest of the context (``max_model_len`` - prompt), which no budget can reserve honestly. The
  gateway writes its reserved limit into the body instead (the alternative, reserving the
  pool's whole context for every such request, would refuse most of them for budget);
* completions: ``max_tokens`` only (``max_completion_tokens`` is not a field there and vLLM
  ignores it); absent or null means 16; 0 with ``echo`` means "echo the prompt", which still
  generates one token;
* every prompt (a completions batch) runs ``n`` sequences of that limit; ``use_beam_search``
  keeps ``n`` beams; ``best_of`` is not a field of either request in vLLM 0.32 (ignored, so it
  multiplies nothing); ``min_tokens`` and ``ignore_eos`` only decide how much of the limit is
  used. vLLM clamps the limit to the context left, so the reservation is never below it.

A prompt the gateway cannot count is refused with 400 ``unsupported_content``: ``prompt_embeds``
here, media content parts in ``gateway.prompt.render``.
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
    max_tokens: int  # the most tokens vLLM generates per sequence (OUTPUT LIMITS above)
    n: int  # sequences per prompt
    user: str | None
    client_wants_usage: bool  # stream_options.include_usage was set by the client
    forward: bytes  # what goes upstream (``forward_body``)

    @property
    def is_chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT

    def forward_body(self) -> bytes:
        return self.forward


def usage_for_gateway_only(options: Any) -> dict[str, Any]:
    """The ``stream_options`` forwarded for a stream whose client did not ask for usage: the
    final usage chunk (the gateway accounts on it; the relay drops it), and no usage on every
    chunk. vLLM sends per-chunk usage only when ``include_usage`` and ``continuous_usage_stats``
    are both set (``should_include_usage``): a client that set the latter alone gets none from
    vLLM, so it must get none through the gateway either."""
    return {**(options if isinstance(options, dict) else {}), "include_usage": True,
            "continuous_usage_stats": False}


def forward_body(raw: bytes, body: dict[str, Any], stream: bool, client_wants_usage: bool,
                 written_limit: tuple[str, int] | None) -> bytes:
    """The bytes to send upstream: the client's own, unless a stream needs its usage chunk or
    ``written_limit`` (field, tokens) must be set (a chat request that gave no output limit)."""
    add_usage = stream and not client_wants_usage
    if not add_usage and written_limit is None:
        return raw
    if (not (add_usage and "stream_options" in body)
            and not (written_limit is not None and written_limit[0] in body)):
        # A valid object with at least one member (``model``): the new members go first.
        start = raw.index(b"{") + 1
        members = b'"stream_options":{"include_usage":true},' if add_usage else b""
        if written_limit is not None:
            members += b'"%s":%d,' % (written_limit[0].encode(), written_limit[1])
        return raw[:start] + members + raw[start:]
    try:
        body = json.loads(raw)
        if add_usage:
            body["stream_options"] = usage_for_gateway_only(body.get("stream_options"))
        if written_limit is not None:
            body[written_limit[0]] = written_limit[1]
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except RecursionError:  # orjson took it, the standard library cannot re-encode it
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


def parse_body(raw: bytes, endpoint: Endpoint, *, default_max_tokens: int) -> ParsedRequest:
    """The request's fields; ``default_max_tokens``: the limit of a chat request without one."""
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
        if body.get("prompt_embeds") is not None:
            raise bad_request(
                "`prompt_embeds` cannot be counted by the gateway (it budgets KV cache by the"
                " prompt's tokens): send the prompt as text or token ids",
                param="prompt_embeds", code="unsupported_content",
            )
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

    max_tokens, written_limit = _output_limit(body, endpoint, default_max_tokens)

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
        forward=forward_body(raw, body, stream, wants_usage, written_limit),
    )


COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""vLLM's ``CompletionRequest.max_tokens`` default (also for an explicit null)."""


def _output_limit(body: dict[str, Any], endpoint: Endpoint,
                  default_max_tokens: int) -> tuple[int, tuple[str, int] | None]:
    """The per-sequence limit vLLM will apply, and the (field, limit) to write into the body
    when the client gave none and vLLM would otherwise run to the end of the context."""
    if endpoint is Endpoint.COMPLETIONS:
        v = _integral(body.get("max_tokens"))
        if v is None:
            return COMPLETIONS_DEFAULT_MAX_TOKENS, None
        if v == 0 and not isinstance(v, bool) and body.get("echo") is True:
            return 1, None  # vLLM echoes the prompt and samples one token
        return _positive(v, "max_tokens"), None
    for field in ("max_completion_tokens", "max_tokens"):
        v = _integral(body.get(field))
        if v is not None:
            return _positive(v, field), None
    # A member the body lacks (spliced, not re-encoded); both present as null: re-encoded.
    field = "max_tokens" if "max_completion_tokens" in body and "max_tokens" not in body \
        else "max_completion_tokens"
    return default_max_tokens, (field, default_max_tokens)


def _positive(value: Any, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise bad_request(f"`{field}` must be a positive integer", param=field)
    return value


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


def session_id_from(header: str | None, user: str | None) -> str | None:
    """The session the client names: X-Session-ID, else `user`, else none (the budget service
    then charges the tenant's default session; routing sees no session).

    Always scoped inside the request's tenant (``gateway.budgets.session_id``). The id is made
    safe for logs, store keys and metric labels by the one rule there (long or odd ids keep a
    readable prefix plus a hash).
    """
    for candidate in (header, user):
        session = sanitize_session_id(candidate)
        if session is not None:
            return session
    return None

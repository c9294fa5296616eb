"""Step 1 of the request path: parse and validate only the fields the gateway needs.

Everything else in the body is forwarded to the worker untouched. The body is parsed with orjson
(fast). Its output limit is read by vLLM 0.32's rules for the route (``OUTPUT LIMITS`` below),
because the budget reserves what vLLM will really generate.

The gateway changes a body in three cases: a stream whose client did not ask for the usage chunk
gets ``stream_options.include_usage``, a chat request without an output limit gets the limit
the gateway reserved (``routing.default_max_tokens``) as ``max_completion_tokens`` (``max_tokens``
when the former is there as null), and a background Responses request gets its ``request_id``
(the id the gateway watches it by: ``/v1/responses`` below). New members are spliced into the client's bytes in front of
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

import hashlib
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

import orjson

from gateway.budgets.session_id import sanitize_session_id
from gateway.errors import bad_request
from gateway.prompt.limits import Truncation
from gateway.prompt.pooling import PoolingInputs
from gateway.prompt.tokenize import TokenizeInput


class Endpoint(StrEnum):
    CHAT = "chat/completions"
    COMPLETIONS = "completions"
    RESPONSES = "responses"  # rendered as chat (``gateway.prompt.render.responses_conversation``)
    # vLLM's pooling routes (``gateway.prompt.pooling``): a pooling model's, never generating.
    EMBEDDINGS = "embeddings"
    SCORE = "score"
    RERANK = "rerank"
    CLASSIFY = "classify"
    POOLING = "pooling"

    @property
    def is_pooling(self) -> bool:
        return self in POOLING_ENDPOINTS

    @property
    def upstream_path(self) -> str:
        """The worker's path for this route: vLLM 0.32 serves ``/classify`` and ``/pooling``
        without the ``/v1`` prefix."""
        return _UPSTREAM_PATHS[self]


POOLING_ENDPOINTS = frozenset({Endpoint.EMBEDDINGS, Endpoint.SCORE, Endpoint.RERANK,
                               Endpoint.CLASSIFY, Endpoint.POOLING})
POOLING_PATHS = {
    "/v1/embeddings": Endpoint.EMBEDDINGS,
    "/score": Endpoint.SCORE,
    "/v1/score": Endpoint.SCORE,
    "/rerank": Endpoint.RERANK,
    "/v1/rerank": Endpoint.RERANK,
    "/v2/rerank": Endpoint.RERANK,
    "/classify": Endpoint.CLASSIFY,
    "/pooling": Endpoint.POOLING,
}
"""vLLM 0.32's paths of the pooling routes, the gateway's and the simulator's."""
_UNVERSIONED = {Endpoint.CLASSIFY: "/classify", Endpoint.POOLING: "/pooling"}
_UPSTREAM_PATHS = {e: _UNVERSIONED.get(e) or f"/v1/{e.value}" for e in Endpoint}
"""Made once: per request the path is one lookup (a property and an f-string cost ~1 us)."""


@dataclass(frozen=True, init=False)
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
    pooling: PoolingInputs | None = None  # the sequences of a pooling route's request
    # Responses: the stored response whose conversation this continues (its worker holds it),
    # and whether the worker is asked to store this one (``store``, vLLM's default true).
    previous_response_id: str | None = None
    store: bool = False
    # Responses with ``background: true``: the id the gateway gave it (``request_id`` in the
    # forwarded body), so the response can be watched even if its answer never comes back.
    background_id: str | None = None
    # vLLM's ``cache_salt``: the prompt's cached blocks are shared only with requests of the same
    # salt (``checked_cache_salt``).
    cache_salt: str | None = None
    # False: vLLM computes the whole prompt, whatever is cached (``reads_prefix_cache``).
    reads_prefix_cache: bool = True
    # ``truncate_prompt_tokens``: vLLM cuts each prompt so before it runs it (chat, completions)
    truncation: Truncation | None = None

    def __init__(
        self, endpoint: Endpoint, raw: bytes, body: dict[str, Any], model: str, stream: bool,
        max_tokens: int, n: int, user: str | None, client_wants_usage: bool, forward: bytes,
        pooling: PoolingInputs | None = None, previous_response_id: str | None = None,
        store: bool = False, background_id: str | None = None, cache_salt: str | None = None,
        reads_prefix_cache: bool = True, truncation: Truncation | None = None,
    ) -> None:
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "raw", raw)
        object.__setattr__(self, "body", body)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "n", n)
        object.__setattr__(self, "user", user)
        object.__setattr__(self, "client_wants_usage", client_wants_usage)
        object.__setattr__(self, "forward", forward)
        object.__setattr__(self, "pooling", pooling)
        object.__setattr__(self, "previous_response_id", previous_response_id)
        object.__setattr__(self, "store", store)
        object.__setattr__(self, "background_id", background_id)
        object.__setattr__(self, "cache_salt", cache_salt)
        object.__setattr__(self, "reads_prefix_cache", reads_prefix_cache)
        object.__setattr__(self, "truncation", truncation)

    @property
    def is_chat(self) -> bool:
        return self.endpoint is Endpoint.CHAT

    @property
    def is_responses(self) -> bool:
        return self.endpoint is Endpoint.RESPONSES

    def forward_body(self) -> bytes:
        return self.forward


def one_sequence(parsed: ParsedRequest) -> bool:
    """Whether the request generates one sequence: ``n`` 1 of one prompt (a chat, a Responses
    turn, a completion of a string, of a list of token ids or of a batch of one). vLLM's
    per-chunk usage (``continuous_usage_stats``) counts one choice's tokens of one prompt, so it
    is the whole request's only then."""
    if parsed.n != 1:
        return False
    if parsed.endpoint is not Endpoint.COMPLETIONS:
        return True
    prompt = parsed.body.get("prompt")
    return not isinstance(prompt, list) or len(prompt) == 1 or all(_is_token(t) for t in prompt)


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


def parse_body(raw: bytes, endpoint: Endpoint, *, default_max_tokens: int,
               aliases: Mapping[str, str] | None = None) -> ParsedRequest:
    """The request's fields; ``default_max_tokens``: the limit of a chat request without one.
    ``aliases`` (``model_aliases``): a client name is resolved here, once, to its served name,
    which the forwarded body carries (vLLM answers 404 to a name it does not serve)."""
    parsed = _parse_fields(raw, endpoint, default_max_tokens)
    served = aliases.get(parsed.model) if aliases else None
    if served is None:
        return parsed
    return replace(parsed, model=served, forward=_with_member(parsed.forward, "model", served))


def _with_member(forward: bytes, name: str, value: str) -> bytes:
    """``forward`` with its member ``name`` set to ``value`` (re-encoded with the standard
    library, as ``forward_body`` does, so integers wider than 64 bits survive)."""
    try:
        body = json.loads(forward)
        body[name] = value
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()
    except RecursionError:
        raise bad_request("request body is nested too deeply", code="invalid_json") from None


TENANT_SALT_PREFIX = "kvgate-"
"""What every salt ``tenant_cache_salt`` derives starts with; refused from a client of a key whose
prefix cache is shared, which could otherwise name an isolated key's salt (it is derived from
the key's name, which is no secret) and time that key's cached prompts."""


def salted_for(parsed: ParsedRequest, tenant: str, isolated: bool) -> ParsedRequest:
    """The request with the ``cache_salt`` its tenant's requests get: ``isolated`` (the key's
    ``isolate_prefix_cache``), one derived from the tenant (``tenant_cache_salt``); otherwise
    the client's own, unless it is one the gateway reserves (400)."""
    if isolated:
        return with_cache_salt(parsed, tenant_cache_salt(tenant, parsed.cache_salt))
    if parsed.cache_salt is not None and parsed.cache_salt.startswith(TENANT_SALT_PREFIX):
        raise bad_request(f"`cache_salt` values starting with {TENANT_SALT_PREFIX!r} are the"
                          " gateway's (the salts of keys with a prefix cache of their own)",
                          param="cache_salt", code="reserved_cache_salt")
    return parsed


def tenant_cache_salt(tenant: str, client_salt: str | None) -> str:
    """The ``cache_salt`` of a request of a tenant whose prefix cache is its own
    (``auth.api_keys[].isolate_prefix_cache``): derived from the tenant and the client's own
    salt, so one tenant's requests share cached blocks with each other (per client salt) and
    never with another tenant's, whatever salt a client sends (it cannot name another tenant's:
    the gateway derives every isolated request's salt from its own key). Hex: within vLLM's
    rules (at most 128 characters, none of ``@ / \\`` or NUL)."""
    name = tenant.encode()
    data = len(name).to_bytes(4, "little") + name + (client_salt or "").encode()
    digest = hashlib.blake2b(data, digest_size=16, person=b"kvgate-tenant").hexdigest()
    return TENANT_SALT_PREFIX + digest


def with_cache_salt(parsed: ParsedRequest, salt: str) -> ParsedRequest:
    """``parsed`` with ``salt`` as its ``cache_salt``, for routing and in the forwarded body (a
    member the body lacks is spliced in, as ``forward_body`` splices; one it has is replaced)."""
    forward = parsed.forward
    if "cache_salt" in parsed.body:
        forward = _with_member(forward, "cache_salt", salt)
    else:
        start = forward.index(b"{") + 1
        forward = forward[:start] + b'"cache_salt":"' + salt.encode() + b'",' + forward[start:]
    return replace(parsed, forward=forward, cache_salt=salt)


def _parse_fields(raw: bytes, endpoint: Endpoint, default_max_tokens: int) -> ParsedRequest:
    body = _json_object(raw)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("`model` is required and must be a non-empty string", param="model")
    _refuse_transfer_params(body)
    _check_priority(body.get("priority"))
    salt = checked_cache_salt(body.get("cache_salt"))

    if endpoint.is_pooling:
        return ParsedRequest(
            endpoint=endpoint, raw=raw, body=body, model=model, stream=False, max_tokens=0,
            n=1, user=_user(body), client_wants_usage=False, forward=raw,
            pooling=_pooling_inputs(body, endpoint), cache_salt=salt,
        )
    if endpoint is Endpoint.RESPONSES:
        return _parse_responses(raw, body, model, default_max_tokens, salt)
    if endpoint is Endpoint.CHAT:
        _check_messages(body.get("messages"))
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

    user = _user(body)

    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise bad_request("`stream_options` must be an object", param="stream_options")
    wants_usage = False
    if isinstance(options, dict):
        for flag in ("include_usage", "continuous_usage_stats"):
            # JSON booleans only: vLLM's lax parsing reads "false" or 0 as false, which the
            # gateway would read as true (no usage asked for it: the stream charged in full)
            value = options.get(flag)
            if value is not None and not isinstance(value, bool):
                raise bad_request(f"`stream_options.{flag}` must be a boolean",
                                  param=f"stream_options.{flag}")
        wants_usage = options.get("include_usage") is True

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
        cache_salt=salt,
        reads_prefix_cache=reads_prefix_cache(body, endpoint),
        truncation=truncation_of(body, generation=True),
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


def _json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    return body


TRANSFER_PARAMS = ("kv_transfer_params", "ec_transfer_params")
"""vLLM's fields for disaggregated serving: where to pull a prompt's KV (or encoder cache) from,
or to keep it for another worker. They are the gateway's to write (``gateway.upstream.disagg``),
never a client's: one could make a worker pull from any host it names, pin blocks it never
frees, or (a value that is not an object) fail the worker's request handling. vLLM also reads
them from ``vllm_xargs``, so they are refused there too."""


_TRANSFER_FIELDS = frozenset({*TRANSFER_PARAMS, "vllm_xargs"})


def _refuse_transfer_params(body: dict[str, Any]) -> None:
    if _TRANSFER_FIELDS.isdisjoint(body):
        return  # the usual body names none of them: one C call, not a loop of lookups
    xargs = body.get("vllm_xargs")
    for field in TRANSFER_PARAMS:
        sent = body.get(field) is not None
        if not sent and not (isinstance(xargs, dict) and field in xargs):
            continue
        raise bad_request(
            f"`{field}` is set by the gateway (prefill/decode disaggregation), not by clients",
            param=field if sent else "vllm_xargs", code="unsupported_parameter")


def reads_prefix_cache(body: Mapping[str, Any], endpoint: Endpoint) -> bool:
    """Whether vLLM serves the prompt from its prefix cache: not when the request asks for the
    prompt's logprobs, which vLLM 0.32 then computes for every prompt token (its sampling
    params' ``skip_reading_prefix_cache``, from ``prompt_logprobs``: set by the client, or by
    ``echo`` with ``logprobs`` on completions, and by ``echo`` on chat, where ``top_logprobs``
    defaults to 0). Such a request is routed by load alone: no worker's cache helps it (its
    blocks are still cached afterwards). Evaluation harnesses send exactly these (loglikelihood
    requests: a completion with ``echo`` and ``logprobs``), many sharing a few-shot prefix."""
    if body.get("prompt_logprobs") is not None:
        return False
    if body.get("echo") is not True:
        return True
    return endpoint is Endpoint.COMPLETIONS and body.get("logprobs") is None


CACHE_SALT_MAX_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def checked_cache_salt(value: Any) -> str | None:
    """vLLM's ``cache_salt`` as its ``validate_cache_salt`` takes it, with its messages (what
    vLLM would refuse is refused before the gateway reserves or routes anything). vLLM adds the
    salt to the hash of a prompt's first block, so every block of a salted prompt is cached
    only for requests of the same salt; the prefix index keys them so too
    (``gateway.kvindex.events.chain_root``)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.",
                          param="cache_salt")
    if len(value) > CACHE_SALT_MAX_CHARS or not _CACHE_SALT_FORBIDDEN.isdisjoint(value):
        raise bad_request("Parameter 'cache_salt' must be at most 128 characters and must not"
                          " contain '@', '/', '\\\\', or NUL.", param="cache_salt")
    return value


def _check_priority(priority: Any) -> None:
    """vLLM's ``priority`` (a worker with ``--scheduling-policy priority`` runs lower values
    first and preempts running requests of higher ones; others refuse any value but 0): a
    client may lower its own request's standing, never raise it above the default 0 that every
    other tenant's requests have, or one key could preempt every other key's requests on the
    worker. Only a JSON integer >= 0 passes (vLLM would also coerce ``"-5"`` or ``-5.0``)."""
    if priority is None:
        return
    if isinstance(priority, bool) or not isinstance(priority, int) or priority < 0:
        raise bad_request(
            "`priority` must be an integer >= 0: requests cannot be put ahead of the default"
            " priority 0 other clients' requests have", param="priority",
            code="invalid_priority")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` is required and must be a non-empty array",
                          param="messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] must be an object with a string `role`",
                              param=f"messages.{i}")


def _user(body: dict[str, Any]) -> str | None:
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request("`user` must be a string", param="user")
    return user


# -- /v1/responses (vLLM 0.32: ``entrypoints/openai/responses/protocol.py``, ``serving.py``) -----
#
# The output limit is ``max_output_tokens``; without it vLLM generates up to the rest of the
# context (``get_max_tokens``, as chat), so the gateway writes its reserved limit
# (``routing.default_max_tokens``) into the body. One sequence (there is no ``n``). The answer
# always carries its usage (the ``response.completed`` event of a stream), so no
# ``stream_options`` is added and nothing the worker sends is dropped.
#
# ``background: true`` (vLLM with its store on): vLLM answers at once (status ``queued``, no
# output; streamed: the events as they come) and generates after the answer, until retrieved
# as ``completed``/``incomplete``/``failed`` or cancelled. The request is tokenized, routed and
# admitted as any other, and its budget reservation and worker hold outlive the answer: the
# dispatcher hands them to ``gateway.upstream.background``, which polls the owner and releases
# them on the final status. So the watcher can find the response even when its answer never
# reached the gateway (a client gone before the first byte), the gateway names it: a fresh
# ``resp_`` + 32 hex digits id, vLLM's own format, written as ``request_id``. vLLM refuses
# ``background`` without ``store`` (400, its message): so does the gateway, before any worker
# is asked. ``background`` and ``store`` must then be JSON booleans: vLLM's lax parsing would
# take ``"true"`` or ``1``, which the gateway could misread as not background.
#
# Refused before any worker is asked:
# * ``request_id``: vLLM makes it the response's id, the key of the conversation it stores; a
#   client-chosen one could overwrite another tenant's stored response on that worker.


MAX_RESPONSE_ID_CHARS = 256
"""Longest response id accepted (vLLM's are ``resp_`` + 32 hex digits): it becomes a key."""


def _parse_responses(raw: bytes, body: dict[str, Any], model: str,
                     default_max_tokens: int, cache_salt: str | None) -> ParsedRequest:
    items = body.get("input")
    if not (isinstance(items, str) or (isinstance(items, list) and items)):
        raise bad_request("`input` is required: a string or a non-empty array of input items",
                          param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("`instructions` must be a string", param="instructions")
    background = _background(body)
    if "request_id" in body:
        raise bad_request(
            "`request_id` is set by the worker for a Responses request (it becomes the id of"
            " the stored response)", param="request_id", code="unsupported_parameter")
    previous = body.get("previous_response_id")
    if previous is not None and not (isinstance(previous, str)
                                     and 0 < len(previous) <= MAX_RESPONSE_ID_CHARS):
        raise bad_request(f"`previous_response_id` must be a string of 1 to"
                          f" {MAX_RESPONSE_ID_CHARS} characters", param="previous_response_id")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean", param="stream")
    limit = _integral(body.get("max_output_tokens"))
    written = None
    if limit is None:
        limit, written = default_max_tokens, ("max_output_tokens", default_max_tokens)
    forward = forward_body(raw, body, bool(stream), True, written)
    truncation = body.get("truncation", "disabled")
    if truncation not in ("auto", "disabled", None):
        raise bad_request("`truncation` must be 'auto' or 'disabled'", param="truncation")
    background_id = None
    if background:
        background_id = f"resp_{uuid.uuid4().hex}"
        start = forward.index(b"{") + 1  # a member goes first, as ``forward_body`` splices
        forward = (forward[:start] + b'"request_id":"' + background_id.encode() + b'",'
                   + forward[start:])
    return ParsedRequest(
        endpoint=Endpoint.RESPONSES, raw=raw, body=body, model=model, stream=bool(stream),
        max_tokens=_positive(limit, "max_output_tokens"), n=1, user=_user(body),
        client_wants_usage=True, forward=forward,
        previous_response_id=previous, store=body.get("store", True) is True,
        background_id=background_id, cache_salt=cache_salt,
        # vLLM cuts the conversation to the model's length unless truncation is "disabled"
        truncation=None if truncation == "disabled" else Truncation(-1, left=True),
    )


def _background(body: dict[str, Any]) -> bool:
    """Whether a Responses request runs in the background; 400 where vLLM refuses it (without
    ``store``) and where its lax parsing could read another value than the gateway does."""
    background = body.get("background")
    if background is None or background is False:
        return False
    if background is not True:
        raise bad_request("`background` must be a boolean", param="background")
    if body.get("store", True) is not True:
        if body.get("store") not in (None, False):
            raise bad_request("`store` must be a boolean", param="store")
        # vLLM's words (``ResponsesRequest.validate_background``)
        raise bad_request("background can only be used when `store` is true",
                          param="background")
    return True


# -- the pooling routes (vLLM 0.32's request shapes: ``gateway.prompt.pooling``) ------------------

_SCORE_SIDES = (("data_1", "data_2"), ("queries", "documents"), ("queries", "items"),
                ("text_1", "text_2"))
_NOT_COUNTED = ("cannot be counted by the gateway (it budgets KV cache by the tokens of text"
                " inputs): send text or token ids")


def truncation_of(body: Mapping[str, Any], *, generation: bool) -> Truncation | None:
    """vLLM's ``truncate_prompt_tokens`` / ``truncation_side`` (``TokenizeParams``, on the
    generation and the pooling routes alike), checked as vLLM checks them. Without a side,
    the tokenizer's, which vLLM sets by runner (``tokenizers/registry.py``): left (keep the
    last tokens) for a generation model, right for a pooling one."""
    cut = _integral(body.get("truncate_prompt_tokens"))
    side = body.get("truncation_side")
    if cut is None and side is None:
        return None
    if cut is not None and (not isinstance(cut, int) or isinstance(cut, bool) or cut < -1):
        raise bad_request("`truncate_prompt_tokens` must be an integer of at least -1",
                          param="truncate_prompt_tokens")
    if side not in (None, "left", "right"):
        raise bad_request("`truncation_side` must be either 'left' or 'right'.",
                          param="truncation_side")
    left = side == "left" if side is not None else generation
    return None if cut is None else Truncation(cut, left)


def _pooling_inputs(body: dict[str, Any], endpoint: Endpoint) -> PoolingInputs:
    cut = truncation_of(body, generation=False)
    if endpoint in (Endpoint.SCORE, Endpoint.RERANK):
        sides = (("query", "documents"),) if endpoint is Endpoint.RERANK else _SCORE_SIDES
        if endpoint is Endpoint.SCORE:
            _one_shape(body, _score_shapes(body))
        names = next((pair for pair in sides if all(n in body for n in pair)), sides[0])
        if endpoint is Endpoint.RERANK and isinstance(body.get("query"), list):
            raise bad_request("`query` must be a string", param="query")
        queries = _score_texts(body.get(names[0]), names[0])
        documents = _score_texts(body.get(names[1]), names[1])
        if len(queries) != 1 and len(queries) != len(documents):
            raise bad_request("Input lengths must be either 1:1, 1:N or N:N", param=names[0])
        return PoolingInputs(texts=(*queries, *documents), truncation=cut,
                             queries=len(queries))
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise bad_request("`add_special_tokens` must be a boolean", param="add_special_tokens")
    if body.get("input") is not None and body.get("messages") is not None:
        _one_shape(body, [("input",), ("messages",)])
    if "input" not in body and body.get("messages") is not None:
        _check_messages(body["messages"])
        _check_generation_prompt(body)
        # ``add_special_tokens`` (default false) is read by ``encode_chat`` from the body
        return PoolingInputs(messages=tuple(body["messages"]), truncation=cut)
    value = body.get("input")
    if "data" in body and value is None:
        raise bad_request(f"`data` (an IO processor plugin's input) {_NOT_COUNTED}",
                          param="data", code="unsupported_content")
    add_special = special is not False
    if isinstance(value, str):
        return PoolingInputs(texts=(value,), add_special_tokens=add_special,
                             truncation=cut)
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return PoolingInputs(texts=tuple(value), add_special_tokens=add_special,
                                 truncation=cut)
        if all(_is_token(t) for t in value):
            return PoolingInputs(token_ids=(tuple(value),), truncation=cut)
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in value):
            return PoolingInputs(token_ids=tuple(tuple(p) for p in value), truncation=cut)
    raise bad_request(
        "`input` is required: a string, an array of strings, an array of token ids, or an"
        " array of token-id arrays (or `messages`, one conversation)", param="input")


def _score_shapes(body: dict[str, Any]) -> list[tuple[str, ...]]:
    """The score request shapes ``body`` carries members of (``queries`` counts as one only
    without ``documents`` or ``items``, which it goes with)."""
    has = {n for pair in _SCORE_SIDES for n in pair if body.get(n) is not None}
    groups: tuple[tuple[str, ...], ...] = (("data_1", "data_2"), ("text_1", "text_2"),
                                           ("documents",), ("items",))
    shapes = [s for s in groups if has.intersection(s)]
    if "queries" in has and not has.intersection(("documents", "items")):
        shapes.append(("queries",))
    return shapes


def _one_shape(body: dict[str, Any], shapes: Sequence[tuple[str, ...]]) -> None:
    """400 for a pooling body that carries more than one request shape (``shapes``: those it
    carries): vLLM runs the one its union of request types picks, which the gateway need not
    have counted, so a small shape's charge could cover a large one's run."""
    if len(shapes) > 1:
        named = " and ".join("/".join(f"`{n}`" for n in s if n in body) for s in shapes)
        raise bad_request(f"{named} are different request shapes: send one", param=shapes[-1][0],
                          code="ambiguous_request")


def _score_texts(value: Any, param: str) -> list[str]:
    """One side of a score or rerank request: a string or an array of strings."""
    items = value if isinstance(value, list) else [value]
    if value is None or not items:
        raise bad_request(f"`{param}` is required: a string or a non-empty array of strings",
                          param=param)
    for i, item in enumerate(items):
        if not isinstance(item, str):
            raise bad_request(f"{param}[{i}] is not a string: media {_NOT_COUNTED}",
                              param=f"{param}.{i}", code="unsupported_content")
    return items


# -- /tokenize and /detokenize (``gateway.prompt.tokenize``) -----------------------------------------


def parse_tokenize(raw: bytes) -> tuple[str | None, TokenizeInput]:
    """The model named (None: not named) and what a ``/tokenize`` body asks for."""
    body = _json_object(raw)
    model = _optional_model(body)
    special = body.get("add_special_tokens")
    if special is not None and not isinstance(special, bool):
        raise bad_request("`add_special_tokens` must be a boolean", param="add_special_tokens")
    strs = body.get("return_token_strs")
    if strs is not None and not isinstance(strs, bool):
        raise bad_request("`return_token_strs` must be a boolean", param="return_token_strs")
    if "messages" in body:
        _check_messages(body["messages"])
        _check_generation_prompt(body)
        # vLLM's chat form encodes without special tokens unless asked (the template wrote them)
        return model, TokenizeInput(body, None, tuple(body["messages"]), special is True,
                                    strs is True)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise bad_request("`prompt` (a string) or `messages` is required", param="prompt")
    return model, TokenizeInput(body, prompt, (), special is not False, strs is True)


def _check_generation_prompt(body: dict[str, Any]) -> None:
    """vLLM's ``check_generation_prompt`` of its chat-form requests (tokenize, pooling): both
    options given truthy (as sent, before any coercion) is refused."""
    if body.get("continue_final_message") and body.get("add_generation_prompt"):
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt`"
                          " to True.", param="continue_final_message")


def parse_detokenize(raw: bytes) -> tuple[str | None, list[int]]:
    """The model named (None: not named) and the token ids of a ``/detokenize`` body."""
    body = _json_object(raw)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_token(t) for t in tokens):
        raise bad_request("`tokens` must be an array of token ids (integers from 0 to 2^31-1)",
                          param="tokens")
    return _optional_model(body), tokens


def _optional_model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and not (isinstance(model, str) and model):
        raise bad_request("`model` must be a non-empty string", param="model")
    return model


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


SLO_TTFT_HEADER = "x-slo-ttft-ms"
SLO_TPOT_HEADER = "x-slo-tpot-ms"
_SLO_MAX_CHARS = 16


def slo_seconds_from(values: list[str], header: str, max_ms: float) -> float | None:
    """A latency objective header (``x-slo-ttft-ms`` / ``x-slo-tpot-ms``, ``values``: every
    occurrence) in seconds; None when absent. Milliseconds as a plain decimal (``250``,
    ``62.5``), above 0 and at most ``max_ms``; anything else (0, negative, NaN, inf, exponents,
    underscores, units, a header sent twice) is a 400: a client that sent an objective must
    not be served as if it had sent none."""
    if not values:
        return None
    if len(values) > 1:
        raise bad_request(f"`{header}` was sent {len(values)} times; send it once",
                          param=header, code="invalid_slo")
    text = values[0].strip()
    if not (0 < len(text) <= _SLO_MAX_CHARS and text.count(".") <= 1
            and text.replace(".", "").isascii() and text.replace(".", "").isdigit()
            and not text.startswith(".") and not text.endswith(".")):
        raise bad_request(f"`{header}` must be a number of milliseconds, not {values[0][:32]!r}",
                          param=header, code="invalid_slo")
    ms = float(text)
    if not 0 < ms <= max_ms:
        raise bad_request(f"`{header}` must be above 0 and at most {max_ms:.0f} ms, not {text}",
                          param=header, code="invalid_slo")
    return ms / 1e3

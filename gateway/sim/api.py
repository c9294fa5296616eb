"""The simulated worker's HTTP API: vLLM 0.32's OpenAI-compatible surface, as a bare ASGI app.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /ping``, ``GET /version``, ``GET /load``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /kv_event_sources``,
``POST /reset_prefix_cache``.

Shapes are vLLM's: streaming chunks are serialised the way vLLM's pydantic models are with
``exclude_unset`` (the first chunk carries ``{"role": "assistant", "content": ""}`` and goes out
with the first token; the last content chunk carries ``finish_reason``; with
``stream_options.include_usage`` a final chunk has ``"choices": []`` and ``usage``; then
``data: [DONE]``). Like vLLM's output collector, tokens that pile up while a client reads slowly
are merged into one chunk. Non-streaming bodies carry every field vLLM's response models have.
Unknown request fields are ignored; ``ignore_eos``, ``min_tokens``, ``seed`` and ``n`` are
honoured, and so is a completions batch (several prompts: ``n`` choices each, choice index
``prompt * n + k``, usage summed with each prompt counted once). Output limits follow vLLM's
rules per route: chat takes ``max_completion_tokens``, else ``max_tokens``, else the rest of the
context (capped by ``SimWorkerConfig.default_max_tokens`` unless that is None); completions take
``max_tokens`` only (default 16; 0 with ``echo`` generates one token) and ignore
``max_completion_tokens``. A limit is clamped to the context left. Messages are rendered as vLLM
renders them (``gateway.prompt.render.vllm_conversation``); media parts are refused, as vLLM does
for a text-only model. The choices of a stream are sent one after the other (vLLM interleaves
them); the tokens are generated concurrently either way.

Why no FastAPI: sixteen workers share one process and two cores. A bare ASGI app has no request
models, dependency injection or middleware to run per request and per chunk; uvicorn still
parses HTTP. The whole path (engine, scheduler, metrics, SSE) costs about 30-60 us of CPU per
streamed token (``python -m gateway.sim.measure``). A client that disconnects aborts its request,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.prompt.render import UncountableContentError, vllm_conversation
from gateway.prompt.tokenizer import PromptTooComplexError
from gateway.sim.engine import RequestStream, TokenEvent

if TYPE_CHECKING:
    from gateway.sim.worker import SimWorker

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

VLLM_COMPAT_VERSION = "0.32.0"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens default
JSON = [(b"content-type", b"application/json")]
SSE = [(b"content-type", b"text/event-stream; charset=utf-8")]
DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before its request body arrived."""


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, type_: str = "BadRequestError", param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type_
        self.param = param

    def body(self) -> bytes:
        return orjson.dumps(
            {
                "error": {
                    "message": self.message,
                    "type": self.type,
                    "param": self.param,
                    "code": self.status,
                }
            }
        )


def _sse(obj: Mapping[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SimApp:
    """ASGI app of one simulated worker."""

    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker
        self._routes: dict[tuple[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]] = {
            ("GET", "/health"): self._health,
            ("GET", "/ping"): self._health,
            ("POST", "/ping"): self._health,
            ("GET", "/version"): self._version,
            ("GET", "/load"): self._load,
            ("GET", "/v1/models"): self._models,
            ("GET", "/metrics"): self._metrics,
            ("GET", "/kv_event_sources"): self._kv_event_sources,
            ("POST", "/tokenize"): self._tokenize,
            ("POST", "/detokenize"): self._detokenize,
            ("POST", "/reset_prefix_cache"): self._reset_prefix_cache,
            ("POST", "/v1/chat/completions"): self._chat,
            ("POST", "/v1/completions"): self._completions,
        }
        self._paths = {path for _, path in self._routes}
        self.inflight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        handler = self._routes.get((scope["method"], path))
        if handler is None:
            status = 405 if path in self._paths else 404
            detail = "Method Not Allowed" if status == 405 else "Not Found"
            await _respond(send, status, orjson.dumps({"detail": detail}))
            return
        try:
            await handler(scope, receive, send)
        except ApiError as exc:
            await _respond(send, exc.status, exc.body())
        except ClientGone:
            return

    @staticmethod
    async def _lifespan(receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- small endpoints --------------------------------------------------------------------

    async def _health(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, b"", headers=[])

    async def _version(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, orjson.dumps({"version": VLLM_COMPAT_VERSION}))

    async def _load(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, orjson.dumps({"server_load": self.inflight}))

    async def _models(self, scope: Scope, receive: Receive, send: Send) -> None:
        w = self.worker
        created = int(w.started_at)
        card = {
            "id": w.config.model_name,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": w.config.model_name,
            "parent": None,
            "max_model_len": w.max_model_len,
            "permission": [
                {
                    "id": f"modelperm-{uuid.uuid4().hex}",
                    "object": "model_permission",
                    "created": created,
                    "allow_create_engine": False,
                    "allow_sampling": True,
                    "allow_logprobs": True,
                    "allow_search_indices": False,
                    "allow_view": True,
                    "allow_fine_tuning": False,
                    "organization": "*",
                    "group": None,
                    "is_blocking": False,
                }
            ],
        }
        await _respond(send, 200, orjson.dumps({"object": "list", "data": [card]}))

    async def _metrics(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(
            send, 200, self.worker.metrics.render(),
            headers=[(b"content-type", CONTENT_TYPE_LATEST.encode())],
        )  # fmt: skip

    async def _kv_event_sources(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _respond(send, 200, orjson.dumps(self.worker.kv_event_sources()))

    async def _reset_prefix_cache(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _read_body(receive)
        if not self.worker.engine.reset_prefix_cache():
            raise ApiError(
                500,
                "Failed to reset prefix cache: requests are running",
                type_="InternalServerError",
            )
        await _respond(send, 200, b"", headers=[])

    async def _tokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        self._check_model(body)
        tok = self.worker.tokenizer
        if "messages" in body:
            ids = self._encode_chat(body)
        elif isinstance(body.get("prompt"), str):
            ids = tok.encode_text(body["prompt"], bool(body.get("add_special_tokens", True)))
        else:
            raise ApiError(400, "either 'prompt' (a string) or 'messages' is required")
        strs = [tok.decode([t]) for t in ids] if body.get("return_token_strs") else None
        out = {
            "count": len(ids),
            "max_model_len": self.worker.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
        await _respond(send, 200, orjson.dumps(out))

    async def _detokenize(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        self._check_model(body)
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ApiError(400, "'tokens' must be a list of integers", param="tokens")
        await _respond(send, 200, orjson.dumps({"prompt": self.worker.tokenizer.decode(tokens)}))

    # -- generation -------------------------------------------------------------------------

    def _check_model(self, body: Mapping[str, Any]) -> str:
        name = self.worker.config.model_name
        model = body.get("model")
        if model is not None and model != name:
            raise ApiError(
                404, f"The model `{model}` does not exist.", type_="NotFoundError", param="model"
            )
        return name

    def _encode_chat(self, body: Mapping[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, Mapping) for m in messages):
            raise ApiError(400, "'messages' must be a list of message objects", param="messages")
        try:
            return self.worker.tokenizer.encode_chat(vllm_conversation(messages), body)
        except UncountableContentError as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        except PromptTooComplexError as exc:
            raise ApiError(400, str(exc), param="messages") from exc

    def _encode_prompts(self, body: Mapping[str, Any]) -> list[list[int]]:
        """Every prompt of a completions request: a string or token ids, or a batch of either."""
        prompt = body.get("prompt")
        add_special = bool(body.get("add_special_tokens", True))
        if isinstance(prompt, str):
            return [self.worker.tokenizer.encode_text(prompt, add_special)]
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            return [list(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(isinstance(p, str) for p in prompt):
                return [self.worker.tokenizer.encode_text(p, add_special) for p in prompt]
            if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
                return [list(p) for p in prompt]
        raise ApiError(
            400, "'prompt' must be a string, a list of token ids, or a batch of either",
            param="prompt",
        )

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        body = await _read_json(receive)
        model = self._check_model(body)
        ids = self._encode_chat(body)
        await self._generate(body, [ids], model, arrival, receive, send, chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        body = await _read_json(receive)
        model = self._check_model(body)
        prompts = self._encode_prompts(body)
        await self._generate(body, prompts, model, arrival, receive, send, chat=False)

    async def _generate(
        self,
        body: Mapping[str, Any],
        prompts: list[list[int]],
        model: str,
        arrival: float,
        receive: Receive,
        send: Send,
        *,
        chat: bool,
    ) -> None:
        n = body.get("n", 1)
        n = 1 if n is None and chat else n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ApiError(400, f"n must be at least 1, got {n}.", param="n")
        limits = [self._max_tokens(body, len(ids), chat) for ids in prompts]
        stream_flag = bool(body.get("stream", False))
        raw_options = body.get("stream_options")
        options: Mapping[str, Any] = raw_options if isinstance(raw_options, Mapping) else {}
        include_usage = stream_flag and bool(options.get("include_usage", False))
        continuous_usage = include_usage and bool(options.get("continuous_usage_stats", False))

        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        single = len(prompts) == 1 and n == 1
        # One engine request per choice, in choice order (prompt * n + k), as vLLM numbers them.
        streams = [
            self.worker.submit(
                request_id if single else f"{request_id}-{p}-{k}", ids, body,
                max_tokens=limit, arrival_time=arrival, choice=k,
            )
            for p, (ids, limit) in enumerate(zip(prompts, limits, strict=True))
            for k in range(n)
        ]
        self.inflight += 1
        watcher = asyncio.get_running_loop().create_task(_wait_disconnect(receive))
        engine = self.worker.engine

        def _abort_all() -> None:
            for s in streams:
                engine.abort(s.request.request_id)  # no-op once finished

        def _client_gone(task: asyncio.Task[None]) -> None:
            if not task.cancelled():
                _abort_all()

        watcher.add_done_callback(_client_gone)
        prompt_streams = streams[::n]  # each prompt counted once in usage
        try:
            if stream_flag:
                await self._stream(send, streams, prompt_streams, request_id, model, chat,
                                   include_usage, continuous_usage, watcher)
            else:
                await self._complete(send, streams, prompt_streams, request_id, model, chat,
                                     watcher)
        finally:
            self.inflight -= 1
            watcher.cancel()
            _abort_all()  # frees the blocks of a cancelled handler

    def _max_tokens(self, body: Mapping[str, Any], prompt_len: int, chat: bool) -> int:
        """vLLM's output limit for one prompt (``get_max_tokens`` and the request models)."""
        limit = self.worker.max_model_len
        if prompt_len >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains {prompt_len} input tokens, which exceeds this limit even without any "
                f"output tokens. Please reduce the length of the input prompt.",
                param="input_tokens",
            )
        if chat:
            field = "max_completion_tokens"
            if body.get(field) is None:
                field = "max_tokens"
            raw = body.get(field)
            if raw is None:
                default = self.worker.config.default_max_tokens
                return limit - prompt_len if default is None else min(default, limit - prompt_len)
        else:
            field = "max_tokens"  # max_completion_tokens is no field of a completions request
            raw = body.get(field)
            if raw is None:
                raw = COMPLETIONS_DEFAULT_MAX_TOKENS
            elif raw == 0 and body.get("echo"):
                return 1  # echo without generation still samples one token
        if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
            raise ApiError(400, f"{field} must be at least 1, got {raw}.", param=field)
        if raw > limit:
            raise ApiError(
                400,
                f"{field}={raw} cannot be greater than max_model_len={limit}",
                param=field,
            )
        return min(raw, limit - prompt_len)

    def _usage(self, prompt_streams: list[RequestStream], completion_tokens: int) -> dict[str, Any]:
        prompt_tokens = sum(s.request.num_prompt_tokens for s in prompt_streams)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if self.worker.config.enable_prompt_tokens_details:
            cached = sum(s.request.num_cached_tokens for s in prompt_streams)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def _stream(
        self,
        send: Send,
        streams: list[RequestStream],
        prompt_streams: list[RequestStream],
        request_id: str,
        model: str,
        chat: bool,
        include_usage: bool,
        continuous_usage: bool,
        watcher: asyncio.Task[None],
    ) -> None:
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": request_id, "object": obj, "created": created, "model": model}
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        text_of = self.worker.token_text
        emitted = 0
        last = len(streams) - 1
        for index, stream in enumerate(streams):
            first = True
            while True:
                batch = await stream.next_batch()
                if not batch:  # aborted
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                out = bytearray()
                if first and chat:
                    role = {
                        **head,
                        "choices": [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                    if continuous_usage:
                        role["usage"] = self._usage(prompt_streams, emitted)
                    out += _sse(role)
                first = False
                emitted += len(batch)
                text = "".join(text_of(e.token_id) for e in batch)
                finish = batch[-1].finish_reason
                choice: dict[str, Any]
                if chat:
                    choice = {
                        "index": index,
                        "delta": {"content": text},
                        "logprobs": None,
                        "finish_reason": finish,
                    }
                    if finish is not None:
                        choice["stop_reason"] = None
                    choice["token_ids"] = None
                else:
                    choice = {
                        "index": index,
                        "text": text,
                        "logprobs": None,
                        "finish_reason": finish,
                        "stop_reason": None,
                        "prompt_token_ids": None,
                        "token_ids": None,
                    }
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if continuous_usage:
                    chunk["usage"] = self._usage(prompt_streams, emitted)
                out += _sse(chunk)
                if finish is not None and index == last:
                    watcher.cancel()
                    if include_usage:
                        out += _sse({**head, "choices": [],
                                     "usage": self._usage(prompt_streams, emitted)})
                    out += DONE
                    await send({"type": "http.response.body", "body": bytes(out),
                                "more_body": False})
                    return
                await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
                if finish is not None:
                    break

    async def _complete(
        self,
        send: Send,
        streams: list[RequestStream],
        prompt_streams: list[RequestStream],
        request_id: str,
        model: str,
        chat: bool,
        watcher: asyncio.Task[None],
    ) -> None:
        text_of = self.worker.token_text
        choices: list[dict[str, Any]] = []
        generated = 0
        for index, stream in enumerate(streams):
            events: list[TokenEvent] = []
            while True:
                batch = await stream.next_batch()
                if not batch:
                    return  # aborted: the client is gone, nobody to answer
                events.extend(batch)
                if batch[-1].finish_reason is not None:
                    break
            generated += len(events)
            text = "".join(text_of(e.token_id) for e in events)
            finish = events[-1].finish_reason
            if chat:
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": None,
                    "audio": None,
                    "function_call": None,
                    "tool_calls": [],
                    "reasoning": None,
                }
                choices.append({"index": index, "message": message, "logprobs": None, "finish_reason": finish, "stop_reason": None, "token_ids": None})  # fmt: skip
            else:
                choices.append({"index": index, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None, "prompt_logprobs": None})  # fmt: skip
        usage = self._usage(prompt_streams, generated)
        created = int(time.time())
        body: dict[str, Any]
        if chat:
            body = {
                "id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": choices,
                "service_tier": None, "system_fingerprint": None,
                "usage": {**usage, "prompt_tokens_details": usage.get("prompt_tokens_details")},
                "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None,
            }  # fmt: skip
        else:
            body = {
                "id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": choices,
                "service_tier": None, "system_fingerprint": None,
                "usage": {**usage, "prompt_tokens_details": usage.get("prompt_tokens_details")},
                "kv_transfer_params": None,
            }  # fmt: skip
        watcher.cancel()
        await _respond(send, 200, orjson.dumps(body))


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _read_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _read_json(receive: Receive) -> dict[str, Any]:
    raw = await _read_body(receive)
    try:
        body = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError as exc:
        raise ApiError(400, f"invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


async def _respond(
    send: Send, status: int, body: bytes, *, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    hdrs = list(JSON if headers is None else headers)
    hdrs.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body, "more_body": False})

"""The simulated worker's HTTP API: vLLM 0.32's OpenAI-compatible surface, as a bare ASGI app.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (SSE streaming or not),
``GET /v1/models``, ``GET /health``, ``GET /ping``, ``GET /version``, ``GET /load``,
``GET /metrics``, ``POST /tokenize``, ``POST /detokenize``, ``GET /kv_event_sources``,
``POST /reset_prefix_cache``; a worker with ``runner: pooling`` serves vLLM's pooling routes
(``gateway.sim.pooling``) instead of the generation routes. A worker with a ``kv_role`` answers
``kv_transfer_params`` as vLLM's NIXL connector does and serves the pulls of its held blocks on
``POST /sim/kv_transfer/pull`` (``gateway.sim.kvtransfer``); without one the field is ignored.

Shapes are vLLM's: streaming chunks are serialised the way vLLM's pydantic models are with
``exclude_unset`` (the first chunk carries ``{"role": "assistant", "content": ""}`` and goes out
with the first token; the last content chunk carries ``finish_reason``; with
``stream_options.include_usage`` a final chunk has ``"choices": []`` and ``usage``; then
``data: [DONE]``). Like vLLM's output collector, tokens that pile up while a client reads slowly
are merged into one chunk. Non-streaming bodies carry every field vLLM's response models have.
Unknown request fields are ignored; ``ignore_eos``, ``min_tokens``, ``seed`` and ``n`` are
honoured, and so is a completions batch (several prompts: ``n`` choices each, choice index
``prompt * n + k``, usage summed with each prompt counted once). ``logprobs``/``top_logprobs``,
``stop``, ``echo``, ``stream_options``, ``tools``/``tool_choice`` and ``response_format`` are
validated and answered as vLLM does (``gateway.sim.output``). Output limits follow vLLM's
rules per route: chat takes ``max_completion_tokens``, else ``max_tokens``, else the rest of the
context (capped by ``SimWorkerConfig.default_max_tokens`` unless that is None); completions take
``max_tokens`` only (default 16; 0 with ``echo`` generates one token) and ignore
``max_completion_tokens``. A limit is clamped to the context left. Messages are rendered as vLLM
renders them (``gateway.prompt.render.vllm_conversation``); media parts are refused, as vLLM does
for a text-only model. The choices of a stream are interleaved as their tokens come, as vLLM
sends them.

Why no FastAPI: sixteen workers share one process and two cores. A bare ASGI app has no request
models, dependency injection or middleware to run per request and per chunk; uvicorn still
parses HTTP. The whole path (engine, scheduler, metrics, SSE) costs about 30-60 us of CPU per
streamed token (``python -m gateway.sim.measure``). A client that disconnects aborts its request,
which frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST

from gateway.config import Runner
from gateway.errors import GatewayError
from gateway.prompt.render import UncountableContentError, vllm_conversation
from gateway.prompt.tokenizer import PromptTooComplexError, message_text
from gateway.request import (
    POOLING_PATHS,
    Endpoint,
    checked_cache_salt,
    reads_prefix_cache,
    truncation_of,
)
from gateway.sim import pooling, responses
from gateway.sim.engine import Bell, RequestStream
from gateway.sim.kvcache import SimLora
from gateway.sim.kvtransfer import NOT_LOADED, PULL_PATH, PullRefused
from gateway.sim.output import (
    ChoiceText,
    OutputSpec,
    PromptRow,
    SpecError,
    chat_logprobs,
    completion_logprobs,
    echoed_completion_logprobs,
    output_spec,
    prompt_logprob_rows,
    script_tokens,
    vllm_prompt_logprobs,
)

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
            ("POST", "/v1/responses"): self._responses,
        }
        if worker.config.runner is Runner.POOLING:  # vLLM serves one kind of route per model
            self._routes = {key: route for key, route in self._routes.items()
                            if key[1] not in pooling.GENERATION_PATHS}
            for path, endpoint in POOLING_PATHS.items():
                self._routes["POST", path] = functools.partial(self._pooling, endpoint)
        if worker.kv_transfer is not None:  # NIXL's side channel exists only with a connector
            self._routes["POST", PULL_PATH] = self._kv_pull
        if worker.config.allow_runtime_lora_updating:  # vLLM adds these routes only then
            self._routes["POST", "/v1/load_lora_adapter"] = self._load_lora
            self._routes["POST", "/v1/unload_lora_adapter"] = self._unload_lora
        self._paths = {path for _, path in self._routes}
        # LoRA adapters served (vLLM's ``OpenAIServingModels.lora_requests``), ids from 1
        self.loras: dict[str, SimLora] = {}
        self._lora_ids = itertools.count(1)
        for name, path in worker.config.lora_modules:
            self.loras[name] = SimLora(name, next(self._lora_ids), path)
        self.responses = responses.ResponseStore()  # this worker's stored responses
        self.inflight = 0
        # vLLM's is its version and a hash of its configuration.
        config_hash = zlib.crc32(repr(worker.config).encode())
        self.fingerprint = f"vllm-{VLLM_COMPAT_VERSION}-{config_hash:08x}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path = scope["path"].rstrip("/") or "/"
        handler = self._routes.get((scope["method"], path))
        if handler is None and path.startswith("/v1/responses/"):
            handler = self._stored_response  # GET /v1/responses/{id}, POST .../cancel
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
        cards = [card] + [
            {**card, "id": lora.name, "root": lora.path, "parent": w.config.model_name,
             "max_model_len": None}
            for lora in self.loras.values()
        ]
        await _respond(send, 200, orjson.dumps({"object": "list", "data": cards}))

    async def _load_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/load_lora_adapter`` with vLLM's checks and answers (a text body)."""
        body = await _read_json(receive)
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ApiError(400, "Both 'lora_name' and 'lora_path' must be provided.",
                           type_="InvalidUserInput")
        if name == self.worker.config.model_name:
            raise ApiError(400, f"The lora adapter '{name}' conflicts with a served base model.",
                           type_="InvalidUserInput")
        previous = self.loras.get(name)
        if previous is not None and body.get("load_inplace") is not True:
            raise ApiError(400, f"The lora adapter '{name}' has already been loaded. If you want"
                           " to load the adapter in place, set 'load_inplace' to True.",
                           type_="InvalidUserInput")
        lora_id = previous.lora_id if previous is not None else next(self._lora_ids)
        self.loras[name] = SimLora(name, lora_id, path)
        await _respond(send, 200, f"Success: LoRA adapter '{name}' added successfully.".encode(),
                       headers=[])

    async def _unload_lora(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await _read_json(receive)
        name = body.get("lora_name")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "'lora_name' needs to be provided to unload a LoRA adapter.",
                           type_="InvalidUserInput")
        if self.loras.pop(name, None) is None:
            raise ApiError(404, f"The lora adapter '{name}' cannot be found.",
                           type_="NotFoundError")
        await _respond(send, 200,
                       f"Success: LoRA adapter '{name}' removed successfully.".encode(),
                       headers=[])

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

    async def _kv_pull(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A decode worker reads a held prefill's blocks (NIXL's read + notification)."""
        body = await _read_json(receive)
        assert self.worker.kv_transfer is not None
        try:
            answer = self.worker.kv_transfer.pull(body)
        except PullRefused as exc:
            raise ApiError(exc.status, str(exc), type_="NotFoundError" if exc.status == 404
                           else "BadRequestError") from exc
        await _respond(send, 200, orjson.dumps(answer))

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
        strs = tok.token_strings(ids) if body.get("return_token_strs") else None
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

    async def _pooling(self, endpoint: Endpoint, scope: Scope, receive: Receive,
                       send: Send) -> None:
        w = self.worker
        try:
            answer = pooling.pooling_answer(endpoint, await _read_body(receive), w.tokenizer,
                                            w.config.model_name, w.max_model_len)
        except pooling.PoolingRefused as exc:
            type_ = "NotFoundError" if exc.status == 404 else "BadRequestError"
            raise ApiError(exc.status, str(exc), type_=type_, param=exc.param) from exc
        await _respond(send, 200, orjson.dumps(answer))

    # -- generation -------------------------------------------------------------------------

    def _check_model(self, body: Mapping[str, Any]) -> str:
        name = self.worker.config.model_name
        model = body.get("model")
        if isinstance(model, str) and model in self.loras:
            return str(model)  # vLLM answers a LoRA request with the adapter's name
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

    def _truncated(self, body: Mapping[str, Any], prompts: list[list[int]]) -> list[list[int]]:
        """The prompts as vLLM cuts them for ``truncate_prompt_tokens`` (``TokenizeParams``:
        -1 keeps the model's length less one token for the output), with its checks."""
        try:
            cut = truncation_of(body, generation=True)
        except GatewayError as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        if cut is None:
            return prompts
        limit = self.worker.config.max_model_len
        if cut.tokens > limit:
            raise ApiError(400, f"truncate_prompt_tokens={cut.tokens} cannot be greater than"
                           f" max_model_len = {limit}. Please request a smaller truncation size.",
                           param="truncate_prompt_tokens")
        return [cut.apply(p, limit - 1) for p in prompts]

    async def _chat(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        body = await _read_json(receive)
        model = self._check_model(body)
        ids = self._encode_chat(body)
        await self._generate(body, self._truncated(body, [ids]), model, arrival, receive, send,
                             chat=True)

    async def _completions(self, scope: Scope, receive: Receive, send: Send) -> None:
        arrival = time.monotonic()
        body = await _read_json(receive)
        model = self._check_model(body)
        prompts = self._truncated(body, self._encode_prompts(body))
        await self._generate(body, prompts, model, arrival, receive, send, chat=False)

    async def _responses(self, scope: Scope, receive: Receive, send: Send) -> None:
        """``POST /v1/responses`` (``gateway.sim.responses``)."""
        arrival = time.monotonic()
        body = await _read_json(receive)
        model = self._check_model(body)
        try:
            turn = self.responses.turn(body)
            ids = self.worker.tokenizer.encode_chat(vllm_conversation(turn.messages),
                                                    turn.options)
        except responses.ResponsesRefused as exc:
            raise _refused(exc) from exc
        except (UncountableContentError, PromptTooComplexError) as exc:
            raise ApiError(400, str(exc), param="input") from exc
        limit = self._max_tokens({"max_tokens": body.get("max_output_tokens")}, len(ids), True)
        stream = self.worker.submit(turn.response_id, ids, body, max_tokens=limit,
                                    arrival_time=arrival)
        engine, rid = self.worker.engine, turn.response_id
        if turn.background:  # generates on after this answer; only a cancel aborts it
            await self.responses.background(send, turn, body, model, limit, stream,
                                            self.worker.token_text,
                                            functools.partial(engine.abort, rid))
            return
        self.inflight += 1
        watcher = asyncio.get_running_loop().create_task(_wait_disconnect(receive))

        def _client_gone(task: asyncio.Task[None]) -> None:
            if not task.cancelled():
                engine.abort(rid)

        watcher.add_done_callback(_client_gone)
        try:
            if body.get("stream"):
                await responses.stream_answer(responses.EventWriter(send), self.responses, turn,
                                              body, model, limit, stream, self.worker.token_text)
                return
            final = await responses.whole_answer(turn, body, model, limit, stream,
                                                 self.worker.token_text)
            if final is not None:
                self.responses.save(turn, final)
                await _respond(send, 200, orjson.dumps(final))
        finally:
            self.inflight -= 1
            watcher.cancel()
            engine.abort(rid)

    async def _stored_response(self, scope: Scope, receive: Receive, send: Send) -> None:
        response_id, _, action = scope["path"].removeprefix("/v1/responses/").partition("/")
        try:
            if scope["method"] == "GET" and not action:
                answer = self.responses.get(response_id)
            elif scope["method"] == "POST" and action == "cancel":
                answer = self.responses.cancel(response_id)
            else:
                await _respond(send, 404, orjson.dumps({"detail": "Not Found"}))
                return
        except responses.ResponsesRefused as exc:
            raise _refused(exc) from exc
        await _respond(send, 200, orjson.dumps(answer))

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
        if not all(prompts):  # vLLM's input check (``_validate_model_input``)
            raise ApiError(400, "The decoder prompt cannot be empty")
        try:
            spec = output_spec(body, chat=chat,
                               tool_parser=self.worker.config.tool_call_parser is not None)
        except SpecError as exc:
            raise ApiError(400, str(exc), param=exc.param) from exc
        try:
            salt = checked_cache_salt(body.get("cache_salt"))  # vLLM's rule and messages
        except GatewayError as exc:
            raise ApiError(400, str(exc), param="cache_salt") from exc
        n = spec.n
        limits = [self._max_tokens(body, len(ids), chat) for ids in prompts]
        stream_flag = bool(body.get("stream", False))
        forced: list[int] = []
        pieces: list[str] = []
        if spec.script is not None:
            forced, pieces = script_tokens(self.worker.tokenizer, spec.script)

        kv_hold, load = False, NOT_LOADED
        kvt = self.worker.kv_transfer
        params = body.get("kv_transfer_params") if kvt is not None else None
        if isinstance(params, Mapping):  # vLLM ignores the field without a connector
            kv_hold = bool(params.get("do_remote_decode"))
            if params.get("do_remote_prefill") and len(prompts) == 1:
                assert kvt is not None
                load = await kvt.load(prompts[0], params, self.loras.get(model), salt)
                if load.failed:
                    await self._load_failed(send, stream_flag)
                    return

        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        single = len(prompts) == 1 and n == 1
        bell = None if single else Bell()  # one reader wakes for the tokens of every choice
        # One engine request per choice, in choice order (prompt * n + k), as vLLM numbers them.
        streams = [
            self.worker.submit(
                request_id if single else f"{request_id}-{p}-{k}", ids, body,
                max_tokens=limit, arrival_time=arrival, choice=k, forced_token_ids=forced,
                bell=bell, lora=self.loras.get(model), cache_salt=salt, kv_hold=kv_hold,
                skip_reading_prefix_cache=not reads_prefix_cache(
                    body, Endpoint.CHAT if chat else Endpoint.COMPLETIONS),
                remote_kv=load.loaded, remote_cached_tokens=load.cached_tokens,
            )
            for p, (ids, limit) in enumerate(zip(prompts, limits, strict=True))
            for k in range(n)
        ]
        texts = [ChoiceText(spec, self.worker.token_text, pieces, streaming=stream_flag)
                 for _ in streams]
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
        answer = _Answer(request_id, model, chat, spec, streams, texts, prompt_streams,
                         self._echoes(body, prompts, chat) if spec.echo else None)
        try:
            if stream_flag:
                await self._stream(send, answer, watcher)
            else:
                await self._complete(send, answer, watcher)
        finally:
            self.inflight -= 1
            watcher.cancel()
            _abort_all()  # frees the blocks of a cancelled handler (and of a stop string)

    @staticmethod
    async def _load_failed(send: Send, stream: bool) -> None:
        """vLLM's answer to a failed KV load under ``kv_load_failure_policy: fail``: the request
        finishes with reason ``error``, raised as ``GenerationError`` (500), or, streaming, sent
        as an error event before ``[DONE]``."""
        error = ApiError(500, "Internal server error", type_="InternalServerError")
        if not stream:
            raise error
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        await send({"type": "http.response.body", "body": b"data: " + error.body() + b"\n\n"
                    + DONE, "more_body": False})

    def _echoes(self, body: Mapping[str, Any], prompts: list[list[int]], chat: bool) -> list[str]:
        """What ``echo`` puts before each prompt's answer: completions, the prompt's text; chat,
        the last message's content when it is the assistant's (vLLM's rule)."""
        if chat:
            messages = body.get("messages") or [{}]
            last = messages[-1]
            own = isinstance(last, Mapping) and last.get("role") == "assistant"
            return [message_text(last.get("content")) if own else ""]
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
            return list(prompt)
        return [self.worker.tokenizer.decode(ids) for ids in prompts]

    def _max_tokens(self, body: Mapping[str, Any], prompt_len: int, chat: bool) -> int:
        """vLLM's output limit for one prompt (``get_max_tokens`` and the request models)."""
        limit = self.worker.max_model_len
        if prompt_len >= limit:
            raise ApiError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your prompt "
                f"contains at least {prompt_len} input tokens, which exceeds this limit even "
                f"without any output tokens. Please reduce the length of the input prompt. "
                f"(parameter=input_tokens, value={prompt_len})",
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
                f"{field}={raw} cannot be greater than max_model_len={limit}. Please request "
                f"fewer output tokens. (parameter={field}, value={raw})",
                param=field,
            )
        return min(raw, limit - prompt_len)

    def _usage(self, prompt_streams: list[RequestStream], completion_tokens: int, *,
               details: bool = True) -> dict[str, Any]:
        """Usage as vLLM reports it; ``details``: with ``prompt_tokens_details`` when the worker
        reports them (vLLM's continuous usage chunks never carry them, only the final usage)."""
        prompt_tokens = sum(s.request.num_prompt_tokens for s in prompt_streams)
        usage: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
        }
        if details and self.worker.config.enable_prompt_tokens_details:
            # a decode reports the producer's hit, not its own ~100 % from the transfer (vLLM)
            cached = sum(s.request.num_cached_tokens if s.request.remote_cached_tokens is None
                         else s.request.remote_cached_tokens for s in prompt_streams)
            usage["prompt_tokens_details"] = {"cached_tokens": cached}
        return usage

    async def _stream(self, send: Send, a: _Answer, watcher: asyncio.Task[None]) -> None:
        """Chunks as vLLM sends them: the choices interleaved as their tokens come; for chat,
        first a role chunk per choice (and the echo), then content; a choice's last content
        chunk carries its ``finish_reason``; the usage chunk (if asked) and ``[DONE]`` last."""
        created = int(time.time())
        obj = "chat.completion.chunk" if a.chat else "text_completion"
        head = {"id": a.request_id, "object": obj, "created": created, "model": a.model}
        await send({"type": "http.response.start", "status": 200, "headers": SSE})
        continuous = a.spec.continuous_usage
        bell = a.streams[0].bell
        started = False
        n = a.spec.n
        echoes = a.echoes
        offsets = [0 if echoes is None else len(echoes[i // n]) for i in range(len(a.streams))]
        unsent = [echoes is not None] * len(a.streams)  # each choice's echo, with its first chunk
        prompt_rows = None if a.chat else self._prompt_rows(a)  # echo with logprobs shows them
        while True:
            out = bytearray()
            for index, (stream, text) in enumerate(zip(a.streams, a.texts, strict=True)):
                if text.finished:
                    continue
                batch = stream.take()
                if not batch:
                    if stream.closed:  # aborted: the client is gone
                        await send({"type": "http.response.body", "body": b"",
                                    "more_body": False})
                        return
                    continue
                if not started and a.chat:
                    out += self._chat_openers(head, a, continuous)
                started = True
                engine_finish = batch[-1].finish_reason
                delta, rows = text.add([e.token_id for e in batch], engine_finish is not None)
                finish = a.finish_reason(text, engine_finish)
                if text.finished and engine_finish is None:
                    self.worker.engine.abort(stream.request.request_id)  # a stop string
                logprobs: Any = None
                choice: dict[str, Any]
                if a.chat:
                    if rows is not None:
                        logprobs = chat_logprobs(rows, a.spec.logprobs or 0)
                    choice = {"index": index, "delta": a.chat_delta(index, delta, text),
                              "logprobs": logprobs, "finish_reason": finish}
                    if finish is not None:
                        choice["stop_reason"] = text.stop_reason
                    choice["token_ids"] = None
                else:
                    prompt_ids = None
                    if echoes is not None and unsent[index]:
                        # vLLM's first chunk of the choice: the prompt and the first tokens
                        # (the prompt alone for ``max_tokens: 0``), the prompt's logprobs first
                        unsent[index] = False
                        request = a.prompt_streams[index // n].request
                        prompt_ids = request.token_ids[: request.num_prompt_tokens]
                        if a.spec.echo_only:
                            delta, rows = "", None if rows is None else []
                        delta = echoes[index // n] + delta
                        if rows is not None and prompt_rows is not None:
                            logprobs = echoed_completion_logprobs(
                                prompt_ids, prompt_rows[index // n], self.worker.token_text,
                                rows)
                            tokens = logprobs["tokens"]
                            offsets[index] = (logprobs["text_offset"][-1] + len(tokens[-1])
                                              if tokens else 0)
                            rows = None
                    if rows is not None:
                        logprobs, offsets[index] = completion_logprobs(rows, offsets[index])
                    choice = {"index": index, "text": delta, "logprobs": logprobs,
                              "finish_reason": finish, "stop_reason": text.stop_reason,
                              "prompt_token_ids": prompt_ids, "token_ids": None}
                chunk: dict[str, Any] = {**head, "choices": [choice]}
                if finish is not None and not a.spec.include_usage:
                    chunk["system_fingerprint"] = self.fingerprint
                if continuous:
                    chunk["usage"] = self._usage([a.prompt_streams[index // n]], text.tokens,
                                                 details=False)
                out += _sse(chunk)
            if not out:
                await bell.wait()
                continue
            if all(t.finished for t in a.texts):
                watcher.cancel()
                if a.spec.include_usage:
                    out += _sse({**head, "choices": [], "usage": self._usage(
                        a.prompt_streams, sum(t.tokens for t in a.texts)),
                        "system_fingerprint": self.fingerprint})
                out += DONE
                await send({"type": "http.response.body", "body": bytes(out), "more_body": False})
                return
            await send({"type": "http.response.body", "body": bytes(out), "more_body": True})

    def _chat_openers(self, head: Mapping[str, Any], a: _Answer, continuous: bool) -> bytes:
        out = bytearray()
        echo = a.echoes[0] if a.echoes else ""
        for delta in ({"role": "assistant", "content": ""}, {"content": echo}):
            if "role" not in delta and not echo:
                break
            for index in range(len(a.streams)):
                chunk: dict[str, Any] = {**head, "choices": [
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]}
                if "role" in delta:
                    chunk |= {"prompt_token_ids": None, "prompt_text": None}
                if continuous:
                    chunk["usage"] = self._usage(a.prompt_streams, 0, details=False)
                out += _sse(chunk)
        return bytes(out)

    def _prompt_rows(self, a: _Answer) -> list[list[PromptRow]] | None:
        """Each prompt's logprobs, when the request asks for them (``OutputSpec``)."""
        k = a.spec.prompt_logprobs
        if k is None:
            return None
        out = []
        for stream in a.prompt_streams:
            ids = stream.request.token_ids[: stream.request.num_prompt_tokens]
            out.append(prompt_logprob_rows(ids, k, self.worker.token_text,
                                           self.worker.token_choices(ids)))
        return out

    async def _complete(self, send: Send, a: _Answer, watcher: asyncio.Task[None]) -> None:
        choices: list[dict[str, Any]] = []
        n = a.spec.n
        prompt_rows = self._prompt_rows(a)
        for index, (stream, text) in enumerate(zip(a.streams, a.texts, strict=True)):
            parts: list[str] = []
            rows: list[Any] = []
            engine_finish: str | None = None
            while not text.finished:
                batch = await stream.next_batch()
                if not batch:
                    return  # aborted: the client is gone, nobody to answer
                engine_finish = batch[-1].finish_reason
                delta, new_rows = text.add([e.token_id for e in batch], engine_finish is not None)
                parts.append(delta)
                rows.extend(new_rows or ())
            if engine_finish is None:
                self.worker.engine.abort(stream.request.request_id)  # a stop string
            content = "".join(parts)
            if a.spec.echo_only:  # vLLM samples one token and shows only the prompt
                content, rows = "", []
            finish = a.finish_reason(text, engine_finish)
            logprobs: Any = None
            if a.chat:
                if a.spec.logprobs is not None:
                    logprobs = chat_logprobs(rows, a.spec.logprobs)
                message = a.chat_message(index, content)
                choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish, "stop_reason": text.stop_reason, "token_ids": None, "routed_experts": None})  # fmt: skip
            else:
                echo = "" if a.echoes is None else a.echoes[index // n]
                own = None if prompt_rows is None else prompt_rows[index // n]
                if a.spec.logprobs is not None and a.echoes is not None and own is not None:
                    request = stream.request
                    logprobs = echoed_completion_logprobs(
                        request.token_ids[: request.num_prompt_tokens], own,
                        self.worker.token_text, rows)
                elif a.spec.logprobs is not None:
                    logprobs, _ = completion_logprobs(rows, len(echo))
                content = echo + content
                shown = None if own is None else vllm_prompt_logprobs(own)
                choices.append({"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish, "stop_reason": text.stop_reason, "token_ids": None, "prompt_logprobs": shown, "prompt_token_ids": None, "routed_experts": None})  # fmt: skip
        usage = self._usage(a.prompt_streams, sum(t.tokens for t in a.texts))
        body: dict[str, Any] = {
            "id": a.request_id, "object": "chat.completion" if a.chat else "text_completion",
            "created": int(time.time()), "model": a.model, "choices": choices,
            "service_tier": None, "system_fingerprint": self.fingerprint,
            "usage": {**usage, "prompt_tokens_details": usage.get("prompt_tokens_details"),
                      "completion_tokens_details": None},
        }
        if a.chat:  # vLLM's chat response has the prompt's fields; both end in the same three
            body |= {"prompt_logprobs": None if prompt_rows is None
                     else vllm_prompt_logprobs(prompt_rows[0]),
                     "prompt_token_ids": None, "prompt_text": None}
        kvt = self.worker.kv_transfer
        kv_params = kvt.params_for(a.streams[0].request.request_id) if kvt is not None else None
        body |= {"kv_transfer_params": kv_params, "ec_transfer_params": None, "metrics": None}
        watcher.cancel()
        await _respond(send, 200, orjson.dumps(body))


@dataclass(slots=True)
class _Answer:
    """One generation request's choices on their way out, and the vLLM rules that shape them."""

    request_id: str
    model: str
    chat: bool
    spec: OutputSpec
    streams: list[RequestStream]
    texts: list[ChoiceText]
    prompt_streams: list[RequestStream]
    echoes: list[str] | None
    called: set[int] = field(default_factory=set)
    """The choices whose tool call has started (its id and name sent)."""

    def finish_reason(self, text: ChoiceText, engine_finish: str | None) -> str | None:
        if not text.finished:
            return None
        if text.stop_reason is not None:
            return "stop"
        if self.spec.tool_required and engine_finish == "stop":
            return "tool_calls"  # OpenAI's: "tool_calls" for required, "stop" for a named tool
        return engine_finish

    def chat_delta(self, index: int, delta: str, text: ChoiceText) -> dict[str, Any]:
        """A stream chunk's delta: content; a named tool's arguments as they come; the calls of
        ``required`` once whole (vLLM streams their arguments piece by piece: a client that
        joins the deltas gets the same calls)."""
        if self.spec.tool_required:
            calls = _tool_calls(self.spec, text.text) if text.finished else None
            return {"tool_calls": [
                {"id": self._new_tool_id(), "type": "function", "index": k, "function": call}
                for k, call in enumerate(calls)]} if calls else {}
        name = self.spec.tool_name
        if name is None:
            return {"content": delta}
        if index not in self.called:
            self.called.add(index)
            return {"tool_calls": [{"id": self._new_tool_id(), "type": "function", "index": 0,
                                    "function": {"name": name, "arguments": delta}}]}
        return {"tool_calls": [{"index": 0, "function": {"arguments": delta}}]} if delta else {}

    def chat_message(self, index: int, content: str) -> dict[str, Any]:
        echo = self.echoes[0] if self.echoes else ""
        message: dict[str, Any] = {"role": "assistant", "content": echo + content,
                                   "refusal": None, "annotations": None, "audio": None,
                                   "function_call": None}
        calls = _tool_calls(self.spec, content)
        if calls is not None:  # vLLM's tool parser took the text
            message["content"] = echo
            if calls:
                message["tool_calls"] = [{"id": self._new_tool_id(), "type": "function",
                                          "function": call} for call in calls]
        message["reasoning"] = None
        return message

    @staticmethod
    def _new_tool_id() -> str:
        return f"chatcmpl-tool-{uuid.uuid4().hex[:16]}"


def _tool_calls(spec: OutputSpec, content: str) -> list[dict[str, str]] | None:
    """The tool calls of a forced answer (None when the answer is text), as vLLM parses them:
    a named tool's arguments are the text; ``required`` is a JSON list of name + parameters."""
    if spec.tool_name is not None:
        return [{"name": spec.tool_name, "arguments": content}]
    if not spec.tool_required:
        return None
    try:
        calls = json.loads(content)
    except ValueError:
        return []  # cut short by max_tokens: no complete call
    return [{"name": c["name"], "arguments": json.dumps(c["parameters"], ensure_ascii=False)}
            for c in calls]

def _refused(exc: responses.ResponsesRefused) -> ApiError:
    return ApiError(exc.status, str(exc), param=exc.param, type_=exc.type_)


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
